"""The generation loop over any backend with ``step(tokens, positions, seq_ids, logits_rows)``
and ``free(seq_id)``: the numpy interpreter or a compiled Engine."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np

from .sampling import SamplingParams, sample
from .tokenizer import Tokenizer


class StepBackend(Protocol):
    def step(self, tokens: np.ndarray, positions: np.ndarray, seq_ids: np.ndarray,
             logits_rows: np.ndarray | None = None) -> np.ndarray: ...

    def free(self, seq: int) -> None: ...


@dataclass
class Generation:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    finish_reason: str = "length"
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def tok_s(self) -> float:
        """Decode speed: generated tokens after the first, per second of decoding."""
        n = len(self.token_ids) - 1
        return n / self.decode_seconds if n > 0 and self.decode_seconds > 0 else 0.0


def stream(backend: StepBackend, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
           seq_id: int = 0, result: Generation | None = None) -> Iterator[str]:
    """Yield text deltas of one sequence's continuation; ``result`` collects ids, timings, finish reason."""
    result = result if result is not None else Generation()
    result.prompt_tokens = len(prompt_ids)
    if not prompt_ids:
        from infeng_compiler.errors import InfengError

        raise InfengError("the prompt is empty and the tokenizer has no BOS token to start from")
    rng = np.random.default_rng(params.seed)
    decoder = tokenizer.stream()
    emitted, pending = "", ""     # text yielded; text held back while it may start a stop string
    stop_hit = False
    n = len(prompt_ids)
    t0 = time.perf_counter()
    try:
        logits = backend.step(np.array(prompt_ids), np.arange(n), np.full(n, seq_id), np.array([n - 1]))
        result.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        pos = n
        for _ in range(params.max_new_tokens):
            token = sample(logits[-1], params, rng)
            if token in tokenizer.eos_token_ids and not params.ignore_eos:
                result.finish_reason = "stop"
                break
            result.token_ids.append(token)
            pending += decoder.push(token)
            cut = min((i for i in (pending.find(s) for s in params.stop) if i >= 0), default=-1)
            stop_hit = cut >= 0
            if stop_hit:
                pending = pending[:cut]
                result.finish_reason = "stop"
            ready = len(pending) if stop_hit else len(pending) - _stop_prefix_len(pending, params.stop)
            if ready:
                emitted += pending[:ready]
                yield pending[:ready]
                pending = pending[ready:]
            if stop_hit:
                break
            if len(result.token_ids) == params.max_new_tokens:
                break
            logits = backend.step(np.array([token]), np.array([pos]), np.array([seq_id]), np.array([0]))
            pos += 1
        if pending and not stop_hit:
            emitted += pending
            yield pending
        result.decode_seconds = time.perf_counter() - t1
    finally:
        backend.free(seq_id)
        result.text = emitted


def generate(backend: StepBackend, tokenizer: Tokenizer, prompt: str, params: SamplingParams) -> Generation:
    result = Generation()
    for _ in stream(backend, tokenizer, tokenizer.encode(prompt), params, result=result):
        pass
    return result


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
