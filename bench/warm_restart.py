"""Warm restarts: time to first token of a request whose ~1,000-token system prompt the server saw
before its restart (``--prefix-cache-dir``), against the same request on a cold start, in one run.

    python bench/warm_restart.py ARTIFACT [--system-tokens 1000] [--threads 2] [--rounds 3]

Each round: start ``infeng serve ARTIFACT --prefix-cache-dir DIR --warmup`` on an empty DIR (cold),
stream one chat request (the shared system prompt, question A), stop the server with SIGTERM (it
saves the cache), start it again on the same DIR (warm), stream the same system prompt with
question B. The system prompt is WikiText-2 text cut to ``--system-tokens`` tokens. One JSON line
per start:

- ``ttft_ms``: client-side time from sending the request to the first content chunk;
- ``cached_tokens``: prompt tokens the server took from its prefix cache (usage);
- ``startup_s``: process start to /health answering (the warm start loads the cache first).

A final line gives the medians over the rounds and ``ttft_ratio`` (cold / warm).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
WIKITEXT = REPO.parent / "shared" / "assets" / "text" / "wikitext-2-raw-v1-test.txt"


def system_prompt(artifact: Path, tokens: int) -> str:
    """WikiText-2 text cut to ``tokens`` tokens of the artifact's tokenizer."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    text = " ".join(WIKITEXT.read_text(encoding="utf-8").split())[: tokens * 8]
    ids = tokenizer.encode(text, add_special_tokens=False).ids[:tokens]
    return tokenizer.decode(ids)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(artifact: Path, cache_dir: Path, threads: int, log: Path) -> tuple[subprocess.Popen, str, float]:
    port = free_port()
    began = time.perf_counter()
    with open(log, "ab") as out:
        proc = subprocess.Popen([shutil.which("infeng") or "infeng", "serve", str(artifact), "--port", str(port),
                                 "--threads", str(threads), "--max-seqs", "4", "--max-context", "2048",
                                 "--served-model-name", "m", "--prefix-cache-dir", str(cache_dir), "--warmup",
                                 "--log-level", "info"], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"infeng serve exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, time.perf_counter() - began
        except httpx.HTTPError:
            time.sleep(0.05)


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)


def ttft(url: str, system: str, question: str) -> tuple[float, int]:
    body = {"model": "m", "stream": True, "max_tokens": 8, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    sent = time.perf_counter()
    first, cached = None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - sent
            if chunk.get("usage"):
                cached = chunk["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return (first or time.perf_counter() - sent) * 1000, cached


def emit(result: dict) -> None:
    print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    system = system_prompt(args.artifact, args.system_tokens)
    runs: dict[str, list[float]] = {"cold": [], "warm": []}
    work = Path(tempfile.mkdtemp(prefix="warm-restart-"))
    for round_ in range(args.rounds):
        cache = work / f"cache-{round_}"
        for kind, question in (("cold", "Summarise the text in one sentence."),
                               ("warm", "What is the text about? One sentence.")):
            proc, url, startup = start(args.artifact, cache, args.threads, work / "serve.log")
            try:
                ms, cached = ttft(url, system, question)
            finally:
                stop(proc)
            runs[kind].append(ms)
            emit({"bench": "warm_restart", "start": kind, "round": round_, "ttft_ms": round(ms, 1),
                  "cached_tokens": cached, "startup_s": round(startup, 2), "system_tokens": args.system_tokens,
                  "threads": args.threads, "artifact": args.artifact.name})
    cold, warm = sorted(runs["cold"])[len(runs["cold"]) // 2], sorted(runs["warm"])[len(runs["warm"]) // 2]
    emit({"bench": "warm_restart_summary", "ttft_ms_cold_p50": round(cold, 1), "ttft_ms_warm_p50": round(warm, 1),
          "ttft_ratio": round(cold / warm, 2), "rounds": args.rounds, "log": str(work / "serve.log")})


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
