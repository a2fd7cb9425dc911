"""Prometheus metrics for `eagle3 serve`, with vLLM's names under the `eagle3:` prefix.

Counters and gauges are read from `engine.metrics()` on every scrape (a custom
collector, so they never drift from the engine). Latency histograms are observed
once per request, when it finishes, from `request.metrics`. Every app gets its own
`CollectorRegistry`, so several servers can live in one process (tests).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "eagle3:"

# (engine.metrics() key, exported name, help). Counters are exposed with a `_total` suffix.
COUNTERS = (
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Speculative rounds that drafted tokens."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    ("suffix_draft_tokens", "suffix_draft_tokens", "Draft tokens only the text proposed (suffix)."),
    ("suffix_accepted_tokens", "suffix_accepted_tokens", "Accepted draft tokens only the text proposed."),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens processed."),
    ("generation_tokens", "generation_tokens", "Tokens generated."),
    ("requests_finished", "request_success", "Requests finished (stop token or length)."),
    ("requests_aborted", "request_aborted", "Requests aborted (client gone, timeout, shutdown)."),
    ("requests_failed", "request_failed", "Requests failed by an error."),
)
GAUGES = (
    ("num_running", "num_requests_running", "Requests in the running batch."),
    ("num_waiting", "num_requests_waiting", "Requests waiting to be admitted."),
    ("kv_usage", "kv_cache_usage_perc", "KV pool usage, 0..1 (1 = full)."),
    ("kv_used_tokens", "kv_cache_used_tokens", "KV pool slots reserved by requests."),
    ("kv_total_tokens", "kv_cache_total_tokens", "KV pool size in tokens."),
)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
HISTOGRAMS = (  # (request.metrics key, exported name, help)
    ("ttft_s", "time_to_first_token_seconds", "Time from arrival to the first generated token."),
    ("itl_s", "inter_token_latency_seconds", "Mean time between generated tokens, per request."),
    ("queue_s", "request_queue_time_seconds", "Time a request waited before it was admitted."),
    ("e2e_s", "e2e_request_latency_seconds", "Time from arrival to the end of the request."),
)


class EngineCollector(Collector):
    """Counters and gauges from `engine.metrics()`, read at scrape time."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        m = self.engine.metrics()
        for key, name, doc in COUNTERS:
            if key in m:
                yield CounterMetricFamily(PREFIX + name, doc, value=m[key])
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position (0 = first).",
                                      labels=["position"])
        for pos, n in enumerate(m.get("spec_decode_num_accepted_tokens_per_pos", [])):
            per_pos.add_metric([str(pos)], n)
        yield per_pos
        for key, name, doc in GAUGES:
            if key in m:
                yield GaugeMetricFamily(PREFIX + name, doc, value=m[key])


class ServerMetrics:
    """One app's registry: the engine collector plus per-request latency histograms."""

    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine))
        self.histograms = {key: Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)
                           for key, name, doc in HISTOGRAMS}
        # Requests the server itself turned away or cut off, by reason (unauthorized,
        # too_many_requests, stalled_stream).
        self.refused = Counter(PREFIX + "server_refused_requests", "Requests refused or cut off by the "
                               "server, by reason.", ["reason"], registry=self.registry)

    def observe(self, request_metrics: dict[str, Any]) -> None:
        """Record one finished request's latencies (missing ones, e.g. never admitted, are skipped)."""
        for key, hist in self.histograms.items():
            value = request_metrics.get(key)
            if value is not None:
                hist.observe(value)

    def render(self) -> tuple[bytes, str]:
        """(Prometheus text exposition, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
