"""Per-token mask cost of three grammar engines (xgrammar, llguidance, outlines-core) on one tokenizer.

    python bench/grammar_mask.py                       # SmolLM2's 49,152-token vocabulary (registry GGUF)
    python bench/grammar_mask.py --tokenizer DIR       # a directory with tokenizer.json

Each engine compiles a set of JSON schemas (nested objects, arrays, enums, bounded numbers) and
free JSON, then is driven token by token through a valid document of each (the tokenizer's own
tokenization of it), filling the next-token mask before every token as a sampler would. Prints one
JSON line per engine and grammar: compile seconds, mask microseconds per token (mean, p50, p99,
max), and the check that the document's every token was allowed. The choice in
``runtime/structured.py`` (and docs/serving.md) follows these numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from infeng_compiler.frontends.gguf import byte_alphabet

SCHEMAS = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "email", "tags"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "engines", "poetry"]}),
    "order": ({"type": "object", "properties": {
        "id": {"type": "integer"}, "status": {"enum": ["open", "paid", "shipped"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
            "price": {"type": "number", "minimum": 0}}, "required": ["sku", "qty", "price"],
            "additionalProperties": False}, "minItems": 1},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["id", "status", "items", "address"], "additionalProperties": False},
        {"id": 1042, "status": "paid", "items": [{"sku": "A-1", "qty": 2, "price": 9.5},
                                                  {"sku": "B-77", "qty": 1, "price": 120.0}],
         "address": {"city": "Lisbon", "zip": "1100-148"}}),
}
FREE_JSON_DOC = {"answer": "yes", "reasons": ["short", "clear"], "score": 0.93, "nested": {"ok": True, "n": None}}


def smollm2_tokenizer_dir() -> Path:
    """tokenizer.json of SmolLM2-135M-Instruct, written from the registry GGUF by the GGUF frontend."""
    from infeng_models.registry import SMOLLM2_135M_INSTRUCT, fetch

    gguf = fetch(SMOLLM2_135M_INSTRUCT)
    from infeng_compiler.frontends.gguf import gguf_tokenizer_dir, open_gguf

    return gguf_tokenizer_dir(open_gguf(gguf))


def timed_walk(fill, consume, doc_ids: list[int]) -> tuple[list[float], bool]:
    """Fill the mask before each token of the document, check the token is allowed, consume it."""
    times, ok = [], True
    for t in doc_ids:
        t0 = time.perf_counter()
        allowed = fill()
        times.append(time.perf_counter() - t0)
        ok = ok and allowed(t)
        consume(t)
    return times, ok


def bench_llguidance(tok_json: str, eos: int, n_vocab: int, grammars, rounds: int):
    import llguidance
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(tok_json, n_vocab=n_vocab, eos_token=eos)
    setup = time.perf_counter() - t0
    for name, (schema, doc_ids) in grammars.items():
        t0 = time.perf_counter()
        spec = llguidance.LLMatcher.grammar_from_json_schema(schema or {"type": "object"},
                                                             defaults={"whitespace_flexible": False, "item_separator": ", ",
                                                                       "key_separator": ": "})
        m = llguidance.LLMatcher(lt, spec)
        compile_s = time.perf_counter() - t0
        assert not m.is_error(), m.get_error()
        mask = lnp.allocate_token_bitmask(1, lt.vocab_size)
        times, ok, first = [], True, None
        for _ in range(rounds):
            m.reset()

            def fill():
                lnp.fill_next_token_bitmask(m, mask, 0)
                return lambda t: bool(mask[0, t >> 5] >> (t & 31) & 1)

            ts, good = timed_walk(fill, m.consume_token, doc_ids)
            first = ts if first is None else first
            times += ts
            ok = ok and good
        yield name, setup, compile_s, first, times, ok


def bench_xgrammar(hf_tok, eos: int, n_vocab: int, grammars, rounds: int):
    import xgrammar as xgr

    t0 = time.perf_counter()
    vocab = [b""] * n_vocab
    for tok, i in hf_tok.get_vocab().items():
        vocab[i] = tok
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=n_vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0
    for name, (schema, doc_ids) in grammars.items():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False) if schema else \
            compiler.compile_builtin_json_grammar()
        compile_s = time.perf_counter() - t0
        m = xgr.GrammarMatcher(compiled)
        mask = np.zeros(xgr.get_bitmask_shape(1, n_vocab), dtype=np.int32)
        times, ok, first = [], True, None
        for _ in range(rounds):
            m.reset()

            def fill():
                m.fill_next_token_bitmask(mask, 0)
                return lambda t: bool(int(mask[0, t >> 5]) >> (t & 31) & 1)

            ts, good = timed_walk(fill, m.accept_token, doc_ids)
            first = ts if first is None else first
            times += ts
            ok = ok and good
        yield name, setup, compile_s, first, times, ok


def bench_outlines(hf_tok, eos: int, n_vocab: int, grammars, rounds: int):
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    byte_of = {c: b for b, c in byte_alphabet().items()}
    t0 = time.perf_counter()
    table: dict[bytes, list[int]] = {}
    for tok, i in hf_tok.get_vocab().items():
        if i == eos:
            continue
        try:
            raw = bytes(byte_of[c] for c in tok)
        except KeyError:                          # an added special token: its text as is
            raw = tok.encode()
        table.setdefault(raw, []).append(i)
    vocab = oc.Vocabulary(eos, table)
    setup = time.perf_counter() - t0
    for name, (schema, doc_ids) in grammars.items():
        if schema is None:                         # outlines-core has no free-JSON grammar (a regex cannot nest)
            continue
        t0 = time.perf_counter()
        index = oc.Index(build_regex_from_schema(json.dumps(schema)), vocab)
        compile_s = time.perf_counter() - t0
        times, ok, first = [], True, None
        mask = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        for _ in range(rounds):
            guide = oc.Guide(index)

            def fill():
                mask[:] = 0
                guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
                return lambda t: bool(int(mask[t >> 5]) >> (t & 31) & 1)

            ts, good = timed_walk(fill, lambda t: guide.advance(t, return_tokens=False), doc_ids[:-1])
            good = good and guide.is_finished()           # outlines ends on a final state, not on EOS
            first = ts if first is None else first
            times += ts
            ok = ok and good
        yield name, setup, compile_s, first, times, ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="directory with tokenizer.json (default: SmolLM2-135M-Instruct's)")
    ap.add_argument("--rounds", type=int, default=5, help="walks through each document")
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    args = ap.parse_args()
    from infeng_common.tokenizer import Tokenizer

    tok_dir = Path(args.tokenizer) if args.tokenizer else smollm2_tokenizer_dir()
    tok = Tokenizer(tok_dir)
    hf = tok.hf
    n_vocab = hf.get_vocab_size(with_added_tokens=True)
    eos = tok.eos_token_ids[0]
    grammars = {name: (schema, hf.encode(json.dumps(doc, separators=(", ", ": ")), add_special_tokens=False).ids
                       + [eos]) for name, (schema, doc) in SCHEMAS.items()}
    grammars["json_object"] = (None, hf.encode(json.dumps(FREE_JSON_DOC, separators=(", ", ": ")),
                                               add_special_tokens=False).ids + [eos])
    runners = {"llguidance": lambda: bench_llguidance(hf.to_str(), eos, n_vocab, grammars, args.rounds),
               "xgrammar": lambda: bench_xgrammar(hf, eos, n_vocab, grammars, args.rounds),
               "outlines-core": lambda: bench_outlines(hf, eos, n_vocab, grammars, args.rounds)}
    for engine in args.engines.split(","):
        try:
            for name, setup, compile_s, first, times, ok in runners[engine]():
                us = sorted(t * 1e6 for t in times)
                print(json.dumps({"engine": engine, "grammar": name, "vocab": n_vocab, "tokens": len(times),
                                  "tokenizer_setup_s": round(setup, 3), "compile_s": round(compile_s, 4),
                                  "mask_us_first_walk": round(statistics.fmean(first) * 1e6, 1),
                                  "mask_us_mean": round(statistics.fmean(us), 1),
                                  "mask_us_p50": round(us[len(us) // 2], 1),
                                  "mask_us_p99": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1),
                                  "mask_us_max": round(us[-1], 1), "document_allowed": ok}), flush=True)
        except Exception as e:                     # an engine that cannot run here: say so, go on
            print(json.dumps({"engine": engine, "error": f"{type(e).__name__}: {e}"}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
