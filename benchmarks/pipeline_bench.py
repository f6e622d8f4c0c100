"""Pipeline parallelism on CPU processes: throughput of PP=2 against PP=1 on the same cores, and each stage's
work over time (``TensorParallelRunner.stage_timelines``): how busy each stage was and how long both
were busy at once.

    python benchmarks/pipeline_bench.py [--requests 32] [--prompt 48] [--max-tokens 32] [--rounds 2]

A random 8-layer model (hidden 512) written once to a temporary folder; greedy requests with EOS
ignored, all added at once.  Rounds alternate PP=1 and PP=2 so that both see the same machine load;
the load average is printed with every round.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import corerun  # noqa: F401  (before torch: its OpenMP settings, corerun.platform.host)
import torch


def model_folder() -> str:
    from corerun.testing.tiny_models import make_tiny_model

    return str(make_tiny_model(tempfile.mkdtemp(prefix="corerun-pp-bench-"), "llama", hidden_size=512,
                               intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                               num_key_value_heads=4, vocab_size=2048, max_position_embeddings=512))


def run(folder: str, pp: int, args: argparse.Namespace) -> tuple[float, int, list[list[tuple[float, float]]] | None]:
    from corerun import LLM, SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 2000, (args.prompt,), generator=g).tolist() for _ in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(model=folder, device="cpu", dtype="float32", attention="torch", pipeline_parallel_size=pp,
              distributed={"start_method": "forkserver"},
              kv_cache={"block_size": 16, "num_blocks": 512},
              scheduler={"max_model_len": 256, "max_num_seqs": args.requests, "max_num_batched_tokens": 1024})
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        lines = llm.engine.runner.stage_timelines() if pp > 1 else None
        if lines is not None:  # this run's intervals only
            t0 = time.time() - wall - 0.05
            lines = [[(a, b) for a, b in line if a >= t0] for line in lines]
        return wall, tokens, lines
    finally:
        llm.shutdown()


def busy(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Seconds during which an interval of ``x`` and one of ``y`` both run (each list sorted, non-overlapping)."""
    total, i, j = 0.0, 0, 0
    while i < len(x) and j < len(y):
        lo, hi = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, hi - lo)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def chart(lines: list[list[tuple[float, float]]], width: int = 72) -> list[str]:
    """One row per stage: '#' where the stage worked in that slice of the run."""
    t0 = min(a for line in lines for a, _ in line)
    t1 = max(b for line in lines for _, b in line)
    step = (t1 - t0) / width
    rows = []
    for s, line in enumerate(lines):
        cells = ["."] * width
        for a, b in line:
            for c in range(int((a - t0) / step), min(width, int((b - t0) / step) + 1)):
                cells[c] = "#"
        rows.append(f"stage {s} |{''.join(cells)}|")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    folder = model_folder()
    print(f"{args.requests} requests, prompt {args.prompt}, {args.max_tokens} tokens each; {os.cpu_count()} cores")
    for r in range(args.rounds):
        for pp in (1, 2):
            load = os.getloadavg()[0]
            wall, tokens, lines = run(folder, pp, args)
            print(f"round {r + 1} PP={pp}: {tokens / wall:7.1f} tokens/s ({tokens} tokens in {wall:.2f} s), load {load:.1f}")
            if lines:
                window = wall
                for s, line in enumerate(lines):
                    print(f"  stage {s}: busy {busy(line):.2f} s of {window:.2f} s ({100 * busy(line) / window:.0f}%), "
                          f"{len(line)} micro-batches")
                both = overlap(lines[0], lines[1])
                print(f"  both stages busy at once: {both:.2f} s ({100 * both / window:.0f}% of the run)")
                for row in chart(lines):
                    print("  " + row)


if __name__ == "__main__":
    main()
