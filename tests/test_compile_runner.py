"""The ``compile`` graph runner: torch.compile of the model with attention kept out of the graph.

Its outputs are checked against Hugging Face transformers (greedy tokens, float32) and against a
float64 run of the same checkpoint (prompt logprobs), over steps that prefill, decode and mix both.
The first compile of the tiny model takes about a minute on a 2-core machine; inductor's cache
makes later runs take seconds, so both engine tests share one engine.
"""

from __future__ import annotations

import pytest
import torch

from corerun import SamplingParams
from corerun.plugin.capabilities import GraphRunnerCapabilities, Need
from corerun.errors import ConfigError
from corerun.graph.compiled import CompileGraphRunner, probe
from corerun.plugin.registry import get_registry
from corerun.testing import make_llm
from corerun.testing.tiny_models import hf_model, make_tiny_model

pytestmark = pytest.mark.skipif(bool(probe()), reason="; ".join(probe()) or "torch.compile available")

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11],
    [3, 4],
    [9, 8, 7, 6, 5, 4, 3, 2, 1, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("compile"), "llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    # chunked prefill of 16 tokens: the long prompt is split, so steps mix prefill chunks and decodes;
    # attention as chosen for the CPU (kept out of the compiled graph)
    engine = make_llm(model_dir, attention="auto", graph={"runner": "compile"}, skip_tokenizer_init=True,
                      scheduler={"max_num_batched_tokens": 16})
    yield engine
    engine.shutdown()


def test_greedy_equals_transformers(llm, model_dir) -> None:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False,
    )
    hf = hf_model(model_dir)
    for prompt, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist(), prompt
    stats = llm.engine.runner.graph.stats
    assert stats.replays > 0 and stats.eager_steps == 0
    assert stats.capture_seconds > 0  # compiled at startup, not in the first request


def test_prompt_logprobs_match_float64(llm, model_dir) -> None:
    prompt = PROMPTS[2]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ref_model = hf_model(model_dir).double()
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([prompt])).logits[0].double(), dim=-1)
    got = torch.tensor([out.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))], dtype=torch.float64)
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert ((got - want).abs() / want.abs()).max().item() < 1e-4


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['fullgraph'\]"):
        CompileGraphRunner(lambda *a: None, None, None, fullgraph=True)
    with pytest.raises(ConfigError, match=r"graph.runner.options.freeze: 'yes' is not a boolean"):
        CompileGraphRunner(lambda *a: None, None, None, freeze="yes")


def test_refuses_tensor_parallel_and_is_never_auto() -> None:
    caps = get_registry().get("graph", "compile").capabilities  # what the built-in registration declares
    assert isinstance(caps, GraphRunnerCapabilities) and caps.fits(Need("cpu")) == []
    assert any("tensor-parallel" in r for r in caps.fits(Need("cpu", tensor_parallel=True)))
    assert get_registry().select("graph", "auto", Need(torch.device("cpu")), "graph.runner").name == "eager"


def test_the_attention_operator_needs_a_compiled_step() -> None:
    q = torch.randn(1, 2, 4)
    with pytest.raises(RuntimeError, match="outside a compiled step"):
        torch.ops.corerun.attention(q, q, q, torch.randn(2, 1, 4, 2, 4))
