"""KV-cache exhaustion and cancellation: nothing lost, nothing leaked, results unchanged.

A cache far too small for the batch forces preemption by recompute (with chunked prefill, prefix
caching and prompt logprobs in the mix): every request still finishes, greedy outputs equal Hugging
Face transformers' token for token, seeded random outputs and logprobs equal those of an
unconstrained engine, and the free-block count returns exactly to the total after every run.
A request cancelled mid-generation (the ``LLM.stream`` iterator closed early, or
``engine.abort(request_id)``) gives its blocks back at once.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from corerun import SamplingParams
from corerun.testing import assert_idle, make_llm
from tests.helpers.tiny_models import hf_logits, hf_model, make_tiny_model
from tests.helpers.engine_testing import hf_greedy, no_hang  # noqa: F401 (no_hang: a fixture)

BS = 4
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]], list[list[int]]]:
    """Model folder, ten prompts (1 to 14 tokens, three sharing a prefix), their greedy references."""
    model_dir = make_tiny_model(tmp_path_factory.mktemp("reliability-exhaustion"), arch="llama")
    g = torch.Generator().manual_seed(11)
    rnd = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()  # noqa: E731
    shared = rnd(2 * BS + 1)
    prompts = [rnd(1), rnd(14), rnd(BS), shared + rnd(3), rnd(7), shared + rnd(5), rnd(BS + 1), shared[:2 * BS] + rnd(2), rnd(12), rnd(2)]
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------------- exhaustion

@pytest.mark.parametrize(
    "scheduler",
    [pytest.param({}, id="whole-prefill"), pytest.param({"max_num_batched_tokens": 6}, id="chunked")],
)
def test_preemption_by_recompute_loses_nothing(tiny, scheduler: dict) -> None:
    """7 blocks (28 slots) for ten requests of up to 23 tokens of K/V each."""
    model_dir, prompts, expected = tiny
    small = make_llm(model_dir, kv_cache={"num_blocks": 7}, scheduler=scheduler)
    for run in range(2):  # the second run starts with cached prefixes left by the first
        outs = small.generate(prompts, GREEDY)
        assert tokens(outs) == expected, f"run {run}"
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert_idle(small)
    assert small.engine.scheduler.num_preemptions > 5
    assert small.engine.kv.stats().prefix_hits > 0


def test_seeded_sampling_and_logprobs_unchanged_by_preemption(tiny) -> None:
    """Mixed seeded parameters with logprobs and prompt logprobs: a tight cache gives what a roomy one gives."""
    model_dir, prompts, _ = tiny
    params = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=MAX_TOKENS, logprobs=3),
        SamplingParams(temperature=1.2, top_k=20, seed=2, max_tokens=MAX_TOKENS, prompt_logprobs=2),
        SamplingParams(temperature=0.7, top_p=0.9, min_p=0.02, seed=3, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, seed=4, max_tokens=MAX_TOKENS),
        SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=MAX_TOKENS, logprobs=1, prompt_logprobs=0),
        SamplingParams(temperature=0.9, seed=5, min_tokens=4, max_tokens=MAX_TOKENS, stop_token_ids=[7, 9]),
    ] * 2
    prompts = (prompts * 2)[: len(params)]
    small = make_llm(model_dir, kv_cache={"num_blocks": 7}, scheduler={"max_num_batched_tokens": 6})
    roomy = make_llm(model_dir, kv_cache={"num_blocks": 256})
    a, b = small.generate(prompts, params), roomy.generate(prompts, params)
    hf = hf_model(model_dir)
    assert small.engine.scheduler.num_preemptions > 0 and roomy.engine.scheduler.num_preemptions == 0
    for x, y, p in zip(a, b, params):
        cx, cy = x.outputs[0], y.outputs[0]
        assert (cx.token_ids, cx.finish_reason, cx.stop_reason) == (cy.token_ids, cy.finish_reason, cy.stop_reason)
        _same_logprobs(cx.logprobs, cy.logprobs)
        _same_logprobs(x.prompt_logprobs, y.prompt_logprobs)
        _top_k_shape(cx.token_ids, cx.logprobs, p.logprobs)
        if p.prompt_logprobs is not None:  # against transformers: position j - 1 predicts prompt token j
            ref = hf_logits(hf, x.prompt_token_ids).double().log_softmax(-1)
            assert x.prompt_logprobs[0] is None and len(x.prompt_logprobs) == len(x.prompt_token_ids)
            for j in range(1, len(x.prompt_token_ids)):
                t = x.prompt_token_ids[j]
                assert abs(x.prompt_logprobs[j][t].logprob - ref[j - 1, t].item()) < 1e-4
    assert_idle(small)
    assert_idle(roomy)


def _top_k_shape(tokens: list[int], logprobs: list | None, k: int | None) -> None:
    """vLLM's rule: each position holds the top ``k`` (ranks 1..k) plus the chosen token when not among them."""
    if k is None:
        assert logprobs is None
        return
    assert len(logprobs) == len(tokens)
    for token, d in zip(tokens, logprobs):
        assert token in d
        assert sorted(v.rank for t, v in d.items() if t != token or v.rank <= k) == list(range(1, k + 1))


