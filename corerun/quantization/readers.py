"""Read a quantized checkpoint's tensors as one :class:`QuantizedTensor` per linear layer.

:func:`group_weights` passes the checkpoint's ``(name, tensor)`` stream through, except the parts of
quantized layers (``...q_proj.qweight``, ``...q_proj.weight_scale``, ...), which it holds until a
layer's parts are all there and then yields as ``(layer + ".weight", QuantizedTensor)``: the name the
float weight would have had, so the model loader and the layers' merged and tensor-parallel cuts
work unchanged.  A reader per ``quant_method`` says which parts it reads and builds the tensor from
``config.json``'s ``quantization_config``; every field it cannot read is refused naming the field,
its value and what it reads.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Iterator, Mapping

import torch

from corerun.quantization import schemes
from corerun.quantization.int_packing import per_word
from corerun.quantization.quantized_tensor import QuantizedLoadError, QuantizedTensor

FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def _field(config: Mapping[str, Any], key: str, default: Any, allowed: Iterable[Any], where: str = "quantization_config") -> Any:
    value = config.get(key, default)
    allowed = list(allowed)
    if value not in allowed:
        raise QuantizedLoadError(f"{where}.{key}: {value!r} is not read by corerun; it reads {', '.join(map(repr, allowed))}")
    return value


class Reader:
    """Which tensor names are parts of a quantized layer, which parts complete one, and how to build it."""

    parts: frozenset[str] = frozenset()

    def is_part(self, suffix: str, tensor: torch.Tensor) -> bool:
        return suffix in self.parts

    def expected(self, prefix: str) -> frozenset[str]:
        return self.parts

    def build(self, prefix: str, parts: dict[str, torch.Tensor]) -> QuantizedTensor:
        raise NotImplementedError


def group_weights(weights: Iterable[tuple[str, Any]], reader: Reader) -> Iterator[tuple[str, Any]]:
    """The checkpoint stream with each quantized layer's parts gathered into one tensor (module docstring)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, suffix = name.rpartition(".")
        if not prefix or not reader.is_part(suffix, tensor):
            yield name, tensor
            continue
        have = pending.setdefault(prefix, {})
        have[suffix] = tensor
        if reader.expected(prefix) <= have.keys():
            yield f"{prefix}.weight", reader.build(prefix, pending.pop(prefix))
    for prefix, have in pending.items():  # layers without their optional parts, in file order
        yield f"{prefix}.weight", reader.build(prefix, have)


def _need(prefix: str, parts: Mapping[str, torch.Tensor], required: Iterable[str], what: str) -> None:
    missing = sorted(set(required) - parts.keys())
    if missing:
        raise QuantizedLoadError(
            f"{prefix}: {what} needs {', '.join(prefix + '.' + m for m in missing)}, which the checkpoint does not have "
            f"(found {', '.join(sorted(parts))})"
        )


