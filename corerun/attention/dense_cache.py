"""The usual dense KV-cache layout, for attention backends to mix in.

One tensor per layer, ``spec.kv_cache_shape(num_blocks)`` = ``[2, num_blocks, block_size,
num_kv_heads, head_size]`` (K at index 0, V at 1), allocated zeroed so that padding rows and unwritten
slots never hold NaN garbage.  A backend class sets ``self.spec`` (its :class:`AttentionSpec`) and
inherits the three cache methods of the ``AttentionBackend`` protocol.
"""

from __future__ import annotations

import torch

from corerun.protocols.attention import AttentionSpec


class DenseKVCache:
    """``kv_cache_bytes_per_block``, ``allocate_kv_cache`` and ``kv_cache_view`` for the dense layout."""

    name: str
    spec: AttentionSpec

    def kv_cache_bytes_per_block(self) -> int:
        return self.spec.kv_bytes_per_block

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Zeroed ``[2, num_blocks, block_size, num_kv_heads, head_size]`` at the spec's dtype and device."""
        s = self.spec
        return torch.zeros(s.kv_cache_shape(num_blocks), dtype=s.dtype, device=s.device)

    def kv_cache_view(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)``, each ``[num_blocks, block_size, num_kv_heads, head_size]``; views into ``kv_cache``.

        Raises ``ValueError`` for a tensor of another layout.
        """
        s = self.spec
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[2:]) != (
            s.block_size, s.num_kv_heads, s.head_size,
        ):
            raise ValueError(
                f"{self.name} KV cache must have shape [2, num_blocks, {s.block_size}, {s.num_kv_heads}, {s.head_size}], "
                f"got {list(kv_cache.shape)}"
            )
        return kv_cache[0], kv_cache[1]
