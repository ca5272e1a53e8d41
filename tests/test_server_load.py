"""Serving under load, on loopback, bounded in count and time: 64 concurrent streaming clients over
the base model and 3 adapters; an admission bound that turns the excess away with 429 and
Retry-After while every accepted request completes; the prefix cache computing a shared system
prompt once; preemption under a deliberately tiny KV pool. Every greedy output is compared with
the same request run alone (``AloneReference``: one sequence on a fresh Engine)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from _serving import ADAPTER_NAMES, AloneReference, adapters, metric, running_server, served_artifact

openai = pytest.importorskip("openai")

WORDS = ("Once upon a time there was a little girl named Lily she loved to play with her dog in the park one day "
         "Tom saw a big red ball and wanted it").split()


def prompts(count: int, seed: int = 0) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 24)))) for _ in range(count)]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("serve-artifact"))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    return adapters(tmp_path_factory.mktemp("serve-adapters"))


@pytest.fixture(scope="module")
def reference(artifact, adapter_dirs):
    return AloneReference(artifact, adapter_dirs)


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> str:
    text = []
    async with client.stream("POST", "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                return "".join(text)
            payload = json.loads(line[6:])
            assert "error" not in payload, payload
            text.append(payload["choices"][0]["text"])
    raise AssertionError("the stream ended without data: [DONE]")


def test_64_streaming_clients_over_3_adapters(artifact, adapter_dirs, reference, tmp_path):
    models = ["stories260K", *ADAPTER_NAMES]
    jobs = [(models[i % 4], p) for i, p in enumerate(prompts(64))]
    max_tokens = 16
    args = [a for name, path in adapter_dirs.items() for a in ("--adapter", f"{name}={path}")]
    with running_server(artifact, *args, "--max-seqs", "32", log=tmp_path / "serve.log") as url:
        async def main():
            limits = httpx.Limits(max_connections=100)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
                return await asyncio.wait_for(asyncio.gather(
                    *(stream_completion(client, m, p, max_tokens) for m, p in jobs)), timeout=240)

        outputs = asyncio.run(main())
        text = httpx.get(f"{url}/metrics", timeout=10).text
    for (model, prompt), got in zip(jobs, outputs):
        assert got == reference(prompt, max_tokens, None if model == "stories260K" else model), (model, prompt)
    assert metric(text, "infeng_generation_tokens_total") >= 64
    assert 'infeng_requests_total{endpoint="/v1/completions",status="200"} 64.0' in text


def test_admission_bound_gives_429_and_loses_nothing(artifact, reference, tmp_path):
    jobs = prompts(16, seed=1)
    max_tokens = 24
    with running_server(artifact, "--max-seqs", "2", "--max-queue", "2", log=tmp_path / "serve.log") as url:
        async def one(client: httpx.AsyncClient, prompt: str) -> tuple[list[int], str]:
            statuses = []
            for _ in range(200):                     # bounded retries, honouring Retry-After
                r = await client.post("/v1/completions", json={"model": "stories260K", "prompt": prompt,
                                                               "max_tokens": max_tokens, "temperature": 0})
                statuses.append(r.status_code)
                if r.status_code == 200:
                    return statuses, r.json()["choices"][0]["text"]
                assert r.status_code == 429, r.text
                error = r.json()["error"]
                assert error["type"] == "rate_limit_error" and error["code"] == "queue_full"
                assert int(r.headers["Retry-After"]) >= 1
                await asyncio.sleep(0.05)              # the test does not wait the full second
            raise AssertionError(f"{prompt!r} was never admitted")

        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                return await asyncio.wait_for(asyncio.gather(*(one(client, p) for p in jobs)), timeout=240)

        results = asyncio.run(main())
        text = httpx.get(f"{url}/metrics", timeout=10).text
    first_try = [statuses[0] for statuses, _ in results]
    assert first_try.count(429) >= 1, "16 simultaneous requests against 2 slots + 2 queue places"
    assert first_try.count(200) >= 2
    for prompt, (_, got) in zip(jobs, results):
        assert got == reference(prompt, max_tokens)
    assert metric(text, "infeng_queue_depth") == 0
    assert 'infeng_requests_total{endpoint="/v1/completions",status="429"}' in text


def test_prefix_cache_computes_shared_system_prompt_once(artifact, reference, tmp_path):
    system = ("Lily and Tom were friends. They liked to play in the park with a big red ball. One day the sun "
              "was hot and they sat under a tree. ")
    questions = ["Lily said", "Tom saw a dog and", "The ball"]
    tok = reference.engine.tokenizer
    shared_blocks = len(tok.encode(system)) // 16
    assert shared_blocks >= 2
    with running_server(artifact, log=tmp_path / "serve.log") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        got, cached = [], []
        for q in questions:
            r = client.completions.create(model="stories260K", prompt=system + q, max_tokens=12, temperature=0)
            got.append(r.choices[0].text)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
        text = httpx.get(f"{url}/metrics", timeout=10).text
    assert [g == reference(system + q, 12) for g, q in zip(got, questions)] == [True] * 3
    assert cached[0] == 0 and all(c >= shared_blocks * 16 for c in cached[1:])
    hits = metric(text, "infeng_prefix_cache_hits_total")
    assert hits >= 2 * shared_blocks
    assert metric(text, "infeng_prefix_cache_misses_total") == metric(text, "infeng_prefix_cache_queries_total") - hits
    prompt_total = sum(len(tok.encode(system + q)) for q in questions)
    computed = metric(text, "infeng_prompt_tokens_computed_total")
    assert computed <= prompt_total - 2 * shared_blocks * 16


def test_preemption_under_tiny_kv_pool(artifact, reference, tmp_path):
    import json as _json

    manifest = _json.loads((artifact / "manifest.json").read_text())["constants"]
    block_bytes = 2 * manifest["n_layers"] * manifest["block_size"] * manifest["n_kv_heads"] * manifest["head_dim"] * 4
    jobs = prompts(8, seed=2)
    max_tokens = 40                              # each sequence needs 3-4 blocks; the pool holds 6
    with running_server(artifact, "--max-seqs", "8", "--kv-memory", str(6 * block_bytes),
                        log=tmp_path / "serve.log") as url:
        async def main():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                return await asyncio.wait_for(asyncio.gather(
                    *(stream_completion(client, "stories260K", p, max_tokens) for p in jobs)), timeout=240)

        outputs = asyncio.run(main())
        text = httpx.get(f"{url}/metrics", timeout=10).text
    assert metric(text, "infeng_kv_blocks_total") == 6
    assert metric(text, "infeng_preemptions_total") >= 1
    for prompt, got in zip(jobs, outputs):
        assert got == reference(prompt, max_tokens)


def poison_requests(count: int) -> list[tuple[str, dict, bytes | None, dict[str, str]]]:
    """``count`` requests no server may serve, mixed: (expected class of status, JSON body or None,
    raw body, extra headers). Each must get a 4xx with an OpenAI error body."""
    nested = b'{"model": "stories260K", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    kinds = [
        ({"prompt": "Once", "seed": -1}, None, {}),
        ({"prompt": "Once", "stop": [f"s{i}" for i in range(4000)]}, None, {}),
        (None, b'{"model": "stories260K", "prompt": "Once"}', {"content-type": "text/plain"}),
        (None, nested, {"content-type": "application/json"}),
        ({"prompt": "Once", "model": "no-such-model"}, None, {}),
        (None, b'{"model": "stories260K", "prompt": "Once", "temperature": NaN}', {"content-type": "application/json"}),
        ({"prompt": "Once", "logit_bias": {"5": 10}}, None, {}),
        ({"prompt": [10 ** 9]}, None, {}),
        ({"prompt": "Once", "priority": 10 ** 12}, None, {}),
        ({"prompt": ["Once"] * 400, "n": 2}, None, {}),
    ]
    out = []
    for i in range(count):
        body, raw, headers = kinds[i % len(kinds)]
        if body is not None:
            body = {"model": "stories260K", "max_tokens": 8, "stream": True, **body}
        out.append(("4xx", body, raw, headers))
    return out


def test_200_streams_with_poison_mixed_in(artifact, adapter_dirs, reference, tmp_path):
    """200 concurrent streaming requests, 10% of them poison: every valid one gets the greedy text
    it gets alone (one asks for temperature 1e-320: greedy), every poison one a 4xx, the KV pool
    returns to where it was, and the log holds no traceback."""
    models = ["stories260K", *ADAPTER_NAMES]
    valid = [(models[i % 4], p, 1e-320 if i % 30 == 7 else 0) for i, p in enumerate(prompts(180, seed=3))]
    poison = poison_requests(20)
    order = list(range(200))
    __import__("random").Random(4).shuffle(order)                 # poison spread through the valid ones
    max_tokens = 12
    args = [a for name, path in adapter_dirs.items() for a in ("--adapter", f"{name}={path}")]
    log = tmp_path / "serve.log"
    with running_server(artifact, *args, "--max-seqs", "32", "--max-queue", "256", log=log) as url:
        before = metric(httpx.get(f"{url}/metrics", timeout=10).text, "infeng_kv_blocks_used")

        async def valid_one(client, model, prompt, temperature):
            text = []
            async with client.stream("POST", "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                    "stream": True}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        return "".join(text)
                    if line.startswith("data: "):
                        payload = json.loads(line[6:])
                        assert "error" not in payload, payload
                        text.append(payload["choices"][0]["text"])
            raise AssertionError("the stream ended without data: [DONE]")

        async def poison_one(client, body, raw, headers):
            if body is not None:
                r = await client.post("/v1/completions", json=body, headers=headers)
            else:
                r = await client.post("/v1/completions", content=raw, headers=headers)
            return r.status_code, r.json()

        async def main():
            limits = httpx.Limits(max_connections=220)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
                jobs = [valid_one(client, *valid[i]) if i < 180 else poison_one(client, *poison[i - 180][1:])
                        for i in order]
                return await asyncio.wait_for(asyncio.gather(*jobs), timeout=300)

        results = dict(zip(order, asyncio.run(main())))
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        text = httpx.get(f"{url}/metrics", timeout=10).text
    for i, (model, prompt, _) in enumerate(valid):
        assert results[i] == reference(prompt, max_tokens, None if model == "stories260K" else model), (model, prompt)
    for i in range(180, 200):
        status, body = results[i]
        assert 400 <= status < 500, (poison[i - 180], status, body)
        assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    assert metric(text, "infeng_kv_blocks_used") == before == 0
    assert metric(text, "infeng_queue_depth") == 0
    assert "Traceback" not in log.read_text()
