"""Compile every kernel for a CUDA architecture, down to a cubin, on a machine without a GPU.

Triton's NVIDIA backend ships ``ptxas``, so the compiled path (the one the interpreter never runs)
can at least be type-checked and lowered here: constexpr branches, ``tl.dot`` shape rules,
loop-carried types, register allocation.  It proves nothing about speed or results on a device.

    TRITON_INTERPRET=0 python plugins/attention_triton/scripts/compile_check.py --arch 90
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "0"  # before the kernels are decorated: build JIT (compiled) functions

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from corerun_attention_triton.kernels import INTERPRET  # noqa: E402
from corerun_attention_triton.kernels.kv_write import kv_write_kernel  # noqa: E402
from corerun_attention_triton.kernels.split_kv_decode import split_kv_decode_kernel  # noqa: E402
from corerun_attention_triton.kernels.split_kv_reduce import split_kv_reduce_kernel  # noqa: E402
from corerun_attention_triton.kernels.unified_attention import unified_attention_kernel  # noqa: E402

POINTERS = {  # pointer arguments: "act" = the activation / cache dtype
    "key_ptr": "act", "value_ptr": "act", "k_cache_ptr": "act", "v_cache_ptr": "act", "q_ptr": "act",
    "out_ptr": "act", "slot_mapping_ptr": "i64", "query_start_loc_ptr": "i32", "seq_lens_ptr": "i32",
    "block_tables_ptr": "i32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32",
}


def signature(fn, constexprs: dict, dtype: str) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in POINTERS:
            sig[name] = "*" + (dtype if POINTERS[name] == "act" else POINTERS[name])
        else:
            sig[name] = "fp32" if name == "scale" else "i32"
    return sig


def configs(head_size: int, group: int) -> list[tuple]:
    """(kernel, constexprs, launch options) as the launch wrappers would pick them."""
    pad = max(16, triton.next_power_of_2(head_size))
    tile_n = 64 if pad <= 128 else 32
    rows = 64 if pad <= 128 else 32
    unified = dict(NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, HEAD_PAD=pad, BLOCK_SIZE=16, TILE_N=tile_n,
                   UPCAST=False, ROUND_BF16=False)
    return [
        (kv_write_kernel, dict(NUM_KV_HEADS=8, HEAD_SIZE=head_size, HEADS_PAD=8, HEAD_PAD=triton.next_power_of_2(head_size),
                               BLOCK_SIZE=16, BLOCK_T=1), dict(num_warps=4)),
        (unified_attention_kernel, dict(unified, BLOCK_M=16, BLOCK_Q=max(1, 16 // group)), dict(num_warps=4, num_stages=2)),
        (unified_attention_kernel, dict(unified, BLOCK_M=rows, BLOCK_Q=max(1, rows // group)), dict(num_warps=8, num_stages=3)),
        (split_kv_decode_kernel, dict(NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, HEAD_PAD=pad, BLOCK_SIZE=16,
                                      BLOCK_H=max(16, triton.next_power_of_2(group)), TILE_N=tile_n, UPCAST=False),
         dict(num_warps=4, num_stages=2)),
        (split_kv_reduce_kernel, dict(HEAD_SIZE=head_size, HEAD_PAD=pad, SPLITS_PAD=16, ROUND_BF16=False), dict(num_warps=4)),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (80 Ampere, 90 Hopper)")
    p.add_argument("--dtypes", default="fp16,bf16", help="comma-separated: fp16, bf16, fp32")
    p.add_argument("--head-sizes", default="128,80", help="comma-separated head sizes")
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    args = p.parse_args()
    if INTERPRET:
        print("kernels were built for the interpreter; run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    for dtype in args.dtypes.split(","):
        for head_size in (int(h) for h in args.head_sizes.split(",")):
            for fn, constexprs, options in configs(head_size, args.group):
                start = time.perf_counter()
                try:
                    kernel = triton.compile(ASTSource(fn, signature(fn, constexprs, dtype), constexprs), target=target,
                                            options=options)
                    status = f"ok ({kernel.metadata.shared} B shared)"
                except Exception as exc:  # report every configuration, then fail
                    failures += 1
                    status = f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                took = time.perf_counter() - start
                print(f"sm_{args.arch} {dtype} hd{head_size} {fn.__name__} {options}: {status} [{took:.1f} s]")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
