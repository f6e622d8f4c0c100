"""Where one request's decode step goes: the linear layers against everything else, inside the model and apart.

Builds the default model (``--model`` to change it) with ``LLM(dtype=..., threads=...)``, warms it up, and
generates ``--tokens`` greedy tokens for one ``--prompt-len``-token prompt (EOS ignored) four ways:

1. as it runs: ms per token;
2. the same, each linear layer's ``forward`` (the projections and the LM head, their quantization method's
   product included) timed by a wrapper: the products' share inside the model;
3. the calls of one decode step's linear layers replayed back to back on the inputs they had (best of
   ``--repeats`` passes): the products alone, nothing between them;
4. the linear layers replaced by a fill of their outputs (0.01 everywhere; greedy then always picks token 0):
   everything else with the weights never read.

(1) - (2) is the rest of the step as it runs; (4) is the same work when no product streams the weights
through the caches between its operators.  The difference is what the products' eviction of the core's
caches costs the rest.

With ``--stream`` it also times the bfloat16 one-token kernel of ``corerun-quant-cpu`` over N copies of a
1536 x 576 weight in turn, for working sets of 2 MB to 512 MB: how much of the last-level cache serves one
core (the model's weights stream from memory when they do not fit).

    .venv/bin/python benchmarks/one_request_anatomy.py --dtype bfloat16 --threads 1 [--tokens 200] [--stream]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch


def generate_ms(llm: Any, prompt: list[int], tokens: int) -> float:
    from corerun.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return (time.perf_counter() - t0) * 1e3 / tokens


def stream(threads: int) -> None:
    from corerun_quant_cpu import kernels

    reasons = kernels.load()
    if reasons:
        print("--stream: corerun-quant-cpu's kernels are not available: " + "; ".join(reasons))
        return
    torch.set_num_threads(threads)
    isa = kernels.bf16_best_isa()
    rows, cols = 1536, 576
    x, out = torch.randn(1, cols).bfloat16(), torch.empty(1, rows, dtype=torch.bfloat16)
    for mb in (2, 8, 32, 64, 128, 256, 512):
        packs = [kernels.repack_bf16(torch.randn(rows, cols).bfloat16()) for _ in range(max(1, mb * 2**20 // (rows * cols * 2)))]
        for _ in range(3):
            for p in packs:
                kernels.bf16_gemv(out, p, x, isa)
        best = float("inf")
        for _ in range(10):
            t0 = time.perf_counter()
            for p in packs:
                kernels.bf16_gemv(out, p, x, isa)
            best = min(best, time.perf_counter() - t0)
        print(f"  {mb:4d} MB of weights in turn: {len(packs) * rows * cols * 2 / best / 1e9:5.1f} GB/s ({isa})")
        del packs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args()

    from corerun.llm import LLM
    from corerun.models.layers import Linear, LMHead

    llm = LLM(**({"model": args.model} if args.model else {}), dtype=args.dtype, threads=args.threads,
              graph={"runner": {"name": "eager"}})  # eager: the timers wrap Python calls a replayed step never makes
    prompt = list(range(100, 100 + args.prompt_len))
    generate_ms(llm, prompt, 8)
    load = os.getloadavg()[0]
    step = generate_ms(llm, prompt, args.tokens)

    spent, calls, captured, capture_limit = [0.0], [0], [], [0]  # capture_limit: how many calls to keep inputs of
    originals = {cls: cls.forward for cls in (Linear, LMHead)}

    depth, head_rows = [0], [0]

    def timed(forward):
        def wrapper(layer, x):
            if depth[0]:  # a quantized LM head's own linear layer: counted in the head's call
                return forward(layer, x)
            depth[0] += 1
            try:
                t0 = time.perf_counter()
                y = forward(layer, x)
                spent[0] += time.perf_counter() - t0
            finally:
                depth[0] -= 1
            calls[0] += 1
            if isinstance(layer, LMHead):
                head_rows[0] = y.shape[1]
            if len(captured) < capture_limit[0]:
                captured.append((forward, layer, x.clone()))
            return y
        return wrapper

    for cls, forward in originals.items():
        cls.forward = timed(forward)
    try:
        with_wrappers = generate_ms(llm, prompt, args.tokens)
        per_token = spent[0] * 1e3 / args.tokens
        n_calls = calls[0] // args.tokens
        capture_limit[0] = 4 * n_calls  # a prefill step's calls, then a decode step's: the last n_calls are the decode's
        generate_ms(llm, prompt, 2)
    finally:
        for cls, forward in originals.items():
            cls.forward = forward
    decode_calls = captured[-n_calls:]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            for forward, layer, x in decode_calls:
                forward(layer, x)
            best = min(best, time.perf_counter() - t0)

    def fill(layer, x):
        if isinstance(layer, LMHead):
            return torch.full((x.shape[0], head_rows[0]), 0.01, dtype=torch.float32)
        return torch.full((x.shape[0], layer.out_features), 0.01, dtype=x.dtype)

    for cls in originals:
        cls.forward = fill
    try:
        filled = generate_ms(llm, prompt, args.tokens)
    finally:
        for cls, forward in originals.items():
            cls.forward = forward

    print(f"{args.dtype}, {args.threads} thread(s), one {args.prompt_len}-token prompt, {args.tokens} tokens, load {load:.2f}")
    print(f"  step as it runs:                          {step:6.2f} ms per token")
    print(f"  linear layers inside the model:           {per_token:6.2f} ms per token ({n_calls} calls; step with "
          f"the timing wrappers {with_wrappers:.2f})")
    print(f"  the same calls back to back:              {best * 1e3:6.2f} ms (best of {args.repeats})")
    print(f"  the rest, inside the model:               {with_wrappers - per_token:6.2f} ms per token")
    print(f"  the rest, linear layers filled instead:   {filled:6.2f} ms per token")
    if args.stream:
        stream(args.threads)


if __name__ == "__main__":
    main()
