"""Consecutive benchmark workers with ``attention: cpu``, each in a fresh process: does any abort?

Each worker is ``corerun bench``'s own corerun worker (``corerun/bench/peers/corerun_worker.py``) on a
small workload of the default model (4 requests, prompts of 32-96 tokens, 8-24 output tokens, a new
seed each), with ``attention: cpu``, on ``--threads`` threads; every other worker schedules asynchronously (the forward on a thread of its own, which is
where a runtime torn down under a running thread would show).  A worker *aborts* when it dies of a
signal (exit status -6 is SIGABRT) or its log holds ``terminate called``, ``Aborted``, ``core dumped``
or ``Segmentation fault``; it *fails* otherwise when it exits non-zero (a Python error) or outlives
``--timeout``.  The last lines of each such worker's log are printed.  Run it on a tree nobody edits
meanwhile (e.g. ``git archive HEAD`` unpacked, on ``PYTHONPATH``): a half-made edit fails workers.

    .venv/bin/python benchmarks/worker_abort_check.py [--workers 50] [--threads 2] [--timeout 300]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ABORT_MARKS = ("terminate called", "Aborted", "core dumped", "Segmentation fault")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2, help="each worker's threads (2: the OpenMP regions run)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one worker may take")
    args = ap.parse_args()

    from corerun.bench.compare import PeerError, WORKER_DIR, WORKERS, build_request, run_worker
    from corerun.bench.workload import make_workload
    from corerun.models.default import default_model_dir

    model_dir = default_model_dir()
    aborts, failures, started = [], [], time.perf_counter()
    print(f"{args.workers} workers, attention: cpu, threads {args.threads}, load {os.getloadavg()[0]:.1f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="corerun-abort-check-") as tmp:
        for i in range(args.workers):
            workload = make_workload(4, "32:96", "8:24", seed=i)
            overrides = {"attention": "cpu", "scheduler": {"async_scheduling": i % 2 == 1}}
            request = build_request(
                "corerun", workload, model_dir=str(model_dir), dtype="float32", threads=args.threads, temperature=0.0,
                warmup=False, max_model_len=256, vocab_size=10000, gguf=None,
                options={"config_path": None, "sets": [], "overrides": overrides},
            )
            t0 = time.perf_counter()
            try:
                run = run_worker("corerun", Path(sys.executable), request, workload, timeout_s=args.timeout,
                                 workdir=Path(tmp), worker=WORKER_DIR / WORKERS["corerun"])
                problem = None
            except PeerError as exc:
                run, problem = None, str(exc)
            log = (Path(tmp) / "corerun.log").read_text(encoding="utf-8", errors="replace")
            marks = [m for m in ABORT_MARKS if m in log]
            status = re.search(r"exit status (-?\d+)", problem or "")
            if marks or (status and int(status.group(1)) < 0):
                aborts.append(i)
            elif problem:
                failures.append(i)
            if problem or marks:
                print(f"worker {i}: {'ABORTED' if aborts[-1:] == [i] else 'FAILED'} {problem or ''} {marks}\n  "
                      + "\n  ".join(log.strip().splitlines()[-10:]), flush=True)
            else:
                backends = run.details.get("backends", {}) if run else {}
                print(f"worker {i}: ok in {time.perf_counter() - t0:.1f} s, async {i % 2 == 1}, "
                      f"attention {backends.get('attention', '?')}, load {os.getloadavg()[0]:.1f}", flush=True)
    clean = args.workers - len(aborts) - len(failures)
    print(f"{clean} of {args.workers} workers exited cleanly; aborted: {len(aborts)} {aborts or ''}, failed otherwise: "
          f"{len(failures)} {failures or ''}; {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f}")
    return 1 if aborts or failures else 0


if __name__ == "__main__":
    sys.exit(main())
