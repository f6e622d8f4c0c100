"""Greedy generation through the whole engine equals Hugging Face transformers token for token.

The batch mixes prompt lengths that hit 1 token, exactly one block, one block plus one, several
blocks, and prompts sharing a long prefix (prefix-cache hits); the KV cache is small enough that
the scheduler must preempt, and long prompts are prefilled in chunks mixed with decodes.
"""

from __future__ import annotations

import pytest
import torch

from corerun import LLM, SamplingParams
from tests.helpers.engine_testing import hf_greedy
from tests.helpers.tiny_models import make_tiny_model

BS = 4
MAX_TOKENS = 12


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    rnd = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    shared = rnd(3 * BS + 2)
    return [
        rnd(1),
        rnd(BS),
        rnd(BS + 1),
        rnd(5 * BS + 3),
        shared + rnd(3),
        shared + rnd(BS),
        shared[: 2 * BS] + rnd(1),
        rnd(2 * BS - 1),
        shared + rnd(2),
    ]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param)
    prompts = _prompts(256)
    return d, prompts, hf_greedy(d, prompts, MAX_TOKENS)


@pytest.mark.parametrize(
    "scheduler",
    [
        pytest.param({"max_num_batched_tokens": 4096}, id="whole-prefill"),
        pytest.param({"max_num_batched_tokens": 7, "max_num_seqs": 4}, id="chunked-mixed"),
        pytest.param({"max_num_batched_tokens": 4096, "chunked_prefill": False}, id="no-chunking"),
    ],
)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_equals_hf_with_preemption(tiny, scheduler, async_scheduling):
    model_dir, prompts, expected = tiny
    llm = LLM(
        model=model_dir, device="cpu", dtype="float32", attention="torch", kv_cache={"block_size": BS, "num_blocks": 24},
        scheduler={"max_model_len": 128, "async_scheduling": async_scheduling, **scheduler},
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    engine = llm.engine
    assert [o.prompt_token_ids for o in outs] == prompts
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert engine.kv.num_free_blocks == engine.runner.num_blocks  # nothing leaked
    if scheduler.get("max_num_seqs") is None:
        assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for the whole batch"
    assert engine.kv.stats().prefix_hits > 0


def test_tiny_and_large_cache_agree(tiny):
    model_dir, prompts, expected = tiny
    common = dict(model=model_dir, device="cpu", dtype="float32", attention="torch", scheduler={"max_model_len": 128})
    small = LLM(kv_cache={"block_size": BS, "num_blocks": 12}, **common)
    large = LLM(kv_cache={"block_size": BS, "num_blocks": 512}, **common)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    a = [o.outputs[0].token_ids for o in small.generate(prompts, sp)]
    b = [o.outputs[0].token_ids for o in large.generate(prompts, sp)]
    assert a == b == expected
    assert small.engine.scheduler.num_preemptions > large.engine.scheduler.num_preemptions == 0
