"""Serving throughput: aggregate tok/s of N concurrent streaming clients against ``infeng serve``,
and the scheduler's Python overhead per step; optionally the same clients against llama-server.

    python bench/serve.py --preset smollm135 --dtype f16 --streams 1,4,16 --threads 2
    python bench/serve.py --artifact stories.infeng --streams 1,4,16 --no-peer

Each client streams one /v1/completions request: a distinct random prompt of ``--prompt-len``
token ids, ``--max-tokens`` new tokens, greedy, ``ignore_eos`` (random weights would stop at
random places). Everything is on loopback. One JSON line per result:

- ``tok_s``: generated tokens of all clients / wall time from the first request to the last token;
- ``ttft_ms_p50``, ``itl_ms_p50``: client-side time to first token and between tokens;
- ``step_overhead_us``: Python time per engine step outside the forward call (schedule, arrays,
  sampling, handing outputs to the event loop), from the server's /metrics counters;
  ``forward_ms``: the forward call per step.

With the peer (llama.cpp's ``llama-server -np N``, same GGUF weights class, same thread count, same
clients), ``ratio`` is infeng / llama-server in the same run.

With ``--ray``, the same clients also stream through ``infeng serve-ray`` (``--ray-replicas`` replicas x
``--ray-threads`` threads on a local Ray cluster, default 2 x 1) in the same alternating rounds:
``ray_tok_s`` and ``ray_ratio`` (Ray Serve / one ``infeng serve`` with ``--threads``), e.g.

    python bench/serve.py --artifact stories.infeng --streams 16 --threads 2 --ray --no-peer

With ``--split N``, the same clients also stream to N plain ``infeng serve`` processes of
``--threads / N`` threads each, pinned to their share of the cores, prompt i to process i mod N:
``split_tok_s`` and ``split_ratio`` (over one ``infeng serve`` with ``--threads``), what replicas give
on this machine with no Ray process in the way, e.g.

    python bench/serve.py --artifact stories.infeng --streams 16 --threads 2 --ray --split 2 --no-peer

With ``--baseline-tree DIR`` (a checkout of an older commit, e.g. ``git worktree add /tmp/old
COMMIT``), the same artifact is also served by that tree's runtime, in the same alternating rounds:
``median_step_overhead_us``, ``baseline_median_step_overhead_us`` and ``overhead_ratio`` (this tree
/ the old one, medians over the rounds) compare the Python time per step of the two runtimes on the
same machine and clients; ``baseline_tok_s``, ``baseline_ttft_ms_p50`` and the per-round lists
(``tok_s_all``, ``ttft_ms_all`` and their ``baseline_`` twins) their throughput and first tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import PEER, QUANT_TYPES, emit, ensure_artifact, ensure_gguf, ensure_model  # noqa: E402

from infeng_common.manifest import weight_storage  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit(f"server at {url} did not come up in {timeout} s")


def start_infeng(artifact: Path, args, log: Path, env: dict[str, str] | None = None,
                 cwd: Path | None = None, cmd_prefix: list[str] = ()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [*cmd_prefix, sys.executable, "-m", "infeng_cli", "serve", str(artifact), "--port", str(port),
           "--threads", str(args.threads), "--max-seqs", str(max(args.streams)), "--log-level", "warning",
           "--max-context", str(args.prompt_len + args.max_tokens + 16)]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env, cwd=cwd)
    return proc, f"http://127.0.0.1:{port}"


def link_packages(tree: Path, workdir: Path) -> Path:
    """A folder with ``tree``'s packages linked under their import names, as its pyproject.toml
    maps them: put first on PYTHONPATH, it shadows this checkout's editable install."""
    links = workdir / "baseline-packages"
    links.mkdir(parents=True, exist_ok=True)
    package_dir = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name, folder in package_dir.items():
        link = links / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(tree / folder)
    return links


def start_baseline(artifact: Path, args, log: Path) -> tuple[subprocess.Popen, str]:
    """``infeng serve`` from the checkout ``--baseline-tree``."""
    links = link_packages(Path(args.baseline_tree).resolve(), Path(args.workdir))
    # run from the links folder: ``python -m`` puts the working directory first on sys.path
    return start_infeng(artifact.resolve(), args, log, env={**os.environ, "PYTHONPATH": str(links)}, cwd=links)


def start_ray(artifact: Path, args, log: Path) -> tuple[subprocess.Popen, str]:
    """``infeng serve-ray``: its own local Ray cluster, ``--ray-replicas`` x ``--ray-threads``."""
    port = free_port()
    cmd = [sys.executable, "-m", "infeng_cli", "serve-ray", str(artifact), "--port", str(port),
           "--replicas", str(args.ray_replicas), "--threads-per-replica", str(args.ray_threads),
           "--max-seqs", str(max(args.streams)), "--max-context", str(args.prompt_len + args.max_tokens + 16)]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "RAY_ADDRESS": ""})
    return proc, f"http://127.0.0.1:{port}"


