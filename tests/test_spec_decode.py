"""Speculative decoding (n-gram drafts): proposals, verification's law, and engine outputs equal to non-speculative.

References: closed forms (the proposer, the law of emitted tokens from fixed per-position
distributions, chi-square), Hugging Face transformers (greedy), and the engine with speculation off
(seeded sampling with penalties: the same tokens, since each verified row draws with the history and
draw index of the non-speculative step).
"""

from __future__ import annotations

import pytest
import torch

from corerun import SamplingParams
from corerun.testing.stats import chi_square_fit
from corerun.core.sequence import Sequence
from corerun.errors import ConfigError
from corerun.spec_decode import NgramProposer, accept_drafts, expand_metadata
from corerun.testing import assert_idle, make_llm
from corerun.testing.reference import hf_greedy, second_token_fit
from corerun.testing.tiny_models import make_tiny_model

BS = 4
SPEC = {"method": "ngram", "num_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


# ------------------------------------------------------------------ proposer
def test_ngram_proposes_what_followed_the_latest_match():
    p = NgramProposer(num_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3)
    # last 3 tokens (7, 8, 9) occurred at 1..3 and at 6..8: the latest one wins -> what followed it
    assert p.lookup([5, 7, 8, 9, 1, 2, 7, 8, 9, 4, 4, 7, 8, 9]) == [4, 4, 7]
    assert p.lookup([1, 2, 3, 1, 2]) == [3, 1, 2]  # the match may run into the suffix itself
    assert p.lookup([1, 2, 3, 1, 2], max_tokens=2) == [3, 1]
    assert p.lookup([1, 2, 3, 4]) == []  # no earlier occurrence of any suffix
    assert p.lookup([9, 9]) == [9]  # one token follows the match
    assert p.lookup([1]) == []
    longest_first = NgramProposer(num_tokens=2, prompt_lookup_min=1, prompt_lookup_max=2)
    # suffix (3, 5) matches at 0; suffix (5) alone would match later, at 4
    assert longest_first.lookup([3, 5, 6, 0, 5, 1, 3, 5]) == [6, 0]


def test_ngram_rejects_bad_ranges():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 3, 2)
    from pydantic import ValidationError

    from corerun.config import Config

    with pytest.raises(ValidationError, match=r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(2\)"):
        Config(speculative={"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2})


def test_accept_drafts_keeps_the_matching_prefix_and_the_next_target():
    targets = [4, 5, 9, 1, 7, 3, 8, 8]
    drafts = [[4, 5, 6], [], [3, 8]]
    assert accept_drafts(targets, drafts) == [[4, 5, 9], [7], [3, 8, 8]]
    with pytest.raises(ValueError):
        accept_drafts(targets[:-1], drafts)


# -------------------------------------------------- verification's law
def _fake_seq(seq_id: int, params: SamplingParams) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), prompt_token_ids=[1, 2], params=params)


@pytest.mark.parametrize("sampler", ["basic", "full"])
def test_verified_tokens_follow_the_non_speculative_law(sampler):
    """Positions with fixed distributions p_0, p_1, p_2 and drafts (d_0, d_1): the emitted sequence is
    (x != d_0) w.p. p_0(x); (d_0, x != d_1) w.p. p_0(d_0) p_1(x); (d_0, d_1, x) w.p. p_0(d_0) p_1(d_1) p_2(x)."""
    from corerun.plugin.registry import get_registry

    V, N = 6, 12000
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, V, generator=g, dtype=torch.float64)
    p = torch.softmax(logits, dim=-1)
    d = [int(p[0].argmax()), int(p[1].argmax())]
    probs = torch.cat([
        p[0] * (torch.arange(V) != d[0]),
        p[0, d[0]] * p[1] * (torch.arange(V) != d[1]),
        p[0, d[0]] * p[1, d[1]] * p[2],
    ])
    smp = get_registry().create("sampler", sampler, V, torch.device("cpu"))
    params = SamplingParams(temperature=1.0)
    seqs = [_fake_seq(i, params) for i in range(N)]
    drafts = [d] * N
    meta = expand_metadata(seqs, drafts, frozenset())
    targets = smp.sample(logits.float().repeat(N, 1), meta).sampled_token_ids.tolist()
    counts = torch.zeros(3 * V)
    for e in accept_drafts(targets, drafts):
        counts[V * (len(e) - 1) + e[-1]] += 1
    fit = chi_square_fit(counts, probs)
    assert fit.ok, fit.describe()
    assert counts[V + d[1]] == 0 and counts[d[0]] == 0  # a rejected position never emits its draft


