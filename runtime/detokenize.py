"""Consumer-side text of one choice: incremental detokenizing, stop strings, logprob entries.

Runs wherever the outputs are consumed (the HTTP event loop, the offline driver that ``infeng run``,
``infeng chat`` and ``infeng generate`` use), never on the engine loop; the one output processor
and the one implementation of stop strings. ``ChoiceText.push`` takes the loop's token outputs and
returns the text that is now final; text that might be the start of a stop string is held back until it is decided.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from infeng_common.tokenizer import StreamDecoder, Tokenizer

from .scheduler import SeqOutput


@dataclass
class TokenLogprob:
    token: int
    text: str                             # the text this token added (may be "" mid-character)
    logprob: float
    top: list[tuple[int, float]] | None
    offset: int                           # where ``text`` starts in the choice's text


@dataclass
class Delta:
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class ChoiceText:
    """The text of one choice as its tokens arrive."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (),
                 logprobs: bool = False):
        self.decoder = StreamDecoder(tokenizer, prompt_ids)
        self.stop = tuple(s for s in stop if s)
        self.want_logprobs = logprobs
        self.text = ""                    # released text
        self.pending = ""                 # held back: may start a stop string
        self.token_ids: list[int] = []
        self.entries: list[TokenLogprob] = []     # every token's entry (when logprobs are wanted)
        self._sent = 0                    # entries already handed out in deltas
        self._cut = False                 # a stop string ended the text
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.cached_tokens = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def push(self, out: SeqOutput) -> Delta | None:
        """Take one output; the delta to send (None when nothing is new)."""
        if self.done:
            return None
        if out.cached_tokens:
            self.cached_tokens = out.cached_tokens
        delta = Delta()
        if out.token is not None:
            self.token_ids.append(out.token)
            piece = self.decoder.push(out.token)
            if self.want_logprobs:
                entry = TokenLogprob(out.token, piece, out.logprob if out.logprob is not None else 0.0,
                                     out.top_logprobs, len(self.text) + len(self.pending))
                self.entries.append(entry)
            self.pending += piece
            if self.stop:
                cut = min((i for i in (self.pending.find(s) for s in self.stop) if i >= 0), default=-1)
                if cut >= 0:
                    self.pending = self.pending[:cut]
                    self.finish_reason, self._cut = "stop", True
        if out.finish_reason is not None and self.finish_reason is None:
            self.finish_reason = out.finish_reason
            self.error = out.error
        if self.finish_reason is not None:
            ready = len(self.pending)
        else:
            ready = len(self.pending) - _stop_prefix_len(self.pending, self.stop)
        delta.text, self.pending = self.pending[:ready], self.pending[ready:]
        self.text += delta.text
        if self.want_logprobs:
            delta.logprobs = self._release_entries()
        delta.finish_reason = self.finish_reason
        delta.error = self.error
        if not delta.text and not delta.logprobs and delta.finish_reason is None:
            return None
        return delta


    def _release_entries(self) -> list[TokenLogprob]:
        """Entries of the tokens whose text is now released; a stop string drops the tokens
        after it and trims the one it starts in."""
        end, k = len(self.text), self._sent
        if self._cut:
            while k < len(self.entries) and self.entries[k].offset < end:
                k += 1
            del self.entries[k:]
            if k:
                last = self.entries[k - 1]
                last.text = last.text[:end - last.offset]
        elif self.done:
            k = len(self.entries)
        else:
            while k < len(self.entries) and self.entries[k].offset + len(self.entries[k].text) <= end:
                k += 1
        out, self._sent = self.entries[self._sent:k], k
        return out


class TokenTexts:
    """Display text of single token ids (for top-logprob alternatives), cached.

    A token decoded alone loses a word-initial space under SentencePiece-style decoders, so it is
    decoded after an anchor token and the anchor's text removed."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        anchor = tokenizer.hf.encode("a", add_special_tokens=False).ids
        self.anchor = anchor[-1:] if anchor else []
        self.anchor_text = tokenizer.decode(self.anchor, skip_special_tokens=False)
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.cache.get(token)
        if text is None:
            full = self.tokenizer.decode(self.anchor + [token], skip_special_tokens=False)
            text = full[len(self.anchor_text):] if full.startswith(self.anchor_text) else \
                self.tokenizer.decode([token], skip_special_tokens=False)
            self.cache[token] = text
        return text


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
