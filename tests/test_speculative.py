"""Speculative decoding (runtime/spec/, runtime/sampling/acceptance.py and the scheduler's verification path).

- the rejection rule and the whole scheduler path are distribution-exact: chi-square over many
  seeds on a 6-token Markov "model" whose logits depend on the row's input token only;
- greedy speculation gives the non-speculative tokens, token for token, on compiled stories260K
  (scalar kernels: each token row is computed alone, so the comparison is exact) with f32, int4
  weights and fht-int8 KV, with an adapter in a slot, alone and in a batch of 4, with n-gram drafts
  and with a draft model (the int4 build drafting for the f32 one);
- rejected positions never reach the prefix cache, non-finite logits fail their sequence alone,
  and ``infeng serve --speculative`` serves speculative and plain requests in one batch.
"""
from __future__ import annotations

import json
import math
import subprocess
import threading
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from _serving import STORIES, AloneReference, adapters, infeng_command, metric, running_server, served_artifact
from infeng_runtime.kv_cache import BlockAllocator
from infeng_runtime.sampling import SamplingParams, accept_greedy, accept_sampled, distribution
from infeng_runtime.scheduler import NON_FINITE, Request, Scheduler
from infeng_runtime.spec import (COST_OBSERVE_RATE, MATCH_CLASSES, SOURCE_TABLE, CostModel, NgramDrafter,
                                        SpecState, SpeculativeConfig, SpeculativeError, Speculator, choose_lengths,
                                        parse_speculative)

V = 6


# -- statistics -------------------------------------------------------------------------------
def chi_square_ok(observed: np.ndarray, expected: np.ndarray, z: float = 3.7) -> tuple[bool, float, float]:
    """Pearson's chi-square of ``observed`` against ``expected`` counts (cells under 5 expected
    pooled), against the upper 1e-4 quantile (Wilson-Hilferty) of its degrees of freedom."""
    observed, expected = observed.ravel().astype(float), expected.ravel().astype(float)
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < crit, stat, crit


def test_rejection_rule_is_distribution_exact():
    p = np.array([0.05, 0.4, 0.25, 0.2, 0.1, 0.0])
    n = 40_000
    for draft in (1, 4, 5):                       # likely, unlikely, impossible drafts
        counts = np.zeros(V)
        for seed in range(n):
            counts[accept_sampled(p, draft, np.random.default_rng(seed))] += 1
        ok, stat, crit = chi_square_ok(counts, p * n)
        assert ok, f"draft {draft}: chi-square {stat:.1f} over {crit:.1f}"
    assert accept_sampled(np.eye(V)[2], 2, np.random.default_rng(0)) == 2
    assert accept_greedy([3, 4, 9], [3, 4]) == 2 and accept_greedy([3, 1, 9], [3, 4]) == 1
    assert accept_greedy([0], []) == 0


# -- the scheduler over a Markov "model" ----------------------------------------------------------
TRANSITIONS = np.log(np.random.default_rng(7).dirichlet(np.full(V, 0.7), size=V)).astype(np.float32)


class FixedDrafter:
    """Drafts (last + 1, last + 2, last) mod V: sometimes right, sometimes not."""

    method = "ngram"

    def propose(self, tokens, st, k):
        last = tokens[-1]
        return [(last + 1) % V, (last + 2) % V, last][:k], 1


def markov_scheduler(max_seqs: int = 64, transitions: np.ndarray = TRANSITIONS, speculate: bool = True):
    kv = BlockAllocator(n_blocks=max_seqs * 4, block_size=4, max_seqs=max_seqs, max_context=16)
    sched = Scheduler(kv, [], max_batched_tokens=1024, max_waiting=1 << 20)
    if speculate:
        spec = Speculator(SpeculativeConfig("ngram", max_draft=3, adaptive=False), engine=None)
        spec.drafter = FixedDrafter()
        sched.speculator = spec

    def run(requests):
        for r in requests:
            sched.add(r)
        outs = []
        while sched.has_work:
            plan = sched.schedule()
            logits = transitions[plan.tokens[plan.logits_rows]]
            outs.extend(sched.update(plan, logits))
        return outs

    return sched, run


