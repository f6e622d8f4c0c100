"""The default model's linear layers per step on CPU in W8A8 against float32, each way of summing the codes.

For the shapes of SmolLM2-135M (qkv 960, o 576, gate_up 3072, down 1536->576; 30 layers), the time of
one step's products at a few token counts: W8A8 through ``int8_linear`` with oneDNN's int8 GEMM (the
weight packed at load), with ``torch._int_mm``, and with the exact float codes (the fallback), against
float32 ``F.linear`` and float32 through :class:`corerun.models.layers.PackedWeight` (what a dense
model runs).  Every W8A8 time includes the activations' quantization and the scaling.  Interleaved,
best of ``--repeats``; the ratios in the same run are the result.

    .venv/bin/python benchmarks/int8_linear_bench.py --threads 1 --tokens 1,32,256
"""

from __future__ import annotations

import os

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch
import torch.nn.functional as F
from linear_bench import LAYERS, best_ms, parse_args  # benchmarks/ is the script's folder: on sys.path

from corerun.models.layers import PackedWeight
from corerun.quantization import int8_matmul
from corerun.quantization.int8_matmul import PackedInt8, int8_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down


def main() -> None:
    args = parse_args(__doc__)
    paths = int8_matmul.cpu_int8_paths()
    print(f"torch {torch.__version__}, {args.threads} thread(s), exact integer products here: {paths or 'none'}; "
          f"load {os.getloadavg()[0]:.2f}; ms per step ({LAYERS} layers' linears)")
    g = torch.Generator().manual_seed(0)
    codes = {s: torch.randint(-127, 128, s, generator=g, dtype=torch.int8) for s in SHAPES}
    scales = {s: torch.rand(s[0], 1, generator=g) * 0.01 for s in SHAPES}
    dense = {s: codes[s].float() * scales[s] for s in SHAPES}
    onednn = {s: PackedInt8.of(codes[s], scales[s]) for s in SHAPES} if "onednn" in paths else {}
    packs = {s: PackedWeight() for s in SHAPES}
    for tokens in (int(t) for t in args.tokens.split(",")):
        xs = {s: torch.randn(tokens, s[1], generator=g) for s in SHAPES}
        ways = {
            "float32": lambda s: F.linear(xs[s], dense[s]),
            "float32 prepacked": lambda s: packs[s].linear(xs[s], dense[s], None),
            "w8a8 float codes": lambda s: int8_linear(xs[s], codes[s], scales[s], None),
        }
        if "int_mm" in paths:
            ways["w8a8 _int_mm"] = lambda s: int8_linear(xs[s], codes[s], scales[s], None)
        if onednn:
            ways["w8a8 oneDNN"] = lambda s: int8_linear(xs[s], codes[s], scales[s], None, onednn[s])
        times = {name: float("inf") for name in ways}
        with torch.inference_mode():
            for _ in range(2):  # interleaved
                for name, way in ways.items():

                    def step(way=way) -> None:
                        for s in SHAPES:
                            for _ in range(LAYERS):
                                way(s)

                    with int8_matmul.only_cpu_paths([] if name == "w8a8 float codes" else paths):
                        times[name] = min(times[name], best_ms(step, args.repeats))
        base = times["float32 prepacked"]
        cells = ", ".join(f"{k} {v:.1f} ms ({base / v:.2f}x)" for k, v in times.items())
        print(f"T={tokens}: {cells}; load {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
