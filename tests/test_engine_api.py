"""Engine API corners: request ids, Config + keyword overrides, the sampler's view of outputs, streaming text."""

from __future__ import annotations

import pytest

from corerun import LLM, Config, RequestError, SamplingParams
from corerun.config import KVCacheConfig, SchedulerConfig
from corerun.core.sequence import TokenView

from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("api"), arch="llama")


def test_token_view_matches_the_slice_it_stands_for():
    tokens = [5, 6, 7, 8, 9]
    view = TokenView(tokens, 2)
    assert list(view) == [7, 8, 9] and len(view) == 3
    assert view[0] == 7 and view[-1] == 9 and view[1:] == [8, 9]
    with pytest.raises(IndexError):
        view[3]
    tokens.append(10)  # a live view: the sampler sees the history as it is at the step
    assert list(view) == [7, 8, 9, 10]


def test_config_object_plus_nested_keyword_overrides_keeps_the_rest(model_dir):
    cfg = Config(model=str(model_dir), device="cpu", dtype="float32", attention="torch",
                 kv_cache=KVCacheConfig(num_blocks=40, prefix_caching=False), scheduler=SchedulerConfig(max_model_len=64))
    llm = LLM(config=cfg, kv_cache={"block_size": 8})
    assert llm.config.kv_cache.block_size == 8
    assert llm.config.kv_cache.num_blocks == 40 and llm.config.kv_cache.prefix_caching is False
    assert llm.engine.runner.num_blocks == 40


def test_automatic_request_ids_never_take_a_chosen_one(model_dir):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", attention="torch",
              kv_cache={"block_size": 4, "num_blocks": 32}, scheduler={"max_model_len": 64})
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=2)
    chosen = engine.add_request([3, 4], sp, request_id="1")
    ids = {chosen} | {engine.add_request([5, 6], sp) for _ in range(3)}
    assert len(ids) == 4 and len(engine.requests) == 4
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request([1], sp, request_id="1")
    while engine.has_unfinished_requests():
        engine.step()
    assert all(engine.requests[r].is_finished for r in ids)


def test_request_larger_than_the_cache_names_the_prompt(model_dir):
    llm = LLM(model=model_dir, device="cpu", dtype="float32", attention="torch",
              kv_cache={"block_size": 4, "num_blocks": 4}, scheduler={"max_model_len": 64})
    with pytest.raises(RequestError, match=r"the prompt alone \(20 tokens\) needs 5 KV-cache blocks"):
        llm.generate([list(range(3, 23))], SamplingParams(max_tokens=1))
