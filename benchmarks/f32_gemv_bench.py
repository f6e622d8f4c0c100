"""float32 product of a few tokens through the default model's weights: corerun-quant-cpu's f32_gemv against
oneDNN's prepacked linear and ``F.linear`` on the column-major weight (what the built-in ``none`` multiplies one
row with; oneDNN's pack from two rows).

The default model's 30 layers of weights and its LM head, each weight its own tensor (538 MB in float32,
streamed once per step as a decode step does): ms per step and GB/s of weights for each, best of three, all
measured in this one process, side by side.

    .venv/bin/python benchmarks/f32_gemv_bench.py [--threads 2] [--tokens 1 2 4 8 12 16]
"""

from __future__ import annotations

import argparse

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch
import torch.nn.functional as F

from corerun_quant_cpu import kernels
from linear_bench import LAYERS, LM_HEAD, SHAPES as LAYER_SHAPES, best_ms  # benchmarks/ is the script's folder: on sys.path

SHAPES = [(out, inp) for inp, out in LAYER_SHAPES] * LAYERS + [LM_HEAD[::-1]]  # (rows, cols) of each weight in turn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert not kernels.load(), kernels.load()
    isa = kernels.f32_best_isa()
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(rows, cols, generator=gen) for rows, cols in SHAPES]
    packed = [kernels.repack_f32(w) for w in ws]
    with torch.inference_mode():
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
    column_major = [w.t().contiguous().t() for w in ws]
    del ws
    total = sum(r * c * 4 for r, c in SHAPES)
    print(f"{total / 1e6:.0f} MB of weights per step, {args.threads} thread(s), kernel isa {isa}; ms per step (GB/s), best of 3")
    print(f"{'T':>4} {'f32_gemv':>16} {'oneDNN':>16} {'F.linear':>16}")
    for T in args.tokens:
        xs = {cols: torch.randn(T, cols, generator=gen) for cols in (576, 1536)}
        outs = [torch.empty(T, rows) for rows, _ in SHAPES]

        def ours() -> None:
            for (rows, cols), p, out in zip(SHAPES, packed, outs):
                kernels.f32_gemv(out, p, xs[cols], isa)

        def theirs() -> None:
            with torch.inference_mode():
                for (rows, cols), d in zip(SHAPES, onednn):
                    torch.ops.mkldnn._linear_pointwise(xs[cols], d, None, "none", [], "")

        def plain() -> None:
            with torch.inference_mode():
                for (rows, cols), w in zip(SHAPES, column_major):
                    F.linear(xs[cols], w)

        times = [best_ms(fn, 3) for fn in (ours, theirs, plain)]
        print(f"{T:>4} " + " ".join(f"{ms:8.2f} ({total / ms / 1e6:4.1f})" for ms in times))


if __name__ == "__main__":
    main()
