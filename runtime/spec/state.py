"""``SpecState``: what one sequence keeps for drafting (its n-gram index, the running acceptance
rates of each draft source)."""
from __future__ import annotations

#: Rate of the running acceptance estimate (per drafted position checked).
ACCEPT_RATE_STEP = 0.15
#: Draft sources; each sequence keeps running acceptance rates per source. Prompt lookup is split by
#: how many of the sequence's last 8 tokens agree with the 8 before the match, position by
#: position: the classes start at MATCH_CLASSES (1, 2-3, 4-7, 8). Many agreeing tokens mean a copy
#: in progress, whose next tokens are far likelier to follow than a lone token's; counting them
#: position by position (not only the unbroken run) keeps a copy with one edited token a copy.
SOURCE_TABLE = 0
MATCH_CLASSES = (1, 2, 4, 8)
SOURCE_DRAFT = 1 + len(MATCH_CLASSES)
#: Prior (first draft, each later draft) acceptance of each source before a sequence has shown
#: anything: table, match classes as above, draft model.
SOURCE_PRIORS = ((0.3, 0.6), (0.3, 0.6), (0.6, 0.75), (0.75, 0.85), (0.9, 0.9), (0.7, 0.8))


class SpecState:
    """What the speculator keeps for one sequence."""

    __slots__ = (
        "accepted",
        "dm_pending",
        "dm_valid",
        "drafted",
        "first",
        "follow",
        "index",
        "indexed",
        "occurrences",
        "order",
        "probe",
        "steps",
    )

    def __init__(self) -> None:
        self.first = [p[0] for p in SOURCE_PRIORS]          # running P(first draft accepted) by source
        self.follow = [p[1] for p in SOURCE_PRIORS]         # running P(draft j+1 accepted | draft j was)
        self.occurrences: dict[tuple, list[int]] = {}       # top-order n-gram -> positions after it
        self.index: dict[tuple, int] = {}                   # lower orders -> position after the last one
        self.indexed = 1                                    # positions [1, indexed) are in ``index``
        self.probe: tuple[int, int, int] | None = None      # (position, token, source) predicted, not run
        self.drafted = 0
        self.accepted = 0
        self.steps = 0
        self.dm_valid = 0                                   # draft model: positions with true-token KV
        self.dm_pending: tuple[int, list[int]] | None = None  # (first position, tokens) drafted there
        self.order = 0                                      # source of the draft now in flight

    def learn(self, source: int, hits: int, checked: int) -> None:
        """``checked`` drafted positions of ``source`` were verified, the first ``hits`` accepted: the
        first position updates ``first``, each later one (reached only after a hit) ``follow``."""
        if checked <= 0:
            return
        self.first[source] += ((1.0 if hits > 0 else 0.0) - self.first[source]) * ACCEPT_RATE_STEP
        f = self.follow[source]
        for i in range(1, checked):
            f += ((1.0 if i < hits else 0.0) - f) * ACCEPT_RATE_STEP
        self.follow[source] = f
