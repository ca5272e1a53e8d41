"""Generation loops over any backend with ``step(tokens, positions, seq_ids, logits_rows)`` and
``free(seq_id)``: the numpy interpreter or a compiled Engine.

``stream`` yields the text of one sequence as it is produced; ``generate_batch`` runs many
sequences together, all of them in every step (one prefill step, then one decode step per token).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np

from infeng_compiler.errors import InfengError

from .sampling import SamplingParams, sample
from .tokenizer import StreamDecoder, Tokenizer


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


class _Sequence:
    """Sampling, EOS, stop strings and incremental text of one sequence."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams, result: Generation):
        if not prompt_ids:
            raise InfengError("the prompt is empty and the tokenizer has no BOS token to start from")
        self.tokenizer, self.params, self.result = tokenizer, params, result
        self.rng = np.random.default_rng(params.seed)
        self.decoder = StreamDecoder(tokenizer, prompt_ids)
        self.pending = ""              # text held back while it may be the start of a stop string
        self.done = params.max_new_tokens == 0
        self.position = len(prompt_ids)
        result.prompt_tokens = len(prompt_ids)

    def feed(self, logits: np.ndarray) -> str:
        """Sample the next token from ``logits``; return the text that is now final."""
        p, result = self.params, self.result
        token = sample(logits, p, self.rng)
        if token in self.tokenizer.eos_token_ids and not p.ignore_eos:
            result.finish_reason, self.done = "stop", True
            return self._flush()
        result.token_ids.append(token)
        self.last_token = token
        self.pending += self.decoder.push(token)
        cut = min((i for i in (self.pending.find(s) for s in p.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.pending = self.pending[:cut]
            result.finish_reason, self.done = "stop", True
            return self._flush()
        if len(result.token_ids) >= p.max_new_tokens:
            self.done = True
            return self._flush()
        ready = len(self.pending) - _stop_prefix_len(self.pending, p.stop)
        text, self.pending = self.pending[:ready], self.pending[ready:]
        result.text += text
        return text

    def _flush(self) -> str:
        text, self.pending = self.pending, ""
        self.result.text += text
        return text


def _slots(adapter_slot: int, n: int) -> dict:
    """The ``adapter_slots`` keyword of a step, or nothing for the base model."""
    return {} if adapter_slot < 0 else {"adapter_slots": np.full(n, adapter_slot, dtype=np.int32)}


def stream(backend: StepBackend, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
           seq_id: int = 0, result: Generation | None = None, adapter_slot: int = -1) -> Iterator[str]:
    """Yield text deltas of one sequence's continuation; ``result`` collects ids, timings, finish reason.

    ``adapter_slot``: the LoRA slot the sequence runs with (-1: the base model)."""
    result = result if result is not None else Generation()
    seq = _Sequence(tokenizer, prompt_ids, params, result)
    n = len(prompt_ids)
    try:
        t0 = time.perf_counter()
        logits = backend.step(np.array(prompt_ids), np.arange(n), np.full(n, seq_id), np.array([n - 1]),
                              **_slots(adapter_slot, n))
        result.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        while not seq.done:
            text = seq.feed(logits[-1])
            if text:
                yield text
            if not seq.done:
                logits = backend.step(np.array([seq.last_token]), np.array([seq.position]), np.array([seq_id]),
                                      np.array([0]), **_slots(adapter_slot, 1))
                seq.position += 1
        result.decode_seconds = time.perf_counter() - t1
    finally:
        backend.free(seq_id)


def generate(backend: StepBackend, tokenizer: Tokenizer, prompt: str, params: SamplingParams,
             adapter_slot: int = -1) -> Generation:
    result = Generation()
    for _ in stream(backend, tokenizer, tokenizer.encode(prompt), params, result=result, adapter_slot=adapter_slot):
        pass
    return result


def generate_batch(backend: StepBackend, tokenizer: Tokenizer, prompts: list[list[int]],
                   params: SamplingParams | list[SamplingParams],
                   adapter_slots: list[int] | None = None) -> list[Generation]:
    """Continue every prompt, all sequences sharing each step; per-sequence params and LoRA slots
    (-1: base) allowed, so sequences with different adapters share a step."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    per_seq = np.array(adapter_slots if adapter_slots is not None else [-1] * len(prompts), dtype=np.int32)
    use_slots = bool((per_seq >= 0).any())
    results = [Generation() for _ in prompts]
    seqs = [_Sequence(tokenizer, ids, p, r) for ids, p, r in zip(prompts, plist, results)]
    try:
        t0 = time.perf_counter()
        lens = [len(ids) for ids in prompts]
        extra = {"adapter_slots": np.repeat(per_seq, lens)} if use_slots else {}
        logits = backend.step(np.concatenate(prompts), np.concatenate([np.arange(n) for n in lens]),
                              np.repeat(np.arange(len(prompts)), lens), np.cumsum(lens) - 1, **extra)
        prefill = time.perf_counter() - t0
        t1 = time.perf_counter()
        live = list(range(len(seqs)))
        while live:
            for row, i in enumerate(live):
                seqs[i].feed(logits[row])
            live = [i for i in live if not seqs[i].done]
            if not live:
                break
            extra = {"adapter_slots": per_seq[live]} if use_slots else {}
            logits = backend.step(np.array([seqs[i].last_token for i in live]),
                                  np.array([seqs[i].position for i in live]), np.array(live), **extra)
            for i in live:
                seqs[i].position += 1
        decode = time.perf_counter() - t1
    finally:
        for i in range(len(prompts)):
            backend.free(i)
    for r in results:
        r.prefill_seconds, r.decode_seconds = prefill, decode
    return results


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