class GPTQReader(Reader):
    parts = frozenset({"qweight", "qzeros", "scales", "g_idx"})

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.bits = _field(config, "bits", 4, (4, 8))
        self.group_size = int(config.get("group_size", 128))
        fmt = _field(config, "checkpoint_format", "gptq", ("gptq", "gptq_v2"))
        self.zeros_offset = 1 if fmt == "gptq" else 0  # gptq (v1) stores each zero point minus one

    def build(self, prefix: str, parts: dict[str, torch.Tensor]) -> QuantizedTensor:
        _need(prefix, parts, ("qweight", "qzeros", "scales"), "GPTQ")
        n = per_word(self.bits)
        cols, out = parts["qweight"].shape[0] * n, parts["qweight"].shape[1]
        group = cols if self.group_size <= 0 else self.group_size
        if "g_idx" not in parts:
            parts["g_idx"] = (torch.arange(cols) // group).to(torch.int32)
        scheme = schemes.gptq(self.bits, group, self.zeros_offset)
        groups = parts["scales"].shape[0]
        schemes.check_shapes(prefix, scheme, parts, {"qzeros": (groups, out // n), "scales": (groups, out), "g_idx": (cols,)})
        if int(parts["g_idx"].max()) >= groups or int(parts["g_idx"].min()) < 0:
            raise QuantizedLoadError(f"{prefix}.g_idx: group indices outside [0, {groups}) (scales has {groups} groups)")
        return QuantizedTensor(prefix, scheme, parts, out, cols)


class AWQReader(Reader):
    parts = frozenset({"qweight", "qzeros", "scales"})

    def __init__(self, config: Mapping[str, Any]) -> None:
        config = {"bits": config.get("w_bit", 4), "group_size": config.get("q_group_size", 128), **config}  # AutoAWQ's older keys
        _field(config, "bits", 4, (4,))
        _field(config, "version", "gemm", ("gemm", "GEMM"))
        _field(config, "zero_point", True, (True,))
        self.group_size = int(config["group_size"])

    def build(self, prefix: str, parts: dict[str, torch.Tensor]) -> QuantizedTensor:
        _need(prefix, parts, self.parts, "AWQ")
        cols, out = parts["qweight"].shape[0], parts["qweight"].shape[1] * 8
        group = cols if self.group_size <= 0 else self.group_size
        scheme = schemes.awq(group)
        if cols % group:
            raise QuantizedLoadError(f"{prefix}.qweight: {cols} input features are not a multiple of the group size {group}")
        schemes.check_shapes(prefix, scheme, parts, {"qzeros": (cols // group, out // 8), "scales": (cols // group, out)})
        return QuantizedTensor(prefix, scheme, parts, out, cols)


class FP8Reader(Reader):
    """``quant_method: fp8`` (vLLM / transformers' FineGrained-less FP8): float8 ``weight``, per-tensor
    ``weight_scale`` (one per output channel accepted too), ``input_scale`` for static activations."""

    parts = frozenset({"weight", "weight_scale"})

    def __init__(self, config: Mapping[str, Any]) -> None:
        if config.get("weight_block_size") is not None:
            raise QuantizedLoadError(
                f"quantization_config.weight_block_size: {config['weight_block_size']!r}: block-wise FP8 scales are not "
                "read by corerun; it reads per-tensor or per-channel weight_scale (weight_block_size null)"
            )
        _field(config, "activation_scheme", "dynamic", ("dynamic", "static"))

    def is_part(self, suffix: str, tensor: torch.Tensor) -> bool:
        return suffix == "weight_scale" or suffix == "input_scale" or (suffix == "weight" and tensor.dtype in FLOAT8)

    def build(self, prefix: str, parts: dict[str, torch.Tensor]) -> QuantizedTensor:
        _need(prefix, parts, self.parts, "FP8")
        return _fp8(prefix, parts)


def _fp8(prefix: str, parts: dict[str, torch.Tensor]) -> QuantizedTensor:
    out, cols = parts["weight"].shape
    if parts["weight"].dtype != getattr(torch, "float8_e4m3fn", None):
        raise QuantizedLoadError(f"{prefix}.weight: FP8 weights are read as float8_e4m3fn, got {parts['weight'].dtype}")
    channel = parts["weight_scale"].numel() == out and out > 1
    if parts["weight_scale"].numel() not in (1, out):
        raise QuantizedLoadError(f"{prefix}.weight_scale: {parts['weight_scale'].numel()} values; expected 1 (per tensor) or {out} (per channel)")
    parts["weight_scale"] = parts["weight_scale"].reshape(out if channel else 1, 1)
    return QuantizedTensor(prefix, schemes.fp8(channel), parts, out, cols)


class CompressedTensorsReader(Reader):
    """llm-compressor's ``quant_method: compressed-tensors``: ``config_groups`` (each with ``targets``,
    ``weights``, ``input_activations`` and ``format``), ``ignore``, and a top-level ``format``."""

    parts = frozenset({"weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "input_scale"})

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.format = config.get("format")  # layers in its ``ignore`` list arrive as float weights and pass through
        groups = config.get("config_groups") or {}
        if not isinstance(groups, Mapping) or not groups:
            raise QuantizedLoadError("quantization_config.config_groups: missing or empty; a compressed-tensors config names its schemes there")
        self.groups = [(name, dict(g)) for name, g in groups.items()]
        for name, group in self.groups:
            self._scheme_of(name, group)  # refuse what cannot be read before any weight is

    def is_part(self, suffix: str, tensor: torch.Tensor) -> bool:
        return suffix in self.parts or (suffix == "weight" and tensor.dtype in (torch.int8, *FLOAT8))

    def expected(self, prefix: str) -> frozenset[str]:
        name, group = self._group(prefix)
        kind, _ = self._scheme_of(name, group)
        weights = group.get("weights") or {}
        if kind == "pack-quantized":
            want = {"weight_packed", "weight_scale", "weight_shape"}
            want |= set() if weights.get("symmetric", True) else {"weight_zero_point"}
            # actorder "group" (alias "dynamic") stores each input's group, weight_g_idx; "weight" (alias
            # "static") only changed the order of calibration, not the format
            return frozenset(want | ({"weight_g_idx"} if weights.get("actorder") in ("group", "dynamic", True) else set()))
        static = (group.get("input_activations") or {}).get("dynamic") is False
        return frozenset({"weight", "weight_scale"} | ({"input_scale"} if static else set()))

    def _group(self, prefix: str) -> tuple[str, dict[str, Any]]:
        for name, group in self.groups:
            for target in group.get("targets") or []:
                if target == "Linear" or _matches(target, prefix):
                    return name, group
        raise QuantizedLoadError(
            f"{prefix}: quantized in the checkpoint, but no quantization_config.config_groups entry targets it "
            f"(targets: {[t for _, g in self.groups for t in g.get('targets') or []]})"
        )

    def _scheme_of(self, name: str, group: Mapping[str, Any]) -> tuple[str, Any]:
        where = f"quantization_config.config_groups.{name}"
        fmt = group.get("format") or self.format
        weights = group.get("weights") or {}
        kind = _field(weights, "type", "int", ("int", "float"), f"{where}.weights")
        strategy = _field(weights, "strategy", "tensor", ("tensor", "channel", "group"), f"{where}.weights")
        if fmt == "pack-quantized":
            _field(weights, "num_bits", 4, (4, 8), f"{where}.weights")
            return fmt, None
        if fmt in ("int-quantized", "naive-quantized") and kind == "int":
            _field(weights, "num_bits", 8, (8,), f"{where}.weights")
            _field(weights, "symmetric", True, (True,), f"{where}.weights")
            _field(weights, "strategy", strategy, ("tensor", "channel"), f"{where}.weights")
            return "int-quantized", _activations(group.get("input_activations"), f"{where}.input_activations")
        if fmt in ("float-quantized", "naive-quantized") and kind == "float":
            _field(weights, "num_bits", 8, (8,), f"{where}.weights")
            _field(weights, "strategy", strategy, ("tensor", "channel"), f"{where}.weights")
            return "float-quantized", None
        raise QuantizedLoadError(
            f"{where}: format {fmt!r} with {kind} weights is not read by corerun; it reads pack-quantized (int weights of "
            "4 or 8 bits), int-quantized (int8 weights, W8A8 or W8A16) and float-quantized (FP8 e4m3 weights)"
        )

    def build(self, prefix: str, parts: dict[str, torch.Tensor]) -> QuantizedTensor:
        name, group = self._group(prefix)
        kind, activations = self._scheme_of(name, group)
        _need(prefix, parts, self.expected(prefix), f"compressed-tensors {kind}")
        weights = group.get("weights") or {}
        if kind == "float-quantized":
            return _fp8(prefix, parts)
        if kind == "int-quantized":
            out, cols = parts["weight"].shape
            channel = parts["weight_scale"].numel() == out and weights.get("strategy") == "channel"
            if parts["weight_scale"].numel() != (out if channel else 1):
                raise QuantizedLoadError(
                    f"{prefix}.weight_scale: {parts['weight_scale'].numel()} values for strategy {weights.get('strategy')!r}; "
                    f"expected {out if channel else 1}"
                )
            parts["weight_scale"] = parts["weight_scale"].reshape(-1, 1)
            return QuantizedTensor(prefix, schemes.int8(channel, activations), parts, out, cols)
        out, cols = (int(v) for v in parts.pop("weight_shape").tolist())
        bits, symmetric = int(weights.get("num_bits", 4)), bool(weights.get("symmetric", True))
        group_size = int(weights["group_size"]) if weights.get("strategy") == "group" else None
        scheme = schemes.pack_quantized(bits, group_size, symmetric, bool(weights.get("actorder")) and "weight_g_idx" in parts)
        n = per_word(bits)
        n_groups = -(-cols // group_size) if group_size else 1
        schemes.check_shapes(prefix, scheme, parts, {
            "weight_packed": (out, -(-cols // n)), "weight_scale": (out, n_groups),
            "weight_zero_point": (-(-out // n), n_groups), "weight_g_idx": (cols,),
        })
        return QuantizedTensor(prefix, scheme, parts, out, cols)


def _matches(target: str, prefix: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], prefix) is not None
    return prefix == target or prefix.endswith("." + target)


def _activations(args: Mapping[str, Any] | None, where: str) -> str | None:
    """``"int8-dynamic"`` (per token), ``"int8-static"`` (one ``input_scale``), or ``None`` (W8A16)."""
    if not args:
        return None
    _field(args, "type", "int", ("int",), where)
    _field(args, "num_bits", 8, (8,), where)
    _field(args, "symmetric", True, (True,), where)
    if args.get("dynamic", False) is True:
        _field(args, "strategy", "token", ("token",), where)
        return "int8-dynamic"
    _field(args, "strategy", "tensor", ("tensor",), where)
    return "int8-static"


READERS = {"gptq": GPTQReader, "awq": AWQReader, "fp8": FP8Reader, "compressed-tensors": CompressedTensorsReader}
