"""Perplexity, by the llama.cpp protocol (so the figures compare with ``llama-perplexity``).

Tokenize the whole text once with BOS prepended; cut it into floor(N/ctx) chunks of ctx tokens;
set the first token of every chunk to BOS; run each chunk from position 0; score the tokens at
positions ctx/2+1 .. ctx-1 from the logits at ctx/2 .. ctx-2; PPL = exp(mean NLL).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from infeng_common.errors import InfengError, not_a_file


@dataclass
class PerplexityResult:
    ppl: float
    nll: float
    tokens: int          # tokens in the (truncated) text, BOS included
    scored: int          # tokens whose log-probability was scored
    chunks: int
    ctx: int
    seconds: float
    # against a base model (``base_step``): its perplexity, the mean KL divergence KL(base || this)
    # of the next-token distributions and how often both put the same token on top
    base_ppl: float | None = None
    kld: float | None = None
    kld_max: float | None = None
    top1: float | None = None

    def as_dict(self) -> dict:
        out = {"ppl": self.ppl, "nll": self.nll, "tokens": self.tokens, "scored": self.scored,
               "chunks": self.chunks, "ctx": self.ctx, "seconds": round(self.seconds, 3)}
        if self.kld is not None:
            out.update(base_ppl=self.base_ppl, drift=self.ppl / self.base_ppl - 1.0, kld=self.kld,
                       kld_max=self.kld_max, top1=self.top1)
        return out


def read_text(path: str | Path, max_bytes: int | None = None) -> str:
    path = Path(path)
    if not path.is_file():
        raise InfengError(not_a_file(path))
    raw = path.read_bytes()
    if max_bytes is not None:
        raw = raw[:max_bytes]
    return raw.decode("utf-8", errors="ignore")  # a cut may split the last character


def chunk_tokens(ids: list[int], ctx: int, bos: int | None) -> np.ndarray:
    """[n_chunks, ctx] with BOS at the start of each chunk."""
    if ctx < 4:
        raise InfengError(f"--ctx must be at least 4, got {ctx}")
    n = len(ids) // ctx
    if n == 0:
        raise InfengError(f"the text has {len(ids)} tokens, fewer than one chunk of --ctx {ctx}")
    chunks = np.array(ids[: n * ctx], dtype=np.int32).reshape(n, ctx)
    if bos is not None:
        chunks[:, 0] = bos
    return chunks


def perplexity(step: Callable, free: Callable[[int], None], ids: list[int], ctx: int, bos: int | None,
               batch: int = 8, progress: Callable[[int, int], None] | None = None,
               base_step: Callable | None = None, base_free: Callable[[int], None] | None = None) -> PerplexityResult:
    """Run the protocol through ``step(tokens, positions, seq_ids, logits_rows) -> logits``.

    ``batch`` chunks go through one step as separate sequences. With ``base_step`` (another model
    with the same vocabulary) the same chunks also run through it, adding its perplexity, the mean
    KL divergence KL(base || model) over the scored positions and the top-1 agreement.
    """
    t0 = time.perf_counter()
    chunks = chunk_tokens(ids, ctx, bos)
    first = ctx // 2
    scored_rows = np.arange(first, ctx - 1)                      # logits rows within a chunk
    nll_sum, count = 0.0, 0
    base_nll, kld_sum, kld_max, same_top = 0.0, 0.0, 0.0, 0
    for start in range(0, len(chunks), batch):
        group = chunks[start:start + batch]
        b = len(group)
        rows = (np.arange(b)[:, None] * ctx + scored_rows[None, :]).reshape(-1)
        args = (group.reshape(-1), np.tile(np.arange(ctx, dtype=np.int32), b),
                np.repeat(np.arange(b, dtype=np.int32), ctx), rows)
        targets = group[:, first + 1:].reshape(-1)
        logp = _log_softmax(step(*args))
        nll_sum -= float(logp[np.arange(len(targets)), targets].sum())
        count += len(targets)
        for s in range(b):
            free(s)
        if base_step is not None:
            base_logp = _log_softmax(base_step(*args))
            if base_logp.shape != logp.shape:
                raise InfengError(f"the base model gives logits {base_logp.shape[1:]}, the model {logp.shape[1:]}; "
                                  "--kld-base needs the same vocabulary")
            base_nll -= float(base_logp[np.arange(len(targets)), targets].sum())
            kl = (np.exp(base_logp) * (base_logp - logp)).sum(axis=1)
            kld_sum += float(kl.sum())
            kld_max = max(kld_max, float(kl.max()))
            same_top += int((base_logp.argmax(axis=1) == logp.argmax(axis=1)).sum())
            for s in range(b):
                base_free(s)
        if progress:
            progress(min(start + batch, len(chunks)), len(chunks))
    nll = nll_sum / count
    result = PerplexityResult(math.exp(nll), nll, len(ids), count, len(chunks), ctx, time.perf_counter() - t0)
    if base_step is not None:
        result.base_ppl = math.exp(base_nll / count)
        result.kld, result.kld_max, result.top1 = kld_sum / count, kld_max, same_top / count
    return result


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))
