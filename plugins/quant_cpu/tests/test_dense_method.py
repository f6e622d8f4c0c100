"""``dense_cpu`` through corerun's layers against float64, and ``quantization: auto``'s choice of it.

The quantization conformance suite cannot take this method: its cases are GGUF block types and
``quant_method`` formats, and ``dense_cpu`` reads unquantized checkpoints only.  So its checks are made here
directly, in bfloat16 and in float32: a plain layer, a merged one loaded out of order, odd sizes, decode-sized
batches (the kernel) and a prefill-sized one (oneDNN), the LM head, and the step size from which it asks
``threads: auto`` for every thread."""

from __future__ import annotations

import pytest
import torch

from corerun.errors import PluginUnavailableError
from corerun.sdk import Registry
from corerun.sdk.models import Linear, MergedLinear

from corerun_quant_cpu import kernels
from corerun_quant_cpu.capabilities import BF16_AMX_MAX_TOKENS, BF16_MAX_TOKENS, F32_MAX_TOKENS
from corerun_quant_cpu.dense_method import DenseCpuMethod
from quant_cpu_cases import f32_bound

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def bf16_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as the loader builds a bfloat16 model
    yield
    torch.set_default_dtype(previous)


def check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within one bfloat16 rounding of the float64 product, plus the float32 sum's rounding."""
    ref = x.double() @ w.double().T
    eps32 = torch.finfo(torch.float32).eps
    tol = 2.0**-8 * ref.abs() + 8 * x.shape[1] ** 0.5 * eps32 * (x.double().abs() @ w.double().abs().T)
    assert got.dtype == torch.bfloat16 and got.shape == ref.shape
    err = (got.double() - ref).abs()
    assert (err <= tol).all(), f"worst {(err / tol).max().item():.2f} of the bound"


def tokens_counts() -> list[int]:
    return [1, 2, BF16_MAX_TOKENS, BF16_MAX_TOKENS + 1, 33, BF16_AMX_MAX_TOKENS, BF16_AMX_MAX_TOKENS + 1]


@pytest.mark.parametrize("rows,cols", [(24, 96), (7, 33), (49, 576)])
def test_plain_layer(rows: int, cols: int) -> None:
    g = torch.Generator().manual_seed(rows + cols)
    w = torch.randn(rows, cols, generator=g, dtype=torch.float32)  # a float32 checkpoint read into a bfloat16 model
    layer = Linear(cols, rows, quant=DenseCpuMethod())
    layer.weight.weight_loader(layer.weight, w)
    assert layer.bf16_packed is not None and layer.weight.numel() == 0  # repacked; the plain weight dropped
    for t in tokens_counts():
        x = torch.randn(t, cols, generator=g).bfloat16()
        with torch.no_grad():
            check(layer(x), x, w.bfloat16())


def test_merged_layer_loaded_out_of_order_and_the_kernel_runs_for_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(5)
    cols, sizes = 64, {"q": 48, "k": 17, "v": 17}
    layer = MergedLinear(cols, sizes, quant=DenseCpuMethod())
    parts = {s: torch.randn(n, cols, generator=g).bfloat16() for s, n in sizes.items()}
    for shard in ("v", "q"):
        layer.weight.weight_loader(layer.weight, parts[shard], shard)
        assert layer.bf16_packed is None  # not until the last shard is in
    layer.weight.weight_loader(layer.weight, parts["k"], "k")
    w = torch.cat([parts["q"], parts["k"], parts["v"]])
    calls: list[int] = []
    real = kernels.bf16_gemv
    monkeypatch.setattr(kernels, "bf16_gemv", lambda out, *a: (calls.append(out.shape[0]), real(out, *a)))
    above = layer.quant.max_tokens + 1  # 17 (AVX512_BF16) or 65 (AMX) tokens go to oneDNN
    for t in (1, 3, above):
        x = torch.randn(t, cols, generator=g).bfloat16()
        with torch.no_grad():
            y = layer(x)
        check(y, x, w)
        assert [yy.shape[1] for yy in layer.split(y)] == [48, 17, 17]
    assert calls == [1, 3]


def test_lm_head_layer() -> None:
    g = torch.Generator().manual_seed(8)
    w = torch.randn(1000, 64, generator=g).bfloat16()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # the loader calls lm_head() after its own default dtype is gone
    try:
        head = DenseCpuMethod().lm_head(w)
    finally:
        torch.set_default_dtype(previous)
    assert head is not None and head.bf16_packed is not None
    for t in (1, 7):
        x = torch.randn(t, 64, generator=g).bfloat16()
        with torch.no_grad():
            check(head(x), x, w)


class _Checkpoint:
    """What ``quantization: auto`` is handed for an unquantized folder (corerun's ``CheckpointFormat``, not
    on the public surface a plugin imports): the device and the dtype the model will run in."""

    quant_method = None
    gguf_types: frozenset[str] = frozenset()

    def __init__(self, dtype: str | None, device: str = "cpu", compiled: bool = False) -> None:
        self.device, self.dtype, self.compiled = torch.device(device), dtype, compiled

    def describe(self) -> str:
        return "an unquantized checkpoint"


def _need(dtype: str | None) -> _Checkpoint:
    return _Checkpoint(dtype)


