"""What a model family needs, in one public module: a ``model`` plugin imports nothing else from corerun.

A family is a ``torch.nn.Module`` class registered under its ``architectures`` name (docs/models.md)::

    model = Family(config)                       # config: ModelConfig; Family(config, tp=group) when tensor parallel
    hidden = model(input_ids, positions, ctx)    # int64 [T], int64 [T], AttentionContext -> [T, hidden_size]
    logits = model.compute_logits(hidden[rows])  # -> float32 [N, vocab_size]
    model.attention_spec(dtype, block_size, device) -> AttentionSpec
    model.num_layers                             # layers that call ctx.attend(layer_idx, q, k, v)
    model.packed_modules_mapping                 # checkpoint module -> (merged module, shard id)

Building blocks, each parameter with its ``weight_loader(param, tensor, shard_id=None)``:

- linears: :class:`Linear`, :class:`MergedLinear` (qkv, gate_up); tensor parallel:
  :class:`ColumnParallelMergedLinear`, :class:`RowParallelLinear`, :func:`attention_projections`,
  :func:`mlp_projections`, :func:`shard_heads`, :func:`shard_range`;
- embeddings and head: :class:`VocabEmbedding`, :class:`LMHead`, :class:`VocabParallelEmbedding`,
  :class:`ParallelLMHead`;
- norms: :class:`RMSNorm`; activations: :class:`SiluAndMul` (``[gate | up] -> silu(gate) * up``);
- rotary: :class:`RotaryEmbedding` (every ``rope_type`` of :data:`ROPE_TYPES`), :class:`Rope`,
  :func:`inverse_frequencies`;
- attention: the :class:`AttentionContext` handed to ``forward``; ``ctx.attend(layer_idx, q, k, v)``
  calls the backend corerun selected, which writes this step's K/V into the paged cache first;
- the Llama family's pieces to reuse or subclass: :class:`LlamaForCausalLM`, :class:`LlamaModel`,
  :class:`LlamaDecoderLayer`, :class:`LlamaAttention`, :class:`LlamaMLP`, :class:`ArchOptions`;
- Gemma's pieces (GeGLU, ``1 + weight`` norms, soft-capping): :class:`GemmaRMSNorm` (``x / rms(x) * (1 + weight)``
  in float32), :class:`GeluTanhAndMul` (``[gate | up] -> gelu_tanh(gate) * up``), :class:`GemmaMLP` (Llama's
  MLP with it), :data:`GELU_TANH` (its ``hidden_activation`` names), :func:`soft_cap` (``cap * tanh(x / cap)``,
  final logits), :func:`config_soft_cap` (a cap key of ``config.json``, checked), :class:`GemmaAttention`,
  :class:`GemmaDecoderLayer`, :class:`Gemma2ForCausalLM`, :class:`Gemma3ForCausalLM`; attention scores are
  soft-capped by the backend, asked for with :class:`AttentionSpec`'s ``logits_soft_cap``;
- mixture of experts: :class:`SparseMoeBlock` (router, stacked experts, optional shared expert),
  :class:`MoeConfig`, :class:`MoeDecoderLayer`, :func:`route`, :func:`grouped_experts`,
  :func:`experts_reference`, :func:`expert_modules_mapping` (per-expert checkpoint tensors);
- loading: :func:`load_weights` (every missing, unexpected and mis-shaped tensor in one error),
  :func:`default_weight_loader`, :class:`WeightShapeError`.
"""

from __future__ import annotations

from corerun.plugin.capabilities import ModelCapabilities
from corerun.distributed.sharding import shard_heads, shard_range
from corerun.protocols.forward_context import AttentionContext
from corerun.models.config import ROPE_TYPES, ModelConfig, RopeConfig
from corerun.models.errors import ModelLoadError, UnsupportedModelError
from corerun.models.gemma import (
    GELU_TANH,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    GemmaAttention,
    GemmaDecoderLayer,
    GemmaMLP,
    GemmaRMSNorm,
    GeluTanhAndMul,
    config_soft_cap,
    soft_cap,
)
from corerun.models.layers import (
    LMHead,
    Linear,
    MergedLinear,
    RMSNorm,
    SiluAndMul,
    VocabEmbedding,
    WeightShapeError,
    default_weight_loader,
)
from corerun.models.llama import (
    ArchOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
)
from corerun.models.loader import load_weights
from corerun.models.moe import (
    MoeConfig,
    MoeDecoderLayer,
    SparseMoeBlock,
    expert_modules_mapping,
    experts_reference,
    grouped_experts,
    route,
)
from corerun.models.parallel_layers import (
    ColumnParallelMergedLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    attention_projections,
    mlp_projections,
)
from corerun.models.rotary import Rope, RotaryEmbedding, inverse_frequencies
from corerun.protocols.attention import AttentionSpec

__all__ = [
    "GELU_TANH",
    "ROPE_TYPES",
    "ArchOptions",
    "AttentionContext",
    "AttentionSpec",
    "ColumnParallelMergedLinear",
    "GeluTanhAndMul",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "GemmaAttention",
    "GemmaDecoderLayer",
    "GemmaMLP",
    "GemmaRMSNorm",
    "LMHead",
    "Linear",
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "LlamaModel",
    "MergedLinear",
    "ModelCapabilities",
    "ModelConfig",
    "ModelLoadError",
    "MoeConfig",
    "MoeDecoderLayer",
    "ParallelLMHead",
    "RMSNorm",
    "Rope",
    "RopeConfig",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "SparseMoeBlock",
    "UnsupportedModelError",
    "VocabEmbedding",
    "VocabParallelEmbedding",
    "WeightShapeError",
    "attention_projections",
    "config_soft_cap",
    "default_weight_loader",
    "expert_modules_mapping",
    "experts_reference",
    "grouped_experts",
    "inverse_frequencies",
    "load_weights",
    "mlp_projections",
    "route",
    "shard_heads",
    "shard_range",
    "soft_cap",
]
