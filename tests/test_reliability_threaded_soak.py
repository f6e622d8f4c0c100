"""Threaded soak: several callers on one ``LLM`` through a small cache, with streams and random aborts.

``THREADS`` threads each send ``REQUESTS_PER_THREAD`` greedy requests (1-12 prompt tokens from a pool
of prompts, 1-12 output tokens) through one engine whose cache holds a fraction of what they ask
for, so preemption by recompute happens throughout. Each thread mixes ``generate()`` batches,
``stream()`` batches read to the end, streams where it aborts one of its own requests midway, and
streams it closes early; meanwhile a chaos thread aborts request ids at random (running, waiting,
finished or unknown alike).

Checked: every request comes back exactly once to the caller that sent it; every request that was
not aborted finished by length with exactly its solo greedy tokens (each pool prompt run alone in a
roomy engine: greedy with EOS ignored, so a shorter request's tokens are a prefix of the longest);
an aborted request was aborted by someone and holds a prefix of its solo tokens; at the end no
request is left and every block is free.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from corerun import LLM, SamplingParams
from tests.helpers.engine_testing import deadline
from tests.helpers.tiny_models import make_tiny_model

THREADS = 4
REQUESTS_PER_THREAD = int(os.environ.get("CORERUN_THREADED_SOAK_REQUESTS", "250"))
POOL = 48
MAX_TOKENS = 12
BS = 4
NUM_BLOCKS = 24  # 96 token slots; the callers ask for up to ~30 sequences of up to 24 tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("threaded-soak"), arch="llama")


def llm_for(model_dir: Path, num_blocks: int) -> LLM:
    return LLM(model=model_dir, device="cpu", dtype="float32", attention="torch",
               kv_cache={"block_size": BS, "num_blocks": num_blocks},
               scheduler={"max_model_len": 64, "max_num_seqs": 32, "max_num_batched_tokens": 64})


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


class Caller:
    """One thread's requests: sends them, keeps every output it gets, never sees another caller's."""

    def __init__(self, k: int, llm: LLM, pool: list[list[int]], solo: list[list[int]], aborted: set[str]) -> None:
        self.rng = random.Random(1000 + k)
        self.llm, self.pool, self.solo, self.aborted = llm, pool, solo, aborted
        self.sent = 0
        self.results: list[tuple[int, int, Any]] = []  # (pool index, max_tokens, final RequestOutput)
        self.error: BaseException | None = None

    def batch(self, most: int) -> tuple[list[int], list[int]]:
        n = min(self.rng.randint(1, most), REQUESTS_PER_THREAD - self.sent)
        self.sent += n
        which = [self.rng.randrange(POOL) for _ in range(n)]
        return which, [self.rng.randint(1, MAX_TOKENS) for _ in range(n)]

    def run(self) -> None:
        try:
            while self.sent < REQUESTS_PER_THREAD:
                r = self.rng.random()
                which, lengths = self.batch(8 if r < 0.4 else 4)
                prompts, params = [self.pool[i] for i in which], [greedy(m) for m in lengths]
                if r < 0.4:
                    outs = self.llm.generate(prompts, params, use_tqdm=False)
                    self.results += zip(which, lengths, outs)
                else:
                    self.stream(which, lengths, prompts, params, mode="read" if r < 0.7 else "abort" if r < 0.9 else "close")
        except BaseException as exc:  # noqa: BLE001 (reported by the test)
            self.error = exc

    def stream(self, which: list[int], lengths: list[int], prompts: list, params: list, mode: str) -> None:
        last: dict[str, Any] = {}
        order: list[str] = []
        stop_after = self.rng.randint(1, 6)
        it = self.llm.stream(prompts, params)
        for j, out in enumerate(it):
            if out.request_id not in last:
                order.append(out.request_id)
            assert not (out.request_id in last and last[out.request_id].finished), "an output after the last one"
            last[out.request_id] = out
            if j == stop_after and mode == "abort":
                victim = self.rng.choice(order)
                self.aborted.add(victim)
                self.llm.abort(victim)
            if j == stop_after and mode == "close":
                unfinished = [rid for rid in order if not last[rid].finished]
                self.aborted.update(unfinished)  # (and those not yet seen, which the close aborts too)
                it.close()
                return
        # prompt order is how a batch's ids were given out: match outputs to what was asked
        ids = sorted(last, key=int)
        assert len(ids) == len(which), "a request of this stream never reported"
        self.results += zip(which, lengths, (last[rid] for rid in ids))


def test_threaded_soak(model_dir: Path) -> None:
    g = torch.Generator().manual_seed(9)
    pool = [torch.randint(3, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 13, (POOL,), generator=g)]
    alone = llm_for(model_dir, 64)
    solo = [alone.generate(p, greedy(MAX_TOKENS))[0].outputs[0].token_ids for p in pool]
    alone.shutdown()

    llm = llm_for(model_dir, NUM_BLOCKS)
    aborted: set[str] = set()
    callers = [Caller(k, llm, pool, solo, aborted) for k in range(THREADS)]
    done = threading.Event()

    def chaos() -> None:
        rng = random.Random(7)
        while not done.is_set():
            rid = str(rng.randrange(THREADS * REQUESTS_PER_THREAD))
            aborted.add(rid)
            llm.abort(rid)  # waiting, running, finished or not yet issued: all must be harmless
            time.sleep(0.01)  # pacing only; nothing is asserted about time

    start = time.perf_counter()
    with deadline(600):
        threads = [threading.Thread(target=c.run) for c in callers] + [threading.Thread(target=chaos)]
        for t in threads[:-1]:
            t.start()
        threads[-1].start()
        for t in threads[:-1]:
            t.join()
        done.set()
        threads[-1].join()
    elapsed = time.perf_counter() - start
    for c in callers:
        if c.error is not None:
            raise c.error

    engine = llm.engine
    assert engine.kv.num_free_blocks == engine.runner.num_blocks, "blocks leaked"
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.scheduler.num_preemptions > 0, "the cache was meant to be too small"

    seen: set[str] = set()
    completed = n_aborted = 0
    for c in callers:
        for i, max_tokens, out in c.results:
            assert out.request_id not in seen, "an output reached two callers"
            seen.add(out.request_id)
            assert out.prompt_token_ids == pool[i], "an output reached the wrong caller"
            comp = out.outputs[0]
            expected = solo[i][:max_tokens]
            if comp.finish_reason == "abort":
                assert out.request_id in aborted, f"request {out.request_id} ended as abort, but nobody aborted it"
                assert comp.token_ids == expected[: len(comp.token_ids)]
                n_aborted += 1
            else:
                assert (comp.finish_reason, comp.error) == ("length", None), comp
                assert comp.token_ids == expected, (out.request_id, i, max_tokens)
                completed += 1
    assert n_aborted > 0 and completed > THREADS * REQUESTS_PER_THREAD // 2
    print(f"threaded soak: {THREADS} x {REQUESTS_PER_THREAD} requests in {elapsed:.1f} s: {completed} complete, "
          f"{n_aborted} aborted, {engine.scheduler.num_preemptions} preemptions")
