"""Qwen3 (dense): Llama's layers plus a per-head RMSNorm of q and k before RoPE; an explicit head_dim;
biases on q/k/v/o only when ``attention_bias`` says so (off in every released checkpoint)."""

from __future__ import annotations

from corerun.models.config import ModelConfig
from corerun.models.llama import ArchOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_options(cls, config: ModelConfig) -> ArchOptions:
        return ArchOptions(qkv_bias=config.attention_bias, o_bias=config.attention_bias, mlp_bias=False, qk_norm=True)
