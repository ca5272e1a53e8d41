"""Unit tests of the serving runtime below HTTP: the KV block manager and its prefix cache, the
scheduler's step plans (token budget, chunked prefill, priorities, preemption, admission bound,
cancellation), consumer-side text (stop strings, logprob entries), chat templates against
transformers, and the offline ``LLM`` API against one-at-a-time generation."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from _serving import AloneReference, served_artifact
from infeng_runtime.kv_cache import BlockAllocator, KVCacheFull, block_hashes
from infeng_common.errors import InfengError
from infeng_runtime.sampling import SamplingParams, sample
from infeng_runtime.scheduler import QueueFull, Request, RequestError, Scheduler, SeqOutput

BS = 4


# -- KV block manager -------------------------------------------------------------------------
def test_hash_chain_depends_on_prefix_and_namespace():
    a = block_hashes(list(range(12)), BS)
    assert len(a) == 3 and len(set(a)) == 3
    assert block_hashes(list(range(13)), BS) == a                  # a partial block has no hash
    b = block_hashes([99] + list(range(1, 12)), BS)
    assert b[0] != a[0] and b[1] != a[1], "a block's hash covers everything before it"
    assert block_hashes(list(range(12)), BS, namespace="lora-x")[0] != a[0]
    known = a[:1]
    assert block_hashes(list(range(12)), BS, known=known) == a and known == a


def test_allocator_shares_published_blocks_and_evicts_lru():
    kv = BlockAllocator(n_blocks=6, block_size=BS, max_seqs=4, max_context=64, cache_blocks=6)
    tokens = list(range(10))
    hashes = block_hashes(tokens, BS)
    kv.ensure(0, 10)                                                # 3 blocks
    kv.register(0, hashes, 2)                                       # two full blocks computed
    assert kv.cached_blocks == 2 and kv.used_blocks == 3
    found = kv.lookup(hashes)
    assert found == kv.blocks_of[0][:2]
    kv.claim(1, found, queried=2)
    assert kv.hits == 2 and kv.queries == 2
    assert kv.block_table[kv.slot_of[1], :2].tolist() == found
    assert [kv.refcount[b] for b in found] == [2, 2]
    kv.free(0)
    assert kv.used_blocks == 2                                      # seq 1 still holds the shared pair
    kv.free(1)
    assert kv.used_blocks == 0 and kv.cached_blocks == 2 and kv.num_free == 6
    # a new owner needing every block evicts the cached ones, the tail of the chain first
    kv.ensure(2, 16)
    assert kv.evictions == 0 and kv.cached_blocks == 2
    kv.ensure(2, 20)
    assert kv.evictions == 1 and kv.lookup(hashes) == found[:1]
    kv.ensure(2, 24)
    assert kv.cached_blocks == 0
    with pytest.raises(KVCacheFull):
        kv.ensure(3, 4)


def test_prefix_cache_keeps_at_most_its_share_committed():
    # every distinct prompt publishes its full blocks; never-used ids (committed memory) are taken
    # only while the cache keeps fewer than cache_blocks unreferenced blocks
    kv = BlockAllocator(n_blocks=400, block_size=BS, max_seqs=4, max_context=64)
    assert kv.cache_blocks == 50
    peak = 0
    for prompt in range(60):
        ids = [prompt * 31 + i for i in range(4 * BS + 1)]          # 4 full blocks and a partial one
        for seq in (2 * prompt, 2 * prompt + 1):                    # two at once, the same prompt
            found = kv.lookup(block_hashes(ids, BS))
            if found:
                kv.claim(seq, found, queried=4)
            kv.ensure(seq, len(ids))
            kv.register(seq, block_hashes(ids, BS), 4)
            peak = max(peak, kv.used_blocks)
        kv.free(2 * prompt)
        kv.free(2 * prompt + 1)
        assert kv.fresh <= peak + kv.cache_blocks
    assert kv.fresh < kv.n_blocks and kv.evictions > 0 and kv.hits == 60 * 4
    assert kv.cached_blocks >= kv.cache_blocks - 4                  # the cache still keeps its share


def test_scheduler_commits_the_peak_in_use_plus_the_cache_share():
    sched = make_scheduler(n_blocks=200, budget=64)
    peak = 0
    for i in range(40):
        sched.add(request(f"r{i}", 13, max_new=2, start=i))         # distinct prompts, 3 full blocks
        while (plan := sched.schedule()) is not None:
            peak = max(peak, sched.kv.used_blocks)                   # planned: blocks held for the step
            logits = np.zeros((len(plan.logits_rows), VOCAB), dtype=np.float32)
            sched.update(plan, logits)
    assert sched.kv.cached_blocks > 0 and sched.kv.evictions > 0
    assert sched.kv.fresh <= peak + sched.kv.cache_blocks


def test_allocator_keeps_first_published_copy_and_can_be_disabled():
    kv = BlockAllocator(8, BS, 2, 32)
    hashes = block_hashes(list(range(8)), BS)
    kv.ensure(0, 8)
    kv.ensure(1, 8)
    kv.register(0, hashes, 2)
    kv.register(1, hashes, 2)                                       # same contents: stays private
    assert kv.lookup(hashes) == kv.blocks_of[0]
    kv.free(1)
    assert kv.num_free == 6 and kv.cached_blocks == 2
    off = BlockAllocator(8, BS, 2, 32, prefix_cache=False)
    off.ensure(0, 8)
    off.register(0, hashes, 2)
    assert off.lookup(hashes) == [] and off.cached_blocks == 0


def test_engine_step_api_unchanged():
    kv = BlockAllocator(4, BS, 2, 16)
    kv.ensure(5, 3)
    kv.ensure(5, 9)
    assert len(kv.blocks_of[5]) == 3 and kv.slot(5) == kv.slot_of[5]
    with pytest.raises(Exception, match="max context"):
        kv.ensure(5, 17)
    kv.free(5)
    assert kv.used_blocks == 0 and kv.free_slots


# -- scheduler --------------------------------------------------------------------------------
VOCAB = 32


def make_scheduler(n_blocks=64, max_seqs=4, budget=8, max_waiting=16, **kw) -> Scheduler:
    return Scheduler(BlockAllocator(n_blocks, BS, max_seqs, 256), eos_token_ids=[0], max_batched_tokens=budget,
                     max_waiting=max_waiting, **kw)


def request(rid: str, n_prompt: int, max_new: int = 4, priority: int = 0, start: int = 1, **kw) -> Request:
    ids = [(start + i) % (VOCAB - 1) + 1 for i in range(n_prompt)]
    return Request(rid, ids, SamplingParams(max_new_tokens=max_new), priority=priority, **kw)


def run_step(sched: Scheduler, next_token: int = 7):
    """Plan a step and feed logits that make every sampled row pick ``next_token``."""
    plan = sched.schedule()
    if plan is None:
        return None, []
    logits = np.zeros((len(plan.logits_rows), VOCAB), dtype=np.float32)
    logits[:, next_token] = 1.0
    return plan, sched.update(plan, logits)


def rows_of(plan) -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq, n in zip(plan.seqs, plan.counts):
        counts[seq.request.request_id] = counts.get(seq.request.request_id, 0) + n
    return counts


def test_chunked_prefill_under_token_budget_and_decode_first():
    sched = make_scheduler(budget=8)
    sched.add(request("long", 19))
    plan, outs = run_step(sched)
    assert rows_of(plan) == {"long": 8} and not outs                 # a chunk: no logits yet
    assert plan.positions.tolist() == list(range(8))
    plan, outs = run_step(sched)
    assert plan.positions.tolist() == list(range(8, 16))
    sched.add(request("short", 3, start=5))
    plan, outs = run_step(sched)                                     # prompt ends: sampled
    assert rows_of(plan) == {"long": 3, "short": 3} and len(outs) == 2
    assert plan.logits_rows.tolist() == [2, 5]
    plan, outs = run_step(sched)                                     # both decoding
    assert rows_of(plan) == {"long": 1, "short": 1}
    sched.add(request("big", 30, start=9))
    plan, _ = run_step(sched)
    # decodes come first and the new prompt gets what is left of the budget
    assert [s.request.request_id for s in plan.seqs] == ["long", "short", "big"]
    assert rows_of(plan) == {"long": 1, "short": 1, "big": 6}
    assert plan.decode_tokens == 2 and plan.prefill_tokens == 6


def test_priorities_then_fifo():
    sched = make_scheduler(max_seqs=1, budget=64)
    for rid, prio in (("b", 1), ("a", 0), ("c", 1), ("d", 0)):
        sched.add(request(rid, 3, max_new=1, priority=prio))
    order = []
    while sched.has_work:
        plan, outs = run_step(sched)
        order += [o.request.request_id for o in outs if o.finish_reason]
    assert order == ["a", "d", "b", "c"]


def test_a_greedy_client_cannot_take_every_slot():
    """A greedy client asking for the top priority with a backlog of requests: a bystander arriving
    later is served when the first slot frees, before the backlog drains; and a client with
    fresher (lower-ranked) requests is held to its share of the slots while another one waits."""
    sched = make_scheduler(max_seqs=4, budget=64, max_waiting=64)
    for i in range(12):
        sched.add(request(f"greedy-{i}", 3, max_new=4, priority=-1000, client="10.0.0.1"))
    run_step(sched)
    sched.add(request("bystander", 3, max_new=2, start=5, client="10.0.0.2"))
    finished: list[str] = []
    while sched.has_work:
        _, outs = run_step(sched)
        finished += [o.request.request_id for o in outs if o.finish_reason]
    assert finished.index("bystander") < 8          # after the first four greedy ones

    sched = make_scheduler(max_seqs=4, budget=64, max_waiting=64)
    sched.add(request("bystander", 3, max_new=2, n=8, client="10.0.0.2"))
    run_step(sched)                                  # four of its eight run
    for i in range(4):                               # ranks 0-3: before the bystander's waiting 4-7
        sched.add(request(f"greedy-{i}", 3, max_new=4, start=5, client="10.0.0.1"))
    while not any(s.request.client == "10.0.0.1" for s in sched.running):
        run_step(sched)
    assert sum(s.request.client == "10.0.0.1" for s in sched.running) == 2     # its share: 4 // 2


def test_admission_bound_and_request_checks():
    sched = make_scheduler(max_waiting=3)
    sched.add(request("x", 3, n=2))
    with pytest.raises(QueueFull):
        sched.add(request("y", 3, n=2))
    sched.add(request("z", 3))
    with pytest.raises(RequestError, match="context"):
        sched.add(request("long", 250, max_new=10))
    with pytest.raises(RequestError, match="empty"):
        sched.add(Request("e", [], SamplingParams()))
    with pytest.raises(RequestError, match="in flight"):
        sched.add(request("z", 3))


def test_abort_waiting_and_running():
    sched = make_scheduler(max_seqs=1)
    sched.add(request("run", 3, max_new=50))
    sched.add(request("wait", 3, max_new=50))
    run_step(sched)
    assert sched.num_waiting == 1 and len(sched.running) == 1
    outs = sched.abort("wait")
    assert [(o.request.request_id, o.finish_reason) for o in outs] == [("wait", "abort")]
    assert sched.num_waiting == 0
    sched.abort("run")
    assert not sched.has_work and sched.kv.used_blocks == 0 and not sched.requests
    assert run_step(sched)[0] is None


def test_eos_and_max_tokens_finish():
    sched = make_scheduler()
    sched.add(request("eos", 3, max_new=10))
    _, outs = run_step(sched, next_token=0)
    assert outs[0].finish_reason == "stop" and outs[0].token is None
    sched.add(request("len", 3, max_new=2))
    run_step(sched)
    _, outs = run_step(sched)
    assert outs[0].finish_reason == "length" and outs[0].token == 7
    assert sched.kv.used_blocks == 0


def test_preemption_recomputes_latest_lowest_priority():
    # 6 blocks of 4 tokens; two sequences of 8-token prompts growing to 12 tokens each: 3+3 blocks fit,
    # a third sequence forces the latest to give way.
    sched = make_scheduler(n_blocks=6, max_seqs=3, budget=64)
    sched.add(request("first", 8, max_new=8, start=1))
    sched.add(request("second", 8, max_new=8, start=11))
    sched.add(request("third", 7, max_new=8, start=21))
    finished, preempted_seen = {}, False
    for _ in range(100):
        if not sched.has_work:
            break
        plan, outs = run_step(sched)
        preempted_seen |= sched.stats.preemptions > 0
        for o in outs:
            if o.finish_reason:
                finished[o.request.request_id] = o.finish_reason
    assert finished == {"first": "length", "second": "length", "third": "length"}
    assert preempted_seen and sched.kv.used_blocks == 0


def test_prefix_cache_in_scheduler():
    sched = make_scheduler(budget=64)
    sched.add(request("a", 10, max_new=1))
    run_step(sched)
    sched.add(request("b", 10, max_new=1))                           # same prompt: two full blocks cached
    plan, _ = run_step(sched)
    assert plan.positions.tolist() == [8, 9] and sched.kv.hits == 2
    assert sched.stats.computed_prompt_tokens == 12


class FixedSlots:
    """An ``AdapterPool`` whose adapters sit in fixed slots (None: never a free slot)."""

    def __init__(self, slots: dict[str, int | None]):
        self.slots, self.held, self.running = slots, {}, set()
        self.served = slots

    def namespace(self, name):
        return name

    def hold(self, name, n):
        self.held[name] = self.held.get(name, 0) + n

    def drop(self, name, n):
        self.held[name] -= n

    def acquire(self, name, seq_id):
        if self.slots[name] is not None:
            self.running.add(seq_id)
        return self.slots[name]

    def release(self, seq_id):
        self.running.remove(seq_id)


def test_adapter_slots_per_token():
    pool = FixedSlots({"x": 2, "y": 0})
    sched = make_scheduler(budget=64, adapters=pool)
    sched.add(request("base", 2))
    sched.add(request("x", 3, adapter="x", max_new=1))
    sched.add(request("y", 1, adapter="y", max_new=1))
    assert pool.held == {"x": 1, "y": 1}
    plan, _ = run_step(sched)
    assert plan.adapter_slots.tolist() == [-1, -1, 2, 2, 2, 0]
    assert pool.held == {"x": 0, "y": 0} and not pool.running          # finished: slots and holds given back
    busy = make_scheduler(adapters=FixedSlots({"x": None}))
    busy.add(request("w", 2, adapter="x"))
    assert busy.schedule() is None and busy.num_waiting == 1
    with pytest.raises(RequestError, match="the model 'x' does not exist"):
        make_scheduler().add(request("no-pool", 2, adapter="x"))
    with pytest.raises(RequestError, match="the model 'z' does not exist"):
        sched.add(request("unknown", 2, adapter="z"))


def test_non_finite_logits_fail_that_sequence_alone():
    sched = make_scheduler(budget=64)
    sched.add(request("greedy", 3))
    sched.add(Request("sampled", [9, 10, 11], SamplingParams(max_new_tokens=4, temperature=0.8, seed=1)))
    sched.add(request("fine", 3, start=5))
    plan = sched.schedule()
    logits = np.zeros((3, VOCAB), dtype=np.float32)
    logits[:, 7] = 1.0
    logits[0, 3] = np.nan                                            # greedy row: argmax finds the NaN
    logits[1, 4] = np.inf                                            # sampled row
    outs = {o.request.request_id: o for o in sched.update(plan, logits)}
    assert outs["greedy"].finish_reason == outs["sampled"].finish_reason == "error"
    assert "non-finite" in outs["greedy"].error
    assert outs["fine"].token == 7 and outs["fine"].finish_reason is None
    assert [s.request.request_id for s in sched.running] == ["fine"]
    assert sched.kv.used_blocks == 1


def test_tiny_temperature_samples_greedily_and_seeds_are_bounded():
    assert SamplingParams(temperature=1e-320).greedy and not SamplingParams(temperature=0.5).greedy
    logits = np.array([0.0, 3.0, 1.0], dtype=np.float32)
    assert sample(logits, SamplingParams(temperature=1e-320), np.random.default_rng(0)) == 1
    for bad in (-1, 2 ** 64):
        with pytest.raises(InfengError, match="seed"):
            SamplingParams(seed=bad)
    with pytest.raises(InfengError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    SamplingParams(seed=2 ** 64 - 1)


# -- consumer-side text -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("serve-artifact"))


@pytest.fixture(scope="module")
def tokenizer(artifact):
    from infeng_common.tokenizer import Tokenizer

    return Tokenizer(artifact)


def test_stop_string_across_tokens_is_held_back(tokenizer):
    from infeng_runtime.detokenize import ChoiceText

    prompt = tokenizer.encode("Once upon a time")
    ids = tokenizer.encode("Once upon a time, there was a little girl named Lily")
    assert ids[:len(prompt)] == prompt
    ids = ids[len(prompt):]
    req = Request("r", prompt, SamplingParams())
    text = ChoiceText(tokenizer, prompt, stop=("girl na",), logprobs=True)
    seen = ""
    for t in ids:
        delta = text.push(SeqOutput(req, 0, t, logprob=-0.5))
        if delta:
            seen += delta.text
            assert "girl" not in seen or text.done
        if text.done:
            break
    assert seen == text.text == ", there was a little " and text.finish_reason == "stop"
    assert "".join(e.text for e in text.entries) == text.text


def test_chat_template_renders_like_transformers(tokenizer):
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    from infeng_runtime.chat import render_chat

    template = ("{%- set ns = namespace(n=0) -%}{{ bos_token }}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
                "<{{ m['role'] }}>{{ m['content'] | tojson }}\n"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}[{{ ns.n }}]")
    messages = [{"role": "system", "content": "Be brief, \"ok\"?"}, {"role": "user", "content": "héllo"}]
    want = chat_utils.render_jinja_template([messages], chat_template=template, add_generation_prompt=True,
                                            bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    want = want[0][0] if isinstance(want, tuple) else want[0]
    assert render_chat(tokenizer, messages, template=template) == want
    with pytest.raises(Exception, match="bad role"):
        render_chat(tokenizer, [{"role": "tool", "content": "x"}], template=template)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "a\\nb" in render_chat(tokenizer, parts, template=template)


# -- offline API and the threaded loop ----------------------------------------------------------
def test_offline_batch_equals_one_at_a_time(artifact):
    from infeng_runtime.llm import LLM

    prompts = ["Once upon a time", "The dog", "Lily and Tom went to the park. They", "A big red ball"] * 3
    llm = LLM(artifact, threads=1, max_seqs=6, max_batched_tokens=16)
    got = llm.generate(prompts, SamplingParams(max_new_tokens=20))
    ref = AloneReference(artifact)
    assert [c.text for c in got] == [ref(p, 20) for p in prompts]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 20 for c in got)
    stopped = llm.generate(["Once upon a time"], SamplingParams(max_new_tokens=40, stop=("Lily",)))[0]
    assert stopped.finish_reason == "stop" and stopped.text == ref("Once upon a time", 40).split("Lily")[0]
    tiny = LLM(artifact, threads=1, max_seqs=6, kv_blocks=6)
    again = tiny.generate(prompts, SamplingParams(max_new_tokens=20))
    assert [c.text for c in again] == [c.text for c in got]
    assert tiny.loop.scheduler.stats.preemptions > 0


def test_threaded_loop_cancels_and_frees(artifact):
    from infeng_runtime.engine import Engine
    from infeng_runtime.loop import EngineLoop

    loop = EngineLoop(Engine(artifact, threads=1, max_seqs=2)).start()
    got: list[SeqOutput] = []
    first = threading.Event()

    def sink(outs):
        got.extend(outs)
        first.set()

    ids = loop.engine.tokenizer.encode("Once upon a time")
    loop.submit(Request("r", ids, SamplingParams(max_new_tokens=400, ignore_eos=True), sink=sink))
    assert first.wait(30)
    loop.abort("r")
    deadline = time.monotonic() + 10
    while loop.snapshot()["running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    snap = loop.snapshot()
    loop.stop()
    assert got[-1].finish_reason == "abort" and len(got) < 400
    assert snap["running"] == 0 and snap["kv_blocks_used"] == 0
    assert not loop.alive


def test_more_adapters_than_slots(artifact, tmp_path):
    """Six adapters on an artifact with four slots: adapters are (re)loaded into slots as their
    sequences are admitted, and every output equals the adapter run alone."""
    from _serving import write_adapter
    from infeng_runtime.llm import LLM

    dirs = {f"x{i}": write_adapter(tmp_path / f"x{i}", seed=300 + i) for i in range(6)}
    llm = LLM(artifact, threads=1, max_seqs=3, adapters=dirs)
    names = [f"x{i % 6}" for i in range(12)]
    prompts = ["Once upon a time", "The dog ran"] * 6
    got = llm.generate(prompts, SamplingParams(max_new_tokens=8), adapter=names)
    for name, prompt, c in zip(names, prompts, got):
        assert c.text == AloneReference(artifact, {name: dirs[name]})(prompt, 8, name), name
    assert len(llm.engine.adapters.resident) <= 4 and set(llm.loop.adapters.served) == set(dirs)
