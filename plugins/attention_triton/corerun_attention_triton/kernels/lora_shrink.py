"""LoRA shrink: each token's input times its adapter's A, scaled (vLLM's ``lora_shrink``, one slice)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corerun_attention_triton.kernels.lora_rows import slot_rows


@triton.jit
def lora_shrink_kernel(
    x_ptr,
    a_ptr,
    buf_ptr,
    order_ptr,
    starts_ptr,
    counts_ptr,
    scalings_ptr,
    hidden,
    rank,
    stride_xt,
    stride_xh,
    stride_as,
    stride_ar,
    stride_ah,
    stride_bt,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Program ``(m, s)``: the ``m``-th block of ``BLOCK_M`` tokens of slot ``s``, all ``rank`` columns.

    - ``x_ptr``: ``[T, hidden]`` (token and feature strides given), the layer's input;
    - ``a_ptr``: ``[S, rank, hidden]``, this slice's A of every slot (strides given);
    - ``buf_ptr``: float32 ``[T, BLOCK_R]`` (token stride given): row ``t`` gets
      ``scalings[s] * x[t] @ A[s].T`` for each token ``t`` of slot ``s``; other rows are not written;
    - ``order_ptr``: int64 ``[T]``, the tokens ordered by slot (slot ``-1`` first);
    - ``starts_ptr`` / ``counts_ptr``: int64 ``[S]``, where slot ``s``'s tokens start in ``order`` and how many;
    - ``scalings_ptr``: float32 ``[S]``.

    Programs past their slot's tokens return at once, so the grid ``(cdiv(T, BLOCK_M), S)`` depends
    on shapes only (CUDA-graph safe).  ``IEEE``: float32 products without TF32; ``UPCAST``: products in
float32 (the interpreter's ``tl.dot`` is wrong on bfloat16).
    """
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    rows, mask_m = slot_rows(order_ptr, starts_ptr, slot, pid_m, count, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        mask_k = offs_k < hidden
        xt = tl.load(x_ptr + rows[:, None] * stride_xt + offs_k[None, :] * stride_xh,
                     mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        at = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ah,
                     mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_K, BLOCK_R]: A[s].T
        if UPCAST:
            acc += tl.dot(xt.to(tl.float32), at.to(tl.float32))
        elif IEEE:
            acc += tl.dot(xt, at, input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    acc *= tl.load(scalings_ptr + slot)
    tl.store(buf_ptr + rows[:, None] * stride_bt + offs_r[None, :], acc, mask=mask_m[:, None])


LAUNCH = dict(BLOCK_M=16, BLOCK_K=64, num_warps=4, num_stages=3)  # every launch (scripts/compile_check.py)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, buf: torch.Tensor, order: torch.Tensor, starts: torch.Tensor,
                counts: torch.Tensor, scalings: torch.Tensor, interpret: bool) -> None:
    """``buf[t, :R] = scalings[s] * x[t] @ a[s].T`` for every token ``t`` of a slot ``s >= 0`` (one slice)."""
    num_slots, rank, hidden = a.shape
    grid = (triton.cdiv(x.shape[0], LAUNCH["BLOCK_M"]), num_slots)
    lora_shrink_kernel[grid](
        x, a, buf, order, starts, counts, scalings, hidden, rank,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), buf.stride(0),
        BLOCK_R=buf.shape[1], IEEE=x.dtype == torch.float32, UPCAST=interpret, **LAUNCH,
    )
