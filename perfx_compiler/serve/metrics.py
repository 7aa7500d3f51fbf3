"""Prometheus metrics of the server, on a registry of its own (several apps can live in one process).

Counters and histograms are fed by the scheduler (as its ``Observer``) and by the
HTTP layer; gauges (queue depth, running sequences, KV pages) read the scheduler's
latest published stats when scraped.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from perfx_compiler.serve.scheduler import SchedulerStats

__all__ = ["CONTENT_TYPE_LATEST", "ServingMetrics"]

disable_created_metrics()  # no "*_created" timestamp series next to every counter

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ServingMetrics:
    """All ``perfx_*`` series of one server."""

    def __init__(self, stats: Callable[[], SchedulerStats], model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "perfx_requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=r
        )
        self.finished = Counter(
            "perfx_sequences_finished", "Finished sequences by finish reason", ["reason"], registry=r
        )
        self.prompt_tokens = Counter("perfx_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generated_tokens = Counter("perfx_generation_tokens", "Generated tokens", registry=r)
        # Per admitted sequence (a preempted one is looked up again when it comes back), as vLLM counts.
        self.prefix_queries = Counter(
            "perfx_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hits = Counter("perfx_prefix_cache_hits", "Prompt tokens found in the prefix cache", registry=r)
        self._queried = self._hit = 0
        Gauge(
            "perfx_prefix_cache_hit_rate",
            "Prefix-cache hit tokens / prompt tokens looked up (0 before any)",
            registry=r,
        ).set_function(lambda: self._hit / self._queried if self._queried else 0.0)
        self.ttft = Histogram(
            "perfx_time_to_first_token_seconds", "Request arrival to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "perfx_inter_token_latency_seconds", "Time between tokens of a sequence", buckets=_ITL_BUCKETS, registry=r
        )
        self._stats = stats
        Gauge("perfx_queue_depth", "Requests waiting for admission", registry=r).set_function(
            lambda: stats().queue_depth
        )
        Gauge("perfx_running_sequences", "Sequences in the batch (holding KV pages)", registry=r).set_function(
            lambda: stats().running
        )
        Gauge("perfx_kv_pages_used", "KV cache pages held by sequences", registry=r).set_function(
            lambda: stats().kv_pages_used
        )
        Gauge(
            "perfx_kv_pages_cached",
            "KV cache pages held by no sequence, kept for their prefix (free to take)",
            registry=r,
        ).set_function(lambda: stats().kv_pages_cached)
        Gauge("perfx_kv_pages_total", "KV cache pages in the pool", registry=r).set_function(
            lambda: stats().kv_pages_total
        )
        Gauge("perfx_preemptions", "Sequences preempted (recomputed) so far", registry=r).set_function(
            lambda: stats().preemptions
        )
        info = Gauge("perfx_model_info", "The served model", ["model"], registry=r)
        info.labels(model=model_name).set(1)

    # -- scheduler Observer ---------------------------------------------------------------------
    def on_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def on_prefix_cache(self, queried: int, hit: int) -> None:
        self.prefix_queries.inc(queried)
        self.prefix_hits.inc(hit)
        self._queried += queried
        self._hit += hit

    def on_generated_tokens(self, n: int) -> None:
        self.generated_tokens.inc(n)

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def on_sequence_finished(self, reason: str) -> None:
        self.finished.labels(reason=reason).inc()

    # -- HTTP -------------------------------------------------------------------------------------
    def on_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
