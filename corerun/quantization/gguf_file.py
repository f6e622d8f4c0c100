"""Read a ``.gguf`` file's tensors under Hugging Face names, quantized ones kept packed.

llama.cpp names tensors ``blk.N.attn_q.weight``, ``token_embd.weight`` and so on, and for the
``llama`` architecture stores the rows of ``attn_q`` / ``attn_k`` permuted (each head's rotary
halves interleaved).  :func:`gguf_weights` yields ``(hf_name, tensor)`` with the names of
``transformers`` checkpoints and the rows put back in their order (rows are whole block rows, so
packed data is permuted as is): F32/F16/BF16 as ``torch.Tensor``, the block types as
:class:`~corerun.quantization.gguf_tensor.GGUFTensor`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from corerun.quantization.gguf_blocks import LAYOUTS, PLAIN
from corerun.quantization.gguf_tensor import GGUFLoadError, GGUFTensor

ARCHITECTURES = ("llama", "qwen2", "qwen3")  # whose tensor names corerun maps
_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")


def hf_name(name: str) -> str | None:
    """The transformers name of GGUF tensor ``name`` (``None``: not a weight corerun knows)."""
    found = _BLOCK_NAME.match(name)
    if found:
        layer, part, kind = found.groups()
        return f"model.layers.{layer}.{_BLOCK[part]}.{kind}" if part in _BLOCK else None
    stem, _, kind = name.rpartition(".")
    return f"{_TOP[stem]}.{kind}" if stem in _TOP and kind in ("weight", "bias") else None


def unpermute_rows(rows: int, num_heads: int) -> torch.Tensor:
    """The row order undoing llama.cpp's q/k permutation: ``hf = gguf[order]`` for ``rows = heads * head_dim``."""
    half = rows // num_heads // 2
    return torch.arange(rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(-1)


def _field(reader: "object", key: str) -> object:
    field = reader.fields.get(key)  # type: ignore[attr-defined]
    return None if field is None else field.contents()


def gguf_types(path: str | Path) -> frozenset[str]:
    """The GGML types of the tensors in ``path``."""
    from gguf import GGUFReader

    return frozenset(t.tensor_type.name for t in GGUFReader(str(path)).tensors)


def gguf_weights(path: str | Path) -> Iterator[tuple[str, "torch.Tensor | GGUFTensor"]]:
    """``(transformers name, tensor)`` for every tensor in ``path`` (see the module docstring)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFLoadError(f"{path}: general.architecture is {arch!r}; corerun reads GGUF files of {', '.join(ARCHITECTURES)}")
    heads = {"q_proj": _field(reader, f"{arch}.attention.head_count"), "k_proj": _field(reader, f"{arch}.attention.head_count_kv")}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise GGUFLoadError(f"{path}: tensor {t.name} ({t.tensor_type.name}) has no place in a {arch} model")
        type_name = t.tensor_type.name
        if type_name not in LAYOUTS:
            raise GGUFLoadError(
                f"{path}: tensor {t.name} has type {type_name}, which corerun does not read; it reads {', '.join(LAYOUTS)}"
            )
        shape = [int(n) for n in reversed(t.shape)]  # GGUF lists the fastest dimension first
        data = torch.from_numpy(np.array(t.data))
        if type_name in PLAIN:
            tensor: torch.Tensor | GGUFTensor = data.view(torch.uint8).view(
                {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
            ).reshape(shape)
        else:
            tensor = GGUFTensor(t.name, type_name, data.reshape(shape[0], -1), shape[-1])
        proj = name.split(".")[-2]
        if arch == "llama" and proj in heads and name.endswith(".weight"):
            order = unpermute_rows(shape[0], int(heads[proj]))  # type: ignore[arg-type]
            tensor = _rows(tensor, order)
        yield name, tensor


def _rows(tensor: "torch.Tensor | GGUFTensor", order: torch.Tensor) -> "torch.Tensor | GGUFTensor":
    if isinstance(tensor, GGUFTensor):
        return GGUFTensor(tensor.name, tensor.type_name, tensor.data[order], tensor.cols)
    return tensor[order]
