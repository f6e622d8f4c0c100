"""The built-in ``torch`` LoRA kernel: each token gathers its slot's A and B, then two small products.

Plain torch on any device, the reference the other kernels are checked against.  It gathers
``[T, R, H_in]`` and ``[T, out_i, R]`` weights per slice, so its memory grows with the tokens of a
step; the grouped and Triton kernels avoid that.  It reads the step's token slots only, not their
order by slot.  Graph safe: no host synchronisation, no shape that depends on the slots' values.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch

from corerun.lora.capabilities import TORCH_KERNEL
from corerun.lora.tokens import LoRATokens
from corerun.protocols.lora import LoRAKernelCapabilities


class TorchLoRAKernel:
    """``add_lora`` as :class:`corerun.protocols.lora.LoRAKernel` states it, token by token (batched)."""

    name: ClassVar[str] = "torch"
    capabilities: LoRAKernelCapabilities = TORCH_KERNEL

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"LoRA kernel 'torch' takes no options, got {sorted(options)}")

    def add_lora(
        self, y: torch.Tensor, x: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
        scalings: torch.Tensor, tokens: LoRATokens, output_slices: Sequence[int],
    ) -> None:
        self.per_token(y, x, a, b, scalings, tokens.slots[: x.shape[0]], output_slices)

    @staticmethod
    def per_token(
        y: torch.Tensor, x: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
        scalings: torch.Tensor, token_slots: torch.Tensor, output_slices: Sequence[int],
    ) -> None:
        """``add_lora`` from the tokens' slots alone (``token_slots`` int32 ``[T]``): the order by slot is not needed."""
        active = token_slots >= 0  # [T]
        slots = token_slots.clamp(min=0).long()
        scale = scalings[slots].to(x.dtype).unsqueeze(1)  # [T, 1]
        offset = 0
        for a_i, b_i, size in zip(a, b, output_slices):
            shrunk = torch.bmm(a_i[slots], x.unsqueeze(2)).squeeze(2) * scale  # [T, R]
            delta = torch.bmm(b_i[slots], shrunk.unsqueeze(2)).squeeze(2)  # [T, out_i]
            cols = y[:, offset : offset + size]
            cols.add_(torch.where(active.unsqueeze(1), delta, torch.zeros((), dtype=delta.dtype, device=delta.device)))
            offset += size
