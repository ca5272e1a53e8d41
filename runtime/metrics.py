"""Prometheus metrics of a server: request counts and latencies observed by the HTTP side, engine
state read from the loop at scrape time (so the step loop pays nothing for them).

Beside infeng's own names, the ones vLLM exports (``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ``vllm:lora_requests_info``, ...; label ``model_name``), which the
Kubernetes inference gateway and llm-d route on. vLLM counts prefix-cache queries and hits in
tokens: infeng's block counts times the block size."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .loop import EngineLoop

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0)


class _LoopCollector:
    def __init__(self, loop: EngineLoop, model_name: str):
        self.loop = loop
        self.model_name = model_name

    def _vllm(self, s: dict):
        labels, values = ["model_name"], [self.model_name]
        block = self.loop.limits.block_size
        gauges = [("vllm:num_requests_running", "sequences running (holding KV blocks)", s["running"]),
                  ("vllm:num_requests_waiting", "sequences waiting for admission", s["waiting"]),
                  ("vllm:kv_cache_usage_perc", "fraction of the KV block pool in use (1 = full)",
                   s["kv_blocks_used"] / s["kv_blocks_total"] if s["kv_blocks_total"] else 0.0)]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            yield g
        counters = [("vllm:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
                     s["prefix_queries"] * block),
                    ("vllm:prefix_cache_hits", "prompt tokens found in the prefix cache", s["prefix_hits"] * block),
                    ("vllm:num_preemptions", "preemptions (recompute)", s["preemptions"]),
                    ("vllm:prompt_tokens", "prompt tokens of admitted sequences", s["prompt_tokens"]),
                    ("vllm:generation_tokens", "tokens generated", s["generated_tokens"])]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            yield c
        running, waiting = self.loop.adapters_in_flight()
        info = GaugeMetricFamily("vllm:lora_requests_info", "adapters of the running and waiting requests (value: "
                                 "the scrape's time)", labels=["max_lora", "running_lora_adapters",
                                                                "waiting_lora_adapters"])
        slots = getattr(self.loop.adapters, "n_slots", 0) if self.loop.adapters is not None else 0
        info.add_metric([str(slots), ",".join(running), ",".join(waiting)], time.time())
        yield info

    def collect(self):
        s = self.loop.snapshot()
        yield from self._vllm(s)
        gauges = [("infeng_queue_depth", "sequences waiting for admission", s["waiting"]),
                  ("infeng_running_sequences", "sequences holding KV blocks", s["running"]),
                  ("infeng_kv_blocks_used", "KV blocks referenced by live sequences", s["kv_blocks_used"]),
                  ("infeng_kv_blocks_total", "KV blocks in the pool", s["kv_blocks_total"]),
                  ("infeng_kv_blocks_cached", "full KV blocks published in the prefix cache", s["kv_blocks_cached"]),
                  ("infeng_kv_bytes_touched", "KV blocks handed out since start x block bytes (a lower "
                   "bound of the KV memory committed)", s["kv_bytes_touched"]),
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
                    ("infeng_late_mask_skips", "steps a sequence sat out because its grammar mask was late",
                     s["late_mask_skips"]),
                    ("infeng_step_seconds", "time in loop iterations that ran a step", s["step_seconds"]),
                    ("infeng_step_forward_seconds", "time of those inside the forward call", s["forward_seconds"])]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


class _Observers:
    """Observes a value into several histograms (infeng's and vLLM's name for one quantity)."""

    def __init__(self, *histograms):
        self.histograms = histograms

    def observe(self, value: float) -> None:
        for h in self.histograms:
            h.observe(value)


class ServerMetrics:
    """One registry per server (tests run several in one process)."""

    def __init__(self, loop: EngineLoop, model_name: str = ""):
        self.registry = CollectorRegistry()
        self.requests = Counter("infeng_requests", "HTTP requests to the API by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)

        def pair(name: str, vllm_name: str, doc: str) -> _Observers:
            ours = Histogram(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)
            theirs = Histogram(vllm_name, doc, ["model_name"], buckets=LATENCY_BUCKETS, registry=self.registry)
            return _Observers(ours, theirs.labels(model_name))

        self.ttft = pair("infeng_time_to_first_token_seconds", "vllm:time_to_first_token_seconds",
                         "request arrival to its first token")
        self.itl = pair("infeng_inter_token_latency_seconds", "vllm:inter_token_latency_seconds",
                        "time between two tokens of one choice")
        self.e2e = pair("infeng_request_seconds", "vllm:e2e_request_latency_seconds",
                        "request arrival to its last token")
        self.registry.register(_LoopCollector(loop, model_name))
        self.registry.register(_SpecCollector(loop))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecCollector:
    """Speculative decoding counters (docs/speculative.md), under infeng's and vLLM's names."""

    def __init__(self, loop: EngineLoop):
        self.loop = loop

    def collect(self):
        s = self.loop.snapshot()
        drafted, accepted = s["spec_draft_tokens"], s["spec_accepted_tokens"]
        counters = [("infeng_spec_decode_drafts", "vllm:spec_decode_num_drafts",
                     "verification steps of a sequence with drafted tokens", s["spec_drafts"]),
                    ("infeng_spec_decode_draft_tokens", "vllm:spec_decode_num_draft_tokens", "tokens drafted",
                     drafted),
                    ("infeng_spec_decode_accepted_tokens", "vllm:spec_decode_num_accepted_tokens",
                     "drafted tokens the target accepted", accepted)]
        for ours, theirs, doc, value in counters:
            yield CounterMetricFamily(ours, doc, value=value)
            yield CounterMetricFamily(theirs, doc, value=value)
        rate = accepted / drafted if drafted else 0.0
        yield GaugeMetricFamily("infeng_spec_decode_acceptance_rate", "accepted / drafted tokens", value=rate)
        yield GaugeMetricFamily("vllm:spec_decode_draft_acceptance_rate", "accepted / drafted tokens", value=rate)
