"""``POST /v1/responses``: OpenAI's Responses API over the chat path (docs/serving.md).

A request is turned into a chat request (``ChatBody``) and goes through the chat path's pieces:
``chat.prepare`` (chat template, tools, grammars), ``RequestCore.submit``/``events`` (the engine
loop), ``chat.assistant_message`` and ``ToolStream`` (tool calls out of the text). What differs is the shape:

- in: ``input`` (a string, or a list of items: messages with ``input_text``/``output_text`` parts,
  ``function_call`` items of earlier turns and ``function_call_output`` results), ``instructions``
  (a system message first), ``max_output_tokens``, function tools in the flat Responses shape,
  ``text.format`` (``json_schema`` or ``json_object``, the chat path's ``response_format``);
- out: a ``response`` object whose ``output`` holds a ``message`` item (``output_text`` content)
  and/or ``function_call`` items, ``usage`` as ``input_tokens``/``output_tokens``; streamed as the
  Responses events (``response.created`` ... ``response.completed``).

Responses are not stored: ``store: true``, ``previous_response_id``, ``conversation`` and
``background`` get a 400 naming the field, as do built-in tools and the other fields this server
does not implement.
"""
from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request as HTTPRequest
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ..api_errors import APIError
from ..detokenize import ChoiceText
from ..sampling import SEED_BOUND
from ..tools import ToolCall, ToolStream
from .bodies import MAX_TOOLS, PRIORITY_BOUND, ChatBody, validated
from .chat import assistant_message, prepare
from .core import RequestCore, post_routes

#: Input part types that carry text (``output_text``: an assistant turn given back as input).
TEXT_PARTS = ("input_text", "output_text", "text")
#: Fields this server does not implement, and the values of them that ask for nothing: any other
#: value is a 400 naming the field.
UNSUPPORTED = {"previous_response_id": (None,), "conversation": (None,), "background": (None, False),
               "store": (None, False), "include": (None, []), "reasoning": (None,), "prompt": (None,),
               "truncation": (None, "disabled"), "max_tool_calls": (None,), "top_logprobs": (None, 0),
               "service_tier": (None, "auto", "default")}
WHY = {"previous_response_id": "responses are not stored on this server; send the whole conversation as input",
       "conversation": "conversations are not stored on this server; send the whole conversation as input",
       "store": "responses are not stored on this server (store: false)",
       "background": "background responses are not supported"}


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="allow")        # checked against UNSUPPORTED; the rest is ignored

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # extensions the chat path has too (as vLLM names them)
    seed: int | None = Field(None, ge=0, lt=SEED_BOUND)
    top_k: int = Field(0, ge=0)
    priority: int = Field(0, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)
    speculative: StrictBool | None = None


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _check_unsupported(body: ResponsesBody) -> None:
    extra = body.model_extra or {}
    for name, harmless in UNSUPPORTED.items():
        if name in extra and extra[name] not in harmless:
            raise _bad(WHY.get(name, f"{name} is not supported by this server"), name)


