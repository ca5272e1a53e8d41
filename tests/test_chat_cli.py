"""``infeng chat`` and ``infeng run`` with a chat template: the prompt is what the chat API renders,
the conversation keeps its turns, commands change the system prompt and the adapter, and a stopped
or failed answer leaves the chat running. stories260K with a Llama-2-style template and LoRA slots
(tests/_serving.py), against the offline API fed the prompts transformers' apply_chat_template
makes of the same messages."""
from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

import pytest
from _serving import adapters, infeng_command, nonfinite_artifact, served_artifact
from typer.testing import CliRunner

from infeng_cli.main import app
from infeng_runtime.llm import LLM
from infeng_runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return served_artifact(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    return adapters(tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def llm(artifact: Path, adapter_dirs: dict[str, Path]):
    engine = LLM(artifact, threads=1, max_seqs=1, adapters={"a1": adapter_dirs["a1"]})
    yield engine
    engine.close()


@functools.lru_cache(maxsize=2)
def hf_tokenizer(artifact: Path):
    """transformers' tokenizer over the artifact's tokenizer.json as it is. (AutoTokenizer would
    build transformers 5's LlamaTokenizer, which rebuilds the pipeline from tokenizer_config's
    ``legacy: false`` and adds no "▁" after a special token: [1, 471, ...] for "<s>User:" where
    the file itself, through tokenizers, gives [1, 410, 471, ...]; a tokenizer question, not a
    chat template one.)"""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(artifact))


def hf_prompt_ids(artifact: Path, messages: list[dict]) -> list[int]:
    """The prompt transformers makes of ``messages`` with the artifact's tokenizer and chat
    template: the independent reference for what chat and run send."""
    ids = hf_tokenizer(artifact).apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def reference(llm: LLM, messages: list[dict], n: int, adapter: str | None = None) -> str:
    """The greedy answer to ``messages`` as transformers renders and encodes them, through the
    offline API."""
    ids = hf_prompt_ids(llm.engine.path, messages)
    return llm.generate([ids], SamplingParams(max_new_tokens=n), adapter=adapter)[0].text


def test_chat_prompt_ids_are_transformers_apply_chat_template(llm):
    from infeng_runtime.chat import chat_prompt_ids

    for messages in ([{"role": "user", "content": "Once upon a time"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Once there was a cat."},
                      {"role": "user", "content": "Tell me more, über-kurz!"}]):
        assert chat_prompt_ids(llm.tokenizer, messages) == hf_prompt_ids(llm.engine.path, messages)


def chat(artifact: Path, lines: list[str], *args: str):
    return CliRunner().invoke(app, ["chat", str(artifact), "-n", "12", "--threads", "1", *args],
                              input="".join(line + "\n" for line in lines))


def answers(stdout: str) -> list[str]:
    """What followed each ``>>> `` prompt on stdout (answers, and the output of /history)."""
    return [part.rstrip("\n") for part in stdout.split(">>> ")[1:] if part.strip()]


def test_chat_keeps_the_conversation(artifact, llm):
    result = chat(artifact, ["Once upon a time", "Tell me more"])
    assert result.exit_code == 0, result.output
    first = reference(llm, [{"role": "user", "content": "Once upon a time"}], 12)
    second = reference(llm, [{"role": "user", "content": "Once upon a time"},
                             {"role": "assistant", "content": first},
                             {"role": "user", "content": "Tell me more"}], 12)
    assert answers(result.stdout) == [first, second]


def test_chat_commands(artifact, llm, adapter_dirs):
    result = chat(artifact, ["/system You tell stories", "Hello", "/history", "/reset", "/adapter a2",
                             f"/adapter a1={adapter_dirs['a1']}", "Hello", "/adapter", "/bogus", "/exit",
                             "never read"])
    assert result.exit_code == 0, result.output
    system = {"role": "system", "content": "You tell stories"}
    hello = reference(llm, [system, {"role": "user", "content": "Hello"}], 12)
    with_a1 = reference(llm, [system, {"role": "user", "content": "Hello"}], 12, adapter="a1")
    assert hello != with_a1
    out = answers(result.stdout)
    assert out[0] == hello
    assert out[1] == f"[system] You tell stories\n[user] Hello\n[assistant] {hello}"
    assert out[2] == with_a1                       # after /reset: the system prompt stays, the turns go
    assert "system prompt: You tell stories" in result.stderr
    assert "no adapter named 'a2'" in result.stderr and "answering with adapter a1" in result.stderr
    assert "answering with the base model" in result.stderr
    assert "unknown command /bogus" in result.stderr


def test_chat_help_and_end_of_input(artifact):
    result = chat(artifact, ["/help"])
    assert result.exit_code == 0, result.output
    for command in ("/reset", "/system TEXT", "/adapter NAME", "/exit", "Ctrl-C"):
        assert command in result.stdout


def test_chat_stops_an_answer_and_goes_on(llm):
    """Ctrl-C while an answer streams (``stopped()`` turns true): the answer ends where it was, its
    text joins the history, the next question is answered in full."""
    from infeng_runtime.terminal_chat import ChatSession

    session = ChatSession(llm, SamplingParams(max_new_tokens=12))
    pieces: list[str] = []
    for piece in session.ask("Once upon a time", stopped=lambda: bool(pieces)):
        pieces.append(piece)
    assert len(pieces) == 1 and session.last.finish_reason == "abort"
    assert session.turns[1] == {"role": "assistant", "content": pieces[0]}
    assert not llm.loop.has_work()
    full = "".join(session.ask("Tell me more"))
    assert full == reference(llm, session.turns[:2] + [{"role": "user", "content": "Tell me more"}], 12)
    assert session.last.finish_reason == "length"


def test_chat_stop_is_seen_before_any_engine_step(artifact, monkeypatch):
    """Ctrl-C during a long prefill (chunks of 16 tokens here): the stop flag is checked before
    every engine step, not only after a piece of text, so no step runs once it is set."""
    from infeng_runtime.terminal_chat import ChatSession

    llm = LLM(artifact, threads=1, max_seqs=1, max_batched_tokens=16)
    steps = []
    run_once = llm.loop.run_once
    monkeypatch.setattr(llm.loop, "run_once", lambda: steps.append(1) or run_once())
    session = ChatSession(llm, SamplingParams(max_new_tokens=12))
    assert list(session.ask("Once upon a time " * 10, stopped=lambda: len(steps) >= 2)) == []
    assert len(steps) == 2 and session.last.finish_reason == "abort" and not llm.loop.has_work()
    assert session.turns[1] == {"role": "assistant", "content": ""}
    llm.close()


def test_ctrl_c_after_an_answer_does_not_end_the_chat(llm, monkeypatch):
    """A Ctrl-C at the prompt within CTRL_C_GRACE_S of an answer's end was meant for the answer;
    later, at an empty prompt, it ends the chat."""
    import io

    from infeng_runtime import terminal_chat
    from infeng_runtime.terminal_chat import ChatSession, chat_loop

    def reader(lines):
        def read(prompt):
            line = lines.pop(0)
            if isinstance(line, type):
                raise line()
            return line
        return read

    out = io.StringIO()
    lines = ["Once upon a time", KeyboardInterrupt, "/history", EOFError]
    chat_loop(ChatSession(llm, SamplingParams(max_new_tokens=4)), reader(lines), out, print, print)
    assert not lines and "[assistant]" in out.getvalue()            # went on to /history
    monkeypatch.setattr(terminal_chat, "CTRL_C_GRACE_S", 0.0)
    lines = ["Once upon a time", KeyboardInterrupt, "/history", EOFError]
    chat_loop(ChatSession(llm, SamplingParams(max_new_tokens=4)), reader(lines), out, print, print)
    assert lines == ["/history", EOFError]                           # the chat ended there


def test_chat_answer_budget_fits_a_short_context(artifact):
    """-n larger than the context: half the context is kept for the answer, and each answer is cut
    to what the context has left (no negative room, no refusal)."""
    result = chat(artifact, ["Once upon a time there was a dog"] * 3, "--max-context", "48", "-n", "512")
    assert result.exit_code == 0, result.output
    assert "error" not in result.stderr and len(answers(result.stdout)) == 3


def test_chat_leaves_out_old_turns_to_fit_the_context(artifact):
    result = chat(artifact, ["Once upon a time there was a dog"] * 4, "--max-context", "64")
    assert result.exit_code == 0, result.output
    assert "were left out to fit the context" in result.stderr
    assert len(answers(result.stdout)) == 4


def test_chat_with_a_failing_model_reports_each_answer(tmp_path):
    result = chat(nonfinite_artifact(tmp_path), ["Hello", "Again"])
    assert result.exit_code == 0, result.output
    assert result.stderr.count("non-finite logits") == 2


def test_chat_ctrl_c_stops_the_answer_not_the_program(artifact):
    """A real terminal's Ctrl-C: SIGINT to the process while it answers; the chat goes on."""
    import signal
    import time

    proc = subprocess.Popen([*infeng_command(), "chat", str(artifact), "-n", "100000", "--threads", "1",
                             "--max-context", "100100"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        proc.stdin.write("Once upon a time\n")
        proc.stdin.flush()
        assert proc.stdout.read(4) == ">>> "
        proc.stdout.read(20)                        # the answer streams
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("Tell me more\n")          # the next answer: Ctrl-C stops it too
        proc.stdin.flush()
        seen = ""
        while not seen.endswith(">>> "):
            seen += proc.stdout.read(1)
        proc.stdout.read(20)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate("/exit\n", timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert err.count("(stopped)") == 2 and "Traceback" not in err


def test_run_applies_the_chat_template(artifact, llm):
    prompt = "Once upon a time"
    result = CliRunner().invoke(app, ["run", str(artifact), prompt, "-n", "12", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["text"] == reference(llm, [{"role": "user", "content": prompt}], 12)
    assert out["prompt_tokens"] == len(hf_prompt_ids(artifact, [{"role": "user", "content": prompt}]))
    system = CliRunner().invoke(app, ["run", str(artifact), prompt, "-n", "12", "--threads", "1", "--json",
                                      "--system", "Be brief"])
    assert json.loads(system.stdout)["text"] == reference(
        llm, [{"role": "system", "content": "Be brief"}, {"role": "user", "content": prompt}], 12)
    raw = CliRunner().invoke(app, ["run", str(artifact), prompt, "-n", "12", "--threads", "1", "--raw"])
    assert raw.exit_code == 0, raw.output
    plain = llm.generate([prompt], SamplingParams(max_new_tokens=12))[0].text
    assert raw.stdout == prompt + plain + "\n"


def test_run_reports_an_answer_that_ends_at_once(artifact):
    """An answer of no tokens (EOS first) reports a prefill speed, never a division by zero."""
    result = CliRunner().invoke(app, ["run", str(artifact), "Hi", "-n", "0", "--threads", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["token_ids"] == [] and (out["prefill_tok_s"] is None or out["prefill_tok_s"] < 1e7)


def test_run_with_non_finite_logits_fails_with_one_line(tmp_path):
    nan = nonfinite_artifact(tmp_path)
    for extra in ([], ["--json"]):
        result = CliRunner().invoke(app, ["run", str(nan), "Hello", "-n", "4", "--threads", "1", *extra])
        assert result.exit_code == 2, result.output
        assert result.stdout == ""
        assert result.stderr.strip().splitlines() == [
            f"error: {nan}: the model produced non-finite logits (NaN or Inf) for this sequence"]


def test_chat_needs_a_chat_template(artifact, tmp_path):
    import shutil

    plain = tmp_path / "plain.infeng"
    shutil.copytree(artifact, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    result = chat(plain, ["Hello"])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: {plain}: the model has no chat template; infeng run --raw continues " \
                                    f"plain text"
    run = CliRunner().invoke(app, ["run", str(plain), "Once", "-n", "4", "--threads", "1"])
    assert run.exit_code == 0 and run.stdout.startswith("Once")       # no template: the prompt is continued
