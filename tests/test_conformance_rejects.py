"""The suite rejects deliberately broken implementations, naming the failing check, and accepts the
correct implementations they were derived from.  Runs through the programmatic runner."""

from __future__ import annotations

import pytest

from corerun.conformance import run
from tests.broken_impls.attention import (
    DropsLastBlock, IgnoresCausalMask, IgnoresPrefix, NaiveAttentionBackend, ScaleOffBy0p2Percent, WritesSlotPlusOne,
)
from tests.broken_impls.graph import PaddingRunner, WritesPaddingKV
from tests.broken_impls.kv_cache import HitsWholePrompt, InsertsBeforeTail, LeaksOnFree, OmitsClaimedPrefix, ReportsBlocksFromZero
from tests.broken_impls.sampler import (
    IgnoresTemperatureWithTopK, IgnoresTopP, NeverSamplesLastId, PenaltySampler, StaleHistory, TemperatureOff, TopKSampler,
    TopPSampler,
)

# One float32 configuration of every attention check plus the refusal checks keeps this file fast;
# the broken behaviours do not depend on the dtype.
ATTENTION_KEYWORD = "fp32 or unsupported"
SAMPLER_KEYWORD = "distribution or undeclared or declared or greedy"
HISTORY_KEYWORD = "seq_id_history or greedy or (penalt and not pair)"  # the step-by-step check and every single-penalty case


