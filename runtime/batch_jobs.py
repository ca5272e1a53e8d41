"""Offline batch jobs in the OpenAI Batch file format (``infeng run-batch``).

Each input line is ``{"custom_id", "method": "POST", "url", "body"}`` with ``url`` one of
``/v1/chat/completions``, ``/v1/completions`` or ``/v1/responses``. Every request goes through the
server's own application (``Server.app``, in process, no socket) and so through the same request
core, engine loop, scheduler and output processor as ``infeng serve``: the same request gives the
same text. Up to ``max_concurrency`` requests are in flight at once, and continuous batching mixes
them as it mixes a server's clients.

Results are written as the Batch API writes them, in input order:

- the output file: ``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"},
  "error": null}`` per request answered;
- the error file: one line per input line that is not a valid request (``response`` null,
  ``error`` {``code``, ``message``, ``line``}) and per request the server refused (``response``
  with its 4xx/5xx status and OpenAI error body, ``error`` its code and message).

A bad line never stops the job. Resuming (the same output file) skips every ``custom_id`` already
in it; a last line cut short by a crash is dropped and its request run again. The error file is
rewritten by each run: it holds the errors of the latest one.
"""
from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from infeng_common.errors import InfengError

#: Endpoints a batch line may call (the Batch API's, those infeng serves).
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


class BatchFileError(InfengError):
    """The batch job's files cannot be used at all (missing input, unreadable output)."""


@dataclass
class BatchLine:
    """One input line: a request to run, or why it cannot run (``problem``)."""

    line: int
    custom_id: str | None
    url: str = ""
    body: dict[str, Any] = field(default_factory=dict)
    problem: tuple[str, str] | None = None       # (code, message)


@dataclass
class BatchSummary:
    total: int                                   # request lines in the input
    skipped: int                                 # already in the output (resume)
    completed: int                               # answered 200 in this run
    failed: int                                  # error lines written in this run
    wall_s: float


def parse_line(raw: str, number: int, seen: set[str]) -> BatchLine:
    """One input line checked as the Batch API checks it; ``seen`` collects the custom ids."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as e:
        return BatchLine(number, None, problem=("invalid_json", f"line {number}: not JSON ({e.msg} at column "
                                                                 f"{e.colno})"))
    if not isinstance(record, dict):
        return BatchLine(number, None, problem=("invalid_request", f"line {number}: expected a JSON object"))
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchLine(number, None, problem=("missing_custom_id", f"line {number}: no \"custom_id\" string"))

    def bad(code: str, message: str) -> BatchLine:
        return BatchLine(number, custom_id, problem=(code, f"line {number}: {message}"))

    if custom_id in seen:
        return bad("duplicate_custom_id", f"custom_id {custom_id!r} was used by an earlier line")
    seen.add(custom_id)
    if record.get("method", "POST") != "POST":
        return bad("invalid_method", f"method {record.get('method')!r}: only POST is supported")
    url = record.get("url")
    if url not in BATCH_URLS:
        return bad("invalid_url", f"url {url!r}: expected one of {', '.join(BATCH_URLS)}")
    body = record.get("body")
    if not isinstance(body, dict):
        return bad("invalid_body", "\"body\" must be a JSON object")
    if body.get("stream"):
        return bad("invalid_body", "\"stream\": true is not supported in a batch")
    return BatchLine(number, custom_id, url, body)


def read_batch(path: Path) -> list[BatchLine]:
    """Every non-blank line of the input file, parsed (problems kept, not raised)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BatchFileError(f"{path}: no such file") from None
    except UnicodeDecodeError as e:
        raise BatchFileError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    seen: set[str] = set()
    return [parse_line(raw, number, seen) for number, raw in enumerate(text.splitlines(), start=1) if raw.strip()]


