"""The reference interpreter behind the engine surface (``InterpreterEngine``): ``infeng generate``
runs through the engine loop, and the golden model can be served over HTTP like an artifact. Its
greedy continuations are the compiled artifact's (stories260K, f32: the same tokens)."""
from __future__ import annotations

import json

import pytest
from _golden import BASE_URL, TRANSCRIPTS

from infeng_common.tokenizer import Tokenizer
from infeng_compiler.frontends import import_model
from infeng_compiler.interp import Interpreter
from infeng_compiler.interp_engine import InterpreterEngine


@pytest.fixture(scope="module")
def interpreter_engine(stories_dir) -> InterpreterEngine:
    graph = import_model(stories_dir, None, strict=True)
    tokenizer = Tokenizer(stories_dir, graph.meta.get("bos_token_id"), graph.meta.get("eos_token_ids"))
    return InterpreterEngine(Interpreter(graph), tokenizer, max_seqs=2, max_context=256)


def test_interpreter_served_over_http_answers_as_the_artifact(interpreter_engine):
    """/v1/completions over the interpreter, streamed and not, n=2: the golden transcript's text."""
    from fastapi.testclient import TestClient

    from infeng_runtime.loop import EngineLoop
    from infeng_runtime.server import Server

    recorded = {t["name"]: t for t in json.loads(TRANSCRIPTS.read_text())}
    expected = json.loads(recorded["cmpl"]["body"])["choices"][0]["text"]
    server = Server(EngineLoop(interpreter_engine, prefix_cache=False), "stories")
    body = {"model": "stories", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    with TestClient(server.app, base_url=BASE_URL) as http:
        answer = http.post("/v1/completions", json={**body, "n": 2}).json()
        assert [c["text"] for c in answer["choices"]] == [expected, expected]
        assert answer["choices"][0]["finish_reason"] == "length"
        stream = http.post("/v1/completions", json={**body, "stream": True}).text
    pieces = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert "".join(p["choices"][0]["text"] for p in pieces) == expected


def test_generate_runs_through_the_engine_loop(interpreter_engine):
    """Stop strings and max tokens are the loop's finish rules, as for a compiled artifact."""
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams

    llm = LLM.over(interpreter_engine, prefix_cache=False)
    stopped, = llm.generate(["Once upon a time"], SamplingParams(max_new_tokens=24, stop=("the",)))
    assert (stopped.text, stopped.finish_reason) == (", ", "stop")          # as tests/golden's llm-generate-1
    pieces = list(llm.stream("Once upon a time", SamplingParams(max_new_tokens=12)))
    assert "".join(pieces) == ", there was a little girl named Lily. She"


def test_interpreter_serves_adapters_as_the_artifact(stories_dir, tmp_path):
    """An adapter loaded into the interpreter's slots (the graph after ``lora-slots``) continues the
    prompt as the compiled artifact's slot does: the golden transcript's text for model a1."""
    from _serving import write_adapter

    from infeng_compiler.passes.manager import PassContext, PassManager, parse_pipeline
    from infeng_runtime.llm import LLM
    from infeng_runtime.sampling import SamplingParams

    graph = import_model(stories_dir, None, strict=True)
    PassManager(parse_pipeline("lora-slots(4,8)")).run(graph, PassContext())
    tokenizer = Tokenizer(stories_dir, graph.meta.get("bos_token_id"), graph.meta.get("eos_token_ids"))
    llm = LLM.over(InterpreterEngine(Interpreter(graph), tokenizer, max_seqs=2, max_context=256), prefix_cache=False)
    llm.loop.load_adapter("a1", write_adapter(tmp_path / "a1", seed=100)).result()
    recorded = {t["name"]: t for t in json.loads(TRANSCRIPTS.read_text())}
    expected = json.loads(recorded["cmpl-adapter"]["body"])["choices"][0]["text"]
    with_adapter, base = llm.generate(["Once upon a time"] * 2, SamplingParams(max_new_tokens=12), adapter=["a1", None])
    assert with_adapter.text == expected
    assert base.text == json.loads(recorded["cmpl"]["body"])["choices"][0]["text"]
