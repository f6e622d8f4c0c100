"""Speculative decoding with a draft model (``speculative.method: draft_model``).

References: Hugging Face transformers (greedy continuations; the float64 law of a sampled token), the
engine with speculation off (greedy and seeded output token for token), the KV-cache managers' free
counts (no draft state outlives its request).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from corerun import SamplingParams
from corerun.errors import ConfigError
from corerun.testing import assert_idle, make_llm
from corerun.testing.reference import hf_greedy, second_token_fit
from corerun.testing.tiny_models import make_tiny_model

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def _perturbed_copy(model_dir, dest, scale: float, seed: int):
    """``model_dir`` with every weight moved by ``scale`` of its own spread: a draft that mostly agrees."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, dest)
    g = torch.Generator().manual_seed(seed)
    weights = load_file(str(dest / "model.safetensors"))
    noisy = {k: w + scale * w.std() * torch.randn(w.shape, generator=g) for k, w in weights.items()}
    save_file(noisy, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    target = make_tiny_model(root, arch="llama")
    return {
        "target": target,
        "near": _perturbed_copy(target, root / "near", 0.3, seed=7),
        "random": make_tiny_model(root, arch="llama", seed=5, num_hidden_layers=1),
    }


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    rnd = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()  # noqa: E731
    base = rnd(6)
    return [base * 3, rnd(9), rnd(1), rnd(2 * BS + 1) * 2, rnd(30)]


def _draft(model, num_tokens=3):
    """The ``speculative`` section for drafting with ``model``."""
    return {"method": "draft_model", "model": str(model), "num_tokens": num_tokens}


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_draft_equal_to_the_target_is_always_accepted(models, prompts):
    expected = hf_greedy(models["target"], prompts, GREEDY.max_tokens)
    off = _ids(make_llm(models["target"]).generate(prompts, GREEDY, use_tqdm=False))
    llm = make_llm(models["target"], speculative=_draft(models["target"]))
    on = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert on == off == expected
    st = llm.engine.spec_stats
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens == st.num_draft_tokens, st.to_dict()
    assert st.mean_accepted_length > 3.0  # up to K + 1 = 4 tokens a step
    assert_idle(llm)


@pytest.mark.parametrize(
    "scheduler,num_blocks",
    [
        pytest.param({"max_num_batched_tokens": 4096}, 64, id="roomy"),
        pytest.param({"max_num_batched_tokens": 7, "max_num_seqs": 4}, 20, id="chunked-preempting"),
    ],
)
@pytest.mark.parametrize("draft", ["near", "random"])
def test_another_draft_keeps_greedy_output(models, prompts, draft, scheduler, num_blocks):
    kw = {"kv_cache": {"num_blocks": num_blocks}, "scheduler": scheduler}
    off = _ids(make_llm(models["target"], **kw).generate(prompts, GREEDY, use_tqdm=False))
    llm = make_llm(models["target"], speculative=_draft(models[draft], 4), **kw)
    on = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert on == off
    st = llm.engine.spec_stats
    assert st.num_draft_tokens > st.num_accepted_tokens, st.to_dict()
    if draft == "near":  # mostly agreeing: both accepted and rejected drafts, so the draft's state rolls back
        assert st.num_accepted_tokens > 0, st.to_dict()
    if num_blocks == 20:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_idle(llm)


def test_seeded_sampling_with_a_draft_model_equals_without(models, prompts):
    params = [SamplingParams(temperature=0.8, seed=11 + i, max_tokens=16, ignore_eos=True, repetition_penalty=1.1)
              for i in range(len(prompts))]
    off = _ids(make_llm(models["target"]).generate(prompts, params, use_tqdm=False))
    llm = make_llm(models["target"], speculative=_draft(models["near"]))
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == off
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def test_sampled_tokens_with_a_draft_model_follow_the_hf_law(models):
    """Unseeded sampling at T=0.7: the second token (the first one verified against a draft) has the
    marginal sum_t0 p(t0) p(t1 | t0) of transformers in float64, by chi-square.  The near draft proposes
    about the target's argmax, which T=0.7 draws far from always: an always-accepting verifier fails."""
    target = models["target"]
    prompt = (torch.randperm(253, generator=torch.Generator().manual_seed(4))[:12] + 3).tolist()
    T, N = 0.7, 2000
    llm = make_llm(target, speculative=_draft(models["near"], 2), kv_cache={"num_blocks": 8192},
                   scheduler={"max_model_len": 64, "max_num_seqs": 512})
    fit = second_token_fit(llm, target, prompt, T, N)
    assert fit.ok, fit.describe()
    st = llm.engine.spec_stats
    assert st.num_drafts > N // 2 and 0 < st.num_accepted_tokens < st.num_draft_tokens, st.to_dict()
    assert_idle(llm)


def test_aborted_and_finished_requests_leave_no_draft_state(models, prompts):
    llm = make_llm(models["target"], speculative=_draft(models["near"]))
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, GREEDY, request_id=str(i))
    for _ in range(3):
        engine.step()
    proposer = engine.proposer
    assert set(proposer.seqs) == {s.seq_id for s in engine.scheduler.running}
    held = proposer.runner.kv_manager.num_free_blocks
    engine.abort("1")
    engine.abort("3")
    assert len(proposer.seqs) == len(prompts) - 2
    assert proposer.runner.kv_manager.num_free_blocks > held
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(len(prompts)):
        engine.release(str(i))  # their outputs taken
    assert_idle(llm)


