"""The ``triton`` LoRA kernel: shrink and expand launches per output slice over tokens grouped by slot.

Per ``add_lora`` call, on the device and without a host synchronisation: the tokens ordered by slot
(a stable ``argsort``), each slot's count (``scatter_add``) and start (``cumsum``); then for each
slice the shrink (``kernels/lora_shrink.py``, ``x @ A[s].T * scaling`` into a float32 buffer
``[T, R]``) and the expand (``kernels/lora_expand.py``, that buffer times ``B[s].T`` added into the
slice's columns of ``y``).  Every grid depends on shapes only, so a captured CUDA graph replays it
with other slots.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch
import triton

from corerun.protocols.lora import LoRAKernelCapabilities
from corerun_attention_triton.capabilities import LORA_CAPABILITIES
from corerun_attention_triton.kernels import INTERPRET
from corerun_attention_triton.kernels.lora_expand import lora_expand
from corerun_attention_triton.kernels.lora_shrink import lora_shrink


class TritonLoRAKernel:
    """``add_lora`` as :class:`corerun.protocols.lora.LoRAKernel` states it, in two Triton launches per slice."""

    name: ClassVar[str] = "triton"
    capabilities: LoRAKernelCapabilities = LORA_CAPABILITIES

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"LoRA kernel 'triton' takes no options, got {sorted(options)}")

    def add_lora(
        self, y: torch.Tensor, x: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
        scalings: torch.Tensor, token_slots: torch.Tensor, output_slices: Sequence[int],
    ) -> None:
        tokens = x.shape[0]
        if tokens == 0:
            return
        num_slots, rank = a[0].shape[0], a[0].shape[1]
        slots = token_slots.long()
        order = torch.argsort(slots, stable=True)  # slot -1 first
        counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=x.device).scatter_add_(0, slots + 1, torch.ones_like(slots))
        starts = counts.cumsum(0) - counts
        counts, starts = counts[1:], starts[1:]
        buf = torch.empty((tokens, max(16, triton.next_power_of_2(rank))), dtype=torch.float32, device=x.device)
        offset = 0
        for a_i, b_i, size in zip(a, b, output_slices):
            lora_shrink(x, a_i, buf, order, starts, counts, scalings, INTERPRET)
            lora_expand(buf, b_i, y, offset, order, starts, counts, INTERPRET)
            offset += size
