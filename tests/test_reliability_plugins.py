"""A plugin that raises in the middle of a step costs the requests of that step, nothing else.

The faulty plugins (``tests/helpers/faulty_plugins.py``) wrap real implementations and raise on one
chosen call; they are registered in-process into a fresh registry and selected by name through the
config, like any installed plugin.  For each one: the requests the failing call was working on end
with ``finish_reason == "error"`` and an error naming the plugin, having kept the tokens generated
before the fault (a prefix of the clean continuation); their blocks are freed; the requests outside
that step finish normally; and the engine then serves the same prompts again exactly like Hugging
Face transformers' greedy decoding (so no cached prefix block was corrupted by the half-done step).

A plugin that fails to load never keeps the others from loading.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import pytest
import torch

import corerun.plugin.registry as registry_module
from corerun import LLM, SamplingParams
from corerun.outputs import RequestOutput
from corerun.plugin.registry import Registry
from corerun.testing import assert_idle, make_llm
from tests.helpers import faulty_plugins
from tests.helpers.tiny_models import make_tiny_model
from tests.helpers.engine_testing import hf_greedy, no_hang  # noqa: F401 (no_hang: a fixture)

MAX_TOKENS = 8
NUM_LAYERS = 2  # tiny_models' default: one attention forward per layer per step
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# two requests at a time, so that a fault in one step spares the two requests queued behind it
TWO_AT_A_TIME = {"max_num_seqs": 2}
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """The model folder, four prompts of one to four blocks, and their reference continuations."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("reliability-plugins"), arch="llama")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (9, 11, 6, 13)]
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Registry:
    """The installed plugins plus the faulty ones, as the process-wide registry ``LLM`` uses."""
    reg = Registry.from_environment()
    reg.register_module(faulty_plugins, plugin="faulty", distribution=faulty_plugins.DISTRIBUTION, version="0")
    assert not [e for e in reg.load_errors if e.plugin == "faulty"]
    monkeypatch.setattr(registry_module, "_default", reg)
    return reg


