"""The structured-output attacks of issue 34 against a real ``infeng serve`` (stories260K, loopback),
with bystanders streaming from other loopback addresses (other clients, for the fair shares):
every attack is a 4xx naming its limit within its budget, the bystanders' inter-token gap stays
under twice its unloaded value, a greedy client does not hold the bystanders back, and SIGTERM in
the middle of it all ends the process within --shutdown-timeout plus the grace.

The gaps are medians over many tokens after a warm-up (the host has 2 shared cores).
"""
from __future__ import annotations

import json
import signal
import statistics
import threading
import time

import httpx
import pytest

from _serving import running_server, served_artifact, server_process

pytest.importorskip("llguidance")

MODEL = "stories260K"
PROMPT = "Once upon a time"
BYSTANDERS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
ATTACKER = "127.0.0.5"
GRAMMAR_TIMEOUT = 2.0
#: A few dozen bytes whose Earley rows grow with the output.
AMBIGUOUS = 'start: s\ns: s s | s s s | "a" | "b" | "ab" | ""'


def chain(depth: int, gbnf: bool = False) -> str:
    if gbnf:
        return "\n".join(["root ::= r0"] + [f"r{i} ::= r{i + 1}" for i in range(depth)] + [f'r{depth} ::= "a"'])
    return "\n".join(["start: r0"] + [f"r{i}: r{i + 1}" for i in range(depth)] + [f'r{depth}: "a"'])


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, **kw}


def client(address: str, timeout: float = 120) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=timeout)


#: (body, the param the 400 names, words of its message): one attack per limit.
ATTACKS = [
    (completion(guided_grammar=chain(2000)), "guided_grammar", "number of grammar rules"),
    (completion(guided_grammar=chain(200)), "guided_grammar", "depth"),
    (completion(structured_outputs={"grammar": chain(3000, gbnf=True)}), "structured_outputs.grammar", "rules"),
    (completion(guided_grammar="start: " + "(" * 500 + '"a"' + ")" * 500), "guided_grammar", "depth"),
    (completion(guided_grammar="start: " + " | ".join(f'"w{i}"' for i in range(5000))), "guided_grammar",
     "alternatives"),
    (completion(guided_choice=[f"w{i}" for i in range(100_000)]), "guided_choice", "number of choices"),
    (completion(guided_choice=["x" * 2000] * 100), "guided_choice", "total size"),
    (completion(guided_regex="(" * 200 + "a" + ")" * 200), "guided_regex", "nesting depth"),
    (completion(guided_json=json.dumps(nested_schema(100))), "guided_json", "64 levels deep"),  # as JSON text
    (completion(guided_regex="[a-z]", n=32), "n", "at most 16 sequences"),
]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("attack-artifact"))


@pytest.fixture(scope="module")
def server(artifact, tmp_path_factory):
    with running_server(artifact, "--max-seqs", "16", "--grammar-timeout", str(GRAMMAR_TIMEOUT),
                        log=tmp_path_factory.mktemp("log") / "serve.log") as url:
        yield url


