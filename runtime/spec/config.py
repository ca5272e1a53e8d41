"""``--speculative``: ``SpeculativeConfig`` and its parser (``ngram[:K]``, ``draft:ARTIFACT[:K]``,
either ending in ``:fixed``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from infeng_common.errors import InfengError


class SpeculativeError(InfengError):
    """The speculative decoding setting cannot be used."""


@dataclass
class SpeculativeConfig:
    """``method``: "ngram" or "draft" (with ``draft``, an artifact directory); ``max_draft``: the
    most tokens drafted per sequence and step; ``adaptive``: pick the length from the measured
    cost curve and acceptance (off: always ``max_draft`` where the drafter has that many)."""

    method: str = "ngram"
    draft: Path | None = None
    max_draft: int = 8
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft"):
            raise SpeculativeError(f"speculative method {self.method!r}: expected ngram or draft:ARTIFACT")
        if self.method == "draft" and not self.draft:
            raise SpeculativeError("draft speculation needs an artifact: draft:ARTIFACT")
        if not 1 <= self.max_draft <= 32:
            raise SpeculativeError(f"the draft length must be between 1 and 32, got {self.max_draft}")


def parse_speculative(text: str | None) -> SpeculativeConfig | None:
    """``"ngram"``, ``"ngram:K"``, ``"draft:ARTIFACT"``, ``"draft:ARTIFACT:K"`` (K: the most tokens
    drafted per step; adaptive below it), any of them ending in ``":fixed"`` (no cost model: draft
    all the drafter has, up to K), ``"off"``/``None`` -> None."""
    if text is None or text.strip().lower() in ("", "off", "none"):
        return None
    text = text.strip()
    if text.endswith(":fixed"):
        config = parse_speculative(text[:-len(":fixed")])
        if config is None:
            raise SpeculativeError(f"--speculative {text!r}: ':fixed' follows ngram or draft:ARTIFACT")
        config.adaptive = False
        return config
    method, _, rest = text.partition(":")
    k = None
    if method == "ngram":
        if rest:
            k = rest
        return SpeculativeConfig("ngram", max_draft=_draft_length(k)) if k else SpeculativeConfig("ngram")
    if method == "draft":
        path, sep, tail = rest.rpartition(":")
        if sep and tail.isdigit():
            return SpeculativeConfig("draft", Path(path), max_draft=_draft_length(tail))
        return SpeculativeConfig("draft", Path(rest) if rest else None)
    raise SpeculativeError(f"--speculative {text!r}: expected ngram[:K], draft:ARTIFACT[:K] or off")


def _draft_length(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise SpeculativeError(f"draft length {text!r} is not a number") from None
