"""What calibration's float32 statistics change in a compile's choices: the AWQ scale exponents and
the clipping search's codes and scales, against the reference interpreter's float64 statistics
(docs/performance.md, *Calibrated compiles*). For models whose calibrated compile takes too long to
run twice (the clipping search weighted by each group's Gram block is numpy, ~1 min per 4M weights).

    python bench/calib_choices.py MODEL [--calib-bytes 50000] [--tensors 7]

Both statistics come from the same graph and token ids: ``collect`` (float32 causal attention,
float32 Gram products) and the reference (the registry's attention, float64 Gram products, as
before). Each runs AWQ on its own copy of the graph; the first ``--tensors`` quantized weights and
the last are then searched with each one's Gram blocks. One JSON line.

    python bench/calib_choices.py MODEL --awq-loss [--calib-bytes 50000]

``--awq-loss`` instead compares AWQ's exponent search with its loss as computed now
(``awq._loss``: round-to-nearest choosing its int4 scale base in C, every consumer's D stacked, one
float64 product with the Gram) against the loss as it was (``reference_loss``: numpy's
round-to-nearest and einsum per consumer), on the same ``collect`` statistics
and the graph's weights as imported: the exponent of every site, the largest relative loss
difference, and each one's seconds. MODEL may be ``smollm2`` (the registry's SmolLM2-135M-Instruct,
widened to f32 like every model here).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from infeng_compiler.codegen.clip_search import clip_search
from infeng_compiler.frontends import import_model, model_source
from infeng_compiler.passes.manager import PassContext, PassManager, parse_pipeline
from infeng_compiler.passes.quantize import Quantize, _grams, _source_f32
from infeng_compiler.quant import calibrate
from infeng_compiler.quant import awq
from infeng_compiler.quant.awq import apply_awq
from infeng_compiler.quant.formats import get_format, is_quantized
from infeng_compiler.quant.search import quantize

TEXT = Path(__file__).resolve().parents[2] / "shared" / "assets" / "text" / "wikitext-2-raw-v1-test.txt"


def reference_collect(graph, chunks: np.ndarray) -> dict[str, calibrate.ActStats]:
    """The statistics as before: the registry's references, float64 Gram products."""
    watched = {n.inputs[0].name for n in graph.nodes if n.op in calibrate.MATMUL_OPS}
    sums: dict[str, list] = {}

    def observe(node, inputs, weights, outputs) -> None:
        for value, array in zip(node.outputs, outputs):
            if value.name in watched:
                x64 = np.asarray(array, dtype=np.float64).reshape(-1, array.shape[-1])
                entry = sums.setdefault(value.name, [0, np.zeros(x64.shape[1]), np.zeros((x64.shape[1],) * 2)])
                entry[0] += x64.shape[0]
                entry[1] += np.abs(x64).sum(axis=0)
                entry[2] += x64.T @ x64

    calibrate._run_chunks(graph, [n for n in graph.nodes if n.op != "logits"], chunks, 8, observe, None)
    return {name: calibrate.ActStats(c, a / c, g) for name, (c, a, g) in sums.items()}


def reference_loss(ws, fmts, s: np.ndarray, gram: np.ndarray, symmetric_choice=None) -> float:
    """AWQ's loss as it was: per consumer, numpy's round-to-nearest and numpy's einsum of
    tr(D G Dᵀ) in float64 (``symmetric_choice`` ignored: numpy chooses)."""
    total = 0
    for w, fmt in zip(ws, fmts):
        deq = quantize((w * s[None, :]).astype(np.float32), get_format(fmt), search=False).dequantize() / s[None, :]
        d = (deq - w).astype(np.float64)
        total += float(np.einsum("nk,kl,nl->", d, gram, d, optimize=True))
    return total


