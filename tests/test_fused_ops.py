"""The ``fused_ops`` plugin kind: the built-in ``torch`` reference registered and passing its suite, the suite
rejecting each broken implementation, selection (``auto``, explicit, refused with every reason), the runner
handing the choice to the model's layers, and ``corerun new fused_ops NAME`` passing the suite unedited."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from corerun.cli import cli
from corerun.config import load_config
from corerun.conformance import run
from corerun.conformance.fused_ops_suite import FusedOpsSuite
from corerun.conformance.suite import Case
from corerun.errors import PluginUnavailableError
from corerun.models.fused_ops import TorchFusedOps, use_fused_ops
from corerun.plugin.hookspecs import hookimpl
from corerun.plugin.registry import Registry
from corerun.protocols.fused_ops import FusedAddRMSNorm, FusedOps, FusedOpsCapabilities, FusedOpsNeed
from corerun.testing.engines import TEST_DEFAULTS
from corerun.testing.tiny_models import corerun_logits, load_corerun_model, make_tiny_model
from tests.broken_impls.fused_ops import (
    AddsInPlace, FlipsSinSign, NormInPlace, NormOverTokens, NormsBeforeTheAdd, NormWithoutEps, ReturnsTheOldResidual,
    RotaryInPlace, RotatesAdjacentPairs, SiluInPlace, SwapsGateAndUp,
)

CPU_FLOAT32 = FusedOpsCapabilities(devices=frozenset({"cpu"}), dtypes=frozenset({"float32"}))


class TestTorch(FusedOpsSuite):
    implementation = "torch"


class Recording(TorchFusedOps):
    """The reference's ops, handed to the layers (not ``inline``), counting each call."""

    inline = False

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.calls = {"rms_norm": 0, "add_rms_norm": 0, "silu_and_mul": 0, "rotary": 0}

    def rms_norm(self, x, weight, eps):
        self.calls["rms_norm"] += 1
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        self.calls["add_rms_norm"] += 1
        return super().add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        self.calls["silu_and_mul"] += 1
        return super().silu_and_mul(x)

    def rotary(self, x, cos, sin):
        self.calls["rotary"] += 1
        return super().rotary(x, cos, sin)


def with_plugin(**registrations) -> Registry:
    """The built-ins (no installed plugin) plus a first-party one registering ``name -> (factory, register kwargs)``."""
    registry = Registry.from_environment(allow=[])

    def corerun_fused_ops(register):
        for name, (factory, kwargs) in registrations.items():
            register(name, factory, **kwargs)

    plugin = types.SimpleNamespace(corerun_fused_ops=hookimpl(corerun_fused_ops))
    registry.register_module(plugin, plugin="tests-fused-ops", distribution="tests", version="0", origin="first-party")
    return registry


def test_hook_corerun_fused_ops() -> None:
    ops = Registry.from_environment().registrations["fused_ops"]
    assert ops["torch"].distribution == "corerun" and ops["torch"].priority_on("cpu") == 0
    made = ops["torch"].create()
    assert isinstance(made, FusedOps) and made.inline
    assert ops["torch"].capabilities.fits(FusedOpsNeed("cpu", "bfloat16")) == []


def _cases(broken, check: str) -> tuple[int, list[str]]:
    """How many of ``check``'s cases ``broken`` runs, and the ids of those the suite let pass."""

    class Suite(FusedOpsSuite):
        pass

    Suite.factory = broken
    suite, target = Suite(), Suite.resolve_targets()[0]
    configs = suite.configs(check, target, full=False)
    passed = []
    for case_id, config in configs:
        try:
            getattr(suite, f"test_{check}")(Case(target, check, case_id, config, "cpu"))
        except AssertionError:
            continue
        passed.append(case_id)
    return len(configs), passed


@pytest.mark.parametrize(("broken", "check"), [
    (NormWithoutEps, "rms_norm"), (NormOverTokens, "rms_norm"), (NormInPlace, "rms_norm"),
    (SwapsGateAndUp, "silu_and_mul"), (SiluInPlace, "silu_and_mul"),
    (RotatesAdjacentPairs, "rotary"), (FlipsSinSign, "rotary"), (RotaryInPlace, "rotary"),
    (NormsBeforeTheAdd, "add_rms_norm"), (ReturnsTheOldResidual, "add_rms_norm"), (AddsInPlace, "add_rms_norm"),
])
def test_every_case_rejects_a_broken_implementation(broken, check: str) -> None:
    total, passed = _cases(broken, check)
    assert total >= 24 and passed == [], f"{broken.__name__} passed {passed}"


