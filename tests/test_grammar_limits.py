"""Bounded grammars (issue 34): the scan that refuses a constraint over a limit before anything
compiles it, grammar compiles in worker processes that are killed past their budget or replaced
when they crash, masks with a per-step and a total time budget (a late sequence is skipped, an
overdue one ends with an error, the others keep going), fair client ranks and shares, and the
exit watchdog of a shutdown. Generated grammars of growing depth, ambiguity and size; the server
end to end is tests/test_grammar_attacks.py.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("llguidance")

from _serving import STORIES, served_artifact  # noqa: E402
from infeng_runtime.grammar_limits import GrammarError, GrammarLimits, check_spec, grammar_shape, json_depth  # noqa: E402

LIMITS = GrammarLimits()
#: No bound the scan would hit: what the worker processes themselves must survive.
UNBOUNDED = GrammarLimits(max_bytes=10 ** 9, max_rules=10 ** 9, max_depth=10 ** 9, max_alternatives=10 ** 9,
                          max_choices=10 ** 9, compile_seconds=2.0)


def chain(depth: int, gbnf: bool = False) -> str:
    """``depth`` rules, each naming the next: the shape that overflows the compiler's stack."""
    if gbnf:
        return "\n".join(["root ::= r0"] + [f"r{i} ::= r{i + 1}" for i in range(depth)] + [f'r{depth} ::= "a"'])
    return "\n".join(["start: r0"] + [f"r{i}: r{i + 1}" for i in range(depth)] + [f'r{depth}: "a"'])


#: A few dozen bytes whose Earley rows grow with the output (each mask costs more than the last).
AMBIGUOUS = 'start: s\ns: s s | s s s | "a" | "b" | "ab" | ""'


# -- the scan -------------------------------------------------------------------------------------
@pytest.mark.parametrize("gbnf", [False, True])
@pytest.mark.parametrize("depth", [1, 10, 100, 1000, 10_000])
def test_chain_depth_is_measured_without_recursion(depth, gbnf):
    shape = grammar_shape(chain(depth, gbnf))
    assert shape.depth == depth + 2 and shape.rules == depth + 2


def test_shape_of_brackets_alternatives_and_recursion():
    assert grammar_shape("start: " + "(" * 300 + '"a"' + ")" * 300).depth == 301
    assert grammar_shape(AMBIGUOUS).alternatives == 6          # recursion is no compile-time depth
    assert grammar_shape(AMBIGUOUS).depth == 2
    gbnf = 'root ::= item ("," item)*\nitem ::= [a-z()]+ | "(" root ")"   # brackets in classes and strings'
    assert grammar_shape(gbnf) .depth == 3 and grammar_shape(gbnf).alternatives == 2
    lark = 'start: x+\nx: /[(]+/ | "((" | X\nX: "a" // ((( a comment'
    assert grammar_shape(lark).rules == 3 and grammar_shape(lark).depth == 3


def test_json_depth():
    assert json_depth(1) == 0 and json_depth({}) == 1 and json_depth({"a": [{"b": 1}]}) == 3
    deep: dict = {}
    for _ in range(10_000):
        deep = {"items": deep}
    assert json_depth(deep) == 10_001


def _refusal(kind, value, limits=LIMITS) -> str:
    with pytest.raises(GrammarError) as e:
        check_spec(kind, value, "structured_outputs." + kind, limits)
    assert e.value.param == "structured_outputs." + kind and e.value.code == "grammar_too_large"
    return str(e.value)


@pytest.mark.parametrize("kind, value, limit", [
    ("grammar", chain(LIMITS.max_depth), "depth"),
    ("grammar", chain(1500, gbnf=True), "number of grammar rules"),
    ("grammar", "start: " + " | ".join(f'"w{i}"' for i in range(2000)), "alternatives"),
    ("grammar", 'start: "' + "a" * 70_000 + '"', "grammar's size"),
    ("grammar", "start: " + "(" * 100 + '"a"' + ")" * 100, "depth"),
    ("choice", [f"w{i}" for i in range(100_000)], "number of choices"),
    ("choice", ["x" * 1000] * 100, "choices' total size"),
    ("regex", "(" * 100 + "a" + ")" * 100, "nesting depth"),
    ("regex", "a" * 70_000, "regex's size"),
    ("json", {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                               for i in range(1000)}}, "JSON schema's size"),
], ids=["depth", "rules", "alternatives", "bytes", "brackets", "choices", "choice-bytes", "regex-depth",
        "regex-bytes", "schema-bytes"])