def _same_logprobs(a: list | None, b: list | None) -> None:
    assert (a is None) == (b is None)
    if a is None:
        return
    assert len(a) == len(b)
    for da, db in zip(a, b):
        assert (da is None) == (db is None)
        if da is None:
            continue
        assert set(da) == set(db)
        for t in da:
            assert abs(da[t].logprob - db[t].logprob) < 1e-4 and da[t].rank == db[t].rank


# ------------------------------------------------------------------------ abort

def test_closing_a_stream_early_frees_its_blocks_at_once(tiny) -> None:
    model_dir, prompts, expected = tiny
    llm = make_llm(model_dir)
    engine = llm.engine
    stream = llm.stream(prompts[:4], GREEDY)
    seen = [next(stream) for _ in range(6)]
    assert not any(o.finished for o in seen)
    assert engine.kv.num_free_blocks < engine.runner.num_blocks
    stream.close()
    assert_idle(llm)
    # a for-loop left with break: the abandoned generator is closed when dropped
    for out in llm.stream(prompts[4:6], GREEDY):
        assert engine.kv.num_free_blocks < engine.runner.num_blocks
        break
    del out
    assert_idle(llm)
    with contextlib.closing(llm.stream(prompts, GREEDY)) as stream:
        next(stream)
    assert_idle(llm)
    assert tokens(llm.generate(prompts, GREEDY)) == expected
    assert_idle(llm)


def test_engine_abort_frees_at_once_and_spares_the_others(tiny) -> None:
    model_dir, prompts, expected = tiny
    llm = make_llm(model_dir, scheduler={"max_num_batched_tokens": 5, "max_num_seqs": 2})
    engine = llm.engine
    running = engine.add_request(prompts[1], GREEDY)  # 14 tokens: prefilled in chunks of <= 5
    other = engine.add_request(prompts[4], GREEDY)
    waiting = engine.add_request(prompts[8], GREEDY)  # held back by max_num_seqs=2
    engine.step()
    seq = engine.requests[running]
    assert 0 < seq.num_computed_tokens < seq.num_prompt_tokens  # in the middle of its prefill
    held = len(engine.kv.block_table(seq.seq_id))
    free = engine.kv.num_free_blocks
    engine.abort(running)
    assert engine.kv.num_free_blocks == free + held
    engine.abort(waiting)  # never scheduled: nothing to free, but it must not run
    engine.abort("no-such-request")  # ignored
    outputs = {}
    while engine.has_unfinished_requests():
        for s in engine.step():
            outputs[s.request_id] = engine.output(s)
    assert set(outputs) == {other}
    assert outputs[other].outputs[0].token_ids == expected[4]
    for rid, reason in ((running, "abort"), (waiting, "abort"), (other, "length")):
        assert engine.output(engine.requests[rid]).outputs[0].finish_reason == reason
        engine.abort(rid)  # finished: ignored
        engine.release(rid)
    assert_idle(llm)
    # mid-decode, with prefix blocks shared with another request
    a = engine.add_request(prompts[3], GREEDY)
    b = engine.add_request(prompts[5], GREEDY)
    for _ in range(4):
        engine.step()
    engine.abort(a)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.requests[b].output_token_ids == expected[5]
    assert engine.requests[a].num_output_tokens < MAX_TOKENS
    engine.release(a)
    engine.release(b)
    assert_idle(llm)
