"""``f32_gemv`` (csrc/f32_gemv.cpp) against float64: every instruction set this CPU runs, odd shapes (rows not
a multiple of 16, an odd number of row blocks, one column), 1 to 19 tokens (one token's two-block path, a second
tile of 8 and a partial third), a column slice of a wider output, the repacked layout against its definition
written out element by element, and a layout that does not match refused."""

from __future__ import annotations

import pytest
import torch

from corerun_quant_cpu import kernels
from quant_cpu_cases import f32_bound, poisoned_columns, untouched_outside

SHAPES = [(16, 32), (37, 19), (960, 576), (33, 1), (7, 64), (576, 1536), (48, 96), (49, 576), (100, 40)]  # 100: 7 row blocks, four streams and three left


@pytest.mark.parametrize("isa", list(kernels.F32_ISAS))
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 11, 19])
def test_f32_gemv_matches_float64(isa: str, rows: int, cols: int, tokens: int) -> None:
    if kernels.F32_ISAS[isa] > kernels.F32_ISAS[kernels.f32_best_isa()]:
        pytest.skip(f"this CPU runs at most {kernels.f32_best_isa()}")
    g = torch.Generator().manual_seed(rows * 1000 + cols * 10 + tokens)
    w = torch.randn(rows, cols, generator=g)
    x = torch.randn(tokens, cols, generator=g)
    ref = x.double() @ w.double().T
    wide, out = poisoned_columns(tokens, rows, 2, torch.float32)
    kernels.f32_gemv(out, kernels.repack_f32(w), x, isa)
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all()
    assert (err <= f32_bound(x, w)).all(), f"worst {(err / f32_bound(x, w)).max().item():.2f} of the bound"
    assert (err.norm() / ref.norm()).item() < 1e-6
    assert untouched_outside(wide, 2, rows)  # nothing outside


def test_one_token_over_two_threads_matches_float64() -> None:
    """The row blocks split over the threads, each range in four streams with a remainder: every row written, once."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(4)
        for rows in (3072, 3088, 49 * 16 + 5):
            w, x = torch.randn(rows, 576, generator=g), torch.randn(1, 576, generator=g)
            wide, out = poisoned_columns(1, rows, 2, torch.float32)
            kernels.f32_gemv(out, kernels.repack_f32(w), x, kernels.f32_best_isa())
            err = (out.double() - x.double() @ w.double().T).abs()
            assert (err <= f32_bound(x, w)).all() and untouched_outside(wide, 2, rows), rows
    finally:
        torch.set_num_threads(saved)


def test_repack_layout_is_its_definition() -> None:
    w = torch.randn(21, 7, generator=torch.Generator().manual_seed(3))
    packed = kernels.repack_f32(w)
    assert packed.shape == (2, 7 * 16) and packed.dtype == torch.float32
    for b in range(2):
        for i in range(7):
            for r in range(16):
                row = 16 * b + r
                want = w[row, i].item() if row < 21 else 0.0
                assert packed[b, i * 16 + r].item() == want, (b, i, r)


def test_f32_gemv_refuses_a_mismatched_layout() -> None:
    w = torch.randn(20, 10)
    out = torch.empty(1, 40)
    with pytest.raises(RuntimeError, match="repack_f32.s, for 40 rows of 10 columns"):
        kernels.f32_gemv(out, kernels.repack_f32(w), torch.randn(1, 10), "scalar")
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        kernels.f32_gemv(torch.empty(1, 20), kernels.repack_f32(w), torch.randn(1, 10).bfloat16(), "scalar")
