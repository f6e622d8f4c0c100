"""The sampling situations the sampler suite draws from, and the fixed logits they use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from corerun.plugin.capabilities import ENGINE_PARAMS

VOCAB = 24  # distribution checks: small enough for tight chi-square bins
NUM_DRAWS = 20000  # rows of one big batch per distribution check
PROMPT = (0, 1, 2, 3, 3, 4, 9, 14)
OUTPUT = (3, 5, 5, 8, 1, 5)

# A value away from the no-op default for each sampling field (what `check` must accept or refuse).
PROBE_VALUES: dict[str, Any] = {
    "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "repetition_penalty": 1.2, "seed": 7, "min_tokens": 2, "logprobs": 3,
    "prompt_logprobs": 2, "logit_bias": {1: 1.0},
}


@dataclass(frozen=True)
class DistCase:
    """One distribution check: parameters plus the request's history."""

    name: str
    params: dict[str, Any]
    prompt: tuple[int, ...] = ()
    output: tuple[int, ...] = ()
    eos: frozenset[int] = field(default_factory=frozenset)
    draws: int = NUM_DRAWS

    def sampling_params(self) -> Any:
        from corerun.sampling_params import SamplingParams

        return SamplingParams(**self.params)

    def required(self) -> set[str]:
        """The sampler-level fields this case needs declared."""
        return set(self.sampling_params().non_default_fields()) - set(ENGINE_PARAMS)


DIST_CASES: list[DistCase] = [
    DistCase("default", {}),
    DistCase("temperature0.7", {"temperature": 0.7}),
    DistCase("temperature1.6", {"temperature": 1.6}),
    DistCase("top_k5", {"top_k": 5}),
    DistCase("top_p0.8", {"top_p": 0.8}),
    DistCase("min_p0.1", {"min_p": 0.1}),
    DistCase("top_k8-top_p0.75-t0.8", {"top_k": 8, "top_p": 0.75, "temperature": 0.8}),
    DistCase("min_p0.05-top_p0.9-t1.3", {"min_p": 0.05, "top_p": 0.9, "temperature": 1.3}),
    DistCase("top_k10-min_p0.03-top_p0.85", {"top_k": 10, "min_p": 0.03, "top_p": 0.85}),
    DistCase("repetition_penalty1.4", {"repetition_penalty": 1.4}, PROMPT, OUTPUT),
    DistCase("repetition_penalty0.7", {"repetition_penalty": 0.7}, PROMPT, OUTPUT),
    DistCase("frequency_penalty0.6", {"frequency_penalty": 0.6}, PROMPT, OUTPUT),
    DistCase("presence_penalty-0.8", {"presence_penalty": -0.8}, PROMPT, OUTPUT),
    DistCase(
        "penalties", {"repetition_penalty": 1.2, "frequency_penalty": 0.4, "presence_penalty": 0.5}, PROMPT, OUTPUT,
    ),
    DistCase("logit_bias", {"logit_bias": {2: 2.0, 5: -1.5, 11: 3.0, 17: -30.0}}),
    DistCase("min_tokens", {"min_tokens": 4, "stop_token_ids": (7,)}, PROMPT, (3, 5), frozenset({3})),
    DistCase("min_tokens-reached", {"min_tokens": 2, "stop_token_ids": (7,)}, PROMPT, (3, 5), frozenset({3})),
    DistCase(
        "all",
        {
            "logit_bias": {2: 1.0, 11: -2.0}, "min_tokens": 8, "stop_token_ids": (7,), "repetition_penalty": 1.2,
            "frequency_penalty": 0.3, "presence_penalty": 0.4, "temperature": 0.9, "min_p": 0.02, "top_k": 12,
            "top_p": 0.9,
        },
        PROMPT, OUTPUT, frozenset({3}),
    ),
]

