"""Sustained load: thousands of requests through a deliberately small KV cache.

Random prompt and output lengths (1-12 tokens each, some prompts sharing prefixes), mixed sampling
parameters (greedy, seeded and unseeded random; temperature, top-k, top-p, min-p, the three
penalties, min_tokens, stop ids, logit bias bans, logprobs), 64 sequences at a time in a cache that
holds far fewer, so preemption, chunked prefill and prefix caching all happen many times over.

Checked: every request finishes as its parameters say (length, stop token, EOS, min_tokens, bans),
nothing leaks (every block free, no request left), a sample of greedy requests equals Hugging Face
transformers and the seeded ones equal their solo runs, and the same workload run twice gives the
same tokens.  ``CORERUN_SOAK_REQUESTS`` raises the number of requests (default 2000).
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from corerun import LLM, SamplingParams
from corerun.outputs import RequestOutput
from corerun.testing import assert_idle, make_llm
from tests.helpers.engine_testing import deadline
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow


NUM_REQUESTS = int(os.environ.get("CORERUN_SOAK_REQUESTS", "2000"))
NUM_REPEATED = min(NUM_REQUESTS, max(300, NUM_REQUESTS // 8))
VOCAB = 256
BS = 4
NUM_BLOCKS = 64  # 256 token slots; 64 running requests can want up to 64 * 6 blocks
SCHEDULER = {"max_num_seqs": 64, "max_num_batched_tokens": 128}
SAMPLE = 20


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams
    kind: str  # "greedy" (plain: comparable with transformers), "greedy+" (processors), "seeded", "random"

    @property
    def deterministic(self) -> bool:
        return self.kind != "random"


def workload(n: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 8))] for _ in range(6)]
    requests = []
    for _ in range(n):
        if rng.random() < 0.25:
            prefix = rng.choice(prefixes)
            prompt = prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 12 - len(prefix)))]
        else:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))]
        max_tokens = rng.randint(1, 12)
        extra: dict[str, Any] = {}
        if rng.random() < 0.15:
            extra["logprobs"] = rng.choice([0, 1, 3])
        if rng.random() < 0.15:
            extra["min_tokens"] = rng.randint(0, max_tokens)
        if rng.random() < 0.15:
            extra["stop_token_ids"] = rng.sample(range(3, VOCAB), 8)
        if rng.random() < 0.15:
            extra["logit_bias"] = {t: -math.inf for t in rng.sample(range(VOCAB), 16)}
        r = rng.random()
        if r < 0.2:
            kind, params = "greedy", SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        else:
            processors = dict(
                presence_penalty=rng.choice([0.0, 0.0, 0.5, -0.4]),
                frequency_penalty=rng.choice([0.0, 0.0, 0.3, -0.2]),
                repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
                ignore_eos=rng.random() < 0.5,
                max_tokens=max_tokens,
                **extra,
            )
            if r < 0.3:
                kind, params = "greedy+", SamplingParams(temperature=0, **processors)
            else:
                kind = "seeded" if r < 0.9 else "random"
                params = SamplingParams(
                    temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
                    top_k=rng.choice([0, 0, 1, 5, 40]),
                    top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
                    min_p=rng.choice([0.0, 0.0, 0.05, 0.2]),
                    seed=rng.randrange(2**32) if kind == "seeded" else None,
                    **processors,
                )
        requests.append(Request(prompt, params, kind))
    return requests


def hf_greedy(model_dir: Path, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Hugging Face transformers' greedy continuations (EOS ignored), float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for p, n in zip(prompts, lengths):
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            outs.append(gen[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("reliability-soak"), arch="llama")


def run(llm: LLM, requests: list[Request]) -> list[RequestOutput]:
    with deadline(900):
        outs = llm.generate([r.prompt for r in requests], [r.params for r in requests], use_tqdm=False)
    assert_idle(llm)
    return outs


def check_finished_as_asked(req: Request, out: RequestOutput, eos: frozenset[int]) -> None:
    p, c = req.params, out.outputs[0]
    ids = c.token_ids
    assert out.finished and out.prompt_token_ids == req.prompt
    assert c.error is None and c.finish_reason in ("length", "stop"), c
    assert 1 <= len(ids) <= p.max_tokens and all(0 <= t < VOCAB for t in ids)
    assert len(ids) >= p.min_tokens
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos))
    assert not stops.intersection(ids[:-1]), "generation went on past a stop token"
    if c.finish_reason == "length":
        assert len(ids) == p.max_tokens
    else:
        assert ids[-1] in stops
        assert c.stop_reason == (ids[-1] if ids[-1] in p.stop_token_ids else None)
    banned = {t for t, b in (p.logit_bias or {}).items() if b == -math.inf}
    assert not banned.intersection(ids), "a banned token was sampled"
    if p.logprobs is None:
        assert c.logprobs is None
    else:
        assert len(c.logprobs) == len(ids)
        for token, d in zip(ids, c.logprobs):
            assert token in d and p.logprobs <= len(d) <= p.logprobs + 1


def test_soak(model_dir: Path) -> None:
    requests = workload(NUM_REQUESTS, seed=2024)
    llm = make_llm(model_dir, kv_cache={"block_size": BS, "num_blocks": NUM_BLOCKS}, scheduler=SCHEDULER)
    outs = run(llm, requests)
    engine = llm.engine
    eos = engine.eos_token_ids
    for req, out in zip(requests, outs):
        check_finished_as_asked(req, out, eos)
    assert engine.num_generated_tokens == sum(len(o.outputs[0].token_ids) for o in outs)
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small"
    assert engine.kv.stats().prefix_hits > 0
    reasons = {o.outputs[0].finish_reason for o in outs}
    assert reasons == {"length", "stop"}

    rng = random.Random(5)
    # plain greedy requests equal transformers
    plain = rng.sample([i for i, r in enumerate(requests) if r.kind == "greedy"], SAMPLE)
    expected = hf_greedy(model_dir, [requests[i].prompt for i in plain], [requests[i].params.max_tokens for i in plain])
    assert [outs[i].outputs[0].token_ids for i in plain] == expected
    # greedy with processors and seeded random requests equal their runs alone in a fresh engine
    solo_ids = rng.sample([i for i, r in enumerate(requests) if r.kind == "greedy+"], SAMPLE // 2)
    solo_ids += rng.sample([i for i, r in enumerate(requests) if r.kind == "seeded"], SAMPLE // 2)
    alone = make_llm(model_dir, kv_cache={"block_size": BS, "num_blocks": 256}, scheduler=SCHEDULER)
    for i in solo_ids:
        (solo,) = alone.generate(requests[i].prompt, requests[i].params)
        assert solo.outputs[0].token_ids == outs[i].outputs[0].token_ids, (i, requests[i].params)
        assert solo.outputs[0].finish_reason == outs[i].outputs[0].finish_reason


def test_same_workload_twice_gives_the_same_outputs(model_dir: Path) -> None:
    requests = workload(NUM_REPEATED, seed=77)
    llm = make_llm(model_dir, kv_cache={"block_size": BS, "num_blocks": NUM_BLOCKS}, scheduler=SCHEDULER)
    first = run(llm, requests)
    second = run(llm, requests)  # now with the first run's prefixes cached: other batches, other preemptions
    compared = 0
    for req, a, b in zip(requests, first, second):
        if not req.deterministic:
            continue
        ca, cb = a.outputs[0], b.outputs[0]
        assert (ca.token_ids, ca.finish_reason, ca.stop_reason) == (cb.token_ids, cb.finish_reason, cb.stop_reason), req
        if ca.logprobs is not None:
            assert [sorted(d) for d in ca.logprobs] == [sorted(d) for d in cb.logprobs]
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for x, y in zip(ca.logprobs, cb.logprobs) for t in x)
        compared += 1
    assert compared > 0.85 * len(requests)
