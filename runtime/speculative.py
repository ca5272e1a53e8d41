"""Speculative decoding: drafters, the acceptance rule and the draft length (docs/speculative.md).

A decoding sequence that speculates runs, in one step of the target model, its last token plus
``k`` drafted tokens at the positions after it; the target's logits at those ``k + 1`` rows decide
how many drafts are accepted, and one more token (the target's own, at the first rejected row or
after the last draft) is always produced. The KV positions of rejected drafts are simply written
again by later steps (``Scheduler`` only counts accepted positions as computed).

- ``NgramDrafter``: prompt lookup (an earlier occurrence of the sequence's last n tokens, n = 3, 2,
  1, in its prompt and output: for n = 3 the one with the longest agreeing run before it, else the
  most recent; what follows it is the draft), falling back to an n-gram table shared by all
  requests (llama.cpp's ``ngram-mod``). No second model.
- ``DraftModelDrafter``: a second compiled artifact with the same vocabulary (e.g. the int4 build
  of the target) drafts greedily, batched over the speculating sequences, with its own KV cache.
- Acceptance: greedy requests accept a draft while it equals the target's argmax, so the output is
  the non-speculative one token for token. Sampled requests use the standard rejection rule for a
  deterministic drafter: accept draft ``d`` with probability ``p(d)``, otherwise sample from ``p``
  with ``d`` removed; every emitted token is then distributed exactly as ``p`` says.
- ``CostModel``: the target's step time for T = 1..16 tokens (and a few more), measured at load;
  the draft length of each sequence is picked from it and the sequence's running acceptance rates
  of the draft's source (first draft; each draft after an accepted one), and is 0 (no drafting)
  where drafting does not pay.
"""
from __future__ import annotations

import bisect
import heapq
import math
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from infeng_common.errors import InfengError

#: Rate of the running acceptance estimate (per drafted position checked).
ACCEPT_RATE_STEP = 0.15
#: A longer draft must raise the expected tokens per second of the step by this factor over the best
#: shorter one (or none) to be run.
MIN_GAIN = 1.02
NGRAM_ORDERS = (3, 2, 1)
SHARED_TABLE_BOUND = 1 << 20
#: Prompt lookup picks, among the last MAX_OCCURRENCES occurrences of the sequence's last 3 tokens,
#: the one whose preceding tokens agree longest with the sequence's (up to LONGEST_RUN more).
MAX_OCCURRENCES = 16
LONGEST_RUN = 16
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


# -- per-sequence state -----------------------------------------------------------------------
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


# -- drafters ---------------------------------------------------------------------------------
def run_before(tokens: list[int], a: int, b: int) -> int:
    """How many tokens before positions ``a`` and ``b`` agree, going back (at most LONGEST_RUN)."""
    m = 0
    while m < LONGEST_RUN and a - 1 - m >= 0 and tokens[a - 1 - m] == tokens[b - 1 - m]:
        m += 1
    return m


class NgramDrafter:
    """Prompt lookup over a sequence's own tokens, then the n-gram table shared by all sequences."""

    method = "ngram"

    def __init__(self) -> None:
        self.shared: dict[tuple, int] = {}

    def _index(self, tokens: list[int], st: SpecState) -> None:
        index, occurrences, shared = st.index, st.occurrences, self.shared
        if len(shared) > SHARED_TABLE_BOUND:
            shared.clear()
        top = NGRAM_ORDERS[0]
        for j in range(st.indexed, len(tokens)):
            if j >= top:
                key = tuple(tokens[j - top:j])
                occurrences.setdefault(key, []).append(j)
                shared[key] = tokens[j]
            for n in NGRAM_ORDERS[1:]:
                if j >= n:
                    index[tuple(tokens[j - n:j])] = j
        st.indexed = max(st.indexed, len(tokens))

    def propose(self, tokens: list[int], st: SpecState, k: int) -> tuple[list[int], int]:
        """Up to ``k`` drafted tokens after ``tokens`` and their source (SOURCE_TABLE, or the class of
        the prompt lookup's match: 1 + i where MATCH_CLASSES[i] or more of the last tokens agree)."""
        self._index(tokens, st)
        L = len(tokens)
        top = NGRAM_ORDERS[0]
        key = tuple(tokens[L - top:]) if L >= top else None
        seen = st.occurrences.get(key) if L > top else None
        if seen:
            # of the last few occurrences of the top-order n-gram, the one whose tokens before it
            # agree longest with the sequence's (the most recent among equals)
            j = max(seen[-MAX_OCCURRENCES:], key=lambda q: (run_before(tokens, q - top, L - top), q))
        else:
            j = None
            for n in NGRAM_ORDERS[1:]:
                if L > n and (j := st.index.get(tuple(tokens[L - n:]))) is not None:
                    break
        if j is not None:
            w = MATCH_CLASSES[-1]
            match = sum(a == b for a, b in zip(tokens[max(j - w, 0):j][::-1], tokens[L - w:][::-1]))
            source = sum(match >= c for c in MATCH_CLASSES)
            if source > 1 or key not in self.shared:    # a lone token's match is weaker than a 3-gram
                return tokens[j:j + k], source            # another request continued
        shared = self.shared
        draft: list[int] = []
        while key is not None and len(draft) < k:
            t = shared.get(key)
            if t is None:
                break
            draft.append(t)
            key = key[1:] + (t,)
        return draft, SOURCE_TABLE


