"""The ``triton`` LoRA kernel: shrink and expand launches per output slice over tokens grouped by slot.

Per ``add_lora`` call, on the device and without a host synchronisation, over the step's tokens
ordered by slot with each slot's count and start (``tokens.order`` / ``counts`` / ``starts``, which
corerun computes once per step, not per layer): for each slice the shrink (``kernels/lora_shrink.py``,
``x @ A[s].T * scaling`` into a float32 buffer ``[T, R]``) and the expand (``kernels/lora_expand.py``,
that buffer times ``B[s].T`` added into the slice's columns of ``y``).  Every grid depends on shapes
only, so a captured CUDA graph replays it with other slots.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch
import triton

from corerun.protocols.lora import LoRAKernelCapabilities, LoRATokensView
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
        scalings: torch.Tensor, tokens: LoRATokensView, output_slices: Sequence[int],
    ) -> None:
        num_tokens = x.shape[0]
        if num_tokens == 0:
            return
        rank = a[0].shape[1]
        order, starts, counts = tokens.order, tokens.starts, tokens.counts  # the step's, sorted once for every layer
        buf = torch.empty((num_tokens, max(16, triton.next_power_of_2(rank))), dtype=torch.float32, device=x.device)
        offset = 0
        for a_i, b_i, size in zip(a, b, output_slices):
            lora_shrink(x, a_i, buf, order, starts, counts, scalings, INTERPRET)
            lora_expand(buf, b_i, y, offset, order, starts, counts, INTERPRET)
            offset += size
