"""The chat page over the real SmolLM2-135M-Instruct (slow: the session's ``smollm2_server``): a
greedy question streams the text the API answers, Stop aborts the request on the server, and a
required tool call is shown with its arguments."""
from __future__ import annotations

import json
import time

import httpx
from _browser import browser, page, screenshot  # noqa: F401  (fixtures)
from _serving import metric

QUESTION = "Write a Python function that adds two numbers."


def open_chat(page, url: str, max_tokens: int) -> None:
    page.goto(url + "/")
    page.wait_for_selector("body[data-ready=true]")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", str(max_tokens))


def test_greedy_answer_is_the_api_answer(smollm2_server, page, screenshot):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": 96}
    expected = httpx.post(f"{smollm2_server}/v1/chat/completions", json=body, timeout=120).json()
    open_chat(page, smollm2_server, 96)
    page.fill("#prompt", QUESTION)
    page.click("#send")
    page.wait_for_selector("body[data-busy=false]", timeout=120_000)
    streamed = page.evaluate("JSON.parse(localStorage.getItem('infeng.conversations'))[0].messages.at(-1).content")
    assert streamed == expected["choices"][0]["message"]["content"]
    assert "```" in streamed                            # the answer's code block is shown as a <pre>
    code = streamed.split("```")[1].split("\n", 1)[1]
    assert page.locator(".message.assistant pre code").first.inner_text().strip() == code.strip()
    assert f"{expected['usage']['completion_tokens']} tokens" in page.locator(".message.assistant .stats").inner_text()
    screenshot(page, "web-chat-smollm2")


def test_stop_aborts_on_the_server(smollm2_server, page):
    def generated() -> float:
        return metric(httpx.get(f"{smollm2_server}/metrics").text, "infeng_generation_tokens_total")

    open_chat(page, smollm2_server, 900)
    page.fill("#prompt", "Write a very long story about a dragon who learns to cook.")
    page.click("#send")
    deadline = time.monotonic() + 60
    while len(page.locator(".message.assistant .body").inner_text()) < 20:     # streaming has begun
        assert time.monotonic() < deadline, "no answer streams"
        time.sleep(0.05)
    assert metric(httpx.get(f"{smollm2_server}/metrics").text, "infeng_running_sequences") == 1
    page.click("#stop")
    page.wait_for_selector("body[data-busy=false]")
    deadline = time.monotonic() + 10
    while metric(httpx.get(f"{smollm2_server}/metrics").text, "infeng_running_sequences") != 0:
        assert time.monotonic() < deadline, "the server still runs the stopped request"
        time.sleep(0.05)
    after_stop = generated()
    time.sleep(0.5)
    assert generated() == after_stop                    # nothing generates any more
    stats = page.locator(".message.assistant .stats").inner_text()
    assert "stopped" in stats
    assert int(stats.split(" tokens")[0]) < 900


def test_tool_call_is_shown(smollm2_server, page):
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}}
    open_chat(page, smollm2_server, 120)
    page.fill("#tools", json.dumps([tool]))
    page.select_option("#tool_choice", "required")
    page.fill("#prompt", "What is the weather like in Paris?")
    page.click("#send")
    page.wait_for_selector("body[data-busy=false]", timeout=120_000)
    answer = page.locator(".message.assistant").last.inner_text()
    assert "get_weather(" in answer, answer
    call = page.locator(".message.assistant pre code").last
    assert call.get_attribute("data-language") == "tool-call"
    text = call.inner_text()
    assert text.startswith("get_weather(") and text.endswith(")")
    assert isinstance(json.loads(text[len("get_weather("):-1])["city"], str)
    assert "tool_calls" in page.locator(".message.assistant .stats").inner_text()
