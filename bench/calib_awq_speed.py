"""Speed of AWQ's exponent loss on llama1b's shapes: one exponent per site of a llama1b layer, the
loss now (``awq._loss``: round-to-nearest's int4 scale base chosen in C, every consumer's D
stacked, one float64 product with the Gram) against
as it was (``calib_choices.reference_loss``: numpy's einsum per consumer) on the same random
weights and Gram (docs/performance.md, *Calibrated compiles in bounded memory*). One JSON line per
site and arm, then the layer's totals.

    python bench/calib_awq_speed.py [--repeat 1]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from infeng_compiler.codegen.clip_search import clip_search
from infeng_compiler.quant import awq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calib_choices import reference_loss  # noqa: E402

#: AWQ sites of a llama1b layer: consumers' rows and their K
SITES = {"input norm (q, k, v)": ([2048, 512, 512], 2048), "attention output (o)": ([2048], 2048),
         "post-attention norm (gate, up)": ([8192, 8192], 2048), "silu_mul (down)": ([2048], 8192)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    totals = {"now": 0.0, "reference": 0.0}
    for site, (rows, K) in SITES.items():
        x = (rng.standard_normal((K + 512, K)) * (rng.random(K) * 3)).astype(np.float32)
        gram = (x.T @ x).astype(np.float64) / K
        del x
        ws = [(rng.standard_normal((n, K)) * 0.02).astype(np.float32) for n in rows]
        s = awq._scale(rng.random(K) + 0.1, 0.5)
        fmts = ["q4g32"] * len(ws)
        losses = {}
        now = lambda *a: awq._loss(*a, symmetric_choice=clip_search)  # noqa: E731
        for arm, loss in (("now", now), ("reference", reference_loss)):
            best = float("inf")
            for _ in range(args.repeat):
                start = time.perf_counter()
                losses[arm] = loss(ws, fmts, s, gram)
                best = min(best, time.perf_counter() - start)
            totals[arm] += best
            print(json.dumps(dict(site=site, consumers=[[n, K] for n in rows], arm=arm, seconds=round(best, 2))),
                  flush=True)
        print(json.dumps(dict(site=site, loss_rel_diff=abs(losses["now"] - losses["reference"]) / losses["reference"])),
              flush=True)
    print(json.dumps(dict(layer_seconds_now=round(totals["now"], 2),
                          layer_seconds_reference=round(totals["reference"], 2))), flush=True)


if __name__ == "__main__":
    main()