def generated(outs) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for o in outs:
        if o.token is not None:
            tokens.setdefault(o.request.request_id, []).append(o.token)
    return tokens


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)])
def test_sampled_speculation_is_distribution_exact(params):
    """Three tokens after [0] from 6,000 seeds: the joint distribution of the speculative runs
    against the chain rule over the sampler's own distribution."""
    sp = SamplingParams(max_new_tokens=3, **params)
    sched, run = markov_scheduler()
    n = 6000
    outs = run([Request(f"r{i}", [0], SamplingParams(max_new_tokens=3, seed=i, **params)) for i in range(n)])
    assert sched.speculator.stats.accepted_tokens > 1000 and sched.speculator.stats.draft_tokens > \
        sched.speculator.stats.accepted_tokens, "both branches of the rule must be exercised"
    counts = np.zeros((V, V, V))
    for toks in generated(outs).values():
        counts[tuple(toks)] += 1
    step = np.array([distribution(TRANSITIONS[t], sp) for t in range(V)])
    # P(x1, x2, x3) = p(x1 | 0) p(x2 | x1) p(x3 | x2)
    expected = n * np.einsum("a,ab,bc->abc", step[0], step, step)
    ok, stat, crit = chi_square_ok(counts, expected)
    assert ok, f"chi-square {stat:.1f} over {crit:.1f}"


def test_greedy_markov_exact_and_nonfinite_fails_its_sequence_alone():
    t = np.full((V, V), -5.0, dtype=np.float32)
    t[1, 4] = t[2, 3] = t[3, 2] = t[0, 1] = t[5, 0] = 0.0
    t[4] = np.nan                                       # any row whose input is 4
    _, run = markov_scheduler(transitions=t)
    outs = run([Request("a", [0], SamplingParams(max_new_tokens=8)),
                Request("b", [2], SamplingParams(max_new_tokens=8))])
    got = generated(outs)
    assert got["b"] == [3, 2, 3, 2, 3, 2, 3, 2]
    fail = [o for o in outs if o.request.request_id == "a" and o.finish_reason]
    assert [o.finish_reason for o in fail] == ["error"] and fail[0].error == NON_FINITE
    assert got["a"] == [1, 4], "tokens before the non-finite row are still emitted"


def test_rejected_positions_are_never_published():
    """Blocks are published only when every position in them was accepted: each published block's
    hash is the hash of the tokens the sequence really has there."""
    from infeng_runtime.kv_cache import block_hashes

    sched, run = markov_scheduler(max_seqs=4)
    outs = run([Request(f"r{i}", [i % V], SamplingParams(max_new_tokens=12, temperature=1.0, seed=i))
                for i in range(4)])
    assert sched.speculator.stats.draft_tokens > sched.speculator.stats.accepted_tokens > 0
    real = {h for rid, toks in generated(outs).items() for h in block_hashes([int(rid[1:]) % V] + toks, 4)}
    assert sched.kv.cached and set(sched.kv.cached) <= real


# -- drafters, lengths, options -----------------------------------------------------------------
def test_ngram_prompt_lookup_and_shared_table():
    d = NgramDrafter()
    st = SpecState()
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    draft, source = d.propose(tokens, st, 4)
    assert draft == [8, 9, 1, 2] and source == 2            # the 3-gram 5 6 7 seen before: a match of 2-3
    draft, source = d.propose(tokens + [8, 9], st, 8)       # incremental index; what there is
    assert draft == [1, 2, 5, 6, 7, 8, 9] and source == 3   # 5 6 7 8 9 agree: 4-7 of the last 8
    draft, source = d.propose([3, 1, 2, 4, 1, 2], SpecState(), 2)
    assert draft == [4, 1] and source == 2                  # the most recent earlier 2-gram
    seq = [1, 2, 7, 8, 9, 10, 5, 6, 7, 8, 9, 11, 1, 2, 7, 8, 9]
    draft, _ = NgramDrafter().propose(seq, SpecState(), 2)
    assert draft == [10, 5]            # of the earlier 7 8 9, the one after 1 2 as here, not the latest
    other = SpecState()
    draft, source = d.propose([40, 41, 7, 8, 9], other, 3)  # not in its own tokens: the shared table
    assert source == SOURCE_TABLE and draft == [1, 2, 5]


