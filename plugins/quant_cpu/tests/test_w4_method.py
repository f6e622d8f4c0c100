"""The 4-bit group-wise product (``w4_gemv``, csrc/gguf_gemv.cpp) and the methods that use it (``gptq_cpu``,
``awq_cpu``, ``compressed_tensors_cpu``'s W4A16): the kernel against float64 dequantize-then-matmul within the
int8-activation bounds (worst case and six standard deviations of its rounding), for every granule, whole
groups of four blocks and the blocks after them, 1-16 tokens, a column slice of a poisoned output; the decoder
(both paths) bit for bit; the repacked layout against its definition; the layers through corerun's ``Linear`` /
``MergedLinear`` (merged shards in one call, activation order permuted per shard, prompts decoded in C++, every
call decoded on a CPU without the AVX-512 set); the conformance suite for each method (on any CPU: without the
kernel its layers take the decoded path).  Tests that need ``w4_gemv`` itself skip elsewhere."""

from __future__ import annotations

import pytest
import torch

from corerun.conformance import QuantizationSuite
from corerun.conformance.reference.quantizers import FORMATS

from corerun_quant_cpu import kernels
from corerun_quant_cpu.w4_method import W4_MAX_TOKENS
from quant_cpu_cases import int8_activation_bound, int8_activation_sigma_bound

pytestmark = pytest.mark.timeout(300)


needs_kernel = pytest.mark.skipif("not kernels.w4_available()", reason="the int8 product (w4_gemv) needs AVX-512 with VNNI and VBMI")


class TestGptqCpuConformance(QuantizationSuite):
    implementation = "gptq_cpu"


class TestAwqCpuConformance(QuantizationSuite):
    implementation = "awq_cpu"


class TestCompressedTensorsCpuConformance(QuantizationSuite):
    implementation = "compressed_tensors_cpu"


