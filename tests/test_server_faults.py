"""``infeng serve`` tried as a careless client and an attacker would try it, through the official
``openai`` client and raw HTTP: access control (API key, JSON-only bodies, the Host check on
loopback, adapter roots, client chat templates), bounded work per request (body size, JSON depth,
stop strings, prompt size, n x prompts, priority, seed, non-finite numbers, lone surrogates), a
sequence with non-finite logits, the engine loop dying, SIGTERM with requests in flight, the
request log and the serve command's ranges.

Every refusal is checked for its status and OpenAI's error body; after each case against the
module's server, /health and a plain completion must still answer 200. One server (API key,
adapter root, request log at info) serves most cases; a few cases need their own: an artifact
whose logits are NaN, a raised body cap, a server to send SIGTERM to, an engine that dies.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from _serving import (infeng_command, metric, nonfinite_artifact, running_server, served_artifact, server_process,
                      sse_lines, write_adapter)

openai = pytest.importorskip("openai")

KEY = "infeng-test-key-3f9c"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "stories260K"
PROMPT = "Once upon a time"
ERROR_KEYS = {"message", "type", "param", "code"}


# -- fixtures and helpers ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("serve-artifact"))


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """An adapter root (a good adapter; one with a NaN in its weights; a symlink to a directory
    outside; a directory whose files are symlinks to outside) and an adapter outside it."""
    from safetensors.numpy import load_file, save_file

    base = tmp_path_factory.mktemp("adapters")
    root, outside = base / "root", base / "outside"
    write_adapter(root / "good", seed=300)
    bad = write_adapter(root / "nan-weights", seed=301)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    tensors[NAN_TENSOR][1, 2] = np.nan
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    secret = write_adapter(outside / "secret", seed=302)
    (root / "escape").symlink_to(secret, target_is_directory=True)
    (root / "linked-files").mkdir()
    for f in secret.iterdir():
        (root / "linked-files" / f.name).symlink_to(f)
    return root, outside


NAN_TENSOR = "base_model.model.model.layers.2.self_attn.v_proj.lora_B.weight"


@pytest.fixture(scope="module")
def server_log(tmp_path_factory):
    return tmp_path_factory.mktemp("log") / "serve.log"


@pytest.fixture(scope="module")
def server(artifact, roots, server_log):
    with running_server(artifact, "--api-key", KEY, "--adapter-root", str(roots[0]), "--log-level", "info",
                        log=server_log) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def still_serving(request):
    """After each case against the module's server: /health and a valid request still get 200."""
    yield
    if "server" in request.fixturenames:
        url = request.getfixturevalue("server")
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                       headers=AUTH, timeout=30)
        assert r.status_code == 200, r.text


def post(url: str, path: str, body=None, *, raw: bytes | None = None, headers: dict | None = None,
         timeout: float = 30) -> httpx.Response:
    """POST JSON (``body``) or ``raw`` bytes as application/json, with the API key unless
    ``headers`` say otherwise."""
    headers = {**AUTH, "Content-Type": "application/json", **(headers or {})}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=timeout)


def error_of(r: httpx.Response, status: int) -> dict:
    """The error object of an OpenAI-style error response with ``status``."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    return body["error"]


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}


def stream_events(lines: list[str]) -> tuple[list[dict], list[dict]]:
    """(chunks, error objects) of an SSE stream's lines, which must end with ``data: [DONE]``."""
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    payloads = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    return [p for p in payloads if "error" not in p], [p["error"] for p in payloads if "error" in p]


# -- access control -----------------------------------------------------------------------------
def test_api_key_required_on_v1_routes(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(f"{server}/v1/completions", json=completion(), headers=headers, timeout=30)
        assert error_of(r, 401)["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
        assert KEY not in r.text
    assert error_of(httpx.get(f"{server}/v1/models", timeout=10), 401)
    assert error_of(httpx.delete(f"{server}/v1/adapters/good", timeout=10), 401)
    assert error_of(httpx.post(f"{server}/v1/adapters", json={"name": "x", "path": "good"}, timeout=10), 401)
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong-key", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200          # open: liveness probes
    assert httpx.get(f"{server}/metrics", timeout=10).status_code == 200         # open: scrapes


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "application/json; charset=latin-1", None])
def test_post_body_must_be_json(server, content_type):
    headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
    r = httpx.post(f"{server}/v1/completions", content=json.dumps(completion()).encode(), headers=headers,
                   timeout=30)
    assert "content-type" in r.request.headers or content_type is None
    assert error_of(r, 415)["code"] == "unsupported_media_type"


