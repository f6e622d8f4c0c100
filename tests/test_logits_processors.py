"""The fifth plugin kind: logits processors.  The hook and who is chosen, the runner-side manager
(per-request state, rows, freeing, refusals), and the conformance suite accepting a correct processor
and rejecting one that leaks state between requests and one that masks the wrong rows."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from corerun import LogitsProcessorCapabilities, SamplerCapabilities, hookimpl
from corerun.conformance import run
from corerun.runner.logits_processing import LogitsProcessors
from corerun.plugin.registry import Registry
from corerun.sampling_params import SamplingParams
from tests.broken_impls.logits_processor import END, LeaksBetweenRequests, MasksWrongRows, TrieChoice

CHOICE = SamplingParams(structured_outputs={"choice": ["3 4 5", "3 6"]})


class Toy:
    @hookimpl
    def corerun_logits_processors(self, register):
        register("trie", TrieChoice, capabilities=TrieChoice.capabilities, priority=5)


def _registry(origin: str) -> Registry:
    reg = Registry()
    reg.register_module(Toy(), plugin="toy", distribution="toy", version="1", origin=origin)
    return reg


def test_hook_corerun_logits_processors() -> None:
    reg = Registry.from_environment(allow=None)
    xgr = reg.get("logits_processor", "xgrammar")
    assert xgr.origin == "first-party" and xgr.distribution == "corerun-structured-output"
    assert xgr.capabilities.params == {"structured_outputs"} and not xgr.capabilities.host_sync
    toy = _registry("third-party").get("logits_processor", "trie")
    assert toy.capabilities is TrieChoice.capabilities and toy.priority == 5


def _manager(origin: str = "built-in", mask: bool = True) -> LogitsProcessors:
    return LogitsProcessors(_registry(origin), 16, torch.device("cpu"), "s", SamplerCapabilities(frozenset(), logits_mask=mask))


def _seq(seq_id: int, params: SamplingParams, out: list[int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(seq_id=seq_id, params=params, output_view=lambda: list(out or []))


def test_manager_masks_only_its_rows_keeps_state_per_sample_and_frees() -> None:
    m = _manager()
    m.prepare(CHOICE)
    plain = SamplingParams()
    seqs = [_seq(1, plain), _seq(2, CHOICE), _seq(3, CHOICE)]  # 2 and 3: two samples of one request
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    raw = logits.clone()
    groups = m.apply(logits, seqs)
    assert torch.equal(logits[0], raw[0])
    for r in (1, 2):
        assert torch.isfinite(logits[r]).nonzero().flatten().tolist() == [3]
    assert m.accept(groups, [9, 3, 3]) == {}
    logits = torch.zeros(3, 16)
    groups = m.apply(logits, seqs)
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [4, 6]
    assert m.accept(groups, [9, 6, 4]) == {}  # the samples go separate ways
    logits = torch.zeros(3, 16)
    groups = m.apply(logits, seqs)
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [END]  # "3 6" complete
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [5]
    assert m.accept(groups, [9, END, 5]) == {1: "stop"}
    m.remove(2)
    m.remove(3)
    assert m.num_requests == 0


def test_manager_is_in_use_while_a_request_that_wants_a_processor_is_at_the_runner() -> None:
    """Set by the requests that reach the runner, cleared when the last one that wants a processor ends:
    a plain request never turns it on, and a preempted one coming back counts once."""
    m = _manager()
    plain = SamplingParams()
    assert not m.in_use
    m.add_requests([_seq(1, plain)])
    assert not m.in_use
    m.add_requests([_seq(2, CHOICE), _seq(3, CHOICE), _seq(4, plain)])
    assert m.in_use
    m.add_requests([_seq(2, CHOICE)])  # resumed after a preemption
    for sid, still in ((1, True), (2, True), (4, True), (3, False)):
        m.remove(sid)
        assert m.in_use is still
    m.add_requests([_seq(5, CHOICE)])
    assert m.in_use


def test_manager_replays_a_request_it_meets_late() -> None:
    m = _manager()
    logits = torch.zeros(1, 16)
    m.apply(logits, [_seq(5, CHOICE, out=[3])])  # re-admitted with one token made
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [4, 6]


def test_manager_refusals_name_what_is_missing() -> None:
    with pytest.raises(ValueError, match="sampler 's' does not declare logits_mask=True"):
        _manager(mask=False).prepare(CHOICE)
    with pytest.raises(ValueError, match="structured_outputs needs a logits processor.*'trie': third-party, not certified"):
        _manager(origin="third-party").prepare(CHOICE)
    with pytest.raises(ValueError, match="trie_choice serves structured_outputs.choice only"):
        _manager().prepare(SamplingParams(structured_outputs={"regex": "a+"}))
    assert _manager().for_params(SamplingParams()) == []


def _failed(results: list) -> dict[str, str]:
    return {r.check: r.reason for r in results if r.failed}


def test_conformance_accepts_a_correct_processor() -> None:
    results = run("logits_processor", factory=TrieChoice)
    assert [r.outcome for r in results] == ["passed"] * 4, [(r.check, r.reason) for r in results]


def test_conformance_rejects_a_processor_that_leaks_state_between_requests() -> None:
    failed = _failed(run("logits_processor", factory=LeaksBetweenRequests))
    assert set(failed) == {"state_per_request", "remove"}, failed
    assert "a second request with the same parameters, after the first advanced" in failed["state_per_request"]


def test_conformance_rejects_a_processor_that_masks_the_wrong_rows() -> None:
    failed = _failed(run("logits_processor", factory=MasksWrongRows))
    assert set(failed) == {"rows_only"}, failed
    assert "changed row 0, which no request of it holds" in failed["rows_only"]


def test_conformance_passes_xgrammar() -> None:
    results = run("logits_processor", "xgrammar")
    assert [r.outcome for r in results] == ["passed"] * 4, [(r.check, r.reason) for r in results]


def test_corerun_new_logits_processor_passes_conformance_unedited(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    from click.testing import CliRunner

    from corerun.cli import cli

    done = CliRunner().invoke(cli, ["new", "logits_processor", "foo", "--dir", str(tmp_path)])
    assert done.exit_code == 0, done.output
    root = tmp_path / "corerun-logits-processor-foo"
    assert "corerun_logits_processors" in (root / "corerun_logits_processor_foo" / "plugin.py").read_text()
    assert "LogitsProcessorSuite" in (root / "tests" / "test_conformance.py").read_text()
    monkeypatch.syspath_prepend(str(root))
    processor = importlib.import_module("corerun_logits_processor_foo.processor").Processor
    results = run("logits_processor", factory=processor)
    assert [r.outcome for r in results] == ["passed"] * 4, [(r.check, r.reason) for r in results]


class Faulty(TrieChoice):
    name = "faulty"

    def apply(self, logits: torch.Tensor, rows, keys) -> None:
        logits[rows] = float("-inf")  # half done, then
        raise RuntimeError("boom")


def test_a_processor_that_raises_ends_only_its_own_requests() -> None:
    class Provides:
        @hookimpl
        def corerun_logits_processors(self, register):
            register("faulty", Faulty, capabilities=Faulty.capabilities)

    reg = Registry()
    reg.register_module(Provides(), plugin="f", distribution="f", version="1", origin="built-in")
    m = LogitsProcessors(reg, 16, torch.device("cpu"), "s", SamplerCapabilities(frozenset(), logits_mask=True))
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    raw = logits.clone()
    step = m.apply(logits, [_seq(1, SamplingParams()), _seq(2, CHOICE), _seq(3, SamplingParams())])
    assert torch.equal(logits[[0, 2]], raw[[0, 2]]) and torch.equal(logits[1], torch.zeros(16))
    assert m.accept(step, [5, 5, 5]) == {1: "logits processor 'faulty' failed masking: RuntimeError: boom"}
    m.remove(2)
    assert m.num_requests == 0


def test_sampler_conformance_checks_the_logits_mask_it_declares() -> None:
    from tests.broken_impls.sampler import ClampsMaskedLogits, MaskedTopPSampler

    (ok,) = run("sampler", factory=MaskedTopPSampler, keyword="masked_logits")
    assert ok.outcome == "passed", ok.reason
    (bad,) = run("sampler", factory=ClampsMaskedLogits, keyword="masked_logits")
    assert bad.outcome == "failed" and "declares logits_mask but drew -inf tokens" in bad.reason, bad.reason
    for name in ("basic", "full"):
        (r,) = run("sampler", name, keyword="masked_logits")
        assert r.outcome == "passed", (name, r.reason)
