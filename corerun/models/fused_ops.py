"""The built-in ``torch`` fused ops: the model layers' own torch code, the reference the others are checked against.

``RMSNorm``, ``SiluAndMul`` and ``Rope`` run this same code inline when their ``ops`` is ``None``; the
runner leaves it ``None`` when this implementation is chosen (``inline``), so choosing it adds no call.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from corerun.models.layers import RMSNorm, SiluAndMul, add_rms_norm, rms_norm, silu_and_mul
from corerun.models.rotary import Rope, RotaryEmbedding
from corerun.protocols.fused_ops import FusedAddRMSNorm, FusedOpsCapabilities


class TorchFusedOps:
    """:class:`corerun.protocols.fused_ops.FusedOps` in plain torch, on any device and dtype."""

    name: ClassVar[str] = "torch"
    capabilities: FusedOpsCapabilities = FusedOpsCapabilities()
    inline: ClassVar[bool] = True  # the layers run this code themselves: the runner hands them nothing

    def __init__(self, **options: Any) -> None:
        if options:
            raise TypeError(f"fused_ops 'torch' takes no options, got {sorted(options)}")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``RMSNorm``'s torch code (:func:`corerun.models.layers.rms_norm`)."""
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``RMSNorm(x, residual)``'s torch code (:func:`corerun.models.layers.add_rms_norm`)."""
        return add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``SiluAndMul``'s torch code (:func:`corerun.models.layers.silu_and_mul`)."""
        return silu_and_mul(x)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``Rope.apply``: four full-width passes below 64 tokens, the halves written out from there."""
        return Rope(cos, sin).apply(x)


FUSED_LAYERS = (RMSNorm, SiluAndMul, RotaryEmbedding)


def use_fused_ops(model: nn.Module, ops: Any) -> int:
    """Hand ``ops`` (a fused_ops implementation, or ``None``: the layers' own torch code) to every
    ``RMSNorm``, ``SiluAndMul`` and ``RotaryEmbedding`` of ``model``; returns how many layers took it.
    Subclasses with a ``forward`` of their own (Gemma's ``1 + weight`` norm) keep their own code.
    The norms get ``add_ops`` too: ``ops`` where it has the optional ``add_rms_norm``, checked here once."""
    add_ops = ops if isinstance(ops, FusedAddRMSNorm) else None
    layers = [m for m in model.modules() if isinstance(m, FUSED_LAYERS)]
    for layer in layers:
        layer.ops = ops
        if isinstance(layer, RMSNorm):
            layer.add_ops = add_ops
    return len(layers)
