"""What the server exposes at /metrics, in the Prometheus text format. Chapter 11.

Names follow Prometheus' conventions (a `llminfer_` prefix, base units, `_total` for counters) and
mirror what vLLM exports, so the same dashboards read both:

| metric | type | meaning |
| --- | --- | --- |
| `llminfer_num_requests_waiting` | gauge | requests not yet scheduled (the engine's queue and the inbox) |
| `llminfer_num_requests_running` | gauge | requests in the running batch |
| `llminfer_kv_blocks_used`, `llminfer_kv_blocks_total` | gauge | KV pool blocks in use, and in all |
| `llminfer_kv_cache_usage_ratio` | gauge | used / total |
| `llminfer_prefix_cache_hit_rate` | gauge | prompt positions found in the prefix cache / positions looked up |
| `llminfer_prefix_cache_queries_total`, `..._hits_total` | counter | those positions, counted |
| `llminfer_engine_steps_total`, `llminfer_preemptions_total` | counter | engine steps run; preemptions |
| `llminfer_prompt_tokens_total`, `llminfer_generation_tokens_total` | counter | tokens in and out |
| `llminfer_requests_total{finish_reason}` | counter | finished requests: stop, length, abort |
| `llminfer_requests_rejected_total{reason}` | counter | refused: invalid, queue_full, unavailable |
| `llminfer_time_to_first_token_seconds` | histogram | TTFT as the engine saw it |
| `llminfer_inter_token_latency_seconds` | histogram | every gap between a request's tokens (ITL) |
| `llminfer_e2e_request_latency_seconds` | histogram | arrival to last token |
| `llminfer_request_queue_time_seconds` | histogram | arrival to first scheduled step |

The gauges and the engine's counters are read from the engine loop's latest stats snapshot when
/metrics is scraped; the histograms are filled as requests finish. Each server has its own registry,
so several servers in one process (tests, notebooks) do not mix their numbers.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ServerMetrics", "TTFT_BUCKETS", "ITL_BUCKETS", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Gauges and counters read from the engine loop's stats snapshot at scrape time."""

    def __init__(self, source):
        self.source = source            # an object with .stats (EngineStats) and .num_queued

    def collect(self):
        stats = self.source.stats
        gauges = (
            ("llminfer_num_requests_waiting", "Requests waiting to be scheduled", self.source.num_queued),
            ("llminfer_num_requests_running", "Requests in the running batch", stats.num_running),
            ("llminfer_kv_blocks_used", "KV-cache blocks in use", stats.blocks_used),
            ("llminfer_kv_blocks_total", "KV-cache blocks in the pool", stats.num_blocks),
            ("llminfer_kv_cache_usage_ratio", "KV-cache blocks in use / blocks in the pool", stats.usage),
            ("llminfer_prefix_cache_hit_rate", "Prompt positions served by the prefix cache / positions looked up",
             stats.prefix_hit_rate),
        )
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], float(value))
            yield family
        counters = (
            ("llminfer_engine_steps", "Engine steps run", stats.steps),
            ("llminfer_preemptions", "Requests preempted (recomputed later) for lack of KV blocks", stats.preemptions),
            ("llminfer_prefix_cache_queries", "Prompt positions looked up in the prefix cache",
             stats.prefix_query_tokens),
            ("llminfer_prefix_cache_hits", "Prompt positions found in the prefix cache", stats.prefix_hit_tokens),
        )
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc)
            family.add_metric([], float(value))
            yield family


class ServerMetrics:
    """The server's Prometheus registry: engine gauges at scrape time, request histograms as they finish. Chapter 11."""

    def __init__(self, source):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(source))
        r = self.registry
        self.prompt_tokens = Counter("llminfer_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("llminfer_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("llminfer_requests", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("llminfer_requests_rejected", "Requests refused, by reason", ["reason"], registry=r)
        self.ttft = Histogram("llminfer_time_to_first_token_seconds", "Time to first token (engine)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("llminfer_inter_token_latency_seconds", "Gap between consecutive tokens (engine)",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("llminfer_e2e_request_latency_seconds", "Arrival to last token (engine)",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram("llminfer_request_queue_time_seconds", "Arrival to first scheduled step",
                                    buckets=TTFT_BUCKETS, registry=r)
        for reason in ("stop", "length", "abort"):
            self.requests.labels(reason)
        for reason in ("invalid", "queue_full", "unavailable"):
            self.rejected.labels(reason)

    def on_step(self, num_new_tokens: int, stats) -> None:
        self.generation_tokens.inc(num_new_tokens)

    def on_finish(self, output) -> None:
        """Records a finished request's engine timings (called on the engine thread)."""
        self.requests.labels(output.finish_reason or "abort").inc()
        self.prompt_tokens.inc(output.num_prompt_tokens)
        if output.token_ids:
            self.ttft.observe(output.ttft_s)
            self.e2e.observe(output.e2e_s)
            self.queue_time.observe(output.queue_s)
            for gap in output.itl_s:
                self.itl.observe(gap)

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format."""
        return generate_latest(self.registry)
