"""Activation precision on a real 4-bit model: agreement with transformers' f32 model and speed, per
``--act-precision`` path, beside llama.cpp on the same file.

    python bench/act_precision.py quality            # 200 chat prompts (shared CPU is fine)
    flock -x /work/cpu.lock python bench/act_precision.py speed       # tok/s: alone on the machine

The model is SmolLM2-135M-Instruct's Q4_1 GGUF from the package registry (``--gguf`` for another
file). infeng compiles it once per path (``int8``: int8/int16 activations in every step; ``auto``:
f32 activations below AUTO_F32_BELOW token rows, int8 from there on; ``f32``: f32 activations in
every step). The reference is transformers loading the same GGUF (dequantized, f32 arithmetic).

``quality``: 200 prompts (10 question templates x 20 topics, each the user turn of a ChatML prompt
rendered with the model's chat template, token ids shared by every engine). transformers decodes
greedily up to 32 tokens (stopping at end of turn); each infeng path is then run teacher-forced
along that continuation: the prompt as one prefill step, then one decode step per reference
token. Per path: first-token agreement (argmax of the prefill's last row = transformers' first
token), continuation agreement (every position's argmax equals the reference token: exactly when a
free greedy run reproduces the reference continuation), and KL(transformers || path) per position,
averaged over the first positions and over all. llama.cpp (``llama-server`` of
../shared/tools/build-llamacpp.sh, temperature 0, the same token ids) generates freely; its KL is
over its top-``N_PROBS`` log-probs with the rest of the vocabulary lumped into one outcome (a lower
bound of the true KL).

``speed``: prefill tok/s (one step of ``--prefill`` tokens) and decode tok/s (``--decode`` steps
of one token after that prefill) and batched decode tok/s (steps of ``--batch`` rows, one per
sequence: a server's decode), best of ``--rounds``, ``--threads`` threads; llama.cpp's
``llama-bench -p PREFILL -n DECODE -t THREADS`` on the same file. One JSON line per result.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import PEER, emit  # noqa: E402

MODES = ("int8", "auto", "f32")
N_PROBS = 50
TEMPLATES = ["What is {}?", "Explain {} in one sentence.", "Give me three facts about {}.",
             "Why is {} important?", "Write a short poem about {}.", "How does {} work?",
             "What are the benefits of {}?", "Describe {} to a child.", "What is the history of {}?",
             "Tell me a fun fact about {}."]
TOPICS = ["the capital of France", "photosynthesis", "the moon", "the Roman Empire", "black holes",
          "the human heart", "climate change", "the Python programming language", "honey bees", "volcanoes",
          "the internet", "chess", "vaccines", "the Great Wall of China", "electricity", "sleep",
          "the ocean", "Mount Everest", "democracy", "coffee"]


def prompts() -> list[str]:
    """The 200 user turns: every template with every topic."""
    return [t.format(topic) for t in TEMPLATES for topic in TOPICS]


def artifacts(gguf: Path, workdir: Path, modes: list[str]) -> dict[str, Path]:
    """The GGUF compiled once per activation path (cached by the compiler's artifact cache)."""
    from infeng_compiler.compile import CompileOptions, cached_artifact

    return {mode: cached_artifact(gguf, CompileOptions(target="native", act_precision=mode))[0] for mode in modes}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def teacher_forced(engine, ids: list[int], continuation: list[int]) -> np.ndarray:
    """Logits [len(continuation), V]: the prompt's last row after one prefill step, then one decode
    step per continuation token but the last."""
    n = len(ids)
    rows = [engine.step(np.array(ids), np.arange(n), np.zeros(n, np.int64), logits_rows=[n - 1])[0]]
    for j, token in enumerate(continuation[:-1]):
        rows.append(engine.step(np.array([token]), np.array([n + j]), np.zeros(1, np.int64))[0])
    engine.free(0)
    return np.stack(rows)


class LlamaServer:
    """llama-server on ``gguf`` (one slot, greedy), for greedy text and top log-probs."""

    def __init__(self, gguf: Path, threads: int, port: int = 18231):
        binary = PEER / "build" / "bin" / "llama-server"
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([str(binary), "-m", str(gguf), "-t", str(threads), "--port", str(port),
                                      "-c", "4096", "-np", "1", "--no-webui"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "LD_LIBRARY_PATH": str(binary.parent)})
        for _ in range(600):
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise SystemExit("llama-server did not start")

    def complete(self, ids: list[int], n: int) -> dict:
        body = json.dumps({"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "n_probs": N_PROBS,
                           "return_tokens": True, "cache_prompt": False}).encode()
        req = urllib.request.Request(self.url + "/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def lumped_kl(ref_logp: np.ndarray, top: dict[int, float]) -> float:
    """KL(ref || peer) over the peer's top tokens plus one outcome for the rest (a lower bound)."""
    ids = np.array(list(top), dtype=np.int64)
    q = np.exp(np.array(list(top.values()), dtype=np.float64))
    p = np.exp(ref_logp[ids])
    p_rest, q_rest = max(1.0 - p.sum(), 1e-300), max(1.0 - q.sum(), 1e-300)
    return float((p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))).sum()
                 + p_rest * (np.log(p_rest) - np.log(q_rest)))


