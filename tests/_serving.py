"""Helpers shared by the serving tests: one compiled stories260K artifact with LoRA slots and a chat
template (built once per process), PEFT adapters for it, a real ``infeng serve`` subprocess on a
free loopback port, and greedy references computed alone, the way ``infeng run`` computes them."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
STORIES = REPO.parent / "shared" / "assets" / "models" / "stories260K"

#: A Llama-2-style template: BOS written by the template, system prompt folded into the first turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYS] {{ message['content'] | trim }} [/SYS]\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] | trim }}\n"
    "{% else %}Assistant: {{ message['content'] | trim }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")

ADAPTER_NAMES = ("a1", "a2", "a3")
_built: dict[str, Path] = {}


def served_artifact(root: Path) -> Path:
    """stories260K compiled (scalar kernels: exact whatever the batch) with 4 LoRA slots of rank
    <= 8, and a chat template added to its tokenizer_config.json. Built once per process."""
    if "artifact" not in _built:
        from infeng_compiler.compile import CompileOptions, compile_model

        out = root / "stories-serve.infeng"
        compile_model(STORIES, out, CompileOptions(target="scalar", max_adapters=4, max_rank=8))
        cfg_path = out / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(cfg, indent=2))
        _built["artifact"] = out
    return _built["artifact"]


def write_adapter(out: Path, seed: int, rank: int = 4, std: float = 0.12) -> Path:
    """A PEFT LoRA adapter for stories260K (q_proj and v_proj of every layer), as PEFT saves it."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(5):
        for module, d_out in (("q_proj", 64), ("v_proj", 32)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, std, (rank, 64)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, std, (d_out, rank)).astype(np.float32)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(STORIES)}))
    return out


def adapters(root: Path) -> dict[str, Path]:
    if "adapters" not in _built:
        _built["adapters"] = root
        for i, name in enumerate(ADAPTER_NAMES):
            write_adapter(root / name, seed=100 + i)
    return {name: _built["adapters"] / name for name in ADAPTER_NAMES}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def infeng_command() -> list[str]:
    exe = shutil.which("infeng")
    return [exe] if exe else [sys.executable, "-m", "infeng_cli"]


@contextmanager
def server_process(artifact: Path, *args: str, log: Path, startup_s: float = 90.0,
                   command: list[str] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """``infeng serve ARTIFACT --port <free> ARGS`` (or ``COMMAND serve ...``); yields the process
    and the base URL once /health answers, and terminates the process (if still running) after."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([*(command or infeng_command()), "serve", str(artifact), "--host", "127.0.0.1",
                                 "--port", str(port), "--threads", "1", "--log-level", "warning", *args],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"infeng serve exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"infeng serve did not come up in {startup_s} s:\n{log.read_text()}")
            time.sleep(0.05)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextmanager
def running_server(artifact: Path, *args: str, log: Path, startup_s: float = 90.0) -> Iterator[str]:
    """``infeng serve ARTIFACT --port <free> ARGS``; yields the base URL once /health answers."""
    with server_process(artifact, *args, log=log, startup_s=startup_s) as (_, url):
        yield url


def nonfinite_artifact(root: Path) -> Path:
    """stories260K compiled like ``served_artifact`` (without LoRA slots), then its final norm weight
    overwritten with NaN inside weights.bin (``infeng compile`` refuses NaN weights, so the damage
    comes after it): every logit it computes is NaN. Built once per process."""
    if "nonfinite" not in _built:
        from infeng_compiler.compile import CompileOptions, compile_model

        out = root / "stories-nan.infeng"
        compile_model(STORIES, out, CompileOptions(target="scalar"))
        norm = next(t for t in json.loads((out / "manifest.json").read_text())["tensors"]
                    if t["name"] == "model.norm.weight")
        assert norm["format"] == "f32"
        with open(out / "weights.bin", "r+b") as f:
            f.seek(norm["offset"])
            f.write(np.full(norm["shape"], np.nan, dtype=np.float32).tobytes())
        cfg_path = out / "tokenizer_config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "chat_template": CHAT_TEMPLATE}, indent=2))
        _built["nonfinite"] = out
    return _built["nonfinite"]


def sse_lines(response: httpx.Response) -> list[str]:
    """The non-empty lines of a server-sent event stream, as they arrive."""
    return [line for line in response.iter_lines() if line]


class AloneReference:
    """Greedy continuations computed one request at a time on a fresh engine of one sequence, through
    the offline ``LLM`` API with the adapter loaded: exactly what ``infeng run --adapter/--use`` does."""

    def __init__(self, artifact: Path, adapter_dirs: dict[str, Path] | None = None):
        from infeng_runtime.llm import LLM

        self.llm = LLM(artifact, threads=1, max_seqs=1, adapters=adapter_dirs)
        self.engine = self.llm.engine
        self.cache: dict[tuple, str] = {}

    def __call__(self, prompt: str | list[int], max_tokens: int, adapter: str | None = None) -> str:
        from infeng_runtime.sampling import SamplingParams

        key = (prompt if isinstance(prompt, str) else tuple(prompt), max_tokens, adapter)
        if key not in self.cache:
            self.cache[key] = self.llm.generate([prompt], SamplingParams(max_new_tokens=max_tokens),
                                                adapter=adapter)[0].text
        return self.cache[key]


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample ``name`` in Prometheus text."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)
