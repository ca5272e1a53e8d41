"""Structured outputs and the rest of the OpenAI surface on a real ``infeng serve`` (stories260K:
a 512-token vocabulary, so masks are cheap and the model is fast), driven by the official
``openai`` client; outputs checked with ``jsonschema`` and ``re``, independent of the grammar
engine. Tool-call parsing is checked as units here; the tool round trip on a real instruct
model is tests/test_tools.py.
"""
from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest

from _serving import ADAPTER_NAMES, adapters, running_server, served_artifact

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from infeng_runtime.tools import ToolStream, parse_forced, parse_tool_calls  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "mood": {"enum": ["happy", "sad", "sleepy"]},
    "age": {"type": "integer", "minimum": 1, "maximum": 99},
    "friends": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
    "required": ["name", "mood", "age", "friends"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Tell me about the cat."}]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("structured-artifact"))


@pytest.fixture(scope="module")
def server(artifact, tmp_path_factory):
    dirs = adapters(tmp_path_factory.mktemp("structured-adapters"))
    args = [a for name, path in dirs.items() for a in ("--adapter", f"{name}={path}")]
    with running_server(artifact, *args, "--max-seqs", "8",
                        log=tmp_path_factory.mktemp("log") / "serve.log") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def _schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "cat", "schema": schema, "strict": True}}


def test_json_schema_n_logprobs_and_adapters(client):
    """Every choice of every model (base and LoRA adapters), sampled, validates; logprobs come back."""
    for model in ("stories260K", *ADAPTER_NAMES[:2]):
        r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=120, n=3, temperature=1.0,
                                           seed=7, response_format=_schema_format(), logprobs=True, top_logprobs=2)
        assert len(r.choices) == 3
        for choice in r.choices:
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            assert choice.logprobs.content and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
            assert all(t.logprob > -9999 for t in choice.logprobs.content)   # sampled tokens are allowed ones


def test_json_schema_stream_equals_non_streamed(client):
    kwargs = dict(model="stories260K", messages=MESSAGES, max_tokens=120, temperature=0,
                  response_format=_schema_format())
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(whole), SCHEMA)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens > 0


def test_json_object_and_vllm_fields(client):
    r = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=60, temperature=0.8, seed=3,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=20, n=4, temperature=1,
                                  seed=5, extra_body={"structured_outputs": {"choice": ["yes", "no", "a cat"]}})
    assert {c.text for c in r.choices} <= {"yes", "no", "a cat"}
    r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=20, temperature=1,
                                  seed=5, extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].text)
    r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=30, temperature=1,
                                  seed=5, extra_body={"structured_outputs": {
                                      "grammar": 'start: "The " ANIMAL " is " COLOR\nANIMAL: "cat" | "dog"\n'
                                                 'COLOR: "red" | "blue"'}})
    assert re.fullmatch(r"The (cat|dog) is (red|blue)", r.choices[0].text)
    r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=30, temperature=1,
                                  seed=5, extra_body={"guided_grammar": 'root ::= "x" [0-9] [0-9]'})
    assert re.fullmatch(r"x[0-9]{2}", r.choices[0].text)
    r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=200, temperature=0,
                                  extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frobnicate"}}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                 "function": {"name": "g"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools.0"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "stories260K", "messages": MESSAGES, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_tokenize_matches_engine_prompt_ids(client, server):
    r = client.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=1)
    tok = httpx.post(f"{server}/tokenize", json={"model": "stories260K", "prompt": "Once upon a time"}).json()
    assert tok["count"] == len(tok["tokens"]) == r.usage.prompt_tokens and tok["max_model_len"] == 512
    chat = client.chat.completions.create(model="stories260K", messages=MESSAGES, max_tokens=1)
    tok_chat = httpx.post(f"{server}/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()
    assert tok_chat["count"] == chat.usage.prompt_tokens and len(tok_chat["token_strs"]) == tok_chat["count"]
    text = httpx.post(f"{server}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.endswith("Once upon a time")
    assert httpx.post(f"{server}/detokenize", json={"tokens": [10 ** 6]}).status_code == 400
    assert httpx.get(f"{server}/version").json()["version"]


def test_vllm_metric_names(server, client):
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
             "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
             "vllm:e2e_request_latency_seconds_count", "vllm:lora_requests_info")
    client.chat.completions.create(model=ADAPTER_NAMES[0], messages=MESSAGES, max_tokens=4)
    text = httpx.get(f"{server}/metrics").text
    for name in names:
        assert re.search(rf"^{re.escape(name)}\{{", text, re.M), name
    assert 'max_lora="4"' in text


# -- tool-call parsing (units) -------------------------------------------------------------------
def test_parse_hermes_and_llama3_calls():
    content, calls = parse_tool_calls('Let me look.\n<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n'
                                      '</tool_call>\n<tool_call>{"name": "t", "arguments": {}}</tool_call>')
    assert content == "Let me look." and [(c.name, json.loads(c.arguments)) for c in calls] == \
        [("w", {"city": "Oslo"}), ("t", {})]
    content, calls = parse_tool_calls('<|python_tag|>{"name": "w", "parameters": {"city": "Oslo"}}')
    assert content is None and calls[0].name == "w" and json.loads(calls[0].arguments) == {"city": "Oslo"}
    content, calls = parse_tool_calls('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert [c.name for c in calls] == ["a", "b"]
    assert parse_tool_calls("plain {text}") == ("plain {text}", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>")[1] == []
    assert [c.name for c in parse_forced('[{"name": "a", "parameters": {"k": 1}}]', None)] == ["a"]
    assert parse_forced('{"k": 1}', "f")[0].arguments == '{"k": 1}'


@pytest.mark.parametrize("text", [
    'Sure.\n<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"q": "<"}}'
    '</tool_call> done <tool',
    '{"name": "w", "parameters": {"city": "Oslo"}}',
    "no calls here < at all",
])
def test_tool_stream_reassembles_to_the_parse(text):
    for size in (1, 3, 7):
        stream = ToolStream()
        events = []
        for i in range(0, len(text), size):
            events += stream.push(text[i:i + size])
        events += stream.finish()
        content = "".join(v for k, v in events if k == "content")
        calls = [(v.name, v.arguments) for k, v in events if k == "call"]
        want_content, want_calls = parse_tool_calls(text)
        assert calls == [(c.name, c.arguments) for c in want_calls]
        assert content.strip() == (want_content or "").strip()


def test_masked_sampling_keeps_finiteness_checks():
    """A masked row keeps NaN visible to the scheduler's checks and samples only allowed tokens."""
    from infeng_runtime.sampling.grammar import MASKED_LOGIT

    row = np.array([0.0, 5.0, np.nan, 1.0], dtype=np.float32)
    disallowed = np.array([False, True, False, True])
    np.copyto(row, MASKED_LOGIT, where=disallowed)
    assert np.isnan(row[2]) and np.isfinite(row[[0, 1, 3]]).all()
    z = row[[0, 1, 3]].astype(np.float64) / 0.1
    p = np.exp(z - z.max())
    assert p[1] == 0 and p[2] == 0
