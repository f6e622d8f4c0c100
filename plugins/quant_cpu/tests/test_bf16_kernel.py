"""``bf16_gemv`` (csrc/bf16_gemv.cpp) against float64: every instruction set this CPU runs, odd shapes,
1 to 11 tokens (a second tile of 8), 16 to 80 (AMX: whole and partial tiles of 16 tokens, passes of 32, an
odd last row block), a column slice of a wider output, and the repacked layout itself
against its definition written out element by element."""

from __future__ import annotations

import pytest
import torch

from corerun_quant_cpu import kernels
from quant_cpu_cases import bf16_bound as bound, poisoned_columns, untouched_outside

SHAPES = [(16, 32), (37, 19), (960, 576), (33, 1), (7, 64), (576, 1536), (48, 96), (100, 40)]  # 100: 7 row blocks, four streams and three left


@pytest.mark.parametrize("isa", list(kernels.BF16_ISAS))
@pytest.mark.parametrize("rows,cols", SHAPES)
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8, 11, 16, 33, 80])
def test_bf16_gemv_matches_float64(isa: str, rows: int, cols: int, tokens: int) -> None:
    if kernels.BF16_ISAS[isa] > kernels.BF16_ISAS[kernels.bf16_best_isa()]:
        pytest.skip(f"this CPU runs at most {kernels.bf16_best_isa()}")
    g = torch.Generator().manual_seed(rows * 1000 + cols * 10 + tokens)
    w = torch.randn(rows, cols, generator=g).bfloat16()
    x = torch.randn(tokens, cols, generator=g).bfloat16()
    ref = x.double() @ w.double().T
    wide, out = poisoned_columns(tokens, rows, 2, torch.bfloat16)
    kernels.bf16_gemv(out, kernels.repack_bf16(w), x, isa)
    err = (out.double() - ref).abs()
    assert torch.isfinite(out).all()
    assert (err <= bound(x, w, ref)).all(), f"worst {(err / bound(x, w, ref)).max().item():.2f} of the bound"
    assert untouched_outside(wide, 2, rows)  # nothing outside


def test_one_token_over_two_threads_matches_float64() -> None:
    """The row blocks split over the threads, each range in four streams with a remainder: every row written, once."""
    if kernels.BF16_ISAS[kernels.bf16_best_isa()] < kernels.BF16_ISAS["avx512_bf16"]:
        pytest.skip("the one-token streams are AVX512_BF16's")
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(4)
        for rows in (3072, 3088, 49 * 16 + 5, 9 * 16):
            w, x = torch.randn(rows, 576, generator=g).bfloat16(), torch.randn(1, 576, generator=g).bfloat16()
            ref = x.double() @ w.double().T
            wide, out = poisoned_columns(1, rows, 2, torch.bfloat16)
            kernels.bf16_gemv(out, kernels.repack_bf16(w), x, "avx512_bf16")
            err = (out.double() - ref).abs()
            assert (err <= bound(x, w, ref)).all() and untouched_outside(wide, 2, rows), rows
    finally:
        torch.set_num_threads(saved)


def test_repack_layout_is_its_definition() -> None:
    w = torch.randn(21, 7, generator=torch.Generator().manual_seed(3)).bfloat16()
    packed = kernels.repack_bf16(w)
    assert packed.shape == (2, 4 * 32) and packed.dtype == torch.bfloat16
    for b in range(2):
        for p in range(4):
            for r in range(16):
                for c in range(2):
                    row, col = 16 * b + r, 2 * p + c
                    want = w[row, col] if row < 21 and col < 7 else torch.tensor(0, dtype=torch.bfloat16)
                    assert packed[b, (p * 16 + r) * 2 + c] == want, (b, p, r, c)


def test_bf16_gemv_refuses_a_mismatched_layout() -> None:
    w = torch.randn(20, 10).bfloat16()
    out = torch.empty(1, 40, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="repack_bf16.s, for 40 rows of 10 columns"):
        kernels.bf16_gemv(out, kernels.repack_bf16(w), torch.randn(1, 10).bfloat16(), "scalar")


def test_amx_tiles_and_onednn_interleaved() -> None:
    """The tile configuration is per-thread state that oneDNN's AMX products (prefill) set too: each of
    the two, called in turn, still matches float64 (neither leaves the other a stale configuration)."""
    if kernels.bf16_best_isa() != "amx":
        pytest.skip(f"this CPU runs at most {kernels.bf16_best_isa()}")
    g = torch.Generator().manual_seed(11)
    w = torch.randn(96, 128, generator=g).bfloat16()
    packed = kernels.repack_bf16(w)
    with torch.inference_mode():
        onednn = torch.ops.mkldnn._reorder_linear_weight(w, None)
    for round_ in range(3):
        for tokens in (256, 24):  # oneDNN's AMX product for a prefill's rows, then the kernel's tiles
            x = torch.randn(tokens, 128, generator=g).bfloat16()
            ref = x.double() @ w.double().T
            with torch.inference_mode():
                theirs = torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
            out = torch.full((tokens, 96), float("nan"), dtype=torch.bfloat16)
            kernels.bf16_gemv(out, packed, x, "amx")
            for got in (theirs, out):
                assert (((got.double() - ref).abs()) <= bound(x, w, ref)).all(), (round_, tokens)
