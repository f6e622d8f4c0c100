"""The sampler suite's non-finite check: a sampler must return ``NON_FINITE`` for rows whose logits are
NaN, ``+inf`` or all ``-inf``, and sample the rows beside them; one that returns a plain argmax for them
is rejected, naming the rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from corerun.conformance import run
from corerun.scaffold import scaffold
from tests.broken_impls.sampler import PenaltySampler, TopKSampler, TopPSampler, UnmarkedArgmax


def _failed(results: list) -> list:
    return [r for r in results if r.failed]


@pytest.mark.parametrize("impl", [TopPSampler, TopKSampler, PenaltySampler], ids=lambda c: c.name)
def test_reference_samplers_pass(impl: type) -> None:
    results = run("sampler", factory=impl, keyword="non_finite")
    assert not _failed(results), [(r.id, r.reason) for r in results if r.failed]
    assert {r.case for r in results if r.outcome == "passed"} == {"fp32", "bf16", "fp16"}


@pytest.mark.parametrize("name", ["full", "basic"])
def test_built_in_samplers_pass(name: str) -> None:
    results = run("sampler", name, keyword="non_finite")
    assert results and all(r.outcome == "passed" for r in results), [(r.id, r.reason) for r in results]


def test_a_sampler_that_does_not_mark_is_rejected() -> None:
    results = run("sampler", factory=UnmarkedArgmax, keyword="non_finite")
    assert {r.case for r in results if r.failed} == {"fp32", "bf16", "fp16"}, [(r.id, r.outcome) for r in results]
    reason = results[0].reason
    # greedy, random, top-k and top-p rows (what TopPSampler declares), two of each bad pattern:
    # 4 kinds x 4 bad patterns x 2 rows, and no good row named
    assert "32 of 48 rows wrong" in reason, reason
    for pattern in ("all NaN", "one NaN", "one +inf", "all -inf"):
        assert f"(greedy, {pattern} logits): drew " in reason, reason
    assert "normal logits" not in reason and "-inf some" not in reason
    assert "must come back as NON_FINITE (-1, corerun.sdk.sampling.mark_non_finite)" in reason


def test_the_sampler_scaffold_passes_unedited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = scaffold("sampler", "nanny", tmp_path)
    monkeypatch.syspath_prepend(str(root))
    from corerun_sampler_nanny.plugin import CAPABILITIES
    from corerun_sampler_nanny.sampler import Sampler

    results = run("sampler", factory=Sampler, capabilities=CAPABILITIES, name="nanny", keyword="non_finite")
    assert len(results) == 3 and all(r.outcome == "passed" for r in results), [(r.id, r.reason) for r in results]
    for module in [m for m in sys.modules if m.startswith("corerun_sampler_nanny")]:
        monkeypatch.delitem(sys.modules, module)
