"""Gemma 2 and Gemma 3 (text): Llama's projections with Gemma's numerics.

What differs from Llama, layer by layer:

- the embedding is scaled by ``sqrt(hidden_size)`` (rounded to the model dtype, as the checkpoints were trained);
- every RMSNorm multiplies by ``1 + weight`` (in float32) instead of ``weight``;
- four norms per layer: ``input_layernorm`` -> attention -> ``post_attention_layernorm`` -> residual,
  ``pre_feedforward_layernorm`` -> MLP -> ``post_feedforward_layernorm`` -> residual;
- the MLP is GeGLU: ``gelu_tanh(gate) * up`` (``hidden_activation: gelu_pytorch_tanh``);
- the softmax scale is ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- layers alternate between sliding-window (local) and full (global) attention (``layer_types``;
  Gemma 2: every other layer from layer 0, Gemma 3: five local, one global, ``sliding_window_pattern``);
- Gemma 2: attention scores soft-capped (``attn_logit_softcapping``, a capability of the attention
  backend) and the final logits too (``final_logit_softcapping``: ``cap * tanh(logits / cap)``);
- Gemma 3: per-head ``(1 + weight)`` RMSNorms of q and k before RoPE, and the local layers' own rotary
  base (``rope_parameters.sliding_attention`` / ``rope_local_base_freq``, 10 000 by default) beside
  the global layers' (which carry any scaling, e.g. linear).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from corerun.models.config import ModelConfig, RopeConfig
from corerun.models.errors import UnsupportedModelError
from corerun.models.layers import RMSNorm
from corerun.models.llama import ArchOptions, LlamaAttention, LlamaForCausalLM, LlamaMLP
from corerun.models.rotary import Rope, RotaryEmbedding
from corerun.protocols.attention import AttentionSpec
from corerun.protocols.forward_context import AttentionContext

if TYPE_CHECKING:
    from corerun.distributed.group import TensorParallelGroup
    from corerun.quantization.base import QuantizationMethod

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")  # the names config.json gives GeGLU's tanh-approximated gelu


class GemmaRMSNorm(RMSNorm):
    """``x / sqrt(mean(x**2) + eps) * (1 + weight)``, computed in float32 (a zero weight is the identity scale)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., size]`` -> same shape and dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` for ``x = [gate | up]`` ``[T, 2*I]`` -> ``[T, I]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class GemmaMLP(LlamaMLP):
    def __init__(self, config: ModelConfig, opts: ArchOptions, tp: "TensorParallelGroup | None" = None,
                 quant: "QuantizationMethod | None" = None) -> None:
        super().__init__(config, opts, tp, quant)
        self.act = GeluTanhAndMul()


class GemmaAttention(LlamaAttention):
    """Llama's attention; Gemma 3's q/k norms scale by ``1 + weight``."""

    def __init__(self, config: ModelConfig, layer_idx: int, opts: ArchOptions, tp: "TensorParallelGroup | None" = None,
                 quant: "QuantizationMethod | None" = None) -> None:
        super().__init__(config, layer_idx, opts, tp, quant)
        if opts.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, opts: ArchOptions, tp: "TensorParallelGroup | None" = None,
                 quant: "QuantizationMethod | None" = None) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = GemmaAttention(config, layer_idx, opts, tp, quant)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = GemmaMLP(config, opts, tp, quant)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, rope: Rope, hidden: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        hidden = hidden + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(hidden), ctx))
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2: see the module docstring; ``forward`` / ``compute_logits`` / ``attention_spec`` as Llama's."""

    decoder_layer: ClassVar[type[nn.Module]] = GemmaDecoderLayer
    hidden_acts: ClassVar[tuple[str, ...]] = ("silu", *GELU_TANH)  # hidden_act, when given, is not what runs: see below
    local_layers_every: ClassVar[int] = 2  # without layer_types: layers i with (i + 1) % this != 0 slide
    local_rope_default: ClassVar[RopeConfig | None] = None  # the local layers' rope when config.json names none
    # a head size apart from query_pre_attn_scalar, a window the suite's prompts run past, caps that bite
    conformance_config: ClassVar[dict[str, Any]] = {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "attn_logit_softcapping": 5.0,
        "final_logit_softcapping": 10.0,
    }

    def __init__(self, config: ModelConfig, tp: "TensorParallelGroup | None" = None,
                 quant: "QuantizationMethod | None" = None) -> None:
        act = config.raw.get("hidden_activation") or config.raw.get("hidden_act") or GELU_TANH[0]
        if act not in GELU_TANH:
            raise UnsupportedModelError(f"{type(self).__name__}: hidden_activation {act!r} is not supported; corerun "
                                        f"runs Gemma's GeGLU with {' or '.join(map(repr, GELU_TANH))}")
        super().__init__(config, tp, quant)
        self.model.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)  # the final norm scales by 1 + w too
        self.embed_scale = config.hidden_size**0.5
        self.final_soft_cap = config_soft_cap(config, "final_logit_softcapping")
        self.kinds = self.layer_types(config)
        local = config.local_rope or self.local_rope_default
        self.local_rotary = None if local is None else RotaryEmbedding(config.head_dim, config.max_position_embeddings, local)

    @classmethod
    def arch_options(cls, config: ModelConfig) -> ArchOptions:
        return ArchOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias)

    @classmethod
    def layer_types(cls, config: ModelConfig) -> tuple[str, ...]:
        if config.layer_types:
            return config.layer_types
        every = int(config.raw.get("sliding_window_pattern") or cls.local_layers_every)
        return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(config.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """``input_ids`` / ``positions`` int64 ``[T]`` -> hidden states ``[T, hidden_size]`` in the model dtype."""
        return self.forward_stage(input_ids, positions, ctx, None, (0, self.num_layers))

    def forward_stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext, hidden: torch.Tensor | None,
        layers: tuple[int, int],
    ) -> torch.Tensor:
        """Decoder layers ``layers = (start, end)``: the scaled embedding first when ``hidden`` is None, the
        final norm after the last layer (a pipeline stage, as Llama's)."""
        m, (start, end) = self.model, layers
        if hidden is None:
            hidden = m.embed_tokens(input_ids)
            hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype, device=hidden.device)
        rope = m.rotary_emb.angles(positions)  # once per step, for every layer of its kind
        local = rope if self.local_rotary is None else self.local_rotary.angles(positions)
        for i in range(start, end):
            hidden = m.layers[i](local if self.kinds[i] == "sliding_attention" else rope, hidden, ctx)
        return m.norm(hidden) if end == len(m.layers) else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, hidden_size]`` -> logits float32 ``[N, vocab_size]``, soft-capped when the config says."""
        logits = self.lm_head(hidden)
        if logits is None or self.final_soft_cap is None:  # tensor parallel: ranks above 0 get None
            return logits
        return soft_cap(logits, self.final_soft_cap)

    def attention_spec(self, dtype: torch.dtype, block_size: int, device: torch.device | str) -> AttentionSpec:
        """Llama's spec with Gemma's softmax scale (``query_pre_attn_scalar ** -0.5``) and attention soft cap."""
        scalar = float(self.config.raw.get("query_pre_attn_scalar") or self.config.head_dim)
        return replace(super().attention_spec(dtype, block_size, device), scale=scalar**-0.5,
                       logits_soft_cap=self.attention_soft_cap())

    def attention_soft_cap(self) -> float | None:
        return config_soft_cap(self.config, "attn_logit_softcapping")


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 (text): Gemma 2's layers with q/k norms, five local layers to one global, the local
    layers' own rotary base; no attention soft-capping (transformers' Gemma 3 applies none)."""

    local_layers_every: ClassVar[int] = 6
    local_rope_default: ClassVar[RopeConfig | None] = RopeConfig(theta=10000.0)
    # layer 0 local, layer 1 global; the global rope scaled (linear) over its own base, the local one plain
    conformance_config: ClassVar[dict[str, Any]] = {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "sliding_window_pattern": 2,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    }

    @classmethod
    def arch_options(cls, config: ModelConfig) -> ArchOptions:
        return ArchOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True)

    def attention_soft_cap(self) -> float | None:
        return None


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: same shape and dtype, every value inside ``(-cap, cap)``, values well below
    ``cap`` nearly unchanged (Gemma 2's final logits; attention scores are capped by the backend through
    ``AttentionSpec.logits_soft_cap``)."""
    return torch.tanh(x / cap) * cap


def config_soft_cap(config: ModelConfig, key: str) -> float | None:
    """``config.json[key]`` as a cap: ``None`` when absent or null; refused (naming it) unless above 0."""
    value = config.raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UnsupportedModelError(f"config.json: {key} must be a number above 0 (or null for none), got {value!r}")
    return float(value)
