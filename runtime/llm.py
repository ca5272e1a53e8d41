"""The offline API, and ``infeng run``: prompts in, completions (or streamed text) out, through the
same engine loop, scheduler and detokenizer as ``infeng serve``.

    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams

    llm = LLM("stories.infeng", max_seqs=16)
    for c in llm.generate(["Once upon a time", "The dog"], SamplingParams(max_new_tokens=32)):
        print(c.text)
    for piece in llm.stream("Once upon a time", SamplingParams(max_new_tokens=32)):
        print(piece, end="")

The loop runs on the calling thread (no server, no queue bound); every prompt is one request and
continuous batching mixes their prefills and decodes exactly as ``infeng serve`` does.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator
from typing import Sequence as Seq

from infeng_common.errors import InfengError

from .detokenize import ChoiceText
from .engine import DEFAULT_MAX_SEQS, Engine
from .loop import EngineLoop
from .sampling import SamplingParams
from .scheduler import Request, SeqOutput
from .spec import SpeculativeConfig, parse_speculative


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int = 0                 # prompt tokens that came from the prefix cache
    logprobs: list = field(default_factory=list)
    error: str | None = None               # why, when finish_reason is "error"
    prefill_seconds: float = 0.0           # submission to the first token
    decode_seconds: float = 0.0            # first token to the last

    @property
    def tok_s(self) -> float:
        """Decode speed: generated tokens after the first, per second of decoding."""
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


class _Choice:
    """One prompt's text as its outputs arrive, with the times a completion reports."""

    def __init__(self, text: ChoiceText, prompt_tokens: int):
        self.text = text
        self.prompt_tokens = prompt_tokens
        self.request_id = ""
        self.pieces: list[str] = []        # released text not yet handed to a stream
        self.submitted = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None

    def completion(self) -> Completion:
        t = self.text
        first = self.first or self.submitted
        return Completion(t.text, t.token_ids, t.finish_reason or "abort", self.prompt_tokens, t.cached_tokens,
                          t.entries, t.error, first - self.submitted, (self.last or first) - first)


class LLM:
    """An Engine plus an EngineLoop driven synchronously."""

    def __init__(self, artifact: str | Path, *, threads: int = 0, max_seqs: int = DEFAULT_MAX_SEQS,
                 max_context: int | None = None,
                 kv_blocks: int | None = None, kv_memory: int | None = None, max_batched_tokens: int | None = None,
                 prefix_cache: bool = True, adapters: dict[str, str | Path] | None = None,
                 speculative: str | SpeculativeConfig | None = None):
        """``max_seqs``, ``max_context``, ``kv_blocks``, ``kv_memory``: the KV pool, as ``Engine``
        sizes it (docs/serving.md, *KV memory*). ``speculative``: ``"ngram"``, ``"draft:ARTIFACT"``
        (``[:K]``, the most drafted tokens per step) or a ``SpeculativeConfig``; None decodes one
        token per step (docs/speculative.md)."""
        engine = Engine(artifact, threads=threads, max_seqs=max_seqs, max_context=max_context, kv_blocks=kv_blocks,
                        kv_memory=kv_memory)
        if engine.tokenizer is None:
            raise InfengError(f"{artifact}: the artifact has no tokenizer.json")
        self._drive(engine, max_batched_tokens, prefix_cache, speculative)
        for name, path in (adapters or {}).items():
            self.loop.load_adapter(name, path).result()

    @classmethod
    def over(cls, engine, *, max_batched_tokens: int | None = None, prefix_cache: bool = True,
             speculative: str | SpeculativeConfig | None = None) -> "LLM":
        """The offline API over an engine already built: a compiled ``Engine``, or anything with its
        surface (the reference interpreter's ``infeng_compiler.interp_engine.InterpreterEngine``)."""
        llm = cls.__new__(cls)
        llm._drive(engine, max_batched_tokens, prefix_cache, speculative)
        return llm

    def _drive(self, engine, max_batched_tokens: int | None, prefix_cache: bool,
               speculative: str | SpeculativeConfig | None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        spec = parse_speculative(speculative) if isinstance(speculative, str) else speculative
        self.loop = EngineLoop(engine, max_batched_tokens=max_batched_tokens, max_waiting=1 << 62,
                               prefix_cache=prefix_cache, speculative=spec)
        self._ids = itertools.count()

    def generate(self, prompts: Seq[str | list[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, adapter: str | None | Seq[str | None] = None, logprobs: int | None = None) -> list[Completion]:
        """Continue every prompt (text, or token ids used as they are); completions in prompt order."""
        n = len(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * n
        alist = list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * n
        if len(plist) != n or len(alist) != n:
            raise InfengError(f"{n} prompts but {len(plist)} sampling params and {len(alist)} adapters")
        choices = [self._submit(prompt, p, name, logprobs) for prompt, p, name in zip(prompts, plist, alist)]
        while self.loop.has_work():
            self.loop.run_once()
        return [c.completion() for c in choices]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None, *,
               adapter: str | None = None, stopped: Callable[[], bool] = lambda: False) -> "TextStream":
        """Continue one prompt; iterate for text as it becomes final, then read ``completion``.
        ``stopped()`` is checked before every engine step (a long prefill too): true, the request
        ends there (``finish_reason`` "abort")."""
        choice = self._submit(prompt, params or SamplingParams(), adapter, None)
        return TextStream(self.loop, choice.request_id, choice, stopped)

    def _submit(self, prompt: str | list[int], params: SamplingParams, adapter: str | None,
                logprobs: int | None) -> _Choice:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        choice = _Choice(ChoiceText(self.tokenizer, ids, tuple(params.stop), logprobs is not None), len(ids))
        choice.request_id = f"offline-{next(self._ids)}"
        request = Request(choice.request_id, ids, params, adapter=adapter, logprobs=logprobs,
                          sink=self._sink, context=choice)
        self.loop.submit(request)
        return choice

    def _sink(self, outs: list[SeqOutput]) -> None:
        """Called by ``run_once`` on this thread: text into each choice; a stop string ends it."""
        now = time.perf_counter()
        for out in outs:
            choice: _Choice = out.request.context
            was_done = choice.text.done
            delta = choice.text.push(out)
            choice.first = choice.first or now  # prefill ends with the first output, a token or not (EOS)
            if out.token is not None:
                choice.last = now
            if delta is not None and delta.text:
                choice.pieces.append(delta.text)
            if choice.text.done and not was_done and out.finish_reason is None:    # a stop string
                self.loop.abort(out.request.request_id)

    def close(self) -> None:
        if self.loop.speculator is not None:
            self.loop.speculator.close()
        self.engine.close()


class TextStream:
    """The text of one request as the loop produces it (the loop runs while it is iterated)."""

    def __init__(self, loop: EngineLoop, request_id: str, choice: _Choice,
                 stopped: Callable[[], bool] = lambda: False):
        self.loop, self.request_id, self.choice, self.stopped = loop, request_id, choice, stopped

    def __iter__(self) -> Iterator[str]:
        choice = self.choice
        try:
            while True:
                while choice.pieces:
                    yield choice.pieces.pop(0)
                if choice.text.done or not self.loop.has_work() or self.stopped():
                    break
                self.loop.run_once()
            while choice.pieces:
                yield choice.pieces.pop(0)
        finally:                                 # left early: the request ends here, not in a later step
            if not choice.text.done:
                self.loop.abort(self.request_id)

    @property
    def completion(self) -> Completion:
        return self.choice.completion()
