"""Chat templates: the model's Jinja template (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``: ``Tokenizer.chat_template``) rendered the way transformers' ``apply_chat_template``
renders it (sandboxed environment with ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols``
extension, its ``tojson`` filter, ``raise_exception``, ``strftime_now``, ``namespace``; the special
tokens as variables), so a prompt is byte-for-byte what the model was fine-tuned on. The rendered
text is tokenized without adding BOS: the template writes it.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from infeng_common.errors import InfengError
from infeng_common.tokenizer import Tokenizer

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTemplateError(InfengError):
    """No chat template, or one that fails on these messages."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, as transformers' does."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _globals() -> dict:
    """What every template can call (transformers' chat-template globals)."""
    return {"raise_exception": _raise_exception, "strftime_now": lambda fmt: datetime.now().strftime(fmt),
            "namespace": _Namespace, "dict": dict}


TEMPLATE_GLOBALS = tuple(_globals())


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(_globals())
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template does not parse: {e}") from None


def special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """The special tokens of tokenizer_config.json as strings (transformers' ``special_tokens_map``)."""
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = tokenizer.config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    extra = tokenizer.config.get("additional_special_tokens")
    if isinstance(extra, list):
        out["additional_special_tokens"] = [t.get("content") if isinstance(t, dict) else t for t in extra]
    return out


def message_text(content: Any) -> Any:
    """OpenAI content parts ``[{"type": "text", "text": ...}]`` joined into one string (as vLLM does)."""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content
                         if isinstance(part, dict) and part.get("type", "text") == "text")
    return content


def template_source(tokenizer: Tokenizer, template: str | None = None) -> str | None:
    """The template that renders a chat: the request's, else the model's (its ``default`` one
    when it has named templates)."""
    source = template or tokenizer.chat_template
    if isinstance(source, list):          # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return source


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                template: str | None = None, tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
    """The prompt text for ``messages`` (and ``tools``, OpenAI's tool list, for a template that
    reads the ``tools`` variable; tools.hermes_messages describes them to one that does not)."""
    source = template_source(tokenizer, template)
    if not source:
        raise ChatTemplateError("this model has no chat template (no chat_template.jinja, and tokenizer_config.json "
                                "has no chat_template); use /v1/completions")
    messages = [{**m, "content": message_text(m.get("content"))} for m in messages]
    context = {**special_tokens(tokenizer), **kwargs}
    try:
        return compile_template(source).render(messages=messages, tools=tools or None, documents=None,
                                               add_generation_prompt=add_generation_prompt, **context)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None


def chat_prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
    """``messages`` rendered by the model's chat template (``render_chat``) and encoded as the
    prompt's token ids; the template writes any BOS itself, so none is added."""
    return tokenizer.encode(render_chat(tokenizer, messages, add_generation_prompt, **kwargs), add_bos=False)