def test_json_with_utf8_charset_is_fine(server):
    r = post(server, "/v1/completions", completion(), headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io", "localhost.evil.example",
                                  "[::2]"])
def test_foreign_host_refused_on_loopback(server, host):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/health")):
        r = httpx.request(method, f"{server}{path}", headers={**AUTH, "Host": host, "Content-Type": "application/json"},
                          content=json.dumps(completion()).encode() if method == "POST" else None, timeout=30)
        assert error_of(r, 421)["code"] == "invalid_host"


@pytest.mark.parametrize("host", ["localhost", "localhost:{port}", "127.0.0.1:{port}", "[::1]:{port}", "[::1]"])
def test_loopback_hosts_accepted(server, host):
    port = server.rsplit(":", 1)[1]
    r = httpx.get(f"{server}/v1/models", headers={**AUTH, "Host": host.format(port=port)}, timeout=10)
    assert r.status_code == 200, r.text


def test_adapter_paths_outside_the_roots_are_refused_alike(server, roots, client):
    _, outside = roots
    answers = {}
    for given in (str(outside / "secret"),                 # exists, outside
                  str(outside / "no-such-dir"),            # does not exist, outside
                  "../outside/secret", "/etc",
                  "escape",                                # a symlink in the root to a directory outside
                  "linked-files"):                         # a directory in the root whose files link outside
        r = post(server, "/v1/adapters", {"name": "x", "path": given})
        error = error_of(r, 403)
        assert error["code"] == "adapter_path_forbidden" and error["type"] == "permission_error"
        answers[given] = error["message"].replace(repr(given), "PATH")
    assert len(set(answers.values())) == 1, answers                # no difference tells whether a path exists
    assert "x" not in [m.id for m in client.models.list().data]


def test_adapter_load_under_a_root(server, roots, client):
    root, _ = roots
    r = post(server, "/v1/adapters", {"name": "good", "path": "good"})
    assert r.status_code == 200, r.text
    assert r.json()["root"] == "good"
    listed = httpx.get(f"{server}/v1/models", headers=AUTH, timeout=10).text
    assert str(root) not in listed and '"/' not in listed, listed      # no absolute paths
    assert client.completions.create(model="good", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
    assert httpx.delete(f"{server}/v1/adapters/good", headers=AUTH, timeout=30).status_code == 200
    missing = error_of(post(server, "/v1/adapters", {"name": "gone", "path": "no-such-adapter"}), 400)
    assert missing["code"] == "adapter_load_failed" and str(root) not in missing["message"]


def test_adapter_snapshot_reads_the_files_it_checked(tmp_path, monkeypatch):
    """Runtime loads read a private copy of the adapter's files, each opened as a path and accepted
    by where it is once open: a file swapped for a symlink to outside once the path was checked is
    refused (the race simulated by a confine that checks nothing), a later swap does not reach the
    copy, a FIFO and files the reader does not read are left alone."""
    import os

    from infeng_runtime.api_errors import APIError
    from infeng_runtime.http_guard import AdapterRoots

    root, outside = tmp_path / "root", tmp_path / "outside"
    good = write_adapter(root / "good", seed=310)
    secret = write_adapter(outside / "secret", seed=311)
    os.mkfifo(good / "a-fifo")
    (good / "notes.txt").write_text("not part of an adapter")
    roots = AdapterRoots([root])
    original = (good / "adapter_model.safetensors").read_bytes()
    with roots.snapshot("good") as copy:
        assert sorted(f.name for f in copy.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        (good / "adapter_model.safetensors").unlink()
        (good / "adapter_model.safetensors").symlink_to(secret / "adapter_model.safetensors")
        assert (copy / "adapter_model.safetensors").read_bytes() == original
    assert not copy.exists()                                          # removed after the load
    monkeypatch.setattr(AdapterRoots, "confine", lambda self, given: root / given)
    with pytest.raises(APIError) as refused:
        with roots.snapshot("good"):
            pass
    assert refused.value.status == 403 and str(outside) not in refused.value.message


def test_adapter_with_nan_weights_is_refused_naming_the_tensor(server, roots):
    error = error_of(post(server, "/v1/adapters", {"name": "nan", "path": "nan-weights"}), 400)
    assert error["code"] == "adapter_load_failed"
    assert NAN_TENSOR in error["message"] and "non-finite" in error["message"]
    assert str(roots[0]) not in error["message"]


@pytest.mark.parametrize("scale", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_adapter_scale_must_be_finite(server, client, scale):
    raw = f'{{"name": "scaled", "path": "good", "scale": {scale}}}'.encode()
    assert "JSON" in error_of(post(server, "/v1/adapters", raw=raw), 400)["message"]
    assert "scaled" not in [m.id for m in client.models.list().data]


def test_client_chat_template_needs_the_flag(server):
    messages = [{"role": "user", "content": "hi"}]
    for extra, param in (({"chat_template_kwargs": {"template": "{{ messages[0].content }}"}},
                          "chat_template_kwargs.template"),
                         ({"chat_template": "{{ messages[0].content }}"}, "chat_template")):
        r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2, **extra})
        error = error_of(r, 400)
        assert error["param"] == param and "--trust-request-chat-template" in error["message"]


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token"])
def test_chat_template_kwargs_cannot_replace_the_renderers_variables(server, key):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, "chat_template_kwargs": {key: "x"}})
    error = error_of(r, 400)
    assert error["param"] == "chat_template_kwargs" and key in error["message"]


