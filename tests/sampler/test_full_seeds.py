"""Seeded requests: the noise is a function of (seed, output position) only."""

from __future__ import annotations

import pytest
import torch

from corerun.sampling_params import SamplingParams as SP
from corerun.sdk.sampling import row_seed
from corerun.sampler.full import FullSampler

V = 64


def _run(ref, sampler, rows, logits_of, steps: int, position: int) -> list[int]:
    """Draw ``steps`` tokens for the seeded row (``rows[position]``) in a batch of ``rows``; others get fresh logits."""
    tokens: list[int] = []
    for step in range(steps):
        logits = torch.randn(len(rows), V) * 2
        logits[position] = logits_of(step)
        outputs = [[0] * step if i == position else [1] * (i + 3) for i in range(len(rows))]
        out = sampler.sample(logits, ref.metadata(rows, None, outputs))
        tokens.append(out.sampled_token_ids[position].item())
    return tokens


def test_same_seed_same_tokens_alone_and_in_a_batch(ref) -> None:
    seeded = SP(temperature=1.2, top_k=40, top_p=0.95, seed=2024)
    others = [SP(), SP(temperature=0), SP(top_p=0.5, seed=7), SP(min_p=0.1), SP(top_k=3, temperature=0.3)]
    fixed = torch.randn(12, V) * 1.5
    sampler = FullSampler(V, "cpu")
    alone = _run(ref, sampler, [seeded], lambda s: fixed[s], steps=12, position=0)
    torch.manual_seed(99)  # a different global generator state must not matter
    in_batch = _run(ref, sampler, [*others[:3], seeded, *others[3:]], lambda s: fixed[s], steps=12, position=3)
    first = _run(ref, FullSampler(V, "cpu"), [seeded, *others], lambda s: fixed[s], steps=12, position=0)
    assert alone == in_batch == first
    assert len(set(alone)) > 3  # the steps draw different noise


def test_other_seed_or_step_changes_the_draw(ref) -> None:
    logits = torch.zeros(1, V)  # uniform: the token is the noise's argmax
    sampler = FullSampler(V, "cpu")
    draw = lambda seed, step: sampler.sample(logits, ref.metadata([SP(seed=seed)], None, [[5] * step])).sampled_token_ids.item()  # noqa: E731
    assert len({draw(1, step) for step in range(20)}) > 5
    assert len({draw(seed, 0) for seed in range(20)}) > 5
    assert all(draw(3, step) == draw(3, step) for step in range(5))


def test_unseeded_rows_vary(ref) -> None:
    logits = torch.zeros(1, V)
    sampler = FullSampler(V, "cpu")
    assert len({sampler.sample(logits, ref.metadata([SP()])).sampled_token_ids.item() for _ in range(30)}) > 5


def test_row_seed_is_a_function_of_seed_and_step() -> None:
    assert row_seed(5, 0) == row_seed(5, 0)
    values = {row_seed(seed, step) for seed in (-1, 0, 1, 2**63, 2**64 - 2) for step in range(50)}
    assert len(values) == 5 * 50
    assert all(0 <= v < 2**63 for v in values)


def test_basic_and_full_agree_on_temperature_and_seed(ref) -> None:
    """The two samplers draw the same noise for a seed, so temperature-only seeded requests match."""
    basic = pytest.importorskip("corerun_sampler_basic.sampler")
    params = [SP(temperature=0.8, seed=5), SP(temperature=0), SP(temperature=1.3, seed=6), SP(seed=7)]
    full, other = FullSampler(V, "cpu"), basic.BasicSampler(V, "cpu")
    for step in range(8):
        logits = torch.randn(len(params), V)
        md = ref.metadata(params, None, [[1] * step] * len(params))
        assert torch.equal(full.sample(logits, md).sampled_token_ids, other.sample(logits, md).sampled_token_ids)
