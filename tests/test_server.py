"""``infeng serve`` driven by the official ``openai`` client (and raw HTTP where the client hides
what matters): completions and chat, streamed and not, per-request adapters, stop strings,
max_tokens, seeds, n, logprobs, adapter load/unload, errors, /health and /metrics.

One real server subprocess on a free loopback port serves the whole module. References are
independent of the server: ``infeng run`` (subprocess) and transformers' ``apply_chat_template``.
"""
from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from _serving import (ADAPTER_NAMES, AloneReference, adapters, infeng_command, metric, running_server,
                      served_artifact, write_adapter)

openai = pytest.importorskip("openai")

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("serve-artifact"))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    return adapters(tmp_path_factory.mktemp("serve-adapters"))


@pytest.fixture(scope="module")
def server(artifact, adapter_dirs, tmp_path_factory):
    args = [a for name, path in adapter_dirs.items() for a in ("--adapter", f"{name}={path}")]
    root = adapter_dirs[ADAPTER_NAMES[0]].parent               # runtime loads read adapters under it
    with running_server(artifact, *args, "--max-seqs", "8", "--adapter-root", str(root),
                        log=tmp_path_factory.mktemp("log") / "serve.log") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(artifact, adapter_dirs):
    return AloneReference(artifact, adapter_dirs)


def infeng_run(artifact, prompt: str, *args: str) -> dict:
    """``infeng run --raw``: the plain continuation /v1/completions computes (the artifact has a chat template)."""
    out = subprocess.run([*infeng_command(), "run", str(artifact), prompt, "--raw", "--json", "--threads", "1", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_models_list_base_and_adapters(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["stories260K", *ADAPTER_NAMES]
    assert client.models.retrieve("a2").id == "a2"


def test_completion_greedy_equals_infeng_run(client, artifact):
    want = infeng_run(artifact, PROMPT, "-n", "24")
    got = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.choices[0].text == want["text"]
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == want["prompt_tokens"] and got.usage.completion_tokens == 24
    stream = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24


def test_stream_is_sse_ending_with_done(server):
    with httpx.stream("POST", f"{server}/v1/completions", timeout=60,
                      json={"model": "stories260K", "prompt": PROMPT, "max_tokens": 8, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]" and len(events) >= 3


@pytest.mark.parametrize("name", ADAPTER_NAMES[:2])
def test_adapter_greedy_equals_infeng_run(client, artifact, adapter_dirs, name):
    want = infeng_run(artifact, PROMPT, "-n", "20", "--adapter", f"{name}={adapter_dirs[name]}", "--use", name)
    got = client.completions.create(model=name, prompt=PROMPT, max_tokens=20, temperature=0)
    assert got.choices[0].text == want["text"]
    base = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=20, temperature=0)
    assert base.choices[0].text != want["text"], "the adapter should change the output"
    streamed = client.completions.create(model=name, prompt=PROMPT, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want["text"]


def test_chat_prompt_rendered_as_transformers_does(client, artifact):
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "system", "content": "You tell short stories."},
                {"role": "user", "content": "Tell me about a cat."}]
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(artifact))
    want_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(want_ids, dict) or hasattr(want_ids, "input_ids"):
        want_ids = want_ids["input_ids"]
    got = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=16, temperature=0)
    assert got.usage.prompt_tokens == len(want_ids)
    # the same ids as a plain completion give the same continuation
    plain = client.completions.create(model="stories260K", prompt=list(want_ids), max_tokens=16, temperature=0)
    assert got.choices[0].message.content == plain.choices[0].text
    assert got.choices[0].message.role == "assistant"
    streamed = client.chat.completions.create(model="stories260K", messages=messages, max_tokens=16, temperature=0,
                                              stream=True)
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == got.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_with_adapter(client, reference, artifact):
    messages = [{"role": "user", "content": "Who is Lily?"}]
    got = client.chat.completions.create(model="a3", messages=messages, max_tokens=12, temperature=0)
    from infeng_runtime.chat import render_chat

    ids = reference.engine.tokenizer.encode(render_chat(reference.engine.tokenizer, messages), add_bos=False)
    assert got.choices[0].message.content == reference(ids, 12, "a3")


