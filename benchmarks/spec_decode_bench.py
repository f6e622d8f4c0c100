"""n-gram speculative decoding on and off, one request at a time: ``corerun bench --speculative both``
on three workloads, as one markdown table (benchmarks/RESULTS.md).

Workloads: a copy-the-list prompt (``--workload repetitive``: the output repeats the prompt's own
context), 256 random token ids greedy, and the same sampled at temperature 1 (seeded, so on and off
must give the same tokens).  Each is one ``corerun bench`` run: one engine, speculation off and on in
turn for ``--rounds`` interleaved rounds; the fastest round of each, their ratio, and the drafts
proposed and accepted over all rounds (corerun.bench.on_off).

    .venv/bin/python benchmarks/spec_decode_bench.py [--rounds 3] [--max-tokens 128] [-- BENCH OPTIONS ...]
    # the same, one workload at a time:
    corerun bench --num-seqs 1 --output-len 128 --workload repetitive --speculative both --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import time

WORKLOADS = {  # name -> corerun bench options
    "repetitive, greedy": ["--workload", "repetitive"],
    "random tokens, greedy": ["--input-len", "256"],
    "random tokens, T=1 seeded": ["--input-len", "256", "--temperature", "1.0"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens of the request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("bench_options", nargs="*", help="more corerun bench options (after --), e.g. --spec-tokens 4 --threads 1")
    a = ap.parse_args()

    from corerun.cli import cli

    docs = {}
    for name, options in WORKLOADS.items():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cli.main(["bench", "--num-seqs", "1", "--output-len", str(a.max_tokens), "--speculative", "both",
                      "--rounds", str(a.rounds), *options, *a.bench_options, "--json"], standalone_mode=False)
        docs[name] = json.loads(out.getvalue())
    s0 = next(iter(docs.values()))["speculative"]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores, K={s0['num_tokens']}, lookup {s0['prompt_lookup_min']}:{s0['prompt_lookup_max']}, "
          f"max_tokens={a.max_tokens}, fastest of {a.rounds} rounds (acceptance counts: all rounds)")
    print("| workload | off tok/s | on tok/s | on / off | proposed | accepted | mean accepted length | same output |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, doc in docs.items():
        s = doc["speculative"]
        print(f"| {name} | {max(s['off_output_tokens_per_s']):.1f} | {max(s['on_output_tokens_per_s']):.1f} "
              f"| {s['speedup']:.2f}x | {s['proposed']} | {s['accepted']} | {s['mean_accepted_length']:.2f} "
              f"| {s['same_outputs'] == doc['workload']['num_seqs']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