def _failed(results: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in results:
        if r.failed:
            out.setdefault(r.check, []).append(r)
    return out


def test_correct_attention_backend_passes() -> None:
    results = run("attention", factory=NaiveAttentionBackend, keyword=ATTENTION_KEYWORD)
    assert not _failed(results), [(r.id, r.reason) for r in results if r.failed]
    refused = {r.case for r in results if r.check == "unsupported" and r.outcome == "passed"}
    assert refused == {"dtype-fp64", "hd72", "bs32"}  # what NaiveAttentionBackend leaves undeclared
    assert sum(r.outcome == "passed" for r in results) >= 12


@pytest.mark.parametrize(
    ("impl", "must_fail", "named"),
    [
        (DropsLastBlock, {"decode", "prefill", "mixed", "block_boundaries"}, ("decode", "relative error")),
        (IgnoresCausalMask, {"prefill", "prefill_cached_prefix", "decode", "mixed"}, ("prefill", "relative error")),
        (WritesSlotPlusOne, {"kv_write", "decode", "prefill"}, ("kv_write", "slots no token names were written")),
        (IgnoresPrefix, {"prefill_cached_prefix", "decode", "mixed"}, ("prefill_cached_prefix", "relative error")),
        (ScaleOffBy0p2Percent, {"prefill", "prefill_cached_prefix", "decode", "mixed"}, ("decode", "relative error")),
    ],
    ids=["drops-last-block", "ignores-causal-mask", "writes-slot-plus-one", "ignores-prefix", "scale-off-by-0.2%"],
)
def test_broken_attention_backend_rejected(impl: type, must_fail: set[str], named: tuple[str, str]) -> None:
    results = run("attention", factory=impl, keyword=f"fp32 and ({' or '.join(sorted(must_fail | {'unsupported'}))})")
    failed = _failed(results)
    assert must_fail <= set(failed), f"{impl.name}: expected {sorted(must_fail)} to fail, got {sorted(failed)}"
    check, text = named
    assert any(text in r.reason for r in failed[check]), failed[check][0].reason
    assert all(r.id.startswith(f"attention-{impl.name}-") for r in results)


def test_correct_sampler_passes() -> None:
    results = run("sampler", factory=TopPSampler, keyword=SAMPLER_KEYWORD)
    assert not _failed(results), [(r.id, r.reason) for r in results if r.failed]
    assert {r.case for r in results if r.check == "distribution" and r.outcome == "passed"} >= {"top_p0.8", "temperature0.7", "top_k5"}


def test_sampler_ignoring_top_p_rejected() -> None:
    failed = _failed(run("sampler", factory=IgnoresTopP, keyword=SAMPLER_KEYWORD))
    cases = {r.case: r.reason for r in failed.get("distribution", [])}
    assert "top_p0.8" in cases, sorted(cases)
    assert "tokens the parameters exclude were drawn" in cases["top_p0.8"]
    assert "temperature0.7" not in cases and "top_k5" not in cases  # only what involves top_p fails


def test_sampler_with_wrong_temperature_rejected() -> None:
    failed = _failed(run("sampler", factory=TemperatureOff, keyword=SAMPLER_KEYWORD))
    cases = {r.case: r.reason for r in failed.get("distribution", [])}
    assert {"default", "temperature0.7", "temperature1.6"} <= set(cases), sorted(cases)
    assert "chi-square" in cases["temperature0.7"] and "p = " in cases["temperature0.7"]
    assert "greedy" not in failed  # temperature 0 never divides


def test_temperature_with_top_k_is_checked_as_a_pair() -> None:
    """A sampler declaring only temperature and top-k: no single-parameter case combines them, the pair case does."""
    assert not _failed(run("sampler", factory=TopKSampler, keyword="distribution"))
    results = run("sampler", factory=IgnoresTemperatureWithTopK, keyword="distribution")
    failed = {r.case: r.reason for r in results if r.failed}
    assert set(failed) == {"pair-temperature+top_k"}, sorted(failed)
    assert "chi-square" in failed["pair-temperature+top_k"]
    assert {"default", "temperature0.7", "top_k5"} <= {r.case for r in results if r.outcome == "passed"}


def test_every_pair_of_declared_parameters_is_drawn() -> None:
    from corerun.conformance.sampler_cases import PAIR_VALUES, pair_cases

    declared = frozenset(PAIR_VALUES) | {"seed", "logprobs"}
    names = {c.name for c in pair_cases(declared)}
    n = len(PAIR_VALUES)
    assert len(names) == n * (n - 1) // 2
    assert {"pair-temperature+top_k", "pair-temperature+top_p", "pair-temperature+min_p", "pair-top_k+repetition_penalty"} <= names
    assert {c.name for c in pair_cases(frozenset({"temperature", "top_p"}))} == {"pair-temperature+top_p"}


def test_sampler_that_never_draws_the_last_id_rejected() -> None:
    failed = _failed(run("sampler", factory=NeverSamplesLastId, keyword="distribution"))
    cases = {r.case: r.reason for r in failed.get("distribution", [])}
    assert {"default", "temperature0.7", "top_p0.8"} <= set(cases), sorted(cases)
    assert "chi-square" in cases["default"]


def test_sampler_with_penalties_passes_step_by_step() -> None:
    results = run("sampler", factory=PenaltySampler, keyword=HISTORY_KEYWORD)
    assert not _failed(results), [(r.id, r.reason) for r in results if r.failed]
    assert {r.check for r in results if r.outcome == "passed"} == {"seq_id_history", "greedy", "distribution"}


def test_sampler_with_a_stale_per_request_history_rejected() -> None:
    """Caching each request's history by seq_id and never refreshing it passes every check but the step-by-step one."""
    failed = _failed(run("sampler", factory=StaleHistory, keyword=HISTORY_KEYWORD))
    assert set(failed) == {"seq_id_history"}, sorted(failed)
    reason = failed["seq_id_history"][0].reason
    assert "the argmax of the processed logits of its current history" in reason and "a stale history?" in reason


def test_leaking_kv_cache_manager_rejected() -> None:
    failed = _failed(run("kv_cache", factory=LeaksOnFree))
    assert {"allocation_accounting", "no_leak_random", "exhaustion"} <= set(failed), sorted(failed)
    assert "num_free_blocks after freeing" in failed["allocation_accounting"][0].reason


def test_kv_cache_manager_hitting_the_whole_prompt_rejected() -> None:
    failed = _failed(run("kv_cache", factory=HitsWholePrompt, keyword="prefix"))
    assert set(failed) == {"prefix_never_whole_prompt", "prefix_reference_counting"}, sorted(failed)
    assert "prefix of the whole cached prompt" in failed["prefix_never_whole_prompt"][0].reason


def test_kv_cache_manager_rewriting_a_held_table_rejected() -> None:
    """The growth check sees it, and the stated-changes check (the ids allocate_slots returned no longer
    match the table); every other check reads tables once, or at lengths under 4."""
    failed = _failed(run("kv_cache", factory=InsertsBeforeTail))
    assert set(failed) == {"block_tables_only_grow", "new_block_ids"}, sorted(failed)
    assert "entries handed out must not change while the sequence holds blocks" in failed["block_tables_only_grow"][0].reason
    assert "so it must return [" in failed["new_block_ids"][0].reason  # (the ids returned no longer match the table)


@pytest.mark.parametrize("factory", [ReportsBlocksFromZero, OmitsClaimedPrefix])
def test_kv_cache_manager_returning_wrong_ids_rejected(factory: type) -> None:
    """Protocol version 3: ``allocate_slots`` returning the whole table each time, or leaving out the prefix
    blocks claimed before the first allocation, fails only the returned-ids check, which names the ids due."""
    failed = _failed(run("kv_cache", factory=factory))
    assert set(failed) == {"new_block_ids"}, sorted(failed)
    assert "so it must return [" in failed["new_block_ids"][0].reason


def test_graph_runner_padding_rows_must_not_write_kv() -> None:
    assert not _failed(run("graph", factory=PaddingRunner, keyword="fp32 and not oversize"))
    failed = _failed(run("graph", factory=WritesPaddingKV, keyword="fp32 and not oversize"))
    assert {"decode_matches_eager", "padding_isolation"} <= set(failed), sorted(failed)
    assert "slots no real token names were written" in failed["decode_matches_eager"][0].reason
    assert "prefill_and_mixed" not in failed  # only padded decode batches carry the bug


def test_expected_failures_are_reported_with_reason() -> None:
    reason = "reads one block too few (tracked upstream)"
    results = run("attention", factory=DropsLastBlock, keyword="decode and fp32", expected_failures={"decode[fp32-*]": reason})
    decode = [r for r in results if r.check == "decode"]
    assert decode and all(r.outcome == "xfailed" and r.reason.startswith(reason) for r in decode)
    strict = run("attention", factory=NaiveAttentionBackend, keyword="decode and fp32", expected_failures={"decode": reason})
    assert strict and all(r.outcome == "xpassed" and r.failed for r in strict)


def test_expected_failure_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="no reason"):
        run("attention", factory=DropsLastBlock, keyword="decode and fp32", expected_failures={"decode": " "})
