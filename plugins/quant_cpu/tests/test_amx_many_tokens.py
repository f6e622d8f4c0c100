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
from quant_cpu_cases import amx_bf16, amx_int8, bf16_bound, poisoned_columns, untouched_outside, w8a8_bound, w8a8_reference

pytestmark = pytest.mark.timeout(600)

TOKENS = [33, 64, 65, 127, 128, 129, 257, 1000, 4096]
SHAPES = [(37, 64), (200, 576), (584, 1536)]  # rows: 2.3, 12.5 and 36.5 blocks of 16
BLOCKINGS = {
    "default": {},
    "fine": {"large_tokens": 0, "group_bytes": 0, "chunk_tokens": 32, "order": 0},
    "fine_pairs_outer": {"large_tokens": 0, "group_bytes": 0, "chunk_tokens": 32, "order": 1},
    "few_token_loop": {"large_tokens": 1 << 30},
}


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
    ref = w8a8_reference(x, w, scale)
    wide, out = poisoned_columns(tokens, rows, 1, torch.bfloat16)
    packed = kernels.repack_int8(w)
    with blocking(name):
        kernels.int8_amx_linear(out, packed, scale, x)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs()
    bound = w8a8_bound(ref, torch.bfloat16)
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f} of the bound"
    assert untouched_outside(wide, 1, rows)


@pytest.mark.skipif("not amx_int8()", reason="this CPU (or kernel) offers no AMX-INT8")
@pytest.mark.parametrize("tokens", [65, 1000])
def test_int8_many_tokens_float32_activations(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    w = torch.randint(-128, 128, (200, 576), generator=g, dtype=torch.int8)
    scale = torch.rand(200, generator=g) * 0.02 + 1e-3
    x = torch.randn(tokens, 576, generator=g) * 3
    ref = w8a8_reference(x, w, scale)
    out = torch.full((tokens, 200), float("nan"))
    kernels.int8_amx_linear(out, kernels.repack_int8(w), scale, x)
    assert torch.isfinite(out).all() and ((out.double() - ref).abs() <= w8a8_bound(ref, torch.float32)).all()


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
    wide, out = poisoned_columns(tokens, rows, 2, torch.bfloat16)
    packed = kernels.repack_bf16(w)
    with blocking(name):
        kernels.bf16_gemv(out, packed, x, "amx")
    assert torch.isfinite(out).all()
    bound = bf16_bound(x, w, ref)
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f} of the bound"
    assert untouched_outside(wide, 2, rows)


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
