"""Golden transcripts of the serving layer: a fixed list of HTTP exchanges (every endpoint, streamed
and not, tools, structured outputs, logprobs, ``n > 1``, stop strings, adapters, speculation, each
error class) and the offline ``LLM`` API, run in process against stories260K (scalar kernels, one
thread: the same tokens whatever the batch), with ids and timestamps normalised.

``python tests/_golden.py`` records ``tests/golden/serving.json`` from the code under test;
``tests/test_golden_serving.py`` replays the exchanges and compares byte for byte. Record only
when a behaviour change is intended, and say so in the commit.
"""
from __future__ import annotations

import json
import re
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

TRANSCRIPTS = Path(__file__).resolve().parent / "golden" / "serving.json"
#: The versions of the libraries whose output some transcripts carry, as recorded.
VERSIONS = TRANSCRIPTS.with_name("versions.json")
#: Request fields that make llguidance shape the output (grammar masks).
GRAMMAR_FIELDS = ("guided_regex", "guided_choice", "guided_grammar", "guided_json", "structured_outputs",
                  "response_format")
#: Exchanges whose error message is pydantic's own wording.
PYDANTIC_MESSAGES = ("missing-model", "bad-temperature", "empty-messages")
BASE_URL = "http://127.0.0.1:8000"          # the Host header a loopback-bound server accepts

#: Generated ids and clock readings -> fixed placeholders (the rest of a body is compared as is).
_NORMALISE = [
    (re.compile(r"\b(chatcmpl|cmpl)-[0-9a-f]{16}(-\d+)?"), r"\1-ID"),
    (re.compile(r"\b(resp|msg|fc)_[0-9a-f]{8,32}"), r"\1_ID"),
    (re.compile(r"\bcall_[0-9a-f]{24}"), "call_ID"),
    (re.compile(r"(request id )[0-9a-f]{16}"), r"\1ID"),
    (re.compile(r'"(created|created_at|completed_at)":\s*[0-9.]+'), r'"\1":0'),
]
#: Response headers worth keeping (the rest carry dates, lengths, request ids).
_HEADERS = ("content-type", "retry-after", "cache-control", "www-authenticate", "allow")

PROMPT = "Once upon a time"
API_KEY = "golden-key"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story about a cat."}]


def _cmpl(**fields: Any) -> dict[str, Any]:
    return {"model": "stories", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"model": "stories", "messages": CHAT, "max_tokens": 12, "temperature": 0, **fields}


def _resp(**fields: Any) -> dict[str, Any]:
    return {"model": "stories", "input": "Tell me a story about a dog.", "max_output_tokens": 12,
            "temperature": 0, **fields}


