"""``compressed_tensors_cpu``: the built-in ``compressed-tensors`` method with its W8A8 decode steps on AMX.

Storage and loading are ``compressed-tensors``' (every scheme it reads: W8A8, W8A16, W4A16, FP8), and so
is every product but one: a W8A8 layer whose activations are quantized per token (``dynamic``, what
``corerun quantize --method int8`` and llm-compressor's W8A8 write), on a CPU with AMX-INT8, multiplies
in C++ (:func:`~corerun_quant_cpu.kernels.int8_amx_linear`), decode steps and prefills alike: the activations quantized per token in one pass,
TDPBSSD tiles on the int8 codes repacked at load (:func:`~corerun_quant_cpu.kernels.repack_int8`), the
int32 sums scaled by the row's and the token's scale in the same pass that writes the output.  That is
``int8_matmul``'s arithmetic (the same codes, the same exact sums, the scales applied in the same order),
without its dozen torch operators per call (a decode step of 32 requests spent about 11 ms in them and
25 us per layer in oneDNN's call): through the default model's 120 decoder products 2.0-2.9x faster
than the built-in from 1 to 512 tokens (``benchmarks/int8_amx_bench.py``).  Static activation scales,
widths that are not a multiple of 64 and other schemes take the built-in's path.

The LM head, which such checkpoints leave in bfloat16 or float32: in a model run in bfloat16 on a CPU that
multiplies bfloat16 natively, :meth:`lm_head` gives it a ``dense_cpu`` layer (AVX512_BF16 / AMX tiles,
as the unquantized model's), in place of oneDNN's product.

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

_DTYPES = (torch.float32, torch.bfloat16)


class CompressedTensorsCpuMethod(CompressedTensorsMethod):
    name = "compressed_tensors_cpu"
    capabilities = COMPRESSED_TENSORS_CPU
    quantizes_lm_head = True  # the loader offers the head's tensor to lm_head()

    def __init__(self) -> None:
        reasons = kernels.load()
        if reasons:
            raise RuntimeError("quantization method compressed_tensors_cpu cannot run here: " + "; ".join(reasons))
        self.amx = kernels.int8_amx_available()
        self.model_dtype: torch.dtype | None = None  # the default dtype the layers were made in (the model's)

    def create_weights(self, layer: nn.Module, in_features: int, shard_sizes: Any) -> None:
        super().create_weights(layer, in_features, shard_sizes)
        self.model_dtype = torch.get_default_dtype()
        layer.int8_amx = None  # (packed codes, weight scales [out]) once a W8A8 layer is whole

    def load_weight(self, layer: nn.Module, loaded: Any, shard_id: Hashable) -> None:
        super().load_weight(layer, loaded, shard_id)
        w8 = layer.int8  # the merged W8A8 shards, once every shard is in (None before, or for other schemes)
        if w8 is not None and self.amx and w8.input_scale is None and w8.weight.device.type == "cpu" and w8.weight.shape[1] % 64 == 0:
            layer.int8_amx = (kernels.repack_int8(w8.weight), w8.weight_scale.reshape(-1).float().contiguous())
            layer.int8 = replace(w8, packed=None)  # oneDNN's copy: no call reaches it now

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]`` -> ``[T, out]`` in ``x``'s dtype."""
        amx = layer.__dict__.get("int8_amx")
        if amx is not None and x.dim() == 2 and x.dtype in _DTYPES and x.device.type == "cpu":
            packed, scale = amx
            out = torch.empty(x.shape[0], scale.shape[0], dtype=x.dtype)
            kernels.int8_amx_linear(out, packed, scale, x.contiguous())
            return out
        return super().apply(layer, x)

    def lm_head(self, loaded: Any) -> nn.Module | None:
        """A ``dense_cpu`` layer holding the head ``loaded`` ``[vocab, hidden]`` when the model runs in bfloat16
        here and this CPU multiplies bfloat16 natively; else ``None`` (the model's own head)."""
        if self.model_dtype != torch.bfloat16 or kernels.bf16_best_isa() not in kernels.BF16_NATIVE:
            return None
        from corerun_quant_cpu.dense_method import DenseCpuMethod

        return DenseCpuMethod().lm_head(loaded)
