"""Prompt logprobs are never served as NaN or infinity: a request whose prompt logits are not finite
ends with ``finish_reason: "error"`` naming the cause and the position, whether or not its prompt chunk
samples, and the request beside it gets the tokens it gets alone.  References: the clean run of the
same prompts, and ``math.isfinite`` over every value served."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from corerun import SamplingParams
from corerun.testing import assert_idle, make_llm

POISONED_ROW = 1  # the logits row predicting prompt position 2
POISONS = {
    "nan_row": lambda row: row.fill_(math.nan),
    "one_nan": lambda row: row.__setitem__(3, math.nan),
    "pos_inf": lambda row: row.__setitem__(5, math.inf),
}
PROMPTS = [[5, 9, 12, 7, 30, 2, 18, 4, 11, 6], [3, 14, 8, 21, 17, 9]]
CHUNKED = {"max_num_batched_tokens": 4}  # prompt chunks of 4 tokens: most sample nothing


class PoisonedPromptLogits:
    """Wraps the engine's sampler: row ``POISONED_ROW`` of the first prompt-logprobs call is poisoned
    (as a model or kernel producing NaN or +inf at that position would leave it)."""

    def __init__(self, inner: Any, poison: str) -> None:
        self.inner, self.poison, self.calls = inner, POISONS[poison], 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def prompt_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> Any:
        self.calls += 1
        if self.calls == 1:
            logits = logits.clone()
            self.poison(logits[POISONED_ROW])
        return self.inner.prompt_logprobs(logits, token_ids, num_logprobs)


def _served(out: Any) -> list[float]:
    return [lp.logprob for position in out.prompt_logprobs or [] if position for lp in position.values()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scheduler", [{}, CHUNKED], ids=["whole-prompt", "chunked"])
@pytest.mark.parametrize("poison", sorted(POISONS))
def test_non_finite_prompt_logprobs_end_the_request_in_error(poison: str, scheduler: dict) -> None:
    asks = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    other = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    with make_llm(sampler="full", scheduler=scheduler) as llm:
        clean, reference = llm.generate(prompts, [asks, other], use_tqdm=False)
        assert len(_served(clean)) > 0 and all(math.isfinite(v) for v in _served(clean))  # the clean run serves them
        runner = llm.engine.runner
        runner.sampler = PoisonedPromptLogits(runner.sampler, poison)
        bad, good = llm.generate(prompts, [asks, other], use_tqdm=False)
        assert bad.outputs[0].finish_reason == "error", bad.outputs[0]
        assert ("the prompt logprobs of this request were not finite (NaN, +inf or -inf) at prompt position 2"
                in (bad.outputs[0].error or ""))
        assert all(math.isfinite(v) for v in _served(bad)), bad.prompt_logprobs
        assert (good.outputs[0].token_ids, good.outputs[0].finish_reason) == (reference.outputs[0].token_ids, "length")
        assert_idle(llm)


@pytest.mark.timeout(120)
def test_a_nan_model_serves_no_prompt_logprobs() -> None:
    """Every logit NaN, prompt in chunks: the first chunk ends the request, before anything samples."""
    with make_llm(sampler="full", scheduler=CHUNKED) as llm:
        model = llm.engine.runner.model
        compute = model.compute_logits
        model.compute_logits = lambda hidden: compute(hidden).fill_(math.nan)
        (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=3, prompt_logprobs=1),
                              use_tqdm=False)
        assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
        assert "prompt logprobs of this request were not finite" in (out.outputs[0].error or "")
        assert _served(out) == []
        assert_idle(llm)
