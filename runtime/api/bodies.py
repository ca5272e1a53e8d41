"""What a client sends: the request bodies (pydantic), their bounds, and the pure conversions of a
body into what the engine takes: ``SamplingParams`` (``sampling_params``) and the output constraint
(``grammar_spec``). Fields of OpenAI's API this server does not implement are refused by name."""
from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from infeng_common.errors import InfengError

from ..api_errors import APIError
from ..json_body import JSONRejected, loads, parse_json
from ..sampling import SEED_BOUND, SamplingParams
from ..structured import GrammarSpec

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
PRIORITY_BOUND = 1000
#: Most tools one request may define (OpenAI's own limit); together with the messages, their JSON
#: text counts against the prompt bound (``max_prompt_chars``) before the chat template runs.
MAX_TOOLS = 128


class GenerationBody(BaseModel):
    model_config = ConfigDict(extra="allow")       # clients send fields we ignore (user, ...)

    model: str
    max_tokens: Optional[int] = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: Optional[dict[str, Any]] = None
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=0, lt=SEED_BOUND)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    # extensions (as vLLM names them)
    top_k: int = Field(0, ge=0)
    ignore_eos: bool = False
    priority: int = Field(0, ge=-PRIORITY_BOUND, le=PRIORITY_BOUND)
    speculative: Optional[StrictBool] = None       # per request: false never drafts (needs --speculative)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


class CompletionBody(GenerationBody):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")       # tool_calls, tool_call_id, name, ...

    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatBody(GenerationBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template: Optional[str] = None            # a client's template: only with --trust-request-chat-template
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None


class TokenizeBody(BaseModel):
    """vLLM's /tokenize: a ``prompt``, or chat ``messages`` rendered with the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    tools: Optional[list[dict[str, Any]]] = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: Optional[dict[str, Any]] = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    tokens: list[int]


#: Fields of OpenAI's API this server does not implement: a request that sets one gets 400 naming
#: it, rather than an answer that silently ignores it.
UNSUPPORTED_FIELDS = ("functions", "function_call", "audio", "prediction", "web_search_options", "store",
                      "modalities")
#: vLLM's ``structured_outputs`` keys: the constraints, and options that change nothing here.
STRUCTURED_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "json_object"}
STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties", "backend",
                      "whitespace_pattern")
TOOL_CHOICES = ("none", "auto", "required")


class AdapterBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Optional[str] = None
    path: Optional[str] = None
    scale: float = 1.0
    lora_name: Optional[str] = None                # vLLM's spelling
    lora_path: Optional[str] = None


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """``raw`` as a ``model``: strict bounded JSON, then the model's checks (400 naming the field)."""
    data = parse_json(raw)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return validated(model, data)


def validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """``data`` as a ``model``; 400 naming the first field that fails its checks."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from None


def check_unsupported(body: BaseModel) -> None:
    """400 naming a field of OpenAI's API that this server does not implement."""
    extra = body.model_extra or {}
    for name in UNSUPPORTED_FIELDS:
        value = extra.get(name)
        if value is None or (name == "store" and value is False) or (name == "modalities" and value == ["text"]):
            continue
        raise APIError(400, f"{name} is not supported by this server", param=name)


def sampling_params(body: GenerationBody, max_tokens: int | None, default_max: int) -> SamplingParams:
    """The body's sampling parameters; ``default_max`` when it gives no token bound."""
    if body.presence_penalty or body.frequency_penalty:
        raise APIError(400, "presence_penalty and frequency_penalty are not supported", param="presence_penalty")
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise APIError(400, f"a stop string may have at most {MAX_STOP_CHARS} characters", param="stop")
    try:
        return SamplingParams(max_new_tokens=default_max if max_tokens is None else max_tokens,
                              temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                              stop=tuple(stop), ignore_eos=body.ignore_eos, speculative=body.speculative)
    except InfengError as e:
        raise APIError(400, str(e)) from None


def grammar_spec(body: GenerationBody) -> GrammarSpec | None:
    """The request's constraint: ``response_format``, ``structured_outputs`` or ``guided_*``
    (at most one of them)."""
    specs: list[GrammarSpec] = []
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            specs.append(GrammarSpec("json_object", None, "response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict):
                raise APIError(400, "response_format.json_schema must be an object with a schema",
                               param="response_format.json_schema")
            schema = js.get("schema", js.get("json_schema", {}))
            specs.append(GrammarSpec("json", schema if schema is not None else {}, "response_format.json_schema"))
        elif kind not in ("text", None):
            raise APIError(400, f"response_format type {kind!r} is not supported (text, json_object, "
                                f"json_schema)", param="response_format.type")
    so = body.structured_outputs
    if so is not None:
        for key, value in so.items():
            if key in STRUCTURED_OPTIONS:
                continue
            if key not in STRUCTURED_KINDS:
                raise APIError(400, f"structured_outputs.{key} is not supported (json, regex, choice, grammar, "
                                    f"json_object)", param=f"structured_outputs.{key}")
            if value is None or (key == "json_object" and value is False):
                continue
            specs.append(GrammarSpec(STRUCTURED_KINDS[key], None if key == "json_object" else value,
                                     f"structured_outputs.{key}"))
    for key, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(body, key)
        if value is not None:
            specs.append(GrammarSpec(kind, value, key))
    for i, spec in enumerate(specs):
        if spec.kind == "json" and isinstance(spec.value, str):   # a schema sent as JSON text
            try:
                specs[i] = GrammarSpec("json", loads(spec.value), spec.param)
            except JSONRejected as e:
                raise APIError(400, f"{spec.param}: the schema {e}", param=spec.param) from None
    if len(specs) > 1:
        raise APIError(400, f"give one output constraint, not {specs[0].param} and {specs[1].param}",
                       param=specs[1].param)
    return specs[0] if specs else None
