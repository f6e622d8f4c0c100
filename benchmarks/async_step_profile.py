"""Where a step's time goes, synchronous and asynchronous scheduling, on one workload, interleaved.

For each mode it times the engine's parts over one ``generate`` (``Scheduler.schedule``,
``ModelRunner.prepare_step``, ``execute_model``, ``sample_tokens``, ``LLMEngine.update``) and, with
asynchronous scheduling, how long the step thread sits idle between two steps (the host work it
cannot hide plus the two thread wake-ups per step).  The host share of a synchronous step bounds what
asynchronous scheduling can hide; the idle gap is what it pays.

    .venv/bin/python benchmarks/async_step_profile.py [--model DIR] [--attention NAME] [--num-seqs 32]
        [--prompt-len 12] [--max-tokens 32] [--threads 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from typing import Any


def profile(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
    """Seconds per part over one generate, the elapsed time, and (asynchronous) the step thread's idle gaps."""
    import corerun.engine.batch_queue as bq  # (the step thread runs bq._run_step)
    from corerun import SamplingParams

    e = llm.engine
    spent: dict[str, float] = defaultdict(float)
    runs: list[tuple[float, float]] = []
    undo = []

    def timed(owner: Any, name: str, key: str) -> None:
        f = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t

        setattr(owner, name, wrapper)
        undo.append((owner, name))

    for owner, name in ((e.scheduler, "schedule"), (e.runner, "prepare_step"), (e.runner, "execute_model"),
                        (e.runner, "sample_tokens"), (e, "update")):
        timed(owner, name, name)
    run_step = bq._run_step

    def noted(runner: Any, prepared: Any) -> Any:
        t = time.perf_counter()
        out = run_step(runner, prepared)
        runs.append((t, time.perf_counter()))
        return out

    bq._run_step = noted
    try:
        steps0 = e.num_steps
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        spent["elapsed"] = time.perf_counter() - t0
        spent["steps"] = e.num_steps - steps0
    finally:
        bq._run_step = run_step
        for owner, name in undo:
            delattr(owner, name)
    if len(runs) > 1:
        gaps = [b[0] - a[1] for a, b in zip(runs, runs[1:])]
        spent["idle_gap_median_ms"] = statistics.median(gaps) * 1e3
    return dict(spent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder [the built-in default model]")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import random

    from corerun import LLM, SamplingParams

    llm = LLM(model=args.model, attention=args.attention, threads=args.threads, scheduler={"async_scheduling": True},
              graph={"runner": {"name": "eager"}})  # eager: the profile wraps Python calls a replayed step never makes
    rng = random.Random(0)
    vocab = llm.engine.runner.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_seqs)]
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up, both paths
    print(f"{args.num_seqs} requests x {args.prompt_len} prompt tokens x {args.max_tokens} output tokens, "
          f"threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
    print("mode   round  elapsed s  steps  schedule ms  prepare ms  forward ms  sample ms  update ms  host share  idle gap ms")
    for r in range(args.rounds):
        for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
            llm.engine.set_async_scheduling(mode == "async")
            p = profile(llm, prompts, args.max_tokens)
            host = p["schedule"] + p["prepare_step"] + p["update"]
            share = host / (host + p["execute_model"] + p["sample_tokens"])
            gap = p.get("idle_gap_median_ms")
            print(f"{mode:6} {r + 1:5}  {p['elapsed']:9.2f}  {int(p['steps']):5}  {p['schedule'] * 1e3:11.1f}  "
                  f"{p['prepare_step'] * 1e3:10.1f}  {p['execute_model'] * 1e3:10.1f}  {p['sample_tokens'] * 1e3:9.1f}  "
                  f"{p['update'] * 1e3:9.1f}  {share:10.2%}  {'-' if gap is None else f'{gap:.2f}':>11}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
