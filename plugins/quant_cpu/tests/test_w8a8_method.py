"""``compressed_tensors_cpu``: the W8A8 products on AMX-INT8 (csrc/int8_amx.cpp) and AVX-512 VNNI (csrc/int8_vnni.cpp)
against float64 (each kernel this CPU runs), VNNI's row corrections, the repacked
layout against its definition, the method's layers (merged q/k/v loaded out of order, static scales and
other widths left to the built-in), ``auto``'s choice, and the default model quantized by ``corerun
quantize`` against the built-in ``compressed-tensors`` method."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from corerun.sdk.models import Linear, MergedLinear
from corerun.sdk.quantization import QuantizedTensor, int8_scheme

from corerun_quant_cpu import kernels
from quant_cpu_cases import f32_bound, int8_kernels, int8_linear, w8a8_bound as bound, w8a8_reference as reference

pytestmark = pytest.mark.timeout(300)


needs_kernel = pytest.mark.skipif("not int8_kernels()", reason="this CPU has neither AMX-INT8 nor AVX-512 VNNI")
KERNELS = [pytest.param(k, marks=pytest.mark.skipif(f"{k!r} not in int8_kernels()", reason=f"this CPU does not run the {k} kernel"))
           for k in ("amx", "vnni")]


def weights(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int8), torch.rand(rows, generator=g) * 0.02 + 1e-3


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(16, 64), (37, 128), (960, 576), (576, 1536), (49, 64), (80, 192)])
@pytest.mark.parametrize("tokens", [1, 2, 5, 6, 7, 15, 16, 17, 32, 33, 64, 130])
def test_int8_linear_matches_float64(kernel: str, dtype: torch.dtype, rows: int, cols: int, tokens: int) -> None:
    w, scale = weights(rows, cols, rows * 7 + cols + tokens)
    x = (torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens)) * 3).to(dtype)
    ref = reference(x, w, scale)
    wide = torch.full((tokens, rows + 3), float("nan"), dtype=dtype)  # poisoned; the kernel writes columns 1 .. rows
    out = wide[:, 1 : rows + 1]
    int8_linear(kernel, out, w, scale, x)
    assert torch.isfinite(out).all()
    err = (out.double() - ref).abs()
    assert (err <= bound(ref, dtype)).all(), f"worst {(err / bound(ref, dtype)).max().item():.2f} of the bound"
    assert torch.isnan(wide[:, :1].float()).all() and torch.isnan(wide[:, rows + 1 :].float()).all()


def assert_float32_within_bound(kernel: str, w: torch.Tensor, scale: torch.Tensor, x: torch.Tensor) -> None:
    """``kernel``'s float32 output for ``x`` against the float64 definition, within its one rounding."""
    out = torch.full((x.shape[0], w.shape[0]), float("nan"))
    int8_linear(kernel, out, w, scale, x)
    ref = reference(x, w, scale)
    assert ((out.double() - ref).abs() <= bound(ref, torch.float32)).all()


@pytest.mark.parametrize("kernel", KERNELS)
def test_codes_are_int8_matmuls_on_a_tie(kernel: str) -> None:
    """Values that fall exactly half-way between two codes round to even, as torch.round does: a wrong
    rounding (half away from zero) moves a code by one and the product by a whole weight row."""
    w, scale = weights(16, 64, 1)
    x = torch.zeros(1, 64)
    x[0, 0] = 127.0  # the scale is then exactly 1
    x[0, 1:8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 3.5, 4.5])
    x[0, 8:] = torch.randn(56, generator=torch.Generator().manual_seed(2)).clamp(-100, 100)
    assert_float32_within_bound(kernel, w, scale, x)


@pytest.mark.parametrize("kernel", KERNELS)
def test_extreme_codes_sum_exactly(kernel: str) -> None:
    """Weight rows of all -128 and all 127 against activation codes of +-127 (the unsigned VNNI operand 255 and
    1): the largest sums and corrections there are, exact."""
    cols = 1536
    w = torch.randint(-128, 128, (32, cols), generator=torch.Generator().manual_seed(5), dtype=torch.int8)
    w[0], w[1], w[2, ::2], w[2, 1::2] = -128, 127, -128, 127
    x = torch.full((3, cols), 1.0)
    x[1] = -1.0
    x[2, ::2] = -1.0
    scale = torch.full((32,), 2.0**-10)
    assert_float32_within_bound(kernel, w, scale, x)


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_widest_layer_sums_exactly(kernel: str) -> None:
    """``INT8_MAX_COLS`` columns of -128 against codes of 127: the largest sum either kernel takes, exact."""
    cols = kernels.INT8_MAX_COLS
    w = torch.full((16, cols), -128, dtype=torch.int8)
    w[1:] = torch.randint(-128, 128, (15, cols), generator=torch.Generator().manual_seed(8), dtype=torch.int8)
    x = torch.ones(2, cols)
    x[1, ::2] = -1.0
    scale = torch.full((16,), 2.0**-10)
    assert_float32_within_bound(kernel, w, scale, x)