def refused(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("body, param, words", ATTACKS, ids=[
    "rules", "depth", "gbnf-rules", "brackets", "alternatives", "choices", "choice-bytes", "regex", "schema-text",
    "n"])
def test_every_attack_is_a_400_naming_its_limit_within_its_budget(server, body, param, words):
    with client(ATTACKER) as http:
        t0 = time.monotonic()
        error = refused(http.post(f"{server}/v1/completions", json=body))
        assert time.monotonic() - t0 < GRAMMAR_TIMEOUT + 1
        assert error["param"] == param and words in error["message"] and "limit" in error["message"]
        assert http.get(f"{server}/health").status_code == 200


def test_an_ambiguous_grammar_ends_with_an_error_event_naming_the_limit(server):
    body = completion(guided_grammar=AMBIGUOUS, max_tokens=480, stream=True, temperature=1.0, seed=5, n=4)
    with client(ATTACKER) as http, http.stream("POST", f"{server}/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    errors = [json.loads(line[6:])["error"] for line in lines if line.startswith('data: {"error"')]
    assert errors and all(e["code"] == "grammar_too_expensive" and "parser limit" in e["message"] for e in errors)
    plain = httpx.post(f"{server}/v1/completions", json={**body, "stream": False}, timeout=120)
    assert refused(plain)["code"] == "grammar_too_expensive"


# -- bystanders ------------------------------------------------------------------------------------
def stream_gaps(url: str, address: str, max_tokens: int, out: dict, warmup: int = 30) -> None:
    """Stream ``max_tokens`` tokens from ``address``; out[address]: the mean gap between chunks
    after ``warmup`` of them (seconds; chunks arrive in bursts, so a median of single gaps says
    little)."""
    body = completion(max_tokens=max_tokens, ignore_eos=True, stream=True)
    times = []
    with client(address) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    out[address] = (times[-1] - times[warmup]) / (len(times) - 1 - warmup)


def bystander_gap(url: str, during=None, max_tokens: int = 400) -> float:
    """The inter-token gap of three bystanders streaming together, the median of their means
    (``during()`` runs meanwhile)."""
    out: dict = {}
    threads = [threading.Thread(target=stream_gaps, args=(url, a, max_tokens, out)) for a in BYSTANDERS]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join(300)
    assert set(out) == set(BYSTANDERS)
    return statistics.median(out.values())


#: Seconds between an attacker's requests. Each refused grammar costs the server about what any
#: request of its size does (receiving and parsing the body on the event loop: 1.5 ms for 13 kB,
#: 9 ms for 490 kB here); back to back from several threads that is a request flood, which slows
#: every stream whatever the requests hold and is a rate limiter's business, not the grammar's.
ATTACK_PACE_S = 0.05


def attack(url: str, stop: threading.Event, results: list, refused_only: bool = False) -> None:
    """One attacker: an ambiguous-grammar stream and grammars to refuse, again and again. (The
    stream is one sequence: each sequence streamed costs the server Python work per token, so on
    this tiny model two more streams of any kind slow three bystanders by about 1.4x; the test
    is about what the grammars cost. n > 1 is test_n_matchers_fill_in_parallel and
    test_an_ambiguous_grammar_ends_with_an_error_event_naming_the_limit.)"""
    bodies = [completion(guided_grammar=chain(5000)), completion(guided_choice=[f"w{i}" for i in range(50_000)]),
              completion(structured_outputs={"grammar": chain(900, gbnf=True)})]
    if not refused_only:
        bodies.append(completion(guided_grammar=AMBIGUOUS, max_tokens=480, temperature=1.0, stream=True))
    # encoded once: an attacker's own JSON encoding (5 ms for the 500 kB choice list) would take the
    # shared cores from the server, which a remote attacker's does not
    encoded = [json.dumps(body).encode() for body in bodies]
    with client(ATTACKER) as http:
        i = 0
        while not stop.is_set():
            content = encoded[i % len(encoded)]
            i += 1
            try:
                r = http.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"})
            except httpx.HTTPError as e:               # the server went away (SIGTERM)
                results.append((None, repr(e)))
                return
            results.append((r.status_code, r.text[-300:]))
            stop.wait(ATTACK_PACE_S)


def gap_under_attack(url: str, results: list, max_tokens: int = 400) -> float:
    """``bystander_gap`` while two attackers run (``attack``: one with the ambiguous stream, one
    with refused grammars only)."""
    stop = threading.Event()
    attackers = [threading.Thread(target=attack, args=(url, stop, results, refused_only))
                 for refused_only in (False, True)]

    def during():
        for t in attackers:
            t.start()
    try:
        return bystander_gap(url, during, max_tokens)
    finally:
        stop.set()
        for t in attackers:
            if t.ident:
                t.join(60)


@pytest.mark.slow
def test_bystanders_keep_their_pace_under_attack(server):
    """Rounds of three bystanders alone and under attack, alternated, after a warm-up of each (the
    first attacks start the grammar worker's caches: CI saw a first round at 2x); the medians
    compared."""
    alone, loaded, results = [], [], []
    bystander_gap(server, max_tokens=100)
    gap_under_attack(server, [], max_tokens=100)
    for _ in range(3):
        alone.append(bystander_gap(server))
        loaded.append(gap_under_attack(server, results))
    print(json.dumps({"bystander_gap_alone_ms": [round(g * 1e3, 3) for g in alone],
                      "under_attack_ms": [round(g * 1e3, 3) for g in loaded], "attacks": len(results)}))
    assert results and all(status in (200, 400) for status, _ in results)
    assert any("grammar_too_expensive" in text for _, text in results)      # the ambiguous streams' errors
    assert statistics.median(loaded) < 2 * statistics.median(alone)
    assert httpx.get(f"{server}/health").status_code == 200


@pytest.mark.slow
def test_a_greedy_client_does_not_hold_three_bystanders_back(artifact, tmp_path):
    """The greedy client queues 24 long sequences on 4 slots first; each bystander is admitted at
    the next free slot, long before the greedy backlog is done."""
    greedy_body = completion(max_tokens=400, ignore_eos=True, n=4)
    with running_server(artifact, "--max-seqs", "4", log=tmp_path / "serve.log") as url:
        done: dict = {}

        def greedy(i: int) -> None:
            with client("127.0.0.1") as http:
                assert http.post(f"{url}/v1/completions", json=greedy_body).status_code == 200
            done[i] = time.monotonic()

        t0 = time.monotonic()
        floods = [threading.Thread(target=greedy, args=(i,)) for i in range(6)]
        for t in floods:
            t.start()
        time.sleep(0.5)
        firsts: dict = {}

        def bystander(address: str) -> None:
            start = time.monotonic()
            with client(address) as http, http.stream("POST", f"{url}/v1/completions",
                                                      json=completion(max_tokens=8, stream=True)) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        firsts.setdefault(address, time.monotonic() - start)
        others = [threading.Thread(target=bystander, args=(a,)) for a in BYSTANDERS]
        for t in others:
            t.start()
        for t in others + floods:
            t.join(300)
    backlog = max(done.values()) - t0
    print(json.dumps({"bystander_ttft_s": {a: round(s, 3) for a, s in firsts.items()}, "greedy_backlog_s":
                      round(backlog, 3)}))
    assert len(done) == 6 and set(firsts) == set(BYSTANDERS)
    assert max(firsts.values()) < backlog / 3


@pytest.mark.slow
def test_sigterm_under_attack_ends_the_process_within_the_timeout(artifact, tmp_path):
    from infeng_runtime.server import SHUTDOWN_GRACE_SECONDS

    timeout = 1.0
    with server_process(artifact, "--max-seqs", "16", "--shutdown-timeout", str(timeout), "--grammar-timeout", "5",
                        log=tmp_path / "serve.log") as (proc, url):
        stop = threading.Event()
        results: list = []
        attackers = [threading.Thread(target=attack, args=(url, stop, results)) for _ in range(3)]
        streams: dict = {}

        def bystander(address: str) -> None:
            body = completion(max_tokens=490, ignore_eos=True, stream=True, n=4)
            with client(address) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
                streams[address] = [line for line in r.iter_lines() if line]

        others = [threading.Thread(target=bystander, args=(a,)) for a in BYSTANDERS]
        for t in attackers + others:
            t.start()
        time.sleep(0.5)             # the attacks under way, the bystanders' 490 tokens far from done at the timeout
        t0 = time.monotonic()       # (at 1.5 s they were 85-90% done 1 s later here, and one finished in a run)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout + SHUTDOWN_GRACE_SECONDS + 5)
        elapsed = time.monotonic() - t0
        stop.set()
        for t in attackers + others:
            t.join(60)
    print(json.dumps({"sigterm_to_exit_s": round(elapsed, 3), "exit_code": code, "attacks": len(results)}))
    assert code == 0                                   # drained (or the watchdog's exit, which keeps the code)
    assert elapsed < timeout + SHUTDOWN_GRACE_SECONDS + 2   # the watchdog fires at timeout + grace
    for lines in streams.values():                     # ended at the timeout: an error event, then [DONE]
        assert lines[-1] == "data: [DONE]"
        assert any(line.startswith('data: {"error"') and "shutting_down" in line for line in lines)
    for status, text in results:                       # never a plain-text 500
        assert status in (None, 200, 400, 503), text
        assert status is None or text.endswith("}") or text.endswith("[DONE]\n\n"), text
