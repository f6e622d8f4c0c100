"""What a benchmark worker process reads and writes: one JSON request in, one JSON result out.

This module imports nothing from corerun (and nothing outside the standard library): the peer
workers run it inside the peers' own virtual environments, where corerun is not installed.  A
worker is started as ``PYTHON WORKER.py REQUEST.json RESULT.json``; it reads the request, runs the
workload once after its warm-up, and writes the result (or exits non-zero with the reason on stderr).

Request keys: ``engine``, ``model_dir`` (a Hugging Face folder), ``gguf`` (a GGUF file of the same
weights in ``dtype``, or null), ``dtype`` ("float32" | "bfloat16"), ``threads``, ``prompts`` (token
ids), ``output_lens``, ``warmup_prompt``, ``warmup_tokens``, ``temperature``, ``max_model_len``, and
``options`` (engine-specific: corerun's config, HF's batching, ...).

Result keys (:data:`RESULT_KEYS`): ``engine``, ``version``, ``elapsed_s``, ``load_s``,
``output_token_ids`` (per request, exactly its output length), ``ttft_s`` / ``tpot_s`` (per request,
possibly empty when the engine cannot time requests one by one), ``threads``, ``peak_rss_bytes`` and
``details`` (a JSON object).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from typing import Any, Callable

RESULT_KEYS = ("engine", "version", "elapsed_s", "load_s", "output_token_ids", "ttft_s", "tpot_s", "threads", "peak_rss_bytes", "details")


def read_request(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_result(path: str, result: dict[str, Any]) -> None:
    missing = [k for k in RESULT_KEYS if k not in result]
    if missing:
        raise ValueError(f"a worker result needs the keys {', '.join(RESULT_KEYS)}; missing {', '.join(missing)}")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f)


def peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def check_lengths(engine: str, outputs: list[list[int]], output_lens: list[int]) -> None:
    """Every request must have produced exactly the tokens it asked for (EOS ignored)."""
    short = [i for i, (o, n) in enumerate(zip(outputs, output_lens)) if len(o) != n]
    if len(outputs) != len(output_lens) or short:
        raise RuntimeError(f"{engine} produced a wrong number of tokens for request(s) {short[:5]} of {len(output_lens)}")


def main(run: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """The worker's entry point: ``run(request) -> result``, with the argument handling around it."""
    if len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} REQUEST.json RESULT.json")
    request = read_request(sys.argv[1])
    t0 = time.perf_counter()
    result = run(request)
    result.setdefault("peak_rss_bytes", peak_rss_bytes())
    result.setdefault("wall_s", time.perf_counter() - t0)
    write_result(sys.argv[2], result)
