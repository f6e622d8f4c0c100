"""Asynchronous scheduling together with speculative decoding (n-gram and draft model).

Step N+1 is scheduled while step N runs, its decodes from placeholder counts (every draft of N
accepted, as many draft slots as the request may get); once N's result is in, those rows are settled.
References: Hugging Face transformers' greedy tokens, and the same requests through a synchronous
engine and through one without speculation; preemption (a small cache), prefix hits (a second run),
aborts and stop strings in the mix.  Every block comes back.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from corerun import LLM, SamplingParams
from corerun.testing import assert_idle, make_llm
from tests.helpers.serving import tiny_chat_model
from tests.helpers.tiny_models import make_tiny_model
from tests.test_reliability_exhaustion import MAX_TOKENS, hf_greedy, tiny  # noqa: F401 (tiny: a fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _loops(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat themselves, so n-gram drafts are often right."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (k,), generator=g).tolist() * 3 for k in range(2, 2 + n)]


@pytest.fixture
def engines() -> Iterator[Any]:
    made: list[LLM] = []

    def build(model_dir: Path, **kw: Any) -> LLM:
        made.append(make_llm(model_dir, **kw))
        return made[-1]

    yield build
    for llm in made:
        llm.shutdown()


def _ids(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scheduler", [pytest.param({}, id="whole-prefill"),
                                       pytest.param({"max_num_batched_tokens": 6}, id="chunked")])
def test_ngram_async_greedy_equals_sync_no_spec_and_transformers(tiny, engines, scheduler: dict) -> None:
    model_dir, prompts, _ = tiny
    prompts = prompts + _loops(4, seed=1)
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)
    spec = {"method": "ngram", "num_tokens": 3}
    asyn = engines(model_dir, kv_cache={"num_blocks": 9}, scheduler={**scheduler, "async_scheduling": True},
                   speculative=spec)
    sync = engines(model_dir, kv_cache={"num_blocks": 9}, scheduler=scheduler, speculative=spec)
    plain = engines(model_dir, kv_cache={"num_blocks": 9}, scheduler={**scheduler, "async_scheduling": True})
    for run in range(2):  # the second run starts with prefixes cached by the first
        a = asyn.generate(prompts, GREEDY, use_tqdm=False)
        assert _ids(a) == expected, f"run {run}"
        assert _ids(a) == _ids(sync.generate(prompts, GREEDY, use_tqdm=False)) == _ids(
            plain.generate(prompts, GREEDY, use_tqdm=False))
        assert all(o.outputs[0].finish_reason == "length" for o in a)
        assert_idle(asyn)
    st = asyn.engine.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0  # speculation ran, and some drafts were accepted
    assert st.num_accepted_tokens < st.num_draft_tokens  # ... and some were rejected: the placeholders were settled
    assert asyn.engine.scheduler.num_preemptions > 0
    assert asyn.engine.kv.stats().prefix_hits > 0


@pytest.fixture(scope="module")
def draft_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("async-draft")
    target = make_tiny_model(root, arch="llama")
    near = root / "near"
    shutil.copytree(target, near)
    g = torch.Generator().manual_seed(7)
    weights = load_file(str(near / "model.safetensors"))
    save_file({k: w + 0.3 * w.std() * torch.randn(w.shape, generator=g) for k, w in weights.items()},
              str(near / "model.safetensors"), metadata={"format": "pt"})
    return {"target": target, "near": near}


@pytest.mark.timeout(240)
def test_draft_model_async_greedy_equals_sync_and_transformers(draft_models, engines) -> None:
    target = draft_models["target"]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (k,), generator=g).tolist() for k in (1, 5, 9, 14)] + _loops(2, seed=4)
    expected = hf_greedy(target, prompts, MAX_TOKENS)
    common = dict(kv_cache={"block_size": 4, "num_blocks": 12},
                  speculative={"method": "draft_model", "model": str(draft_models["near"]), "num_tokens": 3})
    asyn = engines(target, scheduler={"async_scheduling": True, "max_model_len": 64}, **common)
    sync = engines(target, scheduler={"max_model_len": 64}, **common)
    for run in range(2):
        a = asyn.generate(prompts, GREEDY, use_tqdm=False)
        assert _ids(a) == expected, f"run {run}"
        assert _ids(a) == _ids(sync.generate(prompts, GREEDY, use_tqdm=False))
        assert_idle(asyn)
        draft_kv = asyn.engine.proposer.runner.kv_manager
        assert draft_kv.num_free_blocks == draft_kv.num_blocks
    st = asyn.engine.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert asyn.engine.scheduler.num_preemptions > 0


@pytest.mark.timeout(240)
def test_async_ngram_with_aborts_and_stop_strings_equals_sync(tmp_path: Path, engines) -> None:
    chat = tiny_chat_model(tmp_path)
    spec = {"method": "ngram", "num_tokens": 3}
    asyn = engines(chat, kv_cache={"num_blocks": 96}, scheduler={"async_scheduling": True}, speculative=spec)
    sync = engines(chat, kv_cache={"num_blocks": 96})
    prompt = "the cat sat on the mat and the dog sat on the log " * 2
    full = sync.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    stop = full.text[6:8]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    want = sync.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert want.finish_reason == "stop" and want.text == full.text[: full.text.index(stop)]
    # an aborted request beside the others: it ends at once, the others' outputs do not change
    eng = asyn.engine
    eng.add_request(prompt, params, request_id="stopped")
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), request_id="whole")
    eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), request_id="aborted")
    outs: dict[str, Any] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for seq in eng.step():
            outs[seq.request_id] = eng.output(seq)
        steps += 1
        if steps == 3:
            eng.abort("aborted")
    got = outs["stopped"].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (want.text, want.token_ids, "stop", stop)
    assert outs["whole"].outputs[0].token_ids == full.token_ids
    assert eng.requests["aborted"].finish_reason == "abort"
    assert eng.requests["aborted"].num_output_tokens < 24
    for rid in ("stopped", "whole", "aborted"):
        eng.release(rid)
    assert_idle(asyn)
