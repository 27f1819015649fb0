"""Prometheus metrics of one server instance, in its own ``CollectorRegistry`` (no process-global state: two
apps in one process, e.g. in tests, never share or clash).

Request-side series (counters, latency histograms) are updated by the HTTP layer; engine-side series (queue,
running batch, KV pages, prefix cache) are read from the engine loop's latest ``EngineStats`` snapshot at scrape
time, so a scrape never waits for the engine thread.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.engine import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield GaugeMetricFamily("mimw_queue_length", "Requests waiting to be scheduled", s.waiting)
        yield GaugeMetricFamily("mimw_running_requests", "Requests in the running batch", s.running)
        yield GaugeMetricFamily("mimw_kv_pages_total", "KV cache pages in the pool", s.pages_total)
        yield GaugeMetricFamily("mimw_kv_pages_in_use", "KV pages referenced by live requests", s.pages_in_use)
        yield GaugeMetricFamily("mimw_kv_pages_cached", "Unreferenced KV pages kept for prefix reuse (evictable)",
                                s.pages_cached)
        rate = s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0.0
        yield GaugeMetricFamily("mimw_prefix_cache_hit_rate",
                                "Fraction of prompt tokens served from the prefix cache since start", rate)
        yield CounterMetricFamily("mimw_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache",
                                  s.prefix_query_tokens)
        yield CounterMetricFamily("mimw_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                                  s.prefix_hit_tokens)
        yield CounterMetricFamily("mimw_preemptions", "Requests preempted (pages freed, recomputed later)",
                                  s.preemptions)
        yield CounterMetricFamily("mimw_engine_steps", "Engine steps run", s.steps)


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("mimw_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("mimw_request_finish", "Finished generations by finish reason", ["reason"],
                                registry=r)
        self.prompt_tokens = Counter("mimw_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.generation_tokens = Counter("mimw_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("mimw_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("mimw_inter_token_latency_seconds", "Time between consecutive generated tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("mimw_request_latency_seconds", "Arrival to the last token of a generation",
                             buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
