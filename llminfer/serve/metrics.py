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
| `llminfer_requests_total{finish_reason}` | counter | finished requests: stop, length, abort, error |
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

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["ServerMetrics", "TTFT_BUCKETS", "ITL_BUCKETS", "CONTENT_TYPE", "parse_metrics", "MetricsPoller"]

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
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(reason)
        for reason in ("invalid", "queue_full", "unavailable", "unauthorized"):
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


def parse_metrics(text: str) -> dict:
    """Prometheus text to {sample name: value} (labelled samples as 'name{key="value",...}')."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


class MetricsPoller:
    """Scrapes a server's /metrics every interval_s on a background thread; `samples` is [(t, {name: value})]. Chapter 11.

        with MetricsPoller(server.url) as poller:
            ...                                   # the load
        times, waiting = poller.series("llminfer_num_requests_waiting")
    """

    def __init__(self, url: str, interval_s: float = 0.05, timeout_s: float = 2.0):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s!r}")
        self.url = url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.samples: list[tuple[float, dict]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _run(self) -> None:
        import urllib.request
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                with urllib.request.urlopen(self.url, timeout=self.timeout_s) as response:
                    values = parse_metrics(response.read().decode())
                self.samples.append((started - self._t0, values))
            except OSError:
                self.errors += 1
            self._stop.wait(max(0.0, self.interval_s - (time.perf_counter() - started)))

    def start(self) -> "MetricsPoller":
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="llminfer-metrics-poller", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 1)

    def __enter__(self) -> "MetricsPoller":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def series(self, name: str) -> tuple[list[float], list[float]]:
        """(times in s from start, values) of one sample name across the scrapes that had it."""
        points = [(t, values[name]) for t, values in self.samples if name in values]
        return [t for t, _ in points], [v for _, v in points]