def test_harmless_chat_template_kwargs_are_passed(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


def test_no_docs_or_unknown_routes(server):
    for path in ("/docs", "/openapi.json", "/v1/nothing"):
        assert error_of(httpx.get(f"{server}{path}", headers=AUTH, timeout=10), 404)["type"] == "not_found_error"


# -- bounded work per request ---------------------------------------------------------------------
@pytest.mark.parametrize("stop", [["a"] * 4000, [f"s{i}" for i in range(17)], ["x" * 257]])
def test_stop_strings_bounded(server, stop):
    t0 = time.monotonic()
    assert error_of(post(server, "/v1/completions", completion(stop=stop)), 400)["param"] == "stop"
    assert time.monotonic() - t0 < 5


def test_sixteen_stop_strings_are_fine(client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stop=[f"{i:0>256}" for i in range(16)])


def test_body_over_the_cap(server):
    big = completion(prompt="x" * (10 * 2 ** 20))                # 10 MB prompt, default cap 4 MiB
    error = error_of(post(server, "/v1/completions", big), 413)
    assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]

    def chunked():                                                # no Content-Length: counted as it arrives
        yield b'{"model": "stories260K", "prompt": "'
        for _ in range(6):
            yield b"x" * 2 ** 20
        yield b'"}'

    r = httpx.post(f"{server}/v1/completions", content=chunked(), headers={**AUTH, "Content-Type": "application/json"},
                   timeout=30)
    assert "content-length" not in r.request.headers
    assert error_of(r, 413)["code"] == "request_too_large"


def test_deeply_nested_json(server):
    deep = b'{"model": "stories260K", "prompt": "hi", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "nest" in error_of(post(server, "/v1/completions", raw=deep), 400)["message"]
    deep_object = b'{"model": "stories260K", "prompt": "hi", "user": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"
    assert "nest" in error_of(post(server, "/v1/completions", raw=deep_object), 400)["message"]
    shallow = b'{"model": "stories260K", "prompt": "hi", "max_tokens": 2, "user": ' + b"[" * 8 + b"]" * 8 + b"}"
    assert post(server, "/v1/completions", raw=shallow).status_code == 200
    brackets_in_text = completion(prompt="[" * 50 + "{" * 50)               # brackets inside a string are text
    assert post(server, "/v1/completions", brackets_in_text).status_code == 200


def test_n_times_prompts_beyond_the_queue_is_400(server):
    r = post(server, "/v1/completions", completion(prompt=[PROMPT, "The dog", "Lily"], n=128))    # 384 > 256
    error = error_of(r, 400)
    assert error["param"] == "n" and "--max-queue" in error["message"]


@pytest.mark.parametrize("priority", [1001, -1001, 10 ** 30])
def test_priority_bounded(server, priority):
    assert error_of(post(server, "/v1/completions", completion(priority=priority)), 400)["param"] == "priority"


