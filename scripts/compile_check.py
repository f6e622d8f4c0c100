"""Compile corerun's own Triton kernels (the mixture-of-experts experts kernel, corerun/models/moe_triton.py, and
the integer-weight GEMM, corerun/quantization/int_gemm_triton.py: W4A16 and W8A16) for a CUDA architecture down to
a cubin, without a GPU, and report registers and spills per launch.

It proves the compiled path (the one Triton's interpreter never runs) type-checks, lowers and does not
spill; nothing about speed or results on a device.  The ``ptxas`` handling is the attention plugin's
(plugins/attention_triton/scripts/compile_check.py), which compiles that plugin's kernels.

    TRITON_INTERPRET=0 python scripts/compile_check.py --arch 90 [--dtypes fp16,bf16,fp32] [--json report.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before the kernel is decorated: a compiled JIT function

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from corerun.models import moe_triton  # noqa: E402
from corerun.quantization import int_gemm_triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POINTERS = {  # each kernel's pointer arguments: "act" is the launch's dtype
    "experts_kernel": {"a_ptr": "act", "w_ptr": "act", "out_ptr": "act", "order_ptr": "i64", "starts_ptr": "i64",
                       "counts_ptr": "i64", "scale_ptr": "fp32"},
    "int_gemm_kernel": {"x_ptr": "act", "w_ptr": "i32", "s_ptr": "fp32", "c_ptr": "fp32", "out_ptr": "act"},
}
KERNELS = {"experts_kernel": (moe_triton.experts_kernel, moe_triton.NUM_WARPS),
           "int_gemm_kernel": (int_gemm_triton.int_gemm_kernel, int_gemm_triton.NUM_WARPS)}


@dataclass
class Launch:
    use: str  # "gate_up" or "down" (experts_kernel), "w4" or "w8" (int_gemm_kernel)
    dtype: str
    constexprs: dict
    kernel: str = "experts_kernel"
    ok: bool = False
    error: str | None = None
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0


def _ptxas_tools():
    """``(ptxas_path, register_use)`` from the attention plugin's compile check."""
    path = ROOT / "plugins" / "attention_triton" / "scripts" / "compile_check.py"
    spec = importlib.util.spec_from_file_location("attention_compile_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.ptxas_path, module.register_use


def launches(dtype: str) -> list[Launch]:
    """The two launches :func:`corerun.models.moe_triton.triton_experts` makes, with its constexprs."""
    block_n = moe_triton.BLOCK_N_FP32 if dtype == "fp32" else moe_triton.BLOCK_N
    common = dict(BLOCK_M=moe_triton.BLOCK_M, BLOCK_N=block_n, BLOCK_K=moe_triton.BLOCK_K,
                  UPCAST=dtype == "fp32")
    gemm = dict(BLOCK_M=int_gemm_triton.BLOCK_M, BLOCK_N=int_gemm_triton.BLOCK_N_FP32 if dtype == "fp32" else int_gemm_triton.BLOCK_N,
                BLOCK_K=int_gemm_triton.BLOCK_K, UPCAST=dtype == "fp32", EMULATE=False, GROUP=128)
    return [Launch("gate_up", dtype, dict(common, A_ROW_DIV=2, GATED=True, SCALED=False)),
            Launch("down", dtype, dict(common, A_ROW_DIV=1, GATED=False, SCALED=True)),
            *(Launch(f"w{bits}", dtype, dict(gemm, BITS=bits), "int_gemm_kernel") for bits in (4, 8))]


def compile_launch(launch: Launch, target: GPUTarget, ptxas: str, register_use) -> None:
    fn, warps = KERNELS[launch.kernel]
    pointers = POINTERS[launch.kernel]
    sig = {name: ("constexpr" if name in launch.constexprs
                  else "*" + (launch.dtype if pointers[name] == "act" else pointers[name]) if name in pointers else "i32")
           for name in fn.arg_names}
    start = time.perf_counter()
    try:
        kernel = triton.compile(ASTSource(fn, sig, launch.constexprs), target=target, options=dict(num_warps=warps))
        arch = f"sm_{target.arch}a" if target.arch >= 90 else f"sm_{target.arch}"
        launch.figures = dict(register_use(ptxas, kernel.asm["ptx"], arch), shared_bytes=kernel.metadata.shared)
        launch.ok = launch.figures["spill_stores"] + launch.figures["spill_loads"] == 0
    except Exception as exc:  # report every launch, then fail
        launch.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    launch.seconds = round(time.perf_counter() - start, 2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (80 Ampere, 90 Hopper)")
    p.add_argument("--dtypes", default="fp16,bf16,fp32", help="comma-separated: fp16, bf16, fp32")
    p.add_argument("--json", help="also write every launch's figures to this file")
    args = p.parse_args()
    if moe_triton.INTERPRET or int_gemm_triton.INTERPRET:
        print("the kernel was built for the interpreter; run with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    ptxas_path, register_use = _ptxas_tools()
    ptxas = ptxas_path(args.arch)
    if not ptxas or not os.path.exists(ptxas):
        print(f"no ptxas for sm_{args.arch} (Triton's NVIDIA backend ships one; got {ptxas!r})", file=sys.stderr)
        return 3
    target = GPUTarget("cuda", args.arch, 32)
    done = []
    for dtype in args.dtypes.split(","):
        for launch in launches(dtype):
            compile_launch(launch, target, ptxas, register_use)
            state = launch.error or ("ok" if launch.ok else "FAILED (spills)")
            print(f"sm_{args.arch} {dtype} {launch.kernel} {launch.use}: {state} {launch.figures} [{launch.seconds:.1f} s]")
            done.append(launch)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(launch) for launch in done], indent=1))
    failed = [launch for launch in done if not launch.ok]
    print(f"{len(done) - len(failed)} of {len(done)} launches compiled for sm_{args.arch} without spills")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
