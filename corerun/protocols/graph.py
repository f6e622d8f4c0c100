"""The ``GraphRunner`` protocol: run the composed model for one step, eagerly or by CUDA-graph replay.

A graph runner wraps whatever model and attention backend the ModelRunner composed.  It knows
nothing of either beyond this interface: ``model(input_ids, positions, attn_metadata) -> hidden``
and ``attention.plan(batch)``.  The ModelRunner hands it a :class:`ModelInputs` per step; the
runner's logits head and the sampler run outside.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

import torch

from corerun.protocols.attention import AttentionBatch

ModelFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


@dataclass
class ModelInputs:
    """``input_ids`` int64 ``[num_tokens]``, ``positions`` int64 ``[num_tokens]``, and the batch layout;
    ``lora_slots`` int32 ``[num_tokens]``: each token's LoRA adapter slot, ``-1`` for the base model
    (corerun.lora; ``None`` in a hand-made step: every token on the base model)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    batch: AttentionBatch
    lora_slots: torch.Tensor | None = None


@dataclass(frozen=True)
class GraphLimits:
    """What a graph runner needs to size its static buffers."""

    max_batch_size: int  # largest decode batch captured
    max_model_len: int  # longest sequence; sizes the block-table buffer
    block_size: int
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    lora: bool = False  # steps may carry LoRA adapters (lora.enabled), whose per-step state is set outside the model


@dataclass
class GraphStats:
    captured_sizes: list[int] = field(default_factory=list)
    replays: int = 0
    eager_steps: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> count
    capture_seconds: float = 0.0
    capture_bytes: int = 0


@runtime_checkable
class GraphRunner(Protocol):
    """Factory signature: ``factory(model: ModelFn, attention: AttentionBackend, limits: GraphLimits, **options)``."""

    name: ClassVar[str]
    stats: GraphStats

    def capture(self) -> None:
        """Capture whatever this runner captures (at startup, after the KV cache exists)."""
        ...

    def run(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states ``[inputs.batch.num_tokens, hidden_size]`` for the step."""
        ...
