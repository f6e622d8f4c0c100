"""Greedy output of the default model with a quantized KV cache against the unquantized one, side by side.

16 short prompts, 32 tokens each (EOS ignored), greedy, one engine per ``kv_cache.dtype`` in one process
(same weights, same attention backend).  For each quantized format the script counts the prompts whose 32
tokens equal the unquantized cache's, and for the others the position where they part; then, feeding each
prompt with the unquantized run's 32 tokens as one prompt, the share of those tokens the quantized cache
also ranks first (agreement free of the snowball after a first difference).  It prints the cache's block
count in the same memory (``kv_cache.cpu_memory_gb``) and, for scale, the same figures for the unquantized
cache with the whole model in bfloat16 (``--floor``).

    .venv/bin/python benchmarks/kv_quant_check.py [--formats fp8_e4m3,fp8_e5m2,int8] [--tokens 32] [--attention cpu]
"""

from __future__ import annotations

import argparse
import os
import time

from dtype_greedy_check import TEXTS  # (this folder is the script's sys.path[0])

PROMPTS = TEXTS + [
    "The three primary colors are",
    "A good breakfast includes",
    "In 1969, the first humans",
    "To boil an egg, you",
    "import numpy as np\narr = np.",
    "The largest planet in the solar system is",
    "Rain forms when",
    "My favourite book is",
]


def run(tokens: int, attention: str, dtype: str, kv_dtype: str, base: list | None) -> dict:
    """One engine: free-running greedy outputs, the cache's block count, and (given the baseline's outputs) the
    share of the baseline's tokens this engine ranks first when fed the baseline's own context."""
    from corerun.llm import LLM
    from corerun.sampling_params import SamplingParams

    llm = LLM(device="cpu", dtype=dtype, attention=attention, kv_cache={"dtype": kv_dtype, "cpu_memory_gb": 0.5})
    start = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    took = time.perf_counter() - start
    res = {"outs": [list(o.outputs[0].token_ids) for o in outs], "prompts": [list(o.prompt_token_ids) for o in outs],
           "blocks": getattr(llm.engine.runner, "num_blocks", -1), "s": took}
    if base is not None:  # teacher-forced: prompt + the baseline's tokens as one prompt, their ranks read back
        forced = [p + o for p, o in zip(base["prompts"], base["outs"])]
        ranked = llm.generate(forced, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)
        firsts = total = 0
        for p, r in zip(base["prompts"], ranked):
            for entry, tok in zip(r.prompt_logprobs[len(p):], r.prompt_token_ids[len(p):]):
                firsts += entry[tok].rank == 1
                total += 1
        res["forced"] = firsts / total
    llm.shutdown()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="fp8_e4m3,fp8_e5m2,int8")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--dtype", default="auto", help="the model's dtype (auto: float32 on CPU)")
    ap.add_argument("--floor", default="bfloat16", help="also run the unquantized cache with the model in this dtype "
                    "(the agreement a change of rounding alone gives); empty: skip")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {len(PROMPTS)} prompts x {args.tokens} greedy tokens; "
          f"model dtype {args.dtype}, attention {args.attention}")
    base = run(args.tokens, args.attention, args.dtype, "auto", None)
    print(f"{'auto':>18}: {base['blocks']} blocks in 0.5 GiB, {base['s']:.1f} s")
    rows = [(kv, args.dtype, kv) for kv in args.formats.split(",")]
    if args.floor:
        rows.append((f"auto, {args.floor} model", args.floor, "auto"))
    for label, dtype, kv in rows:
        r = run(args.tokens, args.attention, dtype, kv, base)
        outs, b = r["outs"], base["outs"]
        same = sum(o == x for o, x in zip(outs, b))
        parts = sorted(next(i for i, (x, y) in enumerate(zip(o, q)) if x != y) for o, q in zip(outs, b) if o != q)
        print(f"{label:>18}: {same}/{len(b)} prompts identical (the others part at output token {parts}); "
              f"teacher-forced top-1 agreement {r['forced']:.1%}; {r['blocks']} blocks "
              f"({r['blocks'] / base['blocks']:.2f}x), {r['s']:.1f} s")


if __name__ == "__main__":
    main()
