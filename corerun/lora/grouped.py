"""The built-in ``grouped`` LoRA kernel: tokens sorted by slot, one pair of products per adapter present.

Where the ``torch`` reference gathers every token's ``[R, H_in]`` and ``[out_i, R]`` weights (memory
and traffic growing with the tokens of a step), this one counts the tokens of each slot
(``bincount``), orders them by slot (a stable ``argsort``) and, for each slot present, multiplies its
tokens' rows by that slot's A and B once: two matrix products per adapter and slice, whatever the
batch.  The counts are read on the host, so it is not graph safe: for the CPU (and eager CUDA).  On
the CPU, float16 and bfloat16 products run in float32 (oneDNN's half kernels are slow at rank-sized
shapes), rounded once into ``y``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Sequence

import torch

from corerun.lora.capabilities import GROUPED_KERNEL
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
        scalings: torch.Tensor, token_slots: torch.Tensor, output_slices: Sequence[int],
    ) -> None:
        slots = token_slots.long()
        counts = torch.bincount(slots + 1, minlength=a[0].shape[0] + 1).tolist()  # [-1, 0, 1, ...]: one host read
        if counts[0] == slots.numel():
            return  # every token is the base model's
        order = torch.argsort(slots, stable=True)
        compute = torch.float32 if x.device.type == "cpu" and x.dtype in HALF else x.dtype
        scale = scalings.tolist()
        start = counts[0]
        for s, n in enumerate(counts[1:]):
            if n == 0:
                continue
            rows = order[start : start + n]
            start += n
            xs = (x if n == slots.numel() else x.index_select(0, rows)).to(compute)  # [n, H_in]
            offset = 0
            for a_i, b_i, size in zip(a, b, output_slices):
                delta = ((xs @ a_i[s].T.to(compute)).mul_(scale[s]) @ b_i[s].T.to(compute)).to(y.dtype)  # [n, R] -> [n, out_i]
                cols = y[:, offset : offset + size]
                if n == slots.numel():
                    cols.add_(delta)
                else:
                    cols.index_add_(0, rows, delta)
                offset += size
