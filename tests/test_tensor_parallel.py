"""Tensor parallelism through the whole engine: real worker processes, gloo collectives, CPU.

Greedy output of 2 and 4 ranks equals Hugging Face transformers token for token (and the logprobs
equal a single process's); a worker that is killed or fails ends the requests with an error naming
its rank and leaves no process behind; a group launched torchrun-style (env://) works through
``python -m corerun.executor.worker``; workers die with their parent.

Most cases start workers from a forkserver (``distributed.start_method``), which imports torch
once for all of them; the parent-death case uses the default, spawn.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref
from pathlib import Path
from types import MappingProxyType

import pytest
import torch
import torch.distributed as dist

from corerun import LLM, SamplingParams
from corerun.conformance.executor_suite import gone as _gone
from corerun.distributed.errors import TensorParallelError
from corerun.errors import ConfigError
from tests.helpers.tiny_models import make_tiny_model
from tests.helpers.engine_testing import hf_greedy
from tests.helpers.launched import launched_ranks

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 10
BASE = dict(
    device="cpu", dtype="float32", attention="torch",
    kv_cache={"block_size": 4, "num_blocks": 48},
    scheduler={"max_model_len": 128, "max_num_batched_tokens": 16, "max_num_seqs": 4},  # chunked prefill, mixed steps
)
FAST = {"distributed": {"start_method": "forkserver"}}
NGRAM = {"method": "ngram", "num_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    rnd = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    shared = rnd(9)
    return [rnd(1), rnd(5), shared + rnd(3), shared + rnd(6), rnd(23)]  # a shared prefix: prefix-cache hits


def _params(n: int) -> list[SamplingParams]:
    sp = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2) for _ in range(n)]
    sp[-1] = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    return sp


class Case:
    """A tiny model, its prompts, HF's greedy tokens and a single process's outputs."""

    def __init__(self, folder: Path, vocab: int) -> None:
        self.folder, self.prompts = folder, _prompts(vocab)
        self.hf = hf_greedy(folder, self.prompts, MAX_TOKENS)
        single = LLM(model=folder, **BASE)
        self.single = single.generate(self.prompts, _params(len(self.prompts)), use_tqdm=False)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("tp")
    return {
        # 4 query heads / 2 KV heads; vocab 254 leaves the last rank's range short at 4 ranks
        "llama": Case(make_tiny_model(root, "llama", vocab_size=254), 254),
        "qwen2": Case(make_tiny_model(root, "qwen2", tie_word_embeddings=True), 256),  # q/k/v bias, tied head
        "qwen3": Case(make_tiny_model(root, "qwen3"), 256),  # q/k norm, head_dim 32
    }


def _tp_llm(case: Case, n: int, **extra) -> LLM:
    return LLM(model=case.folder, tensor_parallel_size=n, **{**BASE, **FAST, **extra})


def _check_matches(llm: LLM, case: Case) -> None:
    outs = llm.generate(case.prompts, _params(len(case.prompts)), use_tqdm=False)
    assert [o.outputs[0].error for o in outs] == [None] * len(outs)
    assert [o.outputs[0].token_ids for o in outs] == case.hf
    for got, ref in zip(outs, case.single):  # the same numbers as one process (sums in another order)
        for g, r in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert g.keys() == r.keys()
            assert all(abs(g[t].logprob - r[t].logprob) < 1e-4 for t in g)
    got_p, ref_p = outs[-1].prompt_logprobs, case.single[-1].prompt_logprobs
    assert len(got_p) == len(ref_p) == len(case.prompts[-1])
    assert all(abs(g[t].logprob - r[t].logprob) < 1e-4 for g, r in zip(got_p[1:], ref_p[1:]) for t in r)
    assert llm.engine.kv.num_free_blocks == llm.engine.runner.num_blocks  # nothing leaked


def _wait_gone(pids: list[int], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not all(_gone(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _tp_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("corerun-tp-")]


# ---------------------------------------------------------------------- output
@pytest.mark.parametrize(
    "arch,n",
    [
        pytest.param("llama", 2, id="llama-tp2"),
        pytest.param("qwen2", 2, id="qwen2-tp2"),
    ],
)
def test_greedy_output_equals_hf_and_one_process(cases, arch, n):
    llm = _tp_llm(cases[arch], n)
    pids = llm.engine.runner.worker_pids
    assert len(pids) == n - 1
    try:
        _check_matches(llm, cases[arch])
    finally:
        llm.engine.shutdown()
    assert not os.path.exists(f"/proc/{pids[0]}") and not _tp_children()
    llm.engine.shutdown()  # twice is harmless


@pytest.mark.parametrize("speculative", [None, NGRAM], ids=["plain", "ngram-drafts"])
def test_every_rank_holds_the_same_persistent_batch_through_preemption_and_prefix_hits(cases, speculative):
    """Each rank applies the scheduler's message to its own persistent batch: after every step the workers'
    batches equal rank 0's row for row (tokens, computed counts, block tables), rank 0's holds what the
    scheduler and the KV-cache manager hold, and the output stays HF's greedy tokens.  With n-gram drafts
    the workers write each step's drafts and take the accepted ones from what rank 0 recorded."""
    case = cases["llama"]
    extra = {} if speculative is None else {"speculative": speculative}
    llm = _tp_llm(case, 2, kv_cache={"block_size": 4, "num_blocks": 14}, **extra)  # too few for every request at once
    engine, runner = llm.engine, llm.engine.runner
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        order = [engine.add_request(p, params) for p in case.prompts]
        done: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for seq in engine.step():
                if seq.is_finished:
                    done[seq.request_id] = seq.token_ids[seq.num_prompt_tokens:]
            steps += 1
            rank0, *others = runner.batch_snapshots()
            assert all(o == rank0 for o in others), f"step {steps}: the ranks' persistent batches differ"
            for seq in engine.scheduler.running:
                row = rank0[seq.seq_id]
                assert list(row[1]) == list(seq.token_ids), f"step {steps}: request {seq.seq_id}'s tokens"
                assert list(row[4]) == engine.kv.block_table(seq.seq_id), f"step {steps}: request {seq.seq_id}'s blocks"
        assert engine.scheduler.num_preemptions > 0 and engine.kv.stats().prefix_hits > 0
        assert [done[r] for r in order] == case.hf
        if speculative is not None:
            assert engine.spec_stats.num_accepted_tokens > 0, engine.spec_stats.to_dict()
    finally:
        llm.engine.shutdown()


