"""Qwen2: Llama's layers with a bias on q/k/v (always) and none on o_proj or the MLP; with
``use_sliding_window``, the layers from ``max_window_layers`` on attend through ``sliding_window``."""

from __future__ import annotations

from typing import Any, ClassVar

from corerun.models.config import ModelConfig
from corerun.models.llama import ArchOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    # layer 0 full, layer 1 through a window of 8, which the suite's prompts run past
    conformance_config: ClassVar[dict[str, Any]] = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}

    @classmethod
    def arch_options(cls, config: ModelConfig) -> ArchOptions:
        return ArchOptions(qkv_bias=True, o_bias=False, mlp_bias=False)

    @classmethod
    def layer_types(cls, config: ModelConfig) -> tuple[str, ...]:
        return qwen_layer_types(config)


def qwen_layer_types(config: ModelConfig) -> tuple[str, ...]:
    """The Qwen families' layers: config.json's ``layer_types`` where it lists them, else with a window
    (``use_sliding_window``) the layers from ``max_window_layers`` on slide and the ones before are full."""
    if config.layer_types:
        return config.layer_types
    first = config.num_layers if config.sliding_window is None else int(config.raw.get("max_window_layers", 28))
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(config.num_layers))
