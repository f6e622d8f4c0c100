"""The default model's shipped Q4_1 file through ``gguf_cpu`` (decode steps in the kernel, the prompt
through its decoder) gives the greedy tokens of the float folder converted from the same file."""

from __future__ import annotations

import pytest

from corerun import LLM, SamplingParams

pytest.importorskip("gguf")

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]


@pytest.mark.timeout(600)
def test_q4_1_file_through_the_kernel_matches_the_converted_folder() -> None:
    from corerun.sdk.quantization import find_default_gguf

    params = SamplingParams(temperature=0.0, max_tokens=8)
    packed = LLM(model=str(find_default_gguf()), quantization="gguf_cpu", dtype="float32", threads=1)
    try:
        assert packed.engine.runner.quantization_name == "gguf_cpu"
        assert set(packed.engine.runner.model.model.layers[0].mlp.gate_up_proj.gguf_types.values()) == {"Q4_1"}
        got = packed.generate(PROMPTS, params, use_tqdm=False)
    finally:
        packed.shutdown()
    want = LLM(dtype="float32", threads=1).generate(PROMPTS, params, use_tqdm=False)
    for p, a, b in zip(PROMPTS, got, want):
        assert len(a.outputs[0].token_ids) == 8
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, p
