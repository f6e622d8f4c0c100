"""``Registry.select(kind, name, need)``: one ``auto`` for every kind (graph runner, sampler, KV-cache
manager, attention): the highest priority among what fits ``need`` and ``auto`` may choose (built-in,
first-party, certified), every other implementation passed over with its reason; explicit names as asked."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from corerun.plugin import trust
from corerun.plugin.capabilities import AttentionCapabilities, GraphRunnerCapabilities, Need, SamplerCapabilities
from corerun.errors import PluginNotFoundError, PluginUnavailableError
from corerun.plugin.registry import Registry
from tests.test_registry import Provides, Recorder, builtins_only

SAFE, UNSAFE = AttentionCapabilities(cuda_graph_decode=True), AttentionCapabilities(cuda_graph_decode=False)


@pytest.fixture(autouse=True)
def _certificates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORERUN_CACHE_DIR", str(tmp_path))  # no certificate from elsewhere counts


def fast_graph(**caps: object) -> Provides:
    """A third-party graph runner that outranks both built-ins wherever it fits."""
    capabilities = GraphRunnerCapabilities(**caps) if caps else GraphRunnerCapabilities(devices=frozenset({"cpu"}))
    return Provides(graph=[("turbo", Recorder(), {"capabilities": capabilities, "priority": 50})])


def test_a_third_party_graph_runner_is_chosen_by_auto_once_certified(caplog: pytest.LogCaptureFixture) -> None:
    reg = builtins_only((fast_graph(), "turbo", "corerun-graph-turbo"))
    need = Need("cpu", attention=SAFE)
    chosen = reg.select("graph", "auto", need, "graph.runner")
    assert chosen.name == "eager" and chosen.reason == "built-in, priority 0 on cpu"
    why = {r.name: w for r, w in chosen.passed_over}
    assert why["turbo"] == "third-party, not certified on cpu (run `corerun conformance graph:turbo`)"
    assert why["cuda"].startswith("device cpu not in {cuda}")

    trust.record_certificate(reg.get("graph", "turbo"), "cpu", {"passed": 1})
    caplog.clear()
    with caplog.at_level(logging.INFO):
        chosen = reg.select("graph", "auto", need, "graph.runner")
    assert chosen.name == "turbo" and chosen.reason == "certified, priority 50 on cpu"
    assert ("eager", "lower priority (0 < 50)") in [(r.name, w) for r, w in chosen.passed_over]
    choice, reasons = [r.message for r in caplog.records if r.name in ("corerun.selection", "corerun.registry")]
    # the choice in one line at the default level; why each other one was passed over at -v (INFO)
    assert choice == (
        "graph.runner: auto chose 'turbo' from corerun-graph-turbo 1.2.3 (certified, priority 50 on cpu); "
        "passed over compile, eager, cuda, replay (corerun -v says why)"
    )
    assert reasons.startswith("graph.runner: auto passed over ")
    assert "eager: lower priority (0 < 50)" in reasons and "compile: lower priority (-10 < 50)" in reasons
    assert reg.select("graph", "auto", Need("cuda", attention=SAFE)).name != "turbo"  # certified on cpu only


def test_a_capturing_graph_runner_needs_a_graph_safe_attention_backend_and_no_tensor_parallelism() -> None:
    reg = builtins_only((fast_graph(devices=frozenset({"cpu"}), captures=True), "turbo", "corerun-graph-turbo"))
    trust.record_certificate(reg.get("graph", "turbo"), "cpu", {"passed": 1})
    assert reg.select("graph", "auto", Need("cpu", attention=SAFE)).name == "turbo"
    chosen = reg.select("graph", "auto", Need("cpu", attention=UNSAFE))
    assert chosen.name == "eager"
    assert dict((r.name, w) for r, w in chosen.passed_over)["turbo"] == (
        "captures graphs, and the attention backend does not declare its decode path CUDA-graph safe (cuda_graph_decode=False)"
    )
    chosen = reg.select("graph", "auto", Need("cpu", attention=SAFE, tensor_parallel=True))
    assert chosen.name == "eager" and "tensor-parallel" in dict((r.name, w) for r, w in chosen.passed_over)["turbo"]
    # named explicitly, it is used as asked (it replays what it safely can)
    assert reg.select("graph", "turbo", Need("cpu", attention=UNSAFE, tensor_parallel=True)).reason == "as configured"


def test_builtin_cuda_runner_outranks_eager_where_it_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    # as on a machine with a CUDA device: the cuda runner's own probe finds a CUDA build and a device
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reg = builtins_only()
    assert reg.get("graph", "cuda").unavailable_reasons() == []
    assert reg.select("graph", "auto", Need("cuda:0", attention=SAFE)).name == "cuda"
    assert reg.select("graph", "auto", Need("cuda", attention=UNSAFE)).name == "eager"
    assert reg.select("graph", "auto", Need("cpu", attention=SAFE)).name == "eager"


def sampler(name: str, priority: int) -> tuple[str, Recorder, dict]:
    return (name, Recorder(), {"capabilities": SamplerCapabilities(params=frozenset()), "priority": priority})


def test_sampler_auto_picks_by_priority_among_trusted_ones() -> None:
    reg = Registry()
    reg.register_module(Provides(sampler=[sampler("plain", 1), sampler("rich", 10)]), plugin="mine",
                        distribution="corerun-mine", version="1.0", origin=trust.FIRST_PARTY)
    reg.register_module(Provides(sampler=[sampler("loud", 99)]), plugin="loud", distribution="corerun-loud", version="1.0")
    chosen = reg.select("sampler", "auto", Need("cpu"))
    assert chosen.name == "rich" and chosen.reason == "first-party, priority 10 on cpu"
    assert sorted((r.name, w) for r, w in chosen.passed_over) == [
        ("loud", "third-party, not certified on cpu (run `corerun conformance sampler:loud`)"),
        ("plain", "lower priority (1 < 10)"),
    ]
    assert reg.select("sampler", "plain", Need("cpu")).name == "plain"  # explicit names as asked
    assert reg.select("sampler", "loud", Need("cpu")).name == "loud"
    with pytest.raises(PluginNotFoundError, match="no sampler named 'rihc'.*Did you mean 'rich'"):
        reg.select("sampler", "rihc", Need("cpu"))


def test_a_tie_is_broken_by_name_and_says_so() -> None:
    reg = Registry()
    reg.register_module(Provides(sampler=[sampler("beta", 5), sampler("alpha", 5)]), plugin="mine",
                        distribution="corerun-mine", version="1.0", origin=trust.FIRST_PARTY)
    chosen = reg.select("sampler", "auto", Need("cpu"))
    assert chosen.name == "alpha"
    assert [(r.name, w) for r, w in chosen.passed_over] == [("beta", "same priority (5) as 'alpha', which comes first by name")]


def test_kv_cache_auto_and_an_empty_kind() -> None:
    reg = builtins_only()
    assert reg.select("kv_cache", "auto", Need("cpu")).name == "paged"
    assert reg.select("sampler", "auto", Need("cpu")).name == "full"  # the core alone can sample
    with pytest.raises(PluginUnavailableError, match="no sampler is installed"):
        Registry().select("sampler", "auto", Need("cpu"))


def test_an_explicit_name_that_does_not_fit_the_device_is_refused_with_the_reason() -> None:
    reg = builtins_only((fast_graph(), "turbo", "corerun-graph-turbo"))
    with pytest.raises(PluginUnavailableError) as err:
        reg.select("graph", "turbo", Need("cuda", attention=SAFE))
    assert err.value.reasons == ["device cuda not in {cpu}"]


def test_corerun_plugins_shows_the_same_choice_for_every_kind() -> None:
    from corerun.cli.plugins import auto_choices

    reg = builtins_only((fast_graph(), "turbo", "corerun-graph-turbo"))
    reg.register_module(Provides(sampler=[sampler("rich", 20)]), plugin="mine", distribution="corerun-mine",
                        version="1.0", origin=trust.FIRST_PARTY)  # above the built-in full's 10
    rows = {(a["kind"], a["device"]): a for a in auto_choices(reg)}
    assert rows[("graph", "cpu")]["choice"] == "eager"
    assert {p["name"]: p["why"] for p in rows[("graph", "cpu")]["passed_over"]}["turbo"].startswith("third-party, not certified")
    trust.record_certificate(reg.get("graph", "turbo"), "cpu", {"passed": 1})
    rows = {(a["kind"], a["device"]): a for a in auto_choices(reg)}
    assert rows[("graph", "cpu")]["choice"] == "turbo"
    assert (rows[("sampler", "cpu")]["choice"], rows[("kv_cache", "cuda")]["choice"]) == ("rich", "paged")


def test_llm_with_every_kind_on_auto(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """``sampler: auto`` and ``kv_cache: {manager: auto}`` build an engine whose greedy tokens match HF; the
    installed first-party ``full`` (priority 10) outranks ``basic``, and each choice is logged."""
    from corerun import LLM, SamplingParams
    from tests.helpers.engine_testing import hf_greedy
    from tests.helpers.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", arch="qwen2")
    with caplog.at_level(logging.INFO):
        llm = LLM(model=str(model_dir), device="cpu", dtype="float32", sampler="auto",
                  kv_cache={"manager": "auto", "block_size": 4, "num_blocks": 32}, scheduler={"max_model_len": 64})
    runner = llm.engine.runner
    assert (runner.sampler_name, runner.kv_manager_name, runner.graph_name) == ("full", "paged", "replay")  # attention: cpu
    said = [r.message for r in caplog.records]
    assert any(m.startswith("sampler: auto chose 'full' from corerun ") and m.endswith("(corerun -v says why)") for m in said)
    assert any(m.startswith("sampler: auto passed over ") and "basic: lower priority" in m for m in said)
    assert any(m.startswith("graph.runner: auto passed over ") and "cuda: device cpu not in {cuda}" in m for m in said)
    prompts = [[5, 9, 13], [7]]
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(model_dir, prompts, 5)
