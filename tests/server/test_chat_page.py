"""The chat page at / in a real browser: Debian's headless Chromium, driven by Playwright, on a
server with an API key. The page asks for the key, sends a message, shows the streamed answer
with its tokens per second and time to first token, and the engine's live numbers."""

from __future__ import annotations

import re
import shutil

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from jaxinfer.server.app import ServerConfig, build_app
from jaxinfer.server.async_engine import AsyncEngine
from jaxinfer.server.background import serve
from jaxinfer.server.metrics import ServerMetrics
from tests.support.engines import build_engine

pytestmark = [pytest.mark.engine, pytest.mark.browser]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def url(tiny_model_dir):
    engine = build_engine(tiny_model_dir, "served")
    metrics = ServerMetrics(engine)
    config = ServerConfig(served_model_name="tiny", api_key="page-key")
    url, server = serve(build_app(AsyncEngine(engine, metrics.observe_finished), config, metrics))
    yield url
    server.should_exit = True


def test_the_page_is_served_without_the_key(url):
    page = httpx.get(url)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    assert page.headers["x-content-type-options"] == "nosniff"
    assert "<title>jaxinfer chat</title>" in page.text


def test_a_message_gets_a_streamed_answer_in_chromium(url, tmp_path):
    assert CHROMIUM, "the browser test needs Debian's chromium (make test installs it)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1100, "height": 700})
        console: list[str] = []
        page.on("console", lambda message: console.append(message.text))
        page.goto(url)
        expect(page.locator("#keybox")).to_be_visible()  # /v1 answered 401: asks for the key
        page.fill("#key", "page-key")
        page.click("#savekey")
        expect(page.locator("#model")).to_have_text("tiny")
        page.fill("#max_tokens", "24")
        page.fill("#seed", "5")
        page.fill("#prompt", "Tell me about foxes.")
        page.keyboard.press("Enter")
        answer = page.locator(".msg.assistant").first
        expect(answer.locator(".stats")).to_contain_text("tokens/s", timeout=60_000)
        assert len(answer.locator(".text").inner_text()) > 0
        stats = answer.locator(".stats").inner_text()
        assert re.search(r"\d+ tokens · [\d.]+ tokens/s · first token \d+ ms", stats), stats
        expect(page.locator("#kv")).to_contain_text("%", timeout=10_000)  # polled /metrics
        assert page.locator("#running").inner_text() in ("0", "1")
        page.screenshot(path=str(tmp_path / "chat_page.png"))
        # It all ran under the page's strict Content-Security-Policy.
        assert not [text for text in console if "Content Security Policy" in text], console
        browser.close()


def test_reasoning_is_shown_folded_above_the_answer(tmp_path_factory):
    """A reasoning model (the tiny one whose template opens a <think> block) behind a server
    that parses reasoning: the page shows it in a closed <details> above the answer."""
    from tests.support.models import make_thinking_model

    folder = make_thinking_model(tmp_path_factory.mktemp("thinking_page"))
    engine = build_engine(folder, "served", reasoning_parser="qwen3")
    url, server = serve(build_app(AsyncEngine(engine), ServerConfig(served_model_name="tiny")))
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(url)
            expect(page.locator("#model")).to_have_text("tiny")
            page.fill("#max_tokens", "12")
            page.fill("#seed", "0")  # (a random model may sample another <think> token)
            page.fill("#prompt", "Why?")
            page.keyboard.press("Enter")
            answer = page.locator(".msg.assistant").first
            expect(answer.locator(".stats")).to_contain_text("tokens/s", timeout=60_000)
            reasoning = answer.locator("details.reasoning")
            expect(reasoning).to_be_visible()
            assert reasoning.get_attribute("open") is None  # folded
            assert len(reasoning.text_content()) > len("Reasoning")  # the summary, and text
            assert "<think>" not in answer.inner_text()
            browser.close()
    finally:
        server.should_exit = True
