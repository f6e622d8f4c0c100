"""Per-step metadata of the ``flash`` backend (``plan``): what flash-attn's entry points take, derived once per step.

Two shapes of step:

- a pure-decode batch (every request adds one token) goes to ``flash_attn_with_kvcache`` with
  ``q`` ``[num_reqs, 1, num_heads, head_size]``, ``cache_seqlens`` and ``block_table``.  Its plan only
  *references* the batch's tensors, so a CUDA graph captured with it stays valid when the runner
  writes the next step's values into the same tensors.
- any other batch (prefill chunks, cached prefixes, prefills mixed with decodes) goes to
  ``flash_attn_varlen_func`` (FA2) or ``flash_attn_with_kvcache`` with ``cu_seqlens_q`` (FA3), which
  read every request's keys/values, cached prefix included, in place from the paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from corerun.protocols.attention import AttentionBatch


@dataclass
class FlashDecodeMetadata:
    """Plan of a pure-decode batch; every tensor is the batch's own (no copies).

    - ``cache_seqlens`` int32 ``[num_reqs]``: ``batch.seq_lens``, keys per request including this step's.
    - ``block_table``   int32 ``[num_reqs, max_blocks_per_seq]``: ``batch.block_tables``.
    - ``slot_mapping``  int64 ``[num_reqs]``: ``batch.slot_mapping`` (``-1``: write nothing).
    """

    cache_seqlens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_reqs: int


@dataclass
class FlashVarlenMetadata:
    """Plan of a prefill or mixed batch.

    - ``cu_seqlens_q`` int32 ``[num_reqs + 1]``: ``batch.query_start_loc``.
    - ``cu_seqlens_k`` int32 ``[num_reqs + 1]``: cumulative ``seq_lens`` (FA2 takes each request's key
      count as ``cu_seqlens_k[i + 1] - cu_seqlens_k[i]``; with a ``block_table`` the keys themselves
      are read through the table, not at these offsets).
    - ``seq_lens``     int32 ``[num_reqs]``: ``batch.seq_lens`` (FA3's ``cache_seqlens``).
    - ``block_table``  int32 ``[num_reqs, max_blocks_per_seq]``; ``slot_mapping`` int64 ``[num_tokens]``.
    - ``max_seqlen_q`` / ``max_seqlen_k``: host ints, the longest query and (an upper bound of) the longest sequence.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    num_reqs: int


FlashMetadata = FlashDecodeMetadata | FlashVarlenMetadata


def _require_int32(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype != torch.int32:
        raise ValueError(f"flash attention: batch.{name} must be int32 (flash-attn reads it as int32), got {tensor.dtype}")
    if tensor.dim() and tensor.stride(-1) != 1:
        raise ValueError(f"flash attention: batch.{name} must have a contiguous last dimension, got strides {tensor.stride()}")


def plan_batch(batch: AttentionBatch) -> FlashMetadata:
    """``batch`` -> the metadata ``forward`` hands to flash-attn (once per step, outside any CUDA graph)."""
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        _require_int32(name, getattr(batch, name))
    if batch.is_pure_decode or batch.max_query_len == 1:
        if batch.num_tokens != batch.num_reqs:
            raise ValueError(
                f"flash attention: a pure-decode batch has one token per request, got num_tokens={batch.num_tokens} "
                f"for num_reqs={batch.num_reqs}"
            )
        return FlashDecodeMetadata(
            cache_seqlens=batch.seq_lens,
            block_table=batch.block_tables,
            slot_mapping=batch.slot_mapping,
            num_reqs=batch.num_reqs,
        )
    cu_seqlens_k = torch.zeros(batch.num_reqs + 1, dtype=torch.int32, device=batch.seq_lens.device)
    torch.cumsum(batch.seq_lens, dim=0, dtype=torch.int32, out=cu_seqlens_k[1:])
    return FlashVarlenMetadata(
        cu_seqlens_q=batch.query_start_loc,
        cu_seqlens_k=cu_seqlens_k,
        seq_lens=batch.seq_lens,
        block_table=batch.block_tables,
        slot_mapping=batch.slot_mapping,
        max_seqlen_q=batch.max_query_len,
        max_seqlen_k=batch.max_seq_len,
        num_reqs=batch.num_reqs,
    )