def test_stop_strings(client, reference):
    full = reference(PROMPT, 40)
    stop = " named"
    assert stop in full
    got = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "zzz"])
    assert got.choices[0].text == full[:full.index(stop)]
    assert got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=40, temperature=0,
                                         stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == full[:full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens(client):
    got = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=5, temperature=0)
    assert got.usage.completion_tokens == 5 and got.choices[0].finish_reason == "length"
    none = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=0)
    assert none.choices[0].text == "" and none.usage.completion_tokens == 0
    chat = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=3, temperature=0)
    assert chat.usage.completion_tokens == 3


def test_seed_reproducible_and_equal_to_infeng_run(client, artifact):
    kwargs = dict(model="stories260K", prompt=PROMPT, max_tokens=24, temperature=1.0, top_p=0.9)
    a = client.completions.create(seed=7, **kwargs).choices[0].text
    b = client.completions.create(seed=7, **kwargs).choices[0].text
    c = client.completions.create(seed=8, **kwargs).choices[0].text
    assert a == b != c
    want = infeng_run(artifact, PROMPT, "-n", "24", "-t", "1.0", "--top-p", "0.9", "--seed", "7")
    assert a == want["text"]


def test_n_choices_and_logprobs(client, reference):
    got = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=12, temperature=0.8, seed=1, n=3,
                                    logprobs=2)
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    assert len({c.text for c in got.choices}) > 1
    for choice in got.choices:
        lp = choice.logprobs
        assert "".join(lp.tokens) == choice.text
        assert len(lp.token_logprobs) == len(lp.tokens) == len(lp.top_logprobs) == 12
        assert all(x <= 0 for x in lp.token_logprobs)
        assert all(len(top) <= 2 for top in lp.top_logprobs)
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    greedy = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1)
    lp = greedy.choices[0].logprobs
    # greedy picks the most likely token: its logprob is the top one
    assert all(abs(max(top.values()) - x) < 1e-9 for top, x in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 for t in content)


def test_batched_prompts(client, reference):
    prompts = [PROMPT, "The dog ran", "Lily had a red ball"]
    got = client.completions.create(model="stories260K", prompt=prompts, max_tokens=10, temperature=0)
    texts = sorted(got.choices, key=lambda c: c.index)
    assert [c.text for c in texts] == [reference(p, 10) for p in prompts]


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize("payload, status, param", [
    ({"model": "stories260K", "prompt": PROMPT, "temperature": 3}, 400, "temperature"),
    ({"model": "stories260K", "prompt": PROMPT, "n": 0}, 400, "n"),
    ({"model": "stories260K", "prompt": PROMPT, "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": "stories260K", "prompt": [99999]}, 400, "prompt"),
    ({"model": "stories260K"}, 400, "prompt"),
    ({"model": "no-such-model", "prompt": PROMPT}, 404, "model"),
    ({"model": "stories260K", "prompt": PROMPT, "echo": True}, 400, "echo"),
    ({"model": "stories260K", "prompt": PROMPT, "frequency_penalty": 1.0}, 400, "presence_penalty"),
])
def test_bad_completion_requests(server, payload, status, param):
    r = httpx.post(f"{server}/v1/completions", json=payload, timeout=30)
    assert r.status_code == status
    assert _error(r)["param"] == param


def test_bad_bodies(server):
    r = httpx.post(f"{server}/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in _error(r)["message"]
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "stories260K", "messages": []}, timeout=30)
    assert r.status_code == 400 and _error(r)["param"] == "messages"
    r = httpx.post(f"{server}/v1/adapters", json={"name": "x", "path": "no/such/dir"}, timeout=30)
    assert r.status_code == 400 and "no/such/dir" in _error(r)["message"]
    r = httpx.delete(f"{server}/v1/adapters/never-loaded", timeout=30)
    assert r.status_code == 404 and _error(r)["code"] == "model_not_found"


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=2, temperature=-1)


