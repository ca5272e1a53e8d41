"""``POST /v1/completions``: prompts (text or token ids) continued as they are, streamed or not."""
from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request as HTTPRequest

from ..api_errors import APIError
from ..detokenize import ChoiceText
from .bodies import CompletionBody, check_unsupported, grammar_spec, sampling_params
from .core import RequestCore, post_routes, sse

#: max_tokens when a completion request gives none (OpenAI's default).
DEFAULT_MAX_TOKENS = 16


def router(core: RequestCore) -> APIRouter:
    return post_routes(core, {"/v1/completions": create})


async def create(core: RequestCore, http: HTTPRequest):
    record, body, adapter = await core.begin(http, CompletionBody)
    if body.echo:
        raise APIError(400, "echo is not supported", param="echo")
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.best_of not in (None, body.n):
        raise APIError(400, "best_of must equal n", param="best_of")
    check_unsupported(body)
    params = sampling_params(body, body.max_tokens, DEFAULT_MAX_TOKENS)
    spec = grammar_spec(body)
    prompts = await prompt_ids(core, body.prompt, body.n)
    grammars = await core.constraints(spec, body.n, len(prompts))
    rid = f"cmpl-{record.request_id}"
    pending = core.submit(prompts, [params] * len(prompts), body.n, adapter, body.priority, body.logprobs, rid,
                          grammars)
    texts = [ChoiceText(core.tokenizer, prompts[c // body.n], params.stop, body.logprobs is not None)
             for c in range(len(prompts) * body.n)]
    base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": body.model}

    def logprobs(entries) -> dict[str, Any] | None:
        return completion_logprobs(core, entries, body.logprobs) if body.logprobs is not None else None

    if body.stream:
        def render(c: int, delta) -> list[str]:
            choice = {"index": c, "text": delta.text, "logprobs": logprobs(delta.logprobs),
                      "finish_reason": core.finish_reason(texts[c]) if delta.finish_reason else None}
            return [sse({**base, "choices": [choice]})]

        return core.streaming(core.stream_chunks(pending, texts, record, render), pending, texts, record,
                              closing=(base, body.stream_options))
    left = await core.finished(pending, texts, http, record)
    if left is not None:
        return left
    choices = [{"index": c, "text": t.text, "logprobs": logprobs(t.entries), "finish_reason": core.finish_reason(t)}
               for c, t in enumerate(texts)]
    return {**base, "choices": choices, "usage": core.usage(pending, texts)}


async def prompt_ids(core: RequestCore, prompt: Any, n: int) -> list[list[int]]:
    """Token ids of each prompt; text is bounded by characters first, then tokenized off the
    event loop thread."""
    texts: list[str] = []
    if isinstance(prompt, str):
        texts = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        texts = list(prompt)
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif prompt and all(isinstance(p, list) for p in prompt):
        prompts = [list(p) for p in prompt]
    else:
        raise APIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")
    core.check_sequences(n * len(texts or prompts))
    if texts:
        for text in texts:
            core.check_chars(len(text), "prompt")
        return await core.text_work(core.tokenizer.encode_batch, texts, None)   # releases the GIL
    vocab, context = core.engine.vocab_size, core.limits.max_context
    for ids in prompts:
        if len(ids) > context:
            raise APIError(400, f"this model's context is {context} tokens; the prompt has {len(ids)}",
                           param="prompt", code="context_length_exceeded")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return prompts


def completion_logprobs(core: RequestCore, entries, k: int | None) -> dict[str, Any]:
    tt = core.token_texts
    return {"tokens": [e.text for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{tt(t): lp for t, lp in (e.top or [])} for e in entries] if k else None,
            "text_offset": [e.offset for e in entries]}