def test_priority_at_the_bounds_is_fine(server):
    assert post(server, "/v1/completions", completion(priority=-1000)).status_code == 200
    assert post(server, "/v1/completions", completion(priority=1000)).status_code == 200


@pytest.mark.parametrize("seed", [-1, 2 ** 64, -(2 ** 70)])
def test_seed_out_of_range(server, client, seed):
    assert error_of(post(server, "/v1/completions", completion(seed=seed)), 400)["param"] == "seed"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, seed=seed)


def test_largest_seed_is_fine(client):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, seed=2 ** 64 - 1, temperature=1.0)


def test_subnormal_temperature_samples_greedily(client):
    tiny = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1e-320)
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert tiny.choices[0].text == greedy.choices[0].text


@pytest.mark.parametrize("field, value", [("temperature", "NaN"), ("top_p", "NaN"), ("temperature", "Infinity"),
                                          ("temperature", "-Infinity"), ("temperature", "1e999")])
def test_non_finite_numbers_refused(server, field, value):
    raw = f'{{"model": "stories260K", "prompt": "hi", "max_tokens": 2, "{field}": {value}}}'.encode()
    assert "JSON" in error_of(post(server, "/v1/completions", raw=raw), 400)["message"]


def test_assistant_turn_with_null_content(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    user = {"role": "user", "content": "Is it sunny?"}
    with_null = [user, {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    empty = [user, {"role": "assistant", "content": "", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    a = client.chat.completions.create(model=MODEL, messages=with_null, max_tokens=4, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=empty, max_tokens=4, temperature=0)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.choices[0].message.content == b.choices[0].message.content
    bare = client.chat.completions.create(model=MODEL, messages=[user, {"role": "assistant", "content": None},
                                                                 {"role": "user", "content": "And?"}], max_tokens=2)
    assert bare.choices[0].finish_reason == "length"


@pytest.mark.parametrize("raw", [
    b'{"model": "stories260K", "prompt": "a \\ud800 b", "max_tokens": 2}',
    b'{"model": "stories260K", "prompt": "\\udfff", "max_tokens": 2}',
    b'{"model": "stories260K", "prompt": "a \xed\xa0\x80 b", "max_tokens": 2}',
    b'{"model": "stories260K", "prompt": "ok", "stop": ["\\ud800"], "max_tokens": 2}',
])
def test_lone_surrogate_is_a_client_error(server, raw):
    assert "surrogate" in error_of(post(server, "/v1/completions", raw=raw), 400)["message"]


def test_lone_surrogate_in_chat_and_valid_pairs(server):
    raw = b'{"model": "stories260K", "messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}'
    error_of(post(server, "/v1/chat/completions", raw=raw), 400)
    pair = b'{"model": "stories260K", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    assert post(server, "/v1/completions", raw=pair).status_code == 200


def test_prompt_beyond_any_context_refused_before_tokenizing(server):
    r = post(server, "/v1/completions", completion(prompt="word " * 400_000))      # 2 MB, under the cap
    error = error_of(r, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    huge = [{"role": "user", "content": "w " * 10 ** 6}]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": huge})
    assert error_of(r, 400)["code"] == "context_length_exceeded"


# -- the request log ----------------------------------------------------------------------------
def _log_lines(path, pattern: str, deadline_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + deadline_s
    while True:
        lines = [line for line in path.read_text().splitlines() if pattern in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def test_request_log(server, server_log, client):
    got = client.with_raw_response.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    request_id = got.headers["x-request-id"]
    assert got.parse().id == f"cmpl-{request_id}"
    (line,) = _log_lines(server_log, f"id={request_id}")
    fields = dict(item.split("=", 1) for item in line.split(" request ", 1)[1].split())
    assert fields["status"] == "200" and fields["model"] == MODEL and fields["adapter"] == "-"
    assert fields["prompt_tokens"] == str(got.parse().usage.prompt_tokens) and fields["completion_tokens"] == "5"
    assert float(fields["ttft_ms"]) <= float(fields["latency_ms"])
    assert " INFO infeng.server " in line

    with httpx.stream("POST", f"{server}/v1/completions", headers=AUTH, timeout=30,
                      json=completion(max_tokens=490, n=8, ignore_eos=True, stream=True)) as r:
        gone_id = r.headers["x-request-id"]
        next(r.iter_lines())                                      # one chunk, then the client leaves
    (gone,) = _log_lines(server_log, f"id={gone_id}")
    assert "status=499" in gone

    httpx.post(f"{server}/v1/models", timeout=10)                                       # 401
    post(server, "/v1/completions", completion(prompt="x" * (5 * 2 ** 20)))              # 413
    post(server, "/v1/completions", completion(seed=-1))                                 # 400
    (startup,) = _log_lines(server_log, " serving ")
    for key in ("model=stories260K", "target=", "threads=1", "kv_blocks=", "kv_bytes=", "max_seqs=16",
                "max_context=512", "adapters=-", "api_key=on"):
        assert key in startup, startup
    assert KEY not in server_log.read_text()
    text = server_log.read_text()
    assert "status=401" in text and "status=413" in text and "status=400" in text
    assert "Traceback" not in text, "client errors are logged without tracebacks"


# -- a sequence that fails alone: non-finite logits ----------------------------------------------
@pytest.fixture(scope="module")
def nan_server(tmp_path_factory):
    artifact = nonfinite_artifact(tmp_path_factory.mktemp("nan-artifact"))
    log = tmp_path_factory.mktemp("nan-log") / "serve.log"
    with running_server(artifact, "--served-model-name", MODEL, "--log-format", "json", "--log-level", "info",
                        log=log) as url:
        yield url, log


def test_non_finite_logits_fail_the_request_not_the_loop(nan_server):
    url, log = nan_server
    for _ in range(2):                                           # the loop lives on: the same again
        error = error_of(httpx.post(f"{url}/v1/completions", json=completion(), timeout=30), 500)
        assert error["type"] == "server_error" and "non-finite" in error["message"]
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    nan_client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.InternalServerError, match="non-finite"):
        nan_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    for path, body in (("/v1/completions", completion(stream=True, n=3)),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "stream": True})):
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=30) as r:
            assert r.status_code == 200
            _, errors = stream_events(sse_lines(r))
        assert len(errors) == 1 and set(errors[0]) == ERROR_KEYS and "non-finite" in errors[0]["message"]
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}

    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    requests = [r for r in records if r["event"] == "request" and r["path"] == "/v1/completions"]
    assert requests and requests[0]["status"] == 500 and "non-finite" in requests[0]["error"]
    assert {"id", "model", "adapter", "prompt_tokens", "latency_ms", "time", "level"} <= set(requests[0])
    assert any(r["event"] == "serving" and r["model"] == MODEL for r in records)


def test_adapter_loads_off_without_a_root(nan_server):
    url, _ = nan_server
    r = httpx.post(f"{url}/v1/adapters", json={"name": "x", "path": "/etc"}, timeout=10)
    error = error_of(r, 403)
    assert error["code"] == "adapter_loads_disabled" and "/etc" not in error["message"]


# -- a raised body cap, client templates trusted ----------------------------------------------------
@pytest.fixture(scope="module")
def open_server(artifact, tmp_path_factory):
    with running_server(artifact, "--max-request-bytes", "16MiB", "--trust-request-chat-template", "--max-seqs", "1",
                        log=tmp_path_factory.mktemp("open-log") / "serve.log") as url:
        yield url


def test_ten_megabyte_prompt_refused_quickly_while_a_stream_flows(open_server):
    arrivals: list[float] = []
    flowing, enough = threading.Event(), threading.Event()

    def stream():                           # 64 choices one after another (one sequence slot): ~8 s
        with httpx.stream("POST", f"{open_server}/v1/completions", timeout=60,
                          json=completion(max_tokens=490, n=64, ignore_eos=True, stream=True)) as r:
            for _ in r.iter_lines():
                arrivals.append(time.monotonic())
                flowing.set()
                if enough.is_set():
                    return                  # the client leaves; the server cancels the rest

    reader = threading.Thread(target=stream)
    reader.start()
    assert flowing.wait(30)
    t0 = time.monotonic()
    r = httpx.post(f"{open_server}/v1/completions", json=completion(prompt="x" * (10 * 2 ** 20)), timeout=60)
    t1 = time.monotonic()
    time.sleep(0.2)
    enough.set()
    reader.join(60)
    assert error_of(r, 400)["code"] == "context_length_exceeded"
    # tokenizing 10 MB on the event loop took 16 s with every stream stalled; the bounds leave room
    # for a busy 2-core machine
    assert t1 - t0 < 5.0, f"refused after {t1 - t0:.2f} s: it should be by its length, without tokenizing"
    gaps = np.diff([t0, *(t for t in arrivals if t0 <= t <= t1), t1])
    assert gaps.max() < 1.5, f"the stream stalled for {gaps.max():.2f} s"
    assert arrivals[-1] > t1, "the stream went on after the refusal"
    assert httpx.get(f"{open_server}/health", timeout=10).status_code == 200


def test_trusted_client_chat_template(open_server, artifact):
    from infeng_common.tokenizer import Tokenizer

    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}{{ greeting }}"
    r = httpx.post(f"{open_server}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Lily"}], "max_tokens": 2,
        "chat_template_kwargs": {"template": template, "greeting": " Once"}})
    assert r.status_code == 200, r.text
    want = Tokenizer(artifact).encode("<<Lily>> Once", add_bos=False)
    assert r.json()["usage"]["prompt_tokens"] == len(want)


