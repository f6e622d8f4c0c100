"""corerun.testing's shared helpers (make_llm, assert_idle, max_rel_err / assert_rel_err) against known
answers, each shown to raise where it must."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from corerun.sampling_params import SamplingParams
from corerun.testing import TEST_DEFAULTS, assert_idle, assert_rel_err, hf_greedy, make_llm, max_rel_err
from corerun.testing.tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("testing-helpers"), arch="llama")


# ------------------------------------------------------------------ relative error
def test_max_rel_err_is_normwise_max_difference_over_max_reference() -> None:
    assert max_rel_err(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 2.0, 4.0])) == pytest.approx(0.25)
    # normwise: a tiny reference entry off by 100 % weighs by the largest entry, not by itself
    assert max_rel_err(torch.tensor([100.0, 0.002]), torch.tensor([100.0, 0.001])) == pytest.approx(1e-5)
    assert max_rel_err(torch.tensor([[-3.0, 1.0]]), torch.tensor([[-3.0, 1.0]])) == 0.0


def test_max_rel_err_is_taken_in_float64() -> None:
    ref = torch.tensor([1.0 + 1e-10], dtype=torch.float64)  # float32 cannot tell it from 1
    assert max_rel_err(torch.tensor([1.0], dtype=torch.float32), ref) == pytest.approx(1e-10, rel=1e-3)
    assert max_rel_err(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.5], dtype=torch.float64)) == pytest.approx(1 / 3)


def test_max_rel_err_refuses_what_has_no_answer() -> None:
    with pytest.raises(ValueError, match=r"shape \(2,\).*\(1, 2\)"):
        max_rel_err(torch.ones(2), torch.ones(1, 2))  # would broadcast
    with pytest.raises(ValueError, match="all zeros"):
        max_rel_err(torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="1 NaN or infinite"):
        max_rel_err(torch.ones(3), torch.tensor([1.0, float("nan"), 2.0]))
    assert max_rel_err(torch.tensor([1.0, float("inf")]), torch.ones(2)) == float("inf")


def test_assert_rel_err_passes_within_the_bound_and_names_value_bound_and_place_beyond_it() -> None:
    ref = torch.tensor([[1.0, 2.0], [4.0, -8.0]], dtype=torch.float64)
    got = ref.clone()
    got[1, 0] += 0.5  # 0.5 / 8 = 0.0625, exact in binary
    assert assert_rel_err(got, ref, 0.0625) == 0.0625
    with pytest.raises(AssertionError) as info:
        assert_rel_err(got, ref, 0.01, what="logits")
    message = str(info.value)
    assert message.startswith("logits: max relative error 0.0625 exceeds the bound 0.01")
    assert "index (1, 0): got 4.5, reference 4" in message


def test_assert_rel_err_counts_non_finite_entries() -> None:
    got = torch.tensor([1.0, float("nan"), float("-inf"), 4.0])
    with pytest.raises(AssertionError, match="attention output: 2 of 4 entries are NaN or infinite"):
        assert_rel_err(got, torch.ones(4, dtype=torch.float64), 1.0, what="attention output")


# ------------------------------------------------------------------ make_llm
def test_make_llm_defaults_merge_sections_and_replace_values(model_dir: Path) -> None:
    with make_llm(model_dir, dtype="bfloat16", scheduler={"max_num_seqs": 2}) as llm:
        config = llm.engine.config
        assert (config.device, config.dtype, config.attention.name) == ("cpu", "bfloat16", "torch")
        assert (config.kv_cache.block_size, config.kv_cache.num_blocks) == (4, 64)
        assert (config.scheduler.max_model_len, config.scheduler.max_num_seqs) == (128, 2)
        assert llm.engine.kv.stats().num_blocks == 64
    # the defaults themselves are not changed by an override
    assert TEST_DEFAULTS["scheduler"] == {"max_model_len": 128} and TEST_DEFAULTS["dtype"] == "float32"


def test_make_llm_generates_what_transformers_does(model_dir: Path) -> None:
    prompts = [[5, 9, 200, 3], [17]]
    with make_llm(model_dir) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == hf_greedy(model_dir, prompts, GREEDY.max_tokens)


def test_make_llm_without_a_model_serves_a_tiny_one() -> None:
    with make_llm() as llm:
        assert llm.engine.tokenizer is None  # token ids in, token ids out
        assert llm.engine.runner.model_config.vocab_size == 256
        out = llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == GREEDY.max_tokens and all(0 <= t < 256 for t in out.token_ids)


# ------------------------------------------------------------------ assert_idle
def test_assert_idle_names_each_thing_left_until_the_request_is_released(model_dir: Path) -> None:
    with make_llm(model_dir) as llm:
        engine = llm.engine
        assert_idle(llm)
        rid = engine.add_request(list(range(3, 13)), GREEDY)  # 10 tokens: 3 blocks of 4
        with pytest.raises(AssertionError, match=rf"engine not idle: 1 request\(s\) waiting: '{rid}'; "
                                                 rf"1 request\(s\) not released: '{rid}'$"):
            assert_idle(llm)
        engine.step()
        with pytest.raises(AssertionError, match=rf"1 request\(s\) running: '{rid}'.*3 of 64 blocks of the KV cache in use"):
            assert_idle(engine)  # the engine itself is accepted too
        engine.abort(rid)
        with pytest.raises(AssertionError, match=rf"^engine not idle after waiting 0.05 s: 1 request\(s\) not released: '{rid}'$"):
            assert_idle(llm, timeout=0.05)
        engine.release(rid)
        assert_idle(llm)


def test_assert_idle_counts_the_draft_models_cache_and_sequences(model_dir: Path) -> None:
    draft = {"method": "draft_model", "model": str(model_dir), "num_tokens": 2}
    with make_llm(model_dir, speculative=draft) as llm:
        engine = llm.engine
        rid = engine.add_request(list(range(3, 13)), GREEDY)  # 10 tokens: 3 blocks of 4 in each cache
        engine.step()
        with pytest.raises(AssertionError) as err:
            assert_idle(llm)
        assert "3 of 64 blocks of the KV cache in use" in str(err.value)
        assert re.search(r"3 of \d+ blocks of the draft model's KV cache in use", str(err.value)), err.value
        assert "1 draft-model sequence(s) kept, for seq id(s) 0" in str(err.value)
        while engine.has_unfinished_requests():
            engine.step()
        engine.release(rid)
        assert_idle(llm)
