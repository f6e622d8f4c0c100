"""End-to-end decode throughput on a GPU: ``corerun bench`` on a random Llama-shaped model, for the
attention backends and graph runners side by side (``--compare hf`` as the peer), tensor_parallel_size 1.

    python benchmarks/gpu/bench_e2e.py --out RESULTS_DIR
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--timeout", type=int, default=25, help="seconds per configuration")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from benchmarks.gpu.random_llama import random_llama

    model = random_llama(args.hidden, args.layers, 4096, "corerun-e2e-")
    runs = [("torch", "eager"), ("torch", "cuda"), ("triton", "eager"), ("triton", "cuda")]
    results = {}
    for attention, graph in runs:
        cmd = [
            sys.executable, "-m", "corerun", "bench", "--model", str(model), "--json",
            "--attention", attention, "--set", f"graph.runner={graph}", "--dtype", "bfloat16",
            "--num-seqs", str(args.num_seqs), "--input-len", "64:256", "--output-len", "64:128",
        ]
        if (attention, graph) == ("triton", "cuda"):
            cmd += ["--compare", "hf"]
        key = f"{attention}+{graph}"
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            results[key] = json.loads(proc.stdout)
        except subprocess.TimeoutExpired:
            results[key] = {"error": f"timed out after {args.timeout} s"}
        except json.JSONDecodeError:
            results[key] = {"error": proc.stderr[-2000:], "rc": proc.returncode}
        print(key, json.dumps(results[key])[:400], flush=True)
        (args.out / "bench_e2e.json").write_text(json.dumps(results, indent=2))  # after each run: a timeout loses nothing
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
