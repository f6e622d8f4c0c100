"""The built-in ``grouped`` LoRA kernel: tokens sorted by slot, one pair of products per adapter present.

Where the ``torch`` reference gathers every token's ``[R, H_in]`` and ``[out_i, R]`` weights (memory
and traffic growing with the tokens of a step), this one takes the step's tokens ordered by slot and
each slot's count (:class:`~corerun.lora.tokens.LoRATokens`, counted and sorted once per step, not
per layer; the slots' scalings read to the host once per step, too) and, for each slot present,
multiplies its tokens' rows by that slot's A and B once: two matrix products per adapter and slice,
whatever the batch.  The counts are host values (a graph would replay them as captured), so it is
not graph safe: for the CPU (and eager CUDA).  On the CPU, float16 and bfloat16 products run in
float32 (oneDNN's half kernels are slow at rank-sized shapes), rounded once into ``y``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch

from corerun.lora.capabilities import GROUPED_KERNEL
from corerun.lora.tokens import LoRATokens
from corerun.protocols.lora import LoRAKernelCapabilities

HALF = (torch.float16, torch.bfloat16)  # on the CPU their small products run faster (and closer) in float32


class GroupedLoRAKernel:
    """``add_lora`` as :class:`corerun.protocols.lora.LoRAKernel` states it, one adapter group at a time."""

    name: ClassVar[str] = "grouped"
    capabilities: LoRAKernelCapabilities = GROUPED_KERNEL

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"LoRA kernel 'grouped' takes no options, got {sorted(options)}")

    def add_lora(
        self, y: torch.Tensor, x: torch.Tensor, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor],
        scalings: torch.Tensor, tokens: LoRATokens, output_slices: Sequence[int],
    ) -> None:
        total = x.shape[0]
        if tokens.num_base == tokens.num_tokens:
            return  # every token is the base model's
        compute = torch.float32 if x.device.type == "cpu" and x.dtype in HALF else x.dtype
        scale = tokens.host_scalings(scalings) if scalings.device.type == "cpu" else scalings  # (on a device: 0-d tensors, no read)
        start = tokens.num_base
        for s, n in enumerate(tokens.host_counts):
            if n == 0:
                continue
            rows = tokens.order[start : start + n]
            start += n
            xs = (x if n == total else x.index_select(0, rows)).to(compute)  # [n, H_in]
            offset = 0
            for a_i, b_i, size in zip(a, b, output_slices):
                delta = ((xs @ a_i[s].T.to(compute)).mul_(scale[s]) @ b_i[s].T.to(compute)).to(y.dtype)  # [n, R] -> [n, out_i]
                cols = y[:, offset : offset + size]
                if n == total:
                    cols.add_(delta)
                else:
                    cols.index_add_(0, rows, delta)
                offset += size