def test_load_and_unload_adapter_while_serving(server, client, reference, adapter_dirs):
    path = write_adapter(adapter_dirs[ADAPTER_NAMES[0]].parent / "a4", seed=200)      # under --adapter-root
    r = httpx.post(f"{server}/v1/adapters", json={"name": "a4", "path": str(path)}, timeout=60)
    assert r.status_code == 200, r.text
    assert "a4" in [m.id for m in client.models.list().data]
    got = client.completions.create(model="a4", prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    fresh = AloneReference(reference.engine.path, {"a4": path})
    assert got == fresh(PROMPT, 10, "a4")
    r = httpx.post(f"{server}/v1/adapters", json={"name": "a4", "path": str(path)}, timeout=60)
    assert r.status_code == 400 and "already loaded" in _error(r)["message"]
    r = httpx.delete(f"{server}/v1/adapters/a4", timeout=60)
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert "a4" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a4", prompt=PROMPT, max_tokens=2)


def test_health_and_metrics(server, client):
    assert httpx.get(f"{server}/health", timeout=10).json() == {"status": "ok"}
    client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=4)
    text = httpx.get(f"{server}/metrics", timeout=10).text
    for name in ("infeng_queue_depth", "infeng_running_sequences", "infeng_kv_blocks_used", "infeng_kv_blocks_total",
                 "infeng_prefix_cache_hits_total", "infeng_tokens_per_second", "infeng_generation_tokens_total"):
        metric(text, name)
    assert metric(text, "infeng_kv_blocks_total") > 0
    assert metric(text, "infeng_generation_tokens_total") >= 4
    assert 'infeng_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert "infeng_time_to_first_token_seconds_bucket" in text
    assert "infeng_inter_token_latency_seconds_count" in text


def test_serve_cli_errors_are_one_line(artifact, tmp_path):
    bad = subprocess.run([*infeng_command(), "serve", str(artifact), "--adapter", "x=/no/such/adapter", "--port", "1"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    # the engine's start line (INFO, the KV pool) comes before the adapters load; the error is one line
    lines = [line for line in bad.stderr.strip().splitlines() if " INFO infeng." not in line]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "/no/such/adapter" in lines[0]
    bad = subprocess.run([*infeng_command(), "serve", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "config.json: file not found" in bad.stderr     # neither artifact nor model
    assert bad.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_request(server, stream):
    import time

    body = {"model": "stories260K", "prompt": PROMPT, "n": 8, "max_tokens": 490, "ignore_eos": True, "stream": stream}
    before = metric(httpx.get(f"{server}/metrics", timeout=10).text, "infeng_generation_tokens_total")
    with httpx.Client(base_url=server, timeout=30 if stream else 0.3) as c:
        try:
            with c.stream("POST", "/v1/completions", json=body) as r:
                if stream:
                    for i, _ in enumerate(r.iter_lines()):
                        if i > 3:
                            break
        except httpx.ReadTimeout:
            pass
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(f"{server}/metrics", timeout=10).text
        if metric(text, "infeng_running_sequences") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert metric(text, "infeng_running_sequences") == 0 and metric(text, "infeng_kv_blocks_used") == 0
    assert metric(text, "infeng_generation_tokens_total") - before < 8 * 490, "the request ran to the end"


def test_always_include_usage_flag(artifact, tmp_path):
    """``--always-include-usage``: a stream that did not ask for usage still ends with a usage chunk."""
    with running_server(artifact, "--always-include-usage", log=tmp_path / "serve.log") as url:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                "model": "stories260K", "prompt": PROMPT, "max_tokens": 4, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["completion_tokens"] == 4 and chunks[-1]["choices"] == []