# ------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("spec"), arch="llama")
    g = torch.Generator().manual_seed(3)
    rnd = lambda n: torch.randint(3, 256, (n,), generator=g).tolist()  # noqa: E731
    base = rnd(6)
    prompts = [base * 3, rnd(9), base * 2 + rnd(2), rnd(1), rnd(2 * BS + 1) * 2]
    return d, prompts, hf_greedy(d, prompts, 20)


@pytest.mark.parametrize(
    "scheduler,num_blocks",
    [
        pytest.param({"max_num_batched_tokens": 4096}, 64, id="roomy"),
        pytest.param({"max_num_batched_tokens": 7, "max_num_seqs": 4}, 20, id="chunked-preempting"),
    ],
)
def test_greedy_with_drafts_equals_hf(tiny, scheduler, num_blocks):
    model_dir, prompts, expected = tiny
    max_tokens = 20
    llm = make_llm(model_dir, speculative=SPEC, kv_cache={"num_blocks": num_blocks}, scheduler=scheduler)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.mean_accepted_length > 1.0, stats.to_dict()
    assert_idle(llm)  # nothing kept for rejected drafts after the requests end
    if num_blocks == 20:
        assert llm.engine.scheduler.num_preemptions > 0


def test_seeded_penalised_sampling_with_drafts_equals_without(tiny):
    model_dir, prompts, _ = tiny
    params = [
        SamplingParams(temperature=0.7, seed=11 + i, max_tokens=18, ignore_eos=True,
                       repetition_penalty=1.05, frequency_penalty=0.1, presence_penalty=0.05, min_tokens=3)
        for i in range(len(prompts))
    ] + [SamplingParams(temperature=0, max_tokens=18, ignore_eos=True, presence_penalty=0.5)]
    prompts = prompts + [prompts[0]]
    off = [o.outputs[0].token_ids for o in make_llm(model_dir).generate(prompts, params)]
    llm = make_llm(model_dir, speculative=SPEC)
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert on == off
    assert llm.engine.spec_stats.num_draft_tokens > 0


def test_accepted_tokens_stop_at_max_tokens_and_stop_tokens(tiny):
    model_dir, prompts, _ = tiny
    llm_off, llm_on = make_llm(model_dir), make_llm(model_dir, speculative=SPEC)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm_off.generate(prompts, greedy)
    for max_tokens in (2, 5, 7):
        outs = llm_on.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        for o, ref in zip(outs, full):
            assert o.outputs[0].token_ids == ref.outputs[0].token_ids[:max_tokens]
            assert o.outputs[0].finish_reason == "length"
    # a stop token that comes up mid-way (inside a run of accepted drafts where the output repeats)
    for o_ref, prompt in zip(full, prompts):
        ids = o_ref.outputs[0].token_ids
        stop = ids[len(ids) // 2]
        cut = ids.index(stop) + 1
        o = llm_on.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                     stop_token_ids=[stop]))[0]
        assert o.outputs[0].token_ids == ids[:cut]
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason == stop


def test_a_sampler_that_cannot_verify_drafts_is_refused(tiny, monkeypatch):
    from corerun.plugin.capabilities import SamplerCapabilities
    from corerun_sampler_basic.sampler import BasicSampler

    monkeypatch.setattr(BasicSampler, "capabilities", SamplerCapabilities(params=frozenset({"temperature", "seed"})))
    with pytest.raises(ConfigError, match="draft_verification"):
        make_llm(tiny[0], speculative=SPEC, sampler="basic")


