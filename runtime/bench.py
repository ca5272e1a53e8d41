"""``infeng bench``: prefill and decode speed of one artifact, latency percentiles, peak RSS,
the memory-bandwidth roofline, and (for ``--profile`` builds) time per op and a Chrome trace."""
from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from infeng_common.manifest import weight_storage

from .engine import Engine


@dataclass
class BenchConfig:
    prompt_len: int = 128
    gen_len: int = 64
    batch: int = 1
    threads: int = 0
    trace_steps: int = 3


def run_bench(engine: Engine, cfg: BenchConfig,
              bandwidth_gb_s: float | None) -> tuple[list[dict], list[list[dict]], list[dict]]:
    """(one dict per result: prefill, decode with roofline, per-op rows when profiled;
    the per-op spans of the first ``trace_steps`` decode steps when profiled;
    one row per IR node when profiled: ``node_rows``)."""
    rng = np.random.default_rng(0)
    B, P = cfg.batch, cfg.prompt_len
    prompts = rng.integers(0, engine.vocab_size, size=(B, P)).astype(np.int32)
    seqs = np.repeat(np.arange(B), P)
    positions = np.tile(np.arange(P), B)
    last_rows = np.arange(B) * P + P - 1
    engine.step(prompts[:, :8].reshape(-1), np.tile(np.arange(8), B), np.repeat(np.arange(B), 8))  # warm-up
    for s in range(B):
        engine.free(s)
    t0 = time.perf_counter()
    logits = engine.step(prompts.reshape(-1), positions, seqs, last_rows)
    ttft = time.perf_counter() - t0
    tokens = logits.argmax(axis=1).astype(np.int32)
    if engine.profiled:
        engine.profile_reset()
    step_s, spans = [], []
    for i in range(cfg.gen_len):
        t = time.perf_counter()
        logits = engine.step(tokens, np.full(B, P + i), np.arange(B))
        step_s.append(time.perf_counter() - t)
        tokens = logits.argmax(axis=1).astype(np.int32)
        if engine.profiled and i < cfg.trace_steps:
            spans.append(engine.profile())
    profile = engine.profile() if engine.profiled else []
    for s in range(B):
        engine.free(s)
    steps = np.array(step_s)
    decode_tok_s = B * len(steps) / steps.sum()
    weights = engine.manifest["weights_bytes"]
    common = {"artifact": engine.path.name, "threads": engine.threads, "batch": B,
              "target": engine.manifest["target"], "weights": weight_storage(engine.manifest)}
    results = [
        {"bench": "prefill", **common, "prompt_len": P, "tok_s": round(B * P / ttft, 1), "ttft_ms": round(ttft * 1e3, 2)},
        {"bench": "decode", **common, "gen_len": cfg.gen_len, "tok_s": round(decode_tok_s, 1),
         "p50_ms": round(float(np.percentile(steps, 50)) * 1e3, 3),
         "p95_ms": round(float(np.percentile(steps, 95)) * 1e3, 3),
         "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
         "weights_mib": round(weights / 2**20, 1)},
    ]
    if bandwidth_gb_s:
        # weights read once per step; of a MoE model's experts at most the B tokens' choices (docs/moe.md)
        constants = engine.manifest["constants"]
        experts = constants.get("expert_weights_bytes", 0)
        read = weights - experts + experts * min(1.0, B * constants.get("experts_per_token_share", 1.0))
        roofline = bandwidth_gb_s * 1e9 / read * B
        if experts:
            results[1]["weights_read_mib"] = round(read / 2**20, 1)
        results[1].update(bandwidth_gb_s=round(bandwidth_gb_s, 2), roofline_tok_s=round(roofline, 1),
                          roofline_frac=round(decode_tok_s / roofline, 3))
    nodes = node_rows(profile, steps.sum(), len(steps), B, bandwidth_gb_s) if profile else []
    if profile:
        results += profile_rows(profile, steps.sum(), B, bandwidth_gb_s)
    return results, spans, nodes


def node_rows(profile: list[dict], step_seconds: float, steps: int, batch: int,
              bandwidth_gb_s: float | None) -> list[dict]:
    """Per IR node, in graph order: ms per decode step, % of the measured step time, GB/s of its
    weights and the fraction of the memory-bandwidth roofline that is (the explorer's heat overlay)."""
    rows = []
    for e in profile:
        sec = e["ns"] / 1e9
        gb_s = e["weight_bytes"] * e["calls"] / sec / 1e9 if sec and e["weight_bytes"] else None
        rows.append({"name": e["name"], "op": e["op"], "calls": e["calls"],
                     "ms": round(sec * 1e3 / max(steps, 1), 6),
                     "pct_of_step": round(100 * sec / step_seconds, 2) if step_seconds else 0.0,
                     "gb_s": round(gb_s, 2) if gb_s else None,
                     "roofline_frac": round(gb_s / bandwidth_gb_s, 3) if gb_s and bandwidth_gb_s else None,
                     "gflop_s": round(e["flops_per_row"] * batch * e["calls"] / sec / 1e9, 2)
                     if sec and e["flops_per_row"] else None})
    return rows


def profile_rows(profile: list[dict], step_seconds: float, batch: int, bandwidth_gb_s: float | None) -> list[dict]:
    """Ops sorted by time: % of the measured step time, GB/s of weights, GFLOP/s."""
    by_op: dict[str, dict] = {}
    for e in profile:
        row = by_op.setdefault(e["op"], {"ns": 0, "calls": 0, "bytes": 0, "flops": 0})
        row["ns"] += e["ns"]
        row["calls"] += e["calls"]
        row["bytes"] += e["weight_bytes"] * e["calls"]
        row["flops"] += e["flops_per_row"] * batch * e["calls"]
    total_ns = sum(r["ns"] for r in by_op.values())
    rows = []
    for op, r in sorted(by_op.items(), key=lambda kv: -kv[1]["ns"]):
        sec = r["ns"] / 1e9
        row = {"bench": "profile", "op": op, "ms": round(sec * 1e3, 3), "calls": r["calls"],
               "pct_of_step": round(100 * sec / step_seconds, 1),
               "gb_s": round(r["bytes"] / sec / 1e9, 2) if sec and r["bytes"] else None,
               "gflop_s": round(r["flops"] / sec / 1e9, 2) if sec and r["flops"] else None}
        if bandwidth_gb_s and row["gb_s"]:
            row["bw_frac"] = round(row["gb_s"] / bandwidth_gb_s, 3)
        rows.append(row)
    rows.append({"bench": "profile_total", "profiled_ms": round(total_ns / 1e6, 3),
                 "measured_ms": round(step_seconds * 1e3, 3),
                 "profiled_frac": round(total_ns / 1e9 / step_seconds, 3)})
    return rows


def write_trace(path: Path, spans: list[list[dict]]) -> None:
    """A Chrome trace (Perfetto opens it): one complete event per op per profiled step."""
    events = []
    for step, entries in enumerate(spans):
        for e in entries:
            if e["last_end_ns"] > e["last_begin_ns"] > 0:
                events.append({"name": e["name"], "cat": e["op"], "ph": "X", "pid": 1, "tid": 1,
                               "ts": e["last_begin_ns"] / 1e3, "dur": (e["last_end_ns"] - e["last_begin_ns"]) / 1e3,
                               "args": {"op": e["op"], "step": step}})
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