# -- graceful shutdown ------------------------------------------------------------------------------
def _start_requests(url: str, stream_body: dict, plain_body: dict) -> tuple[dict, threading.Thread, threading.Thread]:
    """A streamed and a plain request in threads, on a server with one sequence slot; returns once
    the stream has sent a chunk and the plain request is queued behind it. ``out`` gets ``stream``
    (its lines) and ``plain`` (the response)."""
    out: dict = {"first": threading.Event()}

    def stream():
        with httpx.stream("POST", f"{url}/v1/completions", json=stream_body, timeout=60) as r:
            lines = []
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    out["first"].set()
            out["stream"] = lines

    def plain():
        out["plain"] = httpx.post(f"{url}/v1/completions", json=plain_body, timeout=60)

    threads = threading.Thread(target=stream), threading.Thread(target=plain)
    threads[0].start()
    assert out["first"].wait(30)                  # the stream first: the plain request queues behind it
    threads[1].start()
    # one sequence slot, the stream's n <= the plain request's n: the stream alone keeps fewer than n
    # sequences waiting, so n waiting means the plain request is queued
    assert stream_body["n"] <= plain_body["n"]
    deadline = time.monotonic() + 30
    while True:
        if metric(httpx.get(f"{url}/metrics", timeout=10).text, "infeng_queue_depth") >= plain_body["n"]:
            break
        assert time.monotonic() < deadline, "the requests never reached the engine"
        time.sleep(0.01)
    return out, *threads


