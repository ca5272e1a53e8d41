"""The chat page at / of ``infeng serve`` in headless Chromium, over stories260K (scalar kernels,
greedy answers are exact): what the page streams is what the API answers; the adapter picker,
conversations kept across a reload, rename/delete/export, the status panel, the API key prompt,
``--no-ui``; and the safety check: markup in model output is shown as text and never runs."""
from __future__ import annotations

import json

import httpx
import pytest
from _browser import browser, page, screenshot  # noqa: F401  (fixtures)
from _serving import adapters, running_server, served_artifact

from infeng_runtime.web import CONTENT_SECURITY_POLICY

KEY = "web-test-key"
#: Markup the page must show as text: a script that would set a flag, an image whose onerror would.
HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return served_artifact(tmp_path_factory.mktemp("web-artifact"))


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    return adapters(tmp_path_factory.mktemp("web-adapters"))


@pytest.fixture(scope="module")
def url(artifact, adapter_dirs, tmp_path_factory):
    with running_server(artifact, "--adapter", f"a1={adapter_dirs['a1']}", "--max-seqs", "4",
                        log=tmp_path_factory.mktemp("web-log") / "serve.log") as base:
        yield base


@pytest.fixture(scope="module")
def base(url) -> str:
    """The served base model's name."""
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


