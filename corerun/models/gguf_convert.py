"""Convert a GGUF checkpoint into a Hugging Face safetensors folder, with transformers and the ``gguf`` package.

transformers dequantizes the GGUF tensors and undoes llama.cpp's q/k row permutation; the folder it
writes (``config.json``, ``generation_config.json``, ``model.safetensors``, tokenizer files and chat
template) is an ordinary model folder for :func:`corerun.models.load_model`.

The weights go through ``load_gguf_checkpoint`` rather than ``from_pretrained(gguf_file=...)``:
the latter insists on the ``accelerate`` package, which this path does not need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from corerun.models.errors import ModelLoadError

_INSTALL = "pip install 'corerun[hf]' (transformers and gguf)"


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: torch.dtype = torch.bfloat16,
    on_step: Callable[[str], None] = lambda step: None,
) -> None:
    """Write the model in ``gguf_path`` to ``out_dir`` (which must exist) as safetensors in ``dtype``.

    ``on_step`` is called with a short description before each stage (for progress display).
    """
    try:
        import gguf  # noqa: F401  (transformers reads GGUF through it)
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as exc:
        raise ModelLoadError(f"converting {gguf_path.name} needs transformers and gguf ({exc}); {_INSTALL}") from exc

    folder, name = gguf_path.parent, gguf_path.name
    on_step("reading the GGUF header")
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    on_step("dequantizing the weights")
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if config.tie_word_embeddings:
        missing = [m for m in missing if m != "lm_head.weight"]
        model.tie_weights()
    if missing or unexpected:
        raise ModelLoadError(
            f"{gguf_path}: the GGUF tensors do not fill {type(model).__name__}: missing {missing}, unexpected {unexpected}"
        )
    on_step("writing model.safetensors")
    model.save_pretrained(out_dir, safe_serialization=True)
    on_step("converting the tokenizer")
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
