"""Broken quantization methods, each a built-in (``gguf``, ``gptq``, ``awq``, ``compressed-tensors``) with
one fault, that ``QuantizationSuite`` must reject (``fp8`` too)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
from torch import nn

from corerun.quantization import schemes
from corerun.quantization.int_packing import unpack
from corerun.quantization.packed_method import AWQMethod, CompressedTensorsMethod, FP8Method, GPTQMethod
from corerun.quantization.quantized_tensor import QuantizedTensor

from corerun.quantization.gguf_method import GGUFMethod
from corerun.quantization.gguf_tensor import GGUFTensor


class _Faulty(GGUFMethod):
    def fault(self, blocks: torch.Tensor, type_name: str) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        parts = []
        for i, shard_id in enumerate(layer.gguf_shards):
            kind = layer.gguf_types[shard_id]
            blocks = getattr(layer, f"gguf_blocks_{i}").clone()
            parts.append(GGUFTensor("w", kind, self.fault(blocks, kind), layer.gguf_in_features).dequantize(dtype))
        return torch.cat(parts, 0)


class IgnoresMinimum(_Faulty):
    """Q4_1 decoded without its minimum ``m`` (a wrong zero point)."""

    def fault(self, blocks: torch.Tensor, type_name: str) -> torch.Tensor:
        if type_name == "Q4_1":
            blocks.view(-1, 20)[:, 2:4] = 0
        return blocks


class SwappedNibbles(_Faulty):
    """Q4_0 / Q4_1 codes read high nibble first."""

    def fault(self, blocks: torch.Tensor, type_name: str) -> torch.Tensor:
        start = {"Q4_0": 2, "Q4_1": 4}.get(type_name)
        if start is not None:
            view = blocks.view(-1, 18 if type_name == "Q4_0" else 20)
            codes = view[:, start:]
            view[:, start:] = (codes << 4) | (codes >> 4)
        return blocks


class ScalesOnWrongAxis(_Faulty):
    """Q8_0 scales taken from the block of the transposed position (row i's scales from row ``i+1``)."""

    def fault(self, blocks: torch.Tensor, type_name: str) -> torch.Tensor:
        if type_name == "Q8_0":
            rows = blocks.view(blocks.shape[0], -1, 34)
            rows[:, :, 0:2] = rows[:, :, 0:2].roll(1, dims=0)
        return blocks


def _redecoded(method_cls: type, fault: Callable[[Any], Any]) -> type:
    """``method_cls`` whose every packed tensor decodes through ``fault(tensor)`` (a decoder with one error)."""

    class Broken(method_cls):  # type: ignore[misc, valid-type]
        def checkpoint_weights(self, weights: Any, quantization_config: Any) -> Any:
            for name, t in super().checkpoint_weights(weights, quantization_config):
                yield name, replace(t, scheme=replace(t.scheme, decode=fault(t))) if isinstance(t, QuantizedTensor) else t

    return Broken


def _gptq_zeros_as_stored(t: QuantizedTensor) -> Any:
    """GPTQ (v1) zero points read as stored, without the +1."""
    return schemes.gptq(t.scheme.bits, 32, zeros_offset=0).decode


def _awq_in_order(t: QuantizedTensor) -> Any:
    """AWQ nibbles read in plain order instead of the interleave (0, 2, 4, 6, 1, 3, 5, 7)."""

    def decode(p: dict[str, torch.Tensor], out: int, cols: int) -> torch.Tensor:
        q, z = unpack(p["qweight"], 4, 1), unpack(p["qzeros"], 4, 1)
        g = torch.arange(cols) // 32
        return ((q - z[g]).float() * p["scales"].float()[g]).t()

    return decode


def _scales_transposed(t: QuantizedTensor) -> Any:
    """compressed-tensors W4A16 scales ``[out, groups]`` read as if stored ``[groups, out]`` (GPTQ's axis order)."""
    right = t.scheme.decode

    def decode(p: dict[str, torch.Tensor], out: int, cols: int) -> torch.Tensor:
        s = p["weight_scale"]
        return right({**p, "weight_scale": s.t().reshape(s.shape)}, out, cols)

    return decode


def _fp8_scale_ignored(t: QuantizedTensor) -> Any:
    """FP8 weights taken as their e4m3 values, the ``weight_scale`` never applied."""
    return lambda p, out, cols: p["weight"].float()


GPTQZerosAsStored = _redecoded(GPTQMethod, _gptq_zeros_as_stored)
FP8ScaleIgnored = _redecoded(FP8Method, _fp8_scale_ignored)
AWQInOrder = _redecoded(AWQMethod, _awq_in_order)
CompressedScalesTransposed = _redecoded(CompressedTensorsMethod, _scales_transposed)