def test_the_message_pickles_whole_with_its_drafts():
    """Rank 0 sends the ScheduledBatch as it is; its read-only drafts mapping survives the trip."""
    import pickle

    from corerun.core.batch import BlockIds, NewRequest, NewTokens, ScheduledBatch

    batch = ScheduledBatch(
        req_ids=(7, 3), num_scheduled=(3, 5), num_decodes=1,
        new_reqs=(NewRequest(3, (1, 2, 3, 4, 5), (), SamplingParams(max_tokens=4), (9, 2), 0),), num_computed=(10, 0),
        new_tokens=MappingProxyType({7: NewTokens(10, (42,), 11)}), block_changes=MappingProxyType({7: BlockIds(2, (5,))}),
        drafts=MappingProxyType({7: (8, 9)}), finished_ids=frozenset({1}), preempted_ids=frozenset({2}),
    )
    got = pickle.loads(pickle.dumps(batch))
    assert got == batch and dict(got.drafts) == {7: (8, 9)} and dict(got.block_changes) == {7: (2, (5,))}
    with pytest.raises(TypeError):
        got.drafts[7] = ()  # still read-only


def test_four_ranks_share_two_kv_heads_and_a_killed_worker_is_named(cases):
    """4 ranks, 2 KV heads: each KV head lives on two ranks.  Then rank 3 is killed mid-run: the user sees
    rank 3 named (not ranks 1 and 2, whose collectives break because of it), and no process is left."""
    case = cases["llama"]
    llm = _tp_llm(case, 4)
    pids = llm.engine.runner.worker_pids
    try:
        _check_matches(llm, case)
        stream = llm.stream(case.prompts, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        first = next(stream)
        os.kill(pids[2], signal.SIGKILL)
        finals = [o for o in [first, *stream] if o.finished]
        assert len(finals) == len(case.prompts)
        for o in finals:
            assert o.outputs[0].finish_reason == "error"
            assert "tensor-parallel rank 3 failed: its process was killed by signal SIGKILL" in o.outputs[0].error
        assert all(not os.path.exists(f"/proc/{pid}") for pid in pids)  # every worker reaped, none a zombie
        assert not _tp_children()
        again = llm.generate(case.prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
        assert "the tensor-parallel group is down" in again[0].outputs[0].error
        assert "tensor-parallel rank 3 failed" in again[0].outputs[0].error
    finally:
        llm.engine.shutdown()


def test_a_worker_error_reaches_the_user_with_its_rank(cases):
    case = cases["qwen3"]
    llm = _tp_llm(case, 2)
    (pid,) = llm.engine.runner.worker_pids
    try:
        _check_matches(llm, case)
        llm.engine.runner.workers.send("not a command")  # the worker raises on it and reports why
        outs = llm.generate(case.prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        for o in outs:
            assert o.outputs[0].finish_reason == "error"
            assert o.outputs[0].error.startswith(
                "tensor-parallel rank 1 failed: reading rank 0's commands: TensorParallelError: unknown command 'not a command'"
            )
    finally:
        llm.engine.shutdown()
    assert _wait_gone([pid]) and not _tp_children()


def test_the_rank_that_failed_first_is_blamed():
    from corerun.distributed.errors import CommunicationError, Failure, is_communication_failure, root_cause

    broken = [Failure(1, "all_reduce failed", primary=False, at=10.0), Failure(2, "all_reduce failed", primary=False, at=9.0)]
    assert root_cause(broken, settled=False) is None  # wait: the rank that caused it may still show
    assert root_cause(broken, settled=True).rank == 2
    own = Failure(3, "ValueError: bad", primary=True, at=11.0)
    assert root_cause(broken + [own], settled=False) is own
    killed = Failure(2, "its process was killed by signal SIGKILL", primary=True)
    assert root_cause([broken[0], own, killed], settled=False) is killed
    try:
        try:
            raise CommunicationError("gather failed")
        except CommunicationError as exc:
            raise RuntimeError("model forward failed") from exc
    except RuntimeError as wrapped:
        assert is_communication_failure(wrapped)
    assert not is_communication_failure(ValueError("bad"))


# ---------------------------------------------------------------------- teardown
@pytest.mark.parametrize("how", ["del", "shutdown"])
def test_teardown_frees_the_kv_cache_and_graph_runner_at_once_and_stops_the_workers(cases, how):
    """Reference counting alone frees rank 0's KV cache, graph runner and runner (no cycle through the
    seams or the graph runner), stops the workers and leaves the process group, so a new group can start."""
    llm = _tp_llm(cases["llama"], 2)
    outs = llm.generate(cases["llama"].prompts[:2], _params(2), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == cases["llama"].hf[:2]
    runner = llm.engine.runner
    pids = runner.worker_pids
    memory = [weakref.ref(runner.graph)] + [weakref.ref(t) for t in runner.kv_caches]
    assert len(memory) == 1 + runner.model_config.num_layers
    owners = [weakref.ref(runner), weakref.ref(llm.engine)]
    del runner, outs
    gc.disable()  # freed by reference counting alone, not by a later collection
    try:
        if how == "shutdown":
            llm.shutdown()
            alive = [type(r()).__name__ for r in memory if r() is not None]
            assert not alive, f"still alive after shutdown(): {alive}"
            assert not dist.is_initialized()
        del llm
        alive = [type(r()).__name__ for r in memory + owners if r() is not None]
        assert not alive, f"still alive after {how}: {alive}"
    finally:
        gc.enable()
    assert not dist.is_initialized()
    assert _wait_gone(pids, timeout=10.0), f"workers {pids} outlived the engine"
    assert not _tp_children()


# ---------------------------------------------------------------------- startup
def test_sizes_the_model_cannot_take_are_refused_before_any_process_starts(cases):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 3 cannot split this model.*Sizes that work for it: 1, 2, 4"):
        _tp_llm(cases["llama"], 3)
    with pytest.raises(ConfigError, match="nccl.*CUDA devices only"):
        _tp_llm(cases["llama"], 2, distributed={"backend": "nccl"})
    assert not _tp_children()


def test_a_worker_lost_while_the_ranks_agree_on_the_kv_cache_is_named(cases, monkeypatch):
    """Rank 1 dies just as rank 0 enters the block-count agreement (the first collective of ModelRunner's
    construction): the error names rank 1 and how it ended, not the broken all-reduce, and no process is left."""
    from corerun.distributed.group import TensorParallelGroup

    agree = TensorParallelGroup.min_int

    def kill_rank_1_first(self, value):
        (worker,) = [p for p in _tp_children() if p.name == "corerun-tp-rank-1"]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        return agree(self, value)

    monkeypatch.setattr(TensorParallelGroup, "min_int", kill_rank_1_first)  # this process (rank 0) only
    with pytest.raises(TensorParallelError, match="tensor-parallel rank 1 failed while starting: its process was killed by signal SIGKILL"):
        _tp_llm(cases["llama"], 2)
    assert not _tp_children() and not dist.is_initialized()


def test_a_failed_start_stops_the_workers(cases):
    with pytest.raises(Exception, match="no-such-backend"):
        _tp_llm(cases["llama"], 2, attention="no-such-backend")
    assert not _tp_children()


# ---------------------------------------------------------------------- launched ranks
def test_ranks_launched_with_env_rendezvous(cases, tmp_path, monkeypatch):
    """As under torchrun: this process is rank 0; rank 1 is ``python -m corerun.executor.worker`` with RANK=1."""
    case = cases["llama"]
    with launched_ranks({"model": str(case.folder), "tensor_parallel_size": 2, **BASE}, tmp_path, monkeypatch) as config:
        llm = LLM(config=config)
        try:
            _check_matches(llm, case)
        finally:
            llm.engine.shutdown()


# ---------------------------------------------------------------------- parent death
def test_workers_exit_when_their_parent_is_killed(cases, tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from corerun import LLM
        if __name__ == "__main__":
            llm = LLM(model={str(cases["qwen2"].folder)!r}, tensor_parallel_size=2, **{BASE!r})
            print("workers", *llm.engine.runner.worker_pids, flush=True)
            time.sleep(600)
    """))
    parent = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        assert line.startswith("workers"), parent.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        assert pids and not any(_gone(p) for p in pids)
        parent.kill()
        parent.wait()
        assert _wait_gone(pids), f"workers {pids} outlived their parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