def test_stop_strings_inside_accepted_runs(tmp_path):
    from tests.helpers.tiny_tokenizer import add_tiny_tokenizer

    model_dir = make_tiny_model(tmp_path, arch="llama", seed=5)
    add_tiny_tokenizer(model_dir)
    off, on = make_llm(model_dir), make_llm(model_dir, speculative=SPEC)
    g = torch.Generator().manual_seed(9)
    base = torch.randint(3, 256, (5,), generator=g).tolist()
    prompts = [base * 4, torch.randint(3, 256, (7,), generator=g).tolist() * 2]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    checked = 0
    for prompt, ref in zip(prompts, off.generate(prompts, greedy)):
        text = ref.outputs[0].text
        if len(text) < 12:
            continue
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
        want, got = off.generate([prompt], p)[0].outputs[0], on.generate([prompt], p)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text, want.token_ids, want.finish_reason, want.stop_reason)
        assert got.finish_reason == "stop" and stop not in got.text
        checked += 1
    assert checked and on.engine.spec_stats.num_accepted_tokens > 0


def test_paged_trim_frees_the_tail_but_never_a_registered_block():
    from corerun.kv_cache.paged import PagedKVCacheManager

    kv = PagedKVCacheManager(8, 4)
    assert kv.allocate_slots(0, 13) is not None  # 4 blocks
    kv.cache_blocks(0, list(range(13)), 8)  # blocks 0, 1 registered
    kv.trim(0, 9)
    assert len(kv.block_table(0)) == 3 and kv.num_free_blocks == 5
    kv.trim(0, 1)  # would keep 1 block, but 2 are registered
    assert len(kv.block_table(0)) == 2 and kv.num_free_blocks == 6
    kv.trim(7, 1)  # unknown id: nothing
    kept = kv.block_table(0)
    grown = kv.allocate_slots(0, 16)  # after a trim: the entries from the kept length on, not only the block taken
    assert grown is not None and len(grown) == 2 and kv.block_table(0) == kept + grown


def test_paged_allocate_after_trim_returns_the_table_from_the_kept_length():
    from corerun.kv_cache.paged import PagedKVCacheManager

    kv = PagedKVCacheManager(8, 4)
    first = kv.allocate_slots(0, 8)
    assert first is not None and len(first) == 2
    assert kv.allocate_slots(0, 13) is not None  # a draft's block: 3 blocks
    assert kv.trim(0, 4) == 1  # drafts rejected, nothing registered: back to 1 block
    again = kv.allocate_slots(0, 8)  # the kept block, then one new: the runner's row from index 1 on
    assert again is not None and len(again) == 1 and kv.block_table(0) == [first[0], again[0]]
    assert kv.allocate_slots(0, 8) == []  # nothing gained: an empty list, which is success


def test_rejected_draft_blocks_are_given_back_each_step(tiny):
    model_dir, prompts, expected = tiny
    llm = make_llm(model_dir, speculative=SPEC)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), request_id=str(i))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            if seq.num_tokens - seq.num_computed_tokens == 1:  # decoding: holds no more than its tokens need
                held = len(engine.kv.block_table(seq.seq_id))
                assert -(-seq.num_computed_tokens // BS) <= held <= -(-seq.num_tokens // BS)
                checked += 1
    assert checked and engine.spec_stats.num_draft_tokens > engine.spec_stats.num_accepted_tokens > 0
    assert [engine.requests[str(i)].output_token_ids for i in range(len(prompts))] == expected


def test_engine_sampled_tokens_with_drafts_follow_the_hf_law(tmp_path):
    """Unseeded sampling at T=0.7 through the engine with drafts: the second token's marginal
    sum_t0 p(t0) p(t1 | t0), from transformers in float64, fits by chi-square.  The prompt holds 96
    distinct tokens, so about a third of the samples verify a draft for that token (an always-accepting
    verifier is rejected with p ~ 0 here)."""
    model_dir = make_tiny_model(tmp_path, arch="llama")
    g = torch.Generator().manual_seed(3)
    prompt = (torch.randperm(253, generator=g)[:96] + 3).tolist()
    T, N = 0.7, 3000
    spec = {"method": "ngram", "num_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = make_llm(model_dir, kv_cache={"num_blocks": 4096}, scheduler={"max_num_seqs": 512}, speculative=spec)
    fit = second_token_fit(llm, model_dir, prompt, T, N)
    assert fit.ok, fit.describe()
    assert llm.engine.spec_stats.num_drafts > N // 5
