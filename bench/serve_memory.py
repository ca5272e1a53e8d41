"""Memory of ``infeng serve``: the server process's RSS once /health answers and after one chat
request, and the KV cache line it logs at start.

    python bench/serve_memory.py                       # the real SmolLM2-135M-Instruct GGUF, every default
    python bench/serve_memory.py MODEL -- --max-seqs 4 --max-context 2048

MODEL is an artifact or anything ``infeng serve`` compiles (default: the SmolLM2-135M-Instruct
Q4_1 GGUF of ``infeng_models.registry``); arguments after ``--`` go to ``infeng serve``. The
``infeng`` on PATH runs it, so PYTHONPATH picks the tree measured. One JSON line:
``rss_start_mb`` and ``rss_after_request_mb`` (VmRSS, 10^6 bytes), ``startup_s`` (to /health,
compiling included when the artifact is not cached), ``kv_line`` and the answer's first words.
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no VmRSS for process {pid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="artifact or model (default: the SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: arguments of infeng serve")
    parser.add_argument("--startup-s", type=float, default=900.0)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from infeng_models import registry

        model = str(registry.fetch(registry.SMOLLM2_135M_INSTRUCT))
    extra = [a for a in args.serve_args if a != "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("infeng")
    command = [*([exe] if exe else [sys.executable, "-m", "infeng_cli"]), "serve", model,
               "--port", str(port), "--log-level", "info", *extra]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "serve.log"
        with open(log, "wb") as out:
            started = time.monotonic()
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"infeng serve exited with {proc.returncode}:\n{log.read_text()}")
                try:
                    if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - started > args.startup_s:
                    raise SystemExit(f"infeng serve did not come up in {args.startup_s} s")
                time.sleep(0.1)
            startup_s = time.monotonic() - started
            at_start = rss_mb(proc.pid)
            served = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            answer = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
                "model": served, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}).json()
            after = rss_mb(proc.pid)
        finally:
            proc.terminate()
            proc.wait(30)
        kv_line = next((line.split(" infeng.engine ", 1)[-1] for line in log.read_text().splitlines()
                        if "KV cache:" in line), None)
    print(json.dumps({"model": Path(model).name, "serve_args": extra, "startup_s": round(startup_s, 1),
                      "rss_start_mb": round(at_start, 1), "rss_after_request_mb": round(after, 1),
                      "kv_line": kv_line, "answer": answer["choices"][0]["message"]["content"][:60]}))


if __name__ == "__main__":
    main()
