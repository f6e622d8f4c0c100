"""The step-memory profile behind ``kv_cache.num_blocks: auto`` against what capture and serving then use.

For each attention backend this builds an ``LLM`` on a random Llama-shaped model with the ``cuda``
graph runner and an automatically sized KV cache, and reports, side by side:

- the device memory free before the engine is built (the device is clean: each backend's engine is
  built in a process of its own, so no earlier engine's memory is still held);
- the profile's figures (``runner.step_memory``: prefill, eager decode, sampling, captured decode);
- what capturing the graphs then took (``runner.graph.stats.capture_bytes``) against the captured
  decode the profile reserved for it (ratio near 1 or below: the reserve held);
- the device memory left free after serving a batch that fills ``max_num_batched_tokens``.

    python benchmarks/gpu/check_kv_profile.py --out RESULTS_DIR

Writes ``kv_profile.json`` (and each engine process its own ``kv_profile.BACKEND.json``) as it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.part_report import PartReport  # noqa: E402

MiB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--backends", default="torch,triton")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--memory-fraction", type=float, default=0.5)
    p.add_argument("--engine-timeout", type=int, default=40, help="seconds for each backend's engine process")
    p.add_argument("--dry-run", action="store_true", help="no CUDA: check the engine settings, rehearse the steps")
    p.add_argument("--engine", metavar="BACKEND", help=argparse.SUPPRESS)  # the engine process itself
    p.add_argument("--model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.backend_list = [b.strip() for b in args.backends.split(",") if b.strip()]
    return args


def engine_settings(args: argparse.Namespace, backend: str, model: str) -> dict[str, Any]:
    return dict(
        model=model, attention=backend, dtype="bfloat16", graph={"runner": "cuda", "max_batch_size": args.max_num_seqs},
        kv_cache={"num_blocks": "auto", "memory_fraction": args.memory_fraction},
        scheduler={"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_model_len},
    )


# ------------------------------------------------------------ one engine (its own process)
ENGINE_STEPS = ("device memory before the engine", "build the engine (profile, KV cache, graph capture)", "serve one full batch")


def step_names(backend: str) -> list[str]:
    return [f"{backend}: {s}" for s in ENGINE_STEPS]


def run_engine(args: argparse.Namespace) -> int:
    backend = args.engine
    report = PartReport(args.out / f"kv_profile.{backend}.json", f"kv-profile {backend}", dry_run=args.dry_run)
    if args.dry_run:
        with report.check(f"{backend}: engine settings are valid") as entry:
            from corerun.config import load_config

            entry["config"] = load_config(None, overrides=engine_settings(args, backend, args.model)).model_dump(mode="json")["graph"]
        return report.rehearse(step_names(backend))

    import torch

    from corerun import LLM, SamplingParams

    row = report.results
    steps = step_names(backend)
    with report.check(steps[0]):
        free, total = torch.cuda.mem_get_info()
        row.update(free_before_engine_mib=free / MiB, total_mib=total / MiB)
    with report.check(steps[1]):
        start = time.perf_counter()
        llm = LLM(**engine_settings(args, backend, args.model))
        runner = llm.engine.runner
        m = runner.step_memory
        capture = runner.graph.stats.capture_bytes
        row.update(
            num_blocks=runner.num_blocks,
            prefill_mib=m.prefill_bytes / MiB, decode_mib=m.decode_bytes / MiB,
            sampling_mib=m.sampling_bytes / MiB, graph_mib=m.graph_bytes / MiB,
            reserved_mib=m.reserved_bytes / MiB, capture_mib=capture / MiB,
            capture_over_reserved_graph=round(capture / m.graph_bytes, 3) if m.graph_bytes else None,
            build_seconds=round(time.perf_counter() - start, 1),
        )
    with report.check(steps[2]):
        prompt_len = args.max_model_len // args.max_num_seqs - 8
        prompts = [[(7 * i + j) % 32000 for j in range(prompt_len)] for i in range(args.max_num_seqs)]
        llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True), use_tqdm=False)
        free, _ = torch.cuda.mem_get_info()
        row["free_after_serving_mib"] = free / MiB
    print(backend, json.dumps(row), flush=True)
    return report.finish()


# ------------------------------------------------------------ the part: one process per engine
def engine_doc(args: argparse.Namespace, backend: str) -> dict[str, Any] | None:
    try:
        return json.loads((args.out / f"kv_profile.{backend}.json").read_text())
    except (OSError, ValueError):
        return None


def run_engine_process(args: argparse.Namespace, backend: str, model: str) -> dict[str, Any]:
    """Run one backend's engine in a fresh process (SIGTERM at the timeout, SIGKILL 5 s later); its row."""
    cmd = [sys.executable, __file__, "--out", str(args.out), "--engine", backend, "--model", model,
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
           "--memory-fraction", str(args.memory_fraction)]
    if args.dry_run:
        cmd.append("--dry-run")
    proc = subprocess.Popen(cmd)
    timed_out = False
    try:
        rc = proc.wait(timeout=args.engine_timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.terminate()
        try:
            rc = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    doc = engine_doc(args, backend)
    if doc is None:
        return {"error": f"the engine process exited with status {rc} before writing kv_profile.{backend}.json"}
    row = dict(doc.get("results", {}))
    failed = [c for c in doc.get("checks", []) if c.get("ok") is False]
    if timed_out:
        row["error"] = f"timed out after {args.engine_timeout} s in: {doc.get('killed_in') or doc.get('running')}"
    elif failed:
        row["error"] = "; ".join(f"{c['name']}: {c.get('error', 'failed')}" for c in failed)
    elif rc != 0:
        row["error"] = f"the engine process exited with status {rc} (see the part's log)"
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.engine:
        rc = run_engine(args)
        sys.stdout.flush()
        os._exit(rc)  # its results are written: no engine thread or device teardown may hold the exit
    report = PartReport(args.out / "kv_profile.json", "kv-profile", dry_run=args.dry_run)
    model = "(dry run: no model)"
    if not args.dry_run:
        with report.check("write the random model"):
            from benchmarks.gpu.random_llama import random_llama

            model = str(random_llama(args.hidden, args.layers, args.max_model_len, "corerun-kvprof-", dtype="bfloat16"))
    for backend in args.backend_list:  # one process each: every engine starts on a clean device
        def name_the_step(backend: str = backend) -> None:  # killed: say where the engine process was
            doc = engine_doc(args, backend) or {}
            report.doc["engine_step"] = doc.get("killed_in") or doc.get("running")

        report.on_kill = name_the_step
        with report.check(f"{backend}: engine in its own process") as entry:
            row = run_engine_process(args, backend, model)
            report.results[backend] = row
            if "error" in row:
                entry.update(ok=False, error=row["error"])
    return report.finish()


if __name__ == "__main__":
    raise SystemExit(main())