def quality(args, gguf: Path) -> None:
    from infeng_runtime.chat import render_chat
    from infeng_runtime.engine import Engine

    modes = [] if args.peer_only else list(args.modes)
    paths = artifacts(gguf, args.workdir, modes or ["int8"])
    engines = {mode: Engine(path, threads=args.threads, max_seqs=1) for mode, path in paths.items() if mode in modes}
    tokenizer = Engine(paths[next(iter(paths))], threads=1, max_seqs=1).tokenizer
    eos = list(tokenizer.eos_token_ids)
    items = prompts()[:args.prompts]
    prompt_ids = [tokenizer.encode(render_chat(tokenizer, [{"role": "user", "content": p}]), add_bos=False)
                  for p in items]
    cache = args.workdir / f"act_precision_reference_{len(items)}x{args.tokens}.npz"
    if args.peer_only:                       # transformers' tokens and first-token log-probs of an earlier run
        saved = np.load(cache, allow_pickle=True)
        references = [(list(t), lp[None]) for t, lp in zip(saved["tokens"], saved["first_logp"])]
    else:
        references = None
    peer = LlamaServer(gguf, args.threads) if (PEER / "build" / "bin" / "llama-server").is_file() else None
    names = modes + (["llama.cpp"] if peer else [])
    stats = {name: {"first": 0, "continuation": 0, "kl_first": [], "kl_all": []} for name in names}
    reference = references.__getitem__ if references else transformers_reference(args, gguf, eos)
    kept_tokens, kept_first = [], []
    try:
        for i, ids in enumerate(prompt_ids):
            ref, ref_logp = reference(i) if references else reference(ids)
            kept_tokens.append(np.array(ref, np.int32))
            kept_first.append(ref_logp[0].astype(np.float32))
            for mode, engine in engines.items():
                logits = teacher_forced(engine, ids, ref)
                kl = (np.exp(ref_logp) * (ref_logp - log_softmax(logits))).sum(axis=-1)
                agree = logits.argmax(axis=-1) == np.array(ref)
                s = stats[mode]
                s["first"] += bool(agree[0])
                s["continuation"] += bool(agree.all())
                s["kl_first"].append(float(kl[0]))
                s["kl_all"].extend(kl.tolist())
            if peer:
                got = peer.complete(ids, args.tokens)
                tokens = list(got["tokens"])
                if got.get("stop_type") == "eos" and len(tokens) < args.tokens:
                    tokens.append(ref[-1] if ref and ref[-1] in eos else eos[0])
                s = stats["llama.cpp"]
                s["first"] += bool(tokens[:1] == ref[:1])
                s["continuation"] += bool(tokens == ref)
                probs = got.get("completion_probabilities") or []
                if probs:
                    top = {int(p["id"]): float(p["logprob"]) for p in probs[0]["top_logprobs"]}
                    s["kl_first"].append(lumped_kl(ref_logp[0], top))
            if i % 10 == 9:
                print(f"{i + 1}/{len(items)} prompts", file=sys.stderr, flush=True)
    finally:
        if peer:
            peer.close()
    if not references:
        args.workdir.mkdir(parents=True, exist_ok=True)
        np.savez(cache, tokens=np.array(kept_tokens, dtype=object), first_logp=np.stack(kept_first))
    for name in names:
        s = stats[name]
        emit(bench="act-precision", kind="quality", path=name, prompts=len(items), tokens=args.tokens,
             first_token_agreement=s["first"] / len(items), continuation_agreement=s["continuation"] / len(items),
             kld_first=float(np.mean(s["kl_first"])) if s["kl_first"] else None,
             kld_all=float(np.mean(s["kl_all"])) if s["kl_all"] else None,
             kld_note="lower bound: top-%d log-probs + the rest lumped" % N_PROBS if name == "llama.cpp" else "exact",
             gguf=gguf.name)


