"""Offline batches through the serving scheduler: many prompts in, completions out.

    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams

    llm = LLM("stories.infeng", max_seqs=16)
    for c in llm.generate(["Once upon a time", "The dog"], SamplingParams(max_new_tokens=32)):
        print(c.text)

The loop runs on the calling thread (no server, no queue bound); every prompt is one request and
continuous batching mixes their prefills and decodes exactly as ``infeng serve`` does.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence as Seq

from infeng_compiler.errors import InfengError

from .detokenize import ChoiceText
from .engine import Engine
from .loop import EngineLoop
from .sampling import SamplingParams
from .scheduler import Request, SeqOutput


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int = 0                 # prompt tokens that came from the prefix cache
    logprobs: list = field(default_factory=list)


class LLM:
    """An Engine plus an EngineLoop driven synchronously."""

    def __init__(self, artifact: str | Path, *, threads: int = 0, max_seqs: int = 16, max_context: int | None = None,
                 kv_blocks: int | None = None, kv_memory: int | None = None, max_batched_tokens: int | None = None,
                 prefix_cache: bool = True, adapters: dict[str, str | Path] | None = None):
        self.engine = Engine(artifact, threads=threads, max_seqs=max_seqs, max_context=max_context,
                             kv_blocks=kv_blocks, kv_memory=kv_memory)
        if self.engine.tokenizer is None:
            raise InfengError(f"{artifact}: the artifact has no tokenizer.json")
        self.tokenizer = self.engine.tokenizer
        self.loop = EngineLoop(self.engine, max_batched_tokens=max_batched_tokens, max_waiting=1 << 62,
                               prefix_cache=prefix_cache)
        for name, path in (adapters or {}).items():
            self.loop.load_adapter(name, path).result()
        self._ids = itertools.count()

    def generate(self, prompts: Seq[str | list[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, adapter: str | None | Seq[str | None] = None, logprobs: int | None = None) -> list[Completion]:
        """Continue every prompt (text, or token ids used as they are); completions in prompt order."""
        n = len(prompts)
        plist = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * n
        alist = list(adapter) if isinstance(adapter, (list, tuple)) else [adapter] * n
        if len(plist) != n or len(alist) != n:
            raise InfengError(f"{n} prompts but {len(plist)} sampling params and {len(alist)} adapters")
        texts: dict[str, ChoiceText] = {}
        order: list[tuple[str, list[int]]] = []

        def sink(outs: list[SeqOutput]) -> None:
            for out in outs:
                choice = texts[out.request.request_id]
                was_done = choice.done
                choice.push(out)
                if choice.done and not was_done and out.finish_reason is None:    # a stop string
                    self.loop.abort(out.request.request_id)

        for prompt, p, name in zip(prompts, plist, alist):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"offline-{next(self._ids)}"
            texts[rid] = ChoiceText(self.tokenizer, ids, tuple(p.stop), logprobs is not None)
            self.loop.submit(Request(rid, ids, p, adapter=name, logprobs=logprobs, sink=sink))
            order.append((rid, ids))
        while self.loop.has_work():
            self.loop.run_once()
        results = []
        for rid, ids in order:
            c = texts[rid]
            results.append(Completion(c.text, c.token_ids, c.finish_reason or "abort", len(ids), c.cached_tokens,
                                      c.entries))
        return results

    def close(self) -> None:
        self.engine.close()