def api_answer(url: str, model: str, prompt: str, max_tokens: int, key: str | None = None) -> str:
    """The greedy answer through the API itself (not streamed)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_tokens}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def open_chat(page, url: str, max_tokens: int = 24) -> None:
    page.goto(url + "/")
    page.wait_for_selector("body[data-ready=true]")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", str(max_tokens))


def ask(page, text: str) -> str:
    """Send ``text``; wait for the answer to finish; the answer as streamed (kept in localStorage),
    after checking that the page shows that text."""
    count = page.locator(".message.assistant").count()
    page.fill("#prompt", text)
    page.click("#send")                 # the click handler marks the page busy before it returns
    page.wait_for_selector("body[data-busy=false]")
    assert page.locator(".message.assistant").count() == count + 1
    streamed = page.evaluate("JSON.parse(localStorage.getItem('infeng.conversations'))"
                             ".find(c => c.id === localStorage.getItem('infeng.current')).messages.at(-1).content")
    assert page.locator(".message.assistant .body").last.inner_text().strip() == streamed.strip()
    return streamed


def test_page_headers_and_no_ui(url, artifact, tmp_path):
    page_response = httpx.get(url + "/")
    assert page_response.status_code == 200 and "infeng chat" in page_response.text
    assert page_response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "connect-src 'self'" in CONTENT_SECURITY_POLICY and "script-src 'self'" in CONTENT_SECURITY_POLICY
    assert httpx.get(url + "/ui/chat.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(url + "/ui/missing.js").status_code == 404
    with running_server(artifact, "--no-ui", log=tmp_path / "serve.log") as bare:
        assert httpx.get(bare + "/").status_code == 404
        assert httpx.get(bare + "/ui/chat.js").status_code == 404


def test_streams_the_api_answer_and_keeps_it(url, base, page, screenshot):
    prompt = "Once upon a time"
    expected = api_answer(url, base, prompt, 24)
    open_chat(page, url)
    models = page.locator("#model option").all_inner_texts()
    assert models[0] == base and any(m.startswith("a1 (adapter") for m in models)
    shown = ask(page, prompt)
    assert shown == expected
    stats = page.locator(".message.assistant .stats").last.inner_text()
    assert "tokens" in stats and "TTFT" in stats and "tok/s" in stats
    page.wait_for_selector("#status-running:text-is('0')")
    screenshot(page, "web-chat")
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator(".message.user .body").first.inner_text() == prompt
    assert page.locator(".message.assistant .body").last.inner_text().strip() == shown.strip()
    stored = page.evaluate("JSON.stringify(localStorage)")
    assert "apiKey" not in stored
    assert page.errors == [] and page.console_errors == []


def test_adapter_picker_changes_the_answer(url, base, page):
    prompt = "The little dog"
    open_chat(page, url)
    answer = ask(page, prompt)
    page.click("#new-chat")
    page.select_option("#model", "a1")
    adapted = ask(page, prompt)
    assert answer == api_answer(url, base, prompt, 24)
    assert adapted == api_answer(url, "a1", prompt, 24)
    assert adapted != answer
    assert "a1" in page.locator(".message.assistant .role").last.inner_text()


def test_rename_delete_export(url, page):
    open_chat(page, url, max_tokens=4)
    ask(page, "Lily")
    page.fill("#title", "renamed chat")
    page.press("#title", "Enter")
    page.locator("#title").blur()
    assert page.locator("#conversations li.current").inner_text() == "renamed chat"
    with page.expect_download() as download:
        page.click("#export")
    exported = json.loads(open(download.value.path()).read())
    assert exported["title"] == "renamed chat"
    assert [m["role"] for m in exported["messages"]] == ["user", "assistant"]
    page.click("#new-chat")
    assert page.locator("#conversations li").count() == 2
    page.click("#delete")
    assert page.locator("#conversations li").all_inner_texts() == ["renamed chat"]
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator("#conversations li").all_inner_texts() == ["renamed chat"]


def test_markup_in_model_output_never_runs(url, page):
    """A JSON-schema enum makes the model write the markup; the page shows it as text."""
    open_chat(page, url, max_tokens=64)
    page.fill("#json_schema", json.dumps({"type": "string", "enum": [HOSTILE]}))
    shown = ask(page, HOSTILE)
    assert HOSTILE.replace('"', '\\"') in shown                     # the JSON string the model wrote
    assert page.locator(".message.user .body").last.inner_text() == HOSTILE
    page.wait_for_timeout(300)                                      # an image error would have fired by now
    assert page.evaluate("window.__pwned") is None
    assert page.locator("#messages img, #messages script").count() == 0
    assert page.errors == []


def test_invalid_settings_are_reported_not_sent(url, page):
    open_chat(page, url)
    page.fill("#json_schema", "{not json")
    page.fill("#prompt", "hello")
    page.click("#send")
    assert page.locator("#error").inner_text().startswith("JSON schema: not valid JSON")
    assert page.locator(".message").count() == 0


def test_markdown_becomes_elements_and_markup_stays_text(url, page):
    open_chat(page, url)
    rendered = page.evaluate("""(text) => {
        const box = document.createElement('div');
        renderMarkdown(text, box);
        return {html: box.innerHTML, pre: box.querySelector('pre code').textContent,
                items: [...box.querySelectorAll('li')].map(li => li.textContent),
                strong: box.querySelector('strong').textContent, heading: box.querySelector('h3').textContent};
    }""", f"# Title\nSome **bold** text and `code`.\n\n- one {HOSTILE}\n- two\n\n```python\nprint('<b>hi</b>')\n```\n")
    assert rendered["heading"] == "Title" and rendered["strong"] == "bold"
    assert rendered["items"] == [f"one {HOSTILE}", "two"]
    assert rendered["pre"] == "print('<b>hi</b>')"
    assert "<img" not in rendered["html"] and "<script" not in rendered["html"] and "<b>" not in rendered["html"]
    assert page.evaluate("window.__pwned") is None


def test_api_key_prompt(artifact, base, page, tmp_path):
    with running_server(artifact, "--api-key", KEY, log=tmp_path / "serve.log") as keyed:
        assert httpx.get(keyed + "/v1/models").status_code == 401
        page.goto(keyed + "/")
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#api-key", KEY)
        page.click("#key-submit")
        page.wait_for_selector("body[data-ready=true]")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "8")
        assert ask(page, "Once upon a time") == api_answer(keyed, base, "Once upon a time", 8, key=KEY)
        assert page.evaluate("sessionStorage.getItem('infeng.apiKey')") == KEY
        assert KEY not in page.evaluate("JSON.stringify(localStorage)")

