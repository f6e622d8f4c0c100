"""Greedy outputs of corerun against transformers in the same dtype, on the default model.

The evidence behind ``dtype: auto`` on CPU (docs/benchmarks.md): for each dtype, corerun and
transformers each continue the same prompts greedily (EOS ignored) and the script counts the
requests whose tokens agree exactly, and for the others the first position where they part.
Prompts: chat-style texts through the tokenizer, then random-token prompts.

    .venv/bin/python benchmarks/dtype_greedy_check.py --dtypes float32,bfloat16 --tokens 64 --random 8

``--model DIR`` checks another model folder (with a tokenizer and a chat template) instead.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch

TEXTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "def fibonacci(n):",
    "List three uses of copper:",
    "Translate to German: The weather is nice today.",
    "Once upon a time, in a small village,",
    "What is 17 times 23?",
]


def hf_greedy(model_dir: str, dtype: torch.dtype, prompts: list[list[int]], n: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            outs.append(gen[0, len(p):].tolist())
    return outs


def corerun_greedy(model_dir: str, dtype: str, prompts: list[list[int]], n: int, attention: str) -> list[list[int]]:
    from corerun.llm import LLM
    from corerun.sampling_params import SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, device="cpu", attention=attention)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--random", type=int, default=8, help="random-token prompts besides the texts")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--model", default=None, help="model folder [the built-in default model]")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from corerun.models.default import default_model_dir

    model_dir = args.model or str(default_model_dir())
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in TEXTS]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    rng = random.Random(0)
    ids = min(10_000, len(tok))  # (random ids below 10,000, or the whole vocabulary of a smaller one)
    prompts += [[rng.randrange(ids) for _ in range(rng.randint(16, 128))] for _ in range(args.random)]
    print(f"model {model_dir}; {len(prompts)} prompts, {args.tokens} greedy tokens each; torch {torch.__version__}; "
          f"threads {torch.get_num_threads()}; load {os.getloadavg()[0]:.2f}")
    for dtype in args.dtypes.split(","):
        t0 = time.perf_counter()
        ours = corerun_greedy(model_dir, dtype, prompts, args.tokens, args.attention)
        ref = hf_greedy(model_dir, getattr(torch, dtype), prompts, args.tokens)
        same = sum(a == b for a, b in zip(ours, ref))
        parts = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(ours, ref) if a != b]
        print(f"{dtype}: {same}/{len(prompts)} requests equal to transformers token for token; "
              f"diverging requests part at output positions {parts} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