def transformers_reference(args, gguf: Path, eos: list[int]):
    """ids -> (greedy continuation of up to args.tokens tokens, its log-probs [len, V]) from
    transformers' f32 model on the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(1)           # the reference: one thread (no OpenMP spinning on a shared machine)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=args.tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                              output_logits=True, return_dict_in_generate=True)

    def run(ids: list[int]) -> tuple[list[int], np.ndarray]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), generation_config=config)
        return out.sequences[0, len(ids):].tolist(), log_softmax(torch.cat(out.logits).float().numpy())

    return run


def speed(args, gguf: Path) -> None:
    """Every path's engine loaded at once and the paths interleaved within each round, best round kept."""
    from infeng_runtime.engine import Engine

    paths = artifacts(gguf, args.workdir, args.modes)
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, 40000, args.prefill)
    engines = {mode: Engine(path, threads=args.threads, max_seqs=args.batch) for mode, path in paths.items()}
    times: dict[str, dict[str, list[float]]] = {mode: {"prefill": [], "decode": [], "batch": []} for mode in engines}
    for _ in range(args.rounds):
        for mode, engine in engines.items():
            t = times[mode]
            seqs = np.arange(args.batch)
            t0 = time.perf_counter()
            for j in range(args.decode // 2):              # batch decoding sequences: steps of `batch` rows
                engine.step(tokens[seqs + j], np.full(args.batch, j), seqs)
            t["batch"].append(args.batch * (args.decode // 2) / (time.perf_counter() - t0))
            for seq in seqs:
                engine.free(int(seq))
            t0 = time.perf_counter()
            engine.step(tokens, np.arange(args.prefill), np.zeros(args.prefill, np.int64), logits_rows=[args.prefill - 1])
            t["prefill"].append(args.prefill / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for j in range(args.decode):
                engine.step(np.array([tokens[j]]), np.array([args.prefill + j]), np.zeros(1, np.int64))
            t["decode"].append(args.decode / (time.perf_counter() - t0))
            engine.free(0)
    for mode, engine in engines.items():
        t = times[mode]
        emit(bench="act-precision", kind="speed", path=mode, threads=args.threads, prefill_tokens=args.prefill,
             decode_tokens=args.decode, prefill_tok_s=round(max(t["prefill"]), 1), decode_tok_s=round(max(t["decode"]), 1),
             batch=args.batch, batch_decode_tok_s=round(max(t["batch"]), 1), target=engine.manifest["target"])
        engine.close()
    binary = PEER / "build" / "bin" / "llama-bench"
    if binary.is_file():
        done = subprocess.run([str(binary), "-m", str(gguf), "-t", str(args.threads), "-p", str(args.prefill),
                               "-n", str(args.decode), "-r", str(args.rounds), "-o", "json"], capture_output=True,
                              text=True, env={**os.environ, "LD_LIBRARY_PATH": str(binary.parent)})
        rows = json.loads(done.stdout)
        by = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
        emit(bench="act-precision", kind="speed", path="llama.cpp", threads=args.threads, prefill_tokens=args.prefill,
             decode_tokens=args.decode, prefill_tok_s=round(by["prefill"], 1), decode_tok_s=round(by["decode"], 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("quality", "speed"))
    ap.add_argument("--gguf", type=Path, help="a GGUF file (default: SmolLM2-135M-Instruct from the registry)")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=32, help="greedy continuation length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=128)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16, help="sequences of the batched decode timing (rows per step)")
    ap.add_argument("--peer-only", action="store_true",
                    help="quality of llama.cpp alone, against the transformers reference an earlier run saved")
    ap.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "infeng" / "bench")
    args = ap.parse_args()
    if args.gguf is None:
        from infeng_models.registry import SMOLLM2_135M_INSTRUCT, fetch

        args.gguf = fetch(SMOLLM2_135M_INSTRUCT)
    (quality if args.what == "quality" else speed)(args, args.gguf)


if __name__ == "__main__":
    main()
