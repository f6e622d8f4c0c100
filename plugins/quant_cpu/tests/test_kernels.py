"""The C++ kernel against float64 dequantize-then-matmul, with the ``gguf`` package's own quantizer and
decoder as the reference (llama.cpp's formats, independent of corerun's decoder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from corerun_quant_cpu import kernels  # noqa: E402
from quant_cpu_cases import int8_activation_bound as _act_bound  # noqa: E402
from quant_cpu_cases import matmul_bound as _bound  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # the first use in a fresh cache compiles the kernel


def _weights(type_name: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    w[0, :32] += 0.3  # a block whose minimum is far from zero (Q4_1's m), whose scale is large
    packed = gguf.quants.quantize(w, gguf.GGMLQuantizationType[type_name])
    decoded = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[type_name]).astype(np.float64)
    return torch.from_numpy(packed), torch.from_numpy(decoded)


def _isas() -> list[str]:
    return kernels.runnable_isas()


def _path_bound(isa: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _act_bound(x, w) if isa == "avx512" else _bound(x, w)


@pytest.mark.parametrize("type_name", sorted(kernels.TYPES))
def test_gemv_matches_float64(type_name: str) -> None:
    # 37 rows (no multiple of the thread grain or the token tile), 17 blocks (four groups of 4 and one
    # left over for the AVX-512 path), 1 / 7 / 16 tokens; one token's first block all zeros (dx = 0)
    packed, w = _weights(type_name, 37, 17 * 32, seed=11)
    gen = torch.Generator().manual_seed(12)
    for tokens in (1, 7, 16):
        x = torch.randn(tokens, w.shape[1], generator=gen)
        x[-1, 32:64] = 0.0
        want = x.double() @ w.T
        for isa in _isas():
            wide = torch.full((tokens, 50), float("nan"))
            out = wide[:, 5:42]  # a column slice of a wider output, as a merged layer's shard
            kernels.gguf_gemv(out, packed, x, type_name, isa)
            excess = ((out.double() - want).abs() / _path_bound(isa, x, w)).max().item()
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


@pytest.mark.parametrize("type_name", sorted(kernels.TYPES))
def test_every_path_on_the_model_shapes(type_name: str) -> None:
    # 576 columns (18 blocks: the AVX-512 path's 4 groups and 2 left over) and 1536 (48: groups only);
    # the int8-activation error is also held against the bound at its typical size: well inside it
    gen = torch.Generator().manual_seed(14)
    for cols in (576, 1536):
        packed, w = _weights(type_name, 64, cols, seed=13)
        x = torch.randn(5, cols, generator=gen)
        want = x.double() @ w.T
        for isa in _isas():
            out = torch.empty(5, 64)
            kernels.gguf_gemv(out, packed, x, type_name, isa)
            ratio = ((out.double() - want).abs() / _path_bound(isa, x, w)).max().item()
            assert ratio <= 1, f"{type_name} {cols} {isa}: {ratio:.3g}x the bound"


@pytest.mark.parametrize("rows,nb", [(37, 31), (8, 18), (6, 48), (70, 128)])
def test_q8_0_repacked_matches_float64(rows: int, nb: int) -> None:
    # 31 blocks: spans of 16, 8, 4, 2 and 1; 37 rows: 9 groups of four and 1 left; a -128 code (never
    # written by the quantizer, valid in a file); one token's block all zeros (dx = 0); 70 rows of 4096
    # columns: several tasks of 4 groups for at::parallel_for where torch has more than one thread
    packed, _ = _weights("Q8_0", rows, nb * 32, seed=19)
    packed[rows - 1, 34 + 2 + 5] = 0x80
    packed[0, 2 + 31] = 0x80
    w = torch.from_numpy(gguf.quants.dequantize(packed.numpy(), gguf.GGMLQuantizationType.Q8_0).astype(np.float64))
    codes, scales = kernels.repack_q8_0(packed)
    blocks = packed.reshape(rows, nb, 34)
    assert torch.equal(scales, torch.from_numpy(blocks[:, :, :2].numpy().copy().view(np.float16)).reshape(rows, nb))
    # every code once, offset by 128: per group of four rows (interleaved), and per row for the last rows % 4
    stored = (blocks[:, :, 2:].reshape(rows, -1).view(torch.int8).int() + 128).sort(-1).values
    full = rows // 4 * 4
    assert torch.equal(codes[:full].reshape(-1, 4 * nb * 32).int().sort(-1).values, stored[:full].reshape(-1, 4 * nb * 32).sort(-1).values)
    assert torch.equal(codes[full:].int().sort(-1).values, stored[full:])
    if kernels.best_isa() != "avx512":
        pytest.skip("the repacked product needs AVX-512 + VNNI")
    gen = torch.Generator().manual_seed(20)
    for tokens in (1, 3, 4, 7, 16):
        x = torch.randn(tokens, nb * 32, generator=gen)
        x[-1, 32:64] = 0.0
        wide = torch.full((tokens, rows + 9), float("nan"))
        out = wide[:, 4 : 4 + rows]
        kernels.gguf_gemv_q8_0_repacked(out, codes, scales, x)
        excess = ((out.double() - x.double() @ w.T).abs() / _act_bound(x, w)).max().item()
        assert excess <= 1, f"{rows}x{nb * 32}, {tokens} tokens: {excess:.3g}x the bound"
        assert wide[:, :4].isnan().all() and wide[:, 4 + rows :].isnan().all(), "wrote outside its columns"


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
    codes, scales = kernels.repack_q8_0(packed)
    with pytest.raises(RuntimeError, match="scales must be contiguous float16"):
        torch.ops.corerun_quant_cpu.gguf_q8_0_repack(codes, scales.double(), packed)
    if kernels.best_isa() == "avx512":
        with pytest.raises(RuntimeError, match=r"codes must be contiguous uint8 \[rows, 32\]"):
            kernels.gguf_gemv_q8_0_repacked(torch.empty(1, 4), codes, scales, torch.randn(1, 32))


def test_isa_override(monkeypatch: pytest.MonkeyPatch) -> None:
    for isa in _isas():
        monkeypatch.setenv(kernels.ISA_ENV, isa)
        assert kernels.chosen_isa() == isa
    if kernels.best_isa() != "avx512":
        monkeypatch.setenv(kernels.ISA_ENV, "avx512")
        with pytest.raises(ValueError, match="this CPU runs at most"):
            kernels.chosen_isa()
        with pytest.raises(RuntimeError, match="is not available on this CPU"):
            kernels.gguf_gemv(torch.empty(1, 1), torch.zeros(1, 34, dtype=torch.uint8), torch.randn(1, 32), "Q8_0", "avx512")
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
    if "avx2" not in _isas():
        pytest.skip("gguf_gemv_q8 is AVX2 only")
    packed, w = _weights(type_name, 37, 6 * 32, seed=17)
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(18))
    out = torch.empty(3, 37)
    torch.ops.corerun_quant_cpu.gguf_gemv_q8(out, packed, x, kernels.TYPES[type_name])
    step = x.double().reshape(3, -1, 32).abs().amax(-1, keepdim=True).expand(3, 6, 32).reshape(3, -1) / 254
    bound = step @ w.abs().T + _bound(x, w)
    assert ((out.double() - x.double() @ w.T).abs() <= bound).all()


def test_one_openmp_runtime_after_the_kernels_load():
    """The operators' at::parallel_for runs on torch's own OpenMP runtime: one in the process."""
    from pathlib import Path

    from corerun.testing import openmp_runtimes

    runtimes = openmp_runtimes()
    assert len(runtimes) == 1, f"OpenMP runtimes mapped into the process: {runtimes}"
    torch_gomp = sorted((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))
    if torch_gomp:
        assert Path(runtimes[0]).resolve() == torch_gomp[0].resolve()
