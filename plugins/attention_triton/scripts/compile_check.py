"""Compile every kernel for a CUDA architecture, down to a cubin, on a machine without a GPU, and
report each variant's registers and spills.

Triton's NVIDIA backend ships ``ptxas``, so the compiled path (the one the interpreter never runs)
can at least be type-checked and lowered here: constexpr branches, ``tl.dot`` shape rules,
loop-carried types, register allocation.  It proves nothing about speed or results on a device.

The variants are the ones the launchers pick: tile sizes from the backend's own plan
(``make_plan``) for a decode-only batch and a long prefill, warps from the launch rule
(``decode_num_warps``; prefill autotunes over 4 and 8 warps, both compiled).  Registers, spills and
stack come from ``ptxas -v`` run on each variant's PTX, with the flags Triton gives it.  A variant
fails when it does not compile, or when a launch the launcher fixes (everything but the prefill
autotune candidates, which are reported) spills registers to local memory.

    TRITON_INTERPRET=0 python plugins/attention_triton/scripts/compile_check.py --arch 90
    ... --head-sizes 64,128,256 --fixed-only --json report.json   # what tests/test_compile_check.py runs
    ... --decode-warps 4                                # the decode launches with another warp count
    ... --kernels lora --lora-ranks 16,64,128           # the LoRA shrink and expand (every launch fixed)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # before the kernels are decorated: build JIT (compiled) functions

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from corerun.protocols.attention import AttentionBatch  # noqa: E402
from corerun_attention_triton.kernels import INTERPRET  # noqa: E402
from corerun_attention_triton.kernels.kv_write import kv_write_kernel  # noqa: E402
from corerun_attention_triton.kernels.lora_expand import lora_expand_kernel  # noqa: E402
from corerun_attention_triton.kernels.lora_shrink import lora_shrink_kernel  # noqa: E402
from corerun_attention_triton.kernels.split_kv_decode import split_kv_decode_kernel  # noqa: E402
from corerun_attention_triton.kernels.split_kv_reduce import split_kv_reduce_kernel  # noqa: E402
from corerun_attention_triton.kernels.unified_attention import unified_attention_kernel  # noqa: E402
from corerun_attention_triton.kernels.warps import decode_num_warps  # noqa: E402
from corerun_attention_triton.metadata import make_plan  # noqa: E402

POINTERS = {  # pointer arguments: "act" = the activation / cache dtype
    "key_ptr": "act", "value_ptr": "act", "k_cache_ptr": "act", "v_cache_ptr": "act", "q_ptr": "act",
    "out_ptr": "act", "slot_mapping_ptr": "i64", "query_start_loc_ptr": "i32", "seq_lens_ptr": "i32",
    "block_tables_ptr": "i32", "part_out_ptr": "fp32", "part_lse_ptr": "fp32",
    "x_ptr": "act", "a_ptr": "act", "b_ptr": "act", "y_ptr": "act", "buf_ptr": "fp32", "order_ptr": "i64",
    "starts_ptr": "i64", "counts_ptr": "i64", "scalings_ptr": "fp32",
}
NUM_KV_HEADS = 8
BLOCK_SIZE = 16
PREFILL_LEN = 2048  # long enough for the plan's largest tile


@dataclass
class Variant:
    """One kernel compiled as a launcher would launch it; ``fixed``: the launcher always uses these
    options (not one autotune candidate among others)."""

    kernel: str
    use: str  # "decode", "prefill", "kv write", "split-KV reduce", "lora r16"
    dtype: str
    head_size: int  # the LoRA rank for the LoRA kernels
    constexprs: dict[str, Any]
    options: dict[str, int]
    fixed: bool
    ok: bool = False
    error: str | None = None
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    stack_bytes: int | None = None
    shared_bytes: int | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


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


def planned(head_size: int, group: int, query_len: int):
    """The backend's plan for one request of ``query_len`` tokens (1: a decode) on a 132-SM device."""
    i32 = torch.int32
    batch = AttentionBatch(
        query_start_loc=torch.tensor([0, query_len], dtype=i32), seq_lens=torch.tensor([PREFILL_LEN], dtype=i32),
        context_lens=torch.tensor([PREFILL_LEN - query_len], dtype=i32), block_tables=torch.zeros((1, 1), dtype=i32),
        slot_mapping=torch.zeros(query_len, dtype=torch.int64), num_reqs=1, num_tokens=query_len,
        max_query_len=query_len, max_seq_len=PREFILL_LEN, num_decodes=1 if query_len == 1 else 0,
    )
    return make_plan(batch, num_heads=group * NUM_KV_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=head_size,
                     num_sms=132, forced_splits=None, interpret=False)


