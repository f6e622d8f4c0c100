"""Mixtral: Llama's attention, and in every layer a sparse block of ``num_local_experts`` SiLU experts
of which each token takes ``num_experts_per_tok``, their softmax weights renormalised to sum to one.

Checkpoint: ``block_sparse_moe.gate`` (the router) and ``block_sparse_moe.experts.N.w1`` (gate),
``w3`` (up), ``w2`` (down) per expert, stacked on load (:mod:`corerun.models.moe`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from corerun.models.config import ModelConfig
from corerun.models.llama import ArchOptions, LlamaForCausalLM
from corerun.models.moe import MoeConfig, MoeDecoderLayer, expert_modules_mapping

if TYPE_CHECKING:
    from corerun.distributed.group import TensorParallelGroup
    from corerun.quantization.base import QuantizationMethod


def mixtral_experts(config: ModelConfig) -> MoeConfig:
    return MoeConfig.read(config, ("num_local_experts",), "intermediate_size", renormalize=True)


class MixtralDecoderLayer(MoeDecoderLayer):
    mlp_attr: ClassVar[str] = "block_sparse_moe"

    def make_mlp(
        self, config: ModelConfig, layer_idx: int, opts: ArchOptions, tp: "TensorParallelGroup | None",
        quant: "QuantizationMethod | None",
    ) -> nn.Module:
        return mixtral_experts(config).block(config.hidden_size, tp)


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer: ClassVar[type[nn.Module]] = MixtralDecoderLayer
    conformance_config: ClassVar[dict[str, Any]] = {"num_local_experts": 4, "num_experts_per_tok": 2}

    def __init__(self, config: ModelConfig, tp: "TensorParallelGroup | None" = None,
                 quant: "QuantizationMethod | None" = None) -> None:
        experts = mixtral_experts(config)  # a bad expert setting is refused before anything is allocated
        super().__init__(config, tp, quant)
        self.packed_modules_mapping = {  # type: ignore[misc]
            **expert_modules_mapping(experts.num_experts, {"w1": "gate", "w3": "up", "w2": "down"}),
            **LlamaForCausalLM.packed_modules_mapping,
        }

    @classmethod
    def arch_options(cls, config: ModelConfig) -> ArchOptions:
        return ArchOptions()