class DraftModelDrafter:
    """A second Engine drafting greedily for all speculating sequences at once."""

    method = "draft"

    def __init__(self, engine, target_vocab: int):
        if engine.vocab_size != target_vocab:
            raise SpeculativeError(f"the draft model's vocabulary has {engine.vocab_size} tokens, the target's "
                                   f"{target_vocab}: a draft model must share the target's tokenizer")
        self.engine = engine
        engine.kv.prefix_cache = False

    def propose_batch(self, items: list[tuple[int, list[int], SpecState, int]]) -> list[list[int]]:
        """``items``: (seq_id, tokens, state, k). Greedy drafts of length k for each, in ``max k``
        batched draft steps (the first also catches the draft cache up with the true tokens)."""
        eng, kv = self.engine, self.engine.kv
        drafts: list[list[int]] = [[] for _ in items]
        live = []
        tokens_run, positions, slots, rows = [], [], [], []
        for i, (seq_id, tokens, st, k) in enumerate(items):
            L = len(tokens)
            valid = st.dm_valid
            if st.dm_pending is not None:          # drafted tokens the target accepted are true now
                start, drafted = st.dm_pending
                for j, t in enumerate(drafted):
                    if start + j < L - 1 and tokens[start + j] == t:
                        valid = start + j + 1
                    else:
                        break
                st.dm_pending = None
            valid = min(valid, L - 1)
            try:
                kv.ensure(seq_id, L + k - 1)
            except InfengError:
                continue
            slot = kv.slot_of[seq_id]
            tokens_run.extend(tokens[valid:L])
            positions.extend(range(valid, L))
            slots.extend([slot] * (L - valid))
            rows.append(len(tokens_run) - 1)
            st.dm_valid = L
            live.append(i)
        if not live:
            return drafts
        logits = eng.forward(np.array(tokens_run, dtype=np.int32), np.array(positions, dtype=np.int32),
                             np.array(slots, dtype=np.int32), np.array(rows, dtype=np.int32))
        last = logits.argmax(axis=1).tolist()
        for i, t in zip(live, last):
            drafts[i].append(t)
        step = 1
        while True:
            active = [i for i in live if items[i][3] > step]
            if not active:
                break
            toks = [drafts[i][-1] for i in active]
            pos = [len(items[i][1]) + step - 1 for i in active]
            sl = [kv.slot_of[items[i][0]] for i in active]
            logits = eng.forward(np.array(toks, dtype=np.int32), np.array(pos, dtype=np.int32),
                                 np.array(sl, dtype=np.int32), np.arange(len(active), dtype=np.int32))
            for i, t in zip(active, logits.argmax(axis=1).tolist()):
                drafts[i].append(t)
            step += 1
        for i in live:
            seq_id, tokens, st, k = items[i]
            st.dm_pending = (len(tokens), drafts[i][:-1])     # KV written for all but the last draft
        return drafts

    def release(self, seq_id: int) -> None:
        self.engine.kv.free(seq_id)


# -- cost ----------------------------------------------------------------------------------------
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


def _mean_length(seqs: list) -> float:
    return sum(len(seq.tokens) for seq in seqs) / len(seqs)


# -- the speculator ----------------------------------------------------------------------------
@dataclass
class SpecStats:
    drafts: int = 0                 # sequences x steps that ran drafted tokens
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0         # tokens produced by verification steps (accepted + 1 each)


