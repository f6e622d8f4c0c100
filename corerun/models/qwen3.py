"""Qwen3 (dense): Llama's layers plus a per-head RMSNorm of q and k before RoPE; an explicit head_dim;
biases on q/k/v/o only when ``attention_bias`` says so (off in every released checkpoint)."""

from __future__ import annotations

from corerun.models.config import ModelConfig
from corerun.models.llama import ArchOptions, LlamaForCausalLM
from corerun.models.qwen2 import qwen_layer_types


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def layer_types(cls, config: ModelConfig) -> tuple[str, ...]:
        return qwen_layer_types(config)  # sliding from max_window_layers on, as Qwen2

    @classmethod
    def arch_options(cls, config: ModelConfig) -> ArchOptions:
        return ArchOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, mlp_bias=False, qk_norm=True)
