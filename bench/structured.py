"""Batch-1 decode with and without a JSON-schema constraint, side by side in one run.

    python bench/structured.py ARTIFACT [--tokens 64] [--rounds 5] [--threads 1] [--speculative ngram]

ARTIFACT is a compiled model with a tokenizer (e.g. SmolLM2-135M-Instruct: ``infeng compile
SmolLM2-135M-Instruct.Q4_1.gguf -o smollm2.infeng --quant int4``). Rounds alternate between an
unconstrained request (``ignore_eos``, so it runs ``--tokens`` tokens) and one constrained by a JSON
schema (it stops when the document closes), both through the engine loop and scheduler the server
uses. Prints one JSON line per mode: ms per decode step (mean over rounds, best round), and for the
constrained mode the time the engine thread spent in ``mask_verdicts`` (waiting for the mask the
worker filled during the forward call), ``apply_masks`` (applying it) and ``advance`` (queueing the
job that feeds the matcher its token and fills the next mask): per step (``mask_ms_per_step``), as a fraction of the constrained
step (``mask_time_fraction``) and of the unconstrained step of the same run
(``mask_fraction_of_decode_step``: issue 19's "the mask costs <= 10% of the batch-1 decode step").

With ``--speculative ngram`` (or ``draft:ARTIFACT``) a third mode runs the constrained request with
speculative decoding (drafts checked against the grammar): ms per generated token, the speedup over
the constrained plain run, and whether it gave the same text (greedy speculation is exact).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from infeng_runtime import structured
from infeng_runtime.engine import Engine
from infeng_runtime.loop import EngineLoop
from infeng_runtime.sampling import SamplingParams, grammar
from infeng_runtime.scheduler import Request
from infeng_runtime.spec import parse_speculative

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "maxLength": 32}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                           "maxItems": 4}},
    "required": ["name", "age", "email", "tags"], "additionalProperties": False}
PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"


def run(loop: EngineLoop, ids: list[int], params: SamplingParams, grammar) -> tuple[int, float, list[int]]:
    """(decode steps, seconds, tokens) of one request run alone; the prefill step is not counted."""
    outs: list = []
    loop.submit(Request("r", ids, params, grammar=grammar, sink=outs.extend))
    loop.run_once()                           # prefill (and the first token)
    t0, steps = time.perf_counter(), 0
    while loop.has_work():
        loop.run_once()
        steps += 1
    return steps, time.perf_counter() - t0, [o.token for o in outs if o.token is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifact")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--speculative", default=None, help="also run the constrained request speculating "
                                                        "(ngram, draft:ARTIFACT)")
    args = ap.parse_args()
    engine = Engine(args.artifact, threads=args.threads, max_seqs=1)
    loop = EngineLoop(engine, prefix_cache=False)
    ids = engine.tokenizer.encode_batch([PROMPT], False)[0]
    compiler = structured.GrammarCompiler(engine.tokenizer, engine.vocab_size)
    spec = structured.GrammarSpec("json", SCHEMA)
    compiler.constraint(spec, 1)                          # the tokenizer and grammar, built once

    in_masks = [0.0]
    apply_masks, advance, mask_verdicts = grammar.apply_masks, grammar.advance, grammar.mask_verdicts

    def timed(fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            result = fn(*a, **kw)
            in_masks[0] += time.perf_counter() - t
            return result
        return wrapper

    import infeng_runtime.scheduler as sched
    sched.apply_masks, sched.advance, sched.mask_verdicts = timed(apply_masks), timed(advance), timed(mask_verdicts)
    config = parse_speculative(args.speculative)
    spec_loop = EngineLoop(engine, prefix_cache=False, speculative=config) if config is not None else None
    free_ms, json_ms, mask_ms, mask_frac, spec_ms, json_tok_ms, same = [], [], [], [], [], [], True
    for _ in range(args.rounds):
        steps, s, _ = run(loop, ids, SamplingParams(max_new_tokens=args.tokens, ignore_eos=True), None)
        free_ms.append(s / steps * 1e3)
        in_masks[0] = 0.0
        json_params = SamplingParams(max_new_tokens=args.tokens * 4)
        steps, s, plain_tokens = run(loop, ids, json_params, compiler.constraint(spec, 1))
        json_ms.append(s / steps * 1e3)
        mask_ms.append(in_masks[0] / steps * 1e3)
        mask_frac.append(in_masks[0] / s)
        if spec_loop is not None:
            _, s, spec_tokens = run(spec_loop, ids, json_params, compiler.constraint(spec, 1))
            spec_ms.append(s / max(1, len(spec_tokens) - 1) * 1e3)
            json_tok_ms.append(json_ms[-1] * steps / max(1, len(plain_tokens) - 1))
            same = same and spec_tokens == plain_tokens
    free, constrained = statistics.fmean(free_ms), statistics.fmean(json_ms)
    base = {"artifact": str(args.artifact), "threads": args.threads}
    print(json.dumps({"mode": "unconstrained", **base, "ms_per_step": round(free, 3),
                      "best_ms_per_step": round(min(free_ms), 3)}))
    print(json.dumps({"mode": "json_schema", **base, "ms_per_step": round(constrained, 3),
                      "best_ms_per_step": round(min(json_ms), 3), "step_overhead": round(constrained / free - 1, 4),
                      "mask_ms_per_step": round(statistics.fmean(mask_ms), 4),
                      "mask_time_fraction": round(statistics.fmean(mask_frac), 4),
                      "mask_fraction_of_decode_step": round(statistics.fmean(mask_ms) / free, 4)}))
    if spec_loop is not None:
        stats = spec_loop.speculator.stats
        print(json.dumps({"mode": f"json_schema+{config.method}", **base,
                          "ms_per_token": round(statistics.fmean(spec_ms), 3),
                          "speedup_vs_json_schema": round(statistics.fmean(json_tok_ms) / statistics.fmean(spec_ms), 3),
                          "acceptance": round(stats.accepted_tokens / stats.draft_tokens, 3) if stats.draft_tokens
                          else None, "same": same}))
        spec_loop.speculator.close()


if __name__ == "__main__":
    main()
