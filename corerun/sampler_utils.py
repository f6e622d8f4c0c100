"""Small helpers for sampler plugins: per-step host lists to device tensors without a sync, the logits
contract check, and one reusable ``torch.Generator`` per device for seeded rows."""

from __future__ import annotations

from typing import Any, Sequence

import torch


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list -> a tensor on ``device``; through pinned memory and a non-blocking copy on CUDA (no sync)."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def check_logits(logits: torch.Tensor, batch_size: int, vocab_size: int) -> None:
    """Raise ``ValueError`` unless ``logits`` is a floating ``[batch_size, vocab_size]`` tensor."""
    if logits.dim() != 2 or tuple(logits.shape) != (batch_size, vocab_size) or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a float tensor [batch_size={batch_size}, vocab_size={vocab_size}], "
            f"got {logits.dtype} {list(logits.shape)}"
        )


class GeneratorCache:
    """One ``torch.Generator`` per device, reseeded per seeded row (see ``corerun.sampling_noise``)."""

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}

    def get(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]
