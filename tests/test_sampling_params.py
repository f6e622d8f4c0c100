"""SamplingParams validation: every rule, with an error message that names the field and the value."""

from __future__ import annotations

import math

import pytest

from corerun.sampling_params import MAX_LOGPROBS, SAMPLING_EPS, SamplingParams

NAN, INF = math.nan, math.inf

# (field, bad value, text the message must contain besides the field name)
BAD = [
    ("temperature", -0.5, "got -0.5"),
    ("temperature", -1e-9, "got -1e-09"),
    ("temperature", NAN, "got nan"),
    ("temperature", INF, "got inf"),
    ("temperature", -INF, "got -inf"),
    ("top_p", 0.0, "got 0.0"),
    ("top_p", -0.1, "got -0.1"),
    ("top_p", 1.0001, "got 1.0001"),
    ("top_p", NAN, "got nan"),
    ("top_p", INF, "got inf"),
    ("top_k", -2, "got -2"),
    ("top_k", -100, "got -100"),
    ("min_p", -0.01, "got -0.01"),
    ("min_p", 1.5, "got 1.5"),
    ("min_p", NAN, "got nan"),
    ("presence_penalty", -2.01, "got -2.01"),
    ("presence_penalty", 2.5, "got 2.5"),
    ("presence_penalty", NAN, "got nan"),
    ("frequency_penalty", -3.0, "got -3.0"),
    ("frequency_penalty", 2.0001, "got 2.0001"),
    ("frequency_penalty", INF, "got inf"),
    ("repetition_penalty", 0.0, "got 0.0"),
    ("repetition_penalty", -1.0, "got -1.0"),
    ("repetition_penalty", NAN, "got nan"),
    ("repetition_penalty", INF, "got inf"),
    ("max_tokens", 0, "got 0"),
    ("max_tokens", -5, "got -5"),
    ("min_tokens", -1, "got -1"),
    ("logprobs", -1, "got -1"),
    ("logprobs", MAX_LOGPROBS + 1, f"got {MAX_LOGPROBS + 1}"),
    ("prompt_logprobs", -3, "got -3"),
    ("prompt_logprobs", MAX_LOGPROBS + 5, f"got {MAX_LOGPROBS + 5}"),
    ("stop_token_ids", [5, -1], "got [-1]"),
    ("logit_bias", {-4: 1.0}, "got -4"),
    ("logit_bias", {7: NAN}, "got nan for token 7"),
    ("logit_bias", {7: INF}, "got inf for token 7"),
    ("top_k", True, "got True"),
    ("temperature", False, "got False"),
    ("seed", True, "got True"),
    ("seed", 2**64, f"got {2**64}"),
    ("seed", -(2**63) - 1, f"got {-(2**63) - 1}"),
]


@pytest.mark.parametrize(("field", "value", "text"), BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_value_names_field_and_value(field: str, value: object, text: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert f"\n{field}\n" in message  # pydantic's location line
    assert f"{field} " in message.split("Value error, ", 1)[1]  # our own sentence names it too
    assert text in message


GOOD = [
    ("temperature", 0.0),
    ("temperature", 1e-7),
    ("temperature", 100.0),
    ("top_p", 1e-6),
    ("top_p", 1.0),
    ("top_k", 0),
    ("top_k", 1),
    ("top_k", 50_000),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("presence_penalty", -2.0),
    ("presence_penalty", 2.0),
    ("frequency_penalty", -2.0),
    ("frequency_penalty", 2.0),
    ("repetition_penalty", 1e-3),
    ("repetition_penalty", 10.0),
    ("max_tokens", 1),
    ("min_tokens", 0),
    ("logprobs", 0),
    ("logprobs", MAX_LOGPROBS),
    ("prompt_logprobs", 0),
    ("seed", -(2**63)),
    ("seed", 2**64 - 1),
    ("logit_bias", {0: -100.0, 3: 100.0, 9: -INF}),
]


@pytest.mark.parametrize(("field", "value"), GOOD, ids=[f"{f}={v!r}" for f, v in GOOD])
def test_boundary_values_are_accepted(field: str, value: object) -> None:
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_top_k_minus_one_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert "top_k" not in SamplingParams(top_k=-1).non_default_fields()


def test_min_tokens_above_max_tokens() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(min_tokens=9, max_tokens=4)
    assert "min_tokens (9) must be <= max_tokens (4)" in str(info.value)
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4


def test_unknown_field_is_named() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(top_q=0.5)
    assert "top_q" in str(info.value)


def test_frozen() -> None:
    with pytest.raises(ValueError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


def test_greedy_below_sampling_eps() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=SAMPLING_EPS / 2).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy
    assert not SamplingParams().greedy


def test_empty_logit_bias_is_no_bias() -> None:
    params = SamplingParams(logit_bias={})
    assert params.logit_bias is None
    assert params.non_default_fields() == set()


def test_non_default_fields() -> None:
    params = SamplingParams(temperature=0.5, top_p=0.9, seed=3, max_tokens=4, logprobs=0)
    assert params.non_default_fields() == {"temperature", "top_p", "seed", "max_tokens", "logprobs"}


def test_check_vocab() -> None:
    SamplingParams(logit_bias={31: 1.0}, stop_token_ids=[31]).check_vocab(32)
    with pytest.raises(ValueError, match=r"logit_bias has token ids outside the vocabulary \[0, 32\): \[32\]"):
        SamplingParams(logit_bias={32: 1.0}).check_vocab(32)
    with pytest.raises(ValueError, match=r"stop_token_ids has token ids outside the vocabulary \[0, 32\): \[40\]"):
        SamplingParams(stop_token_ids=[1, 40]).check_vocab(32)
    SamplingParams(logit_bias={0: -INF, 1: -INF}).check_vocab(3)
    with pytest.raises(ValueError, match="logit_bias bans all 3 tokens"):
        SamplingParams(logit_bias={0: -INF, 1: -INF, 2: -INF}).check_vocab(3)