def test_over_a_limit_is_refused_naming_it(kind, value, limit):
    message = _refusal(kind, value)
    assert limit in message and "the limit is" in message


def test_schema_nesting_refused():
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"type": "array", "items": schema}
    assert "nesting depth" in _refusal("json", schema)


@pytest.mark.parametrize("kind, value", [("grammar", chain(40)), ("grammar", AMBIGUOUS),
                                         ("choice", [f"w{i}" for i in range(1000)]), ("regex", "[a-z]{1,20}"),
                                         ("json", {"type": "object"})], ids=["chain", "ambiguous", "choice", "regex",
                                                                            "schema"])
def test_within_the_limits_passes(kind, value):
    check_spec(kind, value, "p", LIMITS)


def test_scan_is_cheap():
    t0 = time.perf_counter()
    grammar_shape(chain(5000))
    assert time.perf_counter() - t0 < 2.0          # linear: tens of ms here; a loose bound on a shared host


# -- worker processes -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workers():
    from infeng_runtime.grammar_worker import GrammarWorkers, TokenizerSpec
    from infeng_common.tokenizer import Tokenizer

    tok = Tokenizer(STORIES)
    pool = GrammarWorkers(TokenizerSpec(tok.hf.to_str(), 512, tuple(tok.eos_token_ids)), 2)
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def compiler(workers):
    from infeng_runtime.structured import GrammarCompiler
    from infeng_common.tokenizer import Tokenizer

    return GrammarCompiler(Tokenizer(STORIES), 512, UNBOUNDED, workers)


@pytest.mark.parametrize("depth", [10, 100, 300])      # the worker's 2 MiB stack holds ~500 (8 MiB: ~2,000)
def test_growing_depth_compiles_in_a_worker(compiler, depth):
    from infeng_runtime.structured import GrammarSpec

    c = compiler.constraint(GrammarSpec("grammar", chain(depth)), 2)
    assert c.ready(0, deadline=time.monotonic() + 30) and c.ready(1, deadline=time.monotonic() + 30)
    assert c.failure(0) is None and c.mask(0).sum() == 511       # only "a" may come first


def test_the_server_builds_matchers_on_an_explicit_stack(compiler, monkeypatch):
    """The in-process compile (the matcher) runs on a thread of COMPILE_STACK_BYTES, four times the
    worker's, whatever the platform's default; the process's default is left as it was."""
    import threading

    from infeng_runtime import structured
    from infeng_runtime.grammar_worker import WORKER_STACK_BYTES
    from infeng_runtime.structured import GrammarSpec

    seen: list[str] = []
    build = structured.on_compile_stack

    def spy(fn):
        def record():
            seen.append(threading.current_thread().name)
            return fn()
        return build(record)

    monkeypatch.setattr(structured, "on_compile_stack", spy)
    before = threading.stack_size()
    c = compiler.constraint(GrammarSpec("grammar", chain(300)), 1)
    assert c.ready(0, deadline=time.monotonic() + 30) and c.failure(0) is None
    assert seen == ["infeng-grammar-matcher"] and threading.stack_size() == before
    assert structured.COMPILE_STACK_BYTES == 4 * WORKER_STACK_BYTES >= 8 * 2 ** 20
    with pytest.raises(ZeroDivisionError):
        structured.on_compile_stack(lambda: 1 / 0)


def test_a_crashing_grammar_is_a_400_and_the_worker_is_replaced(compiler, caplog):
    from infeng_runtime.structured import GrammarSpec

    with caplog.at_level("ERROR", logger="infeng.grammar"):
        with pytest.raises(GrammarError) as e:        # a stack overflow in the worker (SIGSEGV)
            compiler.grammar(GrammarSpec("grammar", chain(20_000), "guided_grammar"))
    assert e.value.code == "grammar_crashed" and e.value.param == "guided_grammar"
    assert [r.message for r in caplog.records] == ["grammar compiler crashed"]
    with caplog.at_level("ERROR", logger="infeng.grammar"):
        with pytest.raises(GrammarError) as again:    # the same grammar again: refused without a compile
            compiler.grammar(GrammarSpec("grammar", chain(20_000), "guided_grammar"))
    assert again.value.code == "grammar_crashed" and len(caplog.records) == 1
    assert compiler.grammar(GrammarSpec("grammar", chain(30)))     # the replacement serves


