"""Tiny random Hugging Face model folders, and a way to run corerun's models on them without an engine.

    folder = make_tiny_model(tmp_path, arch="qwen3")          # config.json + model.safetensors, no tokenizer
    folder = make_tiny_model(tmp_path, arch="llama", tie_word_embeddings=True, max_shard_size="40KB")
    logits = corerun_logits(model, token_ids)                  # float32 [T, vocab], one prefill

Every parameter is random (biases and norm weights too), with a fixed seed: a weight loaded into the
wrong place, or not at all, changes the logits.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch

from corerun.testing.numerics import max_rel_err  # noqa: F401  (its home; kept importable from here)

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def tiny_config(arch: str = "llama", **overrides: Any):
    """A small transformers config for ``arch`` (one of :data:`ARCHS`) with ``overrides`` applied."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
    if arch not in classes:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    base = dict(_BASE)
    if arch == "qwen3":
        base["head_dim"] = 32  # explicit and != hidden / heads, as in the real Qwen3 models
    return classes[arch](**{**base, **overrides})


def make_tiny_model(
    tmp_dir: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random ``arch`` model (config.json + safetensors, no tokenizer files) under ``tmp_dir``; return its folder.

    ``overrides`` are config keys (``tie_word_embeddings=True``, ``rope_scaling={...}``, ``num_hidden_layers=3``);
    ``max_shard_size`` (e.g. ``"40KB"``) writes sharded safetensors with ``model.safetensors.index.json``.
    """
    from transformers import AutoModelForCausalLM

    from corerun.bench.hf_run import hf_with_dtype

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = hf_with_dtype(AutoModelForCausalLM.from_config, config, dtype=torch.float32)
    randomize_(model, seed)
    model = model.to(dtype)
    folder = _fresh_folder(Path(tmp_dir), f"tiny-{arch}")
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def randomize_(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every parameter a random value of a sensible scale (none left at zero or one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:  # [out, in]: unit-variance outputs for unit-variance inputs
                p.copy_(noise / math.sqrt(p.shape[-1]))


def _fresh_folder(parent: Path, stem: str) -> Path:
    parent.mkdir(parents=True, exist_ok=True)
    folder, n = parent / stem, 1
    while folder.exists():
        n += 1
        folder = parent / f"{stem}-{n}"
    folder.mkdir()
    return folder


def hf_model(model_dir: str | Path) -> torch.nn.Module:
    """The folder loaded by Hugging Face transformers, float32, eager attention."""
    from transformers import AutoModelForCausalLM

    from corerun.bench.hf_run import hf_with_dtype

    return hf_with_dtype(AutoModelForCausalLM.from_pretrained, str(model_dir), dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(model: torch.nn.Module | str | Path, token_ids: Sequence[int]) -> torch.Tensor:
    """Hugging Face transformers' float32 logits ``[T, vocab]`` for one prompt (``model``: loaded, or a folder)."""
    if not isinstance(model, torch.nn.Module):
        model = hf_model(model)
    with torch.no_grad():
        return model(torch.tensor([list(token_ids)])).logits[0].float()


def load_corerun_model(model: str | Path, *, dtype: torch.dtype = torch.float32, quant: Any = None) -> tuple[torch.nn.Module, Any]:
    """corerun's model and its ``ModelConfig``, with no engine, from a folder or a ``.gguf`` file (read
    natively, as the engine does), ``quant`` (a quantization method object, e.g. a plugin's) applied
    at load, on CPU: for a method's tests of its layers' outputs against a float64 reference."""
    from corerun.models.loader import load_model

    path = Path(model)
    if path.suffix == ".gguf":
        from corerun.models.gguf_convert import gguf_model_dir

        path = gguf_model_dir(path)
    return load_model(path, dtype=dtype, quant=quant)


def corerun_logits(
    model: torch.nn.Module,
    token_ids: Sequence[int],
    *,
    block_size: int = 4,
    chunks: Sequence[int] | None = None,
) -> torch.Tensor:
    """Run ``token_ids`` through a corerun model with the torch reference attention; float32 logits ``[T, vocab]``.

    The prompt is prefilled in ``chunks`` (token counts summing to ``len(token_ids)``; default one
    chunk), each chunk attending to the earlier ones through the paged KV cache; a chunk of one token
    is a decode step.  Blocks are assigned in a scrambled order so that a wrong slot mapping shows.
    """
    from corerun.attention.torch_backend import TorchAttentionBackend
    from corerun.protocols.forward_context import AttentionContext
    from corerun.protocols.step_layout import requests_step

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    total = len(token_ids)
    chunks = list(chunks) if chunks is not None else [total]
    if sum(chunks) != total:
        raise ValueError(f"chunks {chunks} do not add up to the {total} tokens")
    backend = TorchAttentionBackend(model.attention_spec(dtype, block_size, device))
    num_blocks = -(-total // block_size)
    kv_caches = [backend.allocate_kv_cache(num_blocks + 2).fill_(float("nan")) for _ in range(model.num_layers)]
    table = torch.randperm(num_blocks + 2, generator=torch.Generator().manual_seed(7))[:num_blocks].tolist()
    token_ids = list(token_ids)
    out, start = [], 0
    for n in chunks:
        inputs = requests_step([start], [n], [table], block_size, device, input_ids=token_ids[start : start + n])
        batch = inputs.batch
        ctx = AttentionContext(backend, backend.plan(batch), kv_caches)
        with torch.no_grad():
            hidden = model(inputs.input_ids, inputs.positions, ctx)
            out.append(model.compute_logits(hidden))
        start += n
    return torch.cat(out).float().cpu()