def test_sigterm_lets_running_requests_finish(artifact, tmp_path):
    long = completion(max_tokens=490, n=16, ignore_eos=True)    # 16 x 490 steps one after another: ~2 s
    with server_process(artifact, "--max-seqs", "1", log=tmp_path / "serve.log") as (proc, url):
        out, *threads = _start_requests(url, {**long, "stream": True}, long)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        refused = httpx.post(f"{url}/v1/completions", json=completion(), timeout=10)   # draining: no admission
        health = httpx.get(f"{url}/health", timeout=10)
        for t in threads:
            t.join(60)
        code = proc.wait(30)
    assert error_of(refused, 503)["code"] == "shutting_down" and health.status_code == 503
    chunks, errors = stream_events(out["stream"])
    assert not errors and sum(c["choices"][0]["finish_reason"] == "length" for c in chunks) == 16
    assert out["plain"].status_code == 200 and out["plain"].json()["usage"]["completion_tokens"] == 16 * 490
    assert code == 0


def test_sigterm_past_the_shutdown_timeout_ends_requests(artifact, tmp_path):
    long = completion(max_tokens=490, n=64, ignore_eos=True)         # 64 x 490 steps one after another: ~8 s
    with server_process(artifact, "--max-seqs", "1", "--shutdown-timeout", "1",
                        log=tmp_path / "serve.log") as (proc, url):
        out, *threads = _start_requests(url, {**long, "stream": True}, long)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        code = proc.wait(30)
        elapsed = time.monotonic() - t0
    _, errors = stream_events(out["stream"])                       # an error event, then [DONE]
    assert len(errors) == 1 and errors[0]["code"] == "shutting_down" and "shutdown timeout" in errors[0]["message"]
    assert error_of(out["plain"], 503)["code"] == "shutting_down"
    assert code == 0 and elapsed < 10


