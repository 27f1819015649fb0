"""Prometheus metrics of one server instance, in its own ``CollectorRegistry`` (no process-global state: two
apps in one process, e.g. in tests, never share or clash). Every series carries a ``model_name`` label; the
names follow vLLM's with the ``mimw_`` prefix (docs/metrics.md maps each to its vLLM equivalent), so existing
dashboards need only the prefix changed.

Engine-side series (queue, running batch, KV usage, prefix cache, token counters) are read from the engine
loop's latest ``EngineStats`` snapshot at scrape time, so a scrape never waits for the engine thread; tokens are
counted by the engine when they are computed or sampled (an aborted request's tokens count too).
Request-side series (latency histograms, finish reasons) are observed by a ``RequestTracker`` per engine request,
called on the engine thread for each of its events, so a request whose client went away is still measured.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from ..engine.engine import EngineStats
from ..engine.request import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                          0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self.stats = stats
        self.model = model_name

    def _one(self, family: type, name: str, doc: str, value: float) -> Metric:
        m = family(name, doc, labels=["model_name"])
        m.add_metric([self.model], value)
        return m

    def _split(self, family: type, name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
        m = family(name, doc, labels=["model_name", label])
        for k, v in values.items():
            m.add_metric([self.model, k], v)
        return m

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        g, c = GaugeMetricFamily, CounterMetricFamily
        yield self._one(g, "mimw_num_requests_running", "Requests in the running batch", s.running)
        yield self._one(g, "mimw_num_requests_waiting", "Requests waiting to be scheduled", s.waiting)
        yield self._one(g, "mimw_kv_cache_usage_perc", "Fraction of KV pages referenced by live requests (0-1)",
                        s.pages_in_use / s.pages_total if s.pages_total else 0.0)
        yield self._one(g, "mimw_kv_pages_total", "KV cache pages in the pool", s.pages_total)
        yield self._one(g, "mimw_kv_pages_in_use", "KV pages referenced by live requests", s.pages_in_use)
        yield self._one(g, "mimw_kv_pages_cached", "Unreferenced KV pages kept for prefix reuse (evictable)",
                        s.pages_cached)
        rate = s.prefix_hit_tokens / s.prefix_query_tokens if s.prefix_query_tokens else 0.0
        yield self._one(g, "mimw_prefix_cache_hit_rate",
                        "Fraction of prompt tokens served from the prefix cache since start", rate)
        yield self._one(c, "mimw_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                        s.prefix_query_tokens)
        yield self._one(c, "mimw_prefix_cache_hits", "Prompt tokens found in the prefix cache", s.prefix_hit_tokens)
        yield self._one(c, "mimw_num_preemptions", "Requests preempted (pages freed, recomputed later)",
                        s.preemptions)
        yield self._one(c, "mimw_prompt_tokens", "Prompt tokens of requests whose prefill completed",
                        s.prompt_tokens)
        yield self._one(c, "mimw_generation_tokens", "Tokens generated, counted as they are sampled",
                        s.generation_tokens)
        yield self._one(c, "mimw_engine_steps", "Engine steps run", s.steps)
        yield self._split(c, "mimw_prefix_cache_tier_hits", "Prompt tokens found in the prefix cache, by the tier "
                          "that held them", "tier", {"device": s.prefix_hit_tokens - s.prefix_host_hit_tokens,
                                                      "host": s.prefix_host_hit_tokens})
        yield self._one(g, "mimw_kv_host_pages_total", "KV pages in the host-memory tier", s.host_pages_total)
        yield self._one(g, "mimw_kv_host_pages_used", "Host-tier KV pages holding a cached page", s.host_pages_used)
        yield self._split(c, "mimw_kv_host_copied_bytes", "KV bytes copied between the device and the host tier",
                          "direction", {"to_host": s.kv_bytes_to_host, "to_device": s.kv_bytes_to_device})
        yield self._one(g, "mimw_num_requests_restoring", "Admitted requests waiting for KV pages from the host tier",
                        s.restoring)
        yield self._one(g, "mimw_num_sessions_live", "Sessions whose KV pages are retained", s.sessions_live)
        if s.spec is not None:
            yield from self._spec(s.spec)

    def _spec(self, spec) -> Iterator[Metric]:
        """Speculative decoding: drafted and accepted tokens, and a histogram of accepted drafts per verify step."""
        c = CounterMetricFamily
        yield self._one(c, "mimw_spec_decode_num_draft_tokens", "Tokens proposed by the drafter and verified",
                        spec.draft_tokens)
        yield self._one(c, "mimw_spec_decode_num_accepted_tokens", "Drafted tokens the target accepted",
                        spec.accepted_tokens)
        cumulative, buckets = 0, []
        for a, n in enumerate(spec.accepted_hist):
            cumulative += n
            buckets.append((str(a), cumulative))
        buckets.append(("+Inf", cumulative))
        h = HistogramMetricFamily("mimw_spec_decode_accepted_length", "Drafted tokens accepted per verify step",
                                  labels=["model_name"])
        h.add_metric([self.model], buckets, spec.accepted_tokens)
        yield h


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str = "mimw"):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, m = self.registry, ["model_name"]

        def hist(name: str, doc: str, buckets: tuple = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=r).labels(model_name)

        self._requests = Counter("mimw_requests", "HTTP requests by endpoint and status code",
                                 [*m, "endpoint", "status"], registry=r)
        self._finished = Counter("mimw_request_success", "Finished generations by finish reason",
                                 [*m, "finished_reason"], registry=r)
        self.ttft = hist("mimw_time_to_first_token_seconds", "Arrival to first generated token")
        self.itl = hist("mimw_inter_token_latency_seconds", "Time between consecutive generated tokens",
                        _TOKEN_LATENCY_BUCKETS)
        self.tpot = hist("mimw_request_time_per_output_token_seconds",
                         "Decode time of a request divided by its output tokens after the first",
                         _TOKEN_LATENCY_BUCKETS)
        self.e2e = hist("mimw_e2e_request_latency_seconds", "Arrival to the last token of a generation")
        self.queue = hist("mimw_request_queue_time_seconds", "Arrival to first scheduled (waiting)")
        self.prefill = hist("mimw_request_prefill_time_seconds", "First scheduled to first token")
        self.decode = hist("mimw_request_decode_time_seconds", "First token to last token")
        self.inference = hist("mimw_request_inference_time_seconds", "First scheduled to last token")
        self.prompt_len = hist("mimw_request_prompt_tokens", "Prompt tokens per finished request", _TOKEN_BUCKETS)
        self.output_len = hist("mimw_request_generation_tokens", "Generated tokens per finished request",
                               _TOKEN_BUCKETS)
        self.max_tokens = hist("mimw_request_params_max_tokens", "max_tokens of each request", _TOKEN_BUCKETS)
        r.register(_EngineCollector(stats, model_name))

    def request(self, endpoint: str, status: int | str) -> None:
        self._requests.labels(self.model_name, endpoint, str(status)).inc()

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def tracker(self, t0: float, max_tokens: int) -> "RequestTracker":
        self.max_tokens.observe(max_tokens)
        return RequestTracker(self, t0)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Latency bookkeeping of one engine request; ``observe`` runs on the engine thread for each event."""

    def __init__(self, m: ServerMetrics, t0: float):
        self.m, self.t0, self.last = m, t0, None

    def observe(self, ev: RequestOutput, t: float) -> None:
        m = self.m
        if ev.token_ids:
            if self.last is None:
                m.ttft.observe(t - self.t0)
            else:
                m.itl.observe(t - self.last)
            self.last = t
        if not ev.finished:
            return
        m.finished(ev.finish_reason or "unknown")
        if ev.finish_reason not in ("stop", "length") or ev.times is None:
            return
        tt = ev.times
        m.e2e.observe(t - self.t0)
        m.prompt_len.observe(ev.prompt_tokens)
        m.output_len.observe(ev.completion_tokens)
        if tt.scheduled is not None:
            m.queue.observe(tt.scheduled - tt.arrival)
            m.inference.observe(tt.finished - tt.scheduled)
            if tt.first_token is not None:
                m.prefill.observe(tt.first_token - tt.scheduled)
        if tt.first_token is not None:
            m.decode.observe(tt.finished - tt.first_token)
            if ev.completion_tokens > 1:
                m.tpot.observe((tt.finished - tt.first_token) / (ev.completion_tokens - 1))
