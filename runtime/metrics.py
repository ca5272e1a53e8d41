"""Prometheus metrics of a server: request counts and latencies observed by the HTTP side, engine
state read from the loop at scrape time (so the step loop pays nothing for them)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .loop import EngineLoop

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0)


class _LoopCollector:
    def __init__(self, loop: EngineLoop):
        self.loop = loop

    def collect(self):
        s = self.loop.snapshot()
        gauges = [("infeng_queue_depth", "sequences waiting for admission", s["waiting"]),
                  ("infeng_running_sequences", "sequences holding KV blocks", s["running"]),
                  ("infeng_kv_blocks_used", "KV blocks referenced by live sequences", s["kv_blocks_used"]),
                  ("infeng_kv_blocks_total", "KV blocks in the pool", s["kv_blocks_total"]),
                  ("infeng_kv_blocks_cached", "full KV blocks published in the prefix cache", s["kv_blocks_cached"]),
                  ("infeng_tokens_per_second", "generated tokens per second over the last 10 s",
                   self.loop.tokens_per_second()),
                  ("infeng_step_overhead_seconds", "mean Python time per step outside the forward call",
                   s["overhead_seconds_per_step"])]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [("infeng_prefix_cache_hits", "KV blocks found in the prefix cache at admission", s["prefix_hits"]),
                    ("infeng_prefix_cache_queries", "KV blocks looked up in the prefix cache", s["prefix_queries"]),
                    ("infeng_prefix_cache_misses", "KV blocks looked up and not found (queries - hits)",
                     s["prefix_queries"] - s["prefix_hits"]),
                    ("infeng_preemptions", "sequences preempted (recompute) for lack of KV blocks", s["preemptions"]),
                    ("infeng_prompt_tokens", "prompt tokens of admitted sequences", s["prompt_tokens"]),
                    ("infeng_prompt_tokens_computed", "prompt tokens run (not served from the prefix cache)",
                     s["computed_prompt_tokens"]),
                    ("infeng_generation_tokens", "tokens generated", s["generated_tokens"]),
                    ("infeng_steps", "forward steps run", s["steps"]),
                    ("infeng_step_seconds", "time in loop iterations that ran a step", s["step_seconds"]),
                    ("infeng_step_forward_seconds", "time of those inside the forward call", s["forward_seconds"])]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    """One registry per server (tests run several in one process)."""

    def __init__(self, loop: EngineLoop):
        self.registry = CollectorRegistry()
        self.requests = Counter("infeng_requests", "HTTP requests to the API by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("infeng_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("infeng_inter_token_latency_seconds", "time between two tokens of one choice",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("infeng_request_seconds", "request arrival to its last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_LoopCollector(loop))

    def render(self) -> bytes:
        return generate_latest(self.registry)
