"""Speculative decoding on a real model, batch 1 and (``--batch``) several prompts at a time
(BENCHMARKS.md, "Speculative decoding protocol").

    python bench/speculative.py --threads 2                                  # SmolLM2-135M-Instruct, int4
    python bench/speculative.py --threads 2 --quant f16 --draft-quant int4   # f16 target, int4 draft
    python bench/speculative.py --threads 2 --kv f16                         # f16 KV, as llama.cpp's default
    python bench/speculative.py --artifact x.infeng --modes plain,ngram
    python bench/speculative.py --threads 2 --passages 3 --batch 4            # also 4 prompts at a time
    python bench/speculative.py --replay 0.1,0.2                             # deterministic, no timing

The model is SmolLM2-135M-Instruct from the package registry (``infeng_models.registry``), compiled
from its GGUF (``--quant``: the target's weights, int4/int8/fp8, or f32/f16/bf16 for the GGUF's
values widened; ``none`` is f32; ``--kv``: its KV cache format, f32 by default, f16 as llama.cpp
keeps its KV cache). Prompts, chat-rendered, greedy:

- input-grounded: rewrite, extract from and summarise a 512-token wikitext passage given in the
  prompt (``--passages N``: the same three tasks on N articles, ``rewrite-2`` ...); edit a given code
  file (rename a function, return the whole file);
- free generation: a story.

Each prompt runs without speculation (``plain``), with n-gram/prompt lookup (``ngram``) and, with
``--draft-quant``, with a draft model (``draft``: the same GGUF compiled with that quantization);
the modes alternate ``--rounds`` times and each keeps its best decode speed. Every mode must give
the plain run's tokens (greedy speculation is exact); a mismatch is reported as ``"same": false``.
One JSON line per prompt and mode: decode tok/s (tokens after the first / time from the first to
the last), the speedup over plain, acceptance (accepted / drafted tokens), tokens per target step.
With ``--batch N``, the grounded prompts also run N at a time (one batch per N, in order, as a
server decodes concurrent requests): one line per batch and mode with the batch's decode tok/s
(tokens after each prompt's first / seconds from the batch's last first token to its end), the
speedup over plain and the token rows per step, and llama.cpp's plain decode of as many sequences
at once (``llama-batched-bench``) at the batch's mean prompt length.

With llama.cpp built (``../shared/tools/build-llamacpp.sh``), in the same run and on the same
weights (the registry's Q4_1 GGUF for an int4 target; for f32/f16/bf16/int8 targets that GGUF
widened by ``llama-quantize --allow-requantize`` to F32/F16/F16/Q8_0), the same threads: its plain
decode of as many tokens at the prompt's depth (``llama-bench -p 0 -n N -d PROMPT``), its
prompt-lookup decoding (``llama-lookup``, its defaults) of the same prompt and, with a draft,
``llama-speculative-simple --spec-type draft-simple`` with the Q4_1 GGUF drafting. A ``summary``
line per prompt gives every ratio of that run.

``--replay SLOPES`` measures no time: it decodes each prompt once without speculation, then replays
the n-gram speculator (``runtime/spec/drafters.py``, the same code) over those tokens with a step
cost of ``1 + slope * (T - 1)`` (T: token rows; ``measured`` in the list: the target's own curve). Greedy
speculation emits the plain tokens, so the replay gives the exact steps, drafts and acceptance of a
real run, and the modelled speedup (plain steps / cost of the speculative steps); ``bound`` is the
same drafter with each step's length known in hindsight (its accepted count), nearly an upper bound
for any length rule (not strictly: a rule that stops short puts the next step's drafts after other
suffixes, which can find longer copies), and ``bound_tokens_per_step`` its tokens per step with
every draft run (what the drafter can give at all). ``tree_tokens_per_step``: tokens per step if
each step offered the target up to TREE_CANDIDATES prompt-lookup continuations at once (every
earlier occurrence of the last 3, 2, then 1 tokens, distinct continuations of up to ``--max-draft``
tokens) and kept the best, with hindsight: what a draft tree of prompt-lookup candidates could reach
before paying for its rows; ``tree_bound`` its modelled speedup with each step costed at the rows it
keeps (an upper bound for any tree of those candidates, which also pays for the rows it drops).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "assets" / "text" / "wikitext-2-raw-v1-test.txt"
#: A wikitext article's title line (" = Title = "; sections are " == ... == ").
ARTICLE_HEADING = r"^ = [^=].* = $"
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


def passage(tokenizer, n_tokens: int = 512, article: int = 0) -> str:
    """The first ``n_tokens`` tokens of a wikitext article body (headings dropped), as text: the start
    of the file for ``article`` 0, else the body of its ``article``-th article."""
    text = WIKITEXT.read_text(encoding="utf-8")
    if article:
        text = re.split(ARTICLE_HEADING, text, flags=re.MULTILINE)[article + 1]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("=")]
    body = " ".join(lines[:60])
    ids = tokenizer.encode(body)[:n_tokens]
    return tokenizer.decode(ids)


def prompts(tokenizer, passages: int = 1) -> dict[str, tuple[str, str]]:
    """name -> (kind, user message); the passage tasks once per passage (``rewrite``, ``rewrite-2``, ...)."""
    out = {}
    for i in range(passages):
        text, tag = passage(tokenizer, article=i), "" if i == 0 else f"-{i + 1}"
        out |= {
            f"rewrite{tag}": ("grounded",
                              f"Rewrite the following text, correcting any typos. Output the full text.\n\n{text}"),
            f"extract{tag}": ("grounded", f"Copy every sentence of the following text that mentions a year.\n\n{text}"),
            f"summarise{tag}": ("grounded", f"Summarise the following text.\n\n{text}"),
        }
    return out | {
        "code": ("grounded", ("Rename the function `sample` to `draw` in this Python file and return the whole "
                             f"file.\n\n```python\n{CODE_FILE}```")),
        "story": ("free", "Write a story about a dragon who learns to bake bread."),
    }


WIDEN = {"f32": "f32", "none": "f32", "f16": "f16", "bf16": "bf16"}
#: llama.cpp's type for the same weights as an infeng target (None: the registry's Q4_1 file as is).
PEER_TYPE = {"int4": None, "int8": "Q8_0", "f32": "F32", "none": "F32", "f16": "F16", "bf16": "F16"}


def compile_gguf(gguf: Path, out: Path, quant: str, recompile: bool, kv: str = "f32") -> Path:
    """``quant``: int4/int8/fp8 (``--quant``) or f32/f16/bf16 (``--dtype``: the GGUF's values widened);
    ``kv``: the KV cache format (``infeng compile --kv``)."""
    if recompile or not (out / "manifest.json").exists():
        flags = ["--dtype", WIDEN[quant]] if quant in WIDEN else ["--quant", quant]
        flags += ["--kv", kv]
        done = subprocess.run(["infeng", "compile", str(gguf), "-o", str(out), *flags], check=False,
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"infeng compile {gguf} ({quant}) failed:\n{done.stderr.strip()}")
    return out


def peer_exe(name: str) -> Path | None:
    exe = PEER / "build" / "bin" / name
    return exe if exe.exists() else None


def peer_gguf(gguf: Path, quant: str, workdir: Path) -> Path | None:
    """llama.cpp's file with the same weights as the infeng target (None: no such type)."""
    if quant not in PEER_TYPE:
        return None
    kind = PEER_TYPE[quant]
    if kind is None:
        return gguf
    out = workdir / f"{gguf.stem}.{kind}.gguf"
    exe = peer_exe("llama-quantize")
    if not out.exists() and exe is not None:
        subprocess.run([str(exe), "--allow-requantize", str(gguf), str(out), kind], check=True, capture_output=True)
    return out if out.exists() else None


def peer_decode(gguf: Path, threads: int, n: int, depth: int) -> float | None:
    """llama.cpp's plain decode tok/s: ``n`` tokens after ``depth`` tokens of context."""
    exe = peer_exe("llama-bench")
    if exe is None:
        return None
    out = subprocess.run([str(exe), "-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(n), "-d", str(depth),
                          "-r", "3", "-o", "json"], check=False, capture_output=True, text=True)
    if out.returncode != 0:
        return None
    rows = json.loads(out.stdout)
    return float(rows[0]["avg_ts"]) if rows else None


def peer_batched(gguf: Path, threads: int, n: int, depth: int, sequences: int) -> float | None:
    """llama.cpp's plain decode of ``sequences`` sequences at once, tok/s over all of them: ``n``
    tokens each after ``depth`` tokens of context (``llama-batched-bench``)."""
    exe = peer_exe("llama-batched-bench")
    if exe is None:
        return None
    out = subprocess.run([str(exe), "-m", str(gguf), "-t", str(threads), "-c", str(sequences * (depth + n) + 64),
                          "-npp", str(depth), "-ntg", str(n), "-npl", str(sequences), "--output-format", "jsonl"],
                         check=False, capture_output=True, text=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return float(rows[-1]["speed_tg"]) if out.returncode == 0 and rows else None


def peer_speculative(exe_name: str, args: list[str], prompt: str, threads: int, n: int) -> dict | None:
    """A llama.cpp speculative example on ``prompt`` (greedy): its decode tok/s and acceptance."""
    exe = peer_exe(exe_name)
    if exe is None:
        return None
    try:
        out = subprocess.run([str(exe), *args, "-t", str(threads), "-n", str(n), "--temp", "0", "-p", prompt],
                             check=False, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return None
    log = out.stdout + out.stderr
    m = re.search(r"decoded\s+(\d+)\s+tokens in\s+([\d.]+)\s+seconds, speed:\s+([\d.]+)\s+t/s", log)
    acc = re.search(r"accept\s*=\s*([\d.]+)%", log)
    if not m:
        return None
    return {"tok_s": float(m.group(3)), "acceptance": round(float(acc.group(1)) / 100, 3) if acc else None}


def replay(prompt: list[int], output: list[int], cost, max_draft: int, hindsight: bool = False) -> dict:
    """The n-gram speculator replayed over a greedy output (see the module docstring). ``hindsight``:
    the drafter drafts all it has (up to ``max_draft``) and each step is costed as if it had run
    only the drafts that were accepted."""
    from types import SimpleNamespace

    from infeng_runtime.sampling import accept_greedy
    from infeng_runtime.spec import SpeculativeConfig, Speculator

    config = SpeculativeConfig("ngram", max_draft=max_draft, adaptive=not hindsight)
    spec = Speculator(config, engine=None, cost=None if hindsight else cost)
    seq = SimpleNamespace(seq_id=0, tokens=list(prompt) + output[:1], spec=spec.state())
    done, steps, seconds, drafted, accepted = 1, 0, 0.0, 0, 0
    plain = sum(cost.at(1, len(prompt) + i) for i in range(1, len(output)))
    while done < len(output):
        draft = spec.propose([seq], [len(output) - done - 1], 1, 1)[0]
        a = accept_greedy(output[done:done + len(draft) + 1], draft)
        spec.verified(seq, len(draft), a)
        seq.tokens += output[done:done + a + 1]
        done, steps = done + a + 1, steps + 1
        seconds += cost.at(1 + (a if hindsight else len(draft)), len(seq.tokens) - a - 1)
        drafted, accepted = drafted + len(draft), accepted + a
    return {"steps": steps, "tokens_per_step": round((len(output) - 1) / max(steps, 1), 2),
            "drafted_per_step": round(drafted / max(steps, 1), 2),
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "modelled_speedup": round(plain / seconds, 3) if seconds else 1.0}


#: Prompt-lookup continuations a draft tree would offer per step (``--replay``'s tree_* figures).
TREE_CANDIDATES = 8


def lookup_candidates(tokens: list[int], k: int, length: int) -> list[tuple[int, ...]]:
    """Up to ``k`` distinct continuations (``length`` tokens) of the earlier occurrences of the last 3,
    then 2, then 1 tokens; within an order, the longest agreeing run before the occurrence first."""
    from infeng_runtime.spec import run_before

    n, out = len(tokens), []
    for order in (3, 2, 1):
        if n <= order:
            continue
        suffix = tokens[n - order:]
        seen = [j for j in range(order, n) if tokens[j - order:j] == suffix]
        for j in sorted(seen, key=lambda j: (run_before(tokens, j - order, n - order), j), reverse=True):
            c = tuple(tokens[j:j + length])
            if c and c not in out:
                out.append(c)
                if len(out) == k:
                    return out
    return out


def tree_oracle(prompt: list[int], output: list[int], k: int, length: int, cost) -> dict:
    """Each step keeps the best of ``lookup_candidates`` (hindsight) and is costed at the rows it
    keeps: tokens per step and the modelled speedup over plain decode (as ``replay``'s)."""
    tokens, done, steps, seconds = list(prompt) + output[:1], 1, 0, 0.0
    plain = sum(cost.at(1, len(prompt) + i) for i in range(1, len(output)))
    while done < len(output):
        best = 0
        for c in lookup_candidates(tokens, k, length):
            a = 0
            while a < len(c) and done + a < len(output) - 1 and c[a] == output[done + a]:
                a += 1
            best = max(best, a)
        seconds += cost.at(1 + best, len(tokens))
        tokens += output[done:done + best + 1]
        done, steps = done + best + 1, steps + 1
    return {"tokens_per_step": round((len(output) - 1) / max(steps, 1), 2),
            "modelled_speedup": round(plain / seconds, 3) if seconds else 1.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", type=Path, help="a compiled target (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--quant", default="int4", help="the target's weights: int4, int8, fp8, f32, f16 or bf16")
    ap.add_argument("--kv", default="f32", help="the target's KV cache format (infeng compile --kv): f16 is "
                                                "llama.cpp's default, whose decode the bench runs")
    ap.add_argument("--draft-quant", default=None, help="also run a draft model: the GGUF with this quant")
    ap.add_argument("--modes", default="plain,ngram,draft")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--max-draft", type=int, default=8, help="the most drafted tokens per step (ngram:K)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", default="rewrite,extract,summarise,code,story")
    ap.add_argument("--passages", type=int, default=1,
                    help="wikitext passages for the rewrite/extract/summarise prompts (the first article, then the "
                         "2nd, 3rd, ...): a prompt's gain depends on the one output the model happens to write")
    ap.add_argument("--batch", type=int, default=1,
                    help="also decode the grounded prompts this many at a time (one batch per group, in order)")
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "infeng" / "bench-speculative")
    ap.add_argument("--recompile", action="store_true", help="compile the artifacts even if the workdir has them")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--replay", default=None,
                    help="no timing: replay the n-gram speculator with these step-cost slopes (or 'measured')")
    args = ap.parse_args()
    tasks = ("rewrite", "extract", "summarise", "code", "story")
    unknown = [name for name in args.prompts.split(",") if name not in tasks]
    if unknown:
        raise SystemExit(f"--prompts: unknown {', '.join(unknown)} (the tasks are {', '.join(tasks)})")
    for item in args.replay.split(",") if args.replay else ():
        if item != "measured" and not re.fullmatch(r"\d+(\.\d*)?", item):
            raise SystemExit(f"--replay: {item!r} is neither a slope nor 'measured'")
    if not 1 <= args.batch <= 64:
        raise SystemExit("--batch must be between 1 and 64")
    articles = len(re.findall(ARTICLE_HEADING, WIKITEXT.read_text(encoding="utf-8"), flags=re.MULTILINE))
    if not 1 <= args.passages <= articles:
        raise SystemExit(f"--passages must be between 1 and {articles} (the wikitext file's articles)")

    from infeng_runtime.chat import render_chat
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams
    from infeng_runtime.spec import MEASURED_T, CostModel

    if args.artifact is not None and args.kv != "f32":
        raise SystemExit("--kv applies to the registry model this bench compiles; an --artifact keeps the KV "
                         "cache format it was compiled with")
    gguf = None
    if args.artifact is None:
        from infeng_models.registry import SMOLLM2_135M_INSTRUCT, fetch

        gguf = fetch(SMOLLM2_135M_INSTRUCT)
        args.workdir.mkdir(parents=True, exist_ok=True)
        kv_tag = "" if args.kv == "f32" else f"-kv{args.kv}"
        args.artifact = compile_gguf(gguf, args.workdir / f"smollm2-{args.quant}{kv_tag}.infeng", args.quant,
                                     args.recompile, args.kv)
    params = SamplingParams(max_new_tokens=args.max_tokens)

    def chat_ids(tok, message: str) -> tuple[str, list[int]]:
        text = render_chat(tok, [{"role": "user", "content": message}], add_generation_prompt=True)
        return text, tok.encode(text, add_bos=False)

    chosen_prompts = args.prompts.split(",")
    if args.replay:
        llm = LLM(args.artifact, threads=args.threads, max_seqs=1)
        tok = llm.tokenizer
        chosen = {name: item for name, item in prompts(tok, args.passages).items()
                  if name.partition("-")[0] in chosen_prompts}
        costs = {}
        for item in args.replay.split(","):
            if item == "measured":
                measured = CostModel.measure(llm.engine)
                unit = measured.at(1)
                deep = {t: measured.deep.at(t) / unit for t in MEASURED_T} if measured.deep else None
                costs[item] = CostModel({t: measured.at(t) / unit for t in MEASURED_T}, deep, measured.depth)
            else:
                costs[f"slope {item}"] = CostModel({t: 1 + float(item) * (t - 1) for t in MEASURED_T})
        for name, (kind, message) in chosen.items():
            ids = chat_ids(tok, message)[1]
            output = llm.generate([ids], params)[0].token_ids
            for label, cost in costs.items():
                bound = replay(ids, output, cost, args.max_draft, hindsight=True)
                tree = tree_oracle(ids, output, TREE_CANDIDATES, args.max_draft, cost)
                emit(prompt=name, kind=kind, mode="replay", cost=label, tokens=len(output),
                     **replay(ids, output, cost, args.max_draft), bound=bound["modelled_speedup"],
                     bound_tokens_per_step=bound["tokens_per_step"], tree_tokens_per_step=tree["tokens_per_step"],
                     tree_bound=tree["modelled_speedup"])
        llm.close()
        return

    modes = [m for m in args.modes.split(",") if m != "draft" or args.draft_quant]
    draft = None
    if "draft" in modes:
        if gguf is None:
            raise SystemExit("--draft-quant needs the registry model (no --artifact)")
        draft = compile_gguf(gguf, args.workdir / f"smollm2-{args.draft_quant}.infeng", args.draft_quant,
                             args.recompile)
    specs = {"plain": None, "ngram": f"ngram:{args.max_draft}", "draft": f"draft:{draft}:{args.max_draft}"}
    llms = {m: LLM(args.artifact, threads=args.threads, max_seqs=args.batch, speculative=specs[m]) for m in modes}
    tok = llms[modes[0]].tokenizer
    chosen = {k: v for k, v in prompts(tok, args.passages).items() if k.partition("-")[0] in chosen_prompts}
    peer = None if args.no_peer or gguf is None else peer_gguf(gguf, args.quant, args.workdir)
    for name, (kind, message) in chosen.items():
        text, ids = chat_ids(tok, message)
        best: dict[str, dict] = {}
        for _ in range(args.rounds):
            for mode in modes:
                llm = llms[mode]
                if llm.loop.speculator is not None:      # no drafts from an earlier run of this prompt
                    llm.loop.speculator.forget_requests()
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
        summary = {"prompt": name, "kind": kind, "mode": "summary", "threads": args.threads}
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
                summary[f"{mode}_vs_plain"] = row.get("speedup")
            emit(**row)
            summary[f"{mode}_tok_s"] = row["tok_s"]
        if peer is not None:
            n = args.max_tokens
            runs = {"llama_plain": {"tok_s": peer_decode(peer, args.threads, n, len(ids))},
                    "llama_lookup": peer_speculative("llama-lookup", ["-m", str(peer)], text, args.threads, n)}
            if draft is not None:
                runs["llama_draft"] = peer_speculative("llama-speculative-simple", [
                    "-m", str(peer), "-md", str(gguf), "--spec-type", "draft-simple"], text, args.threads, n)
            for peer_mode, r in runs.items():
                if r and r.get("tok_s"):
                    emit(prompt=name, kind=kind, mode=peer_mode, threads=args.threads, gguf=peer.name, **r)
                    for mode in modes:
                        summary[f"{mode}_vs_{peer_mode}"] = round(summary[f"{mode}_tok_s"] / r["tok_s"], 3)
        emit(**summary)
    if args.batch > 1:
        grounded = [(name, chat_ids(tok, message)[1]) for name, (kind, message) in chosen.items() if kind == "grounded"]
        for i in range(0, len(grounded) - args.batch + 1, args.batch):
            batch_run(llms, modes, grounded[i:i + args.batch], params, args.rounds, args.threads, peer)
    for llm in llms.values():
        llm.close()


def batch_run(llms: dict, modes: list[str], batch: list[tuple[str, list[int]]], params, rounds: int,
              threads: int, peer: Path | None) -> None:
    """The prompts of ``batch`` in one generate call (decoded together), each mode, best of ``rounds``:
    decode tok/s = tokens after each prompt's first / seconds from the last first token to the end;
    token rows per step over all the call's steps (after the first round the prompts come from the
    prefix cache, so their prefill is a row or two). With ``peer``, llama.cpp's plain decode of as
    many sequences at the batch's mean prompt length, in the same run."""
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for mode in modes:
            llm = llms[mode]
            if llm.loop.speculator is not None:
                llm.loop.speculator.forget_requests()
            steps0, rows0 = llm.loop.stats.steps, llm.loop.stats.tokens
            t0 = time.perf_counter()
            done = llm.generate([ids for _, ids in batch], params)
            wall = time.perf_counter() - t0
            decode = wall - max(c.prefill_seconds for c in done)
            steps = llm.loop.stats.steps - steps0
            generated = sum(len(c.token_ids) - 1 for c in done)
            r = {"tok_s": generated / decode if decode > 0 else 0.0, "tokens": [c.token_ids for c in done],
                 "rows_per_step": round((llm.loop.stats.tokens - rows0) / steps, 1)}
            if mode not in best or r["tok_s"] > best[mode]["tok_s"]:
                best[mode] = r
    plain = best.get("plain")
    for mode in modes:
        r = best[mode]
        row = {"prompt": "+".join(name for name, _ in batch), "mode": mode, "batch": len(batch),
               "tok_s": round(r["tok_s"], 1), "rows_per_step": r["rows_per_step"], "threads": threads}
        if plain is not None:
            row["speedup"] = round(r["tok_s"] / plain["tok_s"], 3)
            row["same"] = r["tokens"] == plain["tokens"]
        emit(**row)
    if peer is not None:
        depth = sum(len(ids) for _, ids in batch) // len(batch)
        tok_s = peer_batched(peer, threads, params.max_new_tokens, depth, len(batch))
        if tok_s:
            emit(prompt="+".join(name for name, _ in batch), mode="llama_plain", batch=len(batch),
                 tok_s=round(tok_s, 1), threads=threads, gguf=peer.name,
                 **{f"{mode}_vs_llama_plain": round(best[mode]["tok_s"] / tok_s, 3) for mode in modes})


if __name__ == "__main__":
    main()
