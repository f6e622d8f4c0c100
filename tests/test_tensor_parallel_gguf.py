"""Tensor parallelism with ``model: FILE.gguf``: the sizes are checked against the file's own
configuration before any process starts, and a valid size runs the file's packed blocks on every
rank with the greedy output of one process.

The file is the default model's shipped Q4_1 GGUF (SmolLM2-135M: 9 query heads, 3 KV heads, so 1
and 3 ranks split it; its o_proj and down_proj inputs, 192 and 512 per rank at 3, fall on Q4_1's
32-value blocks)."""

from __future__ import annotations

import multiprocessing

import pytest

from corerun import LLM, SamplingParams
from corerun.errors import ConfigError

pytest.importorskip("gguf")

BASE = dict(device="cpu", dtype="float32", attention="torch", kv_cache={"num_blocks": 64})
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def gguf_file() -> str:
    from corerun.models.default import find_default_gguf

    return str(find_default_gguf())


def _tp_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("corerun-tp-")]


def test_a_size_the_gguf_model_cannot_take_is_refused_before_any_process_starts(gguf_file: str) -> None:
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2 cannot split this model: .*num_attention_heads 9.*"
                                          r"Sizes that work for it: 1, 3$"):
        LLM(model=gguf_file, tensor_parallel_size=2, **BASE)
    assert not _tp_children()


@pytest.mark.timeout(600)
def test_three_ranks_run_the_gguf_file_with_the_greedy_output_of_one_process(gguf_file: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tp = LLM(model=gguf_file, tensor_parallel_size=3, distributed={"start_method": "forkserver"}, **BASE)
    try:
        # the blocks kept packed on every rank (gguf_cpu, the same storage, where corerun-quant-cpu is installed)
        assert tp.engine.runner.quantization_name in {"gguf", "gguf_cpu"}
        got = tp.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    finally:
        tp.shutdown()
    one = LLM(model=gguf_file, **BASE)
    want = one.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    one.shutdown()
    assert got.error is None and got.token_ids == want.token_ids and len(want.token_ids) == 6
    assert not _tp_children()