def test_an_in_place_op_is_named_as_such() -> None:
    class Suite(FusedOpsSuite):
        factory = NormInPlace

    suite, target = Suite(), Suite.resolve_targets()[0]
    case_id, config = suite.configs("rms_norm", target, full=False)[0]
    with pytest.raises(AssertionError, match="input 0 changed"):
        suite.test_rms_norm(Case(target, "rms_norm", case_id, config, "cpu"))


def test_auto_prefers_a_fitting_kernel_and_explicit_names_are_kept_or_refused_with_every_reason() -> None:
    registry = with_plugin(fast=(Recording, {"capabilities": CPU_FLOAT32, "priority": 10}))
    assert registry.select("fused_ops", "auto", FusedOpsNeed("cpu", "float32")).name == "fast"
    eligible, passed = registry.auto_ranking("fused_ops", FusedOpsNeed("cpu", "bfloat16"))
    assert [r.name for r in eligible] == ["torch"]
    assert dict((r.name, why) for r, why in passed)["fast"] == "dtype bfloat16 not in {float32}"
    assert registry.select("fused_ops", "torch", FusedOpsNeed("cpu", "float32")).name == "torch"  # never replaced
    with pytest.raises(PluginUnavailableError) as refused:
        registry.select("fused_ops", "fast", FusedOpsNeed("cuda", "float16"))
    assert "device cuda not in {cpu}" in str(refused.value) and "dtype float16 not in {float32}" in str(refused.value)


def test_the_config_key_and_the_cli_override() -> None:
    assert load_config(None).fused_ops.name == "auto"
    from corerun.config import parse_set

    assert load_config(None, overrides=parse_set(["fused_ops=torch"])).fused_ops.name == "torch"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("fused"), "qwen3")  # q/k norms: per-head rms_norm views too


def test_layers_hand_their_work_to_ops_and_the_reference_leaves_the_logits_unchanged(tiny: Path) -> None:
    model, _ = load_corerun_model(tiny)
    ids = torch.randint(1, 200, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    before = corerun_logits(model, ids, chunks=[66, 1, 1, 1, 1])  # above and below 64 tokens
    ops = Recording()
    assert use_fused_ops(model, ops) > 0
    after = corerun_logits(model, ids, chunks=[66, 1, 1, 1, 1])
    assert torch.equal(before, after)
    layers = model.model.layers
    # per step: the first layer's input norm, q and k norms; every other norm adds the residual before it
    assert ops.calls["rms_norm"] == 5 * (2 * len(layers) + 1)
    assert ops.calls["add_rms_norm"] == 5 * 2 * len(layers)  # the input norms after the first, post-attention, final
    assert ops.calls["silu_and_mul"] == 5 * len(layers) and ops.calls["rotary"] == 5 * 2 * len(layers)


class ThreeOps:
    """An implementation written before ``add_rms_norm``: the three required ops (the reference's), counted."""

    name = "three"
    capabilities = CPU_FLOAT32

    def __init__(self) -> None:
        self.inner = Recording()
        self.calls = self.inner.calls

    def rms_norm(self, x, weight, eps):
        return self.inner.rms_norm(x, weight, eps)

    def silu_and_mul(self, x):
        return self.inner.silu_and_mul(x)

    def rotary(self, x, cos, sin):
        return self.inner.rotary(x, cos, sin)


def test_ops_without_add_rms_norm_run_the_add_in_torch_and_their_suite_skips_it(tiny: Path) -> None:
    model, _ = load_corerun_model(tiny)
    ids = torch.randint(1, 200, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    before = corerun_logits(model, ids, chunks=[66, 1, 1, 1, 1])
    ops = ThreeOps()
    assert isinstance(ops, FusedOps) and not isinstance(ops, FusedAddRMSNorm)
    use_fused_ops(model, ops)
    assert torch.equal(corerun_logits(model, ids, chunks=[66, 1, 1, 1, 1]), before)
    assert ops.calls["rms_norm"] == 5 * (4 * len(model.model.layers) + 1) and ops.calls["add_rms_norm"] == 0
    results = run("fused_ops", factory=ThreeOps, capabilities=CPU_FLOAT32, name="three")
    skipped = [r for r in results if r.check == "add_rms_norm"]
    assert [r.outcome for r in skipped] == ["skipped"] and "no add_rms_norm" in skipped[0].reason
    assert all(r.outcome == "passed" for r in results if r.check != "add_rms_norm")


def _two_adds(self, rope, hidden, ctx):  # the Llama layer before the residual stream, as a subclass might write it
    hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), ctx)
    return hidden + self.mlp(self.post_attention_layernorm(hidden))