def assert_recovered(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> None:
    assert_idle(llm)
    again = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert all(o.outputs[0].finish_reason == "length" and o.outputs[0].error is None for o in again)
    assert_idle(llm)


def check_fault(outs: list[RequestOutput], expected: list[list[int]], failed: set[int], num_tokens: int, names: list[str]) -> None:
    """Requests ``failed`` ended with an error naming the plugin after ``num_tokens`` correct tokens; the rest are whole."""
    for i, (out, exp) in enumerate(zip(outs, expected)):
        c = out.outputs[0]
        assert out.finished
        if i in failed:
            assert c.finish_reason == "error", (i, c)
            for name in names:
                assert name in c.error, (name, c.error)
            assert c.token_ids == exp[:num_tokens]
        else:
            assert c.finish_reason == "length" and c.error is None, (i, c)
            assert c.token_ids == exp


def test_clean_run_matches_transformers(registry: Registry, tiny) -> None:
    model_dir, prompts, expected = tiny
    llm = make_llm(model_dir, scheduler=TWO_AT_A_TIME)
    assert_recovered(llm, prompts, expected)


@pytest.mark.parametrize(("error", "raised"), [("runtime", "InjectedFault"), ("oom", "OutOfMemoryError")])
def test_attention_backend_raising_mid_step(registry: Registry, tiny, error: str, raised: str) -> None:
    """Forward call 8 is the second layer of step 4: the first layer already wrote that step's K/V."""
    model_dir, prompts, expected = tiny
    step = 4
    fail_at = NUM_LAYERS * (step - 1) + 2
    llm = make_llm(model_dir, scheduler=TWO_AT_A_TIME, attention={"name": "faulty_attention", "options": {"fail_at": fail_at, "error": error}})
    outs = llm.generate(prompts, GREEDY)
    check_fault(outs, expected, failed={0, 1}, num_tokens=step - 1, names=[
        "attention backend 'faulty_attention'", f"{raised}: injected fault in attention forward, call {fail_at}",
    ])
    assert llm.engine.runner.attention.trigger.faults == 1
    assert llm.engine.kv.stats().num_cached_blocks > 0  # the prefix blocks of the failed requests stay cached...
    assert_recovered(llm, prompts, expected)  # ...and still hold the right K/V
    assert llm.engine.kv.stats().prefix_hits > 0


@pytest.mark.parametrize(
    ("method", "failed", "num_tokens", "names"),
    [
        # calls: step 1 admits A (1) and B (2), step 2 grows A (3) and B (4), step 3 grows A (5): only A fails
        ("allocate_slots", {0}, 2, ["KV-cache manager 'faulty_kv' failed while scheduling"]),
        # one call per admission: B's (2) fails before it ran at all
        ("get_computed_prefix", {1}, 0, ["KV-cache manager 'faulty_kv' failed while scheduling"]),
        # registering A's blocks after step 3: A fails, B keeps the token of that step
        ("cache_blocks", {0}, 2, ["KV-cache manager 'faulty_kv' failed caching the blocks of request"]),
    ],
)
def test_kv_cache_manager_raising(registry: Registry, tiny, method: str, failed: set[int], num_tokens: int, names: list[str]) -> None:
    model_dir, prompts, expected = tiny
    fail_at = {"get_computed_prefix": 2}.get(method, 5)
    manager = {"name": "faulty_kv", "options": {"fail_at": fail_at, "method": method}}
    llm = make_llm(model_dir, scheduler=TWO_AT_A_TIME, kv_cache={"manager": manager})
    outs = llm.generate(prompts, GREEDY)
    check_fault(outs, expected, failed=failed, num_tokens=num_tokens,
                names=[*names, f"InjectedFault: injected fault in KV-cache {method}, call {fail_at}"])
    assert llm.engine.kv.trigger.faults == 1 and len(llm.engine.kv.failed_seq_ids) == 1
    assert_recovered(llm, prompts, expected)


def test_kv_cache_manager_raising_on_admission(registry: Registry, tiny) -> None:
    """Call 2 admits B, after get_computed_prefix claimed its cached blocks: those are given back."""
    model_dir, prompts, expected = tiny
    llm = make_llm(model_dir, scheduler=TWO_AT_A_TIME, kv_cache={"manager": {"name": "faulty_kv", "options": {"fail_at": 0}}})
    llm.generate(prompts[1:2], GREEDY)  # B's prefix is cached: its admission claims blocks first
    trigger = llm.engine.kv.trigger
    trigger.fail_at, trigger.calls = 2, 0
    outs = llm.generate(prompts, GREEDY)
    check_fault(outs, expected, failed={1}, num_tokens=0, names=["KV-cache manager 'faulty_kv'", "call 2"])
    assert_recovered(llm, prompts, expected)


def test_kv_cache_manager_refusing_every_allocation_ends_requests_instead_of_spinning(registry: Registry, tiny) -> None:
    """With the whole cache free, a refused allocation can never succeed later: the request ends with an error."""
    model_dir, prompts, _ = tiny
    manager = {"name": "faulty_kv", "options": {"fail_at": 1, "times": 10**6, "error": "refuse"}}
    llm = make_llm(model_dir, scheduler=TWO_AT_A_TIME, kv_cache={"manager": manager})
    outs = llm.generate(prompts, GREEDY)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "error" and c.token_ids == []
        assert "cannot be scheduled although no other request holds blocks" in c.error
        assert "KV-cache manager 'faulty_kv' refused its slots (64 of 64 blocks of 4 free)" in c.error
    assert llm.engine.num_steps == 0
    assert llm.engine.kv.num_free_blocks == 64 and not llm.engine.requests


def test_sampler_raising(registry: Registry, tiny) -> None:
    model_dir, prompts, expected = tiny
    llm = make_llm(model_dir, scheduler=TWO_AT_A_TIME, sampler={"name": "faulty_sampler", "options": {"fail_at": 3}})
    outs = llm.generate(prompts, GREEDY)
    check_fault(outs, expected, failed={0, 1}, num_tokens=2, names=[
        "sampler 'faulty_sampler' failed", "InjectedFault: injected fault in sampler sample, call 3",
    ])
    assert_recovered(llm, prompts, expected)


def test_sampler_returning_a_token_outside_the_vocabulary(registry: Registry, tiny) -> None:
    model_dir, prompts, expected = tiny
    llm = make_llm(model_dir, scheduler=TWO_AT_A_TIME, sampler={"name": "lying_sampler", "options": {"fail_at": 2}})
    outs = llm.generate(prompts, GREEDY)
    check_fault(outs, expected, failed={0, 1}, num_tokens=1, names=[
        "sampler 'lying_sampler' returned token ids outside the vocabulary: [256, 256]", "in [0, 256)",
    ])
    assert_recovered(llm, prompts, expected)


def test_plugin_failing_every_step_ends_every_request_without_hanging(registry: Registry, tiny) -> None:
    model_dir, prompts, _ = tiny
    llm = make_llm(model_dir, scheduler=TWO_AT_A_TIME, attention={"name": "faulty_attention", "options": {"fail_at": 1, "times": 10**6}})
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].finish_reason for o in outs] == ["error"] * 4
    assert all(o.outputs[0].token_ids == [] and "faulty_attention" in o.outputs[0].error for o in outs)
    assert llm.engine.num_steps == 2  # one failed step per pair of requests
    assert_idle(llm)


