"""Pipeline parallelism through the whole engine: real stage processes (local executor), gloo, CPU.

A 4-layer tiny Llama split into 2 stages, 3 uneven stages, and 2 stages of 2 tensor-parallel ranks
each gives Hugging Face transformers' greedy tokens (and a single process's logprobs), with prefix
caching, chunked prefill and preemption in the mix; every rank's persistent batch equals rank 0's
after every step; a killed last stage is named and no process is left.  Placements that cannot work
are refused before any process starts.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from corerun import LLM, SamplingParams
from corerun.errors import ConfigError, PluginUnavailableError
from corerun.testing.reference import hf_greedy
from tests.helpers.launched import launched_ranks
from tests.helpers.tiny_models import make_tiny_model

MAX_TOKENS = 10
LAYERS = 4
BASE = dict(
    device="cpu", dtype="float32", attention="torch",
    kv_cache={"block_size": 4, "num_blocks": 14},  # too few blocks for every request at once: preemption
    scheduler={"max_model_len": 128, "max_num_batched_tokens": 16, "max_num_seqs": 4},  # chunked prefill
)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    rnd = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    shared = rnd(9)
    return [rnd(1), rnd(5), shared + rnd(3), shared + rnd(6), rnd(23)]  # a shared prefix: prefix-cache hits


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2) for _ in range(n)]


class Case:
    def __init__(self, folder, vocab: int) -> None:
        self.folder, self.prompts = folder, _prompts(vocab)
        self.hf = hf_greedy(folder, self.prompts, MAX_TOKENS)
        single = LLM(model=folder, **BASE)
        try:
            self.single = single.generate(self.prompts, _params(len(self.prompts)), use_tqdm=False)
        finally:
            single.engine.shutdown()


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    folder = make_tiny_model(tmp_path_factory.mktemp("pp"), "llama", num_hidden_layers=LAYERS, vocab_size=254)
    return Case(folder, 254)


def _pp_llm(case: Case, pp: int, tp: int = 1, **distributed) -> LLM:
    return LLM(model=case.folder, pipeline_parallel_size=pp, tensor_parallel_size=tp,
               distributed={"start_method": "forkserver", **distributed}, **BASE)


def _children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("corerun-tp-")]


def _run_checking_batches(llm: LLM, case: Case) -> list[list[int]]:
    """Step the engine by hand; after every step every rank's persistent batch equals rank 0's (the last stage's
    once no micro-batch is in flight: it has sampled what rank 0 has not collected yet), and rank 0's holds the
    scheduler's tokens and the KV-cache manager's block tables.  Micro-batches of different requests overlap."""
    engine, runner = llm.engine, llm.engine.runner
    order = [engine.add_request(p, sp) for p, sp in zip(case.prompts, _params(len(case.prompts)))]
    done: dict[str, list] = {}
    steps = deepest = 0
    last = set(runner.placement.ranks_of_stage(runner.placement.pipeline_parallel_size - 1))
    while engine.has_unfinished_requests():
        for seq in engine.step():
            if seq.is_finished:
                done[seq.request_id] = seq
        steps += 1
        deepest = max(deepest, len(engine.stages) + 1)  # (+ the one just collected)
        in_flight = {sid for b in engine.stages for sid in b.req_ids}
        assert len(in_flight) == sum(len(b.req_ids) for b in engine.stages), "a request in two micro-batches at once"
        rank0, *others = runner.batch_snapshots()
        assert len(others) == runner.placement.world_size - 1
        for rank, snap in enumerate(others, start=1):
            if rank not in last or not engine.stages:
                assert snap == rank0, f"step {steps}: rank {rank}'s persistent batch differs from rank 0's"
        for seq in engine.scheduler.running:
            assert list(rank0[seq.seq_id][1]) == list(seq.token_ids), f"step {steps}: request {seq.seq_id}'s tokens"
            assert list(rank0[seq.seq_id][4]) == engine.kv.block_table(seq.seq_id), f"step {steps}: blocks"
    assert engine.scheduler.num_preemptions > 0 and engine.kv.stats().prefix_hits > 0
    assert deepest >= 2, "no two micro-batches were ever in flight at once"
    return [done[r].token_ids[done[r].num_prompt_tokens:] for r in order]


def _check_logprobs(outs, case: Case) -> None:
    for got, ref in zip(outs, case.single):  # the same numbers as one process
        for g, r in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert g.keys() == r.keys()
            assert all(abs(g[t].logprob - r[t].logprob) < 1e-4 for t in g)


# ---------------------------------------------------------------------- output
@pytest.mark.timeout(240)
def test_two_stages_equal_hf_and_a_killed_last_stage_is_named(case):
    """PP=2 (layers [0,2) and [2,4), computed): HF's greedy tokens and one process's logprobs; each stage holds
    only its layers' weights and KV caches.  Then the last stage is killed mid-run: every request ends with an error naming
    rank 1 within the timeout, later requests are refused with the same name, and no process is left."""
    llm = _pp_llm(case, 2, timeout_s=60)
    runner = llm.engine.runner
    pids = runner.worker_pids
    try:
        assert runner.placement.stage_layers == ((0, 2), (2, 4)) and len(pids) == 1
        assert [c is not None for c in runner.kv_caches] == [True, True, False, False]
        held = {n.split(".")[2] for n, _ in runner.model.named_parameters() if n.startswith("model.layers.")}
        assert held == {"0", "1"} and runner.model.lm_head is None  # stage 0 loaded its own weights only
        outs = llm.generate(case.prompts, _params(len(case.prompts)), use_tqdm=False)
        assert [o.outputs[0].error for o in outs] == [None] * len(outs)
        assert [o.outputs[0].token_ids for o in outs] == case.hf
        _check_logprobs(outs, case)
        assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.kv.stats().prefix_hits > 0
        stream = llm.stream(case.prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        first = next(stream)
        os.kill(pids[0], signal.SIGKILL)
        start = time.monotonic()
        finals = [o for o in [first, *stream] if o.finished]
        assert time.monotonic() - start < 30
        assert len(finals) == len(case.prompts)
        for o in finals:
            assert o.outputs[0].finish_reason == "error"
            assert "rank 1 failed: its process was killed by signal SIGKILL" in o.outputs[0].error
        again = llm.generate(case.prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        assert "rank 1 failed" in again[0].outputs[0].error
    finally:
        llm.engine.shutdown()
    assert not os.path.exists(f"/proc/{pids[0]}") and not _children()


@pytest.mark.timeout(300)
def test_three_uneven_stages_keep_every_rank_in_step(case):
    """PP=3 with the split stated ([1, 2, 1]): HF's greedy tokens, every rank's batch equal after every step,
    through preemption, prefix-cache hits and chunked prefill."""
    llm = _pp_llm(case, 3, pipeline_layers=[1, 2, 1])
    try:
        assert llm.engine.runner.placement.stage_layers == ((0, 1), (1, 3), (3, 4))
        assert _run_checking_batches(llm, case) == case.hf
    finally:
        llm.engine.shutdown()
    assert not _children()


@pytest.mark.timeout(300)
def test_two_stages_of_two_tensor_parallel_ranks(case):
    """TP=2 x PP=2: four ranks, each stage's heads split over its two ranks; the last stage's ranks gather the
    whole vocabulary and sample alike.  HF's greedy tokens and one process's logprobs."""
    llm = _pp_llm(case, 2, tp=2)
    try:
        assert len(llm.engine.runner.worker_pids) == 3
        outs = llm.generate(case.prompts, _params(len(case.prompts)), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == case.hf
        _check_logprobs(outs, case)
    finally:
        llm.engine.shutdown()
    assert not _children()


@pytest.mark.timeout(240)
def test_ngram_drafts_are_verified_on_the_last_stage(case):
    """n-gram speculation under PP=2: the drafts travel in the message, the last stage verifies them and the
    accepted ones reach every stage; the tokens stay HF's greedy ones."""
    g = torch.Generator().manual_seed(3)
    motif = torch.randint(3, 254, (6,), generator=g).tolist()
    prompts = [motif * 4, motif * 3 + [5], torch.randint(3, 254, (9,), generator=g).tolist()]
    want = hf_greedy(case.folder, prompts, MAX_TOKENS)
    llm = LLM(model=case.folder, pipeline_parallel_size=2, distributed={"start_method": "forkserver"},
              speculative={"method": "ngram", "num_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
              **{**BASE, "kv_cache": {"block_size": 4, "num_blocks": 64}})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.engine.spec_stats.num_accepted_tokens > 0, llm.engine.spec_stats.to_dict()
    finally:
        llm.engine.shutdown()
    assert not _children()


@pytest.mark.timeout(240)
def test_stages_launched_with_env_rendezvous(case, tmp_path, monkeypatch):
    """The launched executor: stage 1 is ``python -m corerun.executor.worker`` with RANK=1 (as under torchrun);
    commands go by broadcast and the last stage's results come back through the rendezvous store."""
    with launched_ranks({"model": str(case.folder), "pipeline_parallel_size": 2, **BASE}, tmp_path, monkeypatch) as config:
        llm = LLM(config=config)
        try:
            outs = llm.generate(case.prompts, _params(len(case.prompts)), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == case.hf
        finally:
            llm.engine.shutdown()


# ---------------------------------------------------------------------- refused placements
def test_placements_that_cannot_work_are_refused_before_any_process_starts(case):
    with pytest.raises(ConfigError, match=r"pipeline_layers \[1, 2\] must give 3 stages .* summing to the model's 4 layers"):
        _pp_llm(case, 3, pipeline_layers=[1, 2])
    with pytest.raises(ConfigError, match="pipeline_parallel_size 5 exceeds the model's 4 layers"):
        _pp_llm(case, 5)
    with pytest.raises(ConfigError, match="async_scheduling: true is not supported with pipeline_parallel_size 2"):
        LLM(model=case.folder, pipeline_parallel_size=2, **{**BASE, "scheduler": {**BASE["scheduler"], "async_scheduling": True}})
    with pytest.raises(PluginUnavailableError, match=r"at most 1 rank\(s\); tensor_parallel_size x pipeline_parallel_size is 2"):
        _pp_llm(case, 2, executor="inproc")
    assert not _children()


# ---------------------------------------------------------------------- micro-batches
def test_a_request_in_flight_is_neither_scheduled_again_nor_preempted():
    """Scheduler.busy: the next micro-batch takes only requests not in flight, and when blocks run out the
    youngest request not in flight is preempted: with both younger ones in flight, the request itself yields."""
    from corerun.core.scheduler import Scheduler
    from corerun.core.sequence import Sequence
    from corerun.kv_cache.paged import PagedKVCacheManager

    def seq(i: int, n: int) -> Sequence:
        return Sequence(seq_id=i, request_id=str(i), prompt_token_ids=list(range(10 * i, 10 * i + n)),
                        params=SamplingParams(max_tokens=8))

    sched = Scheduler(PagedKVCacheManager(6, 4), max_num_seqs=4, max_num_batched_tokens=64)
    a, b, c = seq(1, 8), seq(2, 7), seq(3, 7)
    for s in (a, b, c):
        sched.add(s)
    first = sched.schedule()  # a (2 blocks) and b (2) fit, c (2) too: 6 blocks
    assert list(first.req_ids) == [1, 2, 3]
    for s, n in zip(sched.seqs_of(first), first.num_scheduled):
        s.num_computed_tokens += n
        s.token_ids.append(5)
    tables = {2: sched.kv.block_table(2), 3: sched.kv.block_table(3)}
    sched.busy.update([2, 3])  # b and c in flight
    second = sched.schedule()  # a's decode needs a third block: b and c are younger but in flight, so a yields
    assert list(second.req_ids) == [] and list(second.preempted_ids) == [1]
    assert [s.seq_id for s in sched.running] == [2, 3] and {i: sched.kv.block_table(i) for i in (2, 3)} == tables


@pytest.mark.timeout(240)
def test_structured_outputs_on_the_last_stage(tmp_path):
    """The last stage samples through the logits processors with the engine's tokenizer (sent once): seeded
    choice-constrained requests give one process's texts, each one of the choices, ended by the grammar."""
    pytest.importorskip("xgrammar")
    from tests.helpers.serving import tiny_chat_model

    folder = tiny_chat_model(tmp_path)
    choices = ["yes", "no", "maybe later"]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, structured_outputs={"choice": choices}) for s in range(3)]
    params.append(SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))  # an unconstrained row beside them
    prompts = ["Answer:"] * 3 + ["the dog"]
    engine = dict(device="cpu", dtype="float32", attention="torch", kv_cache={"block_size": 4, "num_blocks": 64})
    one = LLM(model=folder, **engine)
    try:
        want = [o.outputs[0].text for o in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.shutdown()
    llm = LLM(model=folder, pipeline_parallel_size=2, distributed={"start_method": "forkserver"}, **engine)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].error for o in outs] == [None] * 4
    assert [o.outputs[0].text for o in outs] == want
    assert all(o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop" for o in outs[:3])