# -- the engine loop dies ---------------------------------------------------------------------------
#: ``infeng`` with Engine.forward made to raise (not an InfengError: the loop itself dies) once the
#: file named by argv[1] exists. Test code only: production code has no such hook.
DYING_ENGINE = """
import sys
from pathlib import Path
from infeng_runtime.engine import Engine
from infeng_cli.main import main

flag = Path(sys.argv.pop(1))
forward = Engine.forward

def dying_forward(self, *args, **kwargs):
    if flag.exists():
        raise RuntimeError("injected failure of the engine loop")
    return forward(self, *args, **kwargs)

Engine.forward = dying_forward
sys.argv[0] = "infeng"
main()
"""


def test_engine_loop_failure_answers_503_and_exits_1(artifact, tmp_path):
    flag = tmp_path / "die"
    command = [sys.executable, "-c", DYING_ENGINE, str(flag)]
    long = completion(max_tokens=490, n=16, ignore_eos=True)
    with server_process(artifact, "--max-seqs", "1", "--log-level", "info", log=tmp_path / "serve.log",
                        command=command) as (proc, url):
        out, *threads = _start_requests(url, {**long, "stream": True}, long)
        flag.touch()
        for t in threads:
            t.join(60)
        code = proc.wait(30)
    _, errors = stream_events(out["stream"])
    assert len(errors) == 1 and errors[0]["code"] == "engine_stopped" and "injected failure" in errors[0]["message"]
    assert error_of(out["plain"], 503)["code"] == "engine_stopped"
    assert code == 1
    assert "engine loop failed; exiting" in (tmp_path / "serve.log").read_text()


#: DYING_ENGINE whose tokenizer also hangs (a thread the interpreter would wait for at exit) on a
#: prompt with "stuck" in it.
STUCK_AND_DYING = DYING_ENGINE.replace("Engine.forward = dying_forward", """Engine.forward = dying_forward
import time
from infeng_common.tokenizer import Tokenizer
encode_batch = Tokenizer.encode_batch

def stuck_encode_batch(self, texts, *args, **kwargs):
    if any("stuck" in t for t in texts):
        time.sleep(600)
    return encode_batch(self, texts, *args, **kwargs)

Tokenizer.encode_batch = stuck_encode_batch""")


@pytest.mark.slow
def test_engine_loop_failure_exits_even_with_a_stuck_thread(artifact, tmp_path):
    """The exit watchdog is armed when the engine loop dies too, not only on SIGTERM: a text
    thread stuck in native code cannot keep the process alive past uvicorn's wait plus the grace."""
    from infeng_runtime.server import GRACEFUL_SECONDS, SHUTDOWN_GRACE_SECONDS

    flag = tmp_path / "die"
    command = [sys.executable, "-c", STUCK_AND_DYING, str(flag)]
    with server_process(artifact, "--max-seqs", "1", log=tmp_path / "serve.log", command=command) as (proc, url):
        stuck = threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions", json=completion(
            prompt="stuck"), timeout=60), daemon=True)
        stuck.start()
        time.sleep(0.5)
        flag.touch()
        t0 = time.monotonic()
        httpx.post(f"{url}/v1/completions", json=completion(), timeout=60)     # runs forward: the loop dies
        code = proc.wait(GRACEFUL_SECONDS + SHUTDOWN_GRACE_SECONDS + 30)
        elapsed = time.monotonic() - t0
    assert code == 1 and elapsed < GRACEFUL_SECONDS + SHUTDOWN_GRACE_SECONDS + 5
    assert "exiting now" in (tmp_path / "serve.log").read_text()


