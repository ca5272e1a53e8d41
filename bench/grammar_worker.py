"""What compiling grammars in worker processes costs (runtime/grammar_worker.py).

    python bench/grammar_worker.py [TOKENIZER_DIR] [--rounds 20]

For a few constraints (a JSON schema, a Lark chain, a 1,000-string choice, a regex), each made
distinct per round so no cache helps, times the two ways to a matcher, median over rounds:
``in_process_ms`` (validate with llguidance, then build the LLMatcher, on this thread: what the
server did before) and ``worker_ms`` (the shape scan, conversion and validation in a worker
process, then the LLMatcher built here: what the server does now), and the worker's start
(``worker_start_ms``: spawn, import llguidance, build the tokenizer). One JSON line per constraint.
TOKENIZER_DIR defaults to the shared stories260K (512 tokens); pass a larger model's directory
(one with tokenizer.json) to see a real vocabulary.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import llguidance

from infeng_runtime.grammar_limits import GrammarLimits, parser_limits
from infeng_runtime.grammar_worker import GrammarWorkers, TokenizerSpec
from infeng_runtime.grammar_worker import llguidance_grammar
from infeng_runtime.structured import GrammarCompiler, GrammarSpec
from infeng_common.tokenizer import Tokenizer

STORIES = Path(__file__).resolve().parents[2] / "shared" / "assets" / "models" / "stories260K"


def constraints(i: int) -> dict[str, GrammarSpec]:
    schema = {"type": "object", "properties": {f"field{j}_{i}": {"type": "string", "maxLength": 20} for j in range(20)},
              "required": [f"field0_{i}"]}
    chain = "\n".join([f"start: r0 \"{i}\""] + [f"r{j}: r{j + 1} \"x\"" for j in range(50)] + ['r50: "a"'])
    return {"json_schema_20_fields": GrammarSpec("json", schema),
            "lark_chain_50": GrammarSpec("grammar", chain),
            "choice_1000": GrammarSpec("choice", [f"word{j}-{i}" for j in range(1000)]),
            "regex": GrammarSpec("regex", f"[a-z]{{1,{10 + i}}}@[a-z]+\\\\.com")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokenizer", nargs="?", type=Path, default=STORIES)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    tok = Tokenizer(args.tokenizer)
    vocab = tok.vocab_size
    t0 = time.perf_counter()
    workers = GrammarWorkers(TokenizerSpec(tok.hf.to_str(), vocab, tuple(tok.eos_token_ids)), 1)
    workers.check("regex", "a", "p", GrammarLimits())                   # waits for the worker to start
    start_ms = (time.perf_counter() - t0) * 1e3
    here = GrammarCompiler(tok, vocab)
    there = GrammarCompiler(tok, vocab, workers=workers)
    ll_tok = here.ll_tokenizer
    times: dict[str, dict[str, list[float]]] = {}
    for i in range(args.rounds):
        for name, spec in constraints(i).items():
            t = times.setdefault(name, {"in_process": [], "worker": []})
            t0 = time.perf_counter()
            grammar = llguidance_grammar(spec.kind, spec.value, spec.param)
            llguidance.LLMatcher.validate_grammar_with_warnings(grammar, ll_tok, limits=parser_limits())
            llguidance.LLMatcher(ll_tok, grammar, log_level=0, limits=parser_limits())
            t["in_process"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            there.constraint(spec, 1)
            t["worker"].append(time.perf_counter() - t0)
    workers.close()
    for name, t in times.items():
        print(json.dumps({"constraint": name, "vocab": vocab, "rounds": args.rounds,
                          "in_process_ms": round(statistics.median(t["in_process"]) * 1e3, 3),
                          "worker_ms": round(statistics.median(t["worker"]) * 1e3, 3),
                          "worker_start_ms": round(start_ms, 1)}))


if __name__ == "__main__":
    main()
