"""The full sampler against the float64 reference: greedy choice, the distribution drawn from, masks."""

from __future__ import annotations

import math

import pytest
import torch

from corerun.sampling_params import SamplingParams as SP
from corerun.sampler.full import FullSampler
from corerun.sampler.truncation import apply_truncation

V = 20  # small enough that logprobs=20 returns every token's (processed) logprob

MIXED = [
    SP(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
    SP(temperature=0.8, top_k=5),
    SP(temperature=1.3, top_p=0.6),
    SP(temperature=0.5, min_p=0.2),
    SP(temperature=0.0, logit_bias={3: 5.0, 4: -math.inf}),
    SP(temperature=1.1, top_k=8, top_p=0.7, min_p=0.05, repetition_penalty=0.8, frequency_penalty=-0.5),
    SP(temperature=0.9, presence_penalty=1.5, logit_bias={0: 2.0}, min_tokens=4, max_tokens=8),
    SP(temperature=0.0, min_tokens=3, max_tokens=8),
    SP(temperature=2.0, top_p=0.3, top_k=3),
]
PROMPTS = [[1, 2, 2, 7], [5], [6, 6], [], [3, 9], [11, 12, 13, 11], [0], [2], [4, 4, 4]]
OUTPUTS = [[7, 7, 8], [], [1], [19, 19], [3], [12, 18, 18, 18], [0, 6], [5], []]
EOS = frozenset({2, 15})


def _logits(batch: int, vocab: int = V, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(batch, vocab, dtype=torch.float64) * scale


def _reference(ref, logits: torch.Tensor) -> list[torch.Tensor]:
    return [ref.processed_row(logits[i], p, PROMPTS[i], OUTPUTS[i], EOS) for i, p in enumerate(MIXED)]


def test_greedy_rows_take_argmax_of_processed_logits(ref) -> None:
    sampler = FullSampler(V, "cpu")
    for _ in range(20):
        logits = _logits(len(MIXED))
        tokens = sampler.sample(logits.float(), ref.metadata(MIXED, PROMPTS, OUTPUTS, EOS)).sampled_token_ids
        assert tokens.dtype == torch.int64 and tokens.shape == (len(MIXED),)
        for i, row in enumerate(_reference(ref, logits)):
            if MIXED[i].greedy:
                assert tokens[i].item() == int(row.argmax())


def test_processed_logprobs_are_the_reference_distribution(ref) -> None:
    """``logprobs_mode=processed`` with logprobs=V exposes the whole distribution each row draws from."""
    sampler = FullSampler(V, "cpu", logprobs_mode="processed")
    params = [p.model_copy(update={"logprobs": V}) for p in MIXED]
    for _ in range(10):
        logits = _logits(len(MIXED))
        out = sampler.sample(logits.float(), ref.metadata(params, PROMPTS, OUTPUTS, EOS))
        assert out.logprobs is not None
        got = torch.full((len(params), V), math.nan, dtype=torch.float64)
        got.scatter_(1, out.logprobs.token_ids[:, 1:], out.logprobs.logprobs[:, 1:].double())
        assert not got.isnan().any()
        for i, row in enumerate(_reference(ref, logits)):
            if params[i].greedy:
                want = torch.log_softmax(row, dim=0)
            else:
                want = ref.distribution_row(row, params[i]).log()
            assert torch.equal(got[i].isneginf(), want.isneginf()), f"row {i}: support differs"
            finite = want.isfinite()
            torch.testing.assert_close(got[i][finite], want[finite], rtol=0, atol=2e-5)
            assert want[out.sampled_token_ids[i]].isfinite()


def test_masked_tokens_are_never_drawn(ref) -> None:
    """4096 draws per row: every drawn token lies in the reference support (top-k, top-p, min-p, min_tokens, -inf bias)."""
    sampler = FullSampler(V, "cpu")
    logits = _logits(len(MIXED), scale=1.0)  # flat-ish rows: masked tokens would be likely if not masked
    support = [ref.distribution_row(row, p) > 0 for row, p in zip(_reference(ref, logits), MIXED)]
    reps = 4096 // len(MIXED)
    params = [p for p in MIXED for _ in range(reps)]
    md = ref.metadata(params, [q for q in PROMPTS for _ in range(reps)], [o for o in OUTPUTS for _ in range(reps)], EOS)
    tokens = sampler.sample(logits.float().repeat_interleave(reps, dim=0), md).sampled_token_ids.view(len(MIXED), reps)
    for i, p in enumerate(MIXED):
        if p.greedy:
            continue
        drawn = torch.unique(tokens[i])
        assert support[i][drawn].all(), f"row {i} drew masked tokens {drawn[~support[i][drawn]].tolist()}"
        # and the draws are not degenerate: a row with a wide support draws several tokens
        assert drawn.numel() >= min(int(support[i].sum()), 2)


def test_frequencies_match_the_distribution_chi_square(ref) -> None:
    """One truncated row drawn 40000 times; chi-square against the float64 reference (p-value 1e-4 bound)."""
    params = SP(temperature=0.7, top_k=9, top_p=0.85, min_p=0.02)
    logits = _logits(1, scale=1.0)
    want = ref.distribution_row(logits[0], params)
    n = 40_000
    tokens = FullSampler(V, "cpu").sample(logits.float().expand(n, V), ref.metadata([params] * n)).sampled_token_ids
    counts = torch.bincount(tokens, minlength=V).double()
    support = want > 0
    assert counts[~support].sum() == 0
    expected = want[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    dof = int(support.sum()) - 1
    assert chi2 < _chi2_bound(dof), (chi2, dof)


def _chi2_bound(dof: int) -> float:
    """Upper 1e-4 quantile of chi-square(dof) (Wilson-Hilferty), accurate to a few percent for dof >= 2."""
    z = 3.719  # standard normal upper 1e-4 quantile
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(ref, dtype: torch.dtype) -> None:
    logits = _logits(len(MIXED)).to(dtype)
    out = FullSampler(V, "cpu").sample(logits, ref.metadata(MIXED, PROMPTS, OUTPUTS, EOS))
    for i, row in enumerate(_reference(ref, logits.double())):
        if MIXED[i].greedy:
            assert out.sampled_token_ids[i].item() == int(row.argmax())


def test_logits_are_not_modified(ref) -> None:
    logits = _logits(len(MIXED)).float()
    before = logits.clone()
    FullSampler(V, "cpu").sample(logits, ref.metadata(MIXED, PROMPTS, OUTPUTS, EOS))
    assert torch.equal(logits, before)


@pytest.mark.parametrize("seed", range(4))
def test_truncation_masks_match_reference_on_a_large_vocabulary(ref, seed: int) -> None:
    """apply_truncation on V=4000 with every mix of top-k (topk path), top-p alone (sort path) and min-p."""
    gen = torch.Generator().manual_seed(seed)
    vocab = 4000
    rows = [
        SP(top_k=40), SP(top_p=0.9), SP(min_p=0.1), SP(top_k=300, top_p=0.5), SP(top_p=0.95, min_p=0.01),
        SP(top_k=1), SP(), SP(top_k=17, min_p=0.3, top_p=0.99), SP(top_k=vocab), SP(top_p=0.02),
    ]
    logits = torch.randn(len(rows), vocab, generator=gen, dtype=torch.float64) * 3
    x = logits.float()
    apply_truncation(x, [p.top_k for p in rows], [p.top_p for p in rows], [p.min_p for p in rows])
    for i, p in enumerate(rows):
        want = ref.distribution_row(logits[i].float().double(), p) > 0
        got = x[i].isfinite()
        assert torch.equal(got, want), f"row {i} ({p.top_k=}, {p.top_p=}, {p.min_p=}): {int(got.sum())} vs {int(want.sum())}"
        assert torch.equal(x[i][got], logits[i].float()[got])  # survivors untouched


def test_shape_errors(ref) -> None:
    sampler = FullSampler(V, "cpu")
    with pytest.raises(ValueError, match=r"logits must be a float tensor \[batch_size=2, vocab_size=20\], got torch.float32 \[2, 21\]"):
        sampler.sample(torch.randn(2, V + 1), ref.metadata([SP(), SP()]))
    with pytest.raises(ValueError, match="got torch.int64"):
        sampler.sample(torch.ones(2, V, dtype=torch.int64), ref.metadata([SP(), SP()]))


def test_all_greedy_batch_is_the_float64_argmax_and_a_penalised_greedy_row_is_not_skipped(ref) -> None:
    """An all-greedy batch without logprobs, bias, min_tokens or penalties takes the raw argmax
    (non-finite rows marked); one greedy row with a penalty in the batch still gets its processed argmax."""
    torch.manual_seed(7)
    plain = [SP(temperature=0.0) for _ in range(5)]
    logits = _logits(5)
    logits[3, 4] = math.nan
    out = FullSampler(V).sample(logits.to(torch.bfloat16), ref.metadata(plain, [[]] * 5, [[]] * 5, EOS))
    expected = logits.to(torch.bfloat16).to(torch.float64).argmax(dim=-1)
    expected[3] = -1  # NON_FINITE
    assert out.sampled_token_ids.tolist() == expected.tolist()
    assert out.logprobs is None

    penalised = SP(temperature=0.0, repetition_penalty=4.0)
    logits = _logits(2)
    logits[1] = logits[0]
    top = int(logits[0].argmax())
    logits[1, top] = logits[1].abs().max() + 0.5  # alone on top, and not after the penalty divides it by 4
    history = [[top], [top]]
    out = FullSampler(V).sample(logits, ref.metadata([plain[0], penalised], history, [[], []], EOS))
    assert out.sampled_token_ids[0].item() == top
    processed = ref.processed_row(logits[1], penalised, history[1], [], EOS)
    assert int(processed.argmax()) != int(logits[1].argmax())  # the penalty moves this row's argmax
    assert out.sampled_token_ids[1].item() == int(processed.argmax())
