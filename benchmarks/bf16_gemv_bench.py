"""bfloat16 product of a few tokens: corerun-quant-cpu's bf16_gemv against oneDNN's prepacked linear.

One thread; ``--copies`` copies of each weight, used in turn, so that they do not sit in L2 (as in a
model's step, where 30 layers' weights pass by).  Prints GB/s of weight streamed and the ratio, both
measured in this one process, side by side.

    .venv/bin/python benchmarks/bf16_gemv_bench.py [--copies 8] [--tokens 1 2 4 8]
    .venv/bin/python benchmarks/bf16_gemv_bench.py --model     # one token through all 121 of the default model's weights
"""

from __future__ import annotations

import argparse
import time

import torch

from corerun_quant_cpu import kernels

SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)]


def _time(fn, calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def model_stream(rounds: int = 5) -> None:
    """One token through the default model's 30 layers of weights and its LM head, each weight its own
    tensor (269 MB in bfloat16, streamed once per token as a decode step does): ms per token and GB/s."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    ws = [torch.randn(rows, cols, generator=gen).bfloat16() for rows, cols in shapes]
    packed = [kernels.repack_bf16(w) for w in ws]
    with torch.inference_mode():
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
    del ws
    xs = {cols: torch.randn(1, cols, generator=gen).bfloat16() for cols in (576, 1536)}
    outs = [torch.empty(1, rows, dtype=torch.bfloat16) for rows, _ in shapes]
    isa, total = kernels.bf16_best_isa(), sum(r * c * 2 for r, c in shapes)

    def ours() -> None:
        for (rows, cols), p, out in zip(shapes, packed, outs):
            kernels.bf16_gemv(out, p, xs[cols], isa)

    def theirs() -> None:
        with torch.inference_mode():
            for (rows, cols), d in zip(shapes, onednn):
                torch.ops.mkldnn._linear_pointwise(xs[cols], d, None, "none", [], "")

    for _ in range(rounds):
        a, b = _time(ours, 5), _time(theirs, 5)
        print(f"{total / 1e6:.0f} MB per token: kernel {a * 1e3:.2f} ms ({total / a / 1e9:.1f} GB/s), "
              f"oneDNN {b * 1e3:.2f} ms ({total / b / 1e9:.1f} GB/s), kernel/oneDNN {a / b:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--model", action="store_true", help="one token through the default model's weights (model_stream)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    assert not kernels.load(), kernels.load()
    if args.model:
        model_stream()
        return
    isa = kernels.bf16_best_isa()
    gen = torch.Generator().manual_seed(0)
    print(f"isa {isa}, 1 thread, {args.copies} copies of each weight")
    print(f"{'layer':>8} {'T':>2} {'kernel GB/s':>12} {'oneDNN GB/s':>12} {'kernel/oneDNN time':>19}")
    for name, rows, cols in SHAPES:
        copies = args.copies if name != "lm_head" else 2
        ws = [torch.randn(rows, cols, generator=gen).bfloat16() for _ in range(copies)]
        packed = [kernels.repack_bf16(w) for w in ws]
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
        for T in args.tokens:
            x = torch.randn(T, cols, generator=gen).bfloat16()
            out = torch.empty(T, rows, dtype=torch.bfloat16)
            state = {"i": 0}

            def ours() -> None:
                state["i"] = (state["i"] + 1) % copies
                kernels.bf16_gemv(out, packed[state["i"]], x, isa)

            def theirs() -> None:
                state["i"] = (state["i"] + 1) % copies
                torch.ops.mkldnn._linear_pointwise(x, onednn[state["i"]], None, "none", [], "")

            calls = max(4, args.calls if name != "lm_head" else args.calls // 8)
            a, b = _time(ours, calls), _time(theirs, calls)
            a, b = min(a, _time(ours, calls)), min(b, _time(theirs, calls))
            gb = rows * cols * 2 / 1e9
            print(f"{name:>8} {T:>2} {gb / a:12.1f} {gb / b:12.1f} {a / b:19.2f}")


if __name__ == "__main__":
    main()
