"""``/v1/responses`` (OpenAI's Responses API) on a real ``infeng serve`` of SmolLM2-135M-Instruct,
driven by the official ``openai`` client: text in and out (a string and a list of input items,
``instructions``), streamed events that reassemble to the non-streamed response, a tool round trip
(a ``function_call`` output item, then a ``function_call_output`` input item), ``text.format``
json_schema validated with jsonschema, usage, and a 400 naming each unsupported field.
"""
from __future__ import annotations

import json

import httpx
import pytest
from _serving import nonfinite_artifact, running_server, sse_lines

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("infeng_compiler.frontends.gguf")

from infeng_runtime.api_errors import APIError
from infeng_runtime.api.responses import chat_messages, chat_tools, response_format

MODEL = "smollm2"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                         "required": ["city"], "additionalProperties": False}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _streamed(client, **kwargs) -> tuple[list[str], object]:
    """The event types of a streamed response and the response of its last event."""
    types, final = [], None
    for event in client.responses.create(**kwargs, stream=True):
        types.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    return types, final


def test_text_in_and_out(client):
    kwargs = {"model": MODEL, "instructions": "Answer in one short sentence.",
              "input": "What is the capital of France?", "max_output_tokens": 40, "temperature": 0}
    done = client.responses.create(**kwargs)
    assert done.object == "response" and done.status in ("completed", "incomplete")
    assert done.output_text and done.output[0].type == "message"
    assert done.usage.input_tokens > 0 and 0 < done.usage.output_tokens <= 40
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    # the same conversation as input items gives the same text; so does the stream
    items = [{"role": "developer", "content": "Answer in one short sentence."},
             {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                               "text": "What is the capital of France?"}]}]
    assert client.responses.create(model=MODEL, input=items, max_output_tokens=40, temperature=0).output_text == \
        done.output_text
    types, final = _streamed(client, **kwargs)
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert "response.output_text.delta" in types and types[-1] == f"response.{done.status}"
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert final.output_text == done.output_text and final.usage.output_tokens == done.usage.output_tokens
    with client.responses.stream(**kwargs) as stream:            # the SDK's own accumulator agrees
        assert stream.get_final_response().output_text == done.output_text


def test_max_output_tokens_is_incomplete(client):
    done = client.responses.create(model=MODEL, input="Tell me a long story about a dragon.", max_output_tokens=5,
                                   temperature=0)
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    assert done.usage.output_tokens == 5


def test_json_schema_format(client):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}}
    for temperature in (0, 1.0):
        done = client.responses.create(model=MODEL, input="Give me an example person as JSON.", text=fmt,
                                       max_output_tokens=60, temperature=temperature)
        jsonschema.validate(json.loads(done.output_text), SCHEMA)
    _, final = _streamed(client, model=MODEL, input="Give me an example person as JSON.", text=fmt,
                         max_output_tokens=60, temperature=0)
    jsonschema.validate(json.loads(final.output_text), SCHEMA)
    obj = client.responses.create(model=MODEL, input="Describe a cat as JSON.", text={"format": {"type": "json_object"}},
                                  max_output_tokens=60, temperature=0)
    assert obj.output_text.startswith("{")          # a free JSON object may outrun max_output_tokens
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


@pytest.mark.parametrize("tool_choice", ["required", "named", "auto"])
def test_tool_round_trip(client, tool_choice):
    choice = {"type": "function", "name": "get_weather"} if tool_choice == "named" else tool_choice
    question = [{"role": "user", "content": "What is the weather like in Paris?"}]
    kwargs = {"model": MODEL, "input": question, "tools": TOOLS, "tool_choice": choice, "max_output_tokens": 80,
              "temperature": 0}
    done = client.responses.create(**kwargs)
    calls = [o for o in done.output if o.type == "function_call"]
    if tool_choice == "auto" and not calls:          # the model may answer in text: then so must the stream
        _, final = _streamed(client, **kwargs)
        assert done.output_text and final.output_text == done.output_text
        return
    assert calls and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, TOOLS[0]["parameters"])
    # streamed: each call's argument deltas add up to that call of the non-streamed answer (the model
    # may make more than one call: it did, twice the same, on an AVX2 build)
    deltas, done_args, types = {}, {}, []
    for event in client.responses.create(**kwargs, stream=True):
        types.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            deltas[event.item_id] = deltas.get(event.item_id, "") + event.delta
        elif event.type == "response.function_call_arguments.done":
            done_args[event.item_id] = event.arguments
    assert list(deltas) == list(done_args)
    assert [json.loads(d) for d in deltas.values()] == [json.loads(d) for d in done_args.values()] \
        == [json.loads(c.arguments) for c in calls]
    assert types.index("response.output_item.added") < types.index("response.function_call_arguments.delta")
    # the call and its output go back as input items; the answer is text
    history = question + [{"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
                           "arguments": calls[0].arguments},
                          {"type": "function_call_output", "call_id": calls[0].call_id,
                           "output": json.dumps({"city": args["city"], "celsius": 21, "sky": "sunny"})}]
    final = client.responses.create(model=MODEL, input=history, tools=TOOLS, tool_choice="none",
                                    max_output_tokens=40, temperature=0)
    assert final.output_text and not [o for o in final.output if o.type == "function_call"]


@pytest.mark.parametrize("field,value", [
    ("previous_response_id", "resp_123"), ("background", True), ("store", True), ("conversation", "conv_1"),
    ("include", ["message.output_text.logprobs"]), ("reasoning", {"effort": "low"}), ("truncation", "auto")])
def test_unsupported_fields_are_400(server, field, value):
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "hi", field: value}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens")])
def test_bad_requests_are_400(server, body, param):
    r = httpx.post(f"{server}/v1/responses", json={"model": MODEL, "input": "hi", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_input_items_become_chat_messages():
    """Unit: the conversion the endpoint starts with."""
    messages = chat_messages("Be brief.", [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": "{\"city\": \"Bergen\"}"},
        {"type": "function_call_output", "call_id": "c1", "output": "3 C"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "5 C"}]}])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    assert messages[2]["content"] == "Let me look." and [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"]
    assert messages[4] == {"role": "tool", "tool_call_id": "c2", "content": "5 C"}
    assert chat_tools(TOOLS)[0]["function"]["name"] == "get_weather"
    assert response_format({"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}})["json_schema"][
        "schema"] == SCHEMA
    with pytest.raises(APIError):
        chat_messages(None, [{"type": "reasoning", "summary": []}])


def test_a_failed_sequence_is_an_error_not_a_response(tmp_path_factory):
    """stories260K with NaN logits: 500 with OpenAI's error body; streamed, ``error`` then
    ``response.failed`` (no ``response.completed``)."""
    artifact = nonfinite_artifact(tmp_path_factory.mktemp("responses-nan"))
    with running_server(artifact, "--served-model-name", "nan", log=tmp_path_factory.mktemp("log") / "s.log") as url:
        r = httpx.post(f"{url}/v1/responses", json={"model": "nan", "input": "hi", "max_output_tokens": 3},
                       timeout=30)
        assert r.status_code == 500 and "non-finite" in r.json()["error"]["message"]
        with httpx.stream("POST", f"{url}/v1/responses", json={"model": "nan", "input": "hi", "stream": True},
                          timeout=30) as r:
            events = [json.loads(line[6:]) for line in sse_lines(r) if line.startswith("data: ")]
        assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error",
                                               "response.failed"]
        assert "non-finite" in events[2]["message"] and events[3]["response"]["status"] == "failed"
        assert [e["sequence_number"] for e in events] == list(range(4))
