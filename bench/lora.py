"""Multi-LoRA decode throughput: infeng with adapters mixed in every step vs without adapters, and
vs llama-server (which cannot batch requests whose adapters differ), same weights, same run.

    python bench/lora.py --streams 8 16 --adapters 2 4 --threads 2
    python bench/lora.py --streams 16 --adapters 4 --threads 1 --target avx2 --rounds 5 --no-peer

Base: the smollm135 preset (random init, SmolLM-135M shape). Adapters: the two real
medflashcards adapters (q,v; r=16) plus random r=16 adapters on q,k,v,o,gate,up,down. One JSON
line per result; `ratio` lines give mixed/no-adapter and infeng/llama-server. With ``--rounds N`` the
infeng runs with and without adapters alternate N times on the same engine and each keeps its median
(``tok_s_all`` lists the rounds).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

PEER = Path(os.environ.get("PEER_DIR", Path.home() / ".cache" / "infeng-peers")) / "llama.cpp"
ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets" / "adapters"
REAL = ["smollm-135m-instruct-medflashcards-5epochs", "smollm-135m-instruct-medflashcards-100epochs"]
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def emit(**fields) -> None:
    print(json.dumps(fields), flush=True)


def random_adapter(out: Path, config: dict, seed: int, rank: int = 16) -> Path:
    """A PEFT-format LoRA adapter with random A and B on every linear layer of the model."""
    rng = np.random.default_rng(seed)
    hidden, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (hidden, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, hidden),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    tensors = {}
    for layer in range(layers):
        for name, (n_out, n_in) in shapes.items():
            part = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) / np.sqrt(n_in)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.01).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ALL_LINEAR,
        "base_model_name_or_path": "HuggingFaceTB/SmolLM-135M-Instruct", "bias": "none", "fan_in_fan_out": False,
        "task_type": "CAUSAL_LM"}))
    return out


def adapters_for(n: int, work: Path, config: dict) -> dict[str, Path]:
    chosen = {f"real{i}": ASSETS / REAL[i] for i in range(min(n, 2))}
    for i in range(2, n):
        chosen[f"rand{i}"] = random_adapter(work / f"rand{i}", config, seed=i)
    return chosen


def infeng_decode(engine, streams: int, slots: list[int], gen: int, prompt: int = 32) -> float:
    """Aggregate decode tok/s of ``streams`` sequences, sequence i on ``slots[i % len(slots)]``."""
    rng = np.random.default_rng(0)
    per_seq = np.array([slots[i % len(slots)] for i in range(streams)], dtype=np.int32)
    use = bool((per_seq >= 0).any())
    ids = rng.integers(0, engine.vocab_size, size=(streams, prompt)).astype(np.int32)
    kw = {"adapter_slots": np.repeat(per_seq, prompt)} if use else {}
    logits = engine.step(ids.reshape(-1), np.tile(np.arange(prompt), streams), np.repeat(np.arange(streams), prompt),
                         np.arange(streams) * prompt + prompt - 1, **kw)
    tokens = logits.argmax(axis=1).astype(np.int32)
    kw = {"adapter_slots": per_seq} if use else {}
    t0 = time.perf_counter()
    for i in range(gen):
        tokens = engine.step(tokens, np.full(streams, prompt + i), np.arange(streams), **kw).argmax(axis=1).astype(np.int32)
    seconds = time.perf_counter() - t0
    for s in range(streams):
        engine.free(s)
    return streams * gen / seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_server_decode(gguf: Path, loras: list[Path], streams: int, gen: int, threads: int,
                        mixed: bool) -> float:
    import httpx

    port = free_port()
    cmd = [str(PEER / "build" / "bin" / "llama-server"), "-m", str(gguf), "-np", str(streams), "-t", str(threads),
           "--port", str(port), "--host", "127.0.0.1", "-c", str(streams * 256), "--lora-init-without-apply"]
    for lora in loras:
        cmd += ["--lora", str(lora)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

        def one(i: int) -> int:
            body = {"prompt": f"Question {i}: what is", "n_predict": gen, "temperature": 0, "ignore_eos": True,
                    "cache_prompt": False}
            if mixed:
                body["lora"] = [{"id": j, "scale": 1.0 if j == i % len(loras) else 0.0} for j in range(len(loras))]
            r = httpx.post(f"{url}/completion", json=body, timeout=600).json()
            return int(r.get("tokens_predicted", gen))

        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            total = sum(pool.map(one, range(streams)))
        return total / (time.perf_counter() - t0)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--adapters", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--target", default="native")
    ap.add_argument("--rounds", type=int, default=1, help="alternating infeng rounds without / with adapters")
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "infeng" / "bench"))
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)

    from infeng_compiler.compile import CompileOptions, compile_model
    from infeng_models.synthetic import build_preset
    from infeng_runtime.engine import Engine

    model = work / "smollm135"
    if not (model / "config.json").is_file():
        build_preset("smollm135", model)
    config = json.loads((model / "config.json").read_text())
    adapters = adapters_for(max(args.adapters), work, config)
    artifact = work / f"smollm135-{args.dtype}-{args.target}-lora.infeng"
    compile_model(model, artifact, CompileOptions(target=args.target, dtype=args.dtype,
                                                  max_adapters=max(args.adapters), max_rank=16))
    engine = Engine(artifact, threads=args.threads, max_seqs=max(args.streams), max_context=512)
    for name, path in adapters.items():
        t0 = time.perf_counter()
        engine.load_adapter(name, path)
        emit(bench="adapter_load", adapter=name, ms=round((time.perf_counter() - t0) * 1e3, 1))

    gguf = loras = None
    if not args.no_peer:
        gguf = work / f"smollm135-{args.dtype}.gguf"
        if not gguf.is_file():
            subprocess.run([sys.executable, str(PEER / "convert_hf_to_gguf.py"), str(model), "--outtype", args.dtype,
                            "--outfile", str(gguf)], check=True, capture_output=True)
        loras = []
        for name, path in adapters.items():
            out = work / f"lora-{name}.gguf"
            if not out.is_file():
                subprocess.run([sys.executable, str(PEER / "convert_lora_to_gguf.py"), str(path), "--base", str(model),
                                "--outtype", "f16", "--outfile", str(out)], check=True, capture_output=True)
            loras.append(out)

    for streams in args.streams:
        bases = [infeng_decode(engine, streams, [-1], args.gen_len)]
        base = bases[0]
        emit(bench="lora_decode", engine="infeng", streams=streams, adapters=0, tok_s=round(base, 1))
        peer_base = None
        if gguf:
            peer_base = llama_server_decode(gguf, loras[:2], streams, args.gen_len, args.threads, mixed=False)
            emit(bench="lora_decode", engine="llama-server", streams=streams, adapters=0, tok_s=round(peer_base, 1))
        for n in args.adapters:
            slots = [engine.adapter_slot(name) for name in list(adapters)[:n]]
            mixes = [infeng_decode(engine, streams, slots, args.gen_len)]
            for _ in range(args.rounds - 1):            # alternate: drift hits both alike
                bases.append(infeng_decode(engine, streams, [-1], args.gen_len))
                mixes.append(infeng_decode(engine, streams, slots, args.gen_len))
            base, mixed = float(np.median(bases)), float(np.median(mixes))
            emit(bench="lora_decode", engine="infeng", streams=streams, adapters=n, tok_s=round(mixed, 1),
                 tok_s_all=[round(x, 1) for x in mixes])
            row = {"bench": "ratio", "streams": streams, "adapters": n, "mixed_vs_base": round(mixed / base, 3),
                   "base_tok_s": round(base, 1), "base_tok_s_all": [round(x, 1) for x in bases]}
            if gguf:
                peer = llama_server_decode(gguf, loras[:n], streams, args.gen_len, args.threads, mixed=True)
                emit(bench="lora_decode", engine="llama-server", streams=streams, adapters=n, tok_s=round(peer, 1))
                row["vs_llama_server_mixed"] = round(mixed / peer, 3)
            emit(**row)


if __name__ == "__main__":
    main()
