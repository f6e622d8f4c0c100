"""``gguf_cpu`` through corerun's layers: the kernel runs for small batches, prefill decodes with the
kernel library and multiplies in torch, and both equal float64 dequantize-then-matmul; the conformance suite, with the AVX2 and the forced
scalar path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from corerun.conformance import QuantizationSuite

gguf = pytest.importorskip("gguf")

from corerun_quant_cpu import kernels  # noqa: E402

pytestmark = pytest.mark.timeout(300)


class TestGgufCpuConformance(QuantizationSuite):
    implementation = "gguf_cpu"


class TestGgufCpuScalarConformance(QuantizationSuite):
    implementation = "gguf_cpu"

    @pytest.fixture(autouse=True)
    def scalar(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(kernels.ISA_ENV, "scalar")


def test_merged_layer_uses_the_kernel_for_decode_and_its_decoder_for_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    from corerun.sdk.models import MergedLinear
    from corerun.sdk.quantization import GGUFTensor

    from corerun_quant_cpu.method import GGUFCpuMethod

    rng = np.random.default_rng(21)
    cols = 192
    layer = MergedLinear(cols, {"gate": 40, "up": 24}, quant=GGUFCpuMethod())
    # gate in Q4_1 (the kernel's), up in F16 (left to torch's decode)
    w_gate = (rng.standard_normal((40, cols)) * 0.05).astype(np.float32)
    packed = gguf.quants.quantize(w_gate, gguf.GGMLQuantizationType.Q4_1)
    gate = torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q4_1).astype(np.float64))
    layer.weight.weight_loader(layer.weight, GGUFTensor("blk.0.ffn_gate.weight", "Q4_1", torch.from_numpy(packed), cols), "gate")
    up16 = torch.from_numpy(rng.standard_normal((24, cols)) * 0.05).half()
    layer.weight.weight_loader(layer.weight, GGUFTensor("blk.0.ffn_up.weight", "F16", up16.view(torch.uint8), cols), "up")
    refs = [gate, up16.double()]
    w = torch.cat(refs)
    calls: list[str] = []
    for fn in ("gguf_gemv", "gguf_dequantize"):
        real = getattr(kernels, fn)
        monkeypatch.setattr(kernels, fn, lambda *a, _fn=fn, _real=real: (calls.append(_fn), _real(*a))[1])
    gen = torch.Generator().manual_seed(22)
    for tokens, want in ((1, ["gguf_gemv"]), (16, ["gguf_gemv"]), (17, ["gguf_dequantize"])):
        calls.clear()
        x = torch.randn(tokens, cols, generator=gen)
        with torch.no_grad():
            got = layer(x)
        assert calls == want, f"{tokens} tokens: {calls}"
        bound = 8 * cols**0.5 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T)
        if calls == ["gguf_gemv"] and layer.quant.isa == "avx512":  # int8 activations: + half a step, Q4_1 rows only
            step = x.double().reshape(tokens, -1, 32).abs().amax(-1, keepdim=True).expand(tokens, cols // 32, 32).reshape(tokens, cols) / 254
            bound = 2 * bound + torch.cat([step @ gate.abs().T, torch.zeros(tokens, 24, dtype=torch.float64)], 1)
        assert ((got.double() - x.double() @ w.T).abs() <= bound).all(), f"{tokens} tokens"
    x = torch.randn(2, cols, generator=gen).bfloat16()
    with torch.no_grad():
        got = layer(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), x.double() @ w.T, rtol=1e-2, atol=1e-2)


def test_shards_of_one_type_go_in_one_call(monkeypatch: pytest.MonkeyPatch) -> None:
    from corerun.sdk.models import MergedLinear
    from corerun.sdk.quantization import GGUFTensor

    from corerun_quant_cpu.method import GGUFCpuMethod

    rng = np.random.default_rng(23)
    cols, sizes = 96, {"q": 16, "k": 8, "v": 8}
    layer = MergedLinear(cols, sizes, quant=GGUFCpuMethod())
    refs = {}
    for shard in ("v", "q", "k"):  # out of order: merged once the last is in
        w = (rng.standard_normal((sizes[shard], cols)) * 0.05).astype(np.float32)
        packed = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        refs[shard] = torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0).astype(np.float64))
        layer.weight.weight_loader(layer.weight, GGUFTensor(f"blk.0.attn_{shard}.weight", "Q8_0", torch.from_numpy(packed), cols), shard)
    merged = layer.gguf_cpu_whole
    assert merged is not None and merged.data.shape[0] == 32
    assert all(getattr(layer, f"gguf_blocks_{i}").untyped_storage().data_ptr() == merged.data.untyped_storage().data_ptr() for i in range(3))
    calls: list[int] = []
    for fn in ("gguf_gemv", "gguf_gemv_q8_0_repacked"):  # the blocks, or (AVX-512) their repacked copy
        real = getattr(kernels, fn)
        monkeypatch.setattr(kernels, fn, lambda out, *a, _real=real: (calls.append(out.shape[1]), _real(out, *a))[1])
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(24))
    with torch.no_grad():
        got = layer(x)
    assert calls == [32]
    w = torch.cat([refs["q"], refs["k"], refs["v"]])
    step = x.double().reshape(2, -1, 32).abs().amax(-1, keepdim=True).expand(2, -1, 32).reshape(2, -1) / 254
    bound = 16 * cols**0.5 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T) + step @ w.abs().T
    assert ((got.double() - x.double() @ w.T).abs() <= bound).all()


def test_repacked_q8_0_takes_prompts_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """On AVX-512 + VNNI a whole Q8_0 layer multiplies steps of every size with its repacked product (ahead of
    decode-then-matmul to 1024 tokens); elsewhere a prompt above KERNEL_MAX_TOKENS is decoded.  Both within the
    int8-activation bound of float64 on the dequantized weight."""
    from corerun.sdk.models import Linear
    from corerun.sdk.quantization import GGUFTensor

    from corerun_quant_cpu.capabilities import KERNEL_MAX_TOKENS
    from corerun_quant_cpu.method import GGUFCpuMethod

    rng = np.random.default_rng(25)
    cols, rows = 128, 44
    layer = Linear(cols, rows, quant=GGUFCpuMethod())
    w32 = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    packed = gguf.quants.quantize(w32, gguf.GGMLQuantizationType.Q8_0)
    w = torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0).astype(np.float64))
    layer.weight.weight_loader(layer.weight, GGUFTensor("blk.0.attn_output.weight", "Q8_0", torch.from_numpy(packed), cols))
    repacked = layer.quant.isa == "avx512" and "gguf_cpu_q8_0" in layer.__dict__
    calls: list[str] = []
    for fn in ("gguf_gemv", "gguf_gemv_q8_0_repacked", "gguf_dequantize"):
        real = getattr(kernels, fn)
        monkeypatch.setattr(kernels, fn, lambda *a, _fn=fn, _real=real: (calls.append(_fn), _real(*a))[1])
    gen = torch.Generator().manual_seed(26)
    for tokens in (1, KERNEL_MAX_TOKENS, KERNEL_MAX_TOKENS + 1, 100):
        calls.clear()
        x = torch.randn(tokens, cols, generator=gen)
        with torch.no_grad():
            got = layer(x)
        if repacked:
            assert calls == ["gguf_gemv_q8_0_repacked"], (tokens, calls)
        else:
            assert calls == (["gguf_gemv"] if tokens <= KERNEL_MAX_TOKENS else ["gguf_dequantize"]), (tokens, calls)
        step = x.double().reshape(tokens, -1, 32).abs().amax(-1, keepdim=True).expand(tokens, -1, 32).reshape(tokens, -1) / 254
        bound = 16 * cols**0.5 * torch.finfo(torch.float32).eps * (x.double().abs() @ w.abs().T) + step @ w.abs().T
        assert ((got.double() - x.double() @ w.T).abs() <= bound).all(), tokens


def test_a_k_quant_mix_takes_the_k_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Q4_K_M file's mix in one layer (gate Q4_K, up Q6_K; Q5_K as a third shard): each shard its own kernel call
    up to 16 tokens, the library's decoder then torch's matmul above, all within float64's bound."""
    from corerun.sdk.models import MergedLinear
    from corerun.sdk.quantization import GGUFTensor

    from corerun_quant_cpu.method import GGUFCpuMethod
    from quant_cpu_cases import int8_activation_bound, k_blocks, matmul_bound

    cols, sizes = 512, {"gate": 24, "up": 16, "extra": 8}
    layer = MergedLinear(cols, sizes, quant=GGUFCpuMethod())
    refs = []
    for i, (shard, type_name) in enumerate(zip(sizes, ("Q4_K", "Q6_K", "Q5_K"))):
        packed, w = k_blocks(type_name, sizes[shard], cols, seed=30 + i)
        layer.weight.weight_loader(layer.weight, GGUFTensor(f"blk.0.ffn_{shard}.weight", type_name, packed, cols), shard)
        refs.append(w)
    w = torch.cat(refs)
    calls: list[tuple[str, str]] = []
    for fn in ("gguf_gemv", "gguf_dequantize"):
        real = getattr(kernels, fn)
        monkeypatch.setattr(kernels, fn, lambda out, blocks, *a, _fn=fn, _real=real: (calls.append((_fn, a[-2])), _real(out, blocks, *a))[1])
    gen = torch.Generator().manual_seed(33)
    for tokens, fn in ((1, "gguf_gemv"), (16, "gguf_gemv"), (17, "gguf_dequantize")):
        calls.clear()
        x = torch.randn(tokens, cols, generator=gen)
        with torch.no_grad():
            got = layer(x)
        assert calls == [(fn, "Q4_K"), (fn, "Q6_K"), (fn, "Q5_K")], f"{tokens} tokens: {calls}"
        act = fn == "gguf_gemv" and layer.quant.isa == "avx512"
        bound = 2 * (int8_activation_bound(x, w) if act else matmul_bound(x, w))  # the slice copy adds nothing; the stack's sums do
        assert ((got.double() - x.double() @ w.T).abs() <= bound).all(), f"{tokens} tokens"
