"""Broken LoRA kernels, each the built-in ``torch`` kernel with one fault, that ``LoRAKernelSuite`` must reject."""

from __future__ import annotations

from typing import Sequence

import torch

from corerun.lora.reference import TorchLoRAKernel


class IgnoresScaling(TorchLoRAKernel):
    """Adds ``B @ A @ x`` without the slot's ``alpha / r``."""

    def add_lora(self, y, x, a, b, scalings, tokens, output_slices) -> None:
        super().add_lora(y, x, a, b, torch.ones_like(scalings), tokens, output_slices)


class AppliesToBaseTokens(TorchLoRAKernel):
    """Gives tokens of slot -1 the adapter in slot 0."""

    def add_lora(self, y, x, a, b, scalings, tokens, output_slices) -> None:
        self.per_token(y, x, a, b, scalings, tokens.slots[: x.shape[0]].clamp(min=0), output_slices)


class SwapsSlices(TorchLoRAKernel):
    """Takes each slice's A from the next slice (q's columns get k's shrink, ...)."""

    def add_lora(self, y, x, a, b, scalings, tokens, output_slices) -> None:
        super().add_lora(y, x, [*a[1:], *a[:1]], b, scalings, tokens, output_slices)


class TransposesB(TorchLoRAKernel):
    """Reads each B as ``[S, R, out_i]`` (the transposed layout) instead of ``[S, out_i, R]``."""

    def add_lora(self, y, x, a, b: Sequence[torch.Tensor], scalings, tokens, output_slices) -> None:
        flipped = [b_i.reshape(b_i.shape[0], b_i.shape[2], b_i.shape[1]).transpose(1, 2) for b_i in b]
        super().add_lora(y, x, a, flipped, scalings, tokens, output_slices)


class Overwrites(TorchLoRAKernel):
    """Writes the adapter's product into y instead of adding it (the base output is lost)."""

    def add_lora(self, y, x, a, b, scalings, tokens, output_slices) -> None:
        delta = torch.zeros_like(y)
        super().add_lora(delta, x, a, b, scalings, tokens, output_slices)
        active = (tokens.slots[: x.shape[0]] >= 0).unsqueeze(1)
        y.copy_(torch.where(active, delta, y))
