"""Logprobs (raw, the default) and prompt logprobs against float64 log_softmax."""

from __future__ import annotations

import pytest
import torch

from corerun.sampling_params import SamplingParams as SP
from corerun.sampler.full import FullSampler

V = 300


def _check(lp, logits64: torch.Tensor, token_ids: torch.Tensor, k: int) -> None:
    """``lp`` (LogprobsTensors) against log_softmax(logits64): column 0, ranks, and the top-k in order."""
    want = torch.log_softmax(logits64, dim=-1)
    n = logits64.shape[0]
    assert lp.token_ids.shape == (n, 1 + k) and lp.token_ids.dtype == torch.int64
    assert lp.logprobs.shape == (n, 1 + k) and lp.logprobs.dtype == torch.float32
    assert lp.ranks.shape == (n,) and lp.ranks.dtype == torch.int64
    assert torch.equal(lp.token_ids[:, 0], token_ids)
    torch.testing.assert_close(lp.logprobs[:, 0].double(), want.gather(1, token_ids[:, None])[:, 0], rtol=1e-6, atol=1e-5)
    for i in range(n):
        row = want[i].tolist()
        order = sorted(range(V), key=lambda t: -row[t])
        assert lp.token_ids[i, 1:].tolist() == order[:k]
        torch.testing.assert_close(lp.logprobs[i, 1:].double(), want[i, order[:k]], rtol=1e-6, atol=1e-5)
        assert lp.ranks[i].item() == 1 + order.index(int(token_ids[i]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_raw_logprobs_are_log_softmax_of_the_model_logits(ref, dtype: torch.dtype) -> None:
    """Rows with penalties, bias, temperature and truncation still report logprobs of the raw logits."""
    logits = (torch.randn(5, V) * 3).to(dtype)
    params = [
        SP(temperature=0, logprobs=5),
        SP(temperature=0.5, top_k=3, logprobs=2),
        SP(top_p=0.5, repetition_penalty=1.5, logit_bias={7: 3.0}, logprobs=0),
        SP(min_p=0.3),  # asks for none: padding
        SP(temperature=2.0, presence_penalty=1.0, logprobs=1),
    ]
    out = FullSampler(V, "cpu").sample(logits, ref.metadata(params, [[1, 2]] * 5, [[7, 7, 3]] * 5))
    assert out.logprobs is not None
    _check(out.logprobs, logits.double(), out.sampled_token_ids, k=5)


def test_no_logprobs_when_no_row_asks(ref) -> None:
    out = FullSampler(V, "cpu").sample(torch.randn(2, V), ref.metadata([SP(), SP(temperature=0)]))
    assert out.logprobs is None


def test_rank_of_a_sampled_token_far_down(ref) -> None:
    """With top_p tiny the sampled token is the top one (rank 1); with a strong bias it is where the raw logits put it."""
    logits = torch.arange(V, dtype=torch.float32)[None, :].flip(1) / 10  # token t has rank t + 1
    params = [SP(temperature=0, logit_bias={250: 100.0}, logprobs=3), SP(top_p=1e-6, logprobs=0)]
    out = FullSampler(V, "cpu").sample(logits.repeat(2, 1), ref.metadata(params))
    assert out.sampled_token_ids.tolist() == [250, 0]
    assert out.logprobs.ranks.tolist() == [251, 1]
    assert out.logprobs.token_ids[0, 1:].tolist() == [0, 1, 2]


@pytest.mark.parametrize("k", [0, 1, 7])
def test_prompt_logprobs(k: int) -> None:
    logits = torch.randn(9, V, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (9,))
    lp = FullSampler(V, "cpu").prompt_logprobs(logits.to(torch.float16), targets, k)
    _check(lp, logits.to(torch.float16).double(), targets, k)


def test_prompt_logprobs_errors() -> None:
    sampler = FullSampler(V, "cpu")
    with pytest.raises(ValueError, match=r"logits \[N, 300\] and token_ids \[N\], got \[4, 300\] and \[3\]"):
        sampler.prompt_logprobs(torch.randn(4, V), torch.zeros(3, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"num_logprobs must be in \[0, 300\], got -1"):
        sampler.prompt_logprobs(torch.randn(4, V), torch.zeros(4, dtype=torch.int64), -1)
