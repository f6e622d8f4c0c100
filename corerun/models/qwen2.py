"""Qwen2: Llama's layers with a bias on q/k/v (always) and none on o_proj or the MLP."""

from __future__ import annotations

from corerun.models.config import ModelConfig
from corerun.models.llama import ArchOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def arch_options(cls, config: ModelConfig) -> ArchOptions:
        return ArchOptions(qkv_bias=True, o_bias=False, mlp_bias=False)