# One value per distribution-shaping parameter for the pair cases: each far from its no-op value, so
# a sampler that drops one parameter of a pair moves the distribution well past the chi-square bound.
PAIR_VALUES: dict[str, dict[str, Any]] = {
    "temperature": {"temperature": 0.45},
    "top_k": {"top_k": 6},
    "top_p": {"top_p": 0.8},
    "min_p": {"min_p": 0.08},
    "repetition_penalty": {"repetition_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": 0.7},
    "presence_penalty": {"presence_penalty": 0.9},
    "logit_bias": {"logit_bias": {2: 2.5, 5: -1.5, 11: 1.5}},
    "min_tokens": {"min_tokens": 8, "stop_token_ids": (7,)},
}


def pair_cases(declared: frozenset[str]) -> list[DistCase]:
    """Every pair of declared distribution-shaping parameters, on the prompt/output history (EOS 3),
    so a sampler wrong on any combination (temperature ignored when top-k is set, ...) fails."""
    names = [n for n in PAIR_VALUES if n in declared]
    cases = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            params = {**PAIR_VALUES[a], **PAIR_VALUES[b]}
            cases.append(DistCase(f"pair-{a}+{b}", params, PROMPT, OUTPUT, frozenset({3}), draws=NUM_DRAWS // 2))
    return cases


def seeded_cases(declared: frozenset[str]) -> list[DistCase]:
    """Seeded rows alone (at temperature 0.7 when declared) and with each declared distribution-shaping parameter."""
    base = DistCase("temperature0.7", {"temperature": 0.7}, draws=NUM_DRAWS // 2)
    cases = [base if "temperature" in declared else DistCase("default", {}, draws=NUM_DRAWS // 2)]
    for name in PAIR_VALUES:
        if name in declared and name != "temperature":  # the base case covers seed with temperature
            cases.append(DistCase(name, dict(PAIR_VALUES[name]), PROMPT, OUTPUT, frozenset({3}), draws=NUM_DRAWS // 4))
    return cases


# Preferred groups of a mixed batch (the first three a sampler declares).
MIXED_PREFERENCE = ("default", "top_p0.8", "temperature0.7", "top_k5", "penalties", "logit_bias", "min_p0.1")


def applicable(declared: frozenset[str]) -> list[DistCase]:
    return [c for c in DIST_CASES if c.required() <= set(declared)]


def base_logits(vocab: int = VOCAB) -> torch.Tensor:
    """Fixed float32 logits ``[vocab]`` (distinct values, several orders of probability)."""
    gen = torch.Generator().manual_seed(1234)
    return (torch.randn(vocab, generator=gen, dtype=torch.float64) * 1.6).to(torch.float32)


# Rows of the non-finite check: what each row's logits hold, and whether the row must come back as
# corerun.sdk.sampling.NON_FINITE.  "-inf some" is a logits processor's mask: a normal row.
NON_FINITE_PATTERNS: tuple[tuple[str, bool], ...] = (
    ("normal", False), ("all NaN", True), ("one +inf", True), ("all -inf", True), ("-inf some", False),
    ("one NaN", True),
)


def row_kinds(declared: frozenset[str]) -> list[tuple[str, dict[str, Any]]]:
    """The kinds of row a sampler declaring ``declared`` takes: random at the defaults, and greedy,
    seeded, top-k and top-p rows where declared (samplers often take a separate path for each)."""
    kinds: list[tuple[str, dict[str, Any]]] = [("random", {})]
    optional = [("temperature", "greedy", {"temperature": 0.0}), ("seed", "seeded", {"seed": 3}),
                ("top_k", "top_k", {"top_k": 4}), ("top_p", "top_p", {"top_p": 0.7})]
    kinds += [(label, params) for need, label, params in optional if need in declared]
    return kinds


def non_finite_logits(pattern: str, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """One float32 row ``[vocab]`` of ``pattern`` (see :data:`NON_FINITE_PATTERNS`)."""
    row = torch.randn(vocab, generator=gen) * 2.0
    spot = int(torch.randint(vocab, (1,), generator=gen))
    if pattern == "all NaN":
        row.fill_(float("nan"))
    elif pattern == "one +inf":
        row[spot] = float("inf")
    elif pattern == "all -inf":
        row.fill_(float("-inf"))
    elif pattern == "-inf some":
        row[torch.randperm(vocab, generator=gen)[: vocab // 2]] = float("-inf")
    elif pattern == "one NaN":
        row[spot] = float("nan")
    return row