def compare_awq_loss(graph, chunks: np.ndarray, formats: dict[str, str]) -> dict:
    """Every AWQ site's (α, losses) with ``awq._loss`` and with ``reference_loss``."""
    stats = calibrate.collect(graph, chunks)
    sites = [v.name for n in graph.nodes for v in n.outputs if v.name in stats and awq.awq_site(graph, v.name, formats)]
    results, seconds = {"now": [], "reference": []}, {"now": 0.0, "reference": 0.0}
    for label, loss in (("now", awq._loss), ("reference", reference_loss)):
        awq._loss, kept = loss, awq._loss
        try:
            for site in sites:
                start = time.perf_counter()
                results[label].append(awq.search_alpha(graph, site, stats[site], formats, symmetric_choice=clip_search))
                seconds[label] += time.perf_counter() - start
        finally:
            awq._loss = kept
    rel = max((abs(a - b) / max(abs(b), 1e-300) for now, ref in zip(results["now"], results["reference"])
               for a, b in zip(now[1:], ref[1:])), default=None)                   # None: no site
    same = sum(a[0] == b[0] for a, b in zip(results["now"], results["reference"]))
    return dict(awq_sites=len(sites), awq_same_alpha=same,
                folded=sum(a[0] != 0.0 for a in results["now"]), loss_max_rel_diff=rel,
                seconds_now=round(seconds["now"], 2), seconds_reference=round(seconds["reference"], 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--calib-bytes", type=int, default=50_000)
    ap.add_argument("--tensors", type=int, default=7)
    ap.add_argument("--awq-loss", action="store_true", help="compare AWQ's loss now and as it was (above)")
    args = ap.parse_args()
    if str(args.model) == "smollm2":
        from infeng_models.registry import SMOLLM2_135M_INSTRUCT, fetch

        args.model = fetch(SMOLLM2_135M_INSTRUCT)

    def graph():
        g = import_model(args.model, None, strict=True)
        PassManager(parse_pipeline("cast-weights(f32)")).run(g, PassContext())
        return g

    calib = Path("/tmp") / f"calib-choices-{args.calib_bytes}.txt"
    calib.write_bytes(TEXT.read_bytes()[200_000:200_000 + args.calib_bytes])
    g_new = graph()
    tok = PassContext(model_dir=model_source(args.model, None).tokenizer_dir).calibration_tokenizer(g_new, "calib")
    chunks = calibrate.calibration_ids(tok, calib, None, 256)
    formats = {n: a.format for n, a in Quantize("int4").policy.assign(g_new).items() if is_quantized(a.format)}
    if args.awq_loss:
        compared = compare_awq_loss(g_new, chunks, formats)
        print(json.dumps(dict(model=args.model.name, tokens=int(chunks.size), **compared)), flush=True)
        return
    g_old = graph()
    stats = {"float32": calibrate.collect(g_new, chunks), "reference": reference_collect(g_old, chunks)}
    awq = {label: apply_awq(g, stats[label], formats) for label, g in (("float32", g_new), ("reference", g_old))}
    alphas = {label: {s.value: s.alpha for s in done} for label, done in awq.items()}
    sites = sorted(set(alphas["float32"]) | set(alphas["reference"]))
    same_alpha = sum(alphas["float32"].get(v, 0.0) == alphas["reference"].get(v, 0.0) for v in sites)
    grams = {"float32": _grams(g_new, stats["float32"]), "reference": _grams(g_old, stats["reference"])}
    names = [n for n in formats if n in grams["float32"]]
    names = names[:args.tensors] + names[-1:]
    codes_same = scales_same = total_codes = total_scales = 0
    for name in names:
        q = {label: quantize(_source_f32(g.weights[name]), get_format(formats[name]), gram=grams[label][name],
                             symmetric_choice=clip_search)
             for label, g in (("float32", g_new), ("reference", g_old))}
        codes_same += int((q["float32"].codes == q["reference"].codes).sum())
        total_codes += q["float32"].codes.size
        scales_same += int((q["float32"].scales == q["reference"].scales).sum())
        total_scales += q["float32"].scales.size
    rel = max(float(np.abs(stats["float32"][v].gram - stats["reference"][v].gram).max()
                    / np.abs(stats["reference"][v].gram).max()) for v in stats["reference"])
    print(json.dumps(dict(model=args.model.name, tokens=int(chunks.size), gram_max_rel_diff=rel,
                          awq_sites=len(sites), awq_same_alpha=same_alpha,
                          searched_tensors=len(names), codes_same_pct=round(100 * codes_same / total_codes, 4),
                          scales_same_pct=round(100 * scales_same / total_scales, 4))), flush=True)


if __name__ == "__main__":
    main()
