"""The ``LoRAKernel`` protocol: add many adapters' low-rank products to one batch's linear outputs.

A step mixes requests for different adapters (and the base model).  Each adapter sits in one of
``S`` device slots; every token carries its slot (``-1`` for the base model).  Once per step the
engine orders the tokens by slot and counts each slot's (:class:`corerun.lora.tokens.LoRATokens`),
and each linear layer the adapters target calls :meth:`LoRAKernel.add_lora` once after its base
product, with that same bookkeeping.
Adapters of rank below ``R = max_lora_rank`` are zero-padded to ``R``, so every slot has one shape.

A kernel is a ``lora`` plugin (``corerun new lora NAME``, ``corerun conformance lora:NAME``); the
built-in ``torch`` kernel (:mod:`corerun.lora.reference`) is the reference the others are checked
against.  This module imports no torch at run time: capabilities are listed without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Sequence, runtime_checkable

from corerun.plugin.capabilities import LoRAKernelCapabilities  # noqa: F401 (re-exported: defined beside the other capabilities, importable without torch)

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LoRANeed:
    """What the engine asks of a kernel: where it runs, the model dtype, the slots' rank and count, and
    whether decode steps are replayed from CUDA graphs (then only a ``graph_safe`` kernel fits)."""

    device: Any  # a torch.device or a device type ("cuda:0", "cpu")
    dtype: str = "float32"
    max_rank: int = 16
    max_slots: int = 4
    graphs: bool = False


class LoRATokensView(Protocol):
    """What a kernel reads of the step's LoRA bookkeeping (``S`` slots, ``n`` tokens); corerun's
    implementation is :class:`corerun.lora.tokens.LoRATokens`, built once per step."""

    slots: "torch.Tensor"  # int32 [max_tokens] on the device: each token's slot, -1 = base (also past n)
    order: "torch.Tensor"  # int64 [max_tokens] on the device: order[:n], the tokens sorted by slot, stable, base first
    counts: "torch.Tensor"  # int64 [S] on the device: each slot's tokens
    starts: "torch.Tensor"  # int64 [S] on the device: where each slot's tokens start in order
    num_tokens: int  # n (host: not for graph-safe kernels)

    @property
    def num_base(self) -> int: ...  # tokens of slot -1 (host)

    @property
    def host_counts(self) -> tuple[int, ...]: ...  # counts as S host ints


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
        tokens: LoRATokensView,
        output_slices: Sequence[int],
    ) -> None:
        """In place: for each slice ``i`` (columns ``offset_i .. offset_i + output_slices[i]`` of ``y``,
        ``offset_i`` the sum of the slices before it) and each token ``t`` whose slot
        ``s = tokens.slots[t] >= 0``::

            y[t, slice_i] += scalings[s] * ((x[t] @ a[i][s].T) @ b[i][s].T)

        Tokens with slot ``-1`` are untouched.

        - ``y``: ``[T, sum(output_slices)]`` in the model dtype (the base layer's output, bias included);
        - ``x``: ``[T, H_in]``, the layer's input, same dtype;
        - ``a``: one tensor per slice, each ``[S, R, H_in]``; ``b``: one per slice, each ``[S, out_i, R]``
          (``S`` device slots, ``R`` = ``max_lora_rank``; adapters of smaller rank zero-padded; a slice
          an adapter does not target is zero);
        - ``scalings``: ``[S]`` float32, ``alpha / r`` (``alpha / sqrt(r)`` for rsLoRA);
        - ``tokens``: the step's :class:`LoRATokensView` (corerun's ``LoRATokens``), built once per step and the same
          for every layer: ``tokens.slots[:T]`` int32 on ``y``'s device (``-1`` = base model; ``T`` may
          exceed the step's ``tokens.num_tokens`` by a CUDA graph's padding, whose slots are ``-1``),
          ``tokens.order`` int64 (``order[:num_tokens]``: the tokens sorted by slot, stable, the base
          model's first), ``tokens.starts`` / ``tokens.counts`` int64 ``[S]`` (slot ``s``'s tokens are
          ``order[starts[s] : starts[s] + counts[s]]``), all on the device at fixed addresses; and host
          values, ``num_tokens``, ``num_base``, ``host_counts`` (``S`` ints), which a captured graph
          would replay as they were: only for kernels that are not ``graph_safe``.

        No host synchronisation: under CUDA graphs the slots change between replays.
        """
        ...
