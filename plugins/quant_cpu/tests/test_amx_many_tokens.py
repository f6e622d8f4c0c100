"""The AMX products at many tokens (csrc/amx_tiles.h's blocked path, token chunks times row groups, shared by
``bf16_gemv``'s ``amx`` and ``int8_amx_linear``) against their float64 definitions: 33 to 4096 tokens, row counts
that are not whole pairs of 16-row blocks, widths of 64, 576 and 1536, each through the default blocking, a
blocking cut as fine as it goes (groups of two row blocks, chunks of 32 tokens, both loop orders: every edge
of a group and a chunk inside one call) and the few-token loop alone; outputs poisoned first, and a column
slice of a wider output so that a write outside it shows."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from corerun_quant_cpu import kernels

pytestmark = pytest.mark.timeout(600)

TOKENS = [33, 64, 65, 127, 128, 129, 257, 1000, 4096]
SHAPES = [(37, 64), (200, 576), (584, 1536)]  # rows: 2.3, 12.5 and 36.5 blocks of 16
BLOCKINGS = {
    "default": {},
    "fine": {"large_tokens": 0, "group_bytes": 0, "chunk_tokens": 32, "order": 0},
    "fine_pairs_outer": {"large_tokens": 0, "group_bytes": 0, "chunk_tokens": 32, "order": 1},
    "few_token_loop": {"large_tokens": 1 << 30},
}


def amx_int8() -> bool:
    return not kernels.load() and kernels.int8_amx_available()


def amx_bf16() -> bool:
    return not kernels.load() and kernels.bf16_best_isa() == "amx"


@contextlib.contextmanager
def blocking(name: str) -> Iterator[None]:
    before = kernels.amx_tuning(**BLOCKINGS[name])
    try:
        yield
    finally:
        kernels.amx_tuning(**before)


def cases() -> list[tuple[int, int, int]]:
    # every token count at every shape, except that 1000 and 4096 tokens run at one shape each (float64 time)
    out = [(t, r, c) for t in TOKENS if t < 1000 for r, c in SHAPES]
    return out + [(1000, 200, 576), (4096, 584, 1536), (4096, 37, 64)]


def int8_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W8A8 (docs/quantization.md): per-token scale max|x| / 127, codes round(x / s) (float32 division, half to
    even, clamped to 127), their exact product with the weight codes times both scales, in float64."""
    xf = x.float()
    x_scale = xf.abs().amax(dim=1, keepdim=True).div(127.0).clamp_min(torch.finfo(torch.float32).tiny)
    codes = torch.div(xf, x_scale).round().clamp(-127, 127)
    return (codes.double() @ w.double().T) * scale.double().reshape(1, -1) * x_scale.double()


@pytest.mark.skipif("not amx_int8()", reason="this CPU (or kernel) offers no AMX-INT8")
@pytest.mark.parametrize("name", list(BLOCKINGS))
@pytest.mark.parametrize("tokens,rows,cols", cases())
def test_int8_many_tokens_match_float64(name: str, tokens: int, rows: int, cols: int) -> None:
    if tokens >= 1000 and name != "default":
        pytest.skip("the largest counts run through the default blocking only")
    g = torch.Generator().manual_seed(tokens * 31 + rows * 7 + cols)
    w = torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int8)
    scale = torch.rand(rows, generator=g) * 0.02 + 1e-3
    x = (torch.randn(tokens, cols, generator=g) * 3).bfloat16()
    ref = int8_reference(x, w, scale)
    wide = torch.full((tokens, rows + 3), float("nan"), dtype=torch.bfloat16)  # poisoned; the kernel writes columns 1 .. rows
    out = wide[:, 1 : rows + 1]
    packed = kernels.repack_int8(w)
    with blocking(name):
        kernels.int8_amx_linear(out, packed, scale, x)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs()
    bound = 2.0**-8 * ref.abs() + 1e-30  # the output's one bfloat16 rounding
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f} of the bound"
    assert torch.isnan(wide[:, :1].float()).all() and torch.isnan(wide[:, rows + 1 :].float()).all()


@pytest.mark.skipif("not amx_int8()", reason="this CPU (or kernel) offers no AMX-INT8")
@pytest.mark.parametrize("tokens", [65, 1000])
def test_int8_many_tokens_float32_activations(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    w = torch.randint(-128, 128, (200, 576), generator=g, dtype=torch.int8)
    scale = torch.rand(200, generator=g) * 0.02 + 1e-3
    x = torch.randn(tokens, 576, generator=g) * 3
    ref = int8_reference(x, w, scale)
    out = torch.full((tokens, 200), float("nan"))
    kernels.int8_amx_linear(out, kernels.repack_int8(w), scale, x)
    bound = 4 * torch.finfo(torch.float32).eps * ref.abs() + 1e-30  # int32 sum to float32, two products
    assert torch.isfinite(out).all() and ((out.double() - ref).abs() <= bound).all()


@pytest.mark.skipif("not amx_bf16()", reason="this CPU (or kernel) offers no AMX-BF16")
@pytest.mark.parametrize("name", list(BLOCKINGS))
@pytest.mark.parametrize("tokens,rows,cols", cases())
def test_bf16_many_tokens_match_float64(name: str, tokens: int, rows: int, cols: int) -> None:
    if tokens >= 1000 and name != "default":
        pytest.skip("the largest counts run through the default blocking only")
    g = torch.Generator().manual_seed(tokens * 31 + rows * 7 + cols)
    w = torch.randn(rows, cols, generator=g).bfloat16()
    x = torch.randn(tokens, cols, generator=g).bfloat16()
    ref = x.double() @ w.double().T
    wide = torch.full((tokens, rows + 5), float("nan"), dtype=torch.bfloat16)  # poisoned; the kernel writes columns 2 .. rows + 1
    out = wide[:, 2 : rows + 2]
    packed = kernels.repack_bf16(w)
    with blocking(name):
        kernels.bf16_gemv(out, packed, x, "amx")
    assert torch.isfinite(out).all()
    # one bfloat16 rounding of the result plus the float32 sum's rounding, 8 sqrt(in) eps(float32) (|x| @ |W|.T)
    bound = 2.0**-8 * ref.abs() + 8 * cols**0.5 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.double().abs().T) + 1e-30
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f} of the bound"
    assert torch.isnan(wide[:, :2].float()).all() and torch.isnan(wide[:, rows + 2 :].float()).all()


@pytest.mark.skipif("not amx_int8()", reason="this CPU (or kernel) offers no AMX-INT8")
def test_amx_tuning_sets_and_restores() -> None:
    before = kernels.amx_tuning(chunk_tokens=64)
    try:
        assert kernels.amx_tuning()["chunk_tokens"] == 64
    finally:
        kernels.amx_tuning(**before)
    assert kernels.amx_tuning() == before
    with pytest.raises(ValueError, match="amx_tuning"):
        kernels.amx_tuning(chunk=64)
