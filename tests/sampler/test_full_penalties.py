"""Penalties, min_tokens and logit bias against closed-form values on known histories."""

from __future__ import annotations

import math

import torch

from corerun.protocols import SamplingMetadata
from corerun.sampling_params import SamplingParams as SP
from corerun.sampler.penalties import apply_penalties
from corerun.sampler.processors import apply_logit_bias, apply_min_tokens
from corerun.sampler.full import FullSampler


def test_penalties_closed_form() -> None:
    """Hand-worked values: row 0 has every penalty, row 1 only presence, row 2 none (left bit-identical)."""
    logits = torch.tensor(
        [
            [2.0, -1.0, 3.0, -0.5, 0.25, 1.5],
            [1.0, 1.0, -2.0, 0.5, 0.0, 4.0],
            [0.3, -0.3, 0.7, 1.1, -2.2, 0.9],
        ]
    )
    before = logits.clone()
    prompts = [[0, 1, 1], [5], [2, 3]]
    outputs = [[2, 3, 3, 3, 0], [2, 2], [4, 4, 4]]
    apply_penalties(logits, prompts, outputs, [2.0, 1.0, 1.0], [0.5, 0.0, 0.0], [0.25, 1.5, 0.0])
    # row 0, r=2, f=0.5, a=0.25; history {0,1,2,3}; output counts {2:1, 3:3, 0:1}
    want0 = [
        2.0 / 2 - 0.5 * 1 - 0.25,  # in prompt and output, positive
        -1.0 * 2,  # prompt only, negative: multiplied
        3.0 / 2 - 0.5 * 1 - 0.25,
        -0.5 * 2 - 0.5 * 3 - 0.25,  # output x3, negative
        0.25,  # never seen
        1.5,
    ]
    want1 = [1.0, 1.0, -2.0 - 1.5, 0.5, 0.0, 4.0]  # presence once for token 2, prompt ignored (r=1)
    torch.testing.assert_close(logits[0], torch.tensor(want0), rtol=0, atol=1e-6)
    torch.testing.assert_close(logits[1], torch.tensor(want1), rtol=0, atol=1e-6)
    assert torch.equal(logits[2], before[2])


def test_penalties_random_histories_match_float64_reference() -> None:
    gen = torch.Generator().manual_seed(7)
    batch, vocab = 6, 50
    logits = torch.randn(batch, vocab, generator=gen, dtype=torch.float64) * 3
    prompts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in torch.randint(0, 40, (batch,), generator=gen)]
    outputs = [torch.randint(0, 12, (int(n),), generator=gen).tolist() for n in torch.randint(0, 60, (batch,), generator=gen)]
    rep = [1.0, 1.7, 0.6, 1.2, 2.0, 1.0]
    freq = [0.0, 0.3, -1.1, 2.0, 0.0, -2.0]
    pres = [0.0, -0.4, 0.8, 0.0, 1.9, 2.0]
    want = logits.clone()
    for i in range(batch):  # the rules, written out per token
        for t in range(vocab):
            if t in prompts[i] or t in outputs[i]:
                want[i, t] = want[i, t] / rep[i] if want[i, t] > 0 else want[i, t] * rep[i]
            c = outputs[i].count(t)
            want[i, t] -= freq[i] * c + pres[i] * (c > 0)
    got = logits.float()
    apply_penalties(got, prompts, outputs, rep, freq, pres)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)


def test_penalties_through_the_greedy_choice() -> None:
    """Token 0 leads by 1.0; three earlier outputs of it with frequency 0.5 drop it below token 1."""
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]] * 3)
    params = [SP(temperature=0), SP(temperature=0, frequency_penalty=0.5), SP(temperature=0, repetition_penalty=1.3)]
    md_outputs = [[0, 0, 0], [0, 0, 0], [0]]
    out = FullSampler(4, "cpu").sample(logits, SamplingMetadata(params, [[], [], []], md_outputs))
    # row 0: no penalty -> 0; row 1: 5 - 1.5 = 3.5 < 4 -> 1; row 2: 5 / 1.3 = 3.85 < 4 -> 1
    assert out.sampled_token_ids.tolist() == [0, 1, 1]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.randn(4, 10)
    apply_min_tokens(logits, [3, 3, 0, 5], [2, 3, 0, 1], [{7, 2}, {7, 2}, {7}, {1, 99}])
    assert logits[0, 7] == -math.inf and logits[0, 2] == -math.inf
    assert logits[0].isfinite().sum() == 8
    assert logits[1].isfinite().all()  # reached min_tokens
    assert logits[2].isfinite().all()  # min_tokens 0
    assert logits[3, 1] == -math.inf and logits[3].isfinite().sum() == 9  # id 99 is outside the vocabulary


def test_min_tokens_through_the_sampler() -> None:
    """EOS (id 3) is the greedy choice; it is refused while fewer than min_tokens tokens were generated."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 0.5, 8.0]] * 4)
    params = [SP(temperature=0, min_tokens=2), SP(temperature=0, min_tokens=2), SP(temperature=0, min_tokens=3, stop_token_ids=[5]), SP(temperature=0)]
    md = SamplingMetadata(params, [[]] * 4, [[1], [1, 1], [1, 2], []], frozenset({3}))
    assert FullSampler(6, "cpu").sample(logits, md).sampled_token_ids.tolist() == [5, 3, 2, 3]


def test_logit_bias_closed_form_and_ban() -> None:
    logits = torch.zeros(2, 5) + torch.arange(5.0)
    apply_logit_bias(logits, [{0: 10.0, 4: -math.inf}, None])
    torch.testing.assert_close(logits, torch.tensor([[10.0, 1, 2, 3, -math.inf], [0, 1, 2, 3, 4]]))


def test_logit_bias_ban_is_never_drawn() -> None:
    vocab, n = 8, 3000
    logits = torch.zeros(n, vocab)  # uniform: the banned tokens would be drawn ~n/8 times each
    params = [SP(logit_bias={2: -math.inf, 5: -math.inf})] * n
    tokens = FullSampler(vocab, "cpu").sample(logits, SamplingMetadata(params, [[]] * n, [[]] * n)).sampled_token_ids
    counts = torch.bincount(tokens, minlength=vocab)
    assert counts[2] == 0 and counts[5] == 0
    assert (counts[[0, 1, 3, 4, 6, 7]] > n / 6 * 0.8).all()
