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
    corerun:engine_up{engine}                                  gauge, data parallelism only: 1 serving, 0 lost

With data parallelism (``server.data_parallel_size``) every series but the rejections carries an ``engine``
label: ``0``, ``1``, ... for each replica and ``all`` for their sum (sum over ``engine!="all"``, or read
``all``).
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from corerun.outputs import EmbeddingRequestOutput, RequestOutput
from corerun.server.served import EngineStats

disable_created_metrics()  # no *_created series (as vLLM): they double the output and no dashboard reads them

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class _EngineCollector(Collector):
    """What the engines know at scrape time (a scrape reads plain counters; it never waits for a step)."""

    def __init__(self, served: Any, model_name: str) -> None:
        self.served = served
        self.model_name = model_name

    def collect(self) -> Iterator[Any]:
        engines, stats = self.served.engine_labels, self.served.stats()
        names = ["model_name"] if engines is None else ["model_name", "engine"]
        if engines is None:
            series = [([self.model_name], stats[0])]
        else:
            up = GaugeMetricFamily("corerun:engine_up", "1 while the data-parallel replica serves, 0 once lost.",
                                   labels=names)
            for label, s in zip(engines, stats):
                up.add_metric([self.model_name, label], 0.0 if s is None else 1.0)
            yield up
            series = [([self.model_name, label], s) for label, s in zip(engines, stats) if s is not None]
            series.append(([self.model_name, "all"], _total([s for _, s in series])))
        for name, doc, field in (
            ("vllm:num_requests_running", "Requests in the running batch.", "running"),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", "waiting"),
        ):
            g = GaugeMetricFamily(name, doc, labels=names)
            for labels, s in series:
                g.add_metric(labels, getattr(s, field))
            yield g
        kv = [(labels, s) for labels, s in series if s.kv]  # (an engine whose KV stats() raised: read next time)
        g = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block in use.", labels=names)
        for labels, s in kv:
            g.add_metric(labels, 1.0 - s.free_blocks / s.num_blocks if s.num_blocks else 0.0)
        yield g
        counters = [
            ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv, "prefix_queries"),
            ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv, "prefix_hits"),
            ("vllm:num_preemptions", "Preemptions (a sequence's blocks freed, to be recomputed).", series, "preemptions"),
        ]
        spec = [(labels, s) for labels, s in series if s.spec is not None]
        if spec:
            counters += [
                ("vllm:spec_decode_num_drafts", "Decode rows that carried draft tokens.", spec, 0),
                ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", spec, 1),
                ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec, 2),
            ]
        for name, doc, rows, field in counters:
            c = CounterMetricFamily(name, doc, labels=names)
            for labels, s in rows:
                c.add_metric(labels, s.spec[field] if isinstance(field, int) else getattr(s, field))
            yield c


def _total(stats: list[EngineStats]) -> EngineStats:
    """The replicas' counters summed (usage then reads as all blocks in use over all blocks)."""
    kv = [s for s in stats if s.kv] if stats and all(s.kv for s in stats) else []
    spec = [s.spec for s in stats if s.spec is not None]
    return EngineStats(
        running=sum(s.running for s in stats), waiting=sum(s.waiting for s in stats),
        preemptions=sum(s.preemptions for s in stats),
        num_blocks=sum(s.num_blocks for s in kv) if kv else None,  # type: ignore[misc]
        free_blocks=sum(s.free_blocks for s in kv) if kv else None,  # type: ignore[misc]
        prefix_queries=sum(s.prefix_queries for s in kv) if kv else None,  # type: ignore[misc]
        prefix_hits=sum(s.prefix_hits for s in kv) if kv else None,  # type: ignore[misc]
        spec=tuple(sum(x[i] for x in spec) for i in range(3)) if spec else None,  # type: ignore[arg-type]
    )


class ServerMetrics:
    """The server's registry. With several engines (data parallelism) every series but
    ``corerun:requests_rejected`` carries an ``engine`` label: each replica's index, and ``all`` for their sum."""

    def __init__(self, served: Any, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.served = served
        engines = served.engine_labels
        r, ln = self.registry, ["model_name"] if engines is None else ["model_name", "engine"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", ln, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens of finished requests.", ln, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       ln + ["finished_reason"], registry=r)
        self.embeddings = Counter("corerun:embedding_requests", "Finished embedding requests (one per input) "
                                  "by finish reason.", ln + ["finished_reason"], registry=r)
        self.rejected = Counter("corerun:requests_rejected", "Requests refused before reaching the engine.",
                                ["model_name", "reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", ln,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token after the first.", ln,
                              buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.", ln,
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(served, model_name))
        # touch each label set so that a scrape shows zeros before the first request
        every = [(model_name,)] if engines is None else [(model_name, e) for e in [*engines, "all"]]
        for key in every:
            for m in (self.prompt_tokens, self.generation_tokens, self.ttft, self.tpot, self.e2e):
                m.labels(*key)
            for reason in ("stop", "length", "abort", "error"):
                self.request_success.labels(*key, reason)
            for reason in ("stop", "abort", "error"):
                self.embeddings.labels(*key, reason)
        for reason in ("overloaded", "invalid"):
            self.rejected.labels(model_name, reason)

    def reject(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def _keys(self, request_id: str) -> list[tuple[str, ...]]:
        """The label sets a request's end counts in: its engine's, and ``all`` under data parallelism."""
        if self.served.engine_labels is None:
            return [(self.model_name,)]
        engine = self.served.engine_of(request_id)
        return [(self.model_name, "all")] + ([(self.model_name, str(engine))] if engine is not None else [])

    def finished(self, out: RequestOutput) -> None:
        """Record one engine request's end (each of its ``n`` samples counts as generated tokens)."""
        gen = sum(len(c.token_ids) for c in out.outputs)
        m = out.metrics
        arrival, first, done = m.get("arrival_time"), m.get("first_token_time"), m.get("finish_time")
        longest = max((len(c.token_ids) for c in out.outputs), default=0)
        for key in self._keys(out.request_id):
            self.prompt_tokens.labels(*key).inc(len(out.prompt_token_ids))
            self.generation_tokens.labels(*key).inc(gen)
            for c in out.outputs:
                self.request_success.labels(*key, c.finish_reason or "abort").inc()
            if arrival is not None and first is not None:
                self.ttft.labels(*key).observe(max(first - arrival, 0.0))
            if arrival is not None and done is not None:
                self.e2e.labels(*key).observe(max(done - arrival, 0.0))
            if first is not None and done is not None and longest > 1:
                self.tpot.labels(*key).observe(max(done - first, 0.0) / (longest - 1))

    def embedded(self, out: EmbeddingRequestOutput) -> None:
        """Record one embedding request's end: its prompt tokens, and one finished request (nothing is generated)."""
        reason = out.finish_reason or "abort"
        for key in self._keys(out.request_id):
            self.prompt_tokens.labels(*key).inc(len(out.prompt_token_ids))
            self.request_success.labels(*key, reason).inc()
            self.embeddings.labels(*key, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