def test_stream_reports_the_error_and_frees(registry: Registry, tiny) -> None:
    model_dir, prompts, expected = tiny
    llm = make_llm(model_dir, scheduler=TWO_AT_A_TIME, sampler={"name": "faulty_sampler", "options": {"fail_at": 4}})
    last = {}
    for out in llm.stream(prompts[:1], GREEDY):
        last[out.request_id] = out
    (out,) = last.values()
    assert out.finished and out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == expected[0][:3]
    assert_recovered(llm, prompts, expected)


# -------------------------------------------------------------------------- loading

def test_a_hook_that_raises_leaves_the_other_plugins_listed() -> None:
    reg = Registry.from_environment()
    before = {kind: reg.names(kind) for kind in registry_module.KINDS}
    reg.register_module(faulty_plugins.RaisingHook(), plugin="raising", distribution="corerun-raising", version="1")
    reg.register_module(faulty_plugins, plugin="faulty", distribution=faulty_plugins.DISTRIBUTION, version="0")
    (error,) = [e for e in reg.load_errors if e.plugin == "raising"]
    assert "hook corerun_samplers raised InjectedFault: injected fault while registering samplers" in error.error
    assert error.distribution == "corerun-raising"
    for kind, names in before.items():
        assert set(names) <= set(reg.names(kind))
    assert {"faulty_sampler", "lying_sampler"} <= set(reg.names("sampler"))
    assert "faulty_attention" in reg.names("attention") and "faulty_kv" in reg.names("kv_cache")


def test_an_entry_point_that_fails_to_import_leaves_the_others_loading(monkeypatch: pytest.MonkeyPatch, tiny) -> None:
    real = list(md.entry_points(group=registry_module.ENTRY_POINT_GROUP))
    fake = [
        md.EntryPoint("broken", faulty_plugins.broken_entry_point, registry_module.ENTRY_POINT_GROUP),
        md.EntryPoint("faulty", "tests.helpers.faulty_plugins", registry_module.ENTRY_POINT_GROUP),
    ]
    monkeypatch.delenv(registry_module.ENV_ALLOW_LIST, raising=False)
    with monkeypatch.context() as patch:
        patch.setattr(md, "entry_points", lambda group: [*fake, *real])
        reg = Registry.from_environment()
    (error,) = [e for e in reg.load_errors if e.plugin == "broken"]
    assert f"import of {faulty_plugins.broken_entry_point} failed: ModuleNotFoundError" in error.error
    assert {"faulty_attention", "torch"} <= set(reg.names("attention"))
    assert {"faulty_sampler", "full"} <= set(reg.names("sampler"))
    for ep in real:  # every installed plugin still loaded
        assert ep.name in reg.plugins
    # the engine builds and serves from that registry
    monkeypatch.setattr(registry_module, "_default", reg)
    model_dir, prompts, expected = tiny
    llm = make_llm(model_dir, scheduler=TWO_AT_A_TIME)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts[:2], GREEDY)] == expected[:2]
