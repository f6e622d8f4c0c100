"""The ``ray`` executor on a local Ray cluster: ranks as Ray actors in a placement group, gloo on CPU.

Greedy outputs of TP=2 and PP=2 through Ray equal the single-process run's token for token, with
prefix-cache hits, chunked prefill and preemption in the mix; the executor conformance suite's lost-rank
and leak checks pass (its greedy check is the comparison here).  Skipped when ``ray`` is not installed
(``pip install 'corerun[ray]'``).  One local cluster serves the module: the executor attaches to it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

ray = pytest.importorskip("ray")

from corerun import LLM, SamplingParams  # noqa: E402
from tests.helpers.tiny_models import make_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 12
BASE = dict(
    device="cpu", dtype="float32", attention="torch", seed=0,
    kv_cache={"block_size": 4, "num_blocks": 20},  # too few for every request at once: preemption
    scheduler={"max_model_len": 64, "max_num_batched_tokens": 16, "max_num_seqs": 4},  # chunked prefill
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    # The cluster's processes inherit this environment: the ranks import this checkout's corerun.  (Set here,
    # not as a job runtime_env, which sends every worker's start through Ray's runtime-env agent: this file
    # took 71 s with it, 46 s without, at load 6.)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("ray"), "llama", num_hidden_layers=4, vocab_size=254)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    rnd = lambda n: torch.randint(3, 254, (n,), generator=g).tolist()  # noqa: E731
    shared = rnd(10)
    return [shared + rnd(3), rnd(21), shared + rnd(7), rnd(2), shared + rnd(1)]  # a shared prefix: cache hits


def _run(model: Path, **parallel: Any) -> tuple[list[list[int]], Any]:
    llm = LLM(model=model, **BASE, **parallel)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
        sched, kv = llm.engine.scheduler, llm.engine.kv.stats()
        return [o.outputs[0].token_ids for o in outs], (sched.num_preemptions, kv.prefix_hits)
    finally:
        llm.shutdown()


@pytest.mark.timeout(900)
def test_tp2_and_pp2_through_ray_equal_one_process(cluster: None, model: Path) -> None:
    want, (preempted, hits) = _run(model)
    assert preempted > 0 and hits > 0  # the mix the ranks must follow
    for parallel in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        got, _ = _run(model, distributed={"executor": "ray", "timeout_s": 60, "start_timeout_s": 600}, **parallel)
        assert got == want, parallel


@pytest.mark.timeout(900)
def test_ray_passes_the_executor_suite(cluster: None) -> None:
    from corerun.conformance.runner import run

    results = run("executor", "ray", keyword="lost_rank or no_leaks")
    assert results and all(r.outcome == "passed" for r in results), [(r.id, r.outcome, r.reason) for r in results]
