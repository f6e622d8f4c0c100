"""The built-in methods for checkpoints that say ``quantization_config.quant_method``: ``gptq``, ``awq``,
``compressed-tensors`` and ``fp8``.

They differ only in their reader (:mod:`corerun.quantization.readers`), which turns the checkpoint's
parts into one :class:`QuantizedTensor` per layer; the layer cuts it (merged shards, tensor-parallel
ranks) and the method keeps one per shard, as stored.  ``apply`` per scheme:

- 4-bit GPTQ / AWQ / pack-quantized, int8 weights without int8 activations (W8A16), FP8 on CPU:
  the shards are decoded into ``x.dtype`` on every call and multiplied (``F.linear``);
- the same integer formats on CUDA (where Triton imports; ``CORERUN_INT_GEMM_TRITON=0`` keeps the decoded path): packed
  once loaded (:func:`corerun.quantization.int_gemm_triton.pack`) and, for up to ``INT_GEMM_MAX_TOKENS`` rows,
  multiplied by one Triton GEMM that decodes the codes in registers
  (:func:`~corerun.quantization.int_gemm_triton.int_gemm`), merged shards in natural order one launch; the
  checkpoint's parts stay beside the packed copy (larger calls and ``dequantized`` read them);
- W8A8 (int8 activations, dynamic or static): :func:`corerun.quantization.int8_matmul.int8_linear`,
  int8 x int8 -> int32 (``torch._int_mm`` on CUDA and on a CPU with VNNI alone; oneDNN's int8 GEMM on a
  CPU with AMX).  A layer whose shards are all W8A8 alike (merged q/k/v, gate/up) is merged once loaded
  (:func:`~corerun.quantization.int8_matmul.merge`): one activation quantization and one product per call;
- FP8 on CUDA (compute capability 8.9 or more): :func:`corerun.quantization.fp8_cuda.fp8_linear`,
  ``torch._scaled_mm`` with the activations quantized to e4m3 per token.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar, Hashable, Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from corerun.quantization import capabilities as caps
from corerun.quantization.base import QuantizationMethod
from corerun.quantization.fp8_cuda import fp8_linear, use_scaled_mm
from corerun.quantization.int8_matmul import int8_linear, merge
from corerun.quantization.quantized_tensor import QuantizedTensor, as_quantized
from corerun.quantization.readers import READERS, group_weights


class PackedMethod(QuantizationMethod):
    quant_method: ClassVar[str]

    def checkpoint_weights(
        self, weights: Iterable[tuple[str, Any]], quantization_config: Mapping[str, Any] | None,
    ) -> Iterator[tuple[str, Any]]:
        yield from group_weights(weights, READERS[self.quant_method](quantization_config or {}))

    def create_weights(self, layer: nn.Module, in_features: int, shard_sizes: Mapping[Hashable, int]) -> None:
        # a placeholder the model loader finds by name; the parts live in layer.quantized, one tensor per shard
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.quantized_shards = list(shard_sizes)
        layer.quantized = {}
        layer.int8 = None  # the W8A8 shards as one Int8Weight, once every shard is loaded
        layer.int_gemm = None  # CUDA: [PackedInt] of the integer shards, once every shard is loaded

    def load_weight(self, layer: nn.Module, loaded: Any, shard_id: Hashable) -> None:
        w = as_quantized(f"shard {shard_id!r}", loaded).to(layer.weight.device)
        layer.quantized[shard_id] = w
        shards = [layer.quantized.get(s) for s in layer.quantized_shards]
        if all(s is not None and s.scheme.activations is not None for s in shards):
            layer.int8 = merge([(s.parts["weight"], s.parts["weight_scale"], _static_scale(s)) for s in shards])
            if layer.int8 is not None and len(shards) > 1:  # each shard's codes a view of the merged ones, not a second copy
                for s, part in zip(shards, layer.int8.weight.split([s.parts["weight"].shape[0] for s in shards])):
                    s.parts["weight"] = part
        elif all(s is not None for s in shards) and triton_int_gemm(layer.weight.device):
            layer.int_gemm = _int_gemm_parts(shards)

    def shards(self, layer: nn.Module) -> list[QuantizedTensor]:
        return [layer.quantized[s] for s in layer.quantized_shards]

    def dequantized(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight ``[out_features, in_features]`` in ``dtype``, decoded from its parts."""
        parts = [w.dequantize(dtype) for w in self.shards(layer)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.int8 is not None:
            return layer.int8(x)
        parts = layer.__dict__.get("int_gemm")
        if parts is not None and x.dim() == 2 and x.shape[0] <= INT_GEMM_MAX_TOKENS and x.device == layer.weight.device:
            from corerun.quantization.int_gemm_triton import DTYPES, int_gemm

            if x.dtype in DTYPES:
                out = torch.empty(x.shape[0], sum(p.words.shape[0] for p in parts), dtype=x.dtype, device=x.device)
                at = 0
                for p in parts:
                    int_gemm(x, p, out[:, at : at + p.words.shape[0]])
                    at += p.words.shape[0]
                return out
        shards = self.shards(layer)
        if all(w.scheme.activations is None and not use_scaled_mm(w, x) for w in shards):
            return F.linear(x, self.dequantized(layer, x.dtype))
        return torch.cat([self._product(w, x) for w in shards], dim=-1)

    def _product(self, w: QuantizedTensor, x: torch.Tensor) -> torch.Tensor:
        if w.scheme.activations is not None:
            return int8_linear(x, w.parts["weight"], w.parts["weight_scale"], _static_scale(w))
        if use_scaled_mm(w, x):
            return fp8_linear(x, w.parts["weight"], w.parts["weight_scale"])
        return F.linear(x, w.dequantize(x.dtype))


INT_GEMM_MAX_TOKENS = 64  # above (prefill): the weight decoded once per call and cuBLAS, not 16-row tiles each decoding it
INT_GEMM_ENV = "CORERUN_INT_GEMM_TRITON"  # "0": keep the decode-and-F.linear path on CUDA too


def triton_int_gemm(device: torch.device) -> bool:
    """Whether integer shards on ``device`` multiply in the Triton GEMM: a CUDA device, Triton imports, and
    ``$CORERUN_INT_GEMM_TRITON`` is not ``0``."""
    if device.type != "cuda" or os.environ.get(INT_GEMM_ENV, "1").strip() == "0":
        return False
    try:
        import corerun.quantization.int_gemm_triton  # noqa: F401
    except Exception:  # noqa: BLE001 - no Triton, or one too old for the kernel's module (triton.knobs): the decoded path
        return False
    return True


def _int_gemm_parts(shards: list[QuantizedTensor]) -> list | None:
    """The shards packed for the Triton GEMM (merged into one where all are in natural order alike); ``None`` where
    any is not a group-wise integer format without int8 activations."""
    from dataclasses import replace as with_

    from corerun.quantization.int_gemm_triton import pack

    if any(s.scheme.codes is None or s.scheme.activations is not None for s in shards):
        return None
    parts = [pack(s.codes(), s.scheme.bits) for s in shards]
    if any(p is None for p in parts):
        return None
    first = parts[0]
    if len(parts) > 1 and all(p.perm is None and (p.bits, p.group, p.scales.shape[1]) == (first.bits, first.group, first.scales.shape[1]) for p in parts):
        return [with_(first, words=torch.cat([p.words for p in parts]), scales=torch.cat([p.scales for p in parts]),
                      negzs=torch.cat([p.negzs for p in parts]))]
    return parts


def _static_scale(w: QuantizedTensor) -> torch.Tensor | None:
    return w.parts.get("input_scale") if w.scheme.activations == "int8-static" else None


class GPTQMethod(PackedMethod):
    name = quant_method = "gptq"
    capabilities = caps.GPTQ


class AWQMethod(PackedMethod):
    name = quant_method = "awq"
    capabilities = caps.AWQ


class CompressedTensorsMethod(PackedMethod):
    name = quant_method = "compressed-tensors"
    capabilities = caps.COMPRESSED_TENSORS


class FP8Method(PackedMethod):
    name = quant_method = "fp8"
    capabilities = caps.FP8
