"""Split-KV (flash-decoding) first pass: each program attends one decode over one slice of its keys.

The grid is ``(num_decodes, num_kv_heads, num_splits)``.  A decode's keys are cut into
``num_splits`` slices of whole ``TILE_N`` tiles, sized from its own ``seq_len`` at run time; a slice
past the end is empty and records ``lse = -inf``.  ``split_kv_reduce`` then merges the slices.
Everything the launch needs (grid, workspace shapes) comes from host integers, so a CUDA graph
captured once replays correctly for any sequence lengths up to the bound it was captured with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corerun_attention_triton.kernels import INTERPRET
from corerun_attention_triton.kernels.paged_tile import load_kv_tile
from corerun_attention_triton.kernels.warps import decode_num_warps


@triton.jit
def split_kv_decode_kernel(
    part_out_ptr,
    part_lse_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    scale,
    stride_q_tok,
    stride_q_head,
    stride_po_req,
    stride_po_head,
    stride_po_split,
    stride_pl_req,
    stride_pl_head,
    stride_kc_blk,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_blk,
    stride_vc_slot,
    stride_vc_head,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Partial attention of decode ``program_id(0)``, KV head ``program_id(1)``, slice ``program_id(2)``.

    - ``part_out_ptr``: float32 ``[num_decodes, num_heads, num_splits, HEAD_PAD]``: the slice's
      normalised output (zeros for an empty slice).
    - ``part_lse_ptr``: float32 ``[num_decodes, num_heads, num_splits]``: the slice's log-sum-exp of
      the scaled scores in base 2 (``-inf`` for an empty slice).
    - ``q_ptr``: ``[num_tokens, num_heads, head_size]``; decode ``r`` is token ``query_start_loc[r]``.
    - ``k_cache_ptr`` / ``v_cache_ptr``: ``[num_blocks, BLOCK_SIZE, num_kv_heads, head_size]``, last dim contiguous.
    - ``query_start_loc_ptr`` int32 ``[>= num_decodes + 1]``, ``seq_lens_ptr`` int32 ``[>= num_decodes]``,
      ``block_tables_ptr`` int32 ``[>= num_decodes, max_blocks_per_seq]`` (row stride ``stride_bt``).

    A decode attends to every position ``0 .. seq_len - 1`` (its own token was written there first).
    ``BLOCK_H >= NUM_QUERIES_PER_KV`` rows hold the query heads sharing the KV head.
    """
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    token = tl.load(query_start_loc_ptr + req).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + req)
    num_tiles = tl.cdiv(seq_len, TILE_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, TILE_N)
    head = kv_head * NUM_QUERIES_PER_KV + offs_h
    h_ok = offs_h < NUM_QUERIES_PER_KV
    d_ok = offs_d < HEAD_SIZE
    q = tl.load(
        q_ptr + token * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    block_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    qk_scale = scale * 1.4426950408889634  # softmax in base 2

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_PAD], tl.float32)
    for tile in range(tile_begin, tile_end):
        pos = tile * TILE_N + offs_n
        pos_ok = pos < seq_len
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_row, pos, pos_ok, offs_d, d_ok, kv_head,
            stride_kc_blk, stride_kc_slot, stride_kc_head, stride_vc_blk, stride_vc_slot, stride_vc_head,
            BLOCK_SIZE, UPCAST,
        )
        s = tl.dot(q, k, input_precision="ieee") * qk_scale
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    row = req.to(tl.int64) * stride_po_req + head * stride_po_head + split * stride_po_split
    tl.store(part_out_ptr + row[:, None] + offs_d[None, :], out, mask=h_ok[:, None])
    tl.store(part_lse_ptr + req.to(tl.int64) * stride_pl_req + head * stride_pl_head + split, lse, mask=h_ok)


def split_kv_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    num_decodes: int,
    num_splits: int,
    scale: float,
    tile_n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial results of the first ``num_decodes`` requests (each one token), ``num_splits`` slices each.

    ``query``: ``[num_tokens, num_heads, head_size]``; ``k_cache``/``v_cache``:
    ``[num_blocks, block_size, num_kv_heads, head_size]``; batch tensors as in ``AttentionBatch``.
    Returns ``(part_out, part_lse)``: float32 ``[num_decodes, num_heads, num_splits, head_pad]`` and
    ``[num_decodes, num_heads, num_splits]``, freshly allocated (inside a CUDA-graph capture they come
    from the graph's own memory pool, so a replay finds them).
    """
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    head_pad = max(16, triton.next_power_of_2(head_size))
    part_out = torch.empty((num_decodes, num_heads, num_splits, head_pad), dtype=torch.float32, device=query.device)
    part_lse = torch.empty((num_decodes, num_heads, num_splits), dtype=torch.float32, device=query.device)
    split_kv_decode_kernel[(num_decodes, num_kv_heads, num_splits)](
        part_out, part_lse, query, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
        scale,
        query.stride(0), query.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=group,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        TILE_N=tile_n,
        UPCAST=INTERPRET,
        num_warps=decode_num_warps(head_pad),
        num_stages=2,
    )
    return part_out, part_lse
