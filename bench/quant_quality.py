"""Quality of the quantized formats on stories260K by the BENCHMARKS perplexity protocol.

    python bench/quant_quality.py                       # the table of docs/quantization.md
    python bench/quant_quality.py --pipelines "quantize(int4,group=64,asym)"

Evaluation text: the first 100,000 bytes of wikitext-2 test, ctx 256 (247 chunks, the scored second
halves). Calibration text: bytes 200,000-400,000 of the same file (disjoint from the evaluation).
Each configuration runs through the reference interpreter, which computes what the compiled kernels
compute up to the order of float accumulation (tests/test_quant_compiled.py checks that). Prints one
JSON line per configuration: PPL, drift against f32, mean KL divergence KL(f32 || quantized) and
top-1 agreement over the scored positions, the bytes of weights.bin (every weight the forward step
reads, 64-byte aligned) and its bits per weight over all parameters; with --slices, the drift on
further disjoint 100 kB slices of the file too (how much of a drift is the configuration, and how
much the text).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from infeng_compiler.codegen.lower import align, weight_nbytes
from infeng_compiler.evaluate import perplexity
from infeng_compiler.frontends.hf import import_hf
from infeng_compiler.interp import Interpreter
from infeng_compiler.passes.manager import PassContext, PassManager, parse_pipeline
from infeng_common.tokenizer import Tokenizer

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
MODEL = ASSETS / "models" / "stories260K"
TEXT = ASSETS / "text" / "wikitext-2-raw-v1-test.txt"
CALIB = (200_000, 400_000)
EVAL = (0, 100_000)
SLICES = [(a, a + 100_000) for a in (500_000, 600_000, 700_000, 800_000, 900_000)]
PIPELINES = [
    "quantize(int8)", "quantize(int8,calib={calib})", "quantize(fp8)",
    "quantize(int4)", "quantize(int4,calib={calib})", "quantize(int4,calib={calib},gptq=1)",
    "quantize(int4,policy={pad})", "quantize(int4,policy={pad},calib={calib})",
    "quantize(int4,group=64,asym)", "quantize(int4,group=64,asym,calib={calib})",
]


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


class CachedBase:
    """The f32 model's logits, computed once per evaluation text and replayed for every
    configuration (``perplexity`` calls the base in the same order each time)."""

    def __init__(self, interpreter: Interpreter):
        self.it, self.cache, self.key = interpreter, {}, None

    def start(self, text_index: int) -> None:
        self.key, self.calls = text_index, 0

    def step(self, *args):
        k = (self.key, self.calls)
        self.calls += 1
        if k not in self.cache:
            self.cache[k] = self.it.step(*args)
        return self.cache[k]

    def free(self, seq: int) -> None:
        self.it.free(seq)


def cache_calibration() -> None:
    """Calibration statistics depend only on the f32 graph and the text: collect them once."""
    from infeng_compiler.quant import calibrate

    collect, memo = calibrate.collect, {}

    def cached(graph, chunks, *a, **kw):
        key = chunks.tobytes()
        if key not in memo:
            memo[key] = collect(graph, chunks, *a, **kw)
        return dict(memo[key])

    calibrate.collect = cached


def weights_bin_bytes(graph) -> tuple[int, int]:
    """(bytes of weights.bin, parameters) for the weights the graph's nodes read."""
    used = {w.name: w for n in graph.nodes for w in n.weights}
    return sum(align(weight_nbytes(w)) for w in used.values()), sum(w.type.numel() for w in used.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pipelines", nargs="*", default=PIPELINES)
    ap.add_argument("--slices", action="store_true", help="also the drift on 5 further 100 kB slices")
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    raw = TEXT.read_bytes()
    tmp = Path(tempfile.mkdtemp(prefix="infeng-quality-"))
    calib = tmp / "calib.txt"
    calib.write_bytes(raw[CALIB[0]:CALIB[1]])
    pad = tmp / "pad.json"
    pad.write_text(json.dumps({"preset": "int4", "fallback": "pad"}))
    tok = Tokenizer(MODEL, 1, [2])
    texts = [EVAL] + (SLICES if args.slices else [])
    ids = [tok.encode(raw[a:b].decode("utf-8", errors="ignore"), add_bos=True) for a, b in texts]
    base = CachedBase(Interpreter(import_hf(MODEL)))
    cache_calibration()
    f32_bytes, params = weights_bin_bytes(base.it.graph)
    emit(config="f32", bytes=f32_bytes, bpw=round(8 * f32_bytes / params, 3))
    for text in args.pipelines:
        pipeline = text.format(calib=calib, pad=pad)
        graph = import_hf(MODEL)
        ctx = PassContext(model_dir=MODEL)
        PassManager(parse_pipeline(pipeline)).run(graph, ctx)
        it = Interpreter(graph)
        results = []
        for index, i in enumerate(ids):
            base.start(index)
            results.append(perplexity(it.step, it.free, i, 256, tok.bos_token_id, batch=args.batch,
                                      base_step=base.step, base_free=base.free))
        r = results[0]
        nbytes, _ = weights_bin_bytes(graph)
        row = dict(config=text.format(calib="calib.txt", pad="pad.json"), ppl=round(r.ppl, 4), base_ppl=round(r.base_ppl, 4),
                   drift_pct=round(100 * (r.ppl / r.base_ppl - 1), 3), kld=round(r.kld, 6), top1=round(r.top1, 4),
                   bytes=nbytes, bpw=round(8 * nbytes / params, 3),
                   formats={f["format"]: f["bpw"] for f in ctx.quant_report.by_format()})
        if args.slices:
            drifts = [100 * (s.ppl / s.base_ppl - 1) for s in results[1:]]
            row.update(slice_drifts_pct=[round(d, 2) for d in drifts], slice_drift_mean_pct=round(float(np.mean(drifts)), 3),
                       slice_kld_mean=round(float(np.mean([s.kld for s in results[1:]])), 4))
        emit(**row)


if __name__ == "__main__":
    main()
