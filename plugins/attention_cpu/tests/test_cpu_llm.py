"""Through the whole engine: greedy outputs with ``attention: cpu`` equal the torch reference backend's
on a tiny model (chunked prefill, prefix-cache hits, preemption), and Hugging Face transformers' on
the real default model, token for token in float32; ``auto`` ranks the backend first on CPU."""

from __future__ import annotations

import torch

from corerun import LLM, SamplingParams
from cpu_attn_cases import needs_compiler

pytestmark = needs_compiler


def test_tiny_model_greedy_equals_torch_backend(tmp_path):
    from corerun.testing.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path, arch="llama")
    shared = list(range(30, 52))
    prompts = [[7], list(range(3, 19)), shared + [5, 6], list(range(60, 97)), shared + [9], [9, 8, 7, 6, 5] * 4]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    common = dict(model=model_dir, device="cpu", dtype="float32", kv_cache={"block_size": 4, "num_blocks": 24},
                  scheduler={"max_model_len": 64, "max_num_batched_tokens": 11, "max_num_seqs": 4})
    ref = [o.outputs[0].token_ids for o in LLM(attention="torch", **common).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(attention="cpu", **common)
    assert llm.engine.runner.attention_name == "cpu"
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == ref
    assert llm.engine.kv.stats().prefix_hits > 0


def test_default_model_greedy_equals_transformers():
    from transformers import AutoTokenizer

    from corerun.testing import default_model_dir, hf_greedy

    folder = default_model_dir(progress=False)
    tok = AutoTokenizer.from_pretrained(str(folder))
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived"]
    prompts = [tok(t).input_ids for t in texts]
    expected = hf_greedy(folder, prompts, max_tokens=16)
    llm = LLM(model=str(folder), device="cpu", dtype="float32", attention="cpu",
              kv_cache={"block_size": 16, "num_blocks": 16}, scheduler={"max_model_len": 128})
    assert llm.engine.runner.attention_name == "cpu"
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_auto_picks_it_on_cpu():
    from corerun.protocols.attention import AttentionSpec
    from corerun.sdk import get_registry

    reg = get_registry()
    cpu, ref = reg.get("attention", "cpu"), reg.get("attention", "torch")
    spec = AttentionSpec(9, 3, 64, torch.float32, 16, torch.device("cpu"))  # the default model's
    assert cpu.unavailable_reasons() == [] and cpu.capabilities.check(spec) == []
    assert cpu.priority_on("cpu") > ref.priority_on("cpu")
    assert cpu.priority_on("cuda") < ref.priority_on("cuda")
    assert reg.select_attention("auto", spec).name == "cpu"
