"""The default model's shipped Q4_1 file through ``gguf_cpu`` (decode steps in the kernel, the prompt
through its decoder) gives the greedy tokens of the float folder converted from the same file, up to
near-ties.

The kernel quantizes each block of 32 activations to int8, as llama.cpp does, so its logits move by a few
tenths of a nat from the float folder's, and a tiny change upstream (another RMSNorm's summation order)
can flip an int8 rounding; greedy decoding then follows whichever of two near-equal tokens comes out
ahead.  Where the tokens part, both runs must rank both tokens first and second, and the float run's gap
between them must be under ``NEAR_TIE`` nats; a broken kernel parts at once by far more."""

from __future__ import annotations

import pytest

from corerun import LLM, SamplingParams

pytest.importorskip("gguf")

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
NEAR_TIE = 0.5  # nats: a few times the int8 activations' logit error measured here (0.1-0.3)


@pytest.mark.timeout(600)
def test_q4_1_file_through_the_kernel_matches_the_converted_folder() -> None:
    from corerun.sdk.quantization import find_default_gguf

    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    packed = LLM(model=str(find_default_gguf()), quantization="gguf_cpu", dtype="float32", threads=1)
    try:
        assert packed.engine.runner.quantization_name == "gguf_cpu"
        assert set(packed.engine.runner.model.model.layers[0].mlp.gate_up_proj.gguf_types.values()) == {"Q4_1"}
        got = packed.generate(PROMPTS, params, use_tqdm=False)
    finally:
        packed.shutdown()
    want = LLM(dtype="float32", threads=1).generate(PROMPTS, params, use_tqdm=False)
    parted = 0
    for p, a, b in zip(PROMPTS, got, want):
        ka, kb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert len(ka) == 8
        if ka == kb:
            continue
        parted += 1
        i = next(j for j, (x, y) in enumerate(zip(ka, kb)) if x != y)
        lp_kernel, lp_float = a.outputs[0].logprobs[i], b.outputs[0].logprobs[i]
        assert i > 0 and {ka[i], kb[i]} <= set(lp_kernel) & set(lp_float), (p, i, lp_kernel, lp_float)
        assert lp_float[kb[i]].logprob - lp_float[ka[i]].logprob < NEAR_TIE, (p, i, lp_float)
    assert parted <= 1, f"{parted} of {len(PROMPTS)} prompts parted from the float folder's greedy tokens"


@pytest.mark.timeout(600)
def test_dense_cpu_in_bfloat16_matches_none() -> None:
    """The default model in bfloat16: ``dense_cpu`` (picked by ``auto``; decode steps and the LM head in the
    bfloat16 kernel) against ``none`` (oneDNN), greedy, equal up to a near-tie.  Both round each product to
    bfloat16 from float32 sums taken in another order, so a logit can move by a bfloat16 step."""
    from corerun_quant_cpu import kernels

    if kernels.bf16_best_isa() not in kernels.BF16_NATIVE:
        pytest.skip("this CPU lacks AVX512_BF16: auto keeps none")
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    mine = LLM(dtype="bfloat16", threads=1)
    try:
        assert mine.engine.runner.quantization_name == "dense_cpu"
        assert mine.engine.runner.model.lm_head.quantized is not None
        got = mine.generate(PROMPTS, params, use_tqdm=False)
    finally:
        mine.shutdown()
    want = LLM(dtype="bfloat16", threads=1, quantization="none").generate(PROMPTS, params, use_tqdm=False)
    parted = 0
    for p, a, b in zip(PROMPTS, got, want):
        ka, kb = a.outputs[0].token_ids, b.outputs[0].token_ids
        if ka == kb:  # 16 tokens, or fewer up to the same end of sequence
            continue
        parted += 1
        i = next(j for j, (x, y) in enumerate(zip(ka, kb)) if x != y)  # an end of sequence is a token: they part before it
        lp_mine, lp_none = a.outputs[0].logprobs[i], b.outputs[0].logprobs[i]
        assert {ka[i], kb[i]} <= set(lp_mine) & set(lp_none), (p, i, lp_mine, lp_none)
        assert lp_none[kb[i]].logprob - lp_none[ka[i]].logprob < NEAR_TIE, (p, i, lp_none)
    assert parted <= 1, f"{parted} of {len(PROMPTS)} prompts parted from none's greedy tokens"


@pytest.mark.timeout(600)
def test_dense_cpu_in_float32_matches_none_and_takes_every_thread() -> None:
    """The default model in float32: ``dense_cpu`` (picked by ``auto``; decode steps and the LM head in the float32
    kernel, on every thread from one token) against ``none`` (oneDNN and MKL): both sum in float32, in other
    orders, so the greedy tokens are equal and each step's top log-probabilities agree to float32 noise."""
    from corerun_quant_cpu import kernels

    if kernels.bf16_best_isa() not in kernels.BF16_NATIVE or kernels.f32_best_isa() != "avx512":
        pytest.skip("this CPU lacks AVX512_BF16 or AVX-512: the probe refuses dense_cpu, auto keeps none")
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    mine = LLM(dtype="float32", threads="auto")
    try:
        runner = mine.engine.runner
        assert runner.quantization_name == "dense_cpu" and runner.model.lm_head.quantized is not None
        assert runner.parallel_tokens == 1  # threads: auto runs a one-token step on every thread
        got = mine.generate(PROMPTS, params, use_tqdm=False)
    finally:
        mine.shutdown()
    want = LLM(dtype="float32", threads=1, quantization="none").generate(PROMPTS, params, use_tqdm=False)
    for p, a, b in zip(PROMPTS, got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, p
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for token, lp in lb.items():
                assert abs(la[token].logprob - lp.logprob) < 1e-3, (p, token, la[token], lp)
