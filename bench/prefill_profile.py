"""Where a prefill's time goes, per op, by thread count: ``infeng bench --profile`` times decode
steps; this times one prompt of ``--prompt-len`` tokens (one forward call) on an artifact built
with ``--profile``.

    python bench/prefill_profile.py ART-prof.infeng --threads 1,2 --prompt-len 512 --rounds 2

For every thread count (a fresh engine each) it runs the warm-up ``infeng bench`` runs (an 8-token
step), then ``--rounds`` prefills with the profile reset before each, and keeps the fastest.
One JSON line per op: ``threads``, ``op``, ``ms``, ``calls``, ``pct_of_step``, ``gflop_s``
(``runtime/bench.py``'s ``profile_rows`` with the prompt's tokens as rows) and per node kind
(``node_kind``: ``l3.gate_up`` counts as ``gate_up``), after a ``prefill`` line (tok/s, ms) per
thread count; last, per node kind, ``scaling``: its time at the fewest threads over its time at
the most.
"""
from __future__ import annotations

import argparse
import json
import re
import time

import numpy as np

from infeng_runtime.bench import profile_rows
from infeng_runtime.engine import Engine


def by_node_kind(profile: list[dict], step_seconds: float, tokens: int) -> list[dict]:
    """The nodes summed over layers (``l3.gate_up`` -> ``gate_up``), sorted by time: which linear
    (q_k_v, o, gate_up, down, logits) or other node takes the time."""
    kinds: dict[str, dict] = {}
    for e in profile:
        k = kinds.setdefault(re.sub(r"^l\d+\.", "", e["name"]), {"op": e["op"], "ns": 0, "flops": 0})
        k["ns"] += e["ns"]
        k["flops"] += e["flops_per_row"] * tokens * e["calls"]
    return [{"bench": "node_kind", "node": name, "op": k["op"], "ms": round(k["ns"] / 1e6, 3),
             "pct_of_step": round(100 * k["ns"] / 1e9 / step_seconds, 1),
             "gflop_s": round(k["flops"] / k["ns"], 2) if k["ns"] and k["flops"] else None}
            for name, k in sorted(kinds.items(), key=lambda kv: -kv[1]["ns"])]


def prefill_profile(artifact: str, threads: int, prompt_len: int, rounds: int) -> tuple[float, list[dict]]:
    """(seconds of the fastest prefill, its per-op rows and per-node-kind rows)."""
    engine = Engine(artifact, threads=threads, max_seqs=1, max_context=prompt_len + 16)
    if not engine.profiled:
        raise SystemExit(f"{artifact}: not built with --profile")
    prompt = np.random.default_rng(0).integers(0, engine.vocab_size, size=prompt_len).astype(np.int32)
    zeros = np.zeros(prompt_len, dtype=np.int32)
    engine.step(prompt[:8], np.arange(8, dtype=np.int32), zeros[:8])          # warm-up, as infeng bench
    engine.free(0)
    best: tuple[float, list[dict]] | None = None
    for _ in range(rounds):
        engine.profile_reset()
        t0 = time.perf_counter()
        engine.step(prompt, np.arange(prompt_len, dtype=np.int32), zeros, np.array([prompt_len - 1]))
        seconds = time.perf_counter() - t0
        profile = engine.profile()
        engine.free(0)
        if best is None or seconds < best[0]:
            best = (seconds, profile)
    assert best is not None
    return best[0], profile_rows(best[1], best[0], prompt_len, None) + by_node_kind(best[1], best[0], prompt_len)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2, help="prefills per thread count; the fastest is kept")
    args = ap.parse_args(argv)
    by_threads: dict[int, dict[str, float]] = {}
    for threads in map(int, args.threads.split(",")):
        seconds, rows = prefill_profile(args.artifact, threads, args.prompt_len, args.rounds)
        print(json.dumps({"bench": "prefill", "threads": threads, "prompt_len": args.prompt_len,
                          "tok_s": round(args.prompt_len / seconds, 1), "ms": round(seconds * 1e3, 1)}), flush=True)
        for row in rows:
            print(json.dumps({**row, "threads": threads}), flush=True)
        by_threads[threads] = {r["node"]: r["ms"] for r in rows if r["bench"] == "node_kind"}
    if len(by_threads) > 1:
        few, most = min(by_threads), max(by_threads)
        for node, ms in by_threads[few].items():
            if by_threads[most].get(node):
                other = by_threads[most][node]
                print(json.dumps({"bench": "scaling", "node": node, "threads": [few, most], "ms": [ms, other],
                                  "speedup": round(ms / other, 2)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
