"""The CPU warm-up at load (``graph.warmup``): one dummy prefill of the token budget in bfloat16 / float16,
on a scratch cache, with the step's thread count; the real KV cache and what a request gets are untouched."""

from __future__ import annotations

import pytest
import torch

from corerun import LLM, SamplingParams
from corerun.config import Config
from corerun.runner import construction
from corerun.runner.model_runner import ModelRunner
from tests.helpers.tiny_models import make_tiny_model


def _config(model_dir, dtype: str, **over) -> Config:
    return Config(model=str(model_dir), device="cpu", dtype=dtype, attention="torch", threads=1,
                  kv_cache={"block_size": 16, "num_blocks": 64},
                  scheduler={"max_model_len": 200, "max_num_batched_tokens": 600, "max_num_seqs": 8}, **over)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, list[int], list[int], int]]:
    """Record each warm-up forward: its token count, query and sequence lengths, and torch's threads then."""
    seen: list[tuple[int, list[int], list[int], int]] = []
    batches = []  # the dummy steps' batches, as the warm-up builds them
    inner, plan_inner = ModelRunner._model_fn, construction.profile.dummy_step

    def dummy_step(query_lens, context_lens, block_size, device):
        inputs = plan_inner(query_lens, context_lens, block_size, device)
        batches.append(inputs.batch)
        return inputs

    def model_fn(self, input_ids, positions, metadata):
        batch = batches[-1]
        seen.append((input_ids.numel(), batch.query_start_loc.diff().tolist(), batch.seq_lens.tolist(), torch.get_num_threads()))
        return inner(self, input_ids, positions, metadata)

    monkeypatch.setattr(construction.profile, "dummy_step", dummy_step)
    monkeypatch.setattr(ModelRunner, "_model_fn", model_fn)
    return seen


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_on_cpu_warms_up_with_the_whole_budget_in_fresh_prompts(tmp_path, monkeypatch, dtype) -> None:
    seen = _spy(monkeypatch)
    ModelRunner(_config(make_tiny_model(tmp_path), dtype))
    # 600 tokens of budget in prompts of min(256, max_model_len 200) = 200 tokens: three fresh prompts
    assert seen == [(600, [200, 200, 200], [200, 200, 200], 1)]


def test_the_prompt_count_is_capped_by_max_num_seqs_and_the_length_by_max_model_len(tmp_path, monkeypatch) -> None:
    seen = _spy(monkeypatch)
    config = Config(model=str(make_tiny_model(tmp_path)), device="cpu", dtype="bfloat16", attention="torch", threads=1,
                    kv_cache={"block_size": 16, "num_blocks": 64},
                    scheduler={"max_model_len": 64, "max_num_batched_tokens": 4096, "max_num_seqs": 5})
    ModelRunner(config)
    assert seen == [(320, [64] * 5, [64] * 5, 1)]


@pytest.mark.parametrize(("dtype", "over"), [("float32", {}), ("bfloat16", {"graph": {"warmup": False}})])
def test_float32_and_warmup_false_do_not_warm_up(tmp_path, monkeypatch, dtype, over) -> None:
    seen = _spy(monkeypatch)
    ModelRunner(_config(make_tiny_model(tmp_path), dtype, **over))
    assert seen == []


def test_the_warm_up_leaves_the_kv_cache_and_the_thread_count_as_they_were(tmp_path) -> None:
    runner = ModelRunner(_config(make_tiny_model(tmp_path), "bfloat16", graph={"warmup": False}))
    g = torch.Generator().manual_seed(0)
    for c in runner.kv_caches:
        c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    before, threads = [c.clone() for c in runner.kv_caches], torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        construction.warm_up(runner)  # (one thread inside: threads=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(runner.kv_caches, before, strict=True))


def test_outputs_equal_a_runner_that_did_not_warm_up(tmp_path) -> None:
    model_dir = make_tiny_model(tmp_path)
    cold = LLM(config=_config(model_dir, "bfloat16", graph={"warmup": False}))
    warm = LLM(config=_config(model_dir, "bfloat16"))
    prompts = [[(7 * i + 3 * j) % 90 + 1 for j in range(20 + 9 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in warm.generate(prompts, params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in cold.generate(prompts, params, use_tqdm=False)]
    assert got == want and all(len(t) == 12 for t in got)


def test_a_bad_warmup_value_is_refused_naming_the_field(tmp_path) -> None:
    with pytest.raises(Exception, match="warmup"):
        Config(model=str(tmp_path), graph={"warmup": "sometimes"})
