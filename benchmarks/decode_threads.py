"""A decode step's time for N requests at a thread count: what ``threads: auto``'s thresholds are measured with.

Builds the default model with ``LLM(dtype=..., threads=T)`` (an integer: every step on T threads) and, for each
request count N, times ``generate`` of N 32-token prompts for 82 tokens against the same for 2 tokens: the
difference over 80 is the ms of one decode step of N requests (best of 2).  Run it once per thread count, in
separate processes, and divide:

    .venv/bin/python benchmarks/decode_threads.py --dtype bfloat16 --threads 1 --requests 1,4,8,16
    .venv/bin/python benchmarks/decode_threads.py --dtype bfloat16 --threads 2 --requests 1,4,8,16
"""

from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", default="1,4,8,16", help="request counts, comma-separated")
    args = ap.parse_args()

    from corerun import LLM, SamplingParams  # (before torch: its OpenMP settings, corerun.platform.host)

    llm = LLM(dtype=args.dtype, threads=args.threads)
    figures = []
    for n in (int(x) for x in args.requests.split(",")):
        prompts = [[100 + i + j for j in range(32)] for i in range(n)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=82, ignore_eos=True), use_tqdm=False)
            t2 = time.perf_counter()
            best = min(best, ((t2 - t1) - (t1 - t0)) / 80 * 1e3)
        figures.append(f"{n}: {best:.2f}")
    print(f"{args.dtype}, {args.threads} thread(s), ms per decode step by requests: " + ", ".join(figures))


if __name__ == "__main__":
    main()
