"""One linear layer's quantized weight as its checkpoint stores it: several tensors, one logical ``[out, in]``.

GPTQ, AWQ and compressed-tensors write a layer's weight as parts (``qweight``, ``qzeros``, ``scales``,
``g_idx``; ``weight_packed``, ``weight_scale``, ...).  :class:`QuantizedTensor` holds them together
under the layer's name and cuts like a tensor: ``narrow(0, ...)`` takes output features (merged q/k/v,
gate/up, column-parallel ranks), ``narrow(1, ...)`` input features (row-parallel ranks).  Each part's
:class:`Axes` says which of its dimensions runs along the output and input features and how many
features one entry covers (the values per int32 word, the group size); a cut must fall on those
boundaries, or it is refused naming the part.  Scales looked up through ``g_idx`` are kept whole on an
input cut (the cut ``g_idx`` still indexes them).

``dequantize()`` decodes through the scheme's ``decode`` (:mod:`corerun.quantization.schemes`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch


class QuantizedLoadError(ValueError):
    """A quantized checkpoint tensor that cannot be read or cut as asked; the message names it."""


@dataclass(frozen=True)
class Axes:
    """Where a part's dimensions run: ``out_dim`` along the output features, ``out_per`` of them per
    entry (``None``: the part is shared by all outputs); the same for the input features (``in_per``
    0: entries found through ``g_idx``, never cut)."""

    out_dim: int | None = None
    out_per: int = 1
    in_dim: int | None = None
    in_per: int = 1


@dataclass(frozen=True)
class Codes:
    """A group-wise integer format's values, unpacked: ``w[j, i] = scales[j, g] * (q[j, i] - zeros[j, g])``
    with ``g = groups[i]``.  ``q`` int32 ``[out, in]``, unsigned (``0 .. 2**bits - 1``); ``zeros`` int32
    ``[out, G]`` on the same scale; ``scales`` float32 ``[out, G]``; ``groups`` int64 ``[in]``."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    groups: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out, in]``: the integer difference first, then one multiply (exact to float32's rounding)."""
        return (self.q - self.zeros[:, self.groups]).float() * self.scales[:, self.groups]

    def in_group_order(self) -> tuple["Codes", torch.Tensor | None]:
        """The same weight with its input features sorted by group (activation order: GPTQ's ``desc_act``,
        compressed-tensors' ``actorder``), and the permutation (``None`` where already in order): a kernel that reads
        each group as a run multiplies ``x[:, perm]`` by it."""
        g = self.groups
        if g.numel() < 2 or bool((g[1:] >= g[:-1]).all()):
            return self, None
        perm = torch.sort(g, stable=True).indices
        return Codes(self.q[:, perm], self.zeros, self.scales, g[perm]), perm


@dataclass(frozen=True)
class Scheme:
    """A quantized format: its parts' axes, its decoder ``(parts, out, in) -> float32 [out, in]``, and
    ``activations`` (``"int8-dynamic"``, ``"int8-static"`` or ``None``: the activations stay float).
    ``codes`` (group-wise integer formats: GPTQ, AWQ, pack-quantized) gives the parts unpacked as
    :class:`Codes`, for kernels that multiply the codes; ``decode`` is then ``codes(...).dequantize()``."""

    name: str  # in words, for errors and logs: "GPTQ 4-bit, groups of 128"
    axes: dict[str, Axes]
    decode: Callable[[dict[str, torch.Tensor], int, int], torch.Tensor]
    bits: int = 4
    activations: str | None = None
    codes: Callable[[dict[str, torch.Tensor], int, int], Codes] | None = None


@dataclass(frozen=True)
class QuantizedTensor:
    """``parts`` of the layer ``name`` in ``scheme``, logically ``[out_features, in_features]``."""

    name: str
    scheme: Scheme
    parts: dict[str, torch.Tensor]
    out_features: int
    in_features: int

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedTensor":
        """Output features ``[start, start + length)`` (``dim`` 0) or input features (``dim`` 1)."""
        parts = {}
        for key, t in self.parts.items():
            axes = self.scheme.axes.get(key, Axes())
            at, per = (axes.out_dim, axes.out_per) if dim == 0 else (axes.in_dim, axes.in_per)
            if at is None or per == 0:
                parts[key] = t
                continue
            if start % per or length % per:
                what = "output" if dim == 0 else "input"
                raise QuantizedLoadError(
                    f"{self.name}.{key} ({self.scheme.name}): {what} features [{start}, {start + length}) do not fall "
                    f"on its entries of {per}; a merged or tensor-parallel split needs multiples of {per} there"
                )
            parts[key] = t.narrow(at, start // per, length // per)
        out, cols = (length, self.in_features) if dim == 0 else (self.out_features, length)
        return replace(self, parts=parts, out_features=out, in_features=cols)

    def to(self, device: Any) -> "QuantizedTensor":
        return replace(self, parts={k: t.to(device) for k, t in self.parts.items()})

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values, ``[out_features, in_features]`` in ``dtype`` (decoded in float32)."""
        return self.scheme.decode(self.parts, self.out_features, self.in_features).to(dtype)

    def codes(self) -> Codes | None:
        """The unpacked codes of a group-wise integer format (:class:`Codes`); ``None`` for the others."""
        return None if self.scheme.codes is None else self.scheme.codes(self.parts, self.out_features, self.in_features)


def dense_scheme() -> Scheme:
    """A float weight left unquantized in a quantized checkpoint (a layer the format's ``ignore`` names)."""
    return Scheme("unquantized", {"weight": Axes(0, 1, 1, 1)}, lambda p, out, cols: p["weight"].float(), bits=16)


def as_quantized(name: str, loaded: Any) -> QuantizedTensor:
    """``loaded`` as a :class:`QuantizedTensor`: a float tensor wrapped unquantized."""
    if isinstance(loaded, QuantizedTensor):
        return loaded
    if not isinstance(loaded, torch.Tensor) or loaded.dim() != 2:
        raise QuantizedLoadError(f"{name}: expected a quantized weight or a float [out, in] tensor, got {type(loaded).__name__}")
    return QuantizedTensor(name, dense_scheme(), {"weight": loaded}, loaded.shape[0], loaded.shape[1])