def test_a_lone_token_match_gives_way_to_another_requests_3gram():
    """A sequence whose own tokens match only its last token drafts what another request had after
    its last 3 tokens; a longer own match is kept."""
    d = NgramDrafter()
    d.propose([1, 2, 3, 4, 5, 6], SpecState(), 4)
    assert d.propose([3, 9, 7, 2, 3, 4], SpecState(), 2) == ([5, 6], SOURCE_TABLE)   # own: 3 -> 9
    assert NgramDrafter().propose([3, 9, 7, 2, 3], SpecState(), 2) == ([9, 7], 1)   # alone: its own 1-gram


def test_forget_requests_drops_the_shared_table():
    spec = Speculator(SpeculativeConfig("ngram", adaptive=False), engine=None)
    spec.drafter.propose([1, 2, 3, 4, 5], spec.state(), 4)
    assert spec.drafter.propose([9, 2, 3, 4], spec.state(), 2) == ([5], SOURCE_TABLE)
    spec.forget_requests()
    assert spec.drafter.propose([9, 2, 3, 4], spec.state(), 2) == ([], SOURCE_TABLE)


def test_acceptance_is_learned_for_the_first_and_the_later_drafts():
    """The first draft of a step and the drafts after an accepted one have rates of their own: a
    copy in progress is often wrong at its first token and then right for many."""
    st = SpecState()
    first, follow = st.first[1], st.follow[1]
    st.learn(1, 0, 1)                                       # the first draft rejected: ``follow`` unseen
    assert st.first[1] < first and st.follow[1] == follow
    st.learn(1, 5, 6)                                       # 5 accepted, the 6th rejected
    assert st.first[1] > first * 0.85 and st.follow[1] > follow
    st.learn(1, 2, 2)                                       # all drafted accepted: no miss to count
    assert st.follow[1] > follow


