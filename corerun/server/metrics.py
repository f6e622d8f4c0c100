"""``GET /metrics``: Prometheus metrics under vLLM's names, so dashboards made for vLLM read them as they are.

Gauges and the prefix-cache counters are read from the engine when scraped; request counters and
latency histograms are recorded as each request finishes.  Each server has its own registry.

    vllm:num_requests_running / vllm:num_requests_waiting     gauges (scheduler queues)
    vllm:kv_cache_usage_perc                                   gauge, 0..1 (blocks in use / all blocks)
    vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total   counters, in tokens
    vllm:num_preemptions_total                                 counter
    vllm:spec_decode_num_drafts_total, vllm:spec_decode_num_draft_tokens_total,
    vllm:spec_decode_num_accepted_tokens_total                 counters, with speculative decoding on
    vllm:prompt_tokens_total / vllm:generation_tokens_total    counters, finished requests (embeddings too)
    vllm:request_success_total{finished_reason}                counter: stop, length, abort, error
    corerun:embedding_requests_total{finished_reason}          counter: the embedding requests among them
    vllm:time_to_first_token_seconds, vllm:time_per_output_token_seconds,
    vllm:e2e_request_latency_seconds                           histograms
    corerun:requests_rejected_total{reason}                    counter: overloaded (503), invalid (400/404/413)
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from corerun.outputs import EmbeddingRequestOutput, RequestOutput

disable_created_metrics()  # no *_created series (as vLLM): they double the output and no dashboard reads them

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector(Collector):
    """What the engine knows at scrape time (a scrape reads plain counters; it never waits for a step)."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        eng, labels = self.engine, [self.model_name]
        sched = eng.scheduler
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests in the running batch.", len(sched.running)),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", len(sched.waiting)),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            yield g
        try:  # read while the engine thread steps: plain counters, but a plugin's stats() may still race
            stats = eng.kv.stats()
        except Exception:  # noqa: BLE001 (a scrape must not fail; the next one reads them again)
            return
        usage = 1.0 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0
        g = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block in use.", labels=["model_name"])
        g.add_metric(labels, usage)
        yield g
        counters = [
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_queries),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_hits),
            ("vllm:num_preemptions", "Preemptions (a sequence's blocks freed, to be recomputed).", sched.num_preemptions),
        ]
        spec = getattr(eng, "spec_stats", None)
        if getattr(eng, "proposer", None) is not None and spec is not None:
            counters += [
                ("vllm:spec_decode_num_drafts", "Decode rows that carried draft tokens.", spec.num_drafts),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", spec.num_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
            ]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            yield c


class ServerMetrics:
    def __init__(self, engine: Any, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, ln = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", ln, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests.", ln, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       ln + ["finished_reason"], registry=r)
        self.embeddings = Counter("corerun:embedding_requests", "Finished embedding requests (one per input) "
                                  "by finish reason.", ln + ["finished_reason"], registry=r)
        self.rejected = Counter("corerun:requests_rejected", "Requests refused before reaching the engine.",
                                ln + ["reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", ln,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token after the first.", ln,
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", ln,
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(engine, model_name))
        # one label set: touch each so that a scrape shows zeros before the first request
        for m in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e):
            m.labels(model_name)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)
        for reason in ("stop", "abort", "error"):
            self.embeddings.labels(model_name, reason)
        for reason in ("overloaded", "invalid"):
            self.rejected.labels(model_name, reason)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def finished(self, out: RequestOutput) -> None:
        """Record one engine request's end (each of its ``n`` samples counts as generated tokens)."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
        gen = sum(len(c.token_ids) for c in out.outputs)
        self.generation_tokens.labels(name).inc(gen)
        for c in out.outputs:
            self.request_success.labels(name, c.finish_reason or "abort").inc()
        m = out.metrics
        arrival, first, done = m.get("arrival_time"), m.get("first_token_time"), m.get("finish_time")
        if arrival is not None and first is not None:
            self.ttft.labels(name).observe(max(first - arrival, 0.0))
        if arrival is not None and done is not None:
            self.e2e.labels(name).observe(max(done - arrival, 0.0))
        if first is not None and done is not None:
            longest = max((len(c.token_ids) for c in out.outputs), default=0)
            if longest > 1:
                self.tpot.labels(name).observe(max(done - first, 0.0) / (longest - 1))

    def embedded(self, out: EmbeddingRequestOutput) -> None:
        """Record one embedding request's end: its prompt tokens, and one finished request (nothing is generated)."""
        reason = out.finish_reason or "abort"
        self.prompt_tokens.labels(self.model_name).inc(len(out.prompt_token_ids))
        self.request_success.labels(self.model_name, reason).inc()
        self.embeddings.labels(self.model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
