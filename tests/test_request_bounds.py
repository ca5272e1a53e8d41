"""Untrusted JSON text and the lesser per-request bounds of ``infeng serve`` (issue 34):

- ``json_body.loads``, the one JSON parser for everything a client or the model hands the server:
  strict UTF-8 (UTF-16/UTF-32 bodies, with or without a byte-order mark, refused by name),
  finite numbers, no lone surrogate, nesting bounded before parsing (never RecursionError).
- Tool calls parsed from generated text nested past the bound are content, not an error.
- Over HTTP (a Server in-process, Starlette's TestClient): the body's encoding, a schema sent as
  JSON text, the number and size of ``tools`` (chat, Responses, /tokenize), ``/detokenize``'s id
  list (bounded, checked off the event loop). Every refusal is a 400 with OpenAI's error body
  naming the limit, and the server answers a plain request afterwards.
"""
from __future__ import annotations

import codecs
import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _serving import served_artifact
from infeng_runtime.api_errors import APIError
from infeng_runtime.json_body import MAX_DEPTH, JSONRejected, loads, parse_json
from infeng_runtime.tools import ToolStream, arguments_object, parse_forced, parse_tool_calls

MODEL = "stories260K"
ERROR_KEYS = {"message", "type", "param", "code"}
DEEP = "[" * 100_000 + "]" * 100_000                      # far past the interpreter's recursion limit


# -- the parser ---------------------------------------------------------------------------------
@pytest.mark.parametrize("encoding, needle", [
    ("utf-16", "UTF-16 byte-order mark"), ("utf-16-be", "NUL bytes"), ("utf-16-le", "NUL bytes"),
    ("utf-32", "UTF-32 byte-order mark"), ("utf-32-be", "NUL bytes")])
def test_wide_encodings_are_refused_by_name(encoding, needle):
    raw = '{"prompt": "a \\ud800 b"}'.encode(encoding)
    with pytest.raises(JSONRejected, match=needle):
        loads(raw)
    with pytest.raises(APIError) as e:
        parse_json('{"prompt": "\ud800"}'.encode(encoding, "surrogatepass"))        # a raw lone surrogate
    assert e.value.status == 400 and "the request body" in str(e.value) and "UTF-8" in str(e.value)


def test_strict_utf8():
    assert loads(codecs.BOM_UTF8 + '{"a": "é"}'.encode()) == {"a": "é"}        # RFC 8259: a BOM may be ignored
    with pytest.raises(JSONRejected, match="not valid UTF-8.*offset 7"):
        loads(b'{"a": "\xff"}')
    with pytest.raises(JSONRejected, match="lone UTF-16 surrogate"):
        loads(b'{"a": "\xed\xa0\x80"}')                                          # U+D800 written as UTF-8
    with pytest.raises(JSONRejected, match="lone UTF-16 surrogate"):
        loads(b'{"a": "\\udfff"}')
    with pytest.raises(JSONRejected, match="lone UTF-16 surrogate"):
        loads('{"a": "\ud800"}')
    assert loads(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001F600"}


@pytest.mark.parametrize("text", [DEEP, '{"a":' * 50_000 + "1" + "}" * 50_000, "[" * (MAX_DEPTH + 1) +
                                  "]" * (MAX_DEPTH + 1)])
def test_nesting_bounded_for_bytes_and_text(text):
    for given in (text, text.encode()):
        with pytest.raises(JSONRejected, match=f"more than {MAX_DEPTH} levels"):
            loads(given)
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None


@pytest.mark.parametrize("text", ["NaN", "[Infinity]", '{"t": 1e999}', "-Infinity"])
def test_numbers_must_be_finite(text):
    with pytest.raises(JSONRejected, match="finite|out of range"):
        loads(text)


FUZZ = settings(max_examples=300, deadline=None, derandomize=True)
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False,
                                                                                        allow_infinity=False),
                                     st.text()),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                           max_leaves=12)


@FUZZ
@given(value=json_values, ascii_only=st.booleans())
def test_every_finite_json_value_round_trips(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only)
    assert loads(text) == value and loads(text.encode()) == value
    with pytest.raises(JSONRejected):
        loads(text.encode("utf-16"))


@FUZZ
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_any_bytes_parse_or_are_rejected(raw):
    try:
        loads(raw)
    except JSONRejected:
        pass


@FUZZ
@given(text=st.text(alphabet=st.sampled_from(list('{}[]":,;<>|_ nameargumtsp0NaN\\')) | st.characters(),
                    max_size=80))
def test_tool_call_parsing_never_raises(text):
    for candidate in (text, f"<tool_call>{text}</tool_call>", f'{{"name": "f", "arguments": {text}}}'):
        parse_tool_calls(candidate)
        stream = ToolStream()
        stream.push(candidate)
        stream.finish()
        parse_forced(candidate, None)


# -- tool calls in generated text ---------------------------------------------------------------
DEEP_CALL = '{"name": "f", "arguments": {"x": ' + DEEP + "}}"


@pytest.mark.parametrize("text", [f"<tool_call>{DEEP_CALL}</tool_call>", DEEP_CALL, f"<|python_tag|>{DEEP_CALL}",
                                  '{"name": "f", "arguments": {"x": NaN}}'])
def test_tool_calls_nested_too_deeply_are_content(text):
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text
    stream = ToolStream()
    events = stream.push(text) + stream.finish()
    assert all(kind == "content" for kind, _ in events) and "".join(v for _, v in events) == text
    assert parse_forced(f"[{DEEP_CALL}]", None) == []
    assert arguments_object(DEEP) == DEEP                                   # a request's arguments, kept as text


