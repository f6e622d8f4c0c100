"""``threads: 1`` against ``threads: auto``, interleaved: ``corerun bench`` runs in turn, each its own process.

Every round runs ``corerun bench --json`` once per arm, in this order: ``--threads 1``; no
``--threads`` (the config's ``threads: auto``); and with ``--old`` the behaviour before each step was
sized, all steps on every core with OpenMP's default spinning wait (``--threads N`` for the physical
cores, ``GOMP_SPINCOUNT=300000``, libgomp's default, in place of corerun's shorter spin).  It prints, per run, the output tokens/s, the ms per output token
(elapsed / output tokens) and the TPOT median, with the 1-minute load average before the run; then
each arm's median and best.  The machine's other load changes between runs: the interleaving gives
every arm the same share of it.

    .venv/bin/python benchmarks/threads_ab.py --rounds 3 --num-seqs 1 --input-len 128 --output-len 128 [--old]
    .venv/bin/python benchmarks/threads_ab.py --rounds 3 --num-seqs 32 --input-len 32:256 --output-len 32:256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

CORERUN = Path(sys.executable).with_name("corerun")


def run(arm: str, common: list[str], cores: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    extra = {"1": ["--threads", "1"], "auto": [], "old": ["--threads", str(cores)]}[arm]
    if arm == "old":
        env["GOMP_SPINCOUNT"] = "300000"
    load = os.getloadavg()[0]
    out = subprocess.run([str(CORERUN), "bench", *common, *extra, "--json"], env=env, capture_output=True, text=True,
                         check=True, timeout=1800).stdout
    doc = json.loads(out[out.index("{"):])
    c = doc["corerun"]
    return {"arm": arm, "load": load, "tok_s": c["output_tokens_per_s"], "ms_per_token": 1e3 * c["elapsed_s"] / c["output_tokens"],
            "tpot_median_ms": c["tpot_ms"]["median"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-seqs", default="1")
    ap.add_argument("--input-len", default="128")
    ap.add_argument("--output-len", default="128")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--old", action="store_true", help="also the behaviour before steps were sized (see above)")
    args = ap.parse_args()
    from corerun.platform.host import physical_cores

    common = ["--num-seqs", args.num_seqs, "--input-len", args.input_len, "--output-len", args.output_len,
              "--attention", args.attention]
    arms = ["1", "auto", *(["old"] if args.old else [])]
    runs = []
    for r in range(args.rounds):
        for arm in arms:
            res = run(arm, common, physical_cores())
            runs.append(res)
            print(f"round {r} threads {arm:4s}: {res['tok_s']:7.1f} tok/s  {res['ms_per_token']:7.2f} ms/token  "
                  f"TPOT median {res['tpot_median_ms']:7.2f} ms  (load {res['load']:.1f})", flush=True)
    print(f"{' '.join(common)}, {args.rounds} rounds; load {min(r['load'] for r in runs):.1f}-{max(r['load'] for r in runs):.1f}")
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        ms = [r["ms_per_token"] for r in mine]
        tps = [r["tok_s"] for r in mine]
        print(f"threads {arm:4s}: ms/token median {statistics.median(ms):.2f} best {min(ms):.2f}; "
              f"tok/s median {statistics.median(tps):.1f} best {max(tps):.1f}")


if __name__ == "__main__":
    main()