def test_a_decoder_layer_with_its_own_forward_runs_as_before_and_the_stream_gives_the_same_logits(tiny: Path) -> None:
    from corerun.models.llama import LlamaDecoderLayer, LlamaModel

    class OwnForward(LlamaDecoderLayer):
        forward = _two_adds

    model, config = load_corerun_model(tiny)
    assert model.model.residual_stream
    assert not LlamaModel(config, model.arch_options(config), layer=OwnForward).residual_stream
    ids = torch.randint(1, 200, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    stream = corerun_logits(model, ids, chunks=[66, 1, 1, 1, 1])
    model.model.residual_stream = False  # each layer called as a module, through the forward of before
    for layer in model.model.layers:
        layer.forward = _two_adds.__get__(layer)
    assert torch.equal(corerun_logits(model, ids, chunks=[66, 1, 1, 1, 1]), stream)  # float32: the same adds


def test_the_runner_selects_once_and_hands_the_choice_to_the_layers(tiny: Path) -> None:
    from corerun.engine.llm_engine import LLMEngine
    from corerun.models.layers import RMSNorm

    registry = with_plugin(recording=(Recording, {"capabilities": CPU_FLOAT32, "priority": 10}))
    for name, expected in (("auto", Recording), ("torch", type(None))):
        config = load_config(None, overrides={**TEST_DEFAULTS, "model": str(tiny), "fused_ops": name})
        engine = LLMEngine(config, registry)
        try:
            runner = engine.runner
            norms = [m for m in runner.model.modules() if isinstance(m, RMSNorm)]
            assert norms and all(type(m.ops) is expected for m in norms)
            assert runner.describe()["fused_ops"] == ("recording" if name == "auto" else "torch")
        finally:
            engine.shutdown()


def test_scaffolded_ops_pass_the_suite_unedited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    done = CliRunner().invoke(cli, ["new", "fused_ops", "fresh", "--dir", str(tmp_path)])
    root = tmp_path / "corerun-fused-ops-fresh"
    assert done.exit_code == 0 and "corerun conformance fused_ops:fresh" in done.output, done.output
    assert "`fused_ops: fresh`" in (root / "README.md").read_text()
    listing = "import sys, corerun_fused_ops_fresh.plugin; print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy'}))"
    imported = subprocess.run([sys.executable, "-c", listing], cwd=root, capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]"  # `corerun plugins` imports the entry point: no torch
    monkeypatch.syspath_prepend(str(root))
    plugin, ops = (importlib.import_module(f"corerun_fused_ops_fresh.{m}") for m in ("plugin", "ops"))
    try:
        own = Registry()
        own.register_module(plugin, plugin="fused_ops_fresh", distribution="corerun-fused-ops-fresh", version="0.1.0")
        registered = own.get("fused_ops", "fresh")
        assert own.load_errors == [] and registered.capabilities is plugin.CAPABILITIES
        assert registered.priority_on("cpu") > 0  # above the reference, once auto may choose it (certified)
        results = run("fused_ops", factory=ops.Ops, capabilities=plugin.CAPABILITIES, name="fresh")
        failed = [(r.id, r.reason) for r in results if r.outcome != "passed"]
        assert len(results) == 3 * (12 + 12 + 6 + 18) and failed == []  # 3 dtypes x 48 cases
    finally:
        for module in [m for m in sys.modules if m.startswith("corerun_fused_ops_fresh")]:
            del sys.modules[module]
