"""One sequence at a time over a step backend (``step(tokens, positions, seq_ids, logits_rows)`` and
``free(seq_id)``): the numpy interpreter behind ``infeng generate``, or an Engine driven directly
(tests, benchmarks). Compiled artifacts are run for users through the engine loop (``llm.py``:
``infeng run`` and the offline API; ``server.py``); this loop shares their sampling
(``sampling.py``) and their text, stop strings and EOS handling (``detokenize.ChoiceText``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import numpy as np

from infeng_common.errors import InfengError
from infeng_common.tokenizer import Tokenizer

from .detokenize import ChoiceText
from .sampling import SamplingParams, sample
from .scheduler import NON_FINITE, SeqOutput


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


def _slots(adapter_slot: int, n: int) -> dict:
    """The ``adapter_slots`` keyword of a step, or nothing for the base model."""
    return {} if adapter_slot < 0 else {"adapter_slots": np.full(n, adapter_slot, dtype=np.int32)}


def stream(backend: StepBackend, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams,
           seq_id: int = 0, result: Generation | None = None, adapter_slot: int = -1) -> Iterator[str]:
    """Yield text deltas of one sequence's continuation; ``result`` collects ids, timings, finish reason.

    ``adapter_slot``: the LoRA slot the sequence runs with (-1: the base model)."""
    if not prompt_ids:
        raise InfengError("the prompt is empty and the tokenizer has no BOS token to start from")
    result = result if result is not None else Generation()
    result.prompt_tokens = n = len(prompt_ids)
    text = ChoiceText(tokenizer, prompt_ids, tuple(params.stop))
    rng = np.random.default_rng(params.seed)
    eos = set(tokenizer.eos_token_ids) if not params.ignore_eos else set()
    try:
        t0 = time.perf_counter()
        logits = backend.step(np.array(prompt_ids), np.arange(n), np.full(n, seq_id), np.array([n - 1]),
                              **_slots(adapter_slot, n))
        result.prefill_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        position = n
        while not text.done:
            if len(text.token_ids) >= params.max_new_tokens:
                out = SeqOutput(None, 0, None, "length")
            elif not np.isfinite(logits[-1]).all():
                raise InfengError(NON_FINITE)
            else:
                token = sample(logits[-1], params, rng)
                out = SeqOutput(None, 0, None, "stop") if token in eos else SeqOutput(None, 0, token)
                if out.token is not None and len(text.token_ids) + 1 >= params.max_new_tokens:
                    out.finish_reason = "length"
            delta = text.push(out)
            if delta is not None and delta.text:
                yield delta.text
            if not text.done:
                logits = backend.step(np.array([out.token]), np.array([position]), np.array([seq_id]),
                                      np.array([0]), **_slots(adapter_slot, 1))
                position += 1
        result.decode_seconds = time.perf_counter() - t1
    finally:
        backend.free(seq_id)
    result.text, result.token_ids, result.finish_reason = text.text, text.token_ids, text.finish_reason


def generate(backend: StepBackend, tokenizer: Tokenizer, prompt: str, params: SamplingParams,
             adapter_slot: int = -1) -> Generation:
    result = Generation()
    for _ in stream(backend, tokenizer, tokenizer.encode(prompt), params, result=result, adapter_slot=adapter_slot):
        pass
    return result