def finished_ids(output: Path) -> set[str]:
    """The custom ids already answered in ``output``; a last line cut short by a crash is removed."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    done: set[str] = set()
    keep = 0
    for raw in data.splitlines(keepends=True):
        try:
            record = json.loads(raw)
            done.add(record["custom_id"])
        except (ValueError, KeyError, TypeError):
            if keep + len(raw) == len(data):          # the last line: a write cut short
                break
            raise BatchFileError(f"{output}: line {len(done) + 1} is not a batch result; "
                                 f"is this a results file?") from None
        keep += len(raw)
    if keep < len(data):
        with open(output, "r+b") as f:
            f.truncate(keep)
    return done


def _result(custom_id: str | None, response: dict[str, Any] | None, error: dict[str, Any] | None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": response, "error": error}


class _OrderedWriter:
    """Writes results to one file in input order as requests complete out of order."""

    def __init__(self, file, order: list[int]):
        self.file, self.order, self.next = file, order, 0
        self.ready: dict[int, dict[str, Any] | None] = {}

    def put(self, line: int, record: dict[str, Any] | None) -> None:
        """The record of input ``line`` (None: that line writes nothing to this file)."""
        self.ready[line] = record
        while self.next < len(self.order) and self.order[self.next] in self.ready:
            ready = self.ready.pop(self.order[self.next])
            if ready is not None:
                self.file.write(json.dumps(ready) + "\n")
            self.next += 1
        self.file.flush()


async def _run(app, lines: list[BatchLine], outputs: _OrderedWriter, errors: _OrderedWriter,
               max_concurrency: int, progress: Callable[[int, int], None]) -> tuple[int, int]:
    import httpx

    gate = asyncio.Semaphore(max_concurrency)
    counts = {"ok": 0, "failed": 0, "done": 0}

    def finish(ok: bool) -> None:
        counts["ok" if ok else "failed"] += 1
        counts["done"] += 1
        progress(counts["done"], len(lines))

    async def one(client: httpx.AsyncClient, line: BatchLine) -> None:
        if line.problem is not None:
            code, message = line.problem
            outputs.put(line.line, None)
            errors.put(line.line, _result(line.custom_id, None, {"code": code, "message": message, "line": line.line}))
            finish(False)
            return
        async with gate:
            response = await client.post(line.url, json=line.body)
        try:
            body = response.json()
        except ValueError:
            body = {"error": {"message": response.text, "type": "server_error"}}
        record = _result(line.custom_id, {"status_code": response.status_code,
                                          "request_id": response.headers.get("x-request-id", ""), "body": body}, None)
        if response.status_code == 200:
            outputs.put(line.line, record)
            errors.put(line.line, None)
        else:
            failure = body.get("error") if isinstance(body, dict) and isinstance(body.get("error"), dict) else {}
            record["error"] = {"code": failure.get("code") or f"http_{response.status_code}",
                               "message": failure.get("message") or response.text, "line": line.line}
            outputs.put(line.line, None)
            errors.put(line.line, record)
        finish(response.status_code == 200)

    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 0))
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=None) as client:
            await asyncio.gather(*(one(client, line) for line in lines))
    return counts["ok"], counts["failed"]


def run_batch(server, requests: Path, output: Path, errors: Path, *, max_concurrency: int = 16,
              progress: Callable[[int, int], None] = lambda done, total: None) -> BatchSummary:
    """Run every request of ``requests`` not yet in ``output`` through ``server`` (a ``Server``
    whose loop is not started: the job starts and stops it)."""
    import time

    if max_concurrency < 1:
        raise InfengError(f"--max-concurrency {max_concurrency}: must be at least 1")
    lines = read_batch(requests)
    done = finished_ids(output)
    todo = [line for line in lines if line.custom_id is None or line.custom_id not in done]
    order = [line.line for line in todo]
    started = time.perf_counter()
    progress(0, len(todo))
    with open(output, "a", encoding="utf-8") as out, open(errors, "w", encoding="utf-8") as err:
        ok, failed = asyncio.run(_run(server.app, todo, _OrderedWriter(out, order), _OrderedWriter(err, order),
                                      max_concurrency, progress))
    return BatchSummary(len(lines), len(lines) - len(todo), ok, failed, time.perf_counter() - started)
