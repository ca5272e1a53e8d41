"""The KV pool follows the model and the machine: by default it holds ``max_seqs`` sequences of the
model's context, cut to ``KV_MEMORY_SHARE`` of the memory available after the weights; asked sizes
(``max_context`` with ``max_seqs``, or ``kv_memory``) fix it exactly. The library reserves the pool
and memory is committed as blocks are used, so a server for a small model starts small; an
exhausted pool preempts or refuses, never crashes. ``infeng serve`` logs the pool at start."""
from __future__ import annotations

import json
import re
import shutil

import httpx
import numpy as np
import pytest

from _serving import served_artifact, server_process
from infeng_common.errors import InfengError
from infeng_runtime import engine as engine_module
from infeng_runtime.engine import KV_MEMORY_SHARE, Engine, available_memory
from infeng_runtime.kv_cache import KVCacheFull
from infeng_runtime.llm import LLM
from infeng_runtime.sampling import SamplingParams
from infeng_runtime.scheduler import RequestError

MiB = 2 ** 20


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/PID/status")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("kv-memory-artifact"))


@pytest.fixture(scope="module")
def long_context_artifact(artifact, tmp_path_factory):
    """The artifact with a model context of 10^12 tokens: no machine holds 16 such sequences."""
    copy = tmp_path_factory.mktemp("long-context") / "long.infeng"
    shutil.copytree(artifact, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["meta"]["max_position_embeddings"] = 10 ** 12
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def with_memory_for(monkeypatch, engine: Engine, blocks: int) -> None:
    """Make the engine module see the weights plus ``blocks`` KV blocks of memory available."""
    available = int(engine.lib.ife_weights_bytes()) + blocks * engine.kv_block_bytes
    monkeypatch.setattr(engine_module, "available_memory", lambda: available)


def test_available_memory_respects_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n")
    host = 20000000 * 1024
    v2, v1, none = tmp_path / "v2", tmp_path / "v1", tmp_path / "none"
    (v1 / "memory").mkdir(parents=True)
    v2.mkdir()
    none.mkdir()
    assert available_memory(meminfo, none) == host                  # no cgroup files: the host's
    (v2 / "memory.max").write_text("max\n")
    (v2 / "memory.current").write_text(f"{100 * MiB}\n")
    assert available_memory(meminfo, v2) == host                    # v2 without a limit
    (v2 / "memory.max").write_text(f"{1024 * MiB}\n")
    assert available_memory(meminfo, v2) == 924 * MiB               # a container's limit less its use
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{512 * MiB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{600 * MiB}\n")
    assert available_memory(meminfo, v1) == 0                       # over its limit: nothing left
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")   # v1's "no limit"
    assert available_memory(meminfo, v1) == host
    assert available_memory(tmp_path / "absent", v2) == 924 * MiB   # no /proc/meminfo: the cgroup's
    assert available_memory(tmp_path / "absent", none) is None


def test_default_pool_holds_max_seqs_of_the_model_context(artifact):
    engine = Engine(artifact, threads=1)
    model_context = engine.manifest["meta"]["max_position_embeddings"]
    assert engine.max_context == model_context
    assert engine.kv.n_blocks == 16 * -(-model_context // engine.block_size) and engine.kv.max_seqs == 16
    assert engine.kv_on_demand and engine.kv_bytes_touched == 0
    assert f"max context {model_context}, max sequences 16" in engine.kv_summary()
    assert f"16 sequences x the model's {model_context}-token context" in engine.kv_summary()


def test_default_pool_is_cut_to_the_share_of_available_memory(long_context_artifact, monkeypatch):
    probe = Engine(long_context_artifact, threads=1, max_seqs=1, kv_blocks=1)
    with_memory_for(monkeypatch, probe, 1000)
    engine = Engine(long_context_artifact, threads=1)
    budget = int(KV_MEMORY_SHARE * 1000 * probe.kv_block_bytes) // (probe.kv_block_bytes + 8)
    assert engine.kv.n_blocks == budget and engine.kv.max_seqs == 16
    assert engine.max_context == budget * engine.block_size          # one sequence may fill the pool
    assert "sized by 50% of the" in engine.kv_summary()


def test_too_little_memory_for_one_default_sequence_is_refused(long_context_artifact, monkeypatch):
    """A default pool cut below one sequence of min(model context, 2048) tokens is refused (one
    line, exit 2 in the CLI) rather than serving a 16-token context."""
    from infeng_runtime.engine import MIN_DEFAULT_CONTEXT

    probe = Engine(long_context_artifact, threads=1, max_seqs=1, kv_blocks=1)
    blocks = MIN_DEFAULT_CONTEXT // probe.block_size                 # x 50%: half a sequence
    with_memory_for(monkeypatch, probe, blocks)
    with pytest.raises(InfengError, match=f"less than one sequence of {MIN_DEFAULT_CONTEXT}; free memory"):
        Engine(long_context_artifact, threads=1)
    with_memory_for(monkeypatch, probe, 2 * blocks + 8)              # the share holds one sequence
    assert Engine(long_context_artifact, threads=1).max_context >= MIN_DEFAULT_CONTEXT


def test_a_pool_the_kernel_will_not_reserve_is_one_line(artifact):
    """The KV mapping refused (here by an address-space limit; with vm.overcommit_memory=2, by
    the commit limit): one line that says what to lower."""
    import subprocess
    import sys

    if (available_memory() or 0) < 5 * 2**30:
        pytest.skip("needs 5 GiB available: a smaller machine refuses the 4 GiB pool before the mapping")
    script = (f"import resource; from infeng_runtime.engine import Engine\n"
              f"limit = 2**30 + int(open('/proc/self/status').read().split('VmSize:')[1].split()[0]) * 1024\n"
              f"resource.setrlimit(resource.RLIMIT_AS, (limit, limit))\n"
              f"Engine({str(artifact)!r}, threads=1, max_seqs=1, kv_memory=4 * 2**30)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert re.search(r"cannot reserve \d+ MiB of address space for \d+ KV blocks .*: lower --kv-memory or "
                     r"--max-context", result.stderr), result.stderr[-2000:]


def test_asked_sizes_fix_the_pool(artifact, monkeypatch):
    probe = Engine(artifact, threads=1, max_seqs=1, kv_blocks=1)
    with_memory_for(monkeypatch, probe, 100)        # the default pool (16 x 512 tokens) would be cut
    assert Engine(artifact, threads=1).kv.n_blocks < 16 * 512 // probe.block_size
    engine = Engine(artifact, threads=1, max_seqs=3, max_context=100)
    assert (engine.kv.n_blocks, engine.max_context, engine.kv.max_seqs) == (3 * 7, 100, 3)
    engine = Engine(artifact, threads=1, max_seqs=2, kv_memory=5 * probe.kv_block_bytes)
    assert engine.kv.n_blocks == 5 and engine.max_context == 5 * engine.block_size
    assert "--kv-memory" in engine.kv_summary()
    with pytest.raises(InfengError, match="memory available"):       # asked: never cut, refused
        Engine(artifact, threads=1, max_seqs=16, max_context=4096)


def test_pool_memory_is_committed_as_blocks_are_used(artifact):
    before = rss_bytes()
    engine = Engine(artifact, threads=1, max_seqs=64, max_context=16384)
    pool = engine.kv.n_blocks * engine.kv_block_bytes
    assert pool > 1000 * MiB
    assert rss_bytes() - before < 64 * MiB                            # reserved, not committed
    n = 4000
    engine.step(np.arange(n) % 200 + 3, np.arange(n), np.zeros(n, dtype=np.int32), logits_rows=[n - 1])
    committed = -(-n // engine.block_size) * engine.kv_block_bytes
    assert engine.kv_bytes_touched == committed
    assert rss_bytes() - before >= committed                          # the rows written are memory now
    assert f"{committed / MiB:.0f} MiB touched" in engine.kv_summary()


def test_an_exhausted_pool_refuses_or_preempts(artifact):
    engine = Engine(artifact, threads=1, max_seqs=2, kv_blocks=4)
    engine.step([5] * 64, np.arange(64), [0] * 64, logits_rows=[63])
    with pytest.raises(KVCacheFull):
        engine.step([5], [0], [1])
    engine.close()

    params = SamplingParams(max_new_tokens=24)
    prompts = ["Once upon a time", "The cat sat", "Tim and Lily went", "One day a little bird"]
    roomy = LLM(artifact, threads=1, max_seqs=4)
    expected = [c.text for c in roomy.generate(prompts, params)]
    roomy.close()
    tight = LLM(artifact, threads=1, max_seqs=4, kv_blocks=6)      # 96 tokens for four sequences of ~30
    assert [c.text for c in tight.generate(prompts, params)] == expected
    assert tight.loop.scheduler.stats.preemptions > 0
    assert tight.loop.snapshot()["kv_bytes_touched"] == 6 * tight.engine.kv_block_bytes   # the cap, reached
    with pytest.raises(RequestError, match="context is 96 tokens"):
        tight.generate(["word " * 100], params)
    tight.close()


def test_serve_logs_the_pool_at_start(artifact, tmp_path):
    log = tmp_path / "serve.log"
    with server_process(artifact, "--log-level", "info", "--max-seqs", "3", "--max-context", "100", log=log):
        pass
    assert re.search(r"KV cache: 21 blocks of 16 tokens \(\d+ KiB each\), 0 MiB touched / up to \d+ \S+ "
                     r"\(committed as blocks are used\), max context 100, max sequences 3", log.read_text())


@pytest.mark.slow
def test_smollm2_server_starts_under_1gb(tmp_path):
    """The real SmolLM2-135M-Instruct GGUF, served with every default (compiled into the artifact
    cache on first use): its pool is sized for 16 sequences of 8,192 tokens (5.6 GiB, where memory
    allows) but the server's RSS stays under 1 GB at start and after a chat request."""
    from infeng_models import registry

    gguf = registry.fetch(registry.SMOLLM2_135M_INSTRUCT)
    log = tmp_path / "serve.log"
    with server_process(gguf, "--log-level", "info", "--threads", "2", log=log, startup_s=900) as (proc, url):
        at_start = rss_bytes(proc.pid)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
            "model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"], "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        after_request = rss_bytes(proc.pid)
    assert at_start < 1e9 and after_request < 1e9, (at_start, after_request)
    line = next(line for line in log.read_text().splitlines() if "KV cache:" in line)
    assert re.search(r"\d+ blocks of 16 tokens \(720 KiB each\), 0 MiB touched / up to \d+ MiB "
                     r"\(committed as blocks are used\), max context \d+, max sequences 16", line), line
