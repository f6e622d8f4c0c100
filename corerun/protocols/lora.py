"""The ``LoRAKernel`` protocol: add many adapters' low-rank products to one batch's linear outputs.

A step mixes requests for different adapters (and the base model).  Each adapter sits in one of
``S`` device slots; every token carries its slot (``token_slots``, ``-1`` for the base model), and
each linear layer the adapters target calls :meth:`LoRAKernel.add_lora` once after its base product.
Adapters of rank below ``R = max_lora_rank`` are zero-padded to ``R``, so every slot has one shape.

A kernel is a ``lora`` plugin (``corerun new lora NAME``, ``corerun conformance lora:NAME``); the
built-in ``torch`` kernel (:mod:`corerun.lora.reference`) is the reference the others are checked
against.  This module imports no torch at run time: capabilities are listed without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Sequence, runtime_checkable

from corerun.plugin.capabilities import device_reasons

if TYPE_CHECKING:
    import torch


def _fmt(values: frozenset) -> str:
    return "{" + ", ".join(str(v) for v in sorted(values)) + "}"


@dataclass(frozen=True)
class LoRANeed:
    """What the engine asks of a kernel: where it runs, the model dtype, the slots' rank and count, and
    whether decode steps are replayed from CUDA graphs (then only a ``graph_safe`` kernel fits)."""

    device: Any  # a torch.device or a device type ("cuda:0", "cpu")
    dtype: str = "float32"
    max_rank: int = 16
    max_slots: int = 4
    graphs: bool = False


@dataclass(frozen=True)
class LoRAKernelCapabilities:
    """What a LoRA kernel runs, as data.

    - ``devices``: device types; ``dtypes``: model dtypes of ``y`` and ``x`` (``"float32"``, ...).
    - ``max_rank`` / ``max_slots``: the largest ``R`` and ``S`` it takes (``None``: any).
    - ``graph_safe``: no host synchronisation and no shape that depends on the values of
      ``token_slots``, so a captured CUDA graph replays it with other slots.
    - ``grouped``: it groups tokens by slot (one product per adapter present) rather than gathering
      each token's weights.

    ``fits(need)`` lists every reason it cannot serve a :class:`LoRANeed` (a bare
    :class:`~corerun.plugin.capabilities.Need` is checked for its device only).
    """

    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[str] = frozenset({"float16", "bfloat16", "float32", "float64"})
    max_rank: int | None = None
    max_slots: int | None = None
    graph_safe: bool = False
    grouped: bool = False

    def fits(self, need: Any) -> list[str]:
        reasons = device_reasons(self.devices, need.device)
        dtype = getattr(need, "dtype", None)
        if dtype is not None and str(dtype).removeprefix("torch.") not in self.dtypes:
            reasons.append(f"dtype {str(dtype).removeprefix('torch.')} not in {_fmt(self.dtypes)}")
        rank, slots = getattr(need, "max_rank", None), getattr(need, "max_slots", None)
        if rank is not None and self.max_rank is not None and rank > self.max_rank:
            reasons.append(f"max_lora_rank {rank} above its largest rank {self.max_rank}")
        if slots is not None and self.max_slots is not None and slots > self.max_slots:
            reasons.append(f"max_loras {slots} above its largest slot count {self.max_slots}")
        if getattr(need, "graphs", False) and not self.graph_safe:
            reasons.append("decode steps replay CUDA graphs and it is not graph_safe")
        return reasons

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": sorted(self.devices), "dtypes": sorted(self.dtypes), "max_rank": self.max_rank,
            "max_slots": self.max_slots, "graph_safe": self.graph_safe, "grouped": self.grouped,
        }


@runtime_checkable
class LoRAKernel(Protocol):
    """Factory signature: ``factory(**options)``; the engine calls :meth:`add_lora` once per targeted layer."""

    name: ClassVar[str]
    capabilities: LoRAKernelCapabilities

    def add_lora(
        self,
        y: "torch.Tensor",
        x: "torch.Tensor",
        a: Sequence["torch.Tensor"],
        b: Sequence["torch.Tensor"],
        scalings: "torch.Tensor",
        token_slots: "torch.Tensor",
        output_slices: Sequence[int],
    ) -> None:
        """In place: for each slice ``i`` (columns ``offset_i .. offset_i + output_slices[i]`` of ``y``,
        ``offset_i`` the sum of the slices before it) and each token ``t`` whose slot
        ``s = token_slots[t] >= 0``::

            y[t, slice_i] += scalings[s] * ((x[t] @ a[i][s].T) @ b[i][s].T)

        Tokens with slot ``-1`` are untouched.

        - ``y``: ``[T, sum(output_slices)]`` in the model dtype (the base layer's output, bias included);
        - ``x``: ``[T, H_in]``, the layer's input, same dtype;
        - ``a``: one tensor per slice, each ``[S, R, H_in]``; ``b``: one per slice, each ``[S, out_i, R]``
          (``S`` device slots, ``R`` = ``max_lora_rank``; adapters of smaller rank zero-padded; a slice
          an adapter does not target is zero);
        - ``scalings``: ``[S]`` float32, ``alpha / r`` (``alpha / sqrt(r)`` for rsLoRA);
        - ``token_slots``: ``[T]`` int32 on ``y``'s device, ``-1`` = base model.

        No host synchronisation: under CUDA graphs the slots change between replays.
        """
        ...
