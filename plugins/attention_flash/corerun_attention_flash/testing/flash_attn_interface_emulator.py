"""EMULATOR of flash-attn 3's ``flash_attn_with_kvcache`` (``flash_attn_interface``, Hopper), for tests without a GPU.

Not FA3, never used by the backend.  Follows the docstring of FA3's ``flash_attn_with_kvcache``
(hopper/flash_attn_interface.py): the paged cache is addressed through ``page_table`` and its
``page_block_size`` "can be arbitrary"; with ``cu_seqlens_q`` (and ``max_seqlen_q``) the queries are
packed back to back, ``q`` ``(total_q, nheads, headdim)``, and request ``b`` attends over its
``cache_seqlens[b]`` cached keys with the bottom-right causal mask.  Preconditions and numerics are
those of the FA2 emulator (:mod:`.flash_attn_emulator`), whose helpers this module reuses.
"""

from __future__ import annotations

import torch

from corerun_attention_flash.testing import flash_attn_emulator as fa2

__version__ = "3.0.0+cpu-emulator"


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
    max_seqlen_q=None, rotary_seqlens=None, q_descale=None, k_descale=None, v_descale=None,
    softmax_scale=None, causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
    rotary_interleaved=True, scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
    return_softmax_lse=False,
):
    """q ``(batch, seqlen, nheads, headdim)``, or ``(total_q, nheads, headdim)`` with ``cu_seqlens_q``;
    returns the same shape as ``q``."""
    fa2._unsupported(appending_k_v=k is not None or v is not None, qv=qv is not None, rotary=rotary_cos is not None,
                     cache_batch_idx=cache_batch_idx is not None, cache_leftpad=cache_leftpad is not None,
                     cu_seqlens_k_new=cu_seqlens_k_new is not None, fp8_descale=q_descale is not None,
                     sliding_window=tuple(window_size) != (-1, -1), attention_chunk=attention_chunk != 0,
                     softcap=softcap != 0.0, return_softmax_lse=bool(return_softmax_lse))
    if cu_seqlens_q is None:
        return fa2.kvcache_attention(q, k_cache, v_cache, cache_seqlens, page_table, softmax_scale, causal, 1)
    fa2._require(q.dim() == 3, f"with cu_seqlens_q, q must be (total_q, nheads, headdim), got {tuple(q.shape)}")
    fa2._require(max_seqlen_q is not None, "max_seqlen_q must be provided if cu_seqlens_q is provided", ValueError)
    batch = cu_seqlens_q.numel() - 1
    fa2.check_index("cu_seqlens_q", cu_seqlens_q, (batch + 1,))
    fa2.check_index("cache_seqlens", cache_seqlens, (batch,))
    starts = cu_seqlens_q.tolist()
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    for b in range(batch):
        sq = starts[b + 1] - starts[b]
        fa2._require(0 <= sq <= max_seqlen_q, f"sequence {b}: {sq} queries, max_seqlen_q is {max_seqlen_q}", ValueError)
        if sq == 0:
            continue
        out[starts[b]:starts[b + 1]] = fa2.kvcache_attention(
            q[starts[b]:starts[b + 1]].unsqueeze(0), k_cache, v_cache, cache_seqlens[b:b + 1],
            None if page_table is None else page_table[b:b + 1], softmax_scale, causal, 1,
        )[0]
    return out