def start_split(artifact: Path, args, log: Path) -> tuple[list[subprocess.Popen], list[str]]:
    """``--split N``: N plain ``infeng serve`` processes of ``--threads / N`` threads, each confined
    to its own share of this process's CPUs: replicas without Ray, the most any replica scheme on
    this machine could reach (each process reads all the weights every step for its share of the
    streams)."""
    cpus = sorted(os.sched_getaffinity(0))
    n = args.split
    share = max(1, args.threads // n)
    procs, urls = [], []
    for i in range(n):
        mine = cpus[i * len(cpus) // n:(i + 1) * len(cpus) // n] or [cpus[i % len(cpus)]]
        one = argparse.Namespace(**{**vars(args), "threads": share})
        proc, url = start_infeng(artifact, one, log.with_name(f"{log.stem}-{i}.log"),
                                 cmd_prefix=["taskset", "-c", ",".join(map(str, mine))])
        procs.append(proc)
        urls.append(url)
    return procs, urls


def start_llama_server(gguf: Path, args, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    binary = PEER / "build" / "bin" / "llama-server"
    n = max(args.streams)
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(n),
           "-c", str(n * (args.prompt_len + args.max_tokens + 16)), "-t", str(args.threads), "-tb", str(args.threads),
           "--no-webui"]
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}"


def scrape(url: str) -> dict[str, float]:
    """The unlabelled samples of infeng's /metrics."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()[:2]
            values[name] = float(value)
    return values


async def one_stream(client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int
                     ) -> tuple[float, list[float], int]:
    """(request start, arrival time of each chunk with text, tokens generated)."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {(await r.aread())[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if payload.get("usage"):
                tokens = payload["usage"]["completion_tokens"]
            if payload.get("choices") and payload["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    return t0, arrivals, tokens or len(arrivals)


async def run_level(url: str | list[str], model: str, prompts: list[list[int]], max_tokens: int
                    ) -> dict[str, float]:
    """All ``prompts`` streamed at once; with several ``url``s (``--split``) prompt i goes to
    ``url[i % len(url)]``."""
    urls = [url] if isinstance(url, str) else url
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    clients = [httpx.AsyncClient(base_url=u, timeout=600, limits=limits) for u in urls]
    try:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(clients[i % len(clients)], model, p, max_tokens)
                                         for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
    finally:
        for client in clients:
            await client.aclose()
    total = sum(r[2] for r in results)
    ttft = [r[1][0] - r[0] for r in results if r[1]]
    itl = [b - a for r in results for a, b in zip(r[1], r[1][1:])]
    return {"tok_s": total / wall, "tokens": total, "wall_s": wall,
            "ttft_ms_p50": 1e3 * float(np.median(ttft)) if ttft else None,
            "itl_ms_p50": 1e3 * float(np.median(itl)) if itl else None}


def model_id(url: str | list[str]) -> str:
    url = url if isinstance(url, str) else url[0]
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def run_server_level(kind: str, url: str | list[str], prompts: list[list[int]], max_tokens: int) -> dict:
    ours = kind in ("infeng", "baseline")
    before = scrape(url) if ours else {}
    result = asyncio.run(run_level(url, model_id(url), prompts, max_tokens))
    if ours:
        after = scrape(url)
        steps = after["infeng_steps_total"] - before["infeng_steps_total"]
        step_s = after["infeng_step_seconds_total"] - before["infeng_step_seconds_total"]
        fwd_s = after["infeng_step_forward_seconds_total"] - before["infeng_step_forward_seconds_total"]
        result.update(steps=int(steps), step_overhead_us=1e6 * (step_s - fwd_s) / max(steps, 1),
                      forward_ms=1e3 * fwd_s / max(steps, 1))
    return result


class _StubEngine:
    """An Engine without a library: forward returns ready-made logits, so a loop over it measures
    the scheduler's own Python time (planning, arrays, sampling, handing outputs over)."""

    def __init__(self, artifact: Path, max_seqs: int, max_context: int):
        from infeng_runtime.adapters import AdapterManager
        from infeng_runtime.kv_cache import BlockAllocator
        from infeng_common.tokenizer import Tokenizer

        self.path = artifact
        self.manifest = json.loads((artifact / "manifest.json").read_text())
        c = self.manifest["constants"]
        self.vocab_size, self.max_tokens, self.max_context = c["vocab_size"], c["max_tokens"], max_context
        self.kv = BlockAllocator(max_seqs * -(-max_context // c["block_size"]), c["block_size"], max_seqs, max_context)
        self.tokenizer = Tokenizer(artifact)
        self.adapters = AdapterManager([], 0, 0, self.manifest["name"], write=lambda *site: None)
        self._logits = np.zeros((max_seqs, self.vocab_size), dtype=np.float32)
        self._logits[:, 5] = 1.0

    def forward(self, tokens, positions, slots, rows, adapter_slots=None):
        return self._logits[:len(rows)]


def scheduler_overhead(artifact: Path, args) -> None:
    """Python time per step of EngineLoop.run_once over a stub engine, by concurrency; with
    ``--baseline-tree`` the old tree's own script measures its runtime the same way, round after
    round in turn with this one."""
    for n in args.streams:
        ours, base = [], []
        for _ in range(args.rounds):
            ours.append(loop_step_us(artifact, n, args))
            if args.baseline_tree:
                base.append(baseline_loop_step_us(artifact, n, args))
        row = dict(bench="scheduler-overhead", streams=n, prompt_len=args.prompt_len,
                   us_per_decode_step=round(min(ours), 1))
        if base:
            row.update(baseline_us_per_decode_step=round(min(base), 1), ratio=round(min(ours) / min(base), 3),
                       us_all=[round(x, 1) for x in ours], baseline_us_all=[round(x, 1) for x in base])
        emit(**row)


def loop_step_us(artifact: Path, n: int, args) -> float:
    """Median Python time of a decode step of ``n`` streams, in microseconds."""
    from infeng_runtime.loop import EngineLoop
    from infeng_runtime.sampling import SamplingParams
    from infeng_runtime.scheduler import Request

    rng = np.random.default_rng(0)
    engine = _StubEngine(artifact, n, args.prompt_len + args.max_tokens + 16)
    loop = EngineLoop(engine)
    sink = lambda outs: None                       # noqa: E731  (the server's sink only hands over)
    for i in range(n):
        prompt = rng.integers(3, engine.vocab_size, size=args.prompt_len).tolist()
        loop.submit(Request(f"r{i}", prompt, SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True),
                            sink=sink))
    times = []
    while loop.has_work():
        t0 = time.perf_counter()
        loop.run_once()
        times.append(time.perf_counter() - t0)
    return 1e6 * float(np.median(times[-args.max_tokens // 2:]))        # decode steps


def baseline_loop_step_us(artifact: Path, n: int, args) -> float:
    """``loop_step_us`` of the ``--baseline-tree`` checkout, by its own bench script."""
    tree = Path(args.baseline_tree).resolve()
    links = link_packages(tree, Path(args.workdir))
    out = subprocess.run([sys.executable, str(tree / "bench" / "serve.py"), "--scheduler-only", "--artifact",
                          str(artifact.resolve()), "--streams", str(n), "--rounds", "1", "--prompt-len",
                          str(args.prompt_len), "--max-tokens", str(args.max_tokens)], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": str(links)}, cwd=links)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["us_per_decode_step"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifact", help="serve this artifact (no peer) instead of building a preset")
    ap.add_argument("--preset", default="smollm135")
    ap.add_argument("--model", help="a Hugging Face model dir instead of a preset")
    ap.add_argument("--dtype", default="f16", choices=["f32", "f16", "bf16"])
    ap.add_argument("--quant", choices=sorted(QUANT_TYPES), help="quantized weights instead of --dtype")
    ap.add_argument("--quant-args", default="", help="more quantize() arguments, e.g. embed=q4g32")
    ap.add_argument("--target", default="native")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", default="1,4,16", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workdir", default=str(Path.home() / ".cache" / "infeng" / "bench"))
    ap.add_argument("--rounds", type=int, default=3, help="alternating infeng/llama-server rounds per level")
    ap.add_argument("--no-peer", action="store_true", help="skip llama-server")
    ap.add_argument("--baseline-tree", help="also serve the artifact from this older checkout (Python overhead "
                                            "per step, side by side)")
    ap.add_argument("--ray", action="store_true", help="also serve the artifact with infeng serve-ray (Ray Serve "
                                                        "replicas, same clients, same rounds)")
    ap.add_argument("--ray-replicas", type=int, default=2)
    ap.add_argument("--ray-threads", type=int, default=1, help="threads (Ray CPUs) per replica")
    ap.add_argument("--split", type=int, default=0,
                    help="also serve the artifact with this many plain infeng serve processes of --threads / N "
                         "threads each, pinned to their cores, the clients split among them (replicas without Ray)")
    ap.add_argument("--scheduler-only", action="store_true",
                    help="only the scheduler's Python time per step, over a stub engine (no server, no kernels)")
    args = ap.parse_args()
    Path(args.workdir).mkdir(parents=True, exist_ok=True)

    if args.artifact:
        artifact, gguf = Path(args.artifact), None
    else:
        model = ensure_model(args)
        artifact = ensure_artifact(model, args)
        gguf = None if args.no_peer or args.scheduler_only else ensure_gguf(model, args)
    manifest = json.loads((artifact / "manifest.json").read_text())
    vocab = manifest["constants"]["vocab_size"]
    common = dict(model=manifest["name"], weights=weight_storage(manifest), target=manifest["target"],
                  threads=args.threads, prompt_len=args.prompt_len, max_tokens=args.max_tokens)

    if args.scheduler_only:
        scheduler_overhead(artifact, args)
        return
    servers = [("infeng", start_infeng, artifact)] + ([("llama-server", start_llama_server, gguf)] if gguf else []) \
        + ([("baseline", start_baseline, artifact)] if args.baseline_tree else []) \
        + ([("ray", start_ray, artifact)] if args.ray else []) \
        + ([("split", start_split, artifact)] if args.split else [])
    procs, urls = [], {}
    try:
        for kind, start, path in servers:
            log = Path(args.workdir) / f"serve-{kind}.log"
            started, url = start(path, args, log)
            for proc, one in zip(started, url) if isinstance(url, list) else [(started, url)]:
                procs.append(proc)
                wait_healthy(one, proc, log)
            urls[kind] = url
        rng = np.random.default_rng(0)
        for url in urls.values():                          # warm up
            asyncio.run(run_level(url, model_id(url), [rng.integers(3, vocab, size=args.prompt_len).tolist()], 8))
        for n in args.streams:
            # alternate the servers, round after round, on the same prompts: drift hits both alike
            prompts = [rng.integers(3, vocab, size=args.prompt_len).tolist() for _ in range(n)]
            runs: dict[str, list[dict]] = {kind: [] for kind in urls}
            for rnd in range(args.rounds):
                order = list(urls.items()) if rnd % 2 == 0 else list(urls.items())[::-1]   # the order flips
                for kind, url in order:
                    runs[kind].append(run_server_level(kind, url, prompts, args.max_tokens))
            ours = median_run(runs["infeng"])
            row = {"bench": "serve", "streams": n, **common,
                   **{k: round(v, 3) if isinstance(v, float) else v for k, v in ours.items()}}
            if "llama-server" in runs:
                peer = median_run(runs["llama-server"])
                row.update(peer_tok_s=round(peer["tok_s"], 2), ratio=round(ours["tok_s"] / peer["tok_s"], 3),
                           peer_ttft_ms_p50=round(peer["ttft_ms_p50"], 1), peer_itl_ms_p50=round(peer["itl_ms_p50"], 2))
            if "ray" in runs:
                row.update(ray_replicas=args.ray_replicas, ray_threads=args.ray_threads,
                           **against_ours("ray", median_run(runs["ray"]), ours))
            if "split" in runs:
                row.update(split_processes=args.split, split_threads=max(1, args.threads // args.split),
                           **against_ours("split", median_run(runs["split"]), ours))
            if "baseline" in runs:
                base = median_run(runs["baseline"])
                ours_us = float(np.median([r["step_overhead_us"] for r in runs["infeng"]]))
                base_us = float(np.median([r["step_overhead_us"] for r in runs["baseline"]]))
                row.update(baseline_tok_s=round(base["tok_s"], 2), median_step_overhead_us=round(ours_us, 1),
                           baseline_median_step_overhead_us=round(base_us, 1),
                           overhead_ratio=round(ours_us / base_us, 3),
                           overhead_us_all=[round(r["step_overhead_us"], 1) for r in runs["infeng"]],
                           baseline_overhead_us_all=[round(r["step_overhead_us"], 1) for r in runs["baseline"]],
                           baseline_ttft_ms_p50=round(base["ttft_ms_p50"], 3),
                           tok_s_all=[round(r["tok_s"], 1) for r in runs["infeng"]],
                           baseline_tok_s_all=[round(r["tok_s"], 1) for r in runs["baseline"]],
                           ttft_ms_all=[round(r["ttft_ms_p50"], 2) for r in runs["infeng"]],
                           baseline_ttft_ms_all=[round(r["ttft_ms_p50"], 2) for r in runs["baseline"]])
            emit(**row)
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(60)                              # serve-ray stops its Ray cluster first
            except subprocess.TimeoutExpired:
                proc.kill()


def against_ours(prefix: str, run: dict, ours: dict) -> dict:
    """``run``'s tok/s, its ratio over one ``infeng serve`` (``ours``), TTFT and ITL, as ``prefix_*``."""
    return {f"{prefix}_tok_s": round(run["tok_s"], 2), f"{prefix}_ratio": round(run["tok_s"] / ours["tok_s"], 3),
            f"{prefix}_ttft_ms_p50": round(run["ttft_ms_p50"], 1), f"{prefix}_itl_ms_p50": round(run["itl_ms_p50"], 2)}


def median_run(runs: list[dict]) -> dict:
    """The run with the median tok/s (its other figures with it)."""
    return sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]

if __name__ == "__main__":
    main()
