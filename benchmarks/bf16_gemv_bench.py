"""bfloat16 product of a few tokens: corerun-quant-cpu's bf16_gemv against oneDNN's prepacked linear.

One thread; ``--copies`` copies of each weight, used in turn, so that they do not sit in L2 (as in a
model's step, where 30 layers' weights pass by).  Prints GB/s of weight streamed and the ratio, both
measured in this one process, side by side.

    .venv/bin/python benchmarks/bf16_gemv_bench.py [--copies 8] [--tokens 1 2 4 8]
    .venv/bin/python benchmarks/bf16_gemv_bench.py --model --tokens 1 4 8 16 32 64 128  # all 121 of the default model's weights

With ``--model``, the column ``amx few-token`` is the AMX product held to csrc/amx_tiles.h's few-token loop (the
only one before the tenth session; ``amx`` routes many tokens through the blocked path, ``kernels.amx_tuning``).
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


def model_stream(tokens: list[int], rounds: int = 3) -> None:
    """``T`` tokens through the default model's 30 layers of weights and its LM head, each weight its own
    tensor (269 MB in bfloat16, streamed once per step as a decode step does): ms per step and GB/s of
    weights, for each instruction set the kernel runs here and for oneDNN's prepacked product."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
    ws = [torch.randn(rows, cols, generator=gen).bfloat16() for rows, cols in shapes]
    packed = [kernels.repack_bf16(w) for w in ws]
    with torch.inference_mode():
        onednn = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
    del ws
    total = sum(r * c * 2 for r, c in shapes)
    isas = [i for i in ("avx512_bf16", "amx") if kernels.BF16_ISAS[i] <= kernels.BF16_ISAS[kernels.bf16_best_isa()]]
    routed = kernels.amx_tuning()
    print(f"{total / 1e6:.0f} MB of weights per step, {torch.get_num_threads()} thread(s); ms per step (GB/s), best of {rounds}")
    print(f"{'T':>4} " + " ".join(f"{name:>18}" for name in (*isas, *(["amx few-token"] if "amx" in isas else []), "oneDNN")))
    for T in tokens:
        xs = {cols: torch.randn(T, cols, generator=gen).bfloat16() for cols in (576, 1536)}
        outs = [torch.empty(T, rows, dtype=torch.bfloat16) for rows, _ in shapes]

        def ours(isa: str) -> None:
            for (rows, cols), p, out in zip(shapes, packed, outs):
                kernels.bf16_gemv(out, p, xs[cols], isa)

        def theirs() -> None:
            with torch.inference_mode():
                for (rows, cols), d in zip(shapes, onednn):
                    torch.ops.mkldnn._linear_pointwise(xs[cols], d, None, "none", [], "")

        def few_token_loop() -> None:
            kernels.amx_tuning(large_tokens=1 << 30)
            try:
                ours("amx")
            finally:
                kernels.amx_tuning(**routed)

        arms = [(lambda isa=isa: ours(isa)) for isa in isas] + ([few_token_loop] if "amx" in isas else []) + [theirs]
        # AVX512_BF16 past 64 tokens: never routed there, and seconds a step
        best = [None if fn is not theirs and fn.__defaults__ == ("avx512_bf16",) and T > 64 else min(_time(fn, 3) for _ in range(rounds)) for fn in arms]
        print(f"{T:>4} " + " ".join(f"{'-':>18}" if t is None else f"{t * 1e3:9.2f} ({total / t / 1e9:4.1f})" for t in best))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--model", action="store_true", help="one token through the default model's weights (model_stream)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert not kernels.load(), kernels.load()
    if args.model:
        model_stream(args.tokens)
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
