"""Phi-3 (dense): Llama's layers; the checkpoint stores q/k/v fused as ``qkv_proj`` and gate/up as
``gate_up_proj`` (the layout of corerun's merged layers), each split into its shards on load, which
also cuts a tensor-parallel rank's rows per shard.  LongRoPE (``rope_scaling.type: longrope``) comes
from :mod:`corerun.models.rotary` (short factors; ``max_model_len`` capped at the original length)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Hashable

from torch import nn

from corerun.models.config import ModelConfig
from corerun.models.layers import MergedLinear, WeightShapeError
from corerun.models.llama import ArchOptions, LlamaForCausalLM

if TYPE_CHECKING:
    from corerun.distributed.group import TensorParallelGroup
    from corerun.quantization.base import QuantizationMethod


def fused_loader(layer: MergedLinear, full_sizes: dict[str, int]):
    """A ``weight_loader`` taking the whole fused checkpoint tensor (shard ``None``: rows in ``full_sizes``
    order) and handing each shard's rows to the layer's own loader."""
    shard_loader = layer.weight_loader

    def load(param: nn.Parameter, loaded_weight: Any, shard_id: Hashable = None) -> None:
        if shard_id is not None:
            return shard_loader(param, loaded_weight, shard_id)
        if loaded_weight.shape[0] != sum(full_sizes.values()):
            raise WeightShapeError((sum(full_sizes.values()), *param.shape[1:]), tuple(loaded_weight.shape))
        offset = 0
        for shard, size in full_sizes.items():
            shard_loader(param, loaded_weight.narrow(0, offset, size), shard)
            offset += size

    return load


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str]]] = {}  # the checkpoint is already merged
    conformance_config: ClassVar[dict[str, Any]] = {"pad_token_id": 0}

    def __init__(self, config: ModelConfig, tp: "TensorParallelGroup | None" = None,
                 quant: "QuantizationMethod | None" = None) -> None:
        super().__init__(config, tp, quant)
        q, kv, i = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
        for layer in self.model.layers:
            for merged, sizes in ((layer.self_attn.qkv_proj, {"q": q, "k": kv, "v": kv}),
                                  (layer.mlp.gate_up_proj, {"gate": i, "up": i})):
                merged.weight.weight_loader = fused_loader(merged, sizes)
                merged.weight.shard_ids = (None,)

    @classmethod
    def arch_options(cls, config: ModelConfig) -> ArchOptions:
        return ArchOptions()
