"""Rotary position embedding (the "rotate half" layout of Hugging Face Llama checkpoints), from a precomputed cache."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

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
    if rope.rope_type == "yarn":
        return _yarn_scaling(inv_freq, head_dim, rope)
    if rope.rope_type == "longrope":
        return inv_freq / torch.tensor(rope.short_factor, dtype=torch.float64)
    return inv_freq  # default; dynamic NTK changes nothing up to max_position_embeddings


def attention_factor(rope: RopeConfig) -> float:
    """What ``yarn`` and ``longrope`` multiply cos and sin by (1 for the other types)."""
    if rope.rope_type not in ("yarn", "longrope"):
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.factor <= 1.0:
        return 1.0
    if rope.rope_type == "longrope":
        return math.sqrt(1 + math.log(rope.factor) / math.log(float(rope.original_max_position_embeddings or 1)))
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor, 1.0)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_scaling(inv_freq: torch.Tensor, head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """YaRN: dimensions turning fewer than ``beta_slow`` times over the original length are divided by
    ``factor``, those turning more than ``beta_fast`` times are kept, with a linear ramp between."""
    length = float(rope.original_max_position_embeddings or 0)

    def dim_of(turns: float) -> float:  # the dimension whose wavelength fits ``turns`` times in ``length``
        return head_dim * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(rope.theta))

    lo, hi = dim_of(rope.beta_fast), dim_of(rope.beta_slow)
    if rope.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


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
        cache = torch.cat([angles.cos(), angles.sin()], dim=-1) * attention_factor(rope)
        cache = cache.to(torch.float32)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.ops: Any = None  # the engine's fused_ops (corerun.protocols.fused_ops), set by the runner

    def angles(self, positions: torch.Tensor) -> Rope:
        """The step's rotation for ``positions`` int64 ``[T]``, made once and applied by every layer
        (through ``ops.rotary`` when the runner set ``ops``, the engine's ``fused_ops``)."""
        cos, sin = self.cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2] each
        return Rope(torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1), self.ops)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` int64 ``[T]``; ``q`` ``[T, Hq, D]``, ``k`` ``[T, Hkv, D]`` -> rotated, same shapes and dtype."""
        rope = self.angles(positions)
        return rope.apply(q), rope.apply(k)


SPLIT_MIN_TOKENS = 64  # from here on the halves are written in place (fewer passes); below, fewer ops win


class Rope(NamedTuple):
    """``cos`` = ``[cos | cos]`` and ``sin`` = ``[-sin | sin]``, float32 ``[T, 1, D]``: rotating ``x = [x1 | x2]``
    is ``x * cos + [x2 | x1] * sin`` = ``[x1 cos - x2 sin | x2 cos + x1 sin]``, the same products and
    sums as the halves written out, in four operations on any number of heads at once.

    Those four full-width passes (and a rolled copy of ``x``) are the fewest calls, which is what counts for a
    few tokens; from :data:`SPLIT_MIN_TOKENS` tokens on, the halves are written straight into the output
    (half-width products, no roll: 3-5x faster at 512 and more tokens, ``benchmarks/RESULTS.md``)."""

    cos: torch.Tensor
    sin: torch.Tensor
    ops: Any = None  # a fused_ops implementation: ``apply`` is then its ``rotary``

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, H, D]`` -> rotated, same shape and dtype (computed in float32)."""
        if self.ops is not None:
            return self.ops.rotary(x, self.cos, self.sin)
        half = x.shape[-1] // 2
        if x.shape[0] < SPLIT_MIN_TOKENS:
            xf = x.float()
            return (xf * self.cos + xf.roll(half, dims=-1) * self.sin).to(x.dtype)
        cos, sin = self.cos[..., :half], self.sin[..., half:]
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.dtype == torch.float32:  # the products written in place: no temporaries
            torch.mul(x1, cos, out=out[..., :half]).addcmul_(x2, sin, value=-1.0)
            torch.mul(x2, cos, out=out[..., half:]).addcmul_(x1, sin)
        else:  # float32 sums, rounded once each on the copy into ``out``
            out[..., :half] = x1 * cos - x2 * sin
            out[..., half:] = x2 * cos + x1 * sin
        return out