@pytest.mark.parametrize("kernel", KERNELS)
def test_one_block_past_the_widest_layer_is_refused(kernel: str) -> None:
    """The kernels' own bound is the one the method reads (``kernels.INT8_MAX_COLS``, written in Python and in C++)."""
    cols = kernels.INT8_MAX_COLS + 64
    w = torch.randint(-128, 128, (16, cols), generator=torch.Generator().manual_seed(9), dtype=torch.int8)
    with pytest.raises(RuntimeError, match=rf"at most {kernels.INT8_MAX_COLS} columns"):
        int8_linear(kernel, torch.empty(1, 16), w, torch.full((16,), 2.0**-10), torch.randn(1, cols))


@pytest.mark.skipif("'vnni' not in int8_kernels()", reason="this CPU lacks AVX-512 VNNI")
def test_vnni_refuses_corrections_of_the_wrong_size() -> None:
    w, scale = weights(20, 64, 6)
    with pytest.raises(RuntimeError, match=r"w_corr must be contiguous int32 with 32 values"):
        kernels.int8_vnni_linear(torch.empty(1, 20), kernels.repack_int8(w), torch.zeros(20, dtype=torch.int32), scale, torch.randn(1, 64))


def test_corrections_are_minus_128_row_sums() -> None:
    w, _ = weights(21, 64, 7)
    corr = kernels.int8_corrections(w)
    assert corr.dtype == torch.int32 and corr.shape == (32,)
    assert corr[:21].tolist() == [-128 * int(r.sum()) for r in w.long()] and not corr[21:].any()


@needs_kernel
def test_repack_layout_is_its_definition() -> None:
    w, _ = weights(21, 64, 3)
    packed = kernels.repack_int8(w)
    assert packed.shape == (2, 64 * 16) and packed.dtype == torch.int8
    for b in range(2):
        for q in range(16):
            for r in range(16):
                for c in range(4):
                    row, col = 16 * b + r, 4 * q + c
                    assert packed[b, (q * 16 + r) * 4 + c] == (w[row, col] if row < 21 else 0), (b, q, r, c)


@needs_kernel
def test_refuses_a_width_that_is_not_whole_tiles() -> None:
    w, scale = weights(16, 96, 4)
    with pytest.raises(RuntimeError, match="columns must be a multiple of 64"):
        kernels.repack_int8(w)


def _shard(rows: int, cols: int, seed: int, activations: str = "int8-dynamic") -> tuple[QuantizedTensor, torch.Tensor, torch.Tensor]:
    w, scale = weights(rows, cols, seed)
    parts = {"weight": w, "weight_scale": scale.reshape(-1, 1)}
    if activations == "int8-static":
        parts["input_scale"] = torch.tensor([0.05])
    return QuantizedTensor(f"w{seed}", int8_scheme(True, activations), parts, rows, cols), w, scale


def _method() -> nn.Module:
    from corerun_quant_cpu.w8a8_method import CompressedTensorsCpuMethod

    return CompressedTensorsCpuMethod()


@needs_kernel
def test_merged_layer_out_of_order_goes_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    cols, sizes = 128, {"q": 48, "k": 16, "v": 16}
    layer = MergedLinear(cols, sizes, quant=_method())
    shards = {s: _shard(n, cols, i) for i, (s, n) in enumerate(sizes.items())}
    for s in ("v", "q", "k"):
        assert layer.int8_kernel is None  # not until the last shard is in
        layer.weight.weight_loader(layer.weight, shards[s][0], s)
    w = torch.cat([shards[s][1] for s in sizes])
    scale = torch.cat([shards[s][2] for s in sizes])
    calls: list[int] = []
    name = {"amx": "int8_amx_linear", "vnni": "int8_vnni_linear"}[int8_kernels()[0]]  # the first this CPU runs
    real = getattr(kernels, name)
    monkeypatch.setattr(kernels, name, lambda out, *a: (calls.append(out.shape[0]), real(out, *a)))
    for t in (1, 9, 300):  # decode steps and a prefill
        x = torch.randn(t, cols, generator=torch.Generator().manual_seed(t)).bfloat16()
        with torch.no_grad():
            y = layer(x)
        ref = reference(x, w, scale)
        assert y.dtype == torch.bfloat16 and ((y.double() - ref).abs() <= 2 * bound(ref, torch.bfloat16)).all(), t
    assert calls == [1, 9, 300]
    assert layer.int8.packed is None  # oneDNN's copy dropped: nothing calls it


