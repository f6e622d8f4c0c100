"""Round-to-nearest quantization of a float model folder into compressed-tensors format (``corerun quantize``).

Each decoder projection (``q_proj`` ... ``down_proj``) is quantized; embeddings, norms and the LM head
stay as they are.  The output is what llm-compressor writes for the same schemes, so vLLM and
compressed-tensors read it too:

- ``int8`` (W8A8): ``weight`` int8 ``[out, in]``, ``weight_scale`` ``[out, 1]`` with
  ``s = max|w_j| / 127`` per output channel, ``q = clamp(round(w / s), -128, 127)``; activations
  quantized per token at run time (``format: int-quantized``).
- ``int4`` (W4A16): groups of ``group_size`` input features, symmetric, ``s = max|w_g| / 7.5``,
  ``q = clamp(round(w / s), -8, 7)``; ``weight_packed`` int32 ``[out, ceil(in / 8)]`` of ``q + 8``,
  ``weight_scale`` ``[out, ceil(in / group_size)]``, ``weight_shape`` ``[2]`` (``format: pack-quantized``).
  ``asymmetric``: ``s = (max - min) / 15`` over the group's range (zero included), zero point
  ``z = round(-min / s) - 8``, ``q = clamp(round(w / s) + z, -8, 7)``, ``w = s (q - z)``;
  ``weight_zero_point`` packed along the output ``[ceil(out / 8), groups]``.

Scales are kept in the checkpoint's own float dtype and the codes computed from the rounded scale, so
each weight is within half a step of its float value (a value on the top edge of an int4 group clamps
to 7: half a step there too).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import torch

from corerun.quantization.int_packing import pack

METHODS = ("int8", "int4")
PROJECTION = re.compile(r"\.layers\.\d+\..*(q|k|v|o|gate|up|down)_proj\.weight$")
TARGETS = ["re:.*(q|k|v|o|gate|up|down)_proj$"]
# not copied: the float weights, and corerun's markers of where a folder came from (it is no longer that)
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.gguf", "corerun-gguf.json",
                "corerun-source.json")


def quantize_int8(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """float ``w`` ``[out, in]`` -> ``weight`` int8, ``weight_scale`` ``[out, 1]`` in ``w``'s dtype."""
    scale = (w.float().abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-12).to(w.dtype)
    q = torch.round(w.float() / scale.float()).clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}


def quantize_int4(w: torch.Tensor, group_size: int, asymmetric: bool = False) -> dict[str, torch.Tensor]:
    """float ``w`` ``[out, in]`` -> ``weight_packed``, ``weight_scale`` ``[out, groups]``, ``weight_shape``
    (``asymmetric``: and ``weight_zero_point``, packed ``[ceil(out / 8), groups]``)."""
    out, cols = w.shape
    groups = -(-cols // group_size)
    wf = torch.nn.functional.pad(w.float(), (0, groups * group_size - cols)).reshape(out, groups, group_size)
    if asymmetric:  # the group's [min, max] (zero included) on 16 levels; the zero point puts 0.0 on a level
        lo, hi = wf.amin(dim=-1, keepdim=True).clamp(max=0), wf.amax(dim=-1, keepdim=True).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-12).to(w.dtype)
        zero = (torch.round(-lo / scale.float()) - 8).clamp(-8, 7)
    else:
        scale = (wf.abs().amax(dim=-1, keepdim=True) / 7.5).clamp_min(1e-12).to(w.dtype)
        zero = torch.zeros_like(scale, dtype=torch.float32)
    q = (torch.round(wf / scale.float()) + zero).clamp(-8, 7).reshape(out, -1)[:, :cols]
    parts = {"weight_packed": pack(q.long() + 8, 4, dim=1), "weight_scale": scale[..., 0], "weight_shape": torch.tensor([out, cols])}
    if asymmetric:
        parts["weight_zero_point"] = pack(zero[..., 0].long() + 8, 4, dim=0)
    return parts


def quantization_config(method: str, group_size: int, asymmetric: bool = False) -> dict[str, Any]:
    """The ``quantization_config`` compressed-tensors writes for ``method``."""
    if method == "int8":
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None}
        activations = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
                       "group_size": None, "block_structure": None, "actorder": None, "observer": None, "observer_kwargs": {}}
        fmt = "int-quantized"
    else:
        weights = {"num_bits": 4, "type": "int", "symmetric": not asymmetric, "strategy": "group", "group_size": group_size}
        activations, fmt = None, "pack-quantized"
    weights.update({"dynamic": False, "block_structure": None, "actorder": None, "observer": "minmax", "observer_kwargs": {}})
    group = {"targets": TARGETS, "weights": weights, "input_activations": activations, "output_activations": None, "format": fmt}
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None,
    }


def quantized_tensors(
    weights: Iterator[tuple[str, torch.Tensor]], method: str, group_size: int, asymmetric: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint stream with every projection's ``weight`` replaced by its quantized parts."""
    for name, t in weights:
        if PROJECTION.search(name) is None or t.dim() != 2 or not t.is_floating_point():
            yield name, t
            continue
        parts = quantize_int8(t) if method == "int8" else quantize_int4(t, group_size, asymmetric)
        prefix = name.removesuffix(".weight")
        yield from ((f"{prefix}.{k}", v.contiguous()) for k, v in parts.items())


def safetensors_files(model_dir: Path) -> list[Path]:
    """``model.safetensors``, else the shards ``model.safetensors.index.json`` names, else every ``*.safetensors``."""
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return [model_dir / n for n in sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no safetensors weights; corerun quantize reads safetensors model folders")
    return files


def _read(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def quantize_folder(model_dir: Path, out: Path, method: str, group_size: int = 128, asymmetric: bool = False) -> Path:
    """Write ``model_dir`` quantized by ``method`` into ``out`` (created; must not hold a model already);
    ``asymmetric``: int4 groups with zero points."""
    from safetensors.torch import save_file

    if method not in METHODS:
        raise ValueError(f"method: {method!r} is not one corerun quantize writes; use one of {', '.join(METHODS)}")
    if group_size <= 0 or group_size % 8:
        raise ValueError(f"group_size: {group_size}; use a positive multiple of 8 (128 is llm-compressor's default)")
    if asymmetric and method != "int4":
        raise ValueError(f"asymmetric: {method} is symmetric only (int8 weights and activations); zero points are an int4 option")
    files = safetensors_files(model_dir)
    if (out / "config.json").exists():
        raise ValueError(f"--out {out} already holds a model (config.json); choose an empty or new folder")
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for i, path in enumerate(files, start=1):
        shard = f"model-{i:05d}-of-{len(files):05d}.safetensors" if len(files) > 1 else "model.safetensors"
        tensors = dict(quantized_tensors(_read(path), method, group_size, asymmetric))
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in tensors})
    if len(files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    for item in model_dir.iterdir():  # tokenizer, generation config, chat template, ...
        if item.is_file() and item.name != "config.json" and not any(item.match(p) for p in WEIGHT_FILES):
            shutil.copy2(item, out / item.name)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = quantization_config(method, group_size, asymmetric)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out
