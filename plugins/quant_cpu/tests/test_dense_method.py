"""``dense_cpu`` through corerun's layers against float64, and ``quantization: auto``'s choice of it.

The quantization conformance suite cannot take this method: its cases are GGUF block types and
``quant_method`` formats, with float32 activations, and ``dense_cpu`` reads unquantized checkpoints in
bfloat16 only.  So its checks are made here directly: a plain layer, a merged one loaded out of order, odd
sizes, decode-sized batches (the kernel) and a prefill-sized one (oneDNN), the LM head."""

from __future__ import annotations

import pytest
import torch

from corerun.errors import PluginUnavailableError
from corerun.sdk import Registry
from corerun.sdk.models import Linear, MergedLinear

from corerun_quant_cpu import kernels
from corerun_quant_cpu.capabilities import BF16_AMX_MAX_TOKENS, BF16_MAX_TOKENS
from corerun_quant_cpu.dense_method import DenseCpuMethod

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

    def __init__(self, dtype: str | None, device: str = "cpu") -> None:
        self.device, self.dtype = torch.device(device), dtype

    def describe(self) -> str:
        return "an unquantized checkpoint"


def _need(dtype: str | None) -> _Checkpoint:
    return _Checkpoint(dtype)


def test_auto_picks_dense_cpu_in_bfloat16_and_none_in_float32() -> None:
    if kernels.bf16_best_isa() not in kernels.BF16_NATIVE:
        pytest.skip("this CPU lacks AVX512_BF16: the probe refuses dense_cpu (tested below)")
    reg = Registry.from_environment()
    assert reg.select("quantization", "auto", _need("bfloat16")).name == "dense_cpu"
    assert reg.select("quantization", "auto", _need("float32")).name == "none"
    assert reg.select("quantization", "auto", _need("float16")).name == "none"
    assert reg.select("quantization", "none", _need("bfloat16")).name == "none"  # an explicit name is kept


def test_explicit_dense_cpu_in_float32_is_refused_naming_the_dtype() -> None:
    reg = Registry.from_environment()
    with pytest.raises(PluginUnavailableError, match=r"the model runs in float32; its layers take \{bfloat16\}"):
        reg.select("quantization", "dense_cpu", _need("float32"))


def test_probe_refuses_a_cpu_without_avx512_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from corerun_quant_cpu.probe import probe_dense

    monkeypatch.setattr(kernels, "bf16_best_isa", lambda: "avx512")
    assert "lacks AVX512_BF16" in " ".join(probe_dense())
