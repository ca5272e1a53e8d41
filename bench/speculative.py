"""Speculative decoding at batch 1 on a real model (BENCHMARKS.md, "Speculative decoding protocol").

    python bench/speculative.py --threads 2                                  # SmolLM2-135M-Instruct, int4
    python bench/speculative.py --threads 2 --quant none --draft-quant int4  # f32 target, int4 draft
    python bench/speculative.py --artifact x.infeng --modes plain,ngram

The model is SmolLM2-135M-Instruct from the package registry (``infeng_models.registry``), compiled
from its GGUF (``--quant``: the target's weights; ``none`` keeps the GGUF's values in f32). Prompts,
chat-rendered, greedy:

- input-grounded: rewrite, extract from and summarise a 512-token wikitext passage given in the
  prompt; edit a given code file (rename a function, return the whole file);
- free generation: a story.

Each prompt runs without speculation (``plain``), with n-gram/prompt lookup (``ngram``) and, with
``--draft-quant``, with a draft model (``draft``: the same GGUF compiled with that quantization);
the modes alternate ``--rounds`` times and each keeps its best decode speed. Every mode must give
the plain run's tokens (greedy speculation is exact); a mismatch is reported as ``"same": false``.
One JSON line per prompt and mode: decode tok/s (tokens after the first / time from the first to
the last), the speedup over plain, acceptance (accepted / drafted tokens), tokens per target step.
With llama.cpp built (``../shared/tools/build-llamacpp.sh``), ``llama-bench -n`` plain decode of the
same GGUF in the same run (``peer_tok_s``; ``vs_peer``: infeng's tok/s over it), and ``llama-lookup``
where the built version has it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "assets" / "text" / "wikitext-2-raw-v1-test.txt"
PEER = Path(os.environ.get("PEER_DIR", Path.home() / ".cache" / "infeng-peers")) / "llama.cpp"

CODE_FILE = '''def sample(logits, params, rng):
    """One token id from a row of logits."""
    if params.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    if params.top_k and params.top_k < z.size:
        kth = np.partition(z, -params.top_k)[-params.top_k]
        z = np.where(z < kth, -np.inf, z)
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p)
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, params.top_p)) + 1]
        mask = np.zeros_like(p)
        mask[keep] = p[keep]
        p = mask / mask.sum()
    return int(rng.choice(p.size, p=p))
'''


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def passage(tokenizer, n_tokens: int = 512) -> str:
    """The first ``n_tokens`` tokens of a wikitext article body (headings dropped), as text."""
    text = WIKITEXT.read_text(encoding="utf-8")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("=")]
    body = " ".join(lines[:60])
    ids = tokenizer.encode(body)[:n_tokens]
    return tokenizer.decode(ids)


def prompts(tokenizer) -> dict[str, tuple[str, str]]:
    """name -> (kind, user message)."""
    text = passage(tokenizer)
    return {
        "rewrite": ("grounded", f"Rewrite the following text, correcting any typos. Output the full text.\n\n{text}"),
        "extract": ("grounded", f"Copy every sentence of the following text that mentions a year.\n\n{text}"),
        "summarise": ("grounded", f"Summarise the following text.\n\n{text}"),
        "code": ("grounded", "Rename the function `sample` to `draw` in this Python file and return the whole "
                             f"file.\n\n```python\n{CODE_FILE}```"),
        "story": ("free", "Write a story about a dragon who learns to bake bread."),
    }


def compile_gguf(gguf: Path, out: Path, quant: str | None) -> Path:
    """``quant`` None: every weight widened to f32 (``--dtype f32``), the GGUF's values."""
    if not (out / "manifest.json").exists():
        cmd = ["infeng", "compile", str(gguf), "-o", str(out)] + (["--quant", quant] if quant else ["--dtype", "f32"])
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def peer_decode(gguf: Path, threads: int, n: int = 128) -> float | None:
    bench = PEER / "build" / "bin" / "llama-bench"
    if not bench.exists():
        return None
    out = subprocess.run([str(bench), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(n), "-r", "2",
                          "-o", "json"], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    rows = json.loads(out.stdout)
    return float(rows[0]["avg_ts"]) if rows else None


def peer_lookup(gguf: Path, prompt: str, threads: int, n: int) -> dict | None:
    """llama.cpp's prompt-lookup decoding (``llama-lookup``) of the same prompt, if built."""
    exe = PEER / "build" / "bin" / "llama-lookup"
    if not exe.exists():
        return None
    try:
        out = subprocess.run([str(exe), "-m", str(gguf), "-t", str(threads), "-n", str(n), "--temp", "0",
                              "-p", prompt], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return None
    log = out.stdout + out.stderr
    m = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)\s+t/s", log)
    acc = re.search(r"accept\s*=\s*([\d.]+)%", log)
    if not m:
        return None
    return {"tok_s": float(m.group(3)), "accept": float(acc.group(1)) / 100 if acc else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, help="a compiled target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--quant", default="int4", help="the target's weights: int4, int8 or none (f32)")
    ap.add_argument("--draft-quant", default=None, help="also run a draft model: the GGUF with this quant")
    ap.add_argument("--modes", default="plain,ngram,draft")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", default="rewrite,extract,summarise,code,story")
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "infeng" / "bench-speculative")
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args()

    from infeng_runtime.chat import render_chat
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams

    gguf = None
    if args.artifact is None:
        from infeng_models.registry import SMOLLM2_135M_INSTRUCT, fetch

        gguf = fetch(SMOLLM2_135M_INSTRUCT)
        args.workdir.mkdir(parents=True, exist_ok=True)
        quant = None if args.quant == "none" else args.quant
        args.artifact = compile_gguf(gguf, args.workdir / f"smollm2-{args.quant}.infeng", quant)
    modes = [m for m in args.modes.split(",") if m != "draft" or args.draft_quant]
    draft = None
    if "draft" in modes:
        if gguf is None:
            raise SystemExit("--draft-quant needs the registry model (no --artifact)")
        draft = compile_gguf(gguf, args.workdir / f"smollm2-{args.draft_quant}.infeng", args.draft_quant)
    specs = {"plain": None, "ngram": "ngram", "draft": f"draft:{draft}"}
    llms = {m: LLM(args.artifact, threads=args.threads, max_seqs=1, speculative=specs[m]) for m in modes}
    tok = llms[modes[0]].tokenizer
    chosen = {k: v for k, v in prompts(tok).items() if k in args.prompts.split(",")}
    peer = None if args.no_peer or gguf is None else peer_decode(gguf, args.threads)
    params = SamplingParams(max_new_tokens=args.max_tokens)
    for name, (kind, message) in chosen.items():
        ids = tok.encode(render_chat(tok, [{"role": "user", "content": message}], add_generation_prompt=True),
                         add_bos=False)
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for mode in modes:
                llm = llms[mode]
                spec0 = llm.loop.snapshot()
                steps0 = llm.loop.stats.steps
                c = llm.generate([ids], params)[0]
                s = llm.loop.snapshot()
                r = {"tok_s": c.tok_s, "tokens": c.token_ids, "steps": llm.loop.stats.steps - steps0,
                     "drafted": s["spec_draft_tokens"] - spec0["spec_draft_tokens"],
                     "accepted": s["spec_accepted_tokens"] - spec0["spec_accepted_tokens"]}
                if mode not in best or r["tok_s"] > best[mode]["tok_s"]:
                    best[mode] = r
        plain = best.get("plain")
        for mode in modes:
            r = best[mode]
            n = len(r["tokens"])
            row = {"prompt": name, "kind": kind, "mode": mode, "prompt_tokens": len(ids), "tokens": n,
                   "tok_s": round(r["tok_s"], 1), "threads": args.threads, "target": str(args.artifact.name)}
            if plain is not None:
                row["speedup"] = round(r["tok_s"] / plain["tok_s"], 3) if plain["tok_s"] else None
                row["same"] = r["tokens"] == plain["tokens"]
            if mode != "plain":
                row["acceptance"] = round(r["accepted"] / r["drafted"], 3) if r["drafted"] else None
                row["drafted"] = r["drafted"]
                # the prefill step yields the first token; the rest come from decode steps
                row["tokens_per_step"] = round((n - 1) / max(r["steps"] - 1, 1), 2)
            if peer:
                row["peer_tok_s"] = round(peer, 1)
                row["vs_peer"] = round(r["tok_s"] / peer, 3)
            emit(**row)
        if not args.no_peer and gguf is not None:
            text = render_chat(tok, [{"role": "user", "content": message}], add_generation_prompt=True)
            look = peer_lookup(gguf, text, args.threads, args.max_tokens)
            if look:
                emit(prompt=name, kind=kind, mode="llama-lookup", tok_s=look["tok_s"], acceptance=look["accept"])


if __name__ == "__main__":
    main()
