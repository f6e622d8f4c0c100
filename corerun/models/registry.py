"""Model classes by the ``architectures`` name in ``config.json``."""

from __future__ import annotations

from torch import nn

from corerun.models.config import ModelConfig
from corerun.models.errors import UnsupportedModelError
from corerun.models.llama import LlamaForCausalLM, MistralForCausalLM
from corerun.models.qwen2 import Qwen2ForCausalLM
from corerun.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,  # Llama 2/3, SmolLM/SmolLM2, TinyLlama, ...
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_CLASSES)


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    """The class for the first of ``config.architectures`` that corerun supports."""
    for arch in config.architectures:
        if arch in MODEL_CLASSES:
            return MODEL_CLASSES[arch]
    got = ", ".join(config.architectures) if config.architectures else "none listed"
    raise UnsupportedModelError(
        f"config.json architectures [{got}] (model_type {config.model_type!r}) not supported; "
        f"corerun supports: {', '.join(supported_architectures())}"
    )
