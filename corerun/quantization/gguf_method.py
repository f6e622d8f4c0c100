"""``gguf``: GGUF's packed blocks kept as stored, dequantized per layer on every call.

Each shard of a layer (q, k and v; gate and up) keeps its own type, as GGUF files mix them (a
``Q4_K_M`` file stores some ``attn_v`` and ``ffn_down`` tensors as ``Q6_K``).  ``apply``
dequantizes the shards into the activation dtype, stacks them and multiplies: correct in plain
torch on any device.  ``shards`` hands the packed rows as stored to a method that subclasses this
one to multiply them with a kernel of its own (docs/quantization.md, "Kernels").
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from corerun.quantization.capabilities import GGUF
from corerun.quantization.base import QuantizationMethod
from corerun.quantization.gguf_blocks import LAYOUTS, QUANTIZED
from corerun.quantization.gguf_tensor import GGUFLoadError, GGUFTensor


class GGUFMethod(QuantizationMethod):
    name = "gguf"
    capabilities = GGUF

    def create_weights(self, layer: nn.Module, in_features: int, shard_sizes: Mapping[Hashable, int]) -> None:
        # a placeholder the model loader finds by name; the blocks live in one buffer per shard
        layer.weight = nn.Parameter(torch.empty(0, dtype=torch.uint8), requires_grad=False)
        layer.gguf_shards = dict(shard_sizes)
        layer.gguf_in_features = in_features
        layer.gguf_types = {}
        for i, shard_id in enumerate(shard_sizes):
            layer.register_buffer(f"gguf_blocks_{i}", None)

    def load_weight(self, layer: nn.Module, loaded: Any, shard_id: Hashable) -> None:
        if not isinstance(loaded, GGUFTensor):  # a float tensor (F32 in a safetensors file, say): stored as F32
            loaded = GGUFTensor("weight", "F32", loaded.to(torch.float32).contiguous().view(torch.uint8), loaded.shape[1])
        want = (layer.gguf_shards[shard_id], layer.gguf_in_features)
        if tuple(loaded.shape) != want:
            raise GGUFLoadError(f"GGUF tensor {loaded.name} ({loaded.type_name}): expected shape {want}, got {tuple(loaded.shape)}")
        index = list(layer.gguf_shards).index(shard_id)
        device = layer.weight.device
        setattr(layer, f"gguf_blocks_{index}", loaded.data.to(device).contiguous())
        layer.gguf_types[shard_id] = loaded.type_name

    @staticmethod
    def shards(layer: nn.Module) -> list[GGUFTensor]:
        """The layer's shards in output order, each its packed rows as a :class:`GGUFTensor` (for kernels)."""
        return [
            GGUFTensor(str(shard_id), layer.gguf_types[shard_id], getattr(layer, f"gguf_blocks_{i}"), layer.gguf_in_features)
            for i, shard_id in enumerate(layer.gguf_shards)
        ]

    def dequantized(self, layer: nn.Module, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight ``[out_features, in_features]`` in ``dtype``, decoded from its blocks."""
        parts = [shard.dequantize(dtype) for shard in self.shards(layer)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(layer, x.dtype))


__all__ = ["GGUFMethod", "QUANTIZED"]
