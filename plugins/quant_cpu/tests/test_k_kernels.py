"""The C++ K-type kernels (Q4_K, Q5_K, Q6_K: ``csrc/gguf_k.cpp``) against float64, with the ``gguf`` package's
decoder as the reference for the blocks (llama.cpp's formats, independent of corerun's decoders)."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from corerun_quant_cpu import kernels  # noqa: E402
from quant_cpu_cases import int8_activation_bound, int8_activation_sigma_bound, k_blocks, matmul_bound  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # the first use in a fresh cache compiles the kernel

@pytest.mark.parametrize("type_name", sorted(kernels.K_TYPES))
def test_k_dequantize_matches_the_reference_decoder(type_name: str) -> None:
    packed, w = k_blocks(type_name, 11, 3 * 256, seed=21)
    out = torch.full(tuple(w.shape), float("nan"))
    kernels.gguf_dequantize(out, packed, type_name, kernels.best_isa())
    # d sc q and dmin m are exact in float32; their difference is rounded once, as the reference rounds it
    assert ((out.double() - w).abs() <= 2.0**-24 * w.abs()).all(), type_name


@pytest.mark.parametrize("type_name", sorted(kernels.K_TYPES))
def test_k_gemv_matches_float64(type_name: str) -> None:
    # 37 rows, 3 super-blocks, 1 to 16 tokens (tiles of 4 and every remainder); one token's first 32-block all
    # zeros (dx = 0); out a column slice of a wider, NaN-poisoned output.  The int8-activation path is held to its
    # worst-case bound and to six standard deviations of its rounding (which a biased rounding or offset exceeds)
    packed, w = k_blocks(type_name, 37, 3 * 256, seed=22)
    gen = torch.Generator().manual_seed(23)
    for tokens in (1, 2, 3, 4, 7, 16):
        x = torch.randn(tokens, w.shape[1], generator=gen)
        x[-1, :32] = 0.0
        want = x.double() @ w.T
        for isa in kernels.runnable_isas():
            wide = torch.full((tokens, 50), float("nan"))
            out = wide[:, 5:42]
            kernels.gguf_gemv(out, packed, x, type_name, isa)
            bound = int8_activation_bound(x, w) if isa == "avx512" else matmul_bound(x, w)
            excess = ((out.double() - want).abs() / bound).max().item()
            assert excess <= 1, f"{type_name} {isa} {tokens} tokens: {excess:.3g}x the bound"
            if isa == "avx512":
                typical = ((out.double() - want).abs() / int8_activation_sigma_bound(x, w)).max().item()
                assert typical <= 1, f"{type_name} {tokens} tokens: {typical:.3g}x six standard deviations of the rounding"
            assert wide[:, :5].isnan().all() and wide[:, 42:].isnan().all(), "wrote outside its columns"


@pytest.mark.parametrize("type_name", sorted(kernels.K_TYPES))
def test_k_gemv_on_a_large_layer_over_threads(type_name: str) -> None:
    # 300 rows of 2048 columns: several tasks for at::parallel_for where torch has more than one thread;
    # the int8-activation error also held at its typical size, well inside its bound
    packed, w = k_blocks(type_name, 300, 2048, seed=24)
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(25))
    want = x.double() @ w.T
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for isa in kernels.runnable_isas():
            out = torch.empty(2, 300)
            kernels.gguf_gemv(out, packed, x, type_name, isa)
            ratio = ((out.double() - want).abs() / (int8_activation_bound(x, w) if isa == "avx512" else matmul_bound(x, w))).max().item()
            assert ratio <= 1, f"{type_name} {isa}: {ratio:.3g}x the bound"
    finally:
        torch.set_num_threads(threads)


def test_k_arguments_are_refused_with_what_would_be_right() -> None:
    packed, _ = k_blocks("Q4_K", 4, 512, seed=26)
    x = torch.randn(1, 512)
    with pytest.raises(RuntimeError, match="bytes per row"):
        kernels.gguf_gemv(torch.empty(1, 4), packed, x, "Q6_K", "scalar")  # Q4_K rows read as Q6_K
    with pytest.raises(RuntimeError, match="multiple of 256"):
        kernels.gguf_gemv(torch.empty(1, 4), packed, torch.randn(1, 480), "Q4_K", "scalar")
    with pytest.raises(RuntimeError, match=r"out must be float32 \[1, 4\]"):
        kernels.gguf_gemv(torch.empty(1, 5), packed, x, "Q4_K", "scalar")
    with pytest.raises(RuntimeError, match="type must be 12"):
        torch.ops.corerun_quant_cpu.gguf_k_gemv(torch.empty(1, 4), packed, x, 2, 0)
    with pytest.raises(RuntimeError, match="rows that do not overlap"):
        kernels.gguf_gemv(torch.empty(4).expand(2, 4), packed, torch.randn(2, 512), "Q4_K", "scalar")


def test_k_no_columns_is_an_empty_sum() -> None:
    for isa in kernels.runnable_isas():  # (a division by the row's bytes once killed the process here)
        out = torch.full((1, 4), 3.0)
        kernels.gguf_gemv(out, torch.empty(4, 0, dtype=torch.uint8), torch.empty(1, 0), "Q4_K", isa)
        assert torch.equal(out, torch.zeros(1, 4)), isa
