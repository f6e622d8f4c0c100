"""Tensor-parallel versions of corerun's layers, each loading its rank's slice of the full checkpoint tensor.

- :class:`ColumnParallelMergedLinear`: a :class:`MergedLinear` whose every shard holds a range of the
  checkpoint tensor's rows (its output features): ``qkv_proj`` takes the rank's q heads, k heads and
  v heads; ``gate_up_proj`` the rank's slice of gate and of up.  No communication.
- :class:`RowParallelLinear`: ``o_proj`` / ``down_proj`` holding a range of the input features; the
  partial products are summed over the ranks (all-reduce), then the bias is added once.
- :class:`VocabParallelEmbedding`: a range of the vocabulary; rows outside it embed to zero, then
  all-reduce.
- :class:`ParallelLMHead`: the same vocabulary range; the logits slices are gathered on rank 0.

The factories at the end build the layers of one attention block, one MLP and the embeddings for a
rank, so that a model's ``tp is None`` path keeps corerun's plain layers untouched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Hashable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from corerun.models.layers import (
    Linear, LMHead, MergedLinear, VocabEmbedding, WeightShapeError, as_dense, default_weight_loader,
)
from corerun.distributed.sharding import HeadShard, shard_range, shard_vocab

if TYPE_CHECKING:
    from corerun.distributed.group import TensorParallelGroup
    from corerun.quantization.base import QuantizationMethod


class ColumnParallelMergedLinear(MergedLinear):
    """``MergedLinear`` holding rows ``[start, start + size)`` of each checkpoint shard.

    ``shard_ranges`` maps a shard id to ``(start, size, full_size)``: the rows this rank keeps and the
    checkpoint tensor's row count (checked on load).  ``weight`` is ``[sum(size), in_features]``.
    """

    def __init__(
        self, in_features: int, shard_ranges: Mapping[Hashable, tuple[int, int, int]], bias: bool = False,
        quant: "QuantizationMethod | None" = None,
    ) -> None:
        super().__init__(in_features, {k: size for k, (_, size, _) in shard_ranges.items()}, bias, quant)
        self.shard_ranges = dict(shard_ranges)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Any, shard_id: Hashable = None) -> None:
        if shard_id in self.shard_ranges:
            start, size, full = self.shard_ranges[shard_id]
            if loaded_weight.shape[0] != full:
                raise WeightShapeError((full, *param.shape[1:]), tuple(loaded_weight.shape))
            loaded_weight = loaded_weight.narrow(0, start, size)
        super().weight_loader(param, loaded_weight, shard_id)


class RowParallelLinear(Linear):
    """``y = all_reduce(x @ weight.T) + bias``: ``weight`` holds this rank's ``in_features / n`` input columns.

    ``x`` ``[T, in_features / n]`` (this rank's slice) -> ``[T, out_features]``, identical on every rank.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: "TensorParallelGroup",
        quant: "QuantizationMethod | None" = None,
    ) -> None:
        start, local_in = shard_range(in_features, tp.rank, tp.world_size, f"the input features ({in_features})")
        super().__init__(local_in, out_features, bias, quant)
        self.tp, self.in_start, self.full_in_features = tp, start, in_features
        self.weight.weight_loader = self._load_weight  # type: ignore[attr-defined]

    def _load_weight(self, param: nn.Parameter, loaded_weight: Any, shard_id: Hashable = None) -> None:
        expected = (self.out_features, self.full_in_features)
        if tuple(loaded_weight.shape) != expected:
            raise WeightShapeError(expected, tuple(loaded_weight.shape))
        mine = loaded_weight.narrow(1, self.in_start, self.in_features)
        if self.quant is None:
            default_weight_loader(param, mine, shard_id)
        else:
            self._load_quantized(param, mine, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.product(x))
        return y if self.bias is None else y + self.bias


