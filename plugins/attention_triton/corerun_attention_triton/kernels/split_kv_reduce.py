"""Split-KV (flash-decoding) second pass: merge each decode's per-slice results by their log-sum-exp."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corerun_attention_triton.kernels import INTERPRET
from corerun_attention_triton.kernels.rounding import round_to_bf16


@triton.jit
def split_kv_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    num_splits,
    stride_o_tok,
    stride_o_head,
    stride_po_req,
    stride_po_head,
    stride_po_split,
    stride_pl_req,
    stride_pl_head,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """One program per (decode ``program_id(0)``, query head ``program_id(1)``).

    - ``out_ptr``: ``[num_tokens, num_heads, head_size]`` (token / head strides given, last dim
      contiguous); decode ``r`` writes row ``query_start_loc[r]``.
    - ``part_out_ptr``: float32 ``[num_decodes, num_heads, num_splits, HEAD_PAD]``, normalised per slice.
    - ``part_lse_ptr``: float32 ``[num_decodes, num_heads, num_splits]``, base-2 log-sum-exp per slice,
      ``-inf`` for an empty slice.
    - ``query_start_loc_ptr``: int32 ``[>= num_decodes + 1]``.

    ``out = sum_s 2^(lse_s - max lse) * part_out_s / sum_s 2^(lse_s - max lse)``; ``SPLITS_PAD`` is
    ``num_splits`` rounded up to a power of two (masked); ``ROUND_BF16`` rounds a bfloat16 output
    to nearest even by hand (the interpreter's own cast truncates).
    """
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_SIZE

    lse = tl.load(part_lse_ptr + req * stride_pl_req + head * stride_pl_head + offs_s, mask=s_ok, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)  # 0 for empty slices
    parts = tl.load(
        part_out_ptr + req * stride_po_req + head * stride_po_head + offs_s[:, None] * stride_po_split + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0.0, total, 1.0)

    if ROUND_BF16:
        out = round_to_bf16(out)
    token = tl.load(query_start_loc_ptr + req).to(tl.int64)
    tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def split_kv_reduce(
    out: torch.Tensor,
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Merge ``split_kv_decode``'s partial results into ``out`` ``[num_tokens, num_heads, head_size]``.

    ``part_out`` float32 ``[num_decodes, num_heads, num_splits, head_pad]``, ``part_lse`` float32
    ``[num_decodes, num_heads, num_splits]``; ``query_start_loc`` int32 ``[>= num_decodes + 1]``.
    """
    num_decodes, num_heads, num_splits, head_pad = part_out.shape
    split_kv_reduce_kernel[(num_decodes, num_heads)](
        out, part_out, part_lse, query_start_loc,
        num_splits,
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        HEAD_SIZE=out.shape[2],
        HEAD_PAD=head_pad,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        ROUND_BF16=INTERPRET and out.dtype == torch.bfloat16,
        num_warps=4,
    )
