"""Broken model families, each Llama with one fault, that ``ModelSuite`` must reject."""

from __future__ import annotations

from typing import Any, ClassVar, Hashable

import torch
from torch import nn

from corerun.sdk.models import LlamaForCausalLM, ModelConfig, RMSNorm, Rope, RotaryEmbedding, default_weight_loader


class _Interleaved(Rope):
    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """GPT-J's layout: rotates pairs ``(x0, x1), (x2, x3), ...`` instead of the two halves."""
        half = x.shape[-1] // 2
        cos, sin = self.cos[..., :half].float(), self.sin[..., half:].float()
        pairs = x.float().unflatten(-1, (half, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2).to(x.dtype)


class _InterleavedRotary(RotaryEmbedding):
    def angles(self, positions: torch.Tensor) -> Rope:
        rope = super().angles(positions)
        return _Interleaved(rope.cos, rope.sin)


class WrongRotaryVariant(LlamaForCausalLM):
    """Rotates interleaved pairs (GPT-J) where Hugging Face Llama rotates halves."""

    hf_architecture: ClassVar[str] = "LlamaForCausalLM"

    def __init__(self, config: ModelConfig, tp: Any = None) -> None:
        super().__init__(config, tp)
        self.model.rotary_emb = _InterleavedRotary(config.head_dim, config.max_position_embeddings, config.rope)


def _transposed(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
    default_weight_loader(param, loaded_weight.t(), shard_id)


class TransposedWeight(LlamaForCausalLM):
    """Loads every ``o_proj`` weight transposed (square in the suite's configs, so no shape error shows it)."""

    hf_architecture: ClassVar[str] = "LlamaForCausalLM"

    def __init__(self, config: ModelConfig, tp: Any = None) -> None:
        super().__init__(config, tp)
        for layer in self.model.layers:
            layer.self_attn.o_proj.weight.weight_loader = _transposed


class _Skipped(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class MissedNorm(LlamaForCausalLM):
    """Loads ``post_attention_layernorm`` but never applies it."""

    hf_architecture: ClassVar[str] = "LlamaForCausalLM"

    def __init__(self, config: ModelConfig, tp: Any = None) -> None:
        super().__init__(config, tp)
        for layer in self.model.layers:
            skipped = _Skipped(config.hidden_size, config.rms_norm_eps)
            skipped.weight = layer.post_attention_layernorm.weight
            layer.post_attention_layernorm = skipped


BROKEN_MODELS = (WrongRotaryVariant, TransposedWeight, MissedNorm)
