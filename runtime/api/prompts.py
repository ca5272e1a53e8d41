"""Chat messages into prompt token ids, for every endpoint that takes messages (chat, responses,
tokenize): the request's template and its extra variables, each message as the template sees it,
and the rendering (tools in the template's own way or in the Hermes format), bounded in characters
before and after. Rendering runs on a text worker thread (``RequestCore.text_work``)."""
from __future__ import annotations

import json
from typing import Any

from ..api_errors import APIError
from ..chat import SPECIAL_TOKEN_KEYS, TEMPLATE_GLOBALS, ChatTemplateError, message_text, render_chat, template_source
from ..tools import arguments_object, hermes_messages, template_knows_tools
from .bodies import ChatMessage
from .core import RequestCore

#: ``chat_template_kwargs`` keys that would replace the renderer's own variables.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "documents", "chat_template",
                                      "additional_special_tokens", *SPECIAL_TOKEN_KEYS, *TEMPLATE_GLOBALS})


def template_args(core: RequestCore, chat_template: str | None, template_kwargs: dict[str, Any] | None
                  ) -> tuple[str | None, dict[str, Any]]:
    """A request's chat template (only with --trust-request-chat-template) and extra variables."""
    kwargs = dict(template_kwargs or {})
    template = chat_template if chat_template is not None else kwargs.pop("template", None)
    if template is not None:
        param = "chat_template" if chat_template is not None else "chat_template_kwargs.template"
        if not core.options.trust_request_chat_template:
            raise APIError(400, "this server does not run chat templates sent by clients (start it with "
                                "--trust-request-chat-template to allow them)", param=param)
        if not isinstance(template, str):
            raise APIError(400, "a chat template must be a string", param=param)
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise APIError(400, f"chat_template_kwargs cannot set {', '.join(reserved)}: the server renders those "
                            f"itself", param="chat_template_kwargs")
    return template, kwargs


def message_for_template(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as the template sees it: content parts joined, ``content: null`` (an
    assistant turn that only calls tools) as empty text."""
    if isinstance(message.content, list):
        for part in message.content:
            kind = part.get("type", "text")
            if kind != "text":
                raise APIError(400, f"{kind!r} content parts are not supported (text only)",
                               param=f"messages.{index}.content")
            if not isinstance(part.get("text", ""), str):
                raise APIError(400, "a text content part's text must be a string",
                               param=f"messages.{index}.content")
    out = message.model_dump(exclude_none=True)
    out["content"] = message_text(message.content) if message.content is not None else ""
    calls = out.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                  for c in calls):
            raise APIError(400, "tool_calls must be a list of {\"id\", \"type\": \"function\", \"function\": "
                                "{\"name\", \"arguments\"}}", param=f"messages.{index}.tool_calls")
    return out


def render(core: RequestCore, messages: list[dict[str, Any]], add_generation_prompt: bool, template: str | None,
           kwargs: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The prompt's token ids (on a text worker thread). The messages and tools, then the
    rendered text, must fit ``max_prompt_chars`` before anything costly runs on them."""
    if tools:
        chars = sum(len(m["content"]) for m in messages) + len(json.dumps(tools, ensure_ascii=False))
        core.check_chars(chars, "tools", "the messages and tools have")
    try:
        if template_knows_tools(template_source(core.tokenizer, template)):
            messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": arguments_object(
                c["function"].get("arguments"))}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
                for m in messages]
            text = render_chat(core.tokenizer, messages, add_generation_prompt, template=template, tools=tools,
                               **kwargs)
        else:
            text = render_chat(core.tokenizer, hermes_messages(messages, tools), add_generation_prompt,
                               template=template, **kwargs)
    except ChatTemplateError:
        raise
    except Exception as e:                      # a template that trips over these messages' values
        raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
    core.check_chars(len(text), "messages", "the rendered prompt has")
    return core.tokenizer.encode_batch([text], False)[0]


async def prompt_ids(core: RequestCore, messages: list[ChatMessage], add_generation_prompt: bool,
                     template: str | None, kwargs: dict[str, Any], tools: list[dict[str, Any]] | None) -> list[int]:
    """The token ids of ``messages`` rendered with ``template`` (from ``template_args``), on a
    text thread; 400 naming ``messages`` for a template that fails on them."""
    rendered = [message_for_template(m, i) for i, m in enumerate(messages)]
    core.check_chars(sum(len(m["content"]) for m in rendered), "messages")
    try:
        return await core.text_work(render, core, rendered, add_generation_prompt, template, kwargs, tools)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None
