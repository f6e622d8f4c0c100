"""Fixtures of the full sampler's tests: an independent float64 statement of vLLM's sampling rules,
one row at a time (``ref.processed_row``, ``ref.distribution_row``), and ``ref.metadata``."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace
from typing import Iterable, Iterator, Sequence

import pytest
import torch

from corerun.protocols import SamplingMetadata
from corerun.sampling_params import SamplingParams

NEG_INF = float("-inf")


def processed_row(
    logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int], output: Sequence[int], eos: Iterable[int]
) -> torch.Tensor:
    """float64 ``[V]``: logit bias, min_tokens, repetition / frequency / presence penalties (before temperature)."""
    x = logits.to(torch.float64).clone()
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    if len(output) < params.min_tokens:
        for token in set(eos) | set(params.stop_token_ids):
            if token < x.numel():
                x[token] = NEG_INF
    r = params.repetition_penalty
    for token in set(prompt) | set(output):
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token, count in Counter(output).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def distribution_row(processed: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float64 ``[V]``: the probabilities a random row draws from (temperature, min-p, top-k, top-p)."""
    z = processed / params.temperature
    probs = torch.softmax(z, dim=0)
    p, zs = probs.tolist(), z.tolist()
    order = sorted(range(len(zs)), key=lambda t: -zs[t])
    if params.min_p > 0:
        floor = params.min_p * max(p)
        order = [t for t in order if p[t] >= floor]
    if 0 < params.top_k < len(zs):
        order = order[: params.top_k]
    if params.top_p < 1.0:
        mass = sum(p[t] for t in order)
        kept, before = [], 0.0
        for t in order:
            if before >= params.top_p * mass and kept:
                break
            kept.append(t)
            before += p[t]
        order = kept
    out = torch.zeros_like(probs)
    out[order] = probs[order]
    return out / out.sum()


def metadata(
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]] | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
    eos: frozenset[int] = frozenset(),
) -> SamplingMetadata:
    """A step's metadata; histories default to empty."""
    n = len(params)
    return SamplingMetadata(
        params=list(params),
        prompt_token_ids=list(prompts) if prompts is not None else [[] for _ in range(n)],
        output_token_ids=list(outputs) if outputs is not None else [[] for _ in range(n)],
        eos_token_ids=eos,
    )


@pytest.fixture
def ref() -> SimpleNamespace:
    return SimpleNamespace(processed_row=processed_row, distribution_row=distribution_row, metadata=metadata)


@pytest.fixture(autouse=True)
def _seeded_default_generator() -> Iterator[None]:
    """A fixed default generator for every test (one torch thread comes from the root conftest)."""
    torch.manual_seed(1234)
    yield


@pytest.fixture
def forbid_host_sync(monkeypatch: pytest.MonkeyPatch):
    """A CPU stand-in for CUDA's sync check: after ``forbid_host_sync()``, every host read of a tensor
    value (``.item()``, ``.tolist()``, ``bool(t)``, ...) raises, until ``monkeypatch.undo()``."""

    def refuse(name: str):
        def method(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} called while sampling: a host sync on a device")

        return method

    def install() -> None:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
            monkeypatch.setattr(torch.Tensor, name, refuse(name))

    return install

