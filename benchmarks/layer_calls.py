"""What the calls between a one-request decode step's products cost: the attention backend's ``forward`` (and,
for the ``cpu`` backend, its two C calls: the KV write and the kernel) and each ``fused_ops`` operator, timed
around every call while one request decodes.

Builds the default model with ``LLM(dtype=..., threads=...)``, warms it up with one generation, then generates
``--tokens`` greedy tokens for a 32-token prompt with a timer around each call; prints ms per token and us per
decoder layer for each.  The timers add their own few microseconds a call (the step time printed is the wrapped
one); ``benchmarks/one_request_anatomy.py`` gives the products against the rest without them.

    .venv/bin/python benchmarks/layer_calls.py --dtype bfloat16 --threads 1 [--tokens 200]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)


def main() -> None:
    from corerun import LLM, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, threads=args.threads, graph={"runner": {"name": "eager"}})  # eager: a replayed step makes none of these calls
    runner = llm.engine.runner
    spent: dict[str, float] = {}

    def wrap(obj: Any, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

        setattr(obj, name, timed)

    wrap(runner.attention, "forward", f"attention ({runner.attention_name}) forward")
    for inner, label in (("_write", "  its KV write call"), ("_attend_paged", "  its kernel call")):
        if hasattr(runner.attention, inner):
            wrap(runner.attention, inner, label)
    for op in ("add_rms_norm", "rms_norm", "silu_and_mul", "rotary"):
        if runner.fused_ops is not None and hasattr(runner.fused_ops, op):
            wrap(runner.fused_ops, op, f"fused_ops ({runner.fused_ops_name}) {op}")
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([[1] * 32], params, use_tqdm=False)
    spent.clear()
    start = time.perf_counter()
    llm.generate([[1] * 32], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    layers = runner.model_config.num_layers
    print(f"{args.dtype}, {args.threads} thread(s), one 32-token prompt, {args.tokens} tokens: {elapsed / args.tokens * 1e3:.2f} ms per token (timed)")
    for label, seconds in spent.items():
        print(f"  {label:40s} {seconds / args.tokens * 1e3:6.2f} ms per token {seconds / args.tokens / layers * 1e6:7.1f} us per layer")


if __name__ == "__main__":
    main()