def variants(head_size: int, group: int, dtype: str, decode_warps: int | None = None) -> list[Variant]:
    """Every launch the backend makes at this head size, with the constexprs its launcher passes."""
    pad = max(16, triton.next_power_of_2(head_size))
    warps = decode_warps or decode_num_warps(pad)
    decode, prefill = planned(head_size, group, 1), planned(head_size, group, PREFILL_LEN)
    unified = dict(NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, HEAD_PAD=pad, BLOCK_SIZE=BLOCK_SIZE,
                   UPCAST=False, ROUND_BF16=False)
    out = [
        Variant("kv_write_kernel", "kv write", dtype, head_size,
                dict(NUM_KV_HEADS=NUM_KV_HEADS, HEAD_SIZE=head_size, HEADS_PAD=triton.next_power_of_2(NUM_KV_HEADS),
                     HEAD_PAD=triton.next_power_of_2(head_size), BLOCK_SIZE=BLOCK_SIZE, BLOCK_T=1),
                dict(num_warps=4), fixed=True),
        Variant("unified_attention_kernel", "decode", dtype, head_size,
                dict(unified, BLOCK_M=decode.block_m, BLOCK_Q=decode.block_q, TILE_N=decode.tile_n),
                dict(num_warps=warps, num_stages=2), fixed=True),
        Variant("split_kv_decode_kernel", "decode", dtype, head_size,
                dict(NUM_QUERIES_PER_KV=group, HEAD_SIZE=head_size, HEAD_PAD=pad, BLOCK_SIZE=BLOCK_SIZE,
                     BLOCK_H=max(16, triton.next_power_of_2(group)), TILE_N=decode.tile_n, UPCAST=False),
                dict(num_warps=warps, num_stages=2), fixed=True),
        Variant("split_kv_reduce_kernel", "split-KV reduce", dtype, head_size,
                dict(HEAD_SIZE=head_size, HEAD_PAD=pad, SPLITS_PAD=16, ROUND_BF16=False), dict(num_warps=4), fixed=True),
    ]
    for prefill_warps in (4, 8):  # the autotune candidates (_PREFILL_CONFIGS)
        out.append(Variant("unified_attention_kernel", "prefill", dtype, head_size,
                           dict(unified, BLOCK_M=prefill.block_m, BLOCK_Q=prefill.block_q, TILE_N=prefill.tile_n),
                           dict(num_warps=prefill_warps, num_stages=2), fixed=False))
    return out


def lora_variants(rank: int, dtype: str) -> list[Variant]:
    """The LoRA shrink and expand at this rank, with the constexprs and options their launchers pass."""
    from corerun_attention_triton.kernels.lora_expand import LAUNCH as EXPAND
    from corerun_attention_triton.kernels.lora_shrink import LAUNCH as SHRINK

    common = dict(BLOCK_R=max(16, triton.next_power_of_2(rank)), UPCAST=False)
    shrink, expand = dict(SHRINK), dict(EXPAND)
    shrink_options = {k: shrink.pop(k) for k in ("num_warps", "num_stages")}
    expand_options = {k: expand.pop(k) for k in ("num_warps", "num_stages")}
    shrink.update(common, IEEE=dtype == "fp32")
    expand.update(common, FP32=dtype == "fp32", ROUND_BF16=False)
    return [Variant("lora_shrink_kernel", f"lora r{rank}", dtype, rank, shrink, shrink_options, fixed=True),
            Variant("lora_expand_kernel", f"lora r{rank}", dtype, rank, expand, expand_options, fixed=True)]


KERNELS = {fn.__name__: fn for fn in (kv_write_kernel, unified_attention_kernel, split_kv_decode_kernel, split_kv_reduce_kernel,
                                      lora_shrink_kernel, lora_expand_kernel)}


def ptxas_path(arch: int) -> str | None:
    """The ``ptxas`` Triton compiles with (its bundled one unless ``TRITON_PTXAS_PATH`` says otherwise)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path
    except Exception:  # an older Triton, or no NVIDIA backend: the one on PATH, if any
        return shutil.which("ptxas")


def register_use(ptxas: str, ptx: str, arch: str) -> dict[str, int]:
    """``ptxas -v`` on ``ptx``: registers, spill stores / loads and stack frame, in bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", src, "-o", os.path.join(tmp, "k.o")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 and "regAllocOptLevel" in proc.stderr:  # a ptxas without that option
            cmd.remove("--regAllocOptLevel=2")
            proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas -v failed ({proc.returncode}): {log.strip()[-500:]}")

    def number(pattern: str) -> int:
        m = re.search(pattern, log)
        if m is None:
            raise RuntimeError(f"no {pattern!r} in the ptxas -v output: {log.strip()[-500:]}")
        return int(m.group(1))

    return dict(registers=number(r"Used (\d+) registers"), spill_stores=number(r"(\d+) bytes spill stores"),
                spill_loads=number(r"(\d+) bytes spill loads"), stack_bytes=number(r"(\d+) bytes stack frame"))


