"""What a model's attention layers are handed on each forward pass (explicitly, never through a global)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from corerun.protocols.attention import AttentionBackend


@dataclass
class AttentionContext:
    """``backend`` runs every layer; ``metadata`` is ``backend.plan(batch)`` for this step;
    ``kv_caches[i]`` is layer ``i``'s cache in the backend's own layout."""

    backend: AttentionBackend
    metadata: Any
    kv_caches: list[torch.Tensor]

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv, D]`` -> ``[T, Hq, D]``; writes this step's K/V first."""
        return self.backend.forward(q, k, v, self.kv_caches[layer_idx], self.metadata)
