"""Speculative decoding (n-gram drafts) on and off, one request at a time, interleaved in one run.

Workloads: a prompt that makes the model repeat its context (a list the model is asked to copy: the
summarisation / code-editing shape where prompt lookup finds the continuation), and random tokens,
greedy (a small model tends to fall into loops there, which drafts catch) and sampled at temperature 1
with a seed (drafts rare and mostly rejected: the cost of speculation).  Seeded and greedy runs must
give the same tokens on and off ("same output").  Each round runs every workload
with speculation off, then on, on two engines built from the same config; the best round of each is
reported with the on / off ratio and the acceptance statistics.

    .venv/bin/python benchmarks/spec_decode_bench.py [--model DIR] [--set KEY=VALUE ...] \
        [--num-tokens 4] [--max-tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import time


def repetitive_prompt(rng: random.Random) -> str:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
             "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]
    items = [f"{i + 1}. {rng.choice(words)} {rng.choice(words)} {rng.randint(10, 99)}" for i in range(40)]
    text = "\n".join(items)
    return f"Here is a list:\n{text}\n\nCopy the list above exactly, line by line:\n{items[0]}\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the built-in default model)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--num-tokens", type=int, default=4, help="draft tokens per step (speculative.num_tokens)")
    ap.add_argument("--lookup", default="2:4", help="prompt_lookup_min:prompt_lookup_max")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()

    from corerun import LLM, SamplingParams
    from corerun.config import load_config

    overrides = {"model": a.model} if a.model else {}
    sets = ["device=cpu", "kv_cache.num_blocks=512", *a.set]
    off = LLM(config=load_config(None, overrides=overrides or None, sets=sets))
    lo, hi = (int(x) for x in a.lookup.split(":"))
    spec = {"method": "ngram", "num_tokens": a.num_tokens, "prompt_lookup_min": lo, "prompt_lookup_max": hi}
    on = LLM(config=load_config(None, overrides={**overrides, "speculative": spec}, sets=sets))
    vocab = off.engine.runner.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=a.max_tokens, ignore_eos=True)
    rng = random.Random(1)
    random_prompt = [rng.randrange(vocab) for _ in range(256)]
    workloads = {  # name -> (prompt, params)
        "repetitive, greedy": (repetitive_prompt(random.Random(0)), greedy),
        "random tokens, greedy": (random_prompt, greedy),
        "random tokens, T=1 seeded": (random_prompt, sampled),
    }
    for llm in (off, on):  # warm-up
        llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    best: dict[tuple[str, str], float] = {}
    stats: dict[str, dict[str, float]] = {}
    same: dict[str, bool] = {}
    for _ in range(a.rounds):
        for name, (prompt, params) in workloads.items():
            outs = {}
            for mode, llm in (("off", off), ("on", on)):
                st = llm.engine.spec_stats
                before = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
                t0 = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                dt = time.perf_counter() - t0
                outs[mode] = out.outputs[0].token_ids
                tps = len(out.outputs[0].token_ids) / dt
                best[name, mode] = max(best.get((name, mode), 0.0), tps)
                if mode == "on":
                    d, dt_, acc = (x - y for x, y in zip((st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens), before))
                    stats[name] = {"drafts": d, "proposed": dt_, "accepted": acc}
            same[name] = outs["on"] == outs["off"]
    load = os.getloadavg()[0]
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load:.1f} on {os.cpu_count()} cores, "
          f"model {off.engine.runner.model_dir.name}, K={a.num_tokens}, lookup {lo}:{hi}, max_tokens={a.max_tokens}, "
          f"best of {a.rounds} (acceptance counts: last round)")
    print("| workload | off tok/s | on tok/s | on / off | proposed | accepted | mean accepted length | same output |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for name in workloads:
        s = stats[name]
        mal = 1 + s["accepted"] / s["drafts"] if s["drafts"] else 0.0
        print(f"| {name} | {best[name, 'off']:.1f} | {best[name, 'on']:.1f} | {best[name, 'on'] / best[name, 'off']:.2f}x "
              f"| {s['proposed']} | {s['accepted']} | {mal:.2f} | {same[name]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