def test_a_shallow_call_still_parses():
    content, calls = parse_tool_calls('Sure. <tool_call>{"name": "f", "arguments": {"x": [[1]]}}</tool_call>')
    assert content == "Sure." and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": [[1]]}


# -- over HTTP ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, client): a Server over a real engine loop, driven in-process."""
    from starlette.testclient import TestClient

    from infeng_runtime.server import ServeOptions, build_server

    server = build_server(served_artifact(tmp_path_factory.mktemp("serve-artifact")),
                          ServeOptions(threads=1, max_seqs=2))
    with TestClient(server.app, base_url="http://localhost", raise_server_exceptions=False) as http:
        yield server, http


@pytest.fixture
def http(served):
    """The client; after each case a plain completion must still answer 200."""
    yield served[1]
    r = served[1].post("/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 2})
    assert r.status_code == 200, r.text


def error_of(r, status: int = 400) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    return body["error"]


def raw_post(http, path: str, raw: bytes):
    return http.post(path, content=raw, headers={"Content-Type": "application/json"})


def chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}


def tool(name: str, description: str = "") -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32"])
def test_utf16_and_utf32_bodies_are_400(http, encoding):
    for path, body in (("/v1/completions", '{"model": "stories260K", "prompt": "\ud800", "max_tokens": 2}'),
                       ("/v1/chat/completions", json.dumps(chat(), ensure_ascii=False))):
        message = error_of(raw_post(http, path, body.encode(encoding, "surrogatepass")))["message"]
        assert "UTF-8" in message and ("UTF-16" in message or "UTF-32" in message), message


@pytest.mark.parametrize("field", [
    lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}},
    lambda s: {"structured_outputs": {"json": s}}, lambda s: {"guided_json": s}])
def test_schema_sent_as_json_text_is_bounded(http, field):
    for schema_text in (DEEP, '{"type": "array", "items": ' * 100 + "{}" + "}" * 100):
        error = error_of(http.post("/v1/chat/completions", json=chat(**field(schema_text))))
        assert f"more than {MAX_DEPTH} levels" in error["message"] and error["param"], error
    assert "not valid JSON" in error_of(http.post("/v1/chat/completions", json=chat(**field("{nope"))))["message"]
    r = http.post("/v1/chat/completions", json=chat(**field('{"type": "object"}'), max_tokens=8, temperature=0))
    assert r.status_code == 200, r.text


def test_deep_tool_call_in_the_output_is_content(http):
    """The model (held to it by a regex) writes a call nested past the bound: the answer is text."""
    depth = MAX_DEPTH - 1                                   # inside the call's two objects: one level too deep
    pattern = r'<tool_call>\{"name": "f", "arguments": \{"x": ' + r"\[" * depth + r"\]" * depth + r"\}\}</tool_call>"
    r = http.post("/v1/chat/completions", json=chat(tools=[tool("f")], structured_outputs={"regex": pattern},
                                                    max_tokens=None, temperature=0))
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert not message.get("tool_calls") and message["content"].startswith("<tool_call>"), message


def test_tool_count_bounded(http):
    from infeng_runtime.api.bodies import MAX_TOOLS

    tools = [tool(f"f{i}") for i in range(MAX_TOOLS + 1)]
    for path, body in (("/v1/chat/completions", chat(tools=tools)),
                       ("/v1/responses", {"model": MODEL, "input": "Hi", "tools": [
                           {"type": "function", "name": f"f{i}", "parameters": {}} for i in range(MAX_TOOLS + 1)]}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "tools": tools})):
        error = error_of(http.post(path, json=body))
        assert error["param"] == "tools" and f"at most {MAX_TOOLS}" in error["message"], error


def test_tools_count_against_the_prompt_bound(served, http):
    server = served[0]
    big = [tool(f"f{i}", "d" * (server.max_prompt_chars // 8)) for i in range(10)]   # ~1.25x the bound
    for path, body in (("/v1/chat/completions", chat(tools=big)),
                       ("/v1/chat/completions", chat(tools=big, tool_choice="required")),
                       ("/v1/responses", {"model": MODEL, "input": "Hi", "tools": [
                           {"type": "function", "name": t["function"]["name"],
                            "description": t["function"]["description"], "parameters": {}} for t in big]}),
                       ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}], "tools": big})):
        error = error_of(http.post(path, json=body))
        assert error["code"] == "context_length_exceeded" and error["param"] == "tools", error
        assert str(server.max_prompt_chars) in error["message"] and "tools" in error["message"]
    assert http.post("/v1/chat/completions", json=chat(tools=big[:1])).json()["error"]["param"] != "tools"
    assert http.post("/v1/chat/completions", json=chat(tools=[tool("f0", "Says hello.")])).status_code == 200


def test_detokenize_bounded_and_off_the_event_loop(served, http, monkeypatch):
    server = served[0]
    limit = server.loop.scheduler.max_context
    error = error_of(http.post("/detokenize", json={"tokens": [1] * (limit + 1)}))
    assert error["param"] == "tokens" and f"at most {limit}" in error["message"]
    error = error_of(http.post("/detokenize", json={"tokens": [1] * 1_000_000}))         # ~3 MB, under the body cap
    assert f"at most {limit}" in error["message"]
    assert error_of(http.post("/detokenize", json={"tokens": [server.engine.vocab_size]}))["param"] == "tokens"
    from infeng_runtime.api import tokenize

    threads = []
    check = tokenize.detokenize_body
    monkeypatch.setattr(tokenize, "detokenize_body", lambda core, raw: threads.append(threading.current_thread().name)
                        or check(core, raw))
    ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and "Once upon a time" in r.json()["prompt"]
    assert threads and threads[0].startswith("infeng-text"), threads
