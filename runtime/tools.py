"""Tool calling: tools into the prompt, tool calls out of the generated text.

Into the prompt: a chat template that knows tools (it reads the ``tools`` variable) gets them as
transformers passes them; for one that does not (SmolLM2's, the Llama-2 style ones) the tools are
described in a system message in the Hermes format (``<tools>`` JSON signatures, calls answered as
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), and earlier assistant tool calls and
``tool`` results are written into the messages' text in that same format.

Out of the text, for ``tool_choice: auto``: Hermes/Qwen ``<tool_call>`` blocks, or a Llama-3 style
JSON call (the whole answer is ``{"name": ..., "parameters": ...}``, optionally after
``<|python_tag|>``, several separated by ``;``). ``required`` and a named function are enforced by a
grammar instead (structured.tool_call_grammar), and their text is JSON: an array of
``{"name", "parameters"}`` calls, or the named function's arguments.

``ToolStream`` does the same parsing incrementally for streams: content text is released as it
comes (holding back what could be the start of ``<tool_call>``) and each call once it is complete.

Every JSON text here (the model's calls, a request's call arguments) goes through
``json_body.loads``: strict JSON of bounded depth, so a call nested too deeply, or with ``NaN`` or
a lone surrogate in it, is not a call (its text stays content), never an error of the request.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .json_body import loads

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

HERMES_SYSTEM = (
    "You may call functions. Their signatures are in <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object in <tool_call></tool_call> tags:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-dict>}}\n</tool_call>")


@dataclass
class ToolCall:
    name: str
    arguments: str                                  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def template_knows_tools(source: Any) -> bool:
    """Whether a chat template renders the ``tools`` variable itself."""
    if isinstance(source, list):
        source = " ".join(t.get("template", "") for t in source if isinstance(t, dict))
    return isinstance(source, str) and "tools" in source


def arguments_object(arguments: Any) -> Any:
    """A call's arguments as a template wants them: JSON text parsed (transformers' convention)."""
    if isinstance(arguments, str):
        try:
            return loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _call_json(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"name": fn.get("name"), "arguments": arguments_object(fn.get("arguments", {}))}


def hermes_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` for a template that does not know tools: the tools in a system message (merged
    into the first one if there is one), assistant tool calls and tool results as Hermes text."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"{TOOL_CALL_OPEN}\n{json.dumps(_call_json(c), ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"
                              for c in m["tool_calls"])
            m["content"] = (m.get("content") or "") + ("\n" if m.get("content") else "") + calls
            del m["tool_calls"]
        elif m.get("role") == "tool":
            m["content"] = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
        out.append(m)
    if tools:
        signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = HERMES_SYSTEM.format(tools=signatures)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _call_from(obj: Any) -> ToolCall | None:
    """A call from ``{"name": ..., "arguments"|"parameters": ...}``; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):                       # already JSON text
        try:
            loads(args)
        except ValueError:
            return None
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_calls(text: str) -> list[ToolCall] | None:
    """Llama-3 style: the whole text is one JSON call (or a list of them, or several joined by ';')."""
    text = text.strip()
    if text.startswith(PYTHON_TAG):
        text = text[len(PYTHON_TAG):].strip()
    if not text.startswith(("{", "[")):
        return None
    pieces = [text]
    try:
        values = [loads(text)]
    except ValueError:
        pieces = [p for p in text.split(";") if p.strip()]
        try:
            values = [loads(p) for p in pieces]
        except ValueError:
            return None
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_call_from(v) for v in flat]
    return calls if calls and all(calls) else None


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a ``tool_choice: auto`` answer; content is None when only calls remain."""
    if TOOL_CALL_OPEN in text:
        content, calls, rest = [], [], text
        while TOOL_CALL_OPEN in rest:
            before, _, after = rest.partition(TOOL_CALL_OPEN)
            content.append(before)
            body, closed, rest = after.partition(TOOL_CALL_CLOSE)
            call = None
            try:
                call = _call_from(loads(body))
            except ValueError:
                pass
            if call is None:                          # not a call after all: keep it as text
                content.append(TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else ""))
            else:
                calls.append(call)
        content.append(rest)
        joined = "".join(content).strip()
        return (joined or None) if calls else text, calls
    calls = _json_calls(text)
    if calls:
        return None, calls
    return text, []


def parse_forced(text: str, named: str | None) -> list[ToolCall]:
    """The calls of a grammar-forced answer: the named function's arguments, or the ``required``
    array of ``{"name", "parameters"}``. Text cut short (max_tokens) gives what parses."""
    if named is not None:
        return [ToolCall(named, text.strip())]
    try:
        values = loads(text)
    except ValueError:
        return []
    return [c for c in (_call_from(v) for v in (values if isinstance(values, list) else [values])) if c]


class ToolStream:
    """Incremental ``parse_tool_calls`` for one streamed choice. ``push(text)`` and ``finish()``
    return events: ``("content", text)`` and ``("call", ToolCall)``."""

    def __init__(self, named: str | None = None, forced: bool = False):
        self.named, self.forced = named, forced
        self.buffer = ""
        self.in_call = False
        self.maybe_json: bool | None = None            # undecided until the first non-space text
        self.calls: list[ToolCall] = []
        self.named_call: ToolCall | None = None

    def push(self, text: str) -> list[tuple[str, Any]]:
        if self.named is not None:                       # the arguments stream as they come
            events: list[tuple[str, Any]] = []
            if self.named_call is None:
                self.named_call = ToolCall(self.named, "")
                self.calls.append(self.named_call)
                events.append(("call_start", self.named_call))
            if text:
                self.named_call.arguments += text
                events.append(("arguments", text))
            return events
        self.buffer += text
        if self.forced:
            return []
        if self.maybe_json is None:
            head = self.buffer.lstrip()
            if not head:
                return []
            if len(head) < len(PYTHON_TAG) and PYTHON_TAG.startswith(head):
                return []                                # "<|pyth..." or "<tool_ca...": not decided yet
            self.maybe_json = head.startswith(("{", "[", PYTHON_TAG))
        if self.maybe_json:                              # a Llama-3 JSON call: decided at the end
            return []
        return self._scan(final=False)

    def _scan(self, final: bool) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        while True:
            if self.in_call:
                body, closed, rest = self.buffer.partition(TOOL_CALL_CLOSE)
                if not closed and not final:
                    return events
                call = None
                try:
                    call = _call_from(loads(body))
                except ValueError:
                    pass
                if call is None:
                    events.append(("content", TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else "")))
                else:
                    self.calls.append(call)
                    events.append(("call", call))
                self.buffer, self.in_call = rest, False
                if not closed:
                    return events
                continue
            at = self.buffer.find(TOOL_CALL_OPEN)
            if at >= 0:
                if at:
                    events.append(("content", self.buffer[:at]))
                self.buffer, self.in_call = self.buffer[at + len(TOOL_CALL_OPEN):], True
                continue
            keep = 0 if final else _prefix_len(self.buffer, TOOL_CALL_OPEN)
            ready = self.buffer[:len(self.buffer) - keep]
            if ready:
                events.append(("content", ready))
            self.buffer = self.buffer[len(ready):]
            return events

    def finish(self) -> list[tuple[str, Any]]:
        if self.named is not None:
            return [] if self.named_call is not None else self.push("")
        if self.forced:
            calls = parse_forced(self.buffer, None)
            self.calls.extend(calls)
            return [("call", c) for c in calls]
        if self.maybe_json:
            content, calls = parse_tool_calls(self.buffer)
            self.calls.extend(calls)
            return [("call", c) for c in calls] if calls else [("content", self.buffer)]
        if self.maybe_json is None and self.buffer:      # ended while undecided: plain text and tags
            self.maybe_json = False
        return [e for e in self._scan(final=True) if e[0] != "content" or e[1]]


def _prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
