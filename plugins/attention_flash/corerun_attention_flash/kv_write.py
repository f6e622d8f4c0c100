"""Writing this step's K/V into the paged cache by slot mapping, in plain torch indexing.

CUDA-graph safe: no host sync, no data-dependent shapes (a boolean mask would need both).  A slot of
``-1`` (a padding token) must write nothing.  ``index_copy_`` cannot skip an index, so each padding
token is redirected to the slot of the step's *first real token*, carrying that token's own K/V: the
slot receives the same bytes whichever duplicate lands last, so the result is exact and deterministic.
When no token is real (a padding-only capture batch), the padding rows copy slot 0's current content
back onto slot 0, which changes nothing.
"""

from __future__ import annotations

import torch


def write_kv_by_slot(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` into ``kv_cache`` at ``slot_mapping``; slots ``-1`` are skipped.

    - ``key``, ``value``: ``[num_tokens, num_kv_heads, head_size]``, the cache's dtype (any strides).
    - ``kv_cache``: contiguous ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K at 0, V at 1).
    - ``slot_mapping``: int64 ``[num_tokens]``, ``block * block_size + offset`` or ``-1``.
    """
    num_tokens = slot_mapping.shape[0]
    if key.shape[0] != num_tokens or value.shape[0] != num_tokens:
        raise ValueError(
            f"write_kv: key {tuple(key.shape)} / value {tuple(value.shape)} must have one row per slot_mapping "
            f"entry ({num_tokens})"
        )
    if num_tokens == 0:
        return
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()

    # Index with 1-element tensors only: indexing with a 0-dim tensor is an .item() (a host sync, and an
    # error inside CUDA-graph capture).
    real = slots >= 0  # [T]
    first = real.to(torch.int32).argmax().view(1)  # first real token (0 when none is real), [1]
    any_real = real.index_select(0, first)  # [1] bool
    fallback_slot = slots.index_select(0, first).clamp(min=0)  # [1]
    target = torch.where(real, slots, fallback_slot)
    for cache, new in ((flat[0], key), (flat[1], value)):
        fallback = torch.where(
            any_real[:, None, None], new.index_select(0, first), cache.index_select(0, fallback_slot).to(new.dtype)
        )  # [1, Hkv, D]
        rows = torch.where(real[:, None, None], new, fallback)
        cache.index_copy_(0, target, rows.to(cache.dtype))