class Speculator:
    """Drafter, cost curves and acceptance bookkeeping of one engine loop."""

    def __init__(self, config: SpeculativeConfig, engine, draft_engine=None, cost: CostModel | None = None):
        """``cost``: the target's step-cost curve to use instead of measuring it (an n-gram replay
        of recorded outputs, bench/speculative.py ``--replay``); ``engine`` may then be None."""
        self.config = config
        if config.method == "draft":
            if draft_engine is None:
                from .engine import Engine

                draft_engine = Engine(config.draft, threads=engine.threads, max_seqs=engine.kv.max_seqs,
                                      max_context=engine.max_context)
            self.drafter = DraftModelDrafter(draft_engine, engine.vocab_size)
        else:
            self.drafter = NgramDrafter()
        self.cost: CostModel | None = cost
        self.draft_cost: CostModel | None = None
        if config.adaptive and cost is None:
            self.cost = CostModel.measure(engine)
            if config.method == "draft":
                self.draft_cost = CostModel.measure(self.drafter.engine, points=(1, 2, 4, 8, 16))
        self.stats = SpecStats()
        self.step_no = 0

    def state(self) -> SpecState:
        return SpecState()

    def forget_requests(self) -> None:
        """Drop what earlier requests taught the drafter (the shared n-gram table): a benchmark that
        runs a prompt again must not draft from the previous run's output."""
        if self.drafter.method == "ngram":
            self.drafter.shared.clear()

    def propose(self, seqs: list, caps: list[int], base_tokens: int, decodes: int) -> list[list[int]]:
        """Drafts for the decoding sequences ``seqs`` (each with a ``spec`` state), at most
        ``caps[i]`` tokens each, for a step that already runs ``base_tokens`` rows."""
        self.step_no += 1
        max_draft = self.config.max_draft
        if self.drafter.method == "ngram":
            proposals, sources = [], []
            for seq, cap in zip(seqs, caps):
                st = seq.spec
                tokens = seq.tokens
                probe = st.probe
                if probe is not None:
                    pos, tok, src = probe
                    if pos < len(tokens):
                        st.learn(src, int(tokens[pos] == tok), 1)
                    st.probe = None
                if cap <= 0:
                    proposals.append([])
                    sources.append(SOURCE_TABLE)
                    continue
                draft, source = self.drafter.propose(tokens, st, min(cap, max_draft))
                proposals.append(draft)
                sources.append(source)
            if self.cost is None:
                lengths = [len(d) for d in proposals]
            else:
                accept = [seq.spec.first[s] if d else 0.0 for seq, d, s in zip(seqs, proposals, sources)]
                follow = [seq.spec.follow[s] for seq, s in zip(seqs, sources)]
                lengths = choose_lengths(self.cost, base_tokens, decodes, accept, [len(d) for d in proposals],
                                         follow=follow, context=_mean_length(seqs))
            out = []
            for seq, draft, source, k in zip(seqs, proposals, sources, lengths):
                st = seq.spec
                st.order = source
                if k == 0 and draft:                 # not run: check the first draft for free later
                    st.probe = (len(seq.tokens), draft[0], source)
                out.append(draft[:k])
            return out
        # draft model: lengths first (drafting costs), then one batched draft
        source = SOURCE_DRAFT
        if self.cost is None:
            lengths = [min(c, max_draft) for c in caps]
        else:
            accept = [seq.spec.first[source] for seq in seqs]
            follow = [seq.spec.follow[source] for seq in seqs]
            capped = [min(c, max_draft) for c in caps]
            lengths = choose_lengths(self.cost, base_tokens, decodes, accept, capped, self.draft_cost, follow,
                                     _mean_length(seqs))
            if not any(lengths) and self.step_no % 16 == 0:   # probe now and then: acceptance may have risen
                lengths = [min(1, c) for c in capped]
        items = [(seq.seq_id, seq.tokens, seq.spec, k) for seq, k in zip(seqs, lengths) if k > 0]
        if not items:
            return [[] for _ in seqs]
        drafted = iter(self.drafter.propose_batch(items))
        out = []
        for seq, k in zip(seqs, lengths):
            seq.spec.order = source
            out.append(next(drafted)[:k] if k > 0 else [])
        return out

    def observe(self, tokens: int, context: float, seconds: float) -> None:
        """The engine loop ran a forward step of ``tokens`` rows, every one with logits (decodes and
        verifications only), over sequences ``context`` tokens long on average, in ``seconds``."""
        if self.cost is not None:
            self.cost.observe(tokens, context, seconds)

    def verified(self, seq, drafted: int, accepted: int) -> None:
        """A verification step of ``seq`` ran ``drafted`` drafts and accepted ``accepted``."""
        st = seq.spec
        st.learn(st.order, accepted, min(accepted + 1, drafted))
        st.drafted += drafted
        st.accepted += accepted
        st.steps += 1
        s = self.stats
        s.drafts += 1
        s.draft_tokens += drafted
        s.accepted_tokens += accepted
        s.emitted_tokens += accepted + 1

    def release(self, seq) -> None:
        """``seq`` stopped running (finished or preempted): its draft KV goes."""
        if self.drafter.method == "draft":
            self.drafter.release(seq.seq_id)
            seq.spec.dm_valid = 0
            seq.spec.dm_pending = None

    def close(self) -> None:
        if self.drafter.method == "draft":
            self.drafter.engine.close()
