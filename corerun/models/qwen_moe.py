"""Qwen2-MoE and Qwen3-MoE: Qwen2's / Qwen3's attention, and a sparse block of ``num_experts`` SiLU
experts (``moe_intermediate_size`` each) in every ``decoder_sparse_step``-th layer not listed in
``mlp_only_layers`` (the others keep a dense MLP of ``intermediate_size``).  The top-k softmax weights
are renormalised only when ``norm_topk_prob``; Qwen2-MoE adds a shared expert every token goes
through, scaled by ``sigmoid(shared_expert_gate(x))``.

Checkpoint: ``mlp.gate`` (the router), ``mlp.experts.N.gate_proj / up_proj / down_proj`` per expert
(stacked on load, :mod:`corerun.models.moe`), ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from corerun.models.config import ModelConfig
from corerun.models.llama import ArchOptions, LlamaForCausalLM, LlamaMLP
from corerun.models.moe import MoeConfig, MoeDecoderLayer, expert_modules_mapping
from corerun.models.qwen2 import qwen_layer_types

if TYPE_CHECKING:
    from corerun.distributed.group import TensorParallelGroup
    from corerun.quantization.base import QuantizationMethod


def qwen_experts(config: ModelConfig) -> MoeConfig:
    shared = "shared_expert_intermediate_size" if config.model_type == "qwen2_moe" else None
    return MoeConfig.read(config, ("num_experts", "num_local_experts"), "moe_intermediate_size",
                          renormalize="norm_topk_prob", shared_key=shared)


def is_sparse(config: ModelConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has experts (transformers' rule for both families)."""
    step = config.raw.get("decoder_sparse_step", 1) or 1
    return layer_idx not in (config.raw.get("mlp_only_layers") or ()) and (layer_idx + 1) % step == 0


class QwenMoeDecoderLayer(MoeDecoderLayer):
    def make_mlp(
        self, config: ModelConfig, layer_idx: int, opts: ArchOptions, tp: "TensorParallelGroup | None",
        quant: "QuantizationMethod | None",
    ) -> nn.Module:
        if is_sparse(config, layer_idx):
            return qwen_experts(config).block(config.hidden_size, tp)
        return LlamaMLP(config, opts, tp, quant)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_types(cls, config: ModelConfig) -> tuple[str, ...]:
        return qwen_layer_types(config)  # sliding from max_window_layers on, as Qwen2
    decoder_layer: ClassVar[type[nn.Module]] = QwenMoeDecoderLayer
    conformance_config: ClassVar[dict[str, Any]] = {  # layer 1 keeps a dense MLP
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [1],
    }

    def __init__(self, config: ModelConfig, tp: "TensorParallelGroup | None" = None,
                 quant: "QuantizationMethod | None" = None) -> None:
        experts = qwen_experts(config)  # a bad expert setting is refused before anything is allocated
        super().__init__(config, tp, quant)
        self.packed_modules_mapping = {  # type: ignore[misc]  # the experts' entries first: they also hold gate_proj
            **expert_modules_mapping(experts.num_experts, {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}),
            **LlamaForCausalLM.packed_modules_mapping,
        }

    @classmethod
    def arch_options(cls, config: ModelConfig) -> ArchOptions:
        return ArchOptions(qkv_bias=bool(config.raw.get("qkv_bias", True)))


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    conformance_config: ClassVar[dict[str, Any]] = {  # layer 0 keeps a dense MLP
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "mlp_only_layers": [0],
    }

    @classmethod
    def arch_options(cls, config: ModelConfig) -> ArchOptions:
        return ArchOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, qk_norm=True)
