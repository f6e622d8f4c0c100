"""``corerun bench``: the standard offline throughput workload, its runners (corerun, transformers) and report.

- :mod:`corerun.bench.workload`: N requests of random token ids, lengths drawn uniformly from ranges, by seed
  (or copy-the-list prompts that repeat their context: speculative decoding's workload);
- :mod:`corerun.bench.stats`: percentiles, time to first token and time per output token;
- :mod:`corerun.bench.memory`: peak CUDA memory or peak RSS of a section;
- :mod:`corerun.bench.corerun_run` / :mod:`corerun.bench.hf_run`: one timed pass of each engine;
- :mod:`corerun.bench.on_off`: one engine with a setting off and on in turn (async scheduling, speculation);
- :mod:`corerun.bench.report`: the JSON document and the table.
"""

from corerun.bench.stats import percentile, request_latencies, summarize
from corerun.bench.workload import LengthRange, Workload, make_workload, parse_range

__all__ = ["LengthRange", "Workload", "make_workload", "parse_range", "percentile", "request_latencies", "summarize"]
