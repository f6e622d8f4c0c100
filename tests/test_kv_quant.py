"""The quantized KV cache (kv_cache.dtype: fp8_e4m3 | fp8_e5m2 | int8): sizing, selection, and a tiny model's
logits against an independent fake-quantized float64 run and against the unquantized cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from corerun.attention.torch_backend import TorchAttentionBackend
from corerun.config import Config
from corerun.conformance.reference.kv_quant import fake_quant
from corerun.errors import UnsupportedError
from corerun.kv_cache import num_blocks_for_budget
from corerun.plugin.capabilities import AttentionCapabilities
from corerun.protocols.attention import AttentionSpec
from corerun.protocols.forward_context import AttentionContext
from corerun.protocols.step_layout import requests_step

# the default model's attention (SmolLM2-135M): 3 KV heads of 64, 30 layers
DEFAULT_SHAPE = dict(num_heads=9, num_kv_heads=3, head_size=64, block_size=16, device=torch.device("cpu"))


def test_fake_quant_matches_the_formats_grid() -> None:
    """The reference rounding agrees with torch's fp8 types on random values across the range (incl. subnormals)."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * torch.logspace(-4, 2, 4096)
    for name, dt in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        assert torch.equal(fake_quant(x, name, 1.0), x.float().to(dt).to(torch.float64)), name


def test_fp8_cache_holds_at_least_1_9x_the_blocks_of_bfloat16() -> None:
    """The same 1 GiB CPU budget, the default model's 30 layers: fp8 blocks are half as large, int8 ones
    (64 values + a 2-byte float16 scale per token-head) 64/66 of that."""
    counts = {}
    for kv in ("auto", "fp8_e4m3", "int8"):
        spec = AttentionSpec(dtype=torch.bfloat16, kv_cache_dtype=kv, **DEFAULT_SHAPE)
        backend = TorchAttentionBackend(spec)
        cache = backend.allocate_kv_cache(3)  # + its write-off block
        assert cache.numel() * cache.element_size() == 4 * backend.kv_cache_bytes_per_block()
        counts[kv] = num_blocks_for_budget(backend.kv_cache_bytes_per_block() * 30, device=torch.device("cpu"),
                                           memory_fraction=0.9, cpu_memory_gb=1.0)
    per_token_head = {"auto": 2 * 64, "fp8_e4m3": 64, "int8": 64 + 2}  # bytes of K (or V) for one head
    for kv, n in counts.items():
        assert n == (1 << 30) // (2 * 16 * 3 * per_token_head[kv] * 30)
    assert counts["fp8_e4m3"] >= 1.9 * counts["auto"]
    assert counts["int8"] >= 1.9 * counts["auto"]


def test_int8_rows_equal_the_reference_grid_from_tiny_to_saturating_rows() -> None:
    """Stored int8 rows read back equal to the reference (a float16 scale rounded up on float16's grid, from frexp)
    for rows whose largest value runs from 1e-9 (a subnormal scale) to 1e7 (beyond 127 * 65504: saturated), and
    an all-zero row reads back as zeros; every stored scale is a float16 in the row's last two bytes."""
    from corerun.protocols import kv_quant

    spec = AttentionSpec(dtype=torch.float32, kv_cache_dtype="int8", **DEFAULT_SHAPE)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2048, 3, 64, generator=gen) * torch.logspace(-9, 7, 2048)[:, None, None]
    x[7] = 0
    rows = kv_quant.quantize(x, spec, 0)
    assert rows.shape == (2048, 3, 66) and rows.dtype == torch.int8
    back = kv_quant.dequantize(rows, spec, 0, torch.float64)
    assert torch.equal(back, fake_quant(x, "int8"))
    assert torch.equal(back[7], torch.zeros(3, 64, dtype=torch.float64))
    amax = x.double().abs().amax(-1)
    fine = amax < 127 * 65504  # below saturation: within half a step, the step amax / 127 rounded up on float16's grid
    err = (back - x.double()).abs().amax(-1)
    step = amax / 127 * (1 + 2.0**-10) + 2.0**-24  # (a relative 2**-10 for a normal scale, 2**-24 for a subnormal)
    assert (err[fine] <= step[fine] / 2 * (1 + 1e-6)).all()
    assert (err[fine] > step[fine] / 2 * 0.9).any()


def test_a_backend_without_the_kv_dtype_is_refused_naming_what_it_supports() -> None:
    spec = AttentionSpec(dtype=torch.float32, kv_cache_dtype="fp8_e5m2", **DEFAULT_SHAPE)
    reasons = AttentionCapabilities(kv_cache_dtypes=frozenset({"int8"})).check(spec)
    assert reasons == ["kv_cache.dtype fp8_e5m2 not supported (quantized KV caches it supports: int8)"]
    none = AttentionCapabilities().check(spec)
    assert none == ["kv_cache.dtype fp8_e5m2 not supported (quantized KV caches it supports: none: K/V in the model's dtype only)"]
    assert AttentionCapabilities().check(AttentionSpec(dtype=torch.float32, **DEFAULT_SHAPE)) == []


def test_config_field() -> None:
    assert Config().kv_cache.dtype == "auto"
    assert Config(kv_cache={"dtype": "fp8_e4m3", "k_scale": 0.5}).kv_cache.k_scale == 0.5
    with pytest.raises(ValueError, match="fp8_e4m3"):
        Config(kv_cache={"dtype": "fp4"})
    with pytest.raises(ValueError, match="k_scale"):
        Config(kv_cache={"k_scale": 0.0})


# --------------------------------------------------------------------- a tiny model end to end


