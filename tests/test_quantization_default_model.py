"""The default model run natively from its shipped Q4_1 GGUF file, against the converted folder."""

from __future__ import annotations

import pytest

from corerun import LLM, SamplingParams

pytest.importorskip("gguf")

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]


@pytest.mark.timeout(600)
def test_q4_1_gguf_greedy_output_equals_the_converted_folder_in_float32() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    native = LLM(quantization="gguf", dtype="float32")
    assert native.engine.runner.quantization_name == "gguf"
    qkv = native.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert set(qkv.gguf_types.values()) == {"Q4_1"}  # the blocks as shipped, not floats
    packed = native.generate(PROMPTS, params, use_tqdm=False)
    native.shutdown()
    converted = LLM(dtype="float32").generate(PROMPTS, params, use_tqdm=False)
    for p, a, b in zip(PROMPTS, packed, converted):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, p
        assert len(a.outputs[0].token_ids) == 12