def exchanges(adapter_root: Path) -> list[dict[str, Any]]:
    """Every exchange: ``server`` (``base`` or ``spec``), ``method``, ``path`` and a JSON ``body``
    (or raw ``data`` with ``headers``)."""
    post = lambda name, path, body, server="base": {"name": name, "server": server, "method": "POST",  # noqa: E731
                                                    "path": path, "body": body}
    get = lambda name, path: {"name": name, "server": "base", "method": "GET", "path": path}  # noqa: E731
    out = [
        get("health", "/health"), get("models", "/v1/models"), get("model", "/v1/models/a1"),
        get("model-missing", "/v1/models/nope"), get("no-route", "/v2/nothing"),
        {"name": "method-not-allowed", "server": "base", "method": "GET", "path": "/v1/completions"},
        # /v1/completions
        post("cmpl", "/v1/completions", _cmpl()),
        post("cmpl-stream", "/v1/completions", _cmpl(stream=True)),
        post("cmpl-stream-usage", "/v1/completions", _cmpl(stream=True, stream_options={"include_usage": True})),
        post("cmpl-n2-seeded", "/v1/completions", _cmpl(n=2, temperature=0.9, seed=7, top_p=0.9)),
        post("cmpl-n2-stream", "/v1/completions", _cmpl(n=2, temperature=0.9, seed=7, top_k=20, stream=True)),
        post("cmpl-logprobs", "/v1/completions", _cmpl(logprobs=3, max_tokens=6)),
        post("cmpl-logprobs-stream", "/v1/completions", _cmpl(logprobs=2, max_tokens=6, stream=True)),
        post("cmpl-logprobs0", "/v1/completions", _cmpl(logprobs=0, max_tokens=4)),
        post("cmpl-stop", "/v1/completions", _cmpl(stop=["a", "the"], max_tokens=24)),
        post("cmpl-stop-stream", "/v1/completions", _cmpl(stop="a", max_tokens=24, stream=True)),
        post("cmpl-token-ids", "/v1/completions", _cmpl(prompt=[1, 403, 407, 261, 378])),
        post("cmpl-two-prompts", "/v1/completions", _cmpl(prompt=["Once", "The dog"], n=2)),
        post("cmpl-ignore-eos", "/v1/completions", _cmpl(ignore_eos=True, max_tokens=40)),
        post("cmpl-max0", "/v1/completions", _cmpl(max_tokens=0)),
        post("cmpl-adapter", "/v1/completions", _cmpl(model="a1")),
        post("cmpl-adapter-stream", "/v1/completions", _cmpl(model="a2", stream=True)),
        post("cmpl-regex", "/v1/completions", _cmpl(guided_regex="[a-z]{3,6} [0-9]{2}", max_tokens=16)),
        post("cmpl-choice", "/v1/completions", _cmpl(structured_outputs={"choice": ["yes", "no", "maybe"]})),
        post("cmpl-json-schema", "/v1/completions", _cmpl(max_tokens=40, response_format={
            "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})),
        post("cmpl-grammar-stream", "/v1/completions", _cmpl(guided_grammar='root ::= "ab" [c-e]+', stream=True,
                                                             max_tokens=8)),
        # /v1/chat/completions
        post("chat", "/v1/chat/completions", _chat()),
        post("chat-stream", "/v1/chat/completions", _chat(stream=True)),
        post("chat-stream-usage", "/v1/chat/completions", _chat(stream=True, stream_options={"include_usage": True})),
        post("chat-n2-seeded", "/v1/chat/completions", _chat(n=2, temperature=1.0, seed=3)),
        post("chat-n2-stream", "/v1/chat/completions", _chat(n=2, temperature=1.0, seed=3, stream=True)),
        post("chat-logprobs", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=2, max_tokens=5)),
        post("chat-logprobs-stream", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=1, max_tokens=5,
                                                                   stream=True)),
        post("chat-stop", "/v1/chat/completions", _chat(stop=["the"], max_completion_tokens=30)),
        post("chat-stop-stream", "/v1/chat/completions", _chat(stop=["the"], max_completion_tokens=30,
                                                               stream=True)),
        post("chat-parts", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}])),
        post("chat-adapter", "/v1/chat/completions", _chat(model="a2")),
        post("chat-json-object", "/v1/chat/completions", _chat(response_format={"type": "json_object"},
                                                               max_tokens=20)),
        post("chat-json-schema-stream", "/v1/chat/completions", _chat(stream=True, max_tokens=40, response_format={
            "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}})),
        post("chat-tools-auto", "/v1/chat/completions", _chat(tools=TOOLS)),
        post("chat-tools-none", "/v1/chat/completions", _chat(tools=TOOLS, tool_choice="none")),
        post("chat-tools-required", "/v1/chat/completions", _chat(tools=TOOLS, tool_choice="required",
                                                                  max_tokens=40)),
        post("chat-tools-required-stream", "/v1/chat/completions", _chat(tools=TOOLS, tool_choice="required",
                                                                         max_tokens=40, stream=True)),
        post("chat-tools-named", "/v1/chat/completions", _chat(tools=TOOLS, max_tokens=40, tool_choice={
            "type": "function", "function": {"name": "get_weather"}})),
        post("chat-tools-named-stream", "/v1/chat/completions", _chat(tools=TOOLS, max_tokens=40, stream=True,
                                                                      tool_choice={"type": "function", "function": {
                                                                          "name": "get_weather"}})),
        post("chat-tools-single", "/v1/chat/completions", _chat(tools=TOOLS, tool_choice="required", max_tokens=60,
                                                                parallel_tool_calls=False)),
        post("chat-tool-history", "/v1/chat/completions", _chat(tools=TOOLS, messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])),
        # /v1/responses
        post("resp", "/v1/responses", _resp()),
        post("resp-stream", "/v1/responses", _resp(stream=True)),
        post("resp-instructions", "/v1/responses", _resp(instructions="Be brief.", input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])),
        post("resp-tools-required", "/v1/responses", _resp(max_output_tokens=40, tool_choice="required", tools=[
            {"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}])),
        post("resp-tools-stream", "/v1/responses", _resp(max_output_tokens=40, tool_choice="required", stream=True,
                                                         tools=[{"type": "function", "name": "get_weather",
                                                                 "parameters": TOOLS[0]["function"]["parameters"]}])),
        post("resp-json", "/v1/responses", _resp(max_output_tokens=40, text={"format": {
            "type": "json_schema", "name": "p", "schema": SCHEMA}})),
        post("resp-adapter", "/v1/responses", _resp(model="a1")),
        post("resp-bad-item", "/v1/responses", _resp(input=[{"type": "image", "url": "x"}])),
        # /tokenize, /detokenize
        post("tokenize", "/tokenize", {"prompt": PROMPT}),
        post("tokenize-strs", "/tokenize", {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True}),
        post("tokenize-chat", "/tokenize", {"messages": CHAT}),
        post("tokenize-both", "/tokenize", {"prompt": "x", "messages": CHAT}),
        post("detokenize", "/detokenize", {"tokens": [1, 403, 407, 261, 378]}),
        post("detokenize-range", "/detokenize", {"tokens": [1, 100000]}),
        # adapters at runtime
        post("adapter-load", "/v1/adapters", {"name": "a3", "path": str(adapter_root / "a3")}),
        post("cmpl-loaded-adapter", "/v1/completions", _cmpl(model="a3")),
        {"name": "adapter-unload", "server": "base", "method": "DELETE", "path": "/v1/adapters/a3"},
        {"name": "adapter-unload-missing", "server": "base", "method": "DELETE", "path": "/v1/adapters/a3"},
        post("adapter-load-outside-root", "/v1/adapters", {"name": "x", "path": "/etc"}),
        post("adapter-load-base-name", "/v1/adapters", {"name": "stories", "path": str(adapter_root / "a3")}),
        # errors a client can cause
        {"name": "bad-json", "server": "base", "method": "POST", "path": "/v1/completions", "data": b"{not json",
         "headers": {"content-type": "application/json"}},
        {"name": "not-json-type", "server": "base", "method": "POST", "path": "/v1/completions", "data": b"{}",
         "headers": {"content-type": "text/plain"}},
        {"name": "body-not-object", "server": "base", "method": "POST", "path": "/v1/chat/completions",
         "data": b"[1]", "headers": {"content-type": "application/json"}},
        post("missing-model", "/v1/completions", {"prompt": PROMPT}),
        post("unknown-model", "/v1/completions", _cmpl(model="nope")),
        post("bad-temperature", "/v1/chat/completions", _chat(temperature=3)),
        post("unsupported-field", "/v1/chat/completions", _chat(functions=[{"name": "f"}])),
        post("penalty", "/v1/completions", _cmpl(presence_penalty=0.5)),
        post("logit-bias", "/v1/completions", _cmpl(logit_bias={"5": 1.0})),
        post("echo", "/v1/completions", _cmpl(echo=True)),
        post("best-of", "/v1/completions", _cmpl(best_of=3)),
        post("too-many-stops", "/v1/completions", _cmpl(stop=[str(i) for i in range(17)])),
        post("token-out-of-range", "/v1/completions", _cmpl(prompt=[1, 999999])),
        post("prompt-too-long", "/v1/completions", _cmpl(prompt=[1] * 600)),
        post("prompt-chars", "/v1/completions", _cmpl(prompt="a" * 200_000)),
        post("bad-prompt", "/v1/completions", _cmpl(prompt=[])),
        post("n-too-large", "/v1/completions", _cmpl(n=128, prompt=["a", "b", "c"])),
        post("two-constraints", "/v1/completions", _cmpl(guided_regex="a", guided_choice=["b"])),
        post("bad-regex", "/v1/completions", _cmpl(guided_regex="(")),
        post("bad-response-format", "/v1/chat/completions", _chat(response_format={"type": "xml"})),
        post("tool-choice-no-tools", "/v1/chat/completions", _chat(tool_choice="required")),
        post("tool-choice-unknown", "/v1/chat/completions", _chat(tools=TOOLS, tool_choice={
            "type": "function", "function": {"name": "other"}})),
        post("tool-not-function", "/v1/chat/completions", _chat(tools=[{"type": "web"}])),
        post("image-part", "/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}])),
        post("client-template", "/v1/chat/completions", _chat(chat_template="{{ 1 }}")),
        post("reserved-kwargs", "/v1/chat/completions", _chat(chat_template_kwargs={"messages": []})),
        post("speculative-without-flag", "/v1/completions", _cmpl(speculative=True)),
        post("empty-messages", "/v1/chat/completions", _chat(messages=[])),
        {"name": "body-too-large", "server": "base", "method": "POST", "path": "/v1/completions",
         "data": b'{"prompt": "' + b"x" * (4 * 2 ** 20) + b'"}', "headers": {"content-type": "application/json"}},
        {"name": "host-not-loopback", "server": "base", "method": "GET", "path": "/v1/models",
         "headers": {"host": "evil.example"}},
        # access control (--api-key)
        {"name": "key-missing", "server": "keyed", "method": "GET", "path": "/v1/models"},
        {"name": "key-wrong", "server": "keyed", "method": "GET", "path": "/v1/models",
         "headers": {"authorization": "Bearer nope"}},
        {"name": "key-right", "server": "keyed", "method": "POST", "path": "/v1/completions", "body": _cmpl(),
         "headers": {"authorization": f"Bearer {API_KEY}"}},
        # a sequence that fails alone (every logit NaN): 500, or an error event in a stream
        post("nan-cmpl", "/v1/completions", _cmpl(), "nan"),
        post("nan-cmpl-stream", "/v1/completions", _cmpl(stream=True), "nan"),
        post("nan-chat", "/v1/chat/completions", _chat(), "nan"),
        post("nan-chat-stream", "/v1/chat/completions", _chat(stream=True), "nan"),
        post("nan-resp", "/v1/responses", _resp(), "nan"),
        post("nan-resp-stream", "/v1/responses", _resp(stream=True), "nan"),
        get("health-after-nan", "/health"),
        # speculative decoding (n-gram drafts of a fixed length: the same tokens as without)
        post("spec-cmpl", "/v1/completions", _cmpl(prompt="the cat and the cat and the cat and the", max_tokens=24),
             "spec"),
        post("spec-cmpl-stream", "/v1/completions", _cmpl(prompt="the cat and the cat and the cat and the",
                                                          max_tokens=24, stream=True), "spec"),
        post("spec-chat-logprobs", "/v1/chat/completions", _chat(logprobs=True, top_logprobs=1, max_tokens=10), "spec"),
        post("spec-off", "/v1/completions", _cmpl(speculative=False), "spec"),
        post("spec-sampled", "/v1/completions", _cmpl(temperature=0.8, seed=11, max_tokens=16, n=2), "spec"),
        post("spec-json", "/v1/chat/completions", _chat(response_format={"type": "json_object"}, max_tokens=20),
             "spec"),
    ]
    return out


def depends_on(ex: dict[str, Any]) -> list[str]:
    """The libraries besides infeng whose behaviour an exchange's transcript records: llguidance
    (grammar masks, tool-call grammars, its compile errors) and pydantic (its validation wording)."""
    body = ex.get("body") or {}
    grammar = any(body.get(k) is not None for k in GRAMMAR_FIELDS) or isinstance(body.get("tool_choice"), dict) \
        or body.get("tool_choice") == "required" or "text" in body
    return (["llguidance"] if grammar else []) + (["pydantic"] if ex["name"] in PYDANTIC_MESSAGES else [])


def library_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("llguidance", "pydantic")}


def normalise(text: str) -> str:
    for pattern, replacement in _NORMALISE:
        text = pattern.sub(replacement, text)
    return text


def _exchange(client: Any, ex: dict[str, Any], adapter_root: Path) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"headers": ex.get("headers", {})}
    if "body" in ex:
        kwargs["json"] = ex["body"]
    elif "data" in ex:
        kwargs["content"] = ex["data"]
    response = client.request(ex["method"], ex["path"], **kwargs)
    headers = {k: response.headers[k] for k in _HEADERS if k in response.headers}
    return {"name": ex["name"], "status": response.status_code, "headers": headers,
            "body": normalise(response.text.replace(str(adapter_root), "ADAPTERS"))}


#: The servers the exchanges name: speculation on, an API key, the artifact whose logits are NaN.
_VARIANTS: dict[str, dict[str, Any]] = {"base": {}, "spec": {"speculative": "ngram:4:fixed"},
                                        "keyed": {"api_key": API_KEY}, "nan": {"nonfinite": True}}


@contextmanager
def _served(artifacts: dict[str, Path], adapter_dirs: dict[str, Path], variant: str) -> Iterator[Any]:
    from fastapi.testclient import TestClient

    from infeng_runtime.server import ServeOptions, build_server
    from infeng_runtime.spec import parse_speculative

    settings = _VARIANTS[variant]
    nonfinite = settings.get("nonfinite", False)
    options = ServeOptions(threads=1, max_seqs=8, max_context=512, served_model_name="stories",
                           adapters={} if nonfinite else {"a1": adapter_dirs["a1"], "a2": adapter_dirs["a2"]},
                           adapter_roots=[adapter_dirs["a1"].parent], api_key=settings.get("api_key"),
                           speculative=parse_speculative(settings.get("speculative")), log_level="warning")
    server = build_server(artifacts["nonfinite" if nonfinite else "served"], options)
    with TestClient(server.app, base_url=BASE_URL) as client:
        yield client


def _offline(artifact: Path, adapter_dirs: dict[str, Path]) -> list[dict[str, Any]]:
    """The offline ``LLM`` API (``infeng run``'s path): texts, finish reasons and token counts."""
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams

    llm = LLM(artifact, threads=1, max_seqs=4, adapters={"a1": adapter_dirs["a1"]})
    try:
        params = [SamplingParams(max_new_tokens=12, temperature=0.0),
                  SamplingParams(max_new_tokens=24, temperature=0.0, stop=("the",)),
                  SamplingParams(max_new_tokens=12, temperature=0.9, seed=5)]
        out = [{"name": f"llm-generate-{i}", "body": normalise(json.dumps(
            {"text": c.text, "finish_reason": c.finish_reason, "tokens": len(c.token_ids)}))}
            for i, c in enumerate(llm.generate([PROMPT] * len(params), params))]
        logprobs = llm.generate([PROMPT], SamplingParams(max_new_tokens=4, temperature=0.0), adapter="a1",
                                logprobs=2)[0]
        out.append({"name": "llm-logprobs-adapter", "body": json.dumps(
            {"text": logprobs.text, "entries": [[e.text, e.logprob, e.offset, e.top] for e in logprobs.logprobs]})})
        pieces = list(llm.stream(PROMPT, SamplingParams(max_new_tokens=12, temperature=0.0)))
        out.append({"name": "llm-stream", "body": json.dumps(pieces)})
        return out
    finally:
        llm.close()


def transcripts(artifacts: dict[str, Path], adapter_dirs: dict[str, Path]) -> list[dict[str, Any]]:
    """Every exchange of ``exchanges`` on its server, in order, then the offline API's outputs.
    ``artifacts``: ``served`` (``_serving.served_artifact``) and ``nonfinite``."""
    todo = exchanges(adapter_dirs["a1"].parent)
    out = []
    with ExitStack() as stack:
        clients: dict[str, Any] = {}
        for ex in todo:
            if ex["server"] not in clients:
                clients[ex["server"]] = stack.enter_context(_served(artifacts, adapter_dirs, ex["server"]))
            out.append(_exchange(clients[ex["server"]], ex, adapter_dirs["a1"].parent))
    return out + _offline(artifacts["served"], adapter_dirs)


def main() -> None:
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _serving import adapters, nonfinite_artifact, served_artifact

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        artifacts = {"served": served_artifact(root / "artifact"), "nonfinite": nonfinite_artifact(root / "artifact")}
        recorded = transcripts(artifacts, adapters(root / "adapters"))
    TRANSCRIPTS.parent.mkdir(exist_ok=True)
    TRANSCRIPTS.write_text(json.dumps(recorded, indent=1, ensure_ascii=False) + "\n")
    VERSIONS.write_text(json.dumps(library_versions(), indent=1) + "\n")
    print(f"{len(recorded)} transcripts -> {TRANSCRIPTS}")


if __name__ == "__main__":
    main()
