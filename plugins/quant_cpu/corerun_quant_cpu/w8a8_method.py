"""``compressed_tensors_cpu``: the built-in ``compressed-tensors`` method with its W8A8 products in C++, on AMX
or AVX-512 VNNI, and its W4A16 ones on AVX-512 VNNI.

Storage and loading are ``compressed-tensors``' (every scheme it reads: W8A8, W8A16, W4A16, FP8), and so
is every product but one: a W8A8 layer whose activations are quantized per token (``dynamic``, what
``corerun quantize --method int8`` and llm-compressor's W8A8 write) multiplies in C++, decode steps and
prefills alike: the activations quantized per token in one pass, the int8 codes repacked at load
(:func:`~corerun_quant_cpu.kernels.repack_int8`: 16 rows by 4 columns), the int32 sums scaled by the row's
and the token's scale in the same pass that writes the output.  That is ``int8_matmul``'s arithmetic (the
same codes, the same exact sums, the scales applied in the same order), without its dozen torch operators
per call (a decode step of 32 requests spent 11 ms in them on a Sapphire Rapids, 33 ms on an AMD EPYC).
Two kernels, the first the CPU has:

- AMX-INT8 (:func:`~corerun_quant_cpu.kernels.int8_amx_linear`): TDPBSSD tiles; through the default model's 120
  decoder products 2.0-2.9x faster than the built-in from 1 to 512 tokens (``benchmarks/int8_amx_bench.py``);
- AVX-512 VNNI (:func:`~corerun_quant_cpu.kernels.int8_vnni_linear`; AMD Zen 4, Intel Cascade Lake to Ice Lake):
  VPDPBUSD on the codes + 128, each sum started from the row's ``-128 * sum(W)``; 1.3-2.8x the built-in's
  ``torch._int_mm`` there (the same benchmark).

Static activation scales, widths that are not a multiple of 64 or exceed ``kernels.INT8_MAX_COLS`` (65,536) and other
schemes take the built-in's path, but for W4A16 (``pack-quantized`` 4-bit): its batches multiply
in C++ too (up to 32 tokens, 16 in bfloat16), on AVX-512 VNNI (:mod:`corerun_quant_cpu.w4_method`, as ``gptq_cpu`` and ``awq_cpu`` do).

The LM head, which such checkpoints leave in bfloat16 or float32: in a model run in bfloat16 on a CPU that
multiplies bfloat16 natively, :meth:`lm_head` gives it a ``dense_cpu`` layer (AVX512_BF16 / AMX tiles,
as the unquantized model's), in place of oneDNN's product; in float32 there, ``dense_cpu``'s float32 layer.

Such a layer keeps its codes (the built-in's fallbacks and ``dequantized`` read them) and the repacked
copy, and drops oneDNN's packed one: the same memory as the built-in.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Hashable

import torch
from torch import nn

from corerun.sdk.quantization import CompressedTensorsMethod

from corerun_quant_cpu import kernels
from corerun_quant_cpu.capabilities import COMPRESSED_TENSORS_CPU
from corerun_quant_cpu.w4_method import W4CpuMixin

_DTYPES = (torch.float32, torch.bfloat16)


class CompressedTensorsCpuMethod(W4CpuMixin, CompressedTensorsMethod):
    name = "compressed_tensors_cpu"
    capabilities = COMPRESSED_TENSORS_CPU
    quantizes_lm_head = True  # the loader offers the head's tensor to lm_head()

    def __init__(self) -> None:
        reasons = kernels.load()
        if reasons:
            raise RuntimeError("quantization method compressed_tensors_cpu cannot run here: " + "; ".join(reasons))
        self.kernel = "amx" if kernels.int8_amx_available() else "vnni" if kernels.int8_vnni_available() else None
        self.model_dtype: torch.dtype | None = None  # the default dtype the layers were made in (the model's)

    def create_weights(self, layer: nn.Module, in_features: int, shard_sizes: Any) -> None:
        super().create_weights(layer, in_features, shard_sizes)
        self.model_dtype = torch.get_default_dtype()
        layer.int8_kernel = None  # (packed codes, weight scales [out], VNNI's corrections or None) once a W8A8 layer is whole

    def load_weight(self, layer: nn.Module, loaded: Any, shard_id: Hashable) -> None:
        super().load_weight(layer, loaded, shard_id)
        w8 = layer.int8  # the merged W8A8 shards, once every shard is in (None before, or for other schemes)
        if (w8 is not None and self.kernel and w8.input_scale is None and w8.weight.device.type == "cpu"
                and 0 < w8.weight.shape[1] <= kernels.INT8_MAX_COLS and w8.weight.shape[1] % 64 == 0):
            corrections = kernels.int8_corrections(w8.weight) if self.kernel == "vnni" else None
            layer.int8_kernel = (kernels.repack_int8(w8.weight), w8.weight_scale.reshape(-1).float().contiguous(), corrections)
            layer.int8 = replace(w8, packed=None)  # oneDNN's copy: no call reaches it now

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` -> ``[T, out]`` in ``x``'s dtype."""
        found = layer.__dict__.get("int8_kernel")
        if found is not None and x.dim() == 2 and x.dtype in _DTYPES and x.device.type == "cpu":
            packed, scale, corrections = found
            out = torch.empty(x.shape[0], scale.shape[0], dtype=x.dtype)
            if corrections is None:
                kernels.int8_amx_linear(out, packed, scale, x.contiguous())
            else:
                kernels.int8_vnni_linear(out, packed, corrections, scale, x.contiguous())
            return out
        return super().apply(layer, x)

    def lm_head(self, loaded: Any) -> nn.Module | None:
        """A ``dense_cpu`` layer holding the head ``loaded`` ``[vocab, hidden]`` when the model runs in bfloat16
        here and this CPU multiplies bfloat16 natively, or in float32 and it has AVX-512; else ``None`` (the
        model's own head)."""
        if self.model_dtype is None or kernels.bf16_best_isa() not in kernels.BF16_NATIVE:  # (dense_cpu's probe)
            return None
        from corerun_quant_cpu.dense_method import DenseCpuMethod

        head = DenseCpuMethod()
        head.model_dtype = self.model_dtype
        return head.lm_head(loaded)  # (None where dense_cpu does not repack the model's dtype: float16)
