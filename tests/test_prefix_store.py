"""Warm restarts: the prefix cache saved and loaded (``--prefix-cache-dir``), a file of another
artifact ignored, a corrupt one refused; ``--warmup``. A restored prefix gives the text a cold
start gives (the artifact's scalar kernels are exact whatever the batch)."""
from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import httpx
import pytest
from _serving import running_server, served_artifact

from infeng_runtime.llm import LLM
from infeng_runtime.prefix_store import FILENAME, MAGIC, load_prefix_cache, save_prefix_cache
from infeng_runtime.sampling import SamplingParams
from infeng_runtime.warmup import warm_up

PROMPT = ("Once upon a time, there was a little girl named Lily. She liked to play in the park with her ball. "
          "One day she saw a big dog near the tree. ") * 3
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return served_artifact(tmp_path_factory.mktemp("prefix-artifact"))


@pytest.fixture(scope="module")
def saved(artifact, tmp_path_factory) -> tuple[Path, str, int]:
    """A cache saved after one cold generation of PROMPT: (dir, the cold text, blocks saved)."""
    directory = tmp_path_factory.mktemp("prefix-cache")
    llm = LLM(artifact, max_seqs=4, max_context=512)
    cold = llm.generate([PROMPT], GREEDY)[0]
    assert cold.cached_tokens == 0
    blocks = save_prefix_cache(llm.engine, directory)
    llm.close()
    return directory, cold.text, blocks


def test_a_restart_reuses_the_saved_prefix_and_gives_the_same_text(artifact, saved):
    directory, cold_text, blocks = saved
    llm = LLM(artifact, max_seqs=4, max_context=512)
    assert blocks > 4 and load_prefix_cache(llm.engine, directory) == blocks
    warm = llm.generate([PROMPT], GREEDY)[0]
    assert warm.cached_tokens >= 4 * llm.engine.block_size and warm.text == cold_text
    llm.close()


def rewrite(src: Path, dst: Path, edit_header=None, edit_payload=None) -> None:
    data = (src / FILENAME).read_bytes()
    (length,) = struct.unpack("<Q", data[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    header, payload = json.loads(data[start:start + length]), bytearray(data[start + length:])
    if edit_header:
        edit_header(header)
    if edit_payload:
        edit_payload(payload)
    raw = json.dumps(header).encode()
    dst.mkdir(parents=True, exist_ok=True)
    (dst / FILENAME).write_bytes(MAGIC + struct.pack("<Q", len(raw)) + raw + bytes(payload))


def flip(payload: bytearray) -> None:
    payload[len(payload) // 2] ^= 0x40


@pytest.mark.parametrize("case,edit_header,edit_payload,line", [
    ("another artifact", lambda h: h.update(artifact_sha256="0" * 64), None, "belongs to another artifact"),
    ("another KV format", lambda h: h["kv_format"].update(scheme="int8"), None, "holds another KV format"),
    ("a flipped bit", None, flip, "is corrupt and was refused (the blocks do not match their sha256)"),
    ("a cut payload", None, lambda p: p.__delitem__(slice(-10, None)), "is corrupt and was refused"),
    ("a bad header", lambda h: h.update(hashes="zz"), None, "is corrupt and was refused"),
])
def test_a_file_that_does_not_fit_is_not_loaded(artifact, saved, tmp_path, caplog, case, edit_header, edit_payload,
                                                 line):
    rewrite(saved[0], tmp_path, edit_header, edit_payload)
    llm = LLM(artifact, max_seqs=4, max_context=512)
    with caplog.at_level(logging.INFO, logger="infeng.prefix_store"):
        assert load_prefix_cache(llm.engine, tmp_path) == 0
    assert line in caplog.text and llm.engine.kv.cached_blocks == 0
    assert llm.generate([PROMPT], GREEDY)[0].text == saved[1]          # cold, and right
    llm.close()


def test_not_a_cache_file_is_refused(artifact, tmp_path, caplog):
    (tmp_path / FILENAME).write_bytes(b"hello")
    llm = LLM(artifact, max_seqs=4, max_context=512)
    with caplog.at_level(logging.INFO, logger="infeng.prefix_store"):
        assert load_prefix_cache(llm.engine, tmp_path) == 0
    assert "bad magic" in caplog.text
    llm.close()


def test_warm_up_leaves_nothing_behind(artifact):
    llm = LLM(artifact, max_seqs=3, max_context=512)
    done = warm_up(llm.engine)
    kv = llm.engine.kv
    assert done["steps"] >= 3 and not kv.slot_of and kv.cached_blocks == 0 and kv.used_blocks == 0
    llm.close()


def test_serve_saves_at_shutdown_and_starts_warm(artifact, tmp_path):
    """SIGTERM saves the cache; the next start (with --warmup) answers the same prompt from it."""
    args = ("--served-model-name", "stories", "--prefix-cache-dir", str(tmp_path / "cache"), "--warmup",
            "--max-context", "512")
    body = {"model": "stories", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    with running_server(artifact, *args, log=tmp_path / "cold.log") as url:
        cold = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert (tmp_path / "cache" / FILENAME).is_file()
    with running_server(artifact, *args, log=tmp_path / "warm.log") as url:
        warm = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