def test_a_runaway_compile_is_killed_at_its_budget(compiler):
    from infeng_runtime.structured import GrammarSpec

    t0 = time.monotonic()
    with pytest.raises(GrammarError) as e:
        compiler.grammar(GrammarSpec("choice", [f"word{i}" for i in range(200_000)], "guided_choice"))
    elapsed = time.monotonic() - t0
    assert e.value.code == "grammar_too_expensive" and "2 s" in str(e.value)
    assert UNBOUNDED.compile_seconds <= elapsed < UNBOUNDED.compile_seconds + 3
    assert compiler.grammar(GrammarSpec("regex", "[0-9]{3}"))


def test_a_workers_start_never_counts_against_the_compile_budget(monkeypatch, caplog):
    """Workers start on the first grammar; a worker's start (about a second) is not held against a
    0.3 s budget, neither the first nor the replacement of one killed at its budget; a start that
    fails is logged and tried again."""
    import dataclasses

    from infeng_runtime import grammar_worker
    from infeng_runtime.grammar_worker import GrammarWorkers, TokenizerSpec
    from infeng_common.tokenizer import Tokenizer

    tok = Tokenizer(STORIES)
    real_worker, failures = grammar_worker._Worker, []

    def failing_once(*args):
        if not failures:
            failures.append(1)
            raise OSError("no more processes")
        return real_worker(*args)

    monkeypatch.setattr(grammar_worker, "_Worker", failing_once)
    tight = dataclasses.replace(UNBOUNDED, compile_seconds=0.3)
    pool = GrammarWorkers(TokenizerSpec(tok.hf.to_str(), 512, tuple(tok.eos_token_ids)), 1)
    try:
        assert not pool._all                                   # nothing started before a grammar comes
        with caplog.at_level("ERROR", logger="infeng.grammar"):
            assert pool.check("regex", "[0-9]{3}", "p", tight)
        assert [r.message for r in caplog.records] == ["grammar worker failed to start; retrying"]
        with pytest.raises(GrammarError) as e:
            pool.check("choice", [f"word{i}" for i in range(200_000)], "guided_choice", tight)
        assert e.value.code == "grammar_too_expensive"
        assert pool.check("regex", "[0-9]{3}", "p", tight)      # on the replacement, once it started
    finally:
        pool.close()


def test_grammar_workers_die_with_the_server(tmp_path):
    """A server killed outright (SIGKILL: no close) takes its grammar workers with it, the one
    busy in a long compile too (an idle one ends anyway when its pipe closes)."""
    import signal
    from pathlib import Path

    script = (f"import sys\nsys.path[:0] = {sys.path!r}\n"
              "from infeng_runtime.grammar_worker import GrammarWorkers, TokenizerSpec\n"
              "from infeng_runtime.grammar_limits import GrammarLimits\n"
              "from infeng_common.tokenizer import Tokenizer\n"
              f"tok = Tokenizer({str(STORIES)!r})\n"
              "pool = GrammarWorkers(TokenizerSpec(tok.hf.to_str(), 512, tuple(tok.eos_token_ids)), 2)\n"
              "pool.check('regex', 'a', 'p', GrammarLimits())\n"
              "import time\n"
              "while len(pool._all) < 2 or pool._starting: time.sleep(0.05)\n"
              "import threading\n"
              "long = GrammarLimits(max_bytes=10 ** 9, max_choices=10 ** 9, compile_seconds=600)\n"
              "threading.Thread(target=pool.check, args=('choice', [f'word{i}' for i in range(400_000)], 'p', long),"
              " daemon=True).start()\n"
              "time.sleep(1)\n"
              "print(' '.join(str(w.process.pid) for w in pool._all), flush=True)\n"
              "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def alive(pid: int) -> bool:                           # a zombie (killed, not yet reaped) is dead
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[1].split()[0] != "Z"

    deadline = time.monotonic() + 1.5              # less than the compile takes
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids)


