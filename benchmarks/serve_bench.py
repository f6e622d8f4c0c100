"""Online benchmark of a running server (corerun serve, or any OpenAI-compatible one): request rate,
concurrency; TTFT / TPOT / ITL / end-to-end percentiles and throughput. See docs/serving.md.

    .venv/bin/python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --num-prompts 200 --request-rate 8 --max-concurrency 32

The same as ``corerun bench --url URL``, with every knob of corerun.server.bench_client.
"""

import sys

from corerun.server.bench_client import main

if __name__ == "__main__":
    sys.exit(main())
