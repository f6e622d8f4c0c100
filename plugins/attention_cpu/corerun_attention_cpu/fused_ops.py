"""The ``cpu`` fused ops: RMSNorm (alone and after the residual add), SiLU-and-mul and the rotary embedding as one C++ pass each
(``csrc/fused_ops.cpp``), float32 math rounded once to the input's dtype, on ``torch.get_num_threads()``
threads for large inputs.

Each method checks the layout it was given (a few attribute reads), allocates the contiguous output
and calls the kernel: a decode step calls them about 120 times, so nothing else happens per call.
What the kernels do not take (another dtype or device, a last dimension that is not contiguous, more
than two strided leading dimensions) raises ``ValueError`` saying so; nothing falls back silently.
"""

from __future__ import annotations

import ctypes
from typing import Callable, ClassVar

import torch

from corerun.protocols.replay import native
from corerun.sdk import FusedOpsCapabilities
from corerun_attention_cpu import kernels
from corerun_attention_cpu.capabilities import FUSED_OPS_CAPABILITIES

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # enum DType in csrc/fused_ops.cpp


def _dtype_code(op: str, x: torch.Tensor) -> int:
    code = DTYPE_CODES.get(x.dtype)
    if code is None or not x.is_cpu:
        raise ValueError(
            f"cpu fused ops: {op} takes float32 or bfloat16 tensors on the CPU, got {x.dtype} on {x.device}; "
            "select fused_ops: torch for it"
        )
    return code


def _leading(shape: torch.Size, strides: tuple[int, ...]) -> tuple[int, int, int, int]:
    """The leading dimensions of ``x`` ``[..., H]`` as at most two (count, stride) pairs: ``(n0, s0, n1, s1)``,
    row ``i * n1 + j`` at ``i * s0 + j * s1``.  Dimensions that lie one after the other in memory merge."""
    groups: list[list[int]] = []  # [count, stride], innermost first
    for size, stride in zip(reversed(shape[:-1]), reversed(strides[:-1])):
        if size == 1:
            continue
        if groups and stride == groups[-1][0] * groups[-1][1]:
            groups[-1][0] *= size
        else:
            groups.append([size, stride])
    if len(groups) > 2:
        raise ValueError(
            f"cpu fused ops: rms_norm takes at most two strided leading dimensions, got shape {tuple(shape)} "
            f"with strides {strides}; pass a view whose leading dimensions merge into two"
        )
    while len(groups) < 2:
        groups.append([1, 0])
    (n1, s1), (n0, s0) = groups
    return n0, s0, n1, s1


def _refused(op: str, shape: torch.Size) -> Callable[[int], None]:
    """The check of a kernel's return code (:func:`~corerun.protocols.replay.native`): nonzero raises."""

    def check(rc: int) -> None:
        raise ValueError(f"cpu fused ops: the {op} kernel refused shape {tuple(shape)} (error {rc})")

    return check


