"""W8A8 products of a step through the default model's weights: corerun-quant-cpu's call
(``kernels.int8_amx_linear`` on AMX-INT8, else ``kernels.int8_vnni_linear`` on AVX-512 VNNI: activations
quantized, multiplied and scaled in one C++ call) against the built-in ``int8_matmul.int8_linear``
(torch's quantization ops, then oneDNN's int8 GEMM on the weight packed at load with AMX, ``torch._int_mm``
with VNNI alone), one thread, bfloat16 activations, both in this one process, side by side.

    .venv/bin/python benchmarks/int8_amx_bench.py [--tokens 1 8 32 64 128 256 512] [--threads 1]

Columns: the call as it routes (on AMX, the blocked path of csrc/amx_tiles.h from ``kernels.amx_tuning()``'s
``large_tokens`` on), on AMX the same call held to the few-token loop ("few-token loop": the only one before
the tenth session; "-" on VNNI), the built-in, the built-in's time over the call's, and the call's int8 TOPS.
"""

from __future__ import annotations

import argparse
import time

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch

from corerun.quantization import int8_matmul
from corerun_quant_cpu import kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # the 120 decoder products of the default model


def _best(fn, rounds: int = 3, calls: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    assert not kernels.load(), "needs the kernel library"
    kind = "AMX" if kernels.int8_amx_available() else "VNNI" if kernels.int8_vnni_available() else None
    assert kind, "needs AMX-INT8 or AVX-512 VNNI"
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randint(-127, 128, s, generator=gen, dtype=torch.int8) for s in SHAPES]
    scales = [torch.rand(s[0], 1, generator=gen) * 0.01 + 1e-3 for s in SHAPES]
    ours = [(kernels.repack_int8(w), kernels.int8_corrections(w), sc.reshape(-1).contiguous()) for w, sc in zip(ws, scales)]
    theirs = [int8_matmul.Int8Weight(w, sc, None, int8_matmul.prepack(w, sc)) for w, sc in zip(ws, scales)]
    total = sum(r * c for r, c in SHAPES)
    print(f"{total / 1e6:.0f} MB of int8 weights per step, {args.threads} thread(s), bfloat16 activations; ms per step (best of 3)")
    print(f"{'T':>4} {kind + ' call':>10} {'few-token loop':>15} {'built-in':>10} {'ratio':>7} {'TOPS':>6}")
    routed = kernels.amx_tuning()
    for T in args.tokens:
        xs = {c: torch.randn(T, c, generator=gen).bfloat16() for c in (576, 1536)}
        outs = [torch.empty(T, r, dtype=torch.bfloat16) for r, _ in SHAPES]

        def call() -> None:
            for (r, c), (p, k, s), o in zip(SHAPES, ours, outs):
                if kind == "AMX":
                    kernels.int8_amx_linear(o, p, s, xs[c])
                else:
                    kernels.int8_vnni_linear(o, p, k, s, xs[c])

        def builtin() -> None:
            for (r, c), w in zip(SHAPES, theirs):
                w(xs[c])

        def few_token_loop() -> None:
            kernels.amx_tuning(large_tokens=1 << 30)
            try:
                call()
            finally:
                kernels.amx_tuning(**routed)

        a, b = _best(call), _best(builtin)
        old = f"{_best(few_token_loop) * 1e3:15.2f}" if kind == "AMX" else f"{'-':>15}"
        print(f"{T:>4} {a * 1e3:10.2f} {old} {b * 1e3:10.2f} {b / a:6.2f}x {2 * T * total / a / 1e12:6.2f}")

if __name__ == "__main__":
    main()
