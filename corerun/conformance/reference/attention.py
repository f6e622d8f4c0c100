"""float64 paged attention, the slow obvious way: per request, per query token, per head.

Reads K/V through the block table, one position at a time, exactly as the protocol defines it
(``corerun/protocols/attention.py``): query token ``j`` of request ``i`` sits at position
``context_lens[i] + j`` and attends to positions ``0 .. context_lens[i] + j`` of its own sequence.
"""

from __future__ import annotations

from typing import Sequence

import torch


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: Sequence[Sequence[int]],
    context_lens: Sequence[int],
    query_lens: Sequence[int],
    scale: float,
    window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of every real query token over its sequence in the (already written) paged cache.

    ``query`` ``[num_tokens, num_heads, head_size]`` (requests back to back, in order);
    ``k_cache`` / ``v_cache`` float64 ``[num_blocks, block_size, num_kv_heads, head_size]`` holding
    every position of every sequence, this step's tokens included.  ``window``: a query at position
    ``p`` sees only positions ``p - window + 1 .. p``; ``soft_cap``: scores become
    ``soft_cap * tanh(score / soft_cap)`` before the softmax.  Returns float64
    ``[sum(query_lens), num_heads, head_size]``.
    """
    q64 = query.detach().to("cpu", torch.float64)
    kc, vc = k_cache.to("cpu", torch.float64), v_cache.to("cpu", torch.float64)
    num_heads, head_size = q64.shape[1], q64.shape[2]
    num_kv_heads, block_size = kc.shape[2], kc.shape[1]
    kv_head_of = torch.arange(num_heads) // (num_heads // num_kv_heads)  # query head -> its KV head
    out = torch.empty(sum(query_lens), num_heads, head_size, dtype=torch.float64)
    row = 0
    for table, ctx, qlen in zip(block_tables, context_lens, query_lens):
        seq_len = ctx + qlen
        # position p of this sequence lives in block table[p // block_size], offset p % block_size
        keys = torch.stack([kc[table[p // block_size], p % block_size] for p in range(seq_len)])  # [L, Hkv, D]
        values = torch.stack([vc[table[p // block_size], p % block_size] for p in range(seq_len)])
        keys, values = keys[:, kv_head_of], values[:, kv_head_of]  # [L, H, D]
        for j in range(qlen):
            visible = ctx + j + 1  # causal: positions 0 .. ctx + j
            first = 0 if window is None else max(0, visible - window)  # sliding: the last `window` of them
            scores = torch.einsum("lhd,hd->hl", keys[first:visible], q64[row]) * scale  # [H, visible - first]
            if soft_cap is not None:
                scores = soft_cap * torch.tanh(scores / soft_cap)
            weights = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            out[row] = torch.einsum("hl,lhd->hd", weights, values[first:visible])
            row += 1
    return out
