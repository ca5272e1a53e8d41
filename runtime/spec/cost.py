"""The draft length: ``CostModel`` (the target's step time by token count, measured at load and
kept current) and ``choose_lengths`` (the draft lengths that raise expected tokens per second)."""
from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Sequence as Seq

import numpy as np

#: A longer draft must raise the expected tokens per second of the step by this factor over the best
#: shorter one (or none) to be run.
MIN_GAIN = 1.02


MEASURED_T = tuple(range(1, 17)) + (24, 32, 48, 64)
#: The step is also timed this many positions into a sequence, at these row counts.
DEEP_CONTEXT = 1024
#: The running correction of the cost curve by the steps run (CostModel.observe): the weight of the
#: newest step once 1 / COST_OBSERVE_RATE steps of that row count were seen.
COST_OBSERVE_RATE = 0.05
DEEP_T = (1, 2, 4, 8, 16, 32, 64)


class CostModel:
    """Seconds of one forward step as a function of its token rows (all of them with logits),
    linear between and beyond the measured points. With ``deep`` (the same step measured with its
    rows ``depth`` positions into a sequence), the cost at a context of ``c`` tokens moves from the
    first curve towards ``deep`` in proportion, ``c / depth``: every row attends to its context, so
    a drafted row costs more in a long sequence than at its start.

    The steps the engine loop then runs correct it (``observe``): per row count, the running ratio
    of their seconds to the curve's multiplies it; a row count not run yet takes the ratio
    interpolated between the nearest ones that were (beyond them, the nearest one's). A curve
    measured at load while something else ran (too flat, or too steep) is thus corrected by the
    steps themselves, not kept for the engine's life."""

    def __init__(self, seconds: dict[int, float], deep: dict[int, float] | None = None, depth: int = 0):
        ts = sorted(seconds)
        self.ts = np.array(ts, dtype=np.float64)
        self.cost = np.maximum.accumulate(np.array([seconds[t] for t in ts], dtype=np.float64))
        self._table = [self(t) for t in range(257)]
        self.deep = CostModel(deep) if deep and depth > 0 else None
        self.depth = depth
        self._ratio: dict[int, tuple[float, int]] = {}     # rows -> (observed / curve, steps seen)
        self._observed_rows: list[int] = []                  # the keys of _ratio, sorted

    def observe(self, tokens: int, context: float, seconds: float) -> None:
        """A step of ``tokens`` rows (each with logits), its sequences ``context`` tokens long on
        average, took ``seconds``: the ratio for that row count moves towards seconds / the curve's
        (the mean of the first 1 / COST_OBSERVE_RATE steps, then a running average)."""
        modelled = self._measured(tokens, context)
        if not (modelled > 0 and math.isfinite(seconds) and seconds > 0):
            return
        ratio, seen = self._ratio.get(tokens, (0.0, 0))
        if not seen:
            bisect.insort(self._observed_rows, tokens)
        rate = max(1.0 / (seen + 1), COST_OBSERVE_RATE)
        self._ratio[tokens] = (ratio + (seconds / modelled - ratio) * rate, seen + 1)

    def __call__(self, tokens: float) -> float:
        ts, cost = self.ts, self.cost
        if tokens <= ts[-1]:
            return float(np.interp(tokens, ts, cost))
        slope = (cost[-1] - cost[-2]) / (ts[-1] - ts[-2]) if len(ts) > 1 else cost[-1] / ts[-1]
        return float(cost[-1] + slope * (tokens - ts[-1]))

    def at(self, tokens: int, context: float = 0.0) -> float:
        """The step's seconds for ``tokens`` rows whose sequences are ``context`` tokens long."""
        seconds = self._measured(tokens, context)
        if not self._ratio:
            return seconds
        seen = self._ratio.get(tokens)
        if seen is not None:
            return seconds * seen[0]
        rows = self._observed_rows
        i = bisect.bisect(rows, tokens)
        if i == 0 or i == len(rows):                  # outside the row counts seen: the nearest one's
            return seconds * self._ratio[rows[min(i, len(rows) - 1)]][0]
        (a, ra), (b, rb) = (rows[i - 1], self._ratio[rows[i - 1]][0]), (rows[i], self._ratio[rows[i]][0])
        return seconds * (ra + (rb - ra) * (tokens - a) / (b - a))

    def _measured(self, tokens: int, context: float) -> float:
        base = self._table[tokens] if tokens < len(self._table) else self(tokens)
        if self.deep is None or context <= 0:
            return base
        return base + max(self.deep.at(tokens) - base, 0.0) * context / self.depth

    @classmethod
    def measure(cls, engine, points: Seq[int] = MEASURED_T, repeats: int = 3) -> CostModel:
        """Time ``engine``'s forward step for each T in ``points`` (a scratch sequence, logits on
        every row, best of ``repeats``), at positions from 0 and, for the points in DEEP_T, from
        DEEP_CONTEXT (or what the context allows); the KV blocks it used go back to the pool. The
        repeats are rounds over all the points, so a burst of load elsewhere slows one round of
        every T rather than every repeat of a few T (which the running maximum would carry to all
        larger T)."""
        kv = engine.kv
        points = [t for t in points if t <= min(engine.max_tokens, kv.max_context)]
        top = max(points)
        depth = min(DEEP_CONTEXT, kv.max_context - top)
        if depth < top or kv.blocks_needed(-1, depth + top) > kv.num_free:
            depth = 0                                       # no room for a deep curve
        runs = [(t, 0) for t in points] + [(t, depth) for t in points if depth and t in DEEP_T]
        scratch = -1
        kv.ensure(scratch, depth + top)
        try:
            slot = kv.slot_of[scratch]
            seconds = dict.fromkeys(runs, math.inf)
            for _ in range(repeats):
                for t, start in runs:
                    tokens = np.zeros(t, dtype=np.int32)
                    positions = np.arange(start, start + t, dtype=np.int32)
                    slots = np.full(t, slot, dtype=np.int32)
                    rows = np.arange(t, dtype=np.int32)
                    t0 = time.perf_counter()
                    engine.forward(tokens, positions, slots, rows)
                    seconds[t, start] = min(seconds[t, start], time.perf_counter() - t0)
        finally:
            kv.free(scratch)
        deep = {t: v for (t, start), v in seconds.items() if start}
        return cls({t: v for (t, start), v in seconds.items() if not start}, deep, depth)


