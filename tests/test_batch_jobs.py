"""``infeng run-batch``: an OpenAI Batch file through the server's engine loop — results in input
order, one error line per bad line, resume, and the same text ``infeng serve`` gives (checked
against a running server; the artifact's scalar kernels are exact whatever the batch)."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from _serving import running_server, served_artifact
from typer.testing import CliRunner

from infeng_cli.main import app
from infeng_runtime.batch_jobs import finished_ids, parse_line

BAD = {10: "{not json", 50: json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}),
       90: json.dumps({"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": {}})}
BAD_CODES = {10: "invalid_json", 50: "missing_custom_id", 90: "invalid_url"}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return served_artifact(tmp_path_factory.mktemp("batch-artifact"))


def request(i: int) -> dict:
    """Request ``i``: chat, completion or response, greedy, a few tokens."""
    words = ["cat", "dog", "tree", "ball", "girl", "boy", "sun", "park"]
    topic = f"{words[i % 8]} and the {words[(i * 3 + 1) % 8]}"
    if i % 3 == 0:
        url, body = "/v1/completions", {"prompt": f"Once upon a time a {topic}", "max_tokens": 6 + i % 5}
    elif i % 3 == 1:
        url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Tell a story of a {topic}."}],
                                             "max_tokens": 6 + i % 5}
    else:
        url, body = "/v1/responses", {"input": f"A story of a {topic}.", "max_output_tokens": 6 + i % 5}
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": {"model": "stories", "temperature": 0,
                                                                              **body}}


def batch_file(path: Path) -> Path:
    """100 lines: 97 requests and the malformed lines of BAD (1-based line numbers)."""
    lines = [BAD.get(n) or json.dumps(request(n)) for n in range(1, 101)]
    path.write_text("\n".join(lines) + "\n")
    return path


def text_of(url: str, body: dict) -> str:
    if url == "/v1/completions":
        return body["choices"][0]["text"]
    if url == "/v1/chat/completions":
        return body["choices"][0]["message"]["content"]
    return "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])


def run(artifact: Path, requests: Path, output: Path, *extra: str):
    result = CliRunner().invoke(app, ["run-batch", str(artifact), "-i", str(requests), "-o", str(output),
                                      "--served-model-name", "stories", "--max-seqs", "8", "--threads", "1",
                                      *extra])
    assert result.exit_code == 0, result.output
    return result


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_batch_orders_results_reports_bad_lines_and_equals_the_server(tmp_path, artifact):
    requests = batch_file(tmp_path / "requests.jsonl")
    output = tmp_path / "results.jsonl"
    run(artifact, requests, output, "--max-concurrency", "6")
    results = read_jsonl(output)
    good = [n for n in range(1, 101) if n not in BAD]
    assert [r["custom_id"] for r in results] == [f"req-{n}" for n in good]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None and r["id"].startswith("batch_req_")
               for r in results)
    errors = read_jsonl(tmp_path / "results.errors.jsonl")
    assert [(e["error"]["line"], e["error"]["code"]) for e in errors] == sorted(BAD_CODES.items())
    assert all(e["response"] is None and f"line {e['error']['line']}:" in e["error"]["message"] for e in errors)
    assert errors[2]["custom_id"] == "bad-url" and errors[1]["custom_id"] is None

    with running_server(artifact, "--served-model-name", "stories", "--max-seqs", "8",
                        log=tmp_path / "serve.log") as url:
        def served(n: int) -> str:
            req = request(n)
            response = httpx.post(url + req["url"], json=req["body"], timeout=60)
            assert response.status_code == 200, response.text
            return text_of(req["url"], response.json())

        with ThreadPoolExecutor(6) as pool:                    # clients batched together, as the job's were
            texts = list(pool.map(served, good))
    assert [text_of(request(n)["url"], r["response"]["body"]) for n, r in zip(good, results)] == texts


def test_resume_skips_finished_ids_and_drops_a_cut_line(tmp_path, artifact):
    requests = batch_file(tmp_path / "requests.jsonl")
    output = tmp_path / "results.jsonl"
    run(artifact, requests, output, "--no-warmup")
    whole = output.read_text().splitlines(keepends=True)
    output.write_text("".join(whole[:60]) + whole[60][:25])        # a crash mid-write of line 61
    result = run(artifact, requests, output, "--no-warmup")
    assert "60 already in" in result.output
    resumed = read_jsonl(output)
    assert [r["custom_id"] for r in resumed] == [json.loads(line)["custom_id"] for line in whole]
    assert [r["response"]["body"] for r in resumed][:60] == [json.loads(line)["response"]["body"]
                                                               for line in whole[:60]]


def test_refused_request_and_duplicate_id_are_error_lines(tmp_path, artifact):
    requests = tmp_path / "requests.jsonl"
    ok, refused = request(1), request(2)
    refused["body"]["max_output_tokens"] = -5
    lines = [ok, refused, {**request(4), "custom_id": "req-1"}, {**request(5), "body": {**request(5)["body"],
                                                                                      "stream": True}}]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out.jsonl"
    run(artifact, requests, output, "--errors", str(tmp_path / "err.jsonl"), "--no-warmup")
    assert [r["custom_id"] for r in read_jsonl(output)] == ["req-1"]
    errors = read_jsonl(tmp_path / "err.jsonl")
    assert errors[0]["response"]["status_code"] == 400 and errors[0]["response"]["body"]["error"]["message"]
    assert [e["error"]["code"] for e in errors[1:]] == ["duplicate_custom_id", "invalid_body"]


def test_parse_line_checks_each_field():
    seen: set[str] = set()
    assert parse_line('{"custom_id": "a", "url": "/v1/completions", "body": {}}', 1, seen).problem is None
    assert parse_line('{"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}', 2,
                      seen).problem[0] == "invalid_method"
    assert parse_line('{"custom_id": "c", "url": "/v1/completions", "body": []}', 3, seen).problem[0] == "invalid_body"


def test_a_results_file_that_is_not_one_is_refused(tmp_path):
    from infeng_runtime.batch_jobs import BatchFileError

    output = tmp_path / "out.jsonl"
    output.write_text("hello\nworld\n")
    with pytest.raises(BatchFileError, match="not a batch result"):
        finished_ids(output)
