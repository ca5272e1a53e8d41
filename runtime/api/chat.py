"""``POST /v1/chat/completions``: messages rendered with the chat template, tools (auto, required,
named; parsed out of the text, streamed as tool-call deltas), streamed or not. ``prepare`` is the
chat request made ready to submit, which the Responses API (responses.py) shares."""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request as HTTPRequest

from ..api_errors import APIError
from ..detokenize import ChoiceText
from ..sampling import SamplingParams
from ..structured import tool_call_grammar
from ..tools import ToolCall, ToolStream, parse_forced, parse_tool_calls
from .bodies import TOOL_CHOICES, ChatBody, check_unsupported, grammar_spec, sampling_params
from .core import RequestCore, post_routes, sse
from .prompts import prompt_ids, template_args


def router(core: RequestCore) -> APIRouter:
    return post_routes(core, {"/v1/chat/completions": create})


async def create(core: RequestCore, http: HTTPRequest):
    record, body, adapter = await core.begin(http, ChatBody)
    core.check_sequences(body.n)
    check_unsupported(body)
    ids, params, grammars, mode, named = await prepare(core, body)
    k = (body.top_logprobs or 0) if body.logprobs else None
    rid = f"chatcmpl-{record.request_id}"
    pending = core.submit([ids], [params], body.n, adapter, body.priority, k, rid, grammars)
    texts = [ChoiceText(core.tokenizer, ids, params.stop, body.logprobs) for _ in range(body.n)]
    base = {"id": rid, "object": "chat.completion.chunk" if body.stream else "chat.completion",
            "created": int(time.time()), "model": body.model}
    single_call = body.parallel_tool_calls is False
    if body.stream:
        streams = [ToolStream(named, forced=mode == "required") if mode != "none" else None for _ in range(body.n)]

        def render(c: int, delta) -> list[str]:
            lp = {"content": chat_logprobs(core, delta.logprobs)} if body.logprobs else None
            stream = streams[c]
            if stream is None:
                deltas = [{"content": delta.text}] if delta.text else []
            else:
                events = stream.push(delta.text) if delta.text else []
                if delta.finish_reason:
                    events += stream.finish()
                deltas = tool_deltas(stream, events, single_call)
            if lp is not None and delta.logprobs and not deltas:
                deltas = [{}]
            chunks = []
            for d in deltas:
                chunks.append(sse({**base, "choices": [{"index": c, "delta": d, "logprobs": lp,
                                                        "finish_reason": None}]}))
                lp = None
            if delta.finish_reason:
                reason = core.finish_reason(texts[c])
                if stream is not None and stream.calls and reason == "stop" and mode != "named":
                    reason = "tool_calls"
                chunks.append(sse({**base, "choices": [{"index": c, "delta": {}, "logprobs": None,
                                                        "finish_reason": reason}]}))
            return chunks

        opening = [sse({**base, "choices": [{"index": c, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]}) for c in range(body.n)]
        return core.streaming(core.stream_chunks(pending, texts, record, render, opening), pending, texts, record,
                              closing=(base, body.stream_options))
    left = await core.finished(pending, texts, http, record)
    if left is not None:
        return left
    choices = []
    for c, t in enumerate(texts):
        message, reason = assistant_message(core, t, mode, named, single_call)
        choices.append({"index": c, "message": message,
                        "logprobs": {"content": chat_logprobs(core, t.entries)} if body.logprobs else None,
                        "finish_reason": reason})
    return {**base, "choices": choices, "usage": core.usage(pending, texts)}


async def prepare(core: RequestCore, body: ChatBody) -> tuple[list[int], SamplingParams, list | None, str, str | None]:
    """A chat request made ready to submit (also the Responses API's): the prompt's ids, the
    sampling parameters, the grammar constraints (or None), the tool mode (none, auto, required,
    named) and the named function."""
    template, kwargs = template_args(core, body.chat_template, body.chat_template_kwargs)
    tools, mode, named = tool_choice(body)
    spec = grammar_spec(body)
    if mode in ("required", "named"):
        if spec is not None:
            raise APIError(400, f"tool_choice {mode!r} and {spec.param} both constrain the output; give one",
                           param="tool_choice")
        spec = tool_call_grammar(tools, named)
    ids = await prompt_ids(core, body.messages, body.add_generation_prompt, template, kwargs,
                           tools if mode != "none" else None)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, max_tokens, core.limits.room(len(ids)))
    grammars = await core.constraints(spec, body.n, 1)
    return ids, params, grammars, mode, named


def tool_choice(body: ChatBody) -> tuple[list[dict[str, Any]] | None, str, str | None]:
    """(tools, mode, name): mode is none, auto, required or named (name: the function)."""
    tools = body.tools or None
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise APIError(400, "only function tools are supported: {\"type\": \"function\", \"function\": "
                                "{\"name\": ..., \"parameters\": ...}}", param=f"tools.{i}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, "a function needs a name", param=f"tools.{i}.function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError(400, "a function's parameters must be a JSON schema object",
                           param=f"tools.{i}.function.parameters")
    choice, named = body.tool_choice, None
    if choice is None:
        mode = "auto" if tools else "none"
    elif isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise APIError(400, f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a named function",
                           param="tool_choice")
        mode = choice
    else:
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           param="tool_choice")
        mode, named = "named", fn["name"]
    if mode != "none" and not tools:
        raise APIError(400, f"tool_choice {choice if isinstance(choice, str) else 'named'!r} needs tools",
                       param="tool_choice")
    if named is not None and named not in {t["function"]["name"] for t in tools}:
        raise APIError(400, f"tool_choice names {named!r}, which is not among the tools", param="tool_choice")
    return tools, mode, named


def assistant_message(core: RequestCore, text: ChoiceText, mode: str, named: str | None,
                      single_call: bool) -> tuple[dict[str, Any], str]:
    """The non-streamed ``message`` of a choice and its finish reason, tool calls parsed."""
    reason = core.finish_reason(text)
    if mode == "none":
        return {"role": "assistant", "content": text.text}, reason
    if mode == "auto":
        content, calls = parse_tool_calls(text.text)
    else:
        content, calls = None, parse_forced(text.text, named)
    calls = calls[:1] if single_call else calls
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [c.openai() for c in calls]
        if reason == "stop" and mode != "named":
            reason = "tool_calls"
    return message, reason


def chat_logprobs(core: RequestCore, entries) -> list[dict[str, Any]]:
    tt = core.token_texts
    return [{"token": e.text, "logprob": e.logprob, "bytes": list(e.text.encode()),
             "top_logprobs": [{"token": tt(t), "logprob": lp, "bytes": list(tt(t).encode())}
                              for t, lp in (e.top or [])]} for e in entries]


def tool_deltas(stream: ToolStream, events: list[tuple[str, Any]], single_call: bool) -> list[dict[str, Any]]:
    """Chat ``delta`` objects for a choice's tool-stream events, as OpenAI streams them: content
    text, a call's id, name and arguments, then (for a named function) more arguments."""
    deltas: list[dict[str, Any]] = []
    for kind, value in events:
        if kind == "content":
            if value:
                deltas.append({"content": value})
            continue
        index = 0 if kind == "arguments" else next(i for i, c in enumerate(stream.calls) if c is value)
        if single_call and index > 0:
            continue
        if kind == "arguments":
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": value}}]})
        else:
            call: ToolCall = value                  # a named call's arguments follow in pieces
            deltas.append({"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": "" if kind == "call_start" else call.arguments}}]})
    return deltas
