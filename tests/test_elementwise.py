"""The model's elementwise layers (RoPE, RMSNorm, SiLU-and-mul) against float64 closed forms, on both of RoPE's
paths (few tokens: full-width products; from ``SPLIT_MIN_TOKENS``: halves written in place), on the strided
q/k view of a fused qkv output the attention layer hands it."""

from __future__ import annotations

import pytest
import torch

from corerun.models.config import RopeConfig
from corerun.models.layers import RMSNorm, SiluAndMul
from corerun.models.rotary import SPLIT_MIN_TOKENS, RotaryEmbedding

BOUND = {torch.float32: 1e-6, torch.bfloat16: 4e-3}  # relative (Frobenius) error against float64


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tokens", [1, SPLIT_MIN_TOKENS - 1, SPLIT_MIN_TOKENS, 300])
def test_rope_matches_the_float64_rotation(dtype: torch.dtype, tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    d, hq, hkv, theta = 64, 6, 2, 10000.0
    rotary = RotaryEmbedding(d, 4096, RopeConfig(theta=theta))
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g).to(dtype)
    x = qkv[:, : (hq + hkv) * d].view(tokens, hq + hkv, d)  # strided: v follows each row
    got = rotary.angles(positions).apply(x)
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None, None] * inv
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2 :]
    ref = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], dim=-1)
    assert got.dtype == dtype and got.shape == x.shape
    assert _rel(got, ref) < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rmsnorm_matches_float64(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=g) * 2 + 0.1)
    norm = norm.to(dtype)
    x = (torch.randn(200, 576, generator=g) * 3).to(dtype)
    x64, w64 = x.double(), norm.weight.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    got = norm(x)
    assert got.dtype == dtype
    assert _rel(got, ref) < BOUND[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_silu_and_mul_matches_float64(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(50, 2 * 384, generator=g) * 2).to(dtype)
    gate, up = x.double().chunk(2, dim=-1)
    ref = gate / (1 + torch.exp(-gate)) * up
    got = SiluAndMul()(x)
    assert got.shape == (50, 384) and got.dtype == dtype
    assert _rel(got, ref) < BOUND[dtype]