class FakeQuantBackend(TorchAttentionBackend):
    """The float64 reference: K/V rounded by :func:`fake_quant` as they are written, kept in float64."""

    def __init__(self, spec: AttentionSpec, kv_dtype: str, scales: tuple[float, float]) -> None:
        super().__init__(spec)
        self.kv_dtype, self.scales = kv_dtype, scales

    def write_kv(self, key, value, kv_cache, slot_mapping) -> None:
        super().write_kv(fake_quant(key, self.kv_dtype, self.scales[0]), fake_quant(value, self.kv_dtype, self.scales[1]),
                         kv_cache, slot_mapping)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from corerun.models.loader import load_model
    from corerun.testing.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("kvq"), "llama", num_hidden_layers=2)
    m32, _ = load_model(folder, dtype="float32", device="cpu")
    m64, _ = load_model(folder, dtype="float64", device="cpu")
    return m32, m64, folder


def _logits(model, backend, tokens: list[int], chunks: list[int], block_size: int = 4) -> torch.Tensor:
    """Prefill ``tokens`` in ``chunks`` (1: a decode) through ``backend``'s paged cache, scrambled blocks."""
    nblocks = -(-len(tokens) // block_size)
    caches = [backend.allocate_kv_cache(nblocks + 2) for _ in range(model.num_layers)]
    table = torch.randperm(nblocks + 2, generator=torch.Generator().manual_seed(3))[:nblocks].tolist()
    out, start = [], 0
    for n in chunks:
        inputs = requests_step([start], [n], [table], block_size, "cpu", input_ids=tokens[start:start + n])
        ctx = AttentionContext(backend, backend.plan(inputs.batch), caches)
        with torch.no_grad():
            out.append(model.compute_logits(model(inputs.input_ids, inputs.positions, ctx)).double())
        start += n
    return torch.cat(out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "int8"])
def test_tiny_model_logits(tiny, kv_dtype: str) -> None:
    """A prompt of 10 then 4 decodes through a quantized cache: logits equal (float32 tolerance) to float64
    attention over the reference-rounded K/V, and within the format's relative step (2^-3 for e4m3's 3
    mantissa bits; 2^-7 of the row's largest value for int8) of the unquantized cache's, without being equal."""
    m32, m64, _ = tiny
    tokens = torch.randint(0, 200, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    chunks = [10, 1, 1, 1, 1]
    scales = (0.7, 1.3)
    spec = m32.attention_spec(torch.float32, 4, "cpu")
    got = _logits(m32, TorchAttentionBackend(replace(spec, kv_cache_dtype=kv_dtype, kv_scales=scales)), tokens, chunks)
    reference = _logits(m64, FakeQuantBackend(m64.attention_spec(torch.float64, 4, "cpu"), kv_dtype, scales), tokens, chunks)
    exact = _logits(m64, TorchAttentionBackend(m64.attention_spec(torch.float64, 4, "cpu")), tokens, chunks)
    span = exact.abs().max().item()
    assert (got - reference).abs().max().item() <= 1e-4 * span
    step = 2.0**-3 if kv_dtype == "fp8_e4m3" else 2.0**-7
    err = (got - exact).abs().max().item()
    assert 0 < err <= step * span, f"max |logit difference| {err:.3g}, bound {step * span:.3g}"


def test_a_quantized_cache_for_a_backend_without_it_is_refused() -> None:
    class Plain(TorchAttentionBackend):
        capabilities = AttentionCapabilities(dtypes=frozenset({"float32"}), devices=frozenset({"cpu"}))

    with pytest.raises(UnsupportedError, match="kv_cache.dtype int8"):
        Plain(AttentionSpec(dtype=torch.float32, kv_cache_dtype="int8", **DEFAULT_SHAPE))



def test_element_bound_holds_and_is_reached() -> None:
    """The per-element bound the suite derives (half a step) covers the rounding error and is nearly attained."""
    from corerun.conformance.reference.kv_quant import element_bound

    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    for name in ("fp8_e4m3", "fp8_e5m2", "int8"):
        ratio = (fake_quant(x, name, 0.37) - x).abs() / element_bound(x, name, 0.37)
        assert ratio.max() <= 1 + 1e-6 and ratio.max() > 0.95, (name, ratio.max())


@pytest.mark.timeout(60)
def test_engine_runs_the_configured_kv_dtype(tiny) -> None:
    """kv_cache.dtype reaches the backend through the engine: fp8 cache tensors and 4x the blocks of float32
    in the same budget."""
    from corerun.llm import LLM
    from corerun.sampling_params import SamplingParams

    folder = tiny[2]
    blocks = {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(model=str(folder), device="cpu", dtype="float32", attention="torch",
                  kv_cache={"dtype": kv, "block_size": 4, "cpu_memory_gb": 0.001})
        runner = llm.engine.runner
        blocks[kv] = runner.num_blocks
        out = llm.generate([[5, 9, 2, 7, 1]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        if kv != "auto":
            assert runner.kv_caches[0].dtype == torch.float8_e4m3fn
        llm.shutdown()
    assert 4 * blocks["auto"] <= blocks["fp8_e4m3"] < 4 * (blocks["auto"] + 1)


def test_selection_names_the_kv_dtype_and_what_the_backend_supports() -> None:
    """``auto`` passes over a backend without the format; the backend named explicitly is refused with the reason."""
    from corerun.plugin.registry import get_registry

    spec = AttentionSpec(dtype=torch.float32, kv_cache_dtype="int8", **DEFAULT_SHAPE)
    reg = get_registry()
    assert "int8" in reg.select("attention", "auto", spec).registration.capabilities.kv_cache_dtypes
    if "triton" in reg.registrations["attention"]:
        with pytest.raises(Exception, match=r"kv_cache.dtype int8 not supported \(quantized KV caches it supports: none"):
            reg.select("attention", "triton", spec)