def choose_lengths(cost: CostModel, base_tokens: int, decodes: int, accept: Seq[float], caps: Seq[int],
                   draft_cost: CostModel | None = None, follow: Seq[float] | None = None,
                   context: float = 0.0) -> list[int]:
    """Draft lengths that maximise expected tokens per second of the step: ``decodes`` tokens are
    produced anyway from ``base_tokens`` rows; a sequence's first draft adds ``accept`` expected
    tokens and its j-th ``accept * follow**(j-1)`` (``follow`` defaults to ``accept``), one row each.
    ``context``: the sequences' mean length (CostModel.at). Drafts are handed out greedily by
    marginal gain; a longer prefix is kept only if it beats the
    best shorter one (or no drafting) by MIN_GAIN, which keeps an over-hopeful estimate from
    stretching drafts for a sliver of expected gain."""
    n = len(caps)
    follow = accept if follow is None else follow
    k = [0] * n
    heap = [(-accept[i], i) for i in range(n) if caps[i] > 0 and accept[i] > 0]
    heapq.heapify(heap)
    expected, rows = float(decodes), base_tokens
    rounds = [0] * 33                             # draft steps of the draft model: sequences with k > r
    best_rate = expected / cost.at(rows, context)
    best: list[int] | None = None
    while heap:
        gain, i = heapq.heappop(heap)
        expected -= gain
        rows += 1
        rounds[k[i]] += 1
        k[i] += 1
        seconds = cost.at(rows, context)
        if draft_cost is not None:
            seconds += sum(draft_cost.at(c, context) for c in rounds if c)
        rate = expected / seconds
        if rate > best_rate * MIN_GAIN:
            best_rate, best = rate, list(k)
        if k[i] < caps[i] and follow[i] > 0:
            heapq.heappush(heap, (gain * follow[i], i))
    return best if best is not None else [0] * n
