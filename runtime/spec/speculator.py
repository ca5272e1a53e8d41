"""``Speculator``: what the scheduler asks of speculative decoding (a draft per sequence, the
verdicts, the step times), over a drafter, the cost model and each sequence's state."""
from __future__ import annotations

from dataclasses import dataclass

from .config import SpeculativeConfig
from .cost import CostModel, choose_lengths
from .drafters import DraftModelDrafter, NgramDrafter
from .state import SOURCE_DRAFT, SOURCE_TABLE, SpecState


def _mean_length(seqs: list) -> float:
    return sum(len(seq.tokens) for seq in seqs) / len(seqs)


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
                from ..engine import Engine

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