def test_tool_parameters_are_held_to_the_depth_limit_not_the_wrapper():
    """tool_choice "required" wraps each function's parameters in the calls' array schema: the
    parameters' own depth is what the limit bounds (64 passes, 65 is refused)."""
    from infeng_runtime.grammar_limits import json_depth
    from infeng_runtime.structured import GrammarCompiler, GrammarSpec, tool_call_grammar
    from infeng_common.tokenizer import Tokenizer

    def schema(depth: int) -> dict:
        node: dict = {"type": "object"} if depth % 2 else {"type": "object", "properties": {}}
        while json_depth(node) < depth:
            node = {"type": "object", "properties": {"a": node}}
        assert json_depth(node) == depth
        return node

    class Workers:                                         # the shape check alone is under test
        def check(self, kind, value, param, limits):
            check_spec(kind, value, param, limits)
            return "start: /a/"

    compiler = GrammarCompiler(Tokenizer(STORIES), 512, LIMITS, Workers())
    for depth in (LIMITS.max_depth - 1, LIMITS.max_depth):
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema(depth)}}]
        spec = tool_call_grammar(tools, None)
        assert json_depth(spec.value) - json_depth(schema(depth)) == spec.wrapper_depth
        assert compiler.grammar(spec)
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema(LIMITS.max_depth + 1)}}]
    with pytest.raises(GrammarError, match="depth"):
        compiler.grammar(tool_call_grammar(tools, None))
    with pytest.raises(GrammarError, match="depth"):
        compiler.grammar(tool_call_grammar(tools, "f"))


def test_only_refusals_that_always_repeat_are_remembered():
    """A compile out of time (a busy machine) is tried again next time; a grammar over a limit is
    refused at once the second time, naming the second request's field."""
    from infeng_runtime.structured import GrammarCompiler, GrammarSpec
    from infeng_common.tokenizer import Tokenizer

    class Workers:
        def __init__(self, refusal: str):
            self.refusal, self.calls = refusal, 0

        def check(self, kind, value, param, limits):
            self.calls += 1
            if self.calls == 1:
                raise GrammarError(f"{param}: no good {{here}}", param, self.refusal)
            return "start: /a/"

    late = Workers("grammar_too_expensive")
    compiler = GrammarCompiler(Tokenizer(STORIES), 512, UNBOUNDED, late)
    with pytest.raises(GrammarError):
        compiler.grammar(GrammarSpec("regex", "a", "guided_regex"))
    assert compiler.grammar(GrammarSpec("regex", "a", "guided_regex")) and late.calls == 2

    large = Workers("grammar_too_large")
    compiler = GrammarCompiler(Tokenizer(STORIES), 512, UNBOUNDED, large)
    with pytest.raises(GrammarError):
        compiler.grammar(GrammarSpec("regex", "a", "guided_regex"))
    with pytest.raises(GrammarError) as again:
        compiler.grammar(GrammarSpec("regex", "a", "structured_outputs.regex"))
    assert str(again.value) == "structured_outputs.regex: no good {here}" and again.value.param == \
        "structured_outputs.regex" and again.value.code == "grammar_too_large" and large.calls == 1


# -- masks ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("grammar-artifact"))


