"""Online benchmark of a server: request rate, concurrency; TTFT / TPOT / ITL / end-to-end percentiles and
throughput (corerun.server.bench_client; docs/serving.md).

    # a running server (corerun serve, or any OpenAI-compatible one); the same as corerun bench --url URL
    .venv/bin/python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 --max-concurrency 32

    # corerun against itself in one run: the workload through LLM.generate, then the same requests over
    # HTTP to a server on the same LLM; prints both and the ratio (what serving costs)
    .venv/bin/python benchmarks/serve_bench.py --self [--model DIR] [--set KEY=VALUE ...] --num-prompts 16
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import threading
import time


def self_compare(a: argparse.Namespace) -> int:
    from corerun import LLM, SamplingParams
    from corerun.config import load_config
    from corerun.server.bench_client import _range, make_work, report, run
    from corerun.server.run import bind, make_server

    cfg = load_config(None, overrides={"model": a.model} if a.model else None, sets=a.set)
    llm = LLM(config=cfg)
    vocab = llm.engine.runner.vocab_size
    work = make_work(a.num_prompts, _range(a.input_len), _range(a.output_len), vocab, random.Random(a.seed))
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=a.temperature) for _, o in work]
    llm.generate([p for p, _ in work[:1]], params[:1], use_tqdm=False)  # warm-up
    out_tokens = sum(o for _, o in work)
    sock = bind()
    server = make_server(llm, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    offline, streamed, online = [], [], []
    for r in range(a.rounds):  # interleaved, so that a change in the machine's load hits all alike
        t = time.perf_counter()
        outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
        offline.append(time.perf_counter() - t)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == out_tokens
        t = time.perf_counter()
        for _ in llm.stream([p for p, _ in work], params):  # every token's output, as a stream needs
            pass
        streamed.append(time.perf_counter() - t)
        s = asyncio.run(run(url, num_prompts=len(work), input_len=(0, 0), output_len=(0, 0),
                            request_rate=a.request_rate, max_concurrency=a.max_concurrency, seed=a.seed,
                            temperature=a.temperature, vocab=vocab, work=work))
        online.append(s)
        print(f"round {r + 1}: LLM.generate {out_tokens / offline[-1]:.1f} tok/s, LLM.stream "
              f"{out_tokens / streamed[-1]:.1f} tok/s, streamed over HTTP {s['output_throughput']:.1f} tok/s")
    server.should_exit = True
    thread.join(60)
    best = max(online, key=lambda x: x["output_throughput"])
    print(report(best))
    off, st, http = out_tokens / min(offline), out_tokens / min(streamed), best["output_throughput"]
    print(f"best of {a.rounds}: LLM.generate {off:.1f} output tok/s, LLM.stream {st:.1f}, streamed over HTTP {http:.1f}; "
          f"HTTP / generate = {http / off:.2f}x, HTTP / stream = {http / st:.2f}x")
    return 0 if all(x["failed"] == 0 for x in online) else 1


def main() -> int:
    if "--self" not in sys.argv[1:]:
        from corerun.server.bench_client import main as client_main

        return client_main()
    ap = argparse.ArgumentParser()
    ap.add_argument("--self", action="store_true")
    ap.add_argument("--model", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--input-len", default="32:128")
    ap.add_argument("--output-len", default="16:64")
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=2)
    return self_compare(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