@needs_kernel
@pytest.mark.parametrize("case", ["static input scale", "width 96", "width past INT8_MAX_COLS"])
def test_other_layers_keep_the_built_in_product(case: str) -> None:
    cols = {"width 96": 96, "width past INT8_MAX_COLS": kernels.INT8_MAX_COLS + 64}.get(case, 64)
    shard, w, scale = _shard(32, cols, 5, "int8-static" if case == "static input scale" else "int8-dynamic")
    layer = Linear(cols, 32, quant=_method())
    layer.weight.weight_loader(layer.weight, shard)
    assert layer.int8 is not None and layer.int8_kernel is None
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y = layer(x)
    if case == "static input scale":  # the codes of the checkpoint's one scale, 0.05
        codes = torch.div(x, 0.05).round().clamp(-127, 127)
        ref = (codes.double() @ w.double().T) * scale.double().reshape(1, -1) * 0.05
    else:
        ref = reference(x, w, scale)
    assert ((y.double() - ref).abs() <= 8 * bound(ref, torch.float32) + 1e-6 * ref.abs().max()).all()


def test_probe_refuses_a_cpu_without_amx_int8_or_vnni(monkeypatch: pytest.MonkeyPatch) -> None:
    from corerun_quant_cpu.probe import probe_w8a8

    monkeypatch.setattr(kernels, "load", lambda: [])
    monkeypatch.setattr(kernels, "int8_amx_available", lambda: False)
    monkeypatch.setattr(kernels, "int8_vnni_available", lambda: True)
    assert probe_w8a8() == []
    monkeypatch.setattr(kernels, "int8_vnni_available", lambda: False)
    assert any("AMX-INT8" in r and "VNNI" in r for r in probe_w8a8())


@needs_kernel
@pytest.mark.parametrize("amx,vnni,want", [(True, True, "amx"), (False, True, "vnni"), (False, False, None)])
def test_method_takes_amx_first_then_vnni(monkeypatch: pytest.MonkeyPatch, amx: bool, vnni: bool, want: str | None) -> None:
    monkeypatch.setattr(kernels, "int8_amx_available", lambda: amx)
    monkeypatch.setattr(kernels, "int8_vnni_available", lambda: vnni)
    assert _method().kernel == want


@needs_kernel
@pytest.mark.slow
def test_default_model_quantized_agrees_with_the_built_in(tmp_path) -> None:
    """``corerun quantize --method int8`` of the default model, run in bfloat16: ``auto`` takes
    compressed_tensors_cpu, and its greedy tokens equal the built-in compressed-tensors method's (the
    same codes and exact sums; only the last rounding's order could part them at a near-tie)."""
    import subprocess
    import sys
    from pathlib import Path

    from corerun import LLM, SamplingParams

    out = tmp_path / "w8a8"
    subprocess.run([str(Path(sys.executable).with_name("corerun")), "quantize", "--method", "int8", "--out", str(out)], check=True)
    prompts = [[1, 504, 3458, 282, 4649, 314, 1018 + i] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for q in ("auto", "compressed-tensors"):
        llm = LLM(model=str(out), dtype="bfloat16", quantization=q, threads=1)
        head = llm.engine.runner.model.lm_head.quantized
        if q == "auto" and kernels.bf16_best_isa() in kernels.BF16_NATIVE:  # the bfloat16 head through dense_cpu's kernel
            assert head is not None and head.quant.name == "dense_cpu", head
        tokens[q] = (llm.engine.runner.quantization_name, [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        del llm
    assert tokens["auto"][0] == "compressed_tensors_cpu"
    same = sum(a == b for a, b in zip(tokens["auto"][1], tokens["compressed-tensors"][1]))
    assert same >= 5, f"{same}/6 prompts equal"


@needs_kernel
@pytest.mark.skipif("not int8_kernels() or kernels.bf16_best_isa() not in kernels.BF16_NATIVE", reason="this CPU does not multiply bfloat16 natively")
def test_lm_head_in_the_model_dtype_float16_keeps_the_model_s() -> None:
    """The head goes to a dense_cpu layer in the dtype the model's layers were made in (bfloat16 or float32), and
    stays the model's own in float16; each checked against float64 within its dtype's bound."""
    from quant_cpu_cases import f32_bound

    head = torch.randn(300, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    method = _method()
    previous = torch.get_default_dtype()
    f32_kernel = kernels.f32_best_isa() == "avx512"
    layers = {}
    try:
        for dtype, want in ((torch.float16, False), (torch.float32, f32_kernel), (torch.bfloat16, True)):
            torch.set_default_dtype(dtype)
            method.create_weights(nn.Module(), 64, {None: 16})  # as the model's layers are made, in its dtype
            torch.set_default_dtype(torch.float32)  # the loader offers the head after the model's load
            layers[dtype] = method.lm_head(head)
            assert (layers[dtype] is not None) == want, dtype
    finally:
        torch.set_default_dtype(previous)
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        y = layers[torch.bfloat16](x)
    ref = x.double() @ head.double().T
    assert ((y.double() - ref).abs() <= 2.0**-7 * ref.abs() + 64 * 2.0**-24 * (x.double().abs() @ head.double().abs().T)).all()
    if f32_kernel:
        x = torch.randn(3, 64)
        with torch.no_grad():
            y = layers[torch.float32](x)
        assert y.dtype == torch.float32 and layers[torch.float32].f32_packed is not None
        assert ((y.double() - x.double() @ head.double().T).abs() <= f32_bound(x, head.float())).all()