def _run(artifact, slow: dict[str, float], mask_seconds: float, speculative: str | None = None,
         stats: dict | None = None) -> dict[str, tuple[list[int], str | None]]:
    """Four requests in one batch: ``plain`` unconstrained, ``json``, and each name of ``slow`` a
    JSON constraint whose every mask takes that many seconds; (tokens, error) per request (and the
    loop's snapshot into ``stats``)."""
    from infeng_runtime.grammar_limits import GrammarLimits
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams
    from infeng_runtime.scheduler import Request
    from infeng_runtime.sampling.grammar import Constraint
    from infeng_runtime.structured import GrammarCompiler, GrammarSpec

    from infeng_runtime.spec import parse_speculative

    llm = LLM(artifact, threads=1, max_seqs=8, speculative=parse_speculative(speculative))
    grammars = GrammarCompiler(llm.tokenizer, llm.engine.vocab_size, GrammarLimits(mask_seconds=mask_seconds))
    results: dict[str, tuple[list[int], str | None]] = {}

    def sink(outs):
        for o in outs:
            tokens, error = results.setdefault(o.request.request_id, ([], None))
            if o.token is not None:
                tokens.append(o.token)
            if o.error:
                results[o.request.request_id] = (tokens, o.error)

    def slowed(c: Constraint, seconds: float) -> Constraint:
        mask_of = c._mask_of

        def slow_mask(index, out):
            time.sleep(seconds)
            mask_of(index, out)
        c._mask_of = slow_mask
        return c

    params = SamplingParams(max_new_tokens=60)
    prompt = llm.tokenizer.encode("Once upon a time")
    spec = GrammarSpec("json", {"type": "object", "properties": {"name": {"type": "string"}}})
    try:
        llm.loop.submit(Request("plain", prompt, params, sink=sink))
        llm.loop.submit(Request("json", prompt, params, grammar=grammars.constraint(spec, 1), sink=sink))
        for name, seconds in slow.items():
            llm.loop.submit(Request(name, prompt, params, grammar=slowed(grammars.constraint(spec, 1), seconds),
                                    sink=sink))
        while llm.loop.has_work():
            llm.loop.run_once()
        if stats is not None:
            stats.update(llm.loop.snapshot())
    finally:
        llm.close()
    return results


def test_late_masks_skip_a_step_and_change_nothing(artifact):
    """A sequence whose masks are late every step is skipped until they are ready: its output is
    the one it has alone, and the others' are theirs."""
    alone = _run(artifact, {}, mask_seconds=30)
    stats: dict = {}
    slowed = _run(artifact, {"slow": 0.01}, mask_seconds=30, stats=stats)
    assert slowed["plain"] == alone["plain"] and slowed["json"] == alone["json"]
    assert slowed["slow"] == alone["json"] and slowed["slow"][1] is None
    assert stats["late_mask_skips"] > 0                     # counted (infeng_late_mask_skips_total)


def test_late_masks_with_speculation_change_nothing(artifact):
    """Speculating, a choice drafts only when its mask is ready in time and a verification whose
    masks are late is done again from its last token: greedy outputs are the plain ones."""
    alone = _run(artifact, {}, mask_seconds=30)
    slowed = _run(artifact, {"slow": 0.005}, mask_seconds=30, speculative="ngram")
    assert slowed["plain"] == alone["plain"] and slowed["json"] == alone["json"]
    assert slowed["slow"] == alone["json"]


def test_overdue_mask_ends_its_sequence_alone(artifact):
    results = _run(artifact, {"stuck": 1.0}, mask_seconds=0.3)
    tokens, error = results["stuck"]
    assert error and "grammar mask time limit" in error and "0.3 s" in error
    assert results["plain"][1] is None and len(results["plain"][0]) == 60
    assert results["json"][1] is None


def test_n_matchers_fill_in_parallel():
    """The masks of one request's four choices are four jobs on four worker threads, not one."""
    from infeng_runtime.sampling.grammar import MASK_WORKERS
    from infeng_runtime.structured import GrammarCompiler, GrammarSpec
    from infeng_common.tokenizer import Tokenizer

    c = GrammarCompiler(Tokenizer(STORIES), 512).constraint(GrammarSpec("regex", "[a-z]+"), 4)
    assert all(c.ready(i, deadline=time.monotonic() + 30) for i in range(4))
    mask_of = c._mask_of

    def slow_mask(index, out):
        time.sleep(0.5)
        mask_of(index, out)
    c._mask_of = slow_mask
    t0 = time.monotonic()
    c.prefetch(range(4))
    assert all(c.ready(i, deadline=t0 + 30) for i in range(4))
    assert MASK_WORKERS >= 4 and time.monotonic() - t0 < 1.5       # one after another: 2 s


