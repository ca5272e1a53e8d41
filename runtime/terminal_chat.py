"""``infeng chat``: a conversation in the terminal with a compiled model, through the offline API
(``LLM.stream``: the engine loop of ``infeng run`` and ``infeng serve``) and the model's chat template.

The conversation is the list of messages the template renders; each answer streams as it becomes
final and joins the history. Lines that start with ``/`` are commands (``/help`` lists them).
Ctrl-C while an answer is prepared or streams stops that answer (the text so far stays in the
history); the chat ends with /exit, Ctrl-D, or Ctrl-C at an empty prompt, but not with a Ctrl-C
that lands within ``CTRL_C_GRACE_S`` of an answer's end (it was meant for that answer).
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, TextIO

from infeng_common.errors import InfengError

from .chat import chat_prompt_ids, template_source
from .llm import LLM, Completion
from .sampling import SamplingParams

HELP = """\
/reset          forget the conversation (the system prompt stays)
/system TEXT    set the system prompt and start over (/system alone removes it)
/adapter NAME   answer with LoRA adapter NAME (/adapter alone: the base model)
/adapter NAME=DIR  load the PEFT adapter in DIR as NAME and answer with it
/history        show the conversation so far
/help           this list
/exit           leave (Ctrl-D, and Ctrl-C at an empty prompt, leave too)
Ctrl-C while an answer is prepared or streams stops the answer, not the chat."""

#: A Ctrl-C at the prompt this soon after an answer ended was meant for that answer: it is ignored.
CTRL_C_GRACE_S = 1.0


class ChatError(InfengError):
    """A chat turn that cannot run (a command's argument, a prompt that does not fit)."""


@dataclass
class ChatSession:
    """One conversation with ``llm``: the system prompt, the turns so far, the adapter answering."""

    llm: LLM
    params: SamplingParams
    system: str | None = None
    adapter: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)      # user and assistant messages
    dropped_turns: int = 0                                           # oldest turns left out to fit the context
    last: Completion | None = None                                   # the latest answer's completion

    def __post_init__(self) -> None:
        if not template_source(self.llm.tokenizer):
            raise ChatError(f"{self.llm.engine.path}: the model has no chat template; "
                            f"infeng run --raw continues plain text")
        if self.adapter is not None:
            self.use_adapter(self.adapter)

    def messages(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def reset(self) -> None:
        self.turns.clear()

    def set_system(self, text: str | None) -> None:
        self.system = text or None
        self.reset()

    def use_adapter(self, spec: str | None) -> None:
        """``NAME`` (loaded), ``NAME=DIR`` (load it now) or None (the base model)."""
        if not spec:
            self.adapter = None
            return
        name, sep, path = spec.partition("=")
        if sep:
            if not name or not path:
                raise ChatError(f"/adapter {spec}: expected NAME or NAME=DIR")
            self.llm.loop.load_adapter(name, path).result()
        elif name not in self.llm.engine.adapters.served:
            loaded = ", ".join(self.llm.engine.adapters.served) or "none"
            raise ChatError(f"no adapter named {name!r} (loaded: {loaded}; /adapter NAME=DIR loads one)")
        self.adapter = name

    @property
    def answer_budget(self) -> int:
        """Tokens kept for an answer: ``-n``, at most half the context."""
        return max(1, min(self.params.max_new_tokens, self.llm.engine.max_context // 2))

    def prompt_ids(self, user_text: str) -> list[int]:
        """The rendered conversation plus ``user_text``, as token ids that leave room for the answer;
        the oldest turns are left out (two at a time: a question and its answer) until it fits."""
        room = self.llm.engine.max_context - self.answer_budget
        while True:
            ids = chat_prompt_ids(self.llm.tokenizer, self.messages() + [{"role": "user", "content": user_text}])
            if len(ids) <= room or not self.turns:
                break
            del self.turns[:2]
            self.dropped_turns += 2
        if len(ids) > room:
            raise ChatError(f"the message takes {len(ids)} tokens with the system prompt; the context holds "
                            f"{self.llm.engine.max_context}, {self.answer_budget} of them kept for the answer")
        return ids

    def ask(self, user_text: str, stopped: Callable[[], bool] = lambda: False) -> Iterator[str]:
        """Stream the answer to ``user_text`` (at most ``-n`` tokens and what the context has left);
        ``stopped()`` is checked before every engine step and between pieces, and ends the answer
        early. The question and the answer (as far as it got) join the history, unless the answer
        failed (``last.finish_reason == "error"``)."""
        ids = self.prompt_ids(user_text)
        params = replace(self.params, max_new_tokens=min(self.params.max_new_tokens,
                                                         self.llm.engine.max_context - len(ids)))
        stream = self.llm.stream(ids, params, adapter=self.adapter, stopped=stopped)
        pieces: list[str] = []
        text = iter(stream)
        try:
            for piece in text:
                pieces.append(piece)
                yield piece
                if stopped():
                    break
        finally:
            text.close()                         # an answer stopped early ends its request here
            self.last = stream.completion
            if self.last.finish_reason != "error":
                self.turns += [{"role": "user", "content": user_text},
                               {"role": "assistant", "content": "".join(pieces)}]


@contextmanager
def ctrl_c_sets() -> Iterator[threading.Event]:
    """While inside, SIGINT sets the yielded event instead of raising KeyboardInterrupt (an engine
    step is never cut in the middle); outside the main thread nothing changes."""
    hit = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield hit
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hit.set())
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, previous)


def chat_loop(session: ChatSession, read: Callable[[str], str], out: TextIO, note: Callable[[str], None],
              error: Callable[[str], None], prompt: str = ">>> ") -> None:
    """Read lines with ``read(prompt)`` until /exit, EOF or Ctrl-C at an empty prompt (not within
    ``CTRL_C_GRACE_S`` of an answer's end); answer each on ``out``; ``note`` prints status lines,
    ``error`` what went wrong with one line (the chat goes on)."""
    answered = float("-inf")                 # when the latest answer ended (time.monotonic)
    while True:
        try:
            line = read(prompt)
        except EOFError:
            out.write("\n")
            return
        except KeyboardInterrupt:
            out.write("\n")
            if _typed_so_far() or time.monotonic() - answered < CTRL_C_GRACE_S:
                continue                     # a line dropped, or a Ctrl-C meant for the answer
            return
        text = line.strip()
        if not text:
            continue
        try:
            if text.startswith("/"):
                if not command(session, text, out, note):
                    return
                continue
            answer(session, text, out, note)
            answered = time.monotonic()
        except InfengError as e:
            error(str(e))
            answered = time.monotonic()


def _typed_so_far() -> str:
    """The line being edited at the prompt (readline's buffer; empty without readline)."""
    readline = sys.modules.get("readline")
    return readline.get_line_buffer() if readline is not None else ""


def command(session: ChatSession, text: str, out: TextIO, note: Callable[[str], None]) -> bool:
    """Run one ``/command``; False when it ends the chat."""
    name, _, arg = text.partition(" ")
    arg = arg.strip()
    if name in ("/exit", "/quit", "/bye"):
        return False
    if name == "/help":
        out.write(HELP + "\n")
    elif name == "/reset":
        session.reset()
        note("the conversation is forgotten")
    elif name == "/system":
        session.set_system(arg)
        note(f"system prompt: {arg}" if arg else "no system prompt")
    elif name == "/adapter":
        session.use_adapter(arg or None)
        note(f"answering with adapter {session.adapter}" if session.adapter else "answering with the base model")
    elif name == "/history":
        for message in session.messages():
            out.write(f"[{message['role']}] {message['content']}\n")
    else:
        raise ChatError(f"unknown command {name}; /help lists them")
    return True


def answer(session: ChatSession, text: str, out: TextIO, note: Callable[[str], None]) -> Completion:
    """Stream the answer to ``text`` on ``out``; Ctrl-C (once or more) stops it, the chat goes on."""
    dropped = session.dropped_turns
    with ctrl_c_sets() as interrupted:            # until the notes are out: a late Ctrl-C is harmless
        for piece in session.ask(text, stopped=interrupted.is_set):
            out.write(piece)
            out.flush()
        out.write("\n")
        completion = session.last
        if session.dropped_turns > dropped:
            note(f"(the oldest {session.dropped_turns - dropped} messages were left out to fit the context)")
        if interrupted.is_set():
            note("(stopped)")
        elif completion.finish_reason == "error":
            raise ChatError(completion.error or "the answer failed")
        elif completion.finish_reason == "length":
            note(f"(cut at {len(completion.token_ids)} tokens: -n and the context set the limit)")
    return completion