def _load_vocab_rows(layer: "VocabParallelEmbedding | ParallelLMHead") -> Callable[..., None]:
    """A weight loader keeping rows ``[start, end)`` of a ``[vocab_size, hidden]`` tensor, zero past ``end``."""
    shard = layer.shard

    def load(param: nn.Parameter, loaded_weight: Any, shard_id: Hashable = None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter has no shards, got shard {shard_id!r}")
        expected = (shard.vocab_size, param.shape[1])
        if tuple(loaded_weight.shape) != expected:
            raise WeightShapeError(expected, tuple(loaded_weight.shape))
        loaded_weight = as_dense(loaded_weight.narrow(0, shard.start, shard.end - shard.start))
        shard_rows = slice(0, shard.end - shard.start)
        param.data[shard_rows].copy_(loaded_weight)
        param.data[shard_rows.stop :].zero_()

    return load


class VocabParallelEmbedding(VocabEmbedding):
    """This rank's rows of the embedding table, ``weight`` ``[rows_per_rank, hidden_size]``.

    ``input_ids`` int64 ``[T]`` -> ``[T, hidden_size]`` (all-reduced: every rank gets every token's row).
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: "TensorParallelGroup") -> None:
        shard = shard_vocab(vocab_size, tp.rank, tp.world_size)
        super().__init__(shard.rows_per_rank, hidden_size)
        self.shard, self.vocab_size, self.tp = shard, vocab_size, tp
        self.weight.weight_loader = _load_vocab_rows(self)  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.shard.start) & (input_ids < self.shard.end)
        local = torch.where(mine, input_ids - self.shard.start, 0)
        out = F.embedding(local, self.weight).masked_fill_(~mine.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(LMHead):
    """This rank's vocabulary rows of the LM head (tied: the embedding's own parameter, same rows).

    ``hidden`` ``[N, hidden_size]`` -> rank 0: logits float32 ``[N, vocab_size]``; other ranks: ``None``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: "TensorParallelGroup") -> None:
        shard = shard_vocab(vocab_size, tp.rank, tp.world_size)
        super().__init__(shard.rows_per_rank, hidden_size)
        self.shard, self.tp = shard, tp
        self.weight.weight_loader = _load_vocab_rows(self)  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        logits = self.tp.gather_last_dim(self.packed.linear(hidden, self.weight, None))
        return None if logits is None else logits[:, : self.shard.vocab_size].float()


# ------------------------------------------------------------------ factories
def attention_projections(
    hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, heads: HeadShard,
    qkv_bias: bool, o_bias: bool, tp: "TensorParallelGroup", quant: "QuantizationMethod | None" = None,
) -> tuple[ColumnParallelMergedLinear, RowParallelLinear]:
    """``(qkv_proj, o_proj)`` for the rank holding ``heads`` (see :func:`~corerun.distributed.sharding.shard_heads`)."""
    d = head_dim
    kv = (heads.kv_start * d, heads.num_kv_heads * d, num_kv_heads * d)
    ranges = {"q": (heads.q_start * d, heads.num_heads * d, num_heads * d), "k": kv, "v": kv}
    return (
        ColumnParallelMergedLinear(hidden_size, ranges, bias=qkv_bias, quant=quant),
        RowParallelLinear(num_heads * d, hidden_size, o_bias, tp, quant),
    )


def mlp_projections(
    hidden_size: int, intermediate_size: int, bias: bool, tp: "TensorParallelGroup",
    quant: "QuantizationMethod | None" = None,
) -> tuple[ColumnParallelMergedLinear, RowParallelLinear]:
    """``(gate_up_proj, down_proj)`` holding this rank's slice of the intermediate features."""
    start, size = shard_range(intermediate_size, tp.rank, tp.world_size, "intermediate_size")
    ranges = {"gate": (start, size, intermediate_size), "up": (start, size, intermediate_size)}
    return (
        ColumnParallelMergedLinear(hidden_size, ranges, bias=bias, quant=quant),
        RowParallelLinear(intermediate_size, hidden_size, bias, tp, quant),
    )