def test_config_errors_name_the_field(models, tmp_path):
    from pydantic import ValidationError

    from corerun.config import Config

    with pytest.raises(ValidationError, match=r"speculative.model is None; method 'draft_model' needs"):
        Config(speculative={"method": "draft_model"})
    with pytest.raises(ValidationError, match=r"speculative.model .* is used only with method 'draft_model'"):
        Config(speculative={"method": "ngram", "model": str(models["target"])})
    with pytest.raises(ValidationError, match="num_tokens"):
        Config(speculative={"method": "draft_model", "model": str(models["target"]), "num_tokens": 0})
    other_vocab = make_tiny_model(tmp_path, arch="llama", vocab_size=320)
    with pytest.raises(ConfigError, match=r"speculative.model .* vocabulary of 320 tokens and the model 256"):
        make_llm(models["target"], speculative=_draft(other_vocab))
    with pytest.raises(ConfigError, match=r"speculative.model .*: the draft model cannot be loaded"):
        make_llm(models["target"], speculative=_draft(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"speculative.method: 'draft_model' runs on one device only"):
        make_llm(models["target"], speculative=_draft(models["near"]), tensor_parallel_size=2)


def test_a_failing_draft_step_costs_only_that_steps_drafts(models, prompts, caplog):
    """The draft runner raising in a step: that step has no drafts, the draft state is rebuilt, the
    output is still the greedy one and shutdown releases both caches."""
    off = _ids(make_llm(models["target"]).generate(prompts, GREEDY, use_tqdm=False))
    llm = make_llm(models["target"], speculative=_draft(models["target"]))
    runner = llm.engine.proposer.runner
    execute, calls = runner.execute, []

    def flaky(batch, eos):
        calls.append(len(batch.req_ids))
        if len(calls) in (3, 4):
            raise RuntimeError("draft device lost")
        return execute(batch, eos)

    runner.execute = flaky
    with caplog.at_level("ERROR", logger="corerun.engine"):
        assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == off
    assert "draft model's step failed" in caplog.text and "draft device lost" in caplog.text
    st = llm.engine.spec_stats
    assert st.num_accepted_tokens == st.num_draft_tokens > 0
    assert_idle(llm)
    llm.engine.shutdown()
    assert runner.kv_caches == [] and runner.graph is None
