"""Reliability, round three, the engine half (issue 28): long stop lists, non-ASCII structured output,
non-finite logits.

References: brute-force searches for the stop strings (every index, every prefix); the exact strings
asked for in structured output; the clean greedy run of the same prompt for a row that shares its
batch with a poisoned one.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from corerun import SamplingParams
from corerun.engine.stop_strings import StopMatcher, StopStrings
from corerun.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS
from corerun.testing import assert_idle, make_llm
from tests.helpers.engine_testing import no_hang  # noqa: F401
from tests.helpers.serving import tiny_chat_model


# ------------------------------------------------------------ stop strings: limits
def test_stop_list_is_bounded_and_the_error_names_its_size() -> None:
    SamplingParams(stop=["x"] * MAX_STOP_STRINGS)  # at the limit: accepted
    with pytest.raises(ValueError) as err:
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    msg = str(err.value)
    assert "stop" in msg and f"at most {MAX_STOP_STRINGS} strings, got {MAX_STOP_STRINGS + 1}" in msg


def test_stop_string_length_is_bounded_and_the_error_names_the_string() -> None:
    SamplingParams(stop=["y" * MAX_STOP_STRING_LEN])
    with pytest.raises(ValueError) as err:
        SamplingParams(stop=["a", "b" * (MAX_STOP_STRING_LEN + 5), "c"])
    msg = str(err.value)
    assert f"at most {MAX_STOP_STRING_LEN} characters long, got {MAX_STOP_STRING_LEN + 5} (stop[1])" in msg


# ------------------------------------------------------------ stop strings: incremental matching
def _brute_hit(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """The earliest occurrence ending after ``start`` (the longer string on a tie), by trying every index."""
    hits = [(i, -len(s), s) for s in stops for i in range(len(text)) if text.startswith(s, i) and i + len(s) > start]
    return (min(hits)[0], min(hits)[2]) if hits else None


def _brute_held(text: str, stops: list[str]) -> int:
    return max([k for s in stops for k in range(1, len(s)) if k <= len(text) and text.endswith(s[:k])], default=0)


def test_stop_matcher_streamed_equals_brute_force() -> None:
    """Text grown in random pieces: each scan finds what a full search of the new text finds, and holds
    back exactly the longest tail that is a proper prefix of a stop string."""
    rng = random.Random(28)
    for _ in range(1500):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        if rng.random() < 0.5:  # stop strings that never occur: held tails that grow long, then break
            stops = [s + "c" for s in stops]
        m = StopMatcher(stops)
        text = ""
        while len(text) < 30:
            start = len(text)
            text += "".join(rng.choice("aab") for _ in range(rng.randint(0, 4)))
            hit = m.scan(text)
            assert hit == _brute_hit(text, stops, start), (text, stops, start)
            if hit is not None:
                break
            held = _brute_held(text, stops)
            assert m.held == held, (text, stops)
            assert m.shown(text) == text[: len(text) - held]


def test_stop_strings_many_and_shared_prefixes_against_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(300):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 8))) for _ in range(rng.randint(1, 60))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 20)))
        prepared = StopStrings(stops)
        start = rng.randint(0, len(text))
        assert prepared.find(text, start) == _brute_hit(text, stops, start)
        assert prepared.partial_len(text) == _brute_held(text, stops)


def test_stop_matcher_does_not_rescan_what_it_has_passed() -> None:
    """Only the held tail and the new text are looked at: text behind them is never read again (here a
    stop string planted there afterwards is not seen; a running request's text only grows, so it
    could not be there)."""
    stop = "q" * 500
    m = StopMatcher([stop, "zz"])
    text = "x" * 600
    assert m.scan(text) is None and m.held == 0
    planted = stop + text[500:] + "y"  # the same length plus one, the stop string where nothing was held
    assert m.scan(planted) is None
    m2 = StopMatcher([stop, "zz"])
    assert m2.scan(planted) == (0, stop)  # a fresh look finds it


def test_stop_matcher_holds_a_long_partial_match_and_completes_it_across_steps() -> None:
    stop = "ab" * 300
    m = StopMatcher([stop])
    text = "xx"
    for step in range(299):
        text += "ab"
        assert m.scan(text) is None
        assert m.held == 2 * (step + 1) and m.shown(text) == "xx"
    text += "abyy"
    assert m.scan(text) == (2, stop)


# ------------------------------------------------------------ non-finite logits
POISON_SEED = 4242  # marks the request whose logits the wrapper poisons (a seed changes nothing for greedy rows)
POISONS = {
    "nan_row": lambda row: row.fill_(math.nan),
    "one_nan": lambda row: row.__setitem__(7, math.nan),
    "pos_inf": lambda row: row.__setitem__(3, math.inf),
    "all_banned": lambda row: row.fill_(-math.inf),
}


class PoisoningSampler:
    """Wraps the engine's sampler: from output token ``after`` on, the logits row of the request seeded
    ``POISON_SEED`` is poisoned (as a broken kernel, plugin or fp16 overflow would leave it)."""

    def __init__(self, inner: Any, poison: str, after: int) -> None:
        self.inner, self.poison, self.after = inner, POISONS[poison], after

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def sample(self, logits: torch.Tensor, metadata: Any) -> Any:
        logits = logits.clone()
        for i, (p, out) in enumerate(zip(metadata.params, metadata.output_token_ids)):
            if p.seed == POISON_SEED and len(out) >= self.after:
                self.poison(logits[i])
        return self.inner.sample(logits, metadata)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_chat_model(tmp_path_factory.mktemp("nan"))


PROMPTS = ["the cat sat on the mat", "a dog ran to the log and sat"]


@pytest.mark.parametrize("sampler", ["full", "basic"])
@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_row_with_non_finite_logits_ends_in_error_and_the_others_go_on(tiny_dir: Any, sampler: str, poison: str) -> None:
    logprobs = 2 if sampler == "full" else None
    clean = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=logprobs)
    with make_llm(tiny_dir, sampler=sampler, seed=0) as llm:
        reference = [o.outputs[0] for o in llm.generate(PROMPTS, clean, use_tqdm=False)]
        runner = llm.engine.runner
        runner.sampler = PoisoningSampler(runner.sampler, poison, after=3)
        poisoned = clean.model_copy(update={"seed": POISON_SEED})
        bad, good = (o.outputs[0] for o in llm.generate(PROMPTS, [poisoned, clean], use_tqdm=False))
        assert (good.token_ids, good.text, good.finish_reason) == (
            reference[1].token_ids, reference[1].text, "length")
        assert bad.finish_reason == "error" and "logits of this request were not finite" in (bad.error or "")
        assert bad.token_ids == reference[0].token_ids[:3]  # the tokens before the fault, none after
        if logprobs:
            assert len(bad.logprobs) == 3 and len(good.logprobs) == 8
            values = [lp.logprob for step in bad.logprobs + good.logprobs for lp in step.values()]
            assert all(math.isfinite(v) for v in values)
        assert_idle(llm)


def test_a_sampled_row_with_nan_logits_ends_in_error_beside_a_seeded_one(tiny_dir: Any) -> None:
    """Random rows too: the race's winning p / q is NaN for a poisoned row; a seeded row beside it
    gets the tokens it gets alone."""
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=6, ignore_eos=True)
    with make_llm(tiny_dir, sampler="full", seed=0) as llm:
        alone = llm.generate(PROMPTS[1:], seeded, use_tqdm=False)[0].outputs[0]
        runner = llm.engine.runner
        runner.sampler = PoisoningSampler(runner.sampler, "nan_row", after=0)
        poisoned = SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=6, ignore_eos=True)
        bad, good = (o.outputs[0] for o in llm.generate(PROMPTS, [poisoned, seeded], use_tqdm=False))
        assert bad.finish_reason == "error" and bad.token_ids == []
        assert (good.token_ids, good.finish_reason) == (alone.token_ids, "length")


@pytest.mark.parametrize("sampler", ["full", "basic"])
def test_samplers_mark_exactly_the_non_finite_rows(sampler: str) -> None:
    """Sampler level, against a float64 argmax of the clean rows: NON_FINITE for the poisoned rows only."""
    from corerun.protocols import SamplingMetadata
    from corerun.plugin.registry import get_registry
    from corerun.sdk.sampling import NON_FINITE

    vocab = 50
    s = get_registry().create("sampler", sampler, vocab, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, vocab, generator=g, dtype=torch.float64)
    expect = logits.argmax(dim=-1).tolist()
    poisoned = {1: "nan_row", 2: "one_nan", 4: "pos_inf", 6: "all_banned"}
    x = logits.to(torch.float32)
    for row, kind in poisoned.items():
        POISONS[kind](x[row])
    params = [SamplingParams(temperature=0) if i % 2 == 0 else SamplingParams(temperature=0.7, seed=i) for i in range(8)]
    meta = SamplingMetadata(params=params, prompt_token_ids=[[1]] * 8, output_token_ids=[[]] * 8)
    tokens = s.sample(x, meta).sampled_token_ids.tolist()
    for i, t in enumerate(tokens):
        if i in poisoned:
            assert t == NON_FINITE, (i, poisoned[i], t)
        elif params[i].greedy:
            assert t == expect[i]
        else:
            assert 0 <= t < vocab
