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


_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def gguf_model_dir(gguf_path: str | Path) -> Path:
    """A model folder for ``gguf_path`` whose weights are read from the file itself, natively.

    ``config.json``, ``generation_config.json`` and the tokenizer are written once from the file's
    metadata by transformers (no weights, a few MB) into ``cache_dir()/models/<stem>-gguf``, with a
    marker naming the file (:data:`corerun.quantization.checkpoint.GGUF_MARKER`); the loader then
    reads the tensors from the ``.gguf`` file.  Rewritten when the file's size or path changes.
    """
    import json
    import shutil
    import tempfile

    from corerun.platform.host import cache_dir
    from corerun.quantization.checkpoint import GGUF_MARKER

    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise ModelLoadError(f"model: {gguf_path} is not a file; give a .gguf file or a model folder")
    source = {"gguf": str(gguf_path), "gguf_bytes": gguf_path.stat().st_size}
    target = cache_dir() / "models" / f"{gguf_path.stem}-gguf"
    try:
        if json.loads((target / GGUF_MARKER).read_text(encoding="utf-8")) == source:
            return target
    except (OSError, json.JSONDecodeError):
        pass
    try:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    except ImportError as exc:
        raise ModelLoadError(f"reading {gguf_path.name}'s config and tokenizer needs transformers and gguf ({exc}); {_INSTALL}") from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        folder, name = gguf_path.parent, gguf_path.name
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        config.architectures = config.architectures or [_ARCHITECTURES.get(config.model_type, config.model_type)]
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
        (tmp / GGUF_MARKER).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")  # last: complete
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


STEP_PREFIX = "corerun-step: "  # a stage announcement on the converting process's stdout


def main(argv: list[str] | None = None) -> int:
    """``python -m corerun.models.gguf_convert GGUF OUT_DIR [DTYPE]``: convert in a process of its own.

    The default model is converted this way so that transformers' model classes, and what they import
    (triton among them, which fixes its interpreter-or-compiled mode when first imported), stay out of
    the engine's process, and the Hugging Face copy of the weights is freed with the process.  Each
    stage is announced on stdout as ``corerun-step: <stage>``; a failure is written to stderr (exit 1).
    """
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: python -m corerun.models.gguf_convert GGUF OUT_DIR [DTYPE]", file=sys.stderr)
        return 2
    dtype = getattr(torch, args[2]) if len(args) == 3 else torch.bfloat16
    try:
        convert_gguf(Path(args[0]), Path(args[1]), dtype=dtype, on_step=lambda stage: print(STEP_PREFIX + stage, flush=True))
    except ModelLoadError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

