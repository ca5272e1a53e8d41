"""Batch-1 decode with and without a JSON-schema constraint, side by side in one run.

    python bench/structured.py ARTIFACT [--tokens 64] [--rounds 5] [--threads 1]

ARTIFACT is a compiled model with a tokenizer (e.g. SmolLM2-135M-Instruct: ``infeng compile
SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2.infeng --quant int4``). Rounds alternate between an
unconstrained request (``ignore_eos``, so it runs ``--tokens`` tokens) and one constrained by a JSON
schema (it stops when the document closes), both through the engine loop and scheduler the server
uses. Prints one JSON line per mode: ms per decode step (mean over rounds, best round), and for the
constrained mode the time the engine thread spent in ``apply_masks`` (waiting for the mask the
worker filled during the forward call, and applying it) and ``advance`` (the matcher taking the
token, queueing the next fill), as a fraction of the step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from infeng_runtime import structured
from infeng_runtime.engine import Engine
from infeng_runtime.loop import EngineLoop
from infeng_runtime.sampling import SamplingParams
from infeng_runtime.scheduler import Request

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 32}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                           "maxItems": 4}},
    "required": ["name", "age", "email", "tags"], "additionalProperties": False}
PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"


def run(loop: EngineLoop, ids: list[int], params: SamplingParams, grammar) -> tuple[int, float]:
    """(decode steps, seconds) of one request run alone; the prefill step is not counted."""
    outs: list = []
    loop.submit(Request("r", ids, params, grammar=grammar, sink=outs.extend))
    loop.run_once()                           # prefill (and the first token)
    t0, steps = time.perf_counter(), 0
    while loop.has_work():
        loop.run_once()
        steps += 1
    return steps, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    engine = Engine(args.artifact, threads=args.threads, max_seqs=1)
    loop = EngineLoop(engine, prefix_cache=False)
    ids = engine.tokenizer.encode_batch([PROMPT], False)[0]
    compiler = structured.GrammarCompiler(engine.tokenizer, engine.vocab_size)
    spec = structured.GrammarSpec("json", SCHEMA)
    compiler.constraint(spec, 1)                          # the tokenizer and grammar, built once

    in_masks = [0.0]
    apply_masks, advance = structured.apply_masks, structured.advance

    def timed(fn):
        def wrapper(*a):
            t = time.perf_counter()
            fn(*a)
            in_masks[0] += time.perf_counter() - t
        return wrapper

    import infeng_runtime.scheduler as sched
    sched.apply_masks, sched.advance = timed(apply_masks), timed(advance)
    free_ms, json_ms, mask_frac = [], [], []
    for _ in range(args.rounds):
        steps, s = run(loop, ids, SamplingParams(max_new_tokens=args.tokens, ignore_eos=True), None)
        free_ms.append(s / steps * 1e3)
        in_masks[0] = 0.0
        steps, s = run(loop, ids, SamplingParams(max_new_tokens=args.tokens * 4), compiler.constraint(spec, 1))
        json_ms.append(s / steps * 1e3)
        mask_frac.append(in_masks[0] / s)
    free, constrained = statistics.fmean(free_ms), statistics.fmean(json_ms)
    print(json.dumps({"mode": "unconstrained", "artifact": str(args.artifact), "threads": args.threads,
                      "ms_per_step": round(free, 3), "best_ms_per_step": round(min(free_ms), 3)}))
    print(json.dumps({"mode": "json_schema", "artifact": str(args.artifact), "threads": args.threads,
                      "ms_per_step": round(constrained, 3), "best_ms_per_step": round(min(json_ms), 3),
                      "step_overhead": round(constrained / free - 1, 4),
                      "mask_time_fraction": round(statistics.fmean(mask_frac), 4)}))


if __name__ == "__main__":
    main()