def codes(rows: int, cols: int, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random codes, zero points (0..15) and scales of a group-wise 4-bit weight, its groups, and float64 ``W``."""
    g = torch.Generator().manual_seed(seed)
    n = -(-cols // group)
    q = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.int32)
    z = torch.randint(0, 16, (rows, n), generator=g, dtype=torch.int32)
    s = (torch.rand(rows, n, generator=g) * 0.02 + 1e-3).half().float()  # GPTQ's float16 scales
    groups = torch.arange(cols) // group
    return q, z, s, groups, (q - z[:, groups]).double() * s[:, groups].double()


@needs_kernel
@pytest.mark.parametrize("rows,cols,group,gb", [(7, 96, 32, 1), (40, 576, 64, 2), (33, 576, 128, 4), (17, 640, 128, 4),
                                                (10, 576, 576, 4), (9, 256, 256, 4), (5, 32, 32, 4)])
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 16])
def test_w4_gemv_matches_float64(rows: int, cols: int, group: int, gb: int, tokens: int) -> None:
    q, z, s, groups, w = codes(rows, cols, group, rows * 31 + cols + group)
    packed = kernels.repack_w4(q, z, s, groups)
    assert packed is not None and packed[3] == gb  # the widest granule inside one group
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)) * 2
    wide = torch.full((tokens, rows + 3), float("nan"))  # poisoned; the kernel writes columns 1 .. rows
    kernels.w4_gemv(wide[:, 1 : rows + 1], *packed[:3], x, packed[3])
    got, want = wide[:, 1 : rows + 1].double(), x.double() @ w.T
    err = (got - want).abs()
    assert (err <= int8_activation_bound(x, w)).all()
    assert (err <= int8_activation_sigma_bound(x, w)).all(), f"worst {(err / int8_activation_sigma_bound(x, w)).max():.2f} of 6 sigma"
    assert torch.isnan(wide[:, 0]).all() and torch.isnan(wide[:, rows + 1 :]).all()


@pytest.mark.parametrize("isa", ["scalar", pytest.param("avx512", marks=needs_kernel)])
@pytest.mark.parametrize("rows,cols,group", [(7, 96, 32), (40, 576, 64), (10, 576, 576)])
def test_w4_dequantize_is_exact(rows: int, cols: int, group: int, isa: str) -> None:
    """float16 scales: ``s q - s z`` is ``s (q - z)`` exactly in float32, the float64 decode bit for bit."""
    q, z, s, groups, w = codes(rows, cols, group, 11)
    assert torch.equal(kernels.w4_dequantize(*kernels.repack_w4(q, z, s, groups), isa=isa).double(), w)


def test_repacked_layout_is_its_definition() -> None:
    q, z, s, groups, _ = codes(3, 160, 64, 7)
    c, sc, negz, gb = kernels.repack_w4(q, z, s, groups)
    assert c.shape == (3, 80) and sc.shape == negz.shape == (3, 3) and gb == 2  # 5 blocks, granules of 2: 3
    for j in range(3):
        for b in range(5):
            for i in range(16):
                assert c[j, b * 16 + i] == q[j, 32 * b + i] | (q[j, 32 * b + 16 + i] << 4)
        for u in range(3):
            assert sc[j, u] == s[j, u] and negz[j, u] == -s[j, u] * z[j, u]


def test_inputs_it_cannot_take_are_left_to_the_built_in() -> None:
    q, z, s, groups, _ = codes(4, 96, 32, 3)
    assert kernels.repack_w4(q[:, :80], z, s, groups[:80]) is None  # 80 columns: not whole 32-blocks
    assert kernels.repack_w4(q, z, s, torch.arange(96) // 16) is None  # groups of 16 inside a block
    assert kernels.repack_w4(q, z, s, groups.flip(0)) is None  # groups out of order (the method permutes first)


@needs_kernel
def test_w4_gemv_refuses_bad_operands() -> None:
    q, z, s, groups, _ = codes(4, 64, 32, 3)
    c, sc, negz, gb = kernels.repack_w4(q, z, s, groups)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="granule"):
        kernels.w4_gemv(torch.empty(2, 4), c, sc, negz, x, 3)
    with pytest.raises(RuntimeError, match="scales and zero terms"):
        kernels.w4_gemv(torch.empty(2, 4), c, sc[:, :1].contiguous(), negz, x, gb)
    with pytest.raises(RuntimeError, match="overlap"):
        kernels.w4_gemv(torch.empty(1, 4).expand(2, 4), c, sc, negz, x, gb)
    with pytest.raises(RuntimeError, match="codes must be"):
        kernels.w4_gemv(torch.empty(2, 4), c[:, :16].contiguous(), sc, negz, x, gb)


def _checkpoint(fmt: str, rows: int, cols: int, seed: int, method) -> tuple[object, torch.Tensor]:
    ref = FORMATS[fmt].make(rows, cols, seed)
    out = list(method.checkpoint_weights((("model.layers.0.self_attn.q_proj." + k, t) for k, t in ref.tensors.items()), ref.config))
    return out[0][1], ref.weight


@needs_kernel
@pytest.mark.parametrize("fmt,method_name,one_call", [("gptq-4bit-g32", "gptq_cpu", True), ("gptq-4bit-g32-act-order", "gptq_cpu", False),
                                                      ("awq-4bit-g32", "awq_cpu", True), ("ct-w4a16-g32", "compressed_tensors_cpu", True)])
def test_merged_layer_multiplies_in_the_kernel_then_decodes_prefill_in_cpp(
        monkeypatch: pytest.MonkeyPatch, fmt: str, method_name: str, one_call: bool) -> None:
    from corerun.sdk import get_registry
    from corerun.sdk.models import MergedLinear

    method = get_registry().create("quantization", method_name)
    cols, sizes = 256, {"q": 64, "k": 32, "v": 32}
    layer = MergedLinear(cols, sizes, quant=method)
    weights = {}
    for i, shard in enumerate(("v", "q", "k")):  # out of order: repacked once the last is in
        packed, weights[shard] = _checkpoint(fmt, sizes[shard], cols, 40 + i, method)
        assert layer.w4 is None
        layer.weight.weight_loader(layer.weight, packed, shard)
    assert layer.w4 is not None and len(layer.w4) == (1 if one_call else 3)
    w = torch.cat([weights[s] for s in sizes])
    calls: list[int] = []
    real, decode = kernels.w4_gemv, kernels.w4_dequantize
    monkeypatch.setattr(kernels, "w4_gemv", lambda out, *a: (calls.append(out.shape[0]), real(out, *a)))
    monkeypatch.setattr(kernels, "w4_dequantize", lambda *a: (calls.append("decoded"), decode(*a))[1])
    steps = ((1, torch.float32), (7, torch.bfloat16), (32, torch.float32), (33, torch.float32), (16, torch.bfloat16), (17, torch.bfloat16))
    for tokens, dtype in steps:
        x = (torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)) * 2).to(dtype)
        with torch.no_grad():
            y = layer(x)
        assert y.dtype == dtype and y.shape == (tokens, 128)
        ref = x.double() @ w.T
        err = (y.double() - ref).abs()
        if tokens <= W4_MAX_TOKENS[dtype]:  # the kernel: int8 activations, then the output's rounding to x's dtype
            bound = int8_activation_sigma_bound(x.float(), w) + (2.0**-8 * ref.abs() if dtype == torch.bfloat16 else 0)
        elif dtype == torch.float32:  # float32 activations, the decoded weights
            bound = 8 * cols**0.5 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T)
        else:  # the weights rounded to bfloat16 (2^-9), float32 sums, the output rounded (2^-9)
            bound = 2.0**-8 * (x.double().abs() @ w.abs().T) + 2.0**-8 * ref.abs()
        assert (err <= bound).all(), (tokens, (err / bound).max().item())
    per_step = 1 if one_call else 3
    assert calls == [n for n in (1, 7, 32, "decoded", 16, "decoded") for _ in range(per_step)]


def test_without_the_avx512_set_every_call_is_decoded_in_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without AVX-512 VNNI and VBMI: the method still runs (the probe asks for the library only), every product
    through ``w4_dequantize`` and a float32 matmul, exact to float32's rounding."""
    from corerun.sdk import get_registry
    from corerun.sdk.models import Linear

    from corerun_quant_cpu.probe import probe_w4

    monkeypatch.setenv(kernels.ISA_ENV, "avx2")  # as on such a CPU: w4_available() is False, the decode's scalar loop
    assert not kernels.w4_available() and probe_w4() == []
    method = get_registry().create("quantization", "gptq_cpu")
    packed, w = _checkpoint("gptq-4bit-g32", 48, 128, 9, method)
    layer = Linear(128, 48, quant=method)
    layer.weight.weight_loader(layer.weight, packed)
    monkeypatch.setattr(kernels, "w4_gemv", lambda *a: pytest.fail("the int8 product ran without AVX-512 VNNI"))
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = layer(x)
    bound = 8 * 128**0.5 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T)
    assert ((y.double() - x.double() @ w.T).abs() <= bound).all()


