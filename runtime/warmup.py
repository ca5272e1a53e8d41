"""Warm-up: one forward step of every shape a server runs, before the first request.

The first steps after a load pay for page faults on the memory-mapped weights, the KV pages and
the activation arena, and for the first use of each kernel path (a library picks kernels by the
number of token rows: decode-sized steps and prefill-sized ones, AMX tiles for many rows). One
step of each row count the scheduler makes — a single decode row, a full batch of decode rows, a
full prefill chunk — with and without an adapter slot where the library has slots, runs those
paths once. The sequences used are freed after; nothing enters the prefix cache.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np

from .kv_cache import KVCacheFull
from .prefix_store import load_prefix_cache

_log = logging.getLogger("infeng.warmup")

#: Sequence ids of the warm-up (far from the scheduler's, which count up from 0).
_WARM_SEQ = 1 << 40


def warmup_row_counts(max_tokens: int, max_seqs: int, max_context: int) -> list[int]:
    """The step sizes a server runs: 1 row, a batch of decodes, a full prefill chunk."""
    return sorted({1, max(1, min(max_seqs, max_tokens)), max(1, min(max_tokens, max_context))})


def warm_up(engine) -> dict[str, float]:
    """Run one step of each row count (and each with an adapter slot where there are slots);
    returns {"steps": n, "seconds": s}."""
    started = time.perf_counter()
    slots = [-1] + ([0] if engine.adapters.n_slots > 0 else [])
    steps = 0
    for rows in warmup_row_counts(engine.max_tokens, engine.kv.max_seqs, engine.max_context):
        for adapter_slot in slots:
            sequences = min(rows, engine.kv.max_seqs)
            seq_ids = _WARM_SEQ + np.arange(rows) % sequences
            positions = np.arange(rows) // sequences          # each sequence's rows in position order
            if positions.max() + 1 > engine.max_context:
                continue
            tokens = np.arange(rows) % engine.vocab_size
            try:
                engine.step(tokens, positions, seq_ids, logits_rows=[rows - 1],
                            adapter_slots=np.full(rows, adapter_slot) if adapter_slot >= 0 else None)
                steps += 1
            except KVCacheFull:                               # a pool smaller than one prefill chunk
                pass
            finally:
                for seq in set(seq_ids.tolist()):
                    engine.free(seq)
    return {"steps": steps, "seconds": time.perf_counter() - started}


def warm_start(engine, warmup: bool, prefix_cache_dir: str | Path | None) -> None:
    """What ``infeng serve`` does before its port opens: the warm-up steps (``--warmup``), then the
    saved prefix cache (``--prefix-cache-dir``; prefix_store.py). Each logs one line."""
    if warmup:
        done = warm_up(engine)
        rows = warmup_row_counts(engine.max_tokens, engine.kv.max_seqs, engine.max_context)
        _log.info(f"warm-up: {done['steps']} steps of {rows} token rows in {done['seconds']:.2f} s")
    if prefix_cache_dir is not None:
        load_prefix_cache(engine, prefix_cache_dir)
