"""The C++ kernel against float64 dequantize-then-matmul, with the ``gguf`` package's own quantizer and
decoder as the reference (llama.cpp's formats, independent of corerun's decoder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from corerun_quant_cpu import kernels  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # the first use in a fresh cache compiles the kernel


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    reasons = kernels.load()
    if reasons:
        pytest.skip("; ".join(reasons))


def _weights(type_name: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    w[0, :32] += 0.3  # a block whose minimum is far from zero (Q4_1's m), whose scale is large
    packed = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    decoded = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[type_name]).astype(np.float64)
    return torch.from_numpy(packed), torch.from_numpy(decoded)


def _isas() -> list[str]:
    return ["scalar", "avx2"] if kernels.best_isa() == "avx2" else ["scalar"]


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # float32 products and sums of exactly decoded values: the conformance suite's matmul bound
    return 8 * x.shape[1] ** 0.5 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T) + 1e-30


@pytest.mark.parametrize("type_name", sorted(kernels.TYPES))
def test_gemv_matches_float64(type_name: str) -> None:
    # 37 rows (no multiple of the thread grain or the token tile), 17 blocks, 1 / 7 / 16 tokens
    packed, w = _weights(type_name, 37, 17 * 32, seed=11)
    gen = torch.Generator().manual_seed(12)
    for tokens in (1, 7, 16):
        x = torch.randn(tokens, w.shape[1], generator=gen)
        want = x.double() @ w.T
        for isa in _isas():
            wide = torch.full((tokens, 50), float("nan"))
            out = wide[:, 5:42]  # a column slice of a wider output, as a merged layer's shard
            kernels.gguf_gemv(out, packed, x, type_name, isa)
            excess = ((out.double() - want).abs() / _bound(x, w)).max().item()
            assert excess <= 1, f"{type_name} {isa} {tokens} tokens: {excess:.3g}x the bound"
            assert wide[:, :5].isnan().all() and wide[:, 42:].isnan().all(), "wrote outside its columns"


@pytest.mark.parametrize("type_name", sorted(kernels.TYPES))
def test_dequantize_matches_the_reference_decoder(type_name: str) -> None:
    packed, w = _weights(type_name, 13, 5 * 32, seed=16)
    for isa in _isas():
        out = torch.full(tuple(w.shape), float("nan"))
        kernels.gguf_dequantize(out, packed, type_name, isa)
        # one float32 rounding at most (d * q exact, + m or the FMA rounded once)
        assert ((out.double() - w).abs() <= 2.0**-24 * w.abs()).all(), f"{type_name} {isa}"


def test_scalar_and_avx2_agree_on_the_model_shape() -> None:
    if kernels.best_isa() != "avx2":
        pytest.skip("this CPU has no AVX2: only the scalar path runs")
    packed, w = _weights("Q4_1", 64, 576, seed=13)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(14))
    outs = []
    for isa in ("scalar", "avx2"):
        out = torch.empty(3, 64)
        kernels.gguf_gemv(out, packed, x, "Q4_1", isa)
        outs.append(out.double())
    assert ((outs[0] - outs[1]).abs() <= 2 * _bound(x, w)).all()


def test_bad_arguments_are_refused_with_what_would_be_right() -> None:
    packed, _ = _weights("Q8_0", 4, 64, seed=15)
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="bytes per row"):
        kernels.gguf_gemv(torch.empty(1, 4), packed, x, "Q4_0", "scalar")  # Q8_0 rows read as Q4_0
    with pytest.raises(RuntimeError, match="out must be float32"):
        kernels.gguf_gemv(torch.empty(1, 5), packed, x, "Q8_0", "scalar")
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        kernels.gguf_gemv(torch.empty(1, 4), packed, x.double(), "Q8_0", "scalar")
    with pytest.raises(RuntimeError, match="out must be contiguous float32"):
        kernels.gguf_dequantize(torch.empty(5, 64), packed, "Q8_0", "scalar")


def test_isa_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ISA_ENV, "scalar")
    assert kernels.chosen_isa() == "scalar"
    monkeypatch.setenv(kernels.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="expected one of"):
        kernels.chosen_isa()


def test_probe_says_why_it_cannot_build(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from corerun_quant_cpu import probe

    monkeypatch.setenv("CORERUN_CACHE_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    kernels.reset()
    try:
        reasons = probe.probe()
        assert len(reasons) == 1 and "ninja is not on PATH" in reasons[0], reasons
    finally:
        kernels.reset()


@pytest.mark.parametrize("type_name", sorted(kernels.TYPES))
def test_int8_activation_variant_within_its_bound(type_name: str) -> None:
    # llama.cpp's way (benchmarks only): float32 rounding plus half an activation step per 32-block
    if kernels.best_isa() != "avx2":
        pytest.skip("gguf_gemv_q8 is AVX2 only")
    packed, w = _weights(type_name, 37, 6 * 32, seed=17)
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(18))
    out = torch.empty(3, 37)
    torch.ops.corerun_quant_cpu.gguf_gemv_q8(out, packed, x, kernels.TYPES[type_name])
    step = x.double().reshape(3, -1, 32).abs().amax(-1, keepdim=True).expand(3, 6, 32).reshape(3, -1) / 254
    bound = step @ w.abs().T + _bound(x, w)
    assert ((out.double() - x.double() @ w.T).abs() <= bound).all()
