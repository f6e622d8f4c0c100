"""``none``: dense float weights, as corerun always ran them.

A GGUF file is read too: each packed tensor is dequantized once at load.  Models built with this
method keep the layers' own float path (:class:`corerun.models.layers.PackedWeight`), unchanged.
"""

from __future__ import annotations

from typing import Any, Hashable, Mapping

import torch
from torch import nn

from corerun.quantization.capabilities import DENSE
from corerun.quantization.base import QuantizationMethod, shard_offsets
from corerun.quantization.gguf_blocks import LAYOUTS
from corerun.quantization.gguf_tensor import as_dense


class DenseMethod(QuantizationMethod):
    name = "none"
    dense = True
    capabilities = DENSE

    def create_weights(self, layer: nn.Module, in_features: int, shard_sizes: Mapping[Hashable, int]) -> None:
        layer.weight = nn.Parameter(torch.empty(sum(shard_sizes.values()), in_features), requires_grad=False)
        layer.dense_offsets = shard_offsets(shard_sizes)
        layer.dense_sizes = dict(shard_sizes)

    def load_weight(self, layer: nn.Module, loaded: Any, shard_id: Hashable) -> None:
        rows = layer.weight.data.narrow(0, layer.dense_offsets[shard_id], layer.dense_sizes[shard_id])
        rows.copy_(as_dense(loaded))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.weight.to(x.dtype))
