"""Broken fused ops, each the built-in ``torch`` implementation with one fault, that ``FusedOpsSuite`` must reject."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from corerun.models.fused_ops import TorchFusedOps


class NormWithoutEps(TorchFusedOps):
    """``x / sqrt(mean(x**2))``: drops ``eps`` (rows whose ``mean(x**2)`` is near ``eps`` come out too large)."""

    def rms_norm(self, x, weight, eps):
        return super().rms_norm(x, weight, 0.0)


class NormOverTokens(TorchFusedOps):
    """Takes the mean of ``x**2`` over the tokens (the first axis) instead of the features."""

    def rms_norm(self, x, weight, eps):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(dim=0, keepdim=True) + eps) * weight.float()).to(x.dtype)


class SwapsGateAndUp(TorchFusedOps):
    """``silu(up) * gate``: the halves of ``[gate | up]`` taken the other way round."""

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(up) * gate


class RotatesAdjacentPairs(TorchFusedOps):
    """GPT-J's interleaved layout: rotates ``(x[2i], x[2i+1])`` instead of ``(x[i], x[i + D/2])``."""

    def rotary(self, x, cos, sin):
        half = x.shape[-1] // 2
        c, s = cos[..., :half], sin[..., half:]
        even, odd = x[..., 0::2].float(), x[..., 1::2].float()
        return torch.stack([even * c - odd * s, odd * c + even * s], dim=-1).flatten(-2).to(x.dtype)


class FlipsSinSign(TorchFusedOps):
    """Rotates by ``-angle``: ``sin``'s sign flipped."""

    def rotary(self, x, cos, sin):
        return super().rotary(x, cos, -sin)


class NormInPlace(TorchFusedOps):
    """Writes the normalised rows into ``x`` and returns it (the residual stream is lost)."""

    def rms_norm(self, x, weight, eps):
        return x.copy_(super().rms_norm(x, weight, eps))


class SiluInPlace(TorchFusedOps):
    """Writes ``silu(gate)`` over ``gate`` and multiplies it in place."""

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate, inplace=True).mul_(up)


class RotaryInPlace(TorchFusedOps):
    """Rotates ``x`` in place and returns it (a fused qkv output's q and k overwritten)."""

    def rotary(self, x, cos, sin):
        return x.copy_(super().rotary(x, cos, sin))


class NormsBeforeTheAdd(TorchFusedOps):
    """``add_rms_norm`` normalising ``x`` alone: the residual is added to the stream but left out of the norm."""

    def add_rms_norm(self, x, residual, weight, eps):
        return super().rms_norm(x, weight, eps), x + residual


class ReturnsTheOldResidual(TorchFusedOps):
    """``add_rms_norm`` handing back (a copy of) the residual it was given instead of ``x + residual``."""

    def add_rms_norm(self, x, residual, weight, eps):
        return super().add_rms_norm(x, residual, weight, eps)[0], residual.clone()


class AddsInPlace(TorchFusedOps):
    """vLLM's in-place ``fused_add_rms_norm``: the sum written into ``residual`` and returned."""

    def add_rms_norm(self, x, residual, weight, eps):
        residual.add_(x)
        return super().rms_norm(residual, weight, eps), residual
