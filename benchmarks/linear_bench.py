"""The default model's linear layers per step on CPU: plain ``F.linear`` against oneDNN-prepacked weights.

For the shapes of SmolLM2-135M (hidden 576, qkv 960, gate_up 3072, down 1536->576, 30 layers, and
the 49152-row LM head) and a few token counts, the time of one step's matmuls, in float32 and
bfloat16, plain and through :class:`corerun.models.layers.PackedWeight`, interleaved, best of
``--repeats``; in float32 also plain ``F.linear`` on the weights stored column-major, as corerun stores
them (MKL's GEMM without a transpose; what a float32 product of one row, or of ``MATMUL_MIN_ROWS`` or more,
runs).  The ratios in the same run are the result (docs/benchmarks.md).

    .venv/bin/python benchmarks/linear_bench.py --threads 1 --tokens 1,32,256,384,1024
"""

from __future__ import annotations

import argparse
import os
import time

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch
import torch.nn.functional as F

from corerun.models.layers import PackedWeight

LAYERS = 30
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down
LM_HEAD = (576, 49152)


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def parse_args(doc: str) -> argparse.Namespace:
    """``--threads`` (set on torch here), ``--tokens`` and ``--repeats``, described by ``doc``'s first line."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", default="1,32,256")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def main() -> None:
    args = parse_args(__doc__)
    print(f"torch {torch.__version__}, {args.threads} thread(s), load {os.getloadavg()[0]:.2f}; ms per step "
          f"({LAYERS} layers' linears + LM head on the last token of each of min(T, 32) sequences)")
    g = torch.Generator().manual_seed(0)
    weights = {k_n: torch.randn(k_n[1], k_n[0], generator=g) * 0.05 for k_n in SHAPES + [LM_HEAD]}
    for tokens in (int(t) for t in args.tokens.split(",")):
        row = {}
        for dtype in (torch.float32, torch.bfloat16):
            ws = {k: w.to(dtype) for k, w in weights.items()}
            packs = {k: PackedWeight() for k in ws}
            xs = {k: torch.randn(tokens if k != LM_HEAD else min(tokens, 32), k[0], generator=g).to(dtype) for k in ws}

            columns = {k: w.t().contiguous().t() for k, w in ws.items()}  # same values, strides (1, out)

            def step(how: str) -> None:
                for k, w in ws.items():
                    for _ in range(LAYERS if k != LM_HEAD else 1):
                        if how == "prepacked":
                            packs[k].linear(xs[k], w, None)
                        else:
                            F.linear(xs[k], w if how == "plain" else columns[k])

            hows = ("plain", "prepacked", "column-major") if dtype == torch.float32 else ("plain", "prepacked")
            with torch.inference_mode():
                times: dict[str, list[float]] = {how: [] for how in hows}
                for _ in range(2):  # interleaved
                    for how in hows:
                        times[how].append(best_ms(lambda: step(how), args.repeats))
            name = str(dtype).removeprefix("torch.")
            row.update({f"{name} {how}": min(t) for how, t in times.items()})
        base = row["float32 plain"]
        cells = ", ".join(f"{k} {v:.1f} ms ({base / v:.2f}x)" for k, v in row.items())
        print(f"T={tokens}: {cells}; load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
