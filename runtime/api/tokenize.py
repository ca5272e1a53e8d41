"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the ids the engine would get for a prompt or
for chat messages, and the text of token ids."""
from __future__ import annotations

from fastapi import APIRouter, Request as HTTPRequest

from ..api_errors import APIError
from .bodies import DetokenizeBody, TokenizeBody, parse_body
from .core import RequestCore, post_routes
from .prompts import prompt_ids, template_args


def router(core: RequestCore) -> APIRouter:
    return post_routes(core, {"/tokenize": tokenize, "/detokenize": detokenize})


async def tokenize(core: RequestCore, http: HTTPRequest):
    """The ids the engine would get for a prompt or for chat messages."""
    core.admitting()
    body: TokenizeBody = parse_body(TokenizeBody, await http.body())
    if body.model is not None:
        core.adapter_of(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", param="prompt")
    if body.messages is not None:
        template, kwargs = template_args(core, None, body.chat_template_kwargs)
        ids = await prompt_ids(core, body.messages, body.add_generation_prompt, template, kwargs, body.tools)
    else:
        core.check_chars(len(body.prompt), "prompt")
        ids = (await core.text_work(core.tokenizer.encode_batch, [body.prompt],
                                    None if body.add_special_tokens else False))[0]
    out = {"count": len(ids), "max_model_len": core.limits.max_context, "tokens": ids, "token_strs": None}
    if body.return_token_strs:
        out["token_strs"] = [core.tokenizer.hf.id_to_token(t) for t in ids]
    return out


async def detokenize(core: RequestCore, http: HTTPRequest):
    """The text of token ids (at most the model's context of them). The body is parsed, checked
    and decoded on a text thread: a body of a million ids takes the parser a tenth of a second,
    which the event loop must not spend."""
    core.admitting()
    body: DetokenizeBody = await core.text_work(detokenize_body, core, await http.body())
    if body.model is not None:
        core.adapter_of(body.model)
    return {"prompt": await core.text_work(core.tokenizer.decode, body.tokens, False)}


def detokenize_body(core: RequestCore, raw: bytes) -> DetokenizeBody:
    """A /detokenize body, its ids bounded and in the vocabulary (on a text thread)."""
    body: DetokenizeBody = parse_body(DetokenizeBody, raw)
    limit = core.limits.max_context
    if len(body.tokens) > limit:
        raise APIError(400, f"at most {limit} token ids (the model's context, --max-context), got "
                            f"{len(body.tokens)}", param="tokens")
    vocab = core.engine.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return body
