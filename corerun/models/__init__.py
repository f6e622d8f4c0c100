"""corerun's models: the Llama family (Llama, SmolLM, Mistral, Qwen2, Qwen3), their loader and the built-in default model.

    from corerun.models import load_model, default_model_dir
    model, config = load_model(default_model_dir(), dtype="float32", device="cpu")
    hidden = model(input_ids, positions, ctx)          # ctx: corerun.protocols.forward_context.AttentionContext
    logits = model.compute_logits(hidden[last_rows])   # float32 [N, vocab]
"""

from corerun.models.config import ModelConfig, RopeConfig
from corerun.models.default import cache_dir, default_model_dir
from corerun.models.errors import ModelLoadError, UnsupportedModelError
from corerun.models.loader import load_model
from corerun.models.registry import ModelFamily, get_model_class, model_family, supported_architectures

__all__ = [
    "ModelConfig",
    "ModelFamily",
    "ModelLoadError",
    "RopeConfig",
    "UnsupportedModelError",
    "cache_dir",
    "default_model_dir",
    "get_model_class",
    "load_model",
    "model_family",
    "supported_architectures",
]
