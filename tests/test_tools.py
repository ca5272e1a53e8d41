"""Structured outputs and tool calling on a real instruct model: SmolLM2-135M-Instruct (ChatML
template without a ``tools`` section, so tools reach it as a Hermes system message) behind
``infeng serve``, driven by the official ``openai`` client: ``chat.completions.parse`` with pydantic
models of different shapes (validated with jsonschema against the model's own schema), streamed
and not, and a tool-call round trip (call, tool result, answer) for ``tool_choice`` auto, required
and a named function, whose streamed deltas reassemble to the non-streamed call.
"""
from __future__ import annotations

import json
from enum import Enum
from typing import Literal

import pytest


openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance")
pytest.importorskip("infeng_compiler.frontends.gguf")

from pydantic import BaseModel, Field, conint, conlist, constr  # noqa: E402

MODEL = "smollm2"
Short = constr(max_length=16)


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: Short
    age: conint(ge=0, le=120)


class City(BaseModel):
    city: Short
    country: Short
    population_millions: conint(ge=0, le=40)


class Flag(BaseModel):
    ok: bool


class Pick(BaseModel):
    color: Color


class Tags(BaseModel):
    tags: conlist(Short, min_length=1, max_length=3)


class Point(BaseModel):
    x: conint(ge=-10, le=10)
    y: conint(ge=-10, le=10)


class Line(BaseModel):
    start: Point
    end: Point


class Book(BaseModel):
    title: Short
    year: conint(ge=1800, le=2030)
    genre: Literal["fiction", "science", "history"]


class Shelf(BaseModel):
    books: conlist(Book, min_length=1, max_length=2)


class Score(BaseModel):
    score: float = Field(ge=0, le=1)


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    confidence: conint(ge=0, le=100)


class Address(BaseModel):
    street: Short
    number: conint(ge=1, le=999)


class Customer(BaseModel):
    name: Short
    address: Address
    vip: bool


class Matrix(BaseModel):
    rows: conlist(conlist(conint(ge=0, le=9), min_length=2, max_length=2), min_length=2, max_length=2)


class Step(BaseModel):
    action: Literal["walk", "run", "stop"]
    seconds: conint(ge=1, le=60)


class Plan(BaseModel):
    steps: conlist(Step, min_length=1, max_length=3)


class Weather(BaseModel):
    city: Short
    celsius: conint(ge=-50, le=60)
    sky: Literal["sunny", "cloudy", "rainy"]


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    name: Short
    legs: conint(ge=0, le=4)


class Owner(BaseModel):
    owner: Short
    pet: Pet


class Sentiment(BaseModel):
    label: Literal["positive", "negative", "neutral"]


class Range(BaseModel):
    low: float = Field(ge=-100, le=100)
    high: float = Field(ge=-100, le=100)


class Inventory(BaseModel):
    item: Short
    counts: conlist(conint(ge=0, le=1000), min_length=1, max_length=3)


class Translation(BaseModel):
    source: Short
    target: Short
    language: Literal["fr", "de", "es"]


SCHEMAS = [Person, City, Flag, Pick, Tags, Line, Shelf, Score, Answer, Customer, Matrix, Plan, Weather, Owner,
           Sentiment, Range, Inventory, Translation, Point, Book]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.parametrize("schema", SCHEMAS, ids=[s.__name__ for s in SCHEMAS])
def test_parse_pydantic_models(client, schema):
    messages = [{"role": "user", "content": f"Give me an example {schema.__name__} as JSON."}]
    done = client.chat.completions.parse(model=MODEL, messages=messages, response_format=schema, max_tokens=200,
                                         temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, schema)
    jsonschema.validate(json.loads(choice.message.content), schema.model_json_schema())
    with client.chat.completions.stream(model=MODEL, messages=messages, response_format=schema, max_tokens=200,
                                        temperature=0) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == choice.message.content
    assert final.choices[0].message.parsed == choice.message.parsed


def _streamed_calls(client, **kwargs) -> tuple[list[dict], str, str]:
    """Tool calls reassembled from a stream's deltas, as a client does; content; finish reason."""
    calls: dict[int, dict] = {}
    content, reason = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        reason = chunk.choices[0].finish_reason or reason
    return [calls[i] for i in sorted(calls)], content, reason


@pytest.mark.parametrize("tool_choice", ["required", "named", "auto"])
def test_tool_call_round_trip(client, tool_choice):
    choice = {"type": "function", "function": {"name": "get_weather"}} if tool_choice == "named" else tool_choice
    kwargs = dict(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice=choice, max_tokens=120, temperature=0)
    first = client.chat.completions.create(**kwargs).choices[0]
    streamed, streamed_content, streamed_reason = _streamed_calls(client, **kwargs)
    calls = first.message.tool_calls or []
    if tool_choice == "auto" and not calls:         # the model may answer in text: then so must the stream
        assert streamed == [] and streamed_content.strip() == (first.message.content or "").strip()
        return
    assert calls and first.message.content is None
    assert first.finish_reason == ("stop" if tool_choice == "named" else "tool_calls") == streamed_reason
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in calls]
    call = calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": args["city"], "celsius": 21,
                                                                          "sky": "sunny"})}]
    final = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           max_tokens=60, temperature=0).choices[0]
    assert final.message.content and not final.message.tool_calls
