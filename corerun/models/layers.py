"""The building blocks of corerun's models, each parameter carrying its own ``weight_loader``.

A ``weight_loader(param, loaded_weight, shard_id=None)`` copies one checkpoint tensor into a
parameter, or into one shard of a merged parameter (``qkv_proj`` takes ``"q"``, ``"k"``, ``"v"``;
``gate_up_proj`` takes ``"gate"``, ``"up"``).  A shape that does not fit raises
:class:`WeightShapeError` with both shapes; the loader adds the names.

Linear layers are small classes of their own so that a later tensor-parallel split can subclass
them (shard the output features of ``MergedLinear`` per shard, the input features of ``o_proj``
and ``down_proj``) without touching the model code.

On CPU, float32 and bfloat16 weights of the linear layers and the LM head are multiplied through a
copy prepacked once for oneDNN (:class:`PackedWeight`): oneDNN's blocked layout saves the reorder
a plain ``F.linear`` repeats on every call (docs/benchmarks.md has the measurements).  The parameter
itself stays an ordinary tensor, so weight loaders, tying and ``state_dict`` are unchanged; the pack
is redone when the parameter's storage or version changes.  ``CORERUN_CPU_PREPACK=0`` turns it off.

A step of one token (one request decoding) is a matrix-vector product, bound by how fast the weights
stream from memory.  There oneDNN's blocked layout streams slower than a plain product with the
weight stored column by column (``x @ W.T`` with ``W.T`` contiguous: 15 against 12.6 GB/s on one
core of this project's CPU, docs/benchmarks.md), so :func:`use_cpu_matvec_layout` stores each float32
CPU weight that way after loading (same shape and values, strides ``(1, out_features)``), and a
one-token step calls ``F.linear`` on it; steps of two tokens or more keep the prepacked copy.
"""

from __future__ import annotations

import os
from typing import Hashable, Mapping

import torch
import torch.nn.functional as F
from torch import nn


class WeightShapeError(ValueError):
    """A checkpoint tensor does not fit the parameter (shard) it was meant for."""

    def __init__(self, expected: tuple[int, ...], got: tuple[int, ...]):
        self.expected, self.got = expected, got
        super().__init__(f"expected shape {expected}, checkpoint has {got}")


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
    """Copy ``loaded_weight`` into ``param`` (any dtype / device; converted on copy)."""
    if shard_id is not None:
        raise ValueError(f"this parameter has no shards, got shard {shard_id!r}")
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise WeightShapeError(tuple(param.shape), tuple(loaded_weight.shape))
    param.data.copy_(loaded_weight)


def _parameter(*shape: int) -> nn.Parameter:
    """An uninitialised parameter in the current default dtype / device (every one is loaded from the checkpoint)."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return param


def _prepack_wanted() -> bool:
    return os.environ.get("CORERUN_CPU_PREPACK", "1").strip().lower() not in ("0", "false", "no", "off")


def _packable(weight: torch.Tensor) -> bool:
    """A CPU float32 weight (or bfloat16, where oneDNN has a bfloat16 path) that oneDNN can prepack."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.requires_grad or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.float32:
        return True
    return weight.dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _column_major(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.stride(0) == 1 and weight.stride(1) == weight.shape[0]


def use_cpu_matvec_layout(model: nn.Module) -> int:
    """Store every float32 CPU weight of the linear layers and the LM head column by column (see the
    module docstring); a weight tied to the embedding changes with it (a lookup of a few strided rows
    per step).  Returns how many weights were moved.  Nothing changes elsewhere or with
    ``CORERUN_CPU_PREPACK=0``."""
    if not _prepack_wanted():
        return 0
    moved = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not isinstance(module, (Linear, LMHead)) or weight is None or weight.dim() != 2:
            continue
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or _column_major(weight):
            continue
        with torch.no_grad():
            weight.data = weight.data.t().contiguous().t()
        moved += 1
    return moved


class PackedWeight:
    """A weight reordered once into oneDNN's blocked layout, for ``y = x @ weight.T (+ bias)`` on CPU.

    ``linear(x, weight, bias)`` uses the pack when it was made from this very ``weight`` (same storage,
    same version: a weight changed in place is packed again; inference tensors keep no version, so
    one of those is packed once per storage) and plain ``F.linear`` otherwise: other
    devices and dtypes, autograd, or ``CORERUN_CPU_PREPACK=0``.
    """

    __slots__ = ("key", "packed")

    def __init__(self) -> None:
        self.key: tuple[int, int, torch.dtype] | None = None
        self.packed: torch.Tensor | None = None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the compiler packs weights itself (inductor's freezing)
            return F.linear(x, weight, bias)
        if x.dtype != weight.dtype or (torch.is_grad_enabled() and x.requires_grad) or not _packable(weight):
            return F.linear(x, weight, bias)
        if x.shape[0] == 1 and _column_major(weight) and weight.dtype == torch.float32:
            return F.linear(x, weight, bias)  # the matrix-vector product streams this layout faster
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version, weight.dtype)
        if key != self.key:
            if not _prepack_wanted():
                return F.linear(x, weight, bias)
            self.packed, self.key = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None), key
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


class Linear(nn.Module):
    """``y = x @ weight.T + bias``; ``weight`` ``[out_features, in_features]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _parameter(out_features, in_features)
        self.bias = _parameter(out_features) if bias else None
        self.packed = PackedWeight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in_features]`` -> ``[T, out_features]``."""
        return self.packed.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linear layers over the same input, stacked along the output features.

    ``shard_sizes`` maps a shard id to its output size, in order: ``{"q": Hq*D, "k": Hkv*D, "v": Hkv*D}``
    for ``qkv_proj``, ``{"gate": I, "up": I}`` for ``gate_up_proj``.  Each checkpoint tensor lands in its
    rows of ``weight`` (and ``bias``).
    """

    def __init__(self, in_features: int, shard_sizes: Mapping[Hashable, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_sizes = dict(shard_sizes)
        self.shard_offsets: dict[Hashable, int] = {}
        offset = 0
        for shard_id, size in self.shard_sizes.items():
            self.shard_offsets[shard_id] = offset
            offset += size
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
                param.shard_ids = tuple(self.shard_sizes)  # type: ignore[attr-defined]  # each must be loaded

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Hashable = None) -> None:
        if shard_id not in self.shard_sizes:
            raise ValueError(f"unknown shard {shard_id!r}; this layer's shards are {list(self.shard_sizes)}")
        rows = param.data.narrow(0, self.shard_offsets[shard_id], self.shard_sizes[shard_id])
        if tuple(rows.shape) != tuple(loaded_weight.shape):
            raise WeightShapeError(tuple(rows.shape), tuple(loaded_weight.shape))
        rows.copy_(loaded_weight)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``y`` ``[T, out_features]`` -> one view per shard, in ``shard_sizes`` order."""
        return y.split(list(self.shard_sizes.values()), dim=-1)


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension, computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _parameter(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., size]`` -> same shape and dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class VocabEmbedding(nn.Module):
    """Token embedding table ``weight`` ``[vocab_size, hidden_size]``."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.weight = _parameter(vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` int64 ``[T]`` -> ``[T, hidden_size]``."""
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states onto the vocabulary; ``weight`` ``[vocab_size, hidden_size]`` (tied: the embedding's)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = _parameter(vocab_size, hidden_size)
        self.packed = PackedWeight()

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share ``embedding.weight`` (one parameter, loaded once under either name)."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, hidden_size]`` -> logits float32 ``[N, vocab_size]``."""
        return self.packed.linear(hidden, self.weight, None).float()


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` ``[T, 2*I]`` -> ``[T, I]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
