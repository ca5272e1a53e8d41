"""The drafters: ``NgramDrafter`` (prompt lookup, then an n-gram table shared by all requests) and
``DraftModelDrafter`` (a second compiled artifact with the same vocabulary, drafting greedily)."""
from __future__ import annotations

import numpy as np

from infeng_common.errors import InfengError

from .config import SpeculativeError
from .state import MATCH_CLASSES, SOURCE_TABLE, SpecState


NGRAM_ORDERS = (3, 2, 1)
SHARED_TABLE_BOUND = 1 << 20
#: Prompt lookup picks, among the last MAX_OCCURRENCES occurrences of the sequence's last 3 tokens,
#: the one whose preceding tokens agree longest with the sequence's (up to LONGEST_RUN more).
MAX_OCCURRENCES = 16
LONGEST_RUN = 16


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
