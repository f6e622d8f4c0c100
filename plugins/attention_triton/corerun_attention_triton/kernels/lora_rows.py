"""The tokens of one LoRA slot a program takes, shared by the shrink and the expand."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def slot_rows(order_ptr, starts_ptr, slot, pid_m, count, BLOCK_M: tl.constexpr):
    """``(rows, mask)``: the ``pid_m``-th block of ``BLOCK_M`` of slot ``slot``'s ``count`` tokens, as
    int64 row indices of ``x`` / ``y`` (``order`` holds the tokens sorted by slot, ``starts`` where each
    slot's begin); rows past ``count`` are masked (and read as row 0)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < count
    rows = tl.load(order_ptr + tl.load(starts_ptr + slot) + offs_m, mask=mask_m, other=0).to(tl.int64)
    return rows, mask_m