@pytest.fixture
def in_process(artifact):
    """A Server over a real engine loop, driven in-process through Starlette's TestClient."""
    from starlette.testclient import TestClient

    from infeng_runtime.server import ServeOptions, build_server

    server = build_server(artifact, ServeOptions(threads=1, max_seqs=2))
    with TestClient(server.app, base_url="http://localhost", raise_server_exceptions=False) as http:
        yield server, http


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_on_fatal_in_process(in_process, monkeypatch):
    server, http = in_process
    dead = threading.Event()
    forward = server.engine.forward

    def dying_forward(*args, **kwargs):
        if dead.is_set():
            raise RuntimeError("the engine went away")
        return forward(*args, **kwargs)

    monkeypatch.setattr(server.engine, "forward", dying_forward)
    long = completion(max_tokens=490, n=4, ignore_eos=True, stream=True)
    with http.stream("POST", "/v1/completions", json=long) as r:
        lines = r.iter_lines()
        first = next(lines)
        dead.set()
        _, errors = stream_events([first, *(line for line in lines if line)])
    assert errors[0]["code"] == "engine_stopped" and "the engine went away" in errors[0]["message"]
    deadline = time.monotonic() + 5
    while server.exit_code is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.exit_code == 1                                   # serve() exits with it
    health = http.get("/health")
    assert health.status_code == 503 and "the engine went away" in health.json()["message"]
    error = error_of(http.post("/v1/completions", json=completion()), 503)
    assert error["code"] == "engine_stopped"


def test_unexpected_exception_is_a_json_500(in_process, monkeypatch, caplog):
    server, http = in_process

    def broken(model):
        raise RuntimeError("a bug in the handler")

    monkeypatch.setattr(server, "adapter_of", broken)
    with caplog.at_level("ERROR", logger="infeng.server"):
        r = http.post("/v1/completions", json=completion())
    error = error_of(r, 500)
    request_id = r.headers["x-request-id"]
    assert error["type"] == "server_error" and request_id in error["message"]
    assert "a bug in the handler" not in error["message"]
    logged = [rec for rec in caplog.records if rec.exc_info and getattr(rec, "fields", {}).get("id") == request_id]
    assert logged and "a bug in the handler" in str(logged[0].exc_info[1])
    monkeypatch.undo()
    assert http.post("/v1/completions", json=completion()).status_code == 200


def test_text_work_past_its_budget_is_dropped(in_process, monkeypatch):
    import infeng_runtime.api.core as core_module

    server, http = in_process
    encode = server.tokenizer.encode_batch
    monkeypatch.setattr(core_module, "TEXT_WORK_SECONDS", 0.2)
    monkeypatch.setattr(server.tokenizer, "encode_batch", lambda *a: time.sleep(1.0) or encode(*a))
    t0 = time.monotonic()
    error = error_of(http.post("/v1/completions", json=completion()), 400)
    assert error["code"] == "prompt_too_expensive" and time.monotonic() - t0 < 0.9
    monkeypatch.undo()
    assert http.post("/v1/completions", json=completion()).status_code == 200


# -- the command line ---------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, flag", [
    ("port", 0, "--port"), ("port", 65536, "--port"), ("max_queue", 0, "--max-queue"), ("threads", -1, "--threads"),
    ("max_seqs", 0, "--max-seqs"), ("max_context", 0, "--max-context"), ("max_request_bytes", 1023,
                                                                           "--max-request-bytes"),
    ("shutdown_timeout", -1.0, "--shutdown-timeout"), ("shutdown_timeout", float("nan"), "--shutdown-timeout"),
    ("log_format", "xml", "--log-format"), ("log_level", "loud", "--log-level"), ("api_key", " ", "--api-key")])
def test_serve_option_ranges(field, value, flag):
    from infeng_common.errors import InfengError
    from infeng_runtime.server import ServeOptions

    with pytest.raises(InfengError, match=flag):
        ServeOptions(**{field: value}).check()


def test_serve_cli_range_errors_are_one_line(artifact, tmp_path):
    for args, flag in ((["--port", "70000"], "--port"), (["--max-request-bytes", "100"], "--max-request-bytes"),
                       (["--adapter-root", str(tmp_path / "missing")], "--adapter-root")):
        bad = subprocess.run([*infeng_command(), "serve", str(artifact), *args], capture_output=True, text=True,
                             timeout=60)
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.strip().count("\n") == 0 and flag in bad.stderr


def test_serve_port_in_use_is_one_line_exit_2(artifact):
    """The port is bound before the artifact loads: an address in use is one line and exit 2."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        bad = subprocess.run([*infeng_command(), "serve", str(artifact), "--host", "127.0.0.1", "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and f"127.0.0.1:{port}" in bad.stderr, bad.stderr