def compile_variant(v: Variant, target: GPUTarget, ptxas: str) -> None:
    fn = KERNELS[v.kernel]
    start = time.perf_counter()
    try:
        kernel = triton.compile(ASTSource(fn, signature(fn, v.constexprs, v.dtype), v.constexprs), target=target,
                                options=v.options)
        v.shared_bytes = kernel.metadata.shared
        arch = f"sm_{target.arch}a" if target.arch >= 90 else f"sm_{target.arch}"
        for key, value in register_use(ptxas, kernel.asm["ptx"], arch).items():
            setattr(v, key, value)
        spilled = v.spill_stores + v.spill_loads
        v.ok = not (spilled and v.fixed)
        if spilled:
            v.notes.append(f"spills {v.spill_stores} B stored / {v.spill_loads} B loaded"
                           + ("" if v.fixed else " (an autotune candidate: reported, not failed)"))
    except Exception as exc:  # report every variant, then fail
        first = str(exc).splitlines()[0] if str(exc) else ""
        v.error = f"{type(exc).__name__}: {first}"
    v.seconds = round(time.perf_counter() - start, 2)


def line(v: Variant, arch: int) -> str:
    size = "" if v.kernel.startswith("lora") else f" hd{v.head_size}"  # a LoRA variant's use names its rank
    head = f"sm_{arch} {v.dtype}{size} {v.kernel} {v.use} {v.options}"
    if v.error:
        return f"{head}: FAILED: {v.error} [{v.seconds:.1f} s]"
    status = "ok" if v.ok else "FAILED"
    spills = f"{v.spill_stores + v.spill_loads} B spilled"
    body = f"{v.registers} registers, {spills}, {v.stack_bytes} B stack, {v.shared_bytes} B shared"
    notes = "".join(f"; {n}" for n in v.notes)
    return f"{head}: {status}: {body}{notes} [{v.seconds:.1f} s]"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (80 Ampere, 90 Hopper)")
    p.add_argument("--dtypes", default="fp16,bf16", help="comma-separated: fp16, bf16, fp32")
    p.add_argument("--head-sizes", default="64,80,128,256", help="comma-separated head sizes")
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--fixed-only", action="store_true", help="only the launches the launchers fix (no autotune candidates)")
    p.add_argument("--decode-warps", type=int, help="compile the decode launches with this many warps instead of the rule's")
    p.add_argument("--kernels", default="attention,lora", help="comma-separated: attention, lora")
    p.add_argument("--lora-ranks", default="16,64,128", help="comma-separated LoRA ranks (max_lora_rank)")
    p.add_argument("--json", help="also write every variant's figures to this file")
    args = p.parse_args()
    if INTERPRET:
        print("kernels were built for the interpreter; run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    ptxas = ptxas_path(args.arch)
    if not ptxas or not os.path.exists(ptxas):
        print(f"no ptxas for sm_{args.arch} (Triton's NVIDIA backend ships one; got {ptxas!r})", file=sys.stderr)
        return 3
    target = GPUTarget("cuda", args.arch, 32)
    done: list[Variant] = []
    kinds = args.kernels.split(",")
    for dtype in args.dtypes.split(","):
        planned_variants = []
        if "attention" in kinds:
            for head_size in (int(h) for h in args.head_sizes.split(",")):
                planned_variants += variants(head_size, args.group, dtype, args.decode_warps)
        if "lora" in kinds:
            for rank in (int(r) for r in args.lora_ranks.split(",")):
                planned_variants += lora_variants(rank, dtype)
        for v in planned_variants:
            if args.fixed_only and not v.fixed:
                continue
            compile_variant(v, target, ptxas)
            print(line(v, args.arch), flush=True)
            done.append(v)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "triton": triton.__version__, "ptxas": ptxas,
                       "variants": [asdict(v) for v in done]}, f, indent=2)
    failed = [v for v in done if not v.ok]
    print(f"{len(done) - len(failed)}/{len(done)} variants ok" + (f"; {len(failed)} failed" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
