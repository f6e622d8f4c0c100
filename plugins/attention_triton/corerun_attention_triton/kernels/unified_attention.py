"""Unified paged attention: prefill chunks (with a cached prefix) and decodes of one batch in one launch.

The grid is ``(num_q_blocks, num_kv_heads)``.  Each request's query tokens are cut into blocks of
``BLOCK_Q`` tokens; a program takes one such block for one KV head and packs the
``NUM_QUERIES_PER_KV`` query heads sharing that KV head into the rows of one tile
(``BLOCK_M >= BLOCK_Q * NUM_QUERIES_PER_KV`` rows: row ``m`` is token ``m // NUM_QUERIES_PER_KV``,
head ``m % NUM_QUERIES_PER_KV`` of the group), so GQA/MQA read each K/V tile once per group.
It walks the request's keys ``TILE_N`` at a time through the block table, up to the causal horizon
of its last token, with an online softmax in float32.

``num_q_blocks = num_tokens // BLOCK_Q + num_reqs`` bounds the blocks of every possible split of
``num_tokens`` into ``num_reqs`` requests, so the grid depends on host integers only; a program
finds its request by binary search over ``query_start_loc`` and exits when it has no tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from corerun_attention_triton.kernels import INTERPRET
from corerun_attention_triton.kernels.paged_tile import load_kv_tile
from corerun_attention_triton.kernels.rounding import round_to_bf16
from corerun_attention_triton.kernels.warps import decode_num_warps


@triton.jit
def _find_request(query_start_loc_ptr, req_start, num_reqs, token_start, q_block, BLOCK_Q: tl.constexpr):
    """The request in ``[req_start, num_reqs)`` whose query blocks include global block ``q_block``.

    Request ``r``'s first block is ``(query_start_loc[r] - token_start) // BLOCK_Q + (r - req_start)``.
    """
    lo = req_start
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = (tl.load(query_start_loc_ptr + mid) - token_start) // BLOCK_Q + (mid - req_start)
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["req_start", "num_reqs"])
def unified_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    req_start,
    num_reqs,
    scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
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
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """Causal attention of requests ``req_start .. num_reqs - 1`` over the paged cache.

    - ``out_ptr``: ``[num_tokens, num_heads, head_size]`` (token / head strides given, last dim contiguous).
    - ``q_ptr``: ``[num_tokens, num_heads, head_size]`` (token / head strides given, last dim contiguous).
    - ``k_cache_ptr`` / ``v_cache_ptr``: ``[num_blocks, BLOCK_SIZE, num_kv_heads, head_size]``, last dim contiguous.
    - ``query_start_loc_ptr``: int32 ``[num_reqs + 1]``; ``seq_lens_ptr``: int32 ``[num_reqs]``.
    - ``block_tables_ptr``: int32 ``[num_reqs, max_blocks_per_seq]`` (row stride ``stride_bt``);
      only entries below ``ceil(seq_len / BLOCK_SIZE)`` are read.

    Request ``r`` has ``q_len = query_start_loc[r+1] - query_start_loc[r]`` new tokens at positions
    ``seq_len - q_len ..``; token ``j`` attends to positions ``0 .. seq_len - q_len + j``.
    ``HEAD_PAD`` is ``head_size`` rounded up to a power of two (masked).  ``UPCAST`` runs both
    matrix products in float32 (the interpreter's ``tl.dot`` is wrong on bfloat16);
    ``ROUND_BF16`` rounds a bfloat16 output to nearest even by hand (the interpreter's cast truncates).
    """
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)

    token_start = tl.load(query_start_loc_ptr + req_start)
    req = _find_request(query_start_loc_ptr, req_start, num_reqs, token_start, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block - ((q_start - token_start) // BLOCK_Q + (req - req_start))
    if local_block * BLOCK_Q >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_pos = local_block * BLOCK_Q + offs_m // NUM_QUERIES_PER_KV  # token index inside the request
    head = kv_head * NUM_QUERIES_PER_KV + offs_m % NUM_QUERIES_PER_KV
    row_ok = (offs_m < BLOCK_Q * NUM_QUERIES_PER_KV) & (q_pos < q_len)
    d_ok = offs_d < HEAD_SIZE
    token = (q_start + q_pos).to(tl.int64)

    q = tl.load(
        q_ptr + token[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len
    q_abs = context_len + q_pos  # absolute position of each row's token
    kv_end = tl.minimum(context_len + (local_block + 1) * BLOCK_Q, seq_len)  # causal horizon of the tile
    block_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    qk_scale = scale * 1.4426950408889634  # softmax in base 2

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    for tile in range(0, tl.cdiv(kv_end, TILE_N)):
        pos = tile * TILE_N + offs_n
        pos_ok = pos < kv_end
        k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_row, pos, pos_ok, offs_d, d_ok, kv_head,
            stride_kc_blk, stride_kc_slot, stride_kc_head, stride_vc_blk, stride_vc_slot, stride_vc_head,
            BLOCK_SIZE, UPCAST,
        )
        s = tl.dot(q, k, input_precision="ieee") * qk_scale
        s = tl.where((pos[None, :] <= q_abs[:, None]) & pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if ROUND_BF16:
        out = round_to_bf16(out)
    tl.store(
        out_ptr + token[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


# Prefill launches are never captured in a CUDA graph, so they may autotune (compiled mode only:
# the interpreter cannot autotune).  Only warps are tuned: the grid stays a function of BLOCK_Q,
# which the plan chooses.  ``num_stages`` is not tuned: compiled for sm_90 (triton 3.6 and 3.7), stages
# 2, 3 and 4 give the same kernel (same shared memory, no asynchronous copies: the K/V tiles are
# gathered through the block table), so each extra value only added a compile and a timing run.
# The kernel only writes ``out``, so timing runs are harmless.
_PREFILL_CONFIGS = [triton.Config({}, num_warps=w, num_stages=2) for w in (4, 8)]
_PREFILL_KEY = ["NUM_QUERIES_PER_KV", "HEAD_PAD", "BLOCK_SIZE", "BLOCK_M", "TILE_N"]  # + argument dtypes
_prefill_kernel = None if INTERPRET else triton.autotune(_PREFILL_CONFIGS, key=_PREFILL_KEY)(unified_attention_kernel)


def unified_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    *,
    req_start: int,
    num_reqs: int,
    num_q_tokens: int,
    scale: float,
    block_m: int,
    block_q: int,
    tile_n: int,
    autotune: bool = False,
) -> None:
    """Attention of requests ``req_start .. num_reqs - 1`` of the batch, written into ``out``.

    ``out``/``query``: ``[num_tokens, num_heads, head_size]``; ``k_cache``/``v_cache``:
    ``[num_blocks, block_size, num_kv_heads, head_size]``; ``query_start_loc`` int32 ``[num_reqs + 1]``,
    ``seq_lens`` int32 ``[num_reqs]``, ``block_tables`` int32 ``[num_reqs, max_blocks]``.
    ``num_q_tokens`` (a host int) bounds the query tokens of those requests; it sizes the grid.
    ``block_m`` rows per tile hold ``block_q`` tokens of a group of query heads; ``tile_n`` keys per step.
    ``autotune`` picks warps / stages by measurement (compiled mode, never inside a CUDA graph).
    """
    if num_reqs <= req_start:
        return
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    grid = (num_q_tokens // block_q + (num_reqs - req_start), num_kv_heads)
    args = (
        out, query, k_cache, v_cache, query_start_loc, seq_lens, block_tables,
        req_start, num_reqs, scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
    )
    constexprs = dict(
        NUM_QUERIES_PER_KV=num_heads // num_kv_heads,
        HEAD_SIZE=head_size,
        HEAD_PAD=max(16, triton.next_power_of_2(head_size)),
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        UPCAST=INTERPRET,
        ROUND_BF16=INTERPRET and out.dtype == torch.bfloat16,
    )
    if autotune and _prefill_kernel is not None:
        _prefill_kernel[grid](*args, **constexprs)
    else:
        # decode-only batches (and the interpreter): fixed warps, a CUDA graph may capture the launch
        warps = decode_num_warps(constexprs["HEAD_PAD"])
        unified_attention_kernel[grid](*args, **constexprs, num_warps=warps, num_stages=2)
