"""Adapters read from PEFT folders (``adapter_config.json`` + ``adapter_model.safetensors``), checked
against the base model's layers when they load, never in the middle of a batch.

For each ``lora_A`` / ``lora_B`` pair the folder holds (``A`` ``[r, in]``, ``B`` ``[out, r]``), the
module it names (``model.layers.0.self_attn.q_proj``) is found among the model's
:class:`~corerun.lora.layers.LoRATarget` slices: ``q_proj`` is slice ``q`` of ``qkv_proj``; a module
that is itself a merged layer (Phi-3's ``qkv_proj``) feeds every slice with its ``A`` and its rows of
``B``.  Under tensor parallelism each rank keeps its rows of ``B`` (column-parallel layers) or its
columns of ``A`` (row-parallel layers).

Scaling: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``; a module whose rank or
alpha differs (``rank_pattern``, ``alpha_pattern``) has its ratio to the adapter's scaling folded
into its ``B``.  Refused at load, each with a :class:`LoRAError` naming the module, the value and what
would fit: a module the model has no linear layer for (embeddings, the LM head; a mixture-of-experts
block's experts, router or shared expert: those models take adapters on attention), a shape that differs
from the base layer's, a rank above ``lora.max_lora_rank``, DoRA, trained biases, ``modules_to_save``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from corerun.errors import RequestError
from corerun.lora.layers import LoRATarget, in_moe_block
from corerun.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


class LoRAError(RequestError):
    """An adapter cannot be served with this model or configuration (named at load)."""


@dataclass
class LoRAWeights:
    """An adapter as a slot takes it: per target layer, per slice, ``(A [r, in_size], B [size, r])`` in
    this rank's share (``None``: the slice is not adapted); ``scaling`` for the slot."""

    request: LoRARequest
    rank: int
    scaling: float
    layers: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pairs in self.layers.values() for p in pairs if p for t in p)


def _pattern_value(pattern: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``rank_pattern`` / ``alpha_pattern``: the value of the first key matching the module's name or a suffix of it."""
    for key, value in pattern.items():
        if re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def read_config(folder: Path, name: str) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise LoRAError(f"adapter {name!r}: no {CONFIG_FILE} in {str(folder)!r}; a PEFT adapter folder holds "
                        f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"adapter {name!r}: {path} is not readable JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise LoRAError(f"adapter {name!r}: {path} holds {type(cfg).__name__}, expected a JSON object")
    kind = cfg.get("peft_type", "LORA")
    if str(kind).upper() != "LORA":
        raise LoRAError(f"adapter {name!r}: peft_type is {kind!r}; corerun serves LORA adapters only")
    for key, bad, why in (("use_dora", True, "DoRA"), ("fan_in_fan_out", True, "fan_in_fan_out (Conv1D layers)")):
        if cfg.get(key) == bad:
            raise LoRAError(f"adapter {name!r}: {key} is {bad}; {why} is not supported, train with {key}: false")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"adapter {name!r}: bias is {cfg.get('bias')!r}; only bias 'none' is supported (no trained biases)")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"adapter {name!r}: modules_to_save is {cfg['modules_to_save']!r}; full copies of modules are "
                        "not supported, only low-rank pairs")
    for key in ("r", "lora_alpha"):
        value = cfg.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise LoRAError(f"adapter {name!r}: {key} is {value!r} in {path}; expected a positive number")
    return cfg


def load_adapter(request: LoRARequest, targets: dict[str, LoRATarget], max_rank: int) -> LoRAWeights:
    """Read ``request``'s folder and check it against ``targets`` (:func:`corerun.lora.layers.lora_targets`)."""
    from safetensors import safe_open

    name, folder = request.lora_name, Path(request.lora_path)
    if not folder.is_dir():
        raise LoRAError(f"adapter {name!r}: lora_path {request.lora_path!r} is not a folder")
    cfg = read_config(folder, name)
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    rslora = bool(cfg.get("use_rslora", False))

    def scaling(rank: int, a: float) -> float:
        return a / math.sqrt(rank) if rslora else a / rank

    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise LoRAError(f"adapter {name!r}: no {WEIGHTS_FILE} in {str(folder)!r}")
    slices: dict[str, tuple[LoRATarget, int | None]] = {}  # checkpoint module -> (layer, slice index; None: every slice)
    for t in targets.values():
        slices[t.name] = (t, None)
        for i, s in enumerate(t.slices):
            slices[f"{t.parent}.{s.module}"] = (t, i)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt") as f:
        for key in f.keys():
            module, _, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
            kind = kind.removesuffix(".weight")
            if kind not in ("A", "B") or not module:
                raise LoRAError(f"adapter {name!r}: tensor {key!r} is not a lora_A / lora_B weight; corerun serves "
                                "low-rank pairs on linear layers only (no embeddings, biases or magnitudes)")
            pairs.setdefault(module, {})[kind] = f.get_tensor(key)
    if not pairs:
        raise LoRAError(f"adapter {name!r}: {weights_path} holds no lora_A / lora_B tensors")
    out = LoRAWeights(request, 0, scaling(r, alpha))
    layer_names = sorted({t.leaf for t in targets.values()} | {s.module for t in targets.values() for s in t.slices})
    for module, pair in sorted(pairs.items()):
        if module not in slices and in_moe_block(module):
            attention = list(dict.fromkeys(s.module for t in targets.values() if t.parent.endswith("self_attn") for s in t.slices))
            raise LoRAError(f"adapter {name!r}: module {module!r} is part of a mixture-of-experts block (its experts, "
                            f"router or shared expert); corerun serves adapters on such a model's attention "
                            f"projections {attention} (and the MLPs of its dense layers) only")
        if module not in slices:
            raise LoRAError(f"adapter {name!r}: module {module!r} is not a linear layer of this model; adapters may "
                            f"target {layer_names}")
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: module {module!r} has lora_{''.join(pair)} but not both lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        target, index = slices[module]
        rank = int(_pattern_value(cfg.get("rank_pattern") or {}, module, r))
        out_rows = sum(s.full for s in target.slices) if index is None else target.slices[index].full
        if a.shape != (rank, target.in_full) or b.shape != (out_rows, rank):
            raise LoRAError(
                f"adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the base "
                f"layer needs lora_A ({rank}, {target.in_full}) and lora_B ({out_rows}, {rank}) (rank {rank})"
            )
        if rank > max_rank:
            raise LoRAError(f"adapter {name!r}: module {module!r} has rank {rank}, above lora.max_lora_rank={max_rank}; "
                            f"raise max_lora_rank to at least {rank}")
        ratio = scaling(rank, float(_pattern_value(cfg.get("alpha_pattern") or {}, module, alpha))) / out.scaling
        a = a.narrow(1, target.in_start, target.in_size).float()
        b = b.float() * ratio if ratio != 1.0 else b.float()
        layer = out.layers.setdefault(target.name, [None] * len(target.slices))
        offset = 0
        for i, s in enumerate(target.slices):
            if index is None or index == i:
                rows = b.narrow(0, (offset if index is None else 0) + s.start, s.size)
                layer[i] = (a.contiguous(), rows.contiguous())
            offset += s.full
        out.rank = max(out.rank, rank)
    return out
