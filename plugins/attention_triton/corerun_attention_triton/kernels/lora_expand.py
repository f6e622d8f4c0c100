"""LoRA expand: each token's shrunk row times its adapter's B, added into one slice of ``y`` (vLLM's ``lora_expand``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corerun_attention_triton.kernels.lora_rows import slot_rows
from corerun_attention_triton.kernels.rounding import round_to_bf16


@triton.jit
def lora_expand_kernel(
    buf_ptr,
    b_ptr,
    y_ptr,
    order_ptr,
    starts_ptr,
    counts_ptr,
    out_features,
    col_offset,
    rank,
    stride_bt,
    stride_bs,
    stride_bo,
    stride_br,
    stride_yt,
    stride_yc,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    FP32: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Program ``(m, s, n)``: the ``m``-th block of ``BLOCK_M`` tokens of slot ``s``, columns
    ``n * BLOCK_N ..`` of the slice.

    - ``buf_ptr``: float32 ``[T, BLOCK_R]`` (token stride given), the shrink's rows;
    - ``b_ptr``: ``[S, out_features, rank]``, this slice's B of every slot (strides given);
    - ``y_ptr``: ``[T, *]`` (strides given): ``y[t, col_offset + j] += (buf[t] @ B[s].T)[j]``, added
      in float32 and rounded once; rows of slot ``-1`` are never read or written;
    - ``order_ptr`` / ``starts_ptr`` / ``counts_ptr``: as in the shrink.

    The shrunk row is rounded to ``y``'s dtype before the product (tensor cores take half types);
    ``FP32``: float32 products as three TF32 ones (float32's accuracy on tensor cores; IEEE FMA
    products spill registers from rank 64); ``UPCAST``: the product in float32 (the interpreter's
    ``tl.dot`` is wrong on bfloat16); ``ROUND_BF16``: round to nearest even by hand (the interpreter's
    cast truncates).  Grid ``(cdiv(T, BLOCK_M), S, cdiv(out_features, BLOCK_N))``.
    """
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    pid_n = tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    rows, mask_m = slot_rows(order_ptr, starts_ptr, slot, pid_m, count, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_features
    shrunk = tl.load(buf_ptr + rows[:, None] * stride_bt + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :],
                     other=0.0)
    bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bo,
                 mask=mask_r[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]: B[s].T
    if ROUND_BF16:
        shrunk = round_to_bf16(shrunk)
    else:
        shrunk = shrunk.to(bt.dtype)  # float32: unchanged
    if UPCAST:
        delta = tl.dot(shrunk.to(tl.float32), bt.to(tl.float32))
    elif FP32:
        delta = tl.dot(shrunk, bt, input_precision="tf32x3")
    else:
        delta = tl.dot(shrunk, bt)
    y_at = y_ptr + rows[:, None] * stride_yt + (col_offset + offs_n)[None, :] * stride_yc
    mask = mask_m[:, None] & mask_n[None, :]
    total = tl.load(y_at, mask=mask, other=0.0).to(tl.float32) + delta
    if ROUND_BF16:
        tl.store(y_at, round_to_bf16(total), mask=mask)
    else:
        tl.store(y_at, total.to(y_ptr.dtype.element_ty), mask=mask)


LAUNCH = dict(BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=3)  # every launch (scripts/compile_check.py)


def lora_expand(buf: torch.Tensor, b: torch.Tensor, y: torch.Tensor, col_offset: int, order: torch.Tensor,
                starts: torch.Tensor, counts: torch.Tensor, interpret: bool) -> None:
    """``y[t, col_offset : col_offset + out] += buf[t, :R] @ b[s].T`` for every token ``t`` of a slot ``s >= 0``."""
    num_slots, out_features, rank = b.shape
    grid = (triton.cdiv(y.shape[0], LAUNCH["BLOCK_M"]), num_slots, triton.cdiv(out_features, LAUNCH["BLOCK_N"]))
    lora_expand_kernel[grid](
        buf, b, y, order, starts, counts, out_features, col_offset, rank,
        buf.stride(0), b.stride(0), b.stride(1), b.stride(2), y.stride(0), y.stride(1),
        BLOCK_R=buf.shape[1], FP32=y.dtype == torch.float32, UPCAST=interpret,
        ROUND_BF16=interpret and y.dtype == torch.bfloat16, **LAUNCH,
    )