def test_ambiguous_grammar_stops_at_the_parser_limit(artifact):
    """The ambiguous grammar's rows grow with the output until llguidance's max_items_in_row
    (PARSER_LIMITS) ends it: an error naming the limit, after a bounded number of tokens."""
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams
    from infeng_runtime.scheduler import Request
    from infeng_runtime.structured import GrammarCompiler, GrammarSpec

    llm = LLM(artifact, threads=1, max_seqs=8)
    grammars = GrammarCompiler(llm.tokenizer, llm.engine.vocab_size)
    outs = []
    try:
        llm.loop.submit(Request("amb", llm.tokenizer.encode("Once"), SamplingParams(max_new_tokens=500, seed=1,
                                                                                     temperature=1.0), n=8,
                                grammar=grammars.constraint(GrammarSpec("grammar", AMBIGUOUS), 8), sink=outs.extend))
        t0 = time.monotonic()
        while llm.loop.has_work():
            llm.loop.run_once()
        elapsed = time.monotonic() - t0
    finally:
        llm.close()
    errors = [o.error for o in outs if o.finish_reason == "error"]      # (the grammar allows EOS anywhere)
    assert errors and all("parser limit" in e and "max is 200" in e for e in errors)
    assert elapsed < 30


# -- fair shares ------------------------------------------------------------------------------------
def test_a_clients_sequences_rank_after_its_own():
    from infeng_runtime.kv_cache import BlockAllocator
    from infeng_runtime.sampling import SamplingParams
    from infeng_runtime.scheduler import Request, Scheduler

    sched = Scheduler(BlockAllocator(n_blocks=64, block_size=16, max_seqs=2, max_context=256), [2])
    params = SamplingParams(max_new_tokens=4)
    sched.add(Request("greedy", [1, 5, 6], params, n=8, client="10.0.0.1"))
    sched.add(Request("bystander", [1, 7], params, client="10.0.0.2"))
    sched.add(Request("greedy-2", [1, 8], params, client="10.0.0.1"))
    plan = sched.schedule()
    assert [s.request.request_id for s in plan.seqs] == ["greedy", "bystander"]   # second slot: the bystander
    assert [s.order[0] for s in sched.requests["greedy-2"]] == [8]


def test_client_shares_let_one_job_per_client_run():
    from infeng_runtime.fair_share import ClientShares

    async def main() -> list[str]:
        shares = ClientShares()
        order: list[str] = []

        async def job(client: str, name: str, seconds: float):
            release = await shares.acquire(client)
            order.append(name)
            await asyncio.sleep(seconds)
            release()

        await asyncio.gather(job("a", "a1", 0.2), job("a", "a2", 0.2), job("a", "a3", 0.2), job("b", "b1", 0.01))
        assert not shares._held
        return order

    assert asyncio.run(main()) == ["a1", "b1", "a2", "a3"]


@pytest.mark.parametrize("ending", [False, True])
def test_a_request_that_gives_up_waiting_for_its_turn_gives_it_back(artifact, ending):
    """A client's request waiting for its text turn, cancelled (the client left) or ended by the
    shutdown, does not keep the turn it was waiting for: the client's next request runs."""
    from concurrent.futures import ThreadPoolExecutor

    from infeng_runtime.fair_share import CLIENT
    from infeng_runtime.server import APIError, ServeOptions, build_server

    server = build_server(artifact, ServeOptions(threads=1))

    async def main() -> int:
        server.ending = asyncio.Event()
        server.text_pool = ThreadPoolExecutor(2)
        server.text_waiting = 0
        CLIENT.set("10.0.0.1")
        held = [await server.text_shares.acquire("10.0.0.1") for _ in range(2)]   # every turn, taken
        waiting = asyncio.ensure_future(server.text_work(lambda: 1))
        await asyncio.sleep(0.05)
        if ending:
            server.ending.set()
            with pytest.raises(APIError):
                await waiting
            server.ending.clear()
        else:
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
        for release in held:
            release()
        await asyncio.sleep(0)
        answer = await asyncio.wait_for(server.text_work(lambda: 42), 5)
        assert not server.text_shares._held
        server.text_pool.shutdown()
        return answer

    assert asyncio.run(main()) == 42


