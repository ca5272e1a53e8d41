"""Every vLLM-named metric moves under load (issue 19): ``/metrics`` scraped before, during and
after a burst of concurrent streamed requests on a real ``infeng serve`` (stories260K with LoRA
slots) whose conditions are made on purpose: more requests than sequence slots (a queue), a KV
pool too small for the running sequences (preemptions), requests over two adapters, and requests
sharing a prompt prefix that an earlier request left in the prefix cache (hits). The gauges are
sampled while the burst runs; counters and histograms are compared before and after."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from _serving import ADAPTER_NAMES, adapters, running_server, served_artifact

prometheus_parser = pytest.importorskip("prometheus_client.parser")

MODEL = "stories260K"
#: A shared prefix of more than two KV blocks (16 positions each) of stories260K's tokens.
PREFIX = ("Once upon a time there was a little girl named Lily. She loved to play with her dog in the park. "
          "One day she saw a big red ball under a tree and wanted it very much. ")
STORIES = ["Tom had a blue car", "The cat sat on the mat", "A bird sang in the tree", "The sun was hot",
           "Sam ate an apple", "The boy ran fast", "Mom made a cake", "The frog jumped high"]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text as {(sample name, sorted labels): value}."""
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    want = tuple(sorted({"model_name": MODEL, **labels}.items()))
    return samples[(name, want)]


def _lora_info(samples: dict) -> dict[str, str]:
    (labels,) = [dict(k[1]) for k in samples if k[0] == "vllm:lora_requests_info"]
    return labels


async def _stream(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, priority: int = 0) -> int:
    tokens = 0
    async with client.stream("POST", "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "priority": priority}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                payload = json.loads(line[6:])
                assert "error" not in payload, payload
                tokens += 1
    return tokens


def test_every_vllm_metric_moves_under_load(tmp_path_factory):
    artifact = served_artifact(tmp_path_factory.mktemp("metrics-artifact"))
    dirs = adapters(tmp_path_factory.mktemp("metrics-adapters"))
    constants = json.loads((artifact / "manifest.json").read_text())["constants"]
    block_bytes = 2 * constants["n_layers"] * constants["block_size"] * constants["n_kv_heads"] * \
        constants["head_dim"] * 4
    args = [a for name, path in dirs.items() for a in ("--adapter", f"{name}={path}")]
    # 4 sequence slots for 12 requests (a queue); 12 KV blocks for 4 sequences of ~6 blocks (preemption)
    with running_server(artifact, *args, "--max-seqs", "4", "--kv-memory", str(12 * block_bytes),
                        log=tmp_path_factory.mktemp("log") / "serve.log") as url:
        def scrape() -> dict:
            return _samples(httpx.get(f"{url}/metrics", timeout=10).text)

        before = scrape()

        async def main() -> tuple[list[dict], list[int]]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                await _stream(client, MODEL, PREFIX + "The end.", 2)       # leaves the prefix in the cache
                # sent first (and first in priority): admitted before the pool is under pressure, they hit it
                first = [asyncio.ensure_future(_stream(client, MODEL, PREFIX + s, 64, -1)) for s in STORIES[:2]]
                await asyncio.sleep(0.05)
                jobs = [(ADAPTER_NAMES[i % 2] if i % 3 == 0 else MODEL, s, 0) for i, s in enumerate(STORIES)]
                jobs += [(ADAPTER_NAMES[0], STORIES[0] + " and a dog", 0), (MODEL, PREFIX + STORIES[3], 0)]
                burst = asyncio.gather(*first, *(_stream(client, m, p, 64, pr) for m, p, pr in jobs))
                during = []
                while not burst.done():
                    during.append(_samples((await client.get("/metrics")).text))
                    await asyncio.sleep(0.02)
                return during, await burst

        during, tokens = asyncio.run(asyncio.wait_for(main(), timeout=300))
        after = scrape()
    assert tokens == [64] * len(tokens)
    # gauges: idle before and after, busy while the burst ran
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert _value(before, name) == 0 == _value(after, name), name
        assert max(_value(s, name) for s in during) > 0, name
    assert max(_value(s, "vllm:kv_cache_usage_perc") for s in during) <= 1.0
    # counters
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert _value(after, name) > _value(before, name), name
    # histograms: one TTFT and one end-to-end latency per request, an inter-token latency per later token
    requests = len(tokens) + 1
    for name, least in (("vllm:time_to_first_token_seconds_count", requests),
                        ("vllm:e2e_request_latency_seconds_count", requests),
                        ("vllm:inter_token_latency_seconds_count", sum(tokens) - len(tokens))):
        assert _value(after, name) - _value(before, name) >= least, name
    # the adapters of running and waiting requests, as the gateway reads them
    assert _lora_info(before)["running_lora_adapters"] == "" == _lora_info(after)["running_lora_adapters"]
    seen = {a for s in during for key in ("running_lora_adapters", "waiting_lora_adapters")
            for a in _lora_info(s)[key].split(",") if a}
    assert seen == set(ADAPTER_NAMES[:2])
    assert _lora_info(after)["max_lora"] == "4"