def _content_text(content: Any, param: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad("content must be a string or a list of input_text parts", param)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise _bad(f"{kind!r} content parts are not supported (input_text, output_text)", f"{param}.{j}.type")
        if not isinstance(part.get("text"), str):
            raise _bad("a text part's text must be a string", f"{param}.{j}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def chat_messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as chat messages: function calls of earlier turns become an
    assistant message's ``tool_calls`` (joined to the assistant text before them), their outputs
    ``tool`` messages, the ``developer`` role the ``system`` one."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    for i, item in enumerate(items):
        param = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad("a message's role is user, assistant, system or developer", f"{param}.role")
            text = _content_text(item.get("content"), f"{param}.content")
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise _bad(f"a function_call item needs {key} (a string)", f"{param}.{key}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad("a function_call_output item needs call_id (a string)", f"{param}.call_id")
            output = item.get("output")
            text = output if isinstance(output, str) else _content_text(output, f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        else:
            raise _bad(f"input items of type {kind!r} are not supported (message, function_call, "
                       f"function_call_output)", f"{param}.type")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools from the Responses shape (``{"type": "function", "name", "parameters"}``) to
    the chat one; a built-in tool (web_search, file_search, ...) is a 400 naming it."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind != "function":
            raise _bad(f"tools of type {kind!r} are not supported (function tools only)", f"tools.{i}.type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _bad("a function tool needs a name", f"tools.{i}.name")
        fn = {"name": tool["name"], "parameters": tool.get("parameters")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("tool_choice is none, auto, required or {\"type\": \"function\", \"name\": ...}", "tool_choice")


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as the chat path's ``response_format``."""
    if not text:
        return None
    for key, value in text.items():
        if key != "format" and value is not None:
            raise _bad(f"text.{key} is not supported (text.format only)", f"text.{key}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise _bad("text.format must be an object", "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("a json_schema format needs a schema (a JSON object)", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"), "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    raise _bad(f"text.format type {kind!r} is not supported (text, json_object, json_schema)", "text.format.type")


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if text else []}


def _call_item(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments if arguments is None else arguments, "status": status}


@dataclass
class _EventWriter:
    """The SSE events of one streamed response: numbered, with the output items they open and close."""

    sequence: itertools.count = field(default_factory=itertools.count)
    output: list[dict[str, Any]] = field(default_factory=list)     # finished items, in order
    message_id: str | None = None                                  # the open message item, if any
    message_text: str = ""
    open_call: tuple[str, ToolCall] | None = None                  # the named call streaming its arguments
    prefix: str = ""

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": next(self.sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    def _item_id(self, kind: str) -> str:
        return f"{kind}_{self.prefix}_{len(self.output)}"

    def text(self, delta: str) -> list[str]:
        events = []
        if self.message_id is None:
            self.message_id = self._item_id("msg")
            index = len(self.output)
            events.append(self.event("response.output_item.added", output_index=index,
                                     item=_message_item(self.message_id, "", "in_progress")))
            events.append(self.event("response.content_part.added", item_id=self.message_id, output_index=index,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self.message_text += delta
        events.append(self.event("response.output_text.delta", item_id=self.message_id, output_index=len(self.output),
                                 content_index=0, delta=delta, logprobs=[]))
        return events

    def close_message(self) -> list[str]:
        if self.message_id is None:
            return []
        item_id, text, index = self.message_id, self.message_text, len(self.output)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = _message_item(item_id, text, "completed")
        self.output.append(item)
        self.message_id, self.message_text = None, ""
        return [self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=[]),
                self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def call_start(self, call: ToolCall) -> list[str]:
        events = self.close_message()
        item_id = self._item_id("fc")
        self.open_call = (item_id, call)
        events.append(self.event("response.output_item.added", output_index=len(self.output),
                                 item=_call_item(item_id, call, "in_progress", "")))
        return events

    def arguments(self, delta: str) -> list[str]:
        item_id, _ = self.open_call
        return [self.event("response.function_call_arguments.delta", item_id=item_id, output_index=len(self.output),
                           delta=delta)]

    def close_call(self) -> list[str]:
        if self.open_call is None:
            return []
        (item_id, call), index = self.open_call, len(self.output)
        item = _call_item(item_id, call, "completed")
        self.output.append(item)
        self.open_call = None
        return [self.event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                           arguments=call.arguments),
                self.event("response.output_item.done", output_index=index, item=item)]

    def call(self, call: ToolCall) -> list[str]:
        """A call parsed whole: added, its arguments in one delta, done."""
        return [*self.call_start(call), *self.arguments(call.arguments), *self.close_call()]

    def close(self) -> list[str]:
        return [*self.close_message(), *self.close_call()]


def router(core: RequestCore) -> APIRouter:
    responses_api = ResponsesAPI(core)
    return post_routes(core, {"/v1/responses": lambda _, http: responses_api.create(http)})


class ResponsesAPI:
    """``POST /v1/responses`` over one ``RequestCore``."""

    def __init__(self, core: RequestCore):
        self.core = core

    def _chat_body(self, body: ResponsesBody) -> ChatBody:
        fields: dict[str, Any] = {
            "model": body.model, "messages": chat_messages(body.instructions, body.input),
            "max_tokens": body.max_output_tokens, "tools": chat_tools(body.tools),
            "tool_choice": chat_tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": response_format(body.text), "stream": body.stream, "seed": body.seed,
            "top_k": body.top_k, "priority": body.priority, "speculative": body.speculative}
        if body.temperature is not None:
            fields["temperature"] = body.temperature
        if body.top_p is not None:
            fields["top_p"] = body.top_p
        if not fields["messages"]:
            raise _bad("input has no messages", "input")
        return validated(ChatBody, fields)

    def _response(self, body: ResponsesBody, response_id: str, created: float, status: str,
                  output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": response_id, "object": "response", "created_at": created, "status": status,
                "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "model": body.model, "output": output,
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "temperature": body.temperature if body.temperature is not None else 1.0,
                "top_p": body.top_p if body.top_p is not None else 1.0,
                "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
                "tools": body.tools or [], "text": body.text or {"format": {"type": "text"}},
                "usage": usage, "metadata": body.metadata or {}, "store": False, "background": False,
                "previous_response_id": None, "truncation": "disabled", "user": body.user}

    @staticmethod
    def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
        return {"input_tokens": chat_usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": chat_usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": chat_usage["total_tokens"]}

    async def create(self, http: HTTPRequest):
        core = self.core
        record, body, adapter = await core.begin(http, ResponsesBody)
        _check_unsupported(body)
        chat = self._chat_body(body)
        ids, params, grammars, mode, named = await prepare(core, chat)
        response_id = f"resp_{record.request_id}"
        pending = core.submit([ids], [params], 1, adapter, body.priority, None, response_id, grammars)
        texts = [ChoiceText(core.tokenizer, ids, params.stop)]
        created = time.time()
        single_call = body.parallel_tool_calls is False
        if body.stream:
            return core.streaming(self._stream(body, response_id, created, pending, texts, record, mode, named,
                                               single_call), pending, texts, record)
        left = await core.finished(pending, texts, http, record)
        if left is not None:
            return left
        message, reason = assistant_message(core, texts[0], mode, named, single_call)
        output = []
        if message.get("content"):
            output.append(_message_item(f"msg_{record.request_id}_0", message["content"], "completed"))
        for call in message.get("tool_calls", ()):
            fn = call["function"]
            output.append(_call_item(f"fc_{record.request_id}_{len(output)}",
                                     ToolCall(fn["name"], fn["arguments"], call["id"]), "completed"))
        status = "incomplete" if reason == "length" else "completed"
        return self._response(body, response_id, created, status, output,
                              self._usage(core.usage(pending, texts)))

    async def _stream(self, body: ResponsesBody, response_id: str, created: float, pending, texts: list[ChoiceText],
                      record, mode: str, named: str | None, single_call: bool) -> AsyncIterator[str]:
        core = self.core
        out = _EventWriter(prefix=record.request_id)
        yield out.event("response.created", response=self._response(body, response_id, created, "in_progress", []))
        yield out.event("response.in_progress", response=self._response(body, response_id, created, "in_progress",
                                                                         []))
        tools = ToolStream(named, forced=mode == "required") if mode != "none" else None
        calls = 0
        async for batch in core.events(pending, texts, None, record):
            for _, delta in batch:
                failure = core.failure(delta.finish_reason, delta.error)
                if failure is not None:
                    record.error = failure.message
                    error = {"code": failure.code or failure.type, "message": failure.message}
                    yield out.event("error", code=error["code"], message=failure.message, param=None)
                    yield out.event("response.failed", response=self._response(
                        body, response_id, created, "failed", out.output, error=error))
                    return
                if tools is None:
                    events = [("content", delta.text)] if delta.text else []
                else:
                    events = tools.push(delta.text) if delta.text else []
                    if delta.finish_reason:
                        events += tools.finish()
                for kind, value in events:
                    if kind == "content":
                        if value:
                            for e in out.text(value):
                                yield e
                        continue
                    if single_call and kind != "arguments" and calls:
                        continue
                    if kind == "call_start":
                        calls += 1
                        chunk = out.call_start(value)
                    elif kind == "arguments":
                        chunk = out.arguments(value) if out.open_call is not None else []
                    else:
                        calls += 1
                        chunk = out.call(value)
                    for e in chunk:
                        yield e
        for e in out.close():
            yield e
        status = "incomplete" if texts[0].finish_reason == "length" else "completed"
        yield out.event(f"response.{status}", response=self._response(
            body, response_id, created, status, out.output, self._usage(core.usage(pending, texts))))
