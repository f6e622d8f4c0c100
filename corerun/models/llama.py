"""The Llama family: Llama 2/3 (and SmolLM), Mistral, and, through :class:`ArchOptions`, Qwen2 and Qwen3.

Tokens are laid out flat (``[T]``, no batch dimension); attention runs through the
:class:`~corerun.protocols.forward_context.AttentionContext` handed to ``forward``, which owns the KV cache
and the kernels.  Parameter names follow the Hugging Face checkpoints, except that ``q_proj`` /
``k_proj`` / ``v_proj`` are merged into ``qkv_proj`` and ``gate_proj`` / ``up_proj`` into
``gate_up_proj`` (see ``packed_modules_mapping``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from corerun.protocols.forward_context import AttentionContext
from corerun.models.config import ModelConfig
from corerun.models.errors import UnsupportedModelError
from corerun.models.layers import LMHead, Linear, MergedLinear, RMSNorm, SiluAndMul, VocabEmbedding, add_norm
from corerun.models.rotary import Rope, RotaryEmbedding
from corerun.models.parallel_layers import ParallelLMHead, VocabParallelEmbedding, attention_projections, mlp_projections
from corerun.distributed.sharding import shard_heads
from corerun.protocols.attention import AttentionSpec

if TYPE_CHECKING:
    from corerun.distributed.group import TensorParallelGroup
    from corerun.quantization.base import QuantizationMethod


@dataclass(frozen=True)
class ArchOptions:
    """Where the members of the family differ."""

    qkv_bias: bool = False  # bias on q_proj / k_proj / v_proj
    o_bias: bool = False  # bias on o_proj
    mlp_bias: bool = False  # bias on gate / up / down
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, opts: ArchOptions, tp: "TensorParallelGroup | None" = None,
        quant: "QuantizationMethod | None" = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        if tp is None:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            self.qkv_proj = MergedLinear(
                config.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, bias=opts.qkv_bias, quant=quant
            )
            self.o_proj = Linear(q_size, config.hidden_size, bias=opts.o_bias, quant=quant)
        else:  # tensor parallel: this rank's query heads and the KV heads they use
            heads = shard_heads(config.num_heads, config.num_kv_heads, tp.rank, tp.world_size)
            self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
            self.qkv_proj, self.o_proj = attention_projections(
                config.hidden_size, self.head_dim, config.num_heads, config.num_kv_heads, heads, opts.qkv_bias, opts.o_bias, tp,
                quant,
            )
        if opts.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, rope: Rope, hidden: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """``rope``: the step's rotation (:meth:`RotaryEmbedding.angles`), ``hidden`` ``[T, hidden_size]`` -> ``[T, hidden_size]``."""
        t, hq, hkv, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)
        if self.q_norm is None:  # q and k side by side in qkv: one rotation for both
            qk = rope.apply(qkv[:, : (hq + hkv) * d].view(t, hq + hkv, d))
            q, k = qk[:, :hq], qk[:, hq:]
        else:
            q, k, _ = self.qkv_proj.split(qkv)
            q, k = rope.apply(self.q_norm(q.view(t, hq, d))), rope.apply(self.k_norm(k.view(t, hkv, d)))
        v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
        out = ctx.attend(self.layer_idx, q, k, v)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(
        self, config: ModelConfig, opts: ArchOptions, tp: "TensorParallelGroup | None" = None,
        quant: "QuantizationMethod | None" = None,
    ) -> None:
        super().__init__()
        size = config.intermediate_size
        if tp is None:
            self.gate_up_proj = MergedLinear(config.hidden_size, {"gate": size, "up": size}, bias=opts.mlp_bias, quant=quant)
            self.down_proj = Linear(size, config.hidden_size, bias=opts.mlp_bias, quant=quant)
        else:  # tensor parallel: this rank's slice of the intermediate features
            self.gate_up_proj, self.down_proj = mlp_projections(config.hidden_size, size, opts.mlp_bias, tp, quant)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden_size]`` -> ``[T, hidden_size]``."""
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """``hidden + attn(norm(hidden))``, then ``+ mlp(norm(...))``.  :class:`LlamaModel` runs it through
    :meth:`forward_residual`, vLLM's layout: each residual add is fused into the norm after it.  A subclass
    with a ``forward`` of its own is run through that instead (``(rope, hidden, ctx) -> hidden``)."""

    mlp_attr: ClassVar[str] = "mlp"  # the MLP's module name (a family's sparse block keeps its checkpoint's)

    def __init__(
        self, config: ModelConfig, layer_idx: int, opts: ArchOptions, tp: "TensorParallelGroup | None" = None,
        quant: "QuantizationMethod | None" = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, opts, tp, quant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, opts, tp, quant)

    def forward(self, rope: Rope, hidden: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]``: the residual stream before this layer -> the stream after it."""
        hidden, residual = self.forward_residual(rope, hidden, None, ctx)
        return hidden + residual

    def forward_residual(
        self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None, ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream before this layer is ``hidden + residual`` (``hidden`` alone when ``residual`` is
        None: the first layer); returns ``(mlp output, residual)``, whose sum is the stream after it, added by
        the next layer's input norm (:func:`~corerun.models.layers.add_norm`) or the model's final norm.  ``[T, hidden_size]`` each."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = add_norm(self.input_layernorm, hidden, residual)
        hidden, residual = add_norm(self.post_attention_layernorm, self.self_attn(rope, hidden, ctx), residual)
        return getattr(self, self.mlp_attr)(hidden), residual


def _runs_residual(layer: type[nn.Module]) -> bool:
    """``layer`` is run through :meth:`LlamaDecoderLayer.forward_residual`: it keeps Llama's ``forward``."""
    return issubclass(layer, LlamaDecoderLayer) and layer.forward is LlamaDecoderLayer.forward


class LlamaModel(nn.Module):
    """``layer``: the decoder layer class, called as ``layer(config, layer_idx, opts, tp, quant)``."""

    def __init__(
        self, config: ModelConfig, opts: ArchOptions, tp: "TensorParallelGroup | None" = None,
        quant: "QuantizationMethod | None" = None, layer: type[nn.Module] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        if tp is None:
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope)  # one for every layer
        self.layers = nn.ModuleList(layer(config, i, opts, tp, quant) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_stream = _runs_residual(layer)  # decided once: the layers' adds go into the norms

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        return self.forward_layers(input_ids, positions, ctx, None, 0, len(self.layers))

    def forward_layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext, hidden: torch.Tensor | None,
        start: int, end: int,
    ) -> torch.Tensor:
        """Decoder layers ``[start, end)``: embedding first when ``hidden`` is None (``start == 0``), the final
        norm after when ``end`` is the last layer.  ``hidden`` ``[T, hidden_size]``: the stage before's output,
        the residual stream (its last layer's output and residual added up): nothing else crosses."""
        if hidden is None:
            hidden = self.embed_tokens(input_ids)
        rope = self.rotary_emb.angles(positions)  # once per step, for every layer
        last = end == len(self.layers)
        if not self.residual_stream:
            for layer in islice(self.layers, start, end):
                hidden = layer(rope, hidden, ctx)
            return self.norm(hidden) if last else hidden
        residual = None
        for layer in islice(self.layers, start, end):
            hidden, residual = layer.forward_residual(rope, hidden, residual, ctx)
        if residual is None:  # no layer ran
            return self.norm(hidden) if last else hidden
        return add_norm(self.norm, hidden, residual)[0] if last else hidden + residual


class LlamaForCausalLM(nn.Module):
    """A decoder-only causal LM of the Llama family.

    ``forward(input_ids, positions, ctx)`` returns the final-normed hidden states ``[T, hidden_size]``;
    ``compute_logits`` projects the rows the caller keeps (usually each request's last token).

    ``tp``: this process's tensor-parallel group (:mod:`corerun.distributed`); the model then holds its
    rank's heads, MLP features and vocabulary rows, and ``attention_spec`` gives the per-rank head counts.
    ``quant``: the quantization method of the attention and MLP projections (:mod:`corerun.quantization`);
    ``None``: dense float weights.  Embeddings, norms and the LM head stay float.
    """

    supports_tensor_parallel: ClassVar[bool] = True
    decoder_layer: ClassVar[type[nn.Module]] = LlamaDecoderLayer  # a family with other MLPs (experts) names its own
    hidden_acts: ClassVar[tuple[str, ...]] = ("silu",)  # the config's hidden_act values the family runs

    # checkpoint module name -> (corerun module name, shard id)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    @classmethod
    def arch_options(cls, config: ModelConfig) -> ArchOptions:
        return ArchOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, mlp_bias=config.mlp_bias)

    @classmethod
    def layer_types(cls, config: ModelConfig) -> tuple[str, ...]:
        """Per layer, ``"full_attention"`` or ``"sliding_attention"``: config.json's ``layer_types`` where it
        lists them, else every layer slides when the config sets a window (Mistral) and none does otherwise."""
        if config.layer_types:
            return config.layer_types
        return ("sliding_attention" if config.sliding_window is not None else "full_attention",) * config.num_layers

    @classmethod
    def layer_windows(cls, config: ModelConfig) -> tuple[int | None, ...]:
        """Per layer, its sliding window (``config.sliding_window``), or ``None`` for full attention."""
        window = config.sliding_window
        return tuple(window if kind == "sliding_attention" else None for kind in cls.layer_types(config))

    def __init__(
        self, config: ModelConfig, tp: "TensorParallelGroup | None" = None, quant: "QuantizationMethod | None" = None,
    ) -> None:
        super().__init__()
        if config.hidden_act not in self.hidden_acts:
            raise UnsupportedModelError(
                f"{type(self).__name__}: hidden_act {config.hidden_act!r} is not supported; corerun supports "
                f"{', '.join(map(repr, self.hidden_acts))}"
            )
        self.config = config
        self.num_layers = config.num_layers
        self.model = LlamaModel(config, self.arch_options(config), tp, quant, self.decoder_layer)
        if tp is None:
            self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
            self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        else:
            heads = shard_heads(config.num_heads, config.num_kv_heads, tp.rank, tp.world_size)
            self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """``input_ids`` / ``positions`` int64 ``[T]`` -> hidden states ``[T, hidden_size]`` in the model dtype."""
        return self.model(input_ids, positions, ctx)

    def forward_stage(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext, hidden: torch.Tensor | None,
        layers: tuple[int, int],
    ) -> torch.Tensor:
        """One pipeline stage: decoder layers ``layers = (start, end)`` (see :meth:`LlamaModel.forward_layers`);
        ``hidden`` ``[T, hidden_size]`` from the stage before (``None`` on the first stage)."""
        return self.model.forward_layers(input_ids, positions, ctx, hidden, *layers)

    def keep_layers(self, start: int, end: int) -> None:
        """Drop what a pipeline stage holding layers ``[start, end)`` never runs: the other decoder
        layers (empty modules keep the indices), the embedding before the first stage's, the final norm
        and LM head after the last stage's (a tied LM head keeps its embedding's parameter).  Called
        before the weights load: ``dropped_weights`` names the checkpoint prefixes nobody reads."""
        layers, dropped = self.model.layers, []
        for i in range(len(layers)):
            if not start <= i < end:
                layers[i] = nn.Module()
                dropped.append(f"model.layers.{i}.")
        if start > 0 and not (self.config.tie_word_embeddings and end == len(layers)):
            self.model.embed_tokens = None
            dropped.append("model.embed_tokens.")
        if end < len(layers):
            self.model.norm = self.lm_head = None
            dropped += ["model.norm.", "lm_head."]
        self.dropped_weights = tuple(dropped)  # checkpoint names the loader skips (corerun.models.loader)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, hidden_size]`` -> logits float32 ``[N, vocab_size]``.

        Tensor parallel: every rank must call it with the same rows; rank 0 gets the logits, the others ``None``.
        """
        return self.lm_head(hidden)

    def attention_spec(self, dtype: torch.dtype, block_size: int, device: torch.device | str) -> AttentionSpec:
        """What every attention layer of this model asks of the attention backend (this rank's heads)."""
        c = self.config
        return AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=c.head_dim,
            dtype=dtype,
            block_size=block_size,
            device=torch.device(device),
            scale=c.head_dim**-0.5,
            sliding_windows=self.sliding_windows(),
        )

    def sliding_windows(self) -> tuple[int | None, ...]:
        """``AttentionSpec.sliding_windows``: :meth:`layer_windows`, or ``()`` when every layer is full."""
        windows = self.layer_windows(self.config)
        return windows if any(w is not None for w in windows) else ()


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral's dense models: Llama's layers, every one attending through ``sliding_window`` when the config sets it."""

    conformance_config: ClassVar[dict[str, Any]] = {"sliding_window": 8}  # the suite's prompts run past it