def test_client_shares_are_work_conserving():
    """A client alone uses every turn; once another client comes, it is back to its one."""
    from infeng_runtime.fair_share import ClientShares

    async def main() -> list[str]:
        shares = ClientShares(per_client=1, capacity=2)
        order: list[str] = []

        async def job(client: str, name: str, seconds: float, after: float = 0.0):
            await asyncio.sleep(after)
            release = await shares.acquire(client)
            order.append(name)
            await asyncio.sleep(seconds)
            release()

        t0 = time.monotonic()
        await asyncio.gather(job("a", "a1", 0.3), job("a", "a2", 0.3))
        assert time.monotonic() - t0 < 0.5                      # side by side: alone, both turns
        await asyncio.gather(job("a", "a3", 0.3), job("b", "b1", 0.3), job("a", "a4", 0.1, after=0.05))
        assert not shares._held
        return order

    assert asyncio.run(main()) == ["a1", "a2", "a3", "b1", "a4"]


# -- the shutdown's last resort -------------------------------------------------------------------
def test_exit_watchdog_ends_a_process_stuck_in_a_thread():
    script = ("import threading, time\n"
              "from infeng_runtime.exit_watchdog import exit_after\n"
              "threading.Thread(target=time.sleep, args=(60,)).start()\n"      # not a daemon: exit waits
              "exit_after(0.5, lambda: 0)\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and time.monotonic() - t0 < 10
    assert "exiting now" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("slow", ["text", "grammar"])
def test_a_greedy_client_holds_one_text_thread_and_one_compiler(artifact, monkeypatch, slow):
    """A greedy client alone takes both text threads (compilers) for its slow prompts (grammars);
    a bystander's request, sent while four of them are in, runs when the first of them ends, ahead
    of the greedy client's other two."""
    from starlette.testclient import TestClient

    from infeng_runtime.server import ServeOptions, build_server

    server = build_server(artifact, ServeOptions(threads=1, max_seqs=4))
    encode, compile_grammar = server.tokenizer.encode_batch, server.grammars.grammar

    def slow_encode(texts, *a):
        if "greedy" in texts[0]:
            time.sleep(2.0)
        return encode(texts, *a)

    def slow_grammar(spec):
        if "greedy" in json.dumps(spec.value):
            time.sleep(2.0)
        return compile_grammar(spec)

    if slow == "text":
        monkeypatch.setattr(server.tokenizer, "encode_batch", slow_encode)
    else:
        monkeypatch.setattr(server.grammars, "grammar", slow_grammar)

    async def app(scope, receive, send):                  # the peer address from a test header
        if scope["type"] == "http":
            peer = dict(scope["headers"]).get(b"x-peer", b"127.0.0.1").decode()
            scope = {**scope, "client": (peer, 1)}
        await server.app(scope, receive, send)

    def body(who: str) -> dict:
        return {"model": "stories260K", "prompt": f"Once upon a time {who}", "max_tokens": 2,
                "guided_choice": [f"{who} a", f"{who} b"]}

    with TestClient(app, base_url="http://localhost") as http:
        warm = http.post("/v1/completions", json=body("warm"), headers={"x-peer": "10.0.0.3"})
        assert warm.status_code == 200                    # the grammar workers started, the model ran once
        statuses: list[int] = []

        def greedy() -> None:
            statuses.append(http.post("/v1/completions", json=body("greedy"), headers={"x-peer": "10.0.0.1"})
                            .status_code)
        flood = [threading.Thread(target=greedy) for _ in range(4)]
        for t in flood:
            t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        r = http.post("/v1/completions", json=body("bystander"), headers={"x-peer": "10.0.0.2"})
        waited = time.monotonic() - t0
        for t in flood:
            t.join(30)
    assert r.status_code == 200 and statuses == [200] * 4
    assert waited < 2.8          # 1.7 s behind the first greedy pair; without the shares 3.7 s, behind both


@pytest.mark.parametrize("field, value, flag", [("grammar_timeout", 0.0, "--grammar-timeout"),
                                                ("grammar_mask_timeout", float("nan"), "--grammar-mask-timeout"),
                                                ("max_grammar_bytes", 1, "--max-grammar-bytes")])
def test_grammar_option_ranges(field, value, flag):
    from infeng_common.errors import InfengError
    from infeng_runtime.server import ServeOptions

    with pytest.raises(InfengError, match=flag):
        ServeOptions(**{field: value}).check()
