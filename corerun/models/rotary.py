"""Rotary position embedding (the "rotate half" layout of Hugging Face Llama checkpoints), from a precomputed cache."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from corerun.models.config import RopeConfig


def inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """float64 ``[head_dim // 2]``: ``theta ** (-2i / head_dim)``, then the ``rope.rope_type`` scaling."""
    inv_freq = 1.0 / rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, the band between interpolated."""
    old_len = float(rope.original_max_position_embeddings or 0)
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / rope.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, out)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to ``q`` / ``k`` at ``positions``.

    ``cos_sin_cache`` float32 ``[max_positions, head_dim]`` holds ``cos`` in its first half and ``sin``
    in its second, computed in float64 once at construction.
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim = head_dim
        angles = torch.arange(max_positions, dtype=torch.float64)[:, None] * inverse_frequencies(head_dim, rope)[None, :]
        cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def angles(self, positions: torch.Tensor) -> Rope:
        """The step's rotation for ``positions`` int64 ``[T]``, made once and applied by every layer."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        return Rope(torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int64 ``[T]``; ``q`` ``[T, Hq, D]``, ``k`` ``[T, Hkv, D]`` -> rotated, same shapes and dtype."""
        rope = self.angles(positions)
        return rope.apply(q), rope.apply(k)


class Rope(NamedTuple):
    """``cos`` = ``[cos | cos]`` and ``sin`` = ``[-sin | sin]``, float32 ``[T, 1, D]``: rotating ``x = [x1 | x2]``
    is ``x * cos + [x2 | x1] * sin`` = ``[x1 cos - x2 sin | x2 cos + x1 sin]``, the same products and
    sums as the halves written out, in four operations on any number of heads at once."""

    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H, D]`` -> rotated, same shape and dtype (computed in float32)."""
        xf = x.float()
        return (xf * self.cos + xf.roll(x.shape[-1] // 2, dims=-1) * self.sin).to(x.dtype)
