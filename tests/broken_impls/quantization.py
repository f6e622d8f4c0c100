"""Broken GGUF methods, each the built-in ``gguf`` with one fault, that ``QuantizationSuite`` must reject."""

from __future__ import annotations

import torch
from torch import nn

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
