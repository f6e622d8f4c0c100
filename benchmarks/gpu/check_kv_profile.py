"""The step-memory profile behind ``kv_cache.num_blocks: auto`` against what capture and serving then use.

For each attention backend this builds an ``LLM`` on a random Llama-shaped model with the ``cuda``
graph runner and an automatically sized KV cache, and prints, side by side:

- the profile's figures (``runner.step_memory``: prefill, eager decode, sampling, captured decode);
- what capturing the graphs then took (``runner.graph.stats.capture_bytes``) against the captured
  decode the profile reserved for it (ratio near 1 or below: the reserve held);
- the device memory left free after serving a batch that fills ``max_num_batched_tokens``.

    python benchmarks/gpu/check_kv_profile.py --out RESULTS_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MiB = 1 << 20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--backends", default="torch,triton")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--memory-fraction", type=float, default=0.5)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import torch

    from corerun import LLM, SamplingParams
    from benchmarks.gpu.random_llama import random_llama

    model = random_llama(args.hidden, args.layers, args.max_model_len, "corerun-kvprof-", dtype=torch.bfloat16)
    results = {}
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        start = time.perf_counter()
        try:
            llm = LLM(
                model=str(model), attention=backend, dtype="bfloat16", graph={"runner": "cuda", "max_batch_size": args.max_num_seqs},
                kv_cache={"num_blocks": "auto", "memory_fraction": args.memory_fraction},
                scheduler={"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                           "max_num_batched_tokens": args.max_model_len},
            )
            runner = llm.engine.runner
            m = runner.step_memory
            capture = runner.graph.stats.capture_bytes
            prompts = [[(7 * i + j) % 32000 for j in range(args.max_model_len // args.max_num_seqs - 8)] for i in range(args.max_num_seqs)]
            llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True), use_tqdm=False)
            free, total = torch.cuda.mem_get_info()
            row = {
                "num_blocks": runner.num_blocks,
                "prefill_mib": m.prefill_bytes / MiB, "decode_mib": m.decode_bytes / MiB,
                "sampling_mib": m.sampling_bytes / MiB, "graph_mib": m.graph_bytes / MiB,
                "reserved_mib": m.reserved_bytes / MiB, "capture_mib": capture / MiB,
                "capture_over_reserved_graph": round(capture / m.graph_bytes, 3) if m.graph_bytes else None,
                "free_after_serving_mib": free / MiB, "total_mib": total / MiB,
                "seconds": round(time.perf_counter() - start, 1),
            }
            llm.shutdown()
            del llm
            torch.cuda.empty_cache()
        except Exception as exc:  # one backend failing must not hide the other's figures
            row = {"error": f"{type(exc).__name__}: {exc}"}
        results[backend] = row
        print(backend, json.dumps(row), flush=True)
    (args.out / "kv_profile.json").write_text(json.dumps(results, indent=2))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