class CpuFusedOps:
    """``factory(**options)`` (no options): RMSNorm, SiLU-and-mul and RoPE through the C++ kernels."""

    name: ClassVar[str] = "cpu"
    capabilities: FusedOpsCapabilities = FUSED_OPS_CAPABILITIES  # cpu; float32, bfloat16

    def __init__(self) -> None:
        lib, reasons = kernels.load()
        if lib is None:
            raise RuntimeError("cpu fused ops: the kernel library is not available: " + "; ".join(reasons))
        self._rms_norm = lib.corerun_cpu_rms_norm
        self._silu_and_mul = lib.corerun_cpu_silu_and_mul
        self._rotary = lib.corerun_cpu_rotary
        self._add_rms_norm = lib.corerun_cpu_add_rms_norm  # declared here: kernels.py declares the others
        i64, vp = ctypes.c_int64, ctypes.c_void_p
        self._add_rms_norm.restype = ctypes.c_int
        self._add_rms_norm.argtypes = [ctypes.c_int, vp, i64, vp, i64, i64, i64, vp, ctypes.c_float, vp, vp, ctypes.c_int]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``x`` ``[..., H]`` (last dimension contiguous), ``weight`` ``[H]`` of ``x``'s dtype -> contiguous
        ``[..., H]``: ``x / sqrt(mean(x**2, -1) + eps) * weight``."""
        code = _dtype_code("rms_norm", x)
        hidden = x.shape[-1]
        if x.stride(-1) != 1 or weight.dtype != x.dtype or weight.shape != (hidden,) or not weight.is_contiguous():
            raise ValueError(
                f"cpu fused ops: rms_norm takes x [..., H] with a contiguous last dimension and a contiguous weight "
                f"[H] of x's dtype, got x {tuple(x.shape)} strides {x.stride()} {x.dtype}, weight "
                f"{tuple(weight.shape)} {weight.dtype}"
            )
        if x.dim() == 2:  # the hidden states: the common case, without the merging loop
            n0, s0, n1, s1 = x.shape[0], x.stride(0), 1, 0
        else:
            n0, s0, n1, s1 = _leading(x.shape, x.stride())
        out = torch.empty_like(x, memory_format=torch.contiguous_format)  # 0.8 us, torch.empty 1.8
        native(self._rms_norm, code, x.data_ptr(), n0, s0, n1, s1, hidden, weight.data_ptr(), eps, out.data_ptr(),
               torch.get_num_threads(), check=_refused("rms_norm", x.shape), threads_at=-1)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``, ``residual`` ``[T, H]`` of one dtype (rows may be strided, last dimension contiguous), ``weight``
        ``[H]`` of that dtype -> ``(normed, new_residual)``, contiguous ``[T, H]``: ``new_residual = x + residual``
        rounded once, ``normed`` its RMSNorm."""
        code = _dtype_code("add_rms_norm", x)
        hidden = x.shape[-1]
        if (x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype or x.stride(1) != 1
                or residual.stride(1) != 1 or weight.dtype != x.dtype or weight.shape != (hidden,)
                or not weight.is_contiguous() or not residual.is_cpu):
            raise ValueError(
                f"cpu fused ops: add_rms_norm takes x and residual [T, H] of one dtype with contiguous last dimensions "
                f"and a contiguous weight [H] of that dtype, got x {tuple(x.shape)} strides {x.stride()} {x.dtype}, "
                f"residual {tuple(residual.shape)} strides {residual.stride()} {residual.dtype} on {residual.device}, "
                f"weight {tuple(weight.shape)} {weight.dtype}"
            )
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
        native(
            self._add_rms_norm, code, x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), x.shape[0],
            hidden, weight.data_ptr(), eps, out.data_ptr(), new_residual.data_ptr(), torch.get_num_threads(),
            check=_refused("add_rms_norm", x.shape), threads_at=-1,
        )
        return out, new_residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, 2I]`` (rows may be strided, last dimension contiguous) -> contiguous ``[T, I]``:
        ``silu(x[:, :I]) * x[:, I:]``."""
        code = _dtype_code("silu_and_mul", x)
        if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
            raise ValueError(
                f"cpu fused ops: silu_and_mul takes x [T, 2I] with a contiguous last dimension, got shape "
                f"{tuple(x.shape)} strides {x.stride()}"
            )
        tokens, inter = x.shape[0], x.shape[1] // 2
        out = torch.empty((tokens, inter), dtype=x.dtype)
        native(self._silu_and_mul, code, x.data_ptr(), tokens, x.stride(0), inter, out.data_ptr(), torch.get_num_threads(),
               check=_refused("silu_and_mul", x.shape), threads_at=-1)
        return out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H, D]`` (last dimension contiguous; tokens and heads may be strided), ``cos`` = ``[c | c]``,
        ``sin`` = ``[-s | s]`` contiguous float32 ``[T, 1, D]`` -> contiguous ``[T, H, D]``:
        ``[x1 c - x2 s | x2 c + x1 s]`` for ``x = [x1 | x2]``."""
        code = _dtype_code("rotary", x)
        if x.dim() != 3 or x.shape[2] % 2 or x.stride(2) != 1:
            raise ValueError(
                f"cpu fused ops: rotary takes x [T, H, D] with an even, contiguous last dimension, got shape "
                f"{tuple(x.shape)} strides {x.stride()}"
            )
        tokens, heads, dim = x.shape
        for t in (cos, sin):
            if t.dtype != torch.float32 or t.shape != (tokens, 1, dim) or not t.is_contiguous() or not t.is_cpu:
                raise ValueError(
                    f"cpu fused ops: rotary takes cos and sin as contiguous float32 [T, 1, D] = {[tokens, 1, dim]} "
                    f"on the CPU, got {tuple(t.shape)} {t.dtype} strides {t.stride()} on {t.device}"
                )
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        native(
            self._rotary, code, x.data_ptr(), tokens, heads, dim, x.stride(0), x.stride(1),
            cos.data_ptr(), sin.data_ptr(), out.data_ptr(), torch.get_num_threads(), check=_refused("rotary", x.shape), threads_at=-1,
        )
        return out
