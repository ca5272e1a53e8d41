"""``infeng serve MODEL`` with a model that is not an artifact: compiled with the compile options
into the content-addressed artifact cache, then served; the next start reuses the artifact, and
another option compiles another one."""
from __future__ import annotations

import os
import time

import httpx

from _serving import running_server


def test_serve_compiles_into_the_cache_then_reuses_it(stories_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("INFENG_CACHE_DIR", str(tmp_path / "cache" / "build"))
    artifacts = tmp_path / "cache" / "artifacts"
    texts, logs, ready = [], [], []
    for i, extra in enumerate([(), (), ("--quant", "int8")]):
        log = tmp_path / f"serve{i}.log"
        started = time.monotonic()
        with running_server(stories_dir, "--target", "scalar", *extra, log=log) as url:
            ready.append(time.monotonic() - started)
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "stories260K", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        logs.append(log.read_text())
    assert "compiled " in logs[0] and "reusing " in logs[1] and "compiled " in logs[2]
    assert len([p for p in os.listdir(artifacts) if p.endswith(".infeng")]) == 2      # f32 and int8
    assert texts[0] == texts[1]