def test_a_copy_in_progress_drafts_long():
    """Replayed over a fixed output that copies the prompt with a few edits, greedy acceptance and a
    step cost rising 20% a row: the copy runs are drafted at full length, and after a substituted
    token the copy is picked up again at once (the version before this drafted 5.9 tokens a step
    and 2.95 per unit of cost here)."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(100, 5000, 200).tolist()
    output = prompt[20:80] + [7] + prompt[81:140] + [8, 9] + prompt[140:190]
    cost = CostModel({t: 1 + 0.2 * (t - 1) for t in range(1, 17)})
    spec = Speculator(SpeculativeConfig("ngram", max_draft=8), engine=None, cost=cost)

    seq = SimpleNamespace(tokens=prompt + output[:1], spec=spec.state())
    done, steps, seconds = 1, 0, 0.0
    while done < len(output):
        draft = spec.propose([seq], [len(output) - done - 1], 1, 1)[0]
        accepted = accept_greedy(output[done:done + len(draft) + 1], draft)
        spec.verified(seq, len(draft), accepted)
        seq.tokens += output[done:done + accepted + 1]
        done, steps, seconds = done + accepted + 1, steps + 1, seconds + cost.at(1 + len(draft))
    assert (len(output) - 1) / steps > 6.3 and (len(output) - 1) / seconds > 3.0
    assert seq.spec.first[len(MATCH_CLASSES)] > 0.9       # the long-match source learned it is right


def test_choose_lengths_follows_cost_and_acceptance():
    flat = CostModel({1: 1.0, 8: 1.0, 16: 2.0, 64: 8.0})
    steep = CostModel({1: 1.0, 2: 2.0, 16: 16.0})
    assert choose_lengths(flat, 1, 1, [0.9], [8]) == [7]     # free rows: draft while it may pay
    assert choose_lengths(flat, 1, 1, [0.0], [8]) == [0]
    assert choose_lengths(steep, 1, 1, [0.9], [8]) == [0]    # every row costs a whole step: never
    assert choose_lengths(flat, 40, 40, [0.9] * 40, [8] * 40) == [0] * 40   # a large batch is compute-bound
    rising = CostModel({t: 1 + 0.2 * (t - 1) for t in range(1, 17)})
    assert choose_lengths(rising, 1, 1, [0.3], [8]) == [1]   # each further draft as unlikely as the first
    assert choose_lengths(rising, 1, 1, [0.3], [8], follow=[0.95]) == [3]   # once right, likely right on


def test_a_long_context_makes_drafted_rows_dearer():
    """The cost curve measured deep into a sequence is blended in by context length: where every
    drafted row attends to a long context, drafts are shorter."""
    cost = CostModel({t: 1.0 + 0.05 * (t - 1) for t in range(1, 17)},
                     {t: 1.2 + 0.5 * (t - 1) for t in range(1, 17)}, depth=1000)
    assert cost.at(4) == pytest.approx(1.15) and cost.at(4, 1000) == pytest.approx(2.7)
    assert cost.at(4, 500) == pytest.approx(1.925)
    assert choose_lengths(cost, 1, 1, [0.6], [8], follow=[0.8]) == [6]
    assert choose_lengths(cost, 1, 1, [0.6], [8], follow=[0.8], context=1000) == [1]


def test_steps_run_correct_a_cost_curve_measured_under_load():
    """A curve measured while something else ran (flat: every T as dear as T = 1 was then) makes
    drafts look free; the steps the loop runs correct it per row count, a row count not run yet
    taking the ratio interpolated between those that were, and drafting stops where it does not pay."""
    noisy = CostModel({t: 2.0 for t in range(1, 17)})
    assert choose_lengths(noisy, 1, 1, [0.15], [8])[0] > 0              # believes extra rows are free
    for _ in range(3):
        noisy.observe(1, 100.0, 1.0)                                        # the quiet machine's steps
        noisy.observe(3, 100.0, 1.5)
    assert noisy.at(1) == pytest.approx(1.0) and noisy.at(3, 100.0) == pytest.approx(1.5)
    assert noisy.at(2) == pytest.approx(1.25) and noisy.at(8) == pytest.approx(1.5)  # between / beyond those seen
    assert choose_lengths(noisy, 1, 1, [0.15], [8]) == [0]
    steady = CostModel({1: 1.0, 2: 1.2})
    for seconds in [2.0] * 20 + [1.0]:
        steady.observe(1, 0.0, seconds)
    assert steady.at(1) == pytest.approx(2.0 - COST_OBSERVE_RATE)     # a running average after 20 steps
    steady.observe(2, 0.0, float("nan"))
    assert steady.at(2) == pytest.approx(1.2 * steady.at(1))          # a broken timing is ignored


def test_cost_measured_at_the_start_and_deep_into_a_sequence():
    class Engine:
        max_tokens = 4096

        def __init__(self, max_context):
            self.kv = BlockAllocator(n_blocks=max_context // 16, block_size=16, max_seqs=2, max_context=max_context)
            self.starts = set()

        def forward(self, tokens, positions, slots, rows):
            self.starts.add((len(tokens), int(positions[0])))

    engine = Engine(2048)
    cost = CostModel.measure(engine, points=(1, 2, 3, 4), repeats=1)
    assert cost.depth == 1024 and cost.deep is not None
    assert engine.starts == {(1, 0), (2, 0), (3, 0), (4, 0), (1, 1024), (2, 1024), (4, 1024)}
    assert engine.kv.num_free == engine.kv.n_blocks                  # the scratch sequence is gone
    small = Engine(96)
    assert CostModel.measure(small, points=(1, 64), repeats=1).deep is None   # no room to go deep


def test_parse_speculative(tmp_path):
    assert parse_speculative(None) is None and parse_speculative("off") is None
    assert parse_speculative("ngram") == SpeculativeConfig("ngram")
    assert parse_speculative("ngram:4").max_draft == 4
    c = parse_speculative(f"draft:{tmp_path}:3")
    assert c.method == "draft" and c.draft == tmp_path and c.max_draft == 3
    assert parse_speculative(f"draft:{tmp_path}").max_draft == 8
    assert parse_speculative("ngram:4:fixed") == SpeculativeConfig("ngram", max_draft=4, adaptive=False)
    assert not parse_speculative(f"draft:{tmp_path}:fixed").adaptive
    for bad in ("eagle", "draft:", "ngram:x", "ngram:0", "off:fixed"):
        with pytest.raises(SpeculativeError):
            parse_speculative(bad)


# -- compiled models: greedy exactness -----------------------------------------------------------
PROMPTS = ["Once upon a time", "The dog", "Lily and Tom went to the park. Lily and Tom", "One day, a little"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("spec-artifact"))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    return adapters(tmp_path_factory.mktemp("spec-adapters"))


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    from infeng_compiler.compile import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("spec-variants")
    out = {}
    for name, opts in {"int4": CompileOptions(target="scalar", quant="int4"),
                       "fht-int8": CompileOptions(target="scalar", kv="fht-int8"),
                       "fht-int8-window": CompileOptions(target="scalar", kv="fht-int8", kv_window=8)}.items():
        compile_model(STORIES, root / f"{name}.infeng", opts)
        out[name] = root / f"{name}.infeng"
    return out


def always(method: str = "ngram", **kw) -> SpeculativeConfig:
    """Draft whatever the drafter finds (no cost model): the tests need drafts to happen."""
    return SpeculativeConfig(method, adaptive=False, **kw)


def run_llm(path, spec, prompts, adapter=None, max_seqs=4, n=48, adapters_=None):
    from infeng_runtime.llm import LLM

    llm = LLM(path, threads=1, max_seqs=max_seqs, speculative=spec, adapters=adapters_)
    try:
        outs = llm.generate(prompts, SamplingParams(max_new_tokens=n), adapter=adapter)
        return [o.token_ids for o in outs], llm.loop.snapshot()
    finally:
        llm.close()


def test_greedy_ngram_is_exact_alone_batched_and_with_an_adapter(artifact, adapter_dirs):
    plain, _ = run_llm(artifact, None, PROMPTS)
    alone = [run_llm(artifact, always(), [p], max_seqs=1)[0][0] for p in PROMPTS]
    batched, snap = run_llm(artifact, always(), PROMPTS)
    assert alone == plain and batched == plain
    assert snap["spec_accepted_tokens"] > 20 and snap["spec_draft_tokens"] > snap["spec_accepted_tokens"]
    named = {"a1": adapter_dirs["a1"]}
    with_adapter, _ = run_llm(artifact, None, PROMPTS, adapter=[None, "a1", "a1", None], adapters_=named)
    spec_adapter, snap = run_llm(artifact, always(), PROMPTS, adapter=[None, "a1", "a1", None], adapters_=named)
    assert spec_adapter == with_adapter and with_adapter != plain
    assert snap["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("variant", ["int4", "fht-int8"])
def test_greedy_ngram_is_exact_with_int4_weights_and_fht_int8_kv(variants, variant):
    path = variants[variant]
    plain, _ = run_llm(path, None, PROMPTS)
    spec, snap = run_llm(path, always(), PROMPTS)
    assert spec == plain and snap["spec_accepted_tokens"] > 0
    assert [run_llm(path, always(), [PROMPTS[2]], max_seqs=1)[0][0]] == plain[2:3]


def test_kv_window_roll_back_is_bit_identical(variants):
    """With an f16 window (``--kv-window``), the ring keeps its positions across a roll-back of
    rejected drafts (the library tells a roll-back from a new sequence because the runtime frees a
    slot before handing it over, ife_slot_free): tokens and logprobs are those of the plain run,
    bit for bit, alone and in a batch."""
    from infeng_runtime.llm import LLM

    def run(spec, prompts, max_seqs=4):
        llm = LLM(variants["fht-int8-window"], threads=1, max_seqs=max_seqs, speculative=spec)
        try:
            outs = llm.generate(prompts, SamplingParams(max_new_tokens=64), logprobs=0)
            return [(o.token_ids, [e.logprob for e in o.logprobs]) for o in outs], llm.loop.snapshot()
        finally:
            llm.close()

    plain, _ = run(None, PROMPTS)
    batched, snap = run(always(), PROMPTS)
    assert batched == plain
    assert snap["spec_draft_tokens"] > snap["spec_accepted_tokens"] > 0, "drafts were rejected and rolled back"
    assert run(always(), PROMPTS[2:3], max_seqs=1)[0] == plain[2:3]


def test_kv_window_ring_is_not_rolled_back_into_another_sequence(variants):
    """A slot handed to another sequence that starts inside the span the previous owner's ring
    holds (after a shared prefix) must not read that ring: freeing the slot tells the library."""
    from infeng_runtime.engine import Engine

    path = variants["fht-int8-window"]
    rng = np.random.default_rng(5)
    b, c = (rng.integers(3, 500, 48).astype(np.int32) for _ in range(2))
    want = Engine(path, max_seqs=4).step(b, np.arange(48), np.zeros(48), np.array([47]))

    def shared_prefix_run(tell_library: bool) -> np.ndarray:
        engine = Engine(path, max_seqs=4)
        if not tell_library:
            engine.kv.on_slot_free = None
        engine.step(b[:32], np.arange(32), np.zeros(32), np.array([31]))     # seq 0: b's prefix
        engine.step(c, np.arange(48), np.ones(48), np.array([47]))          # seq 1: c up to 47, freed
        engine.free(1)
        slot = engine.kv.slot(2)
        assert slot == 1
        engine.kv.ensure(2, 48)
        blocks = 32 // engine.block_size                                    # b's prefix, shared
        engine.kv.block_table[slot, :blocks] = engine.kv.block_table[engine.kv.slot_of[0], :blocks]
        return engine.forward(b[32:], np.arange(32, 48, dtype=np.int32), np.full(16, slot, np.int32),
                              np.array([15], np.int32))

    def rel(x, y):
        return float(np.abs(x - y).max() / np.abs(y).max())

    told = rel(shared_prefix_run(True), want)          # measured 6e-4: positions 24..31 from the int8 store
    assert told < 0.02
    assert rel(shared_prefix_run(False), want) > 5 * told, "without the free the stale ring of c is read (7e-3)"


def test_greedy_draft_model_is_exact(artifact, variants):
    plain, _ = run_llm(artifact, None, PROMPTS)
    spec, snap = run_llm(artifact, always("draft", draft=variants["int4"], max_draft=4), PROMPTS)
    assert spec == plain
    assert snap["spec_accepted_tokens"] > 0.5 * snap["spec_draft_tokens"], "the int4 build agrees most of the time"


def test_prefix_cache_after_speculation_gives_the_same_tokens(artifact):
    """A request that continues a speculated one hits the blocks it published; its tokens are the
    plain ones (a rejected position in a published block would change them)."""
    from infeng_runtime.llm import LLM

    llm = LLM(artifact, threads=1, max_seqs=2, speculative=always())
    try:
        first = llm.generate([PROMPTS[2]], SamplingParams(max_new_tokens=40))[0]
        ids = llm.tokenizer.encode(PROMPTS[2]) + first.token_ids
        second = llm.generate([ids], SamplingParams(max_new_tokens=16))[0]
        assert second.cached_tokens >= 32
    finally:
        llm.close()
    plain, _ = run_llm(artifact, None, [ids], n=16)
    assert second.token_ids == plain[0]


# -- CLI and server ---------------------------------------------------------------------------------
def test_run_speculative_prints_the_plain_text(artifact):
    def run(*extra):
        out = subprocess.run([*infeng_command(), "run", str(artifact), PROMPTS[2], "-n", "32", "--threads", "1",
                              "--json", *extra], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    plain, spec = run(), run("--speculative", "ngram")
    assert spec["text"] == plain["text"] and spec.get("speculative", {}).get("method") == "ngram"
    bad = subprocess.run([*infeng_command(), "run", str(artifact), "x", "--speculative", "eagle"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "ngram" in bad.stderr


def test_server_serves_speculative_and_plain_requests_in_one_batch(artifact, adapter_dirs, tmp_path):
    ref = AloneReference(artifact, {"a1": adapter_dirs["a1"]})
    with running_server(artifact, "--speculative", "ngram:fixed", "--adapter", f"a1={adapter_dirs['a1']}",
                        log=tmp_path / "serve.log") as url:
        base = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        cases = [(p, m, s) for p in PROMPTS for m in (base, "a1") for s in (None, False, True)]
        results: dict[int, str] = {}

        def ask(i, prompt, model, speculative):
            body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0}
            if speculative is not None:
                body["speculative"] = speculative
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            results[i] = r.json()["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i, *case)) for i, case in enumerate(cases)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, (prompt, model, _) in enumerate(cases):
            assert results[i] == ref(prompt, 32, None if model == base else model), cases[i]
        text = httpx.get(f"{url}/metrics").text
        assert metric(text, "vllm:spec_decode_num_draft_tokens_total") >= \
            metric(text, "vllm:spec_decode_num_accepted_tokens_total") > 0
        assert metric(text, "infeng_spec_decode_accepted_tokens_total") > 0
        bad = httpx.post(f"{url}/v1/completions", json={"model": base, "prompt": "x",
                                                         "speculative": "yes please"})
        assert bad.status_code == 400
        # a json_schema chat request speculates too: the plain request's text, valid
        schema = GRAMMARS[0][1]
        texts = []
        for speculative in (False, True):
            r = httpx.post(f"{url}/v1/chat/completions", json={
                "model": base, "messages": [{"role": "user", "content": "Lily and Tom went to the park."}],
                "max_tokens": 160, "temperature": 0, "speculative": speculative,
                "response_format": {"type": "json_schema", "json_schema": {"name": "m", "schema": schema}}},
                timeout=120)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["message"]["content"])
        assert texts[0] == texts[1]
        check_valid([texts[1]], [("json", schema)])


# -- grammar-constrained requests speculate too ------------------------------------------------------
GRAMMARS = [("json", {"type": "object", "properties": {
                 "moods": {"type": "array", "items": {"enum": ["happy", "sad", "sleepy"]}, "minItems": 3,
                           "maxItems": 6},
                 "name": {"type": "string", "maxLength": 12}}, "required": ["moods", "name"],
                 "additionalProperties": False}),
            ("regex", r"(Lily and Tom (went|ran) to the (park|shop)\. ){2,4}"),
            ("choice", ["Once upon a time", "The dog", "One day, a little"]),
            ("grammar", ('start: NAME " and " NAME " went to the " PLACE "."\nNAME: "Lily" | "Tom"\n'
                         'PLACE: "park" | "shop" | "sea"'))]


def run_constrained(path, spec, params: SamplingParams, drafts: list | None = None) -> list[str]:
    """Every (prompt, grammar) of PROMPTS x GRAMMARS in one batch; the texts. ``drafts`` collects
    (drafted, allowed) of every draft checked against a grammar."""
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling.grammar import Constraint
    from infeng_runtime.structured import GrammarCompiler, GrammarSpec

    llm = LLM(path, threads=1, max_seqs=8, speculative=spec)
    grammars = GrammarCompiler(llm.tokenizer, llm.engine.vocab_size)
    tokens: dict[str, list[int]] = {}
    check = Constraint.check_draft

    def recording_check(self, index, draft):
        allowed = check(self, index, draft)
        drafts.append((len(draft), allowed))
        return allowed

    def sink(outs):
        for o in outs:
            if o.token is not None:
                tokens.setdefault(o.request.request_id, []).append(o.token)

    cases = [(p, g) for p in PROMPTS for g in GRAMMARS]
    try:
        if drafts is not None:
            Constraint.check_draft = recording_check
        for i, (prompt, (kind, value)) in enumerate(cases):
            llm.loop.submit(Request(f"r{i}", llm.tokenizer.encode(prompt), params,
                                    grammar=grammars.constraint(GrammarSpec(kind, value), 1), sink=sink))
        while llm.loop.has_work():
            llm.loop.run_once()
    finally:
        Constraint.check_draft = check
        llm.close()
    return [llm.tokenizer.decode(tokens.get(f"r{i}", [])) for i in range(len(cases))]


def check_valid(texts: list[str], grammars: list | None = None) -> None:
    """Each text against its grammar (default: those of ``run_constrained``'s cases)."""
    import re

    jsonschema = pytest.importorskip("jsonschema")
    for text, (kind, value) in zip(texts, grammars or [g for _ in PROMPTS for g in GRAMMARS]):
        if kind == "json":
            jsonschema.validate(json.loads(text), value)
        elif kind == "grammar":
            assert re.fullmatch(r"(Lily|Tom) and (Lily|Tom) went to the (park|shop|sea)\.", text), text
        elif kind == "regex":
            assert re.fullmatch(value, text), text
        else:
            assert text in value, text


def test_constrained_greedy_speculation_equals_plain_and_validates(artifact):
    """Drafts are cut at the first token the grammar rejects, each verification row is masked with
    the grammar's state after the drafts before it, and the matcher is rolled back for the rest:
    greedy outputs are the plain constrained ones, token for token, and all validate."""
    pytest.importorskip("llguidance")
    params = SamplingParams(max_new_tokens=160)
    plain = run_constrained(artifact, None, params)
    drafts: list[tuple[int, int]] = []
    spec = run_constrained(artifact, always(), params, drafts)
    assert spec == plain
    check_valid(spec)
    assert any(0 < allowed for _, allowed in drafts), "some drafts pass the grammar"
    assert any(allowed < drafted for drafted, allowed in drafts), "some drafts are cut by the grammar"


def test_constrained_sampled_speculation_validates(artifact):
    pytest.importorskip("llguidance")
    check_valid(run_constrained(artifact, always(), SamplingParams(max_new_tokens=160, temperature=1.0, seed=3)))


@pytest.fixture(scope="module")
def native_builds(tmp_path_factory):
    from infeng_compiler.compile import CompileOptions, compile_model

    root = tmp_path_factory.mktemp("spec-native")
    out = {}
    # one activation path in every step (act-precision auto switches at 17 rows, which a batch of
    # verifications can pass while plain decode does not: docs/quantization.md)
    act = {"act_precision": "int8"}
    for name, opts in {"int4": CompileOptions(target="native", quant="int4", **act),
                       "int4-fht-int8": CompileOptions(target="native", quant="int4", kv="fht-int8", **act),
                       "int4-f16-kv": CompileOptions(target="native", quant="int4", kv="f16", **act)}.items():
        compile_model(STORIES, root / f"{name}.infeng", opts)
        out[name] = root / f"{name}.infeng"
    return out


@pytest.mark.parametrize("variant", ["int4", "int4-fht-int8", "int4-f16-kv"])
@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_ngram_is_exact_on_native_builds(native_builds, variant, threads):
    """The host's best int4 kernels (AVX-512/VNNI linears, vector attention over f32, f16 and
    fht-int8 caches) compute a token row the same way at any row count, so verifying drafts in one
    step gives the one-by-one tokens and logprobs, bit for bit. (f32/f16/bf16 weights: the T = 1
    linear sums in other chains than the tiles, docs/speculative.md.)"""
    from infeng_runtime.llm import LLM

    def run(spec):
        llm = LLM(native_builds[variant], threads=threads, max_seqs=4, speculative=spec)
        try:
            outs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=96), logprobs=0)
            return [(o.token_ids, [e.logprob for e in o.logprobs]) for o in outs], llm.loop.snapshot()
        finally:
            llm.close()

    plain, _ = run(None)
    spec, snap = run(always())
    assert spec == plain
    assert snap["spec_accepted_tokens"] > 0