def test_auto_picks_dense_cpu_in_bfloat16_and_float32_and_none_in_float16() -> None:
    if kernels.bf16_best_isa() not in kernels.BF16_NATIVE:
        pytest.skip("this CPU lacks AVX512_BF16: the probe refuses dense_cpu (tested below)")
    reg = Registry.from_environment()
    assert reg.select("quantization", "auto", _need("bfloat16")).name == "dense_cpu"
    assert reg.select("quantization", "auto", _need("float32")).name == "dense_cpu"
    assert reg.select("quantization", "auto", _need("float16")).name == "none"
    assert reg.select("quantization", "none", _need("bfloat16")).name == "none"  # an explicit name is kept


def test_explicit_dense_cpu_in_float16_is_refused_naming_the_dtype() -> None:
    reg = Registry.from_environment()
    with pytest.raises(PluginUnavailableError, match=r"the model runs in float16; its layers take \{bfloat16, float32\}"):
        reg.select("quantization", "dense_cpu", _need("float16"))


def test_under_torch_compile_auto_keeps_none_and_an_explicit_name_is_refused() -> None:
    """inductor cannot lower oneDNN's packed weights nor these C++ ops: with graph.runner compile, none."""
    if kernels.bf16_best_isa() not in kernels.BF16_NATIVE:
        pytest.skip("this CPU lacks AVX512_BF16: the probe refuses dense_cpu")
    reg = Registry.from_environment()
    for dtype in ("float32", "bfloat16"):
        assert reg.select("quantization", "auto", _Checkpoint(dtype, compiled=True)).name == "none"
    with pytest.raises(PluginUnavailableError, match="graph.runner: compile; its layers do not trace"):
        reg.select("quantization", "dense_cpu", _Checkpoint("float32", compiled=True))


def test_probe_refuses_a_cpu_without_avx512_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from corerun_quant_cpu.probe import probe_dense

    monkeypatch.setattr(kernels, "bf16_best_isa", lambda: "avx512")
    assert "lacks AVX512_BF16" in " ".join(probe_dense())


@pytest.fixture
def f32_default():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # as the loader builds a float32 model (after bf16_default's)
    yield
    torch.set_default_dtype(previous)


def check_f32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within a float32 sum's rounding of the float64 product."""
    ref = x.double() @ w.double().T
    assert got.dtype == torch.float32 and got.shape == ref.shape
    err = (got.double() - ref).abs()
    assert (err <= f32_bound(x, w)).all(), f"worst {(err / f32_bound(x, w)).max().item():.2f} of the bound"


def _needs_f32_kernel() -> None:
    if kernels.f32_best_isa() != "avx512":
        pytest.skip("this CPU lacks AVX-512: dense_cpu keeps a float32 layer's plain weight")


@pytest.mark.parametrize("rows,cols", [(24, 96), (7, 33), (49, 576)])
def test_float32_plain_layer(f32_default, rows: int, cols: int) -> None:
    _needs_f32_kernel()
    g = torch.Generator().manual_seed(rows + cols)
    w = torch.randn(rows, cols, generator=g)
    method = DenseCpuMethod()
    layer = Linear(cols, rows, quant=method)
    layer.weight.weight_loader(layer.weight, w)
    assert layer.f32_packed is not None and layer.bf16_packed is None and layer.weight.numel() == 0
    assert method.parallel_tokens == 1  # the kernel splits one token's rows over the threads
    for t in (1, 2, F32_MAX_TOKENS, F32_MAX_TOKENS + 1, 40):
        x = torch.randn(t, cols, generator=g)
        with torch.no_grad():
            check_f32(layer(x), x, w)


def test_float32_merged_layer_the_kernel_for_decode_onednn_above(f32_default, monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_f32_kernel()
    g = torch.Generator().manual_seed(6)
    cols, sizes = 64, {"gate": 40, "up": 40}
    layer = MergedLinear(cols, sizes, quant=DenseCpuMethod())
    parts = {s: torch.randn(n, cols, generator=g) for s, n in sizes.items()}
    layer.weight.weight_loader(layer.weight, parts["up"], "up")
    assert layer.f32_packed is None  # not until the last shard is in
    layer.weight.weight_loader(layer.weight, parts["gate"], "gate")
    w = torch.cat([parts["gate"], parts["up"]])
    calls: list[int] = []
    real = kernels.f32_gemv
    monkeypatch.setattr(kernels, "f32_gemv", lambda out, *a: (calls.append(out.shape[0]), real(out, *a)))
    for t in (1, 5, F32_MAX_TOKENS + 1):
        x = torch.randn(t, cols, generator=g)
        with torch.no_grad():
            y = layer(x)
        check_f32(y, x, w)
        assert [yy.shape[1] for yy in layer.split(y)] == [40, 40]
    assert calls == [1, 5]


def test_float32_lm_head_layer(f32_default) -> None:
    """In a float32 model the head is a float32 layer, from a bfloat16 tensor as read (the default model's folder)."""
    _needs_f32_kernel()
    g = torch.Generator().manual_seed(9)
    method = DenseCpuMethod()
    Linear(8, 8, quant=method)  # the model's layers are made first, in its dtype
    w = torch.randn(1000, 64, generator=g).bfloat16()
    torch.set_default_dtype(torch.bfloat16)  # not the model's: lm_head() takes the dtype its layers were made in
    head = method.lm_head(w)
    assert head is not None and head.f32_packed is not None
    torch.set_default_dtype(torch.float32)
    for t in (1, 7):
        x = torch.randn(t, 64, generator=g)
        with torch.no_grad():
            check_f32(head(x), x, w.float())


def test_bfloat16_model_leaves_threads_to_the_dtype_rule() -> None:
    method = DenseCpuMethod()
    Linear(8, 8, quant=method)
    assert method.model_dtype == torch.bfloat16 and method.parallel_tokens is None
