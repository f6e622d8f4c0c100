"""Reliability, round three, the engine half (issue 28): long stop lists, non-ASCII structured output,
non-finite logits.

References: brute-force searches for the stop strings (every index, every prefix); the exact strings
asked for in structured output; the clean greedy run of the same prompt for a row that shares its
batch with a poisoned one.
"""

from __future__ import annotations

import random

import pytest

from corerun import SamplingParams
from corerun.engine.stop_strings import StopMatcher, StopStrings
from corerun.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS


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
