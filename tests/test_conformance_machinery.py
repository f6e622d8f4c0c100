"""The suite's own machinery: case sampling, the chi-square bound, the references."""

from __future__ import annotations

import math
from itertools import product

import pytest
import torch

from corerun.plugin.capabilities import AttentionCapabilities, SamplerCapabilities
from corerun.conformance.attention_matrix import attention_configs, unsupported_configs
from corerun.conformance.reference.attention import paged_attention_reference
from corerun.conformance.reference.sampling import sampling_distribution
from corerun.conformance.sampler_cases import applicable
from corerun.testing.stats import chi2_critical, chi2_sf, chi_square_fit
from corerun.sampling_params import SamplingParams


def test_default_matrix_covers_every_declared_value() -> None:
    caps = AttentionCapabilities(dtypes=frozenset({"float16", "bfloat16", "float32"}), max_head_size=256, block_sizes=frozenset({16, 32, 64, 128}))
    configs = attention_configs(caps, full=False)
    assert {c.dtype for c in configs} == {"float16", "bfloat16", "float32"}
    assert {c.head_size for c in configs} == {64, 80, 128, 256}  # <= 64, not a power of two, 128, > 128
    assert {(c.block_size, c.gqa_ratio) for c in configs} == set(product((16, 32), (1, 4)))
    assert len(configs) == 4
    full = attention_configs(caps, full=True)
    assert len(full) == 3 * 8 * 4 * 4 and len({c.id for c in full}) == len(full)
    assert configs[0].id == "bf16-hd128-bs16-gqa4"


def test_unsupported_cases_pick_values_outside_the_declared_sets() -> None:
    caps = AttentionCapabilities(dtypes=frozenset({"float16", "bfloat16"}), head_sizes=frozenset({64, 128}), block_sizes=frozenset({16}), gqa=False)
    cases = {cid: cfg for cid, cfg, _ in unsupported_configs(caps)}
    assert set(cases) == {"dtype-fp32", "hd72", "bs8", "gqa2"}
    assert all(caps.check(cfg.spec("cpu")) for cfg in cases.values())
    assert unsupported_configs(AttentionCapabilities(dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}))) == []


def test_chi_square_bound() -> None:
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)  # the textbook 5% point
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-9)
    assert chi2_critical(10, 0.05) == pytest.approx(18.307, rel=2e-3)  # Wilson-Hilferty
    assert chi2_critical(23, 1e-4) == pytest.approx(57.3, rel=1e-2)  # exact 57.28
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    assert chi_square_fit(torch.tensor([5000.0, 3000.0, 2000.0, 0.0]), probs).p_value == pytest.approx(1.0)
    assert not chi_square_fit(torch.tensor([5400.0, 2800.0, 1800.0, 0.0]), probs).ok


def test_sampling_reference_closed_forms() -> None:
    raw = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64))
    top_p = sampling_distribution(raw, SamplingParams(top_p=0.7))  # 0.5 < 0.7 needs the second token too
    assert torch.allclose(top_p, torch.tensor([2 / 3, 1 / 3, 0, 0], dtype=torch.float64))
    min_p = sampling_distribution(raw, SamplingParams(min_p=0.3))  # threshold 0.15 keeps 0.5 and 0.25
    assert torch.allclose(min_p, torch.tensor([2 / 3, 1 / 3, 0, 0], dtype=torch.float64))
    hot = sampling_distribution(raw, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, torch.sqrt(torch.exp(raw)) / torch.sqrt(torch.exp(raw)).sum())
    pen = sampling_distribution(torch.zeros(3, dtype=torch.float64), SamplingParams(frequency_penalty=1.0), output=[1, 1])
    assert torch.allclose(pen, torch.tensor([1, math.exp(-2), 1], dtype=torch.float64) / (2 + math.exp(-2)))
    assert sampling_distribution(raw, SamplingParams(temperature=0.0)).tolist() == [1.0, 0.0, 0.0, 0.0]


def test_sampler_cases_follow_declarations() -> None:
    basic = {c.name for c in applicable(SamplerCapabilities(params=frozenset({"temperature", "seed"})).params)}
    assert basic == {"default", "temperature0.7", "temperature1.6"}


def test_attention_reference_single_key_is_the_value() -> None:
    """A query that sees one position returns that position's value exactly, whatever the scores."""
    k = torch.randn(3, 4, 2, 8, dtype=torch.float64)
    v = torch.randn(3, 4, 2, 8, dtype=torch.float64)
    q = torch.randn(1, 4, 8, dtype=torch.float64)
    out = paged_attention_reference(q, k, v, [[2, 0]], [0], [1], 0.3)
    assert torch.allclose(out[0], v[2, 0].repeat_interleave(2, dim=0))
