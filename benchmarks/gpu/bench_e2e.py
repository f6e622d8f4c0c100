"""End-to-end decode throughput on a GPU: ``corerun bench`` on a random Llama-shaped model, for the
attention backends and graph runners side by side (``--compare hf`` as the peer), tensor_parallel_size 1.

    python benchmarks/gpu/bench_e2e.py --out RESULTS_DIR

Each configuration runs in its own ``corerun bench`` process with its own time limit (SIGTERM, then
SIGKILL 5 s later); ``bench_e2e.json`` is rewritten after each, and a configuration cut short keeps
the tail of its output.  ``--dry-run`` checks every command line against ``corerun bench`` (its
``--help`` parse) without running one.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu.part_report import PartReport  # noqa: E402

# What the engine runs first (triton attention replaying CUDA graphs, with transformers as the peer),
# then the configurations it is compared with.
RUNS = [("triton", "cuda"), ("triton", "eager"), ("torch", "cuda"), ("torch", "eager")]


def command(args: argparse.Namespace, model: str, attention: str, graph: str) -> list[str]:
    cmd = [
        sys.executable, "-m", "corerun", "bench", "--model", model, "--json",
        "--attention", attention, "--set", f"graph.runner={graph}", "--dtype", "bfloat16",
        "--num-seqs", str(args.num_seqs), "--input-len", "64:256", "--output-len", "64:128",
    ]
    if (attention, graph) == RUNS[0]:
        cmd += ["--compare", "hf"]
    return cmd


def run_one(cmd: list[str], timeout: float) -> dict:
    """The JSON document of one ``corerun bench`` run, or an error with the tail of its output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, err = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return {"error": f"timed out after {timeout:.0f} s", "output_tail": ((out or "") + (err or ""))[-1500:]}
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        return {"error": f"exit status {proc.returncode}, no JSON on stdout", "output_tail": (err or out)[-2000:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--timeout", type=int, default=22, help="seconds per configuration")
    p.add_argument("--hf-extra", type=int, default=8, help="more seconds for the configuration that also runs transformers")
    p.add_argument("--dry-run", action="store_true", help="check the command lines, run no benchmark")
    args = p.parse_args(argv)
    report = PartReport(args.out / "bench_e2e.json", "bench-e2e", dry_run=args.dry_run)
    model = "(dry run: no model)"
    if not args.dry_run:
        with report.check("write the random model (or reuse the KV profile's)"):
            from benchmarks.gpu.random_llama import random_llama

            model = str(random_llama(args.hidden, args.layers, 4096, "corerun-e2e-", dtype="bfloat16"))
    for attention, graph in RUNS:
        key = f"{attention}+{graph}" + (" (+hf)" if (attention, graph) == RUNS[0] else "")
        cmd = command(args, model, attention, graph)
        with report.check(key) as entry:
            if args.dry_run:  # the options must parse; `--help` exits 0 only if they all exist
                proc = subprocess.run(cmd + ["--help"], capture_output=True, text=True, timeout=60)
                entry.update(dry_run=True, ok=proc.returncode == 0)
                if proc.returncode:
                    entry["error"] = proc.stderr.strip()[-500:]
                report.rehearse_hang(key)
                continue
            start = time.perf_counter()
            result = run_one(cmd, args.timeout + (args.hf_extra if "--compare" in cmd else 0))
            report.results[key] = result
            entry["seconds_wall"] = round(time.perf_counter() - start, 1)
            if "error" in result:
                entry.update(ok=False, error=result["error"])
        print(key, json.dumps(report.results.get(key, {}))[:400], flush=True)
    return report.finish()


if __name__ == "__main__":
    raise SystemExit(main())
