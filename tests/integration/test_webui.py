"""llama.cpp's WebUI, served and driven through kvctl, in headless Chromium (Playwright).

The server parks every running request each 50 tokens (``--park-test-interval``), so each answer below crosses
dozens of park/resume cycles while the browser streams it. The WebUI's streams are resumable conversation streams
(``X-Conversation-Id``), which kvctl relays byte for byte.

- a message gets its whole answer: the text the WebUI stored equals what the server gives the same request alone;
- a reload mid-answer re-attaches to the running stream (``/v1/streams/lookup``, ``GET /v1/stream``) and the
  stored answer is again the whole one;
- Stop ends generation on the server: its slots go idle with fewer tokens predicted than the request allowed.

The server runs greedy (``--temp 0``, as every test server: testkit/llama.py), so that the answer is a
fact to compare with, computed once the browser's request has ended (a batch of two can round differently).
Chromium is Debian's (/usr/bin/chromium, installed by scripts/test.sh; ``KVCTL_CHROMIUM`` names another).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from playwright.async_api import Browser, Page, async_playwright

from testkit.llama import ServerProcess, get_json, parse_metrics
from tests.harness import ServerFactory, running_app

pytestmark = pytest.mark.server

CHROMIUM = Path(os.environ.get("KVCTL_CHROMIUM", "/usr/bin/chromium"))
# as root, in a closed network: no sandbox, and none of Chromium's own background connections
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
N_PREDICT = 3000
SERVER_ARGS = ("-c", "8192", "-np", "2", "-kvu", "--slots", "--metrics", "-n", str(N_PREDICT))
PARK_EVERY = ("--park-test-interval", "50")
# the IndexedDB of the WebUI (tools/ui/src/lib/constants: STORAGE_APP_NAME, IDXDB_TABLES.messages)
READ_ASSISTANT_MESSAGES = """() => new Promise((resolve, reject) => {
    const open = indexedDB.open('LlamaUi');
    open.onerror = () => reject(open.error);
    open.onsuccess = () => {
        const tx = open.result.transaction('messages', 'readonly');
        const all = tx.objectStore('messages').getAll();
        all.onsuccess = () => {
            resolve(all.result.filter(m => m.role === 'assistant').map(m => m.content));
            open.result.close();
        };
        all.onerror = () => reject(all.error);
    };
})"""


CLICK_STOP = """() => {
    const stop = [...document.querySelectorAll('button')].find(b => b.getAttribute('aria-label') === 'Stop generation'
        || b.textContent.trim() === 'Stop');
    if (stop) stop.click();
    return !!stop;
}"""


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    if not os.path.exists(CHROMIUM):  # noqa: ASYNC240 (one stat)
        pytest.fail(f"no Chromium at {CHROMIUM}: scripts/test.sh installs Debian's chromium (or set KVCTL_CHROMIUM)")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            await b.close()


def start(start_server: ServerFactory) -> ServerProcess:
    return start_server(*SERVER_ARGS, *PARK_EVERY)


async def open_ui(browser: Browser, url: str, http: aiohttp.ClientSession) -> Page:
    async with http.get(url + "/") as resp:
        body = await resp.text()
        assert resp.status == 200 and "<html" in body.lower(), (
            "the server has no WebUI: scripts/build_llama.sh builds it when npm is installed"
        )
    page = await browser.new_page()
    await page.goto(url + "/")
    return page


async def send(page: Page, text: str) -> dict[str, Any]:
    """Type a message and send it; the body of the generation request the WebUI made for it."""
    box = page.locator("textarea").first
    await box.wait_for(timeout=30_000)
    async with page.expect_request(
        lambda r: r.method == "POST" and r.url.endswith("/v1/chat/completions"), timeout=30_000
    ) as info:
        await box.fill(text)
        await box.press("Enter")
    req = await info.value
    assert req.headers.get("x-conversation-id"), "the WebUI's stream is a resumable conversation stream"
    body: dict[str, Any] = json.loads(req.post_data or "{}")
    return body


def stop_button(page: Page) -> Any:
    return page.get_by_role("button", name="Stop")


async def wait_answer_done(page: Page, timeout_s: float = 120) -> None:
    """Until the answer is no longer generating (the Stop button gone)."""
    await stop_button(page).first.wait_for(state="hidden", timeout=timeout_s * 1000)


async def stored_answers(page: Page) -> list[str]:
    answers: list[str] = await page.evaluate(READ_ASSISTANT_MESSAGES)
    return answers


async def wait_stored(page: Page, want: str, timeout_s: float = 30) -> list[str]:
    """The WebUI writes the message to IndexedDB as the stream ends: poll until it holds ``want``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    answers = await stored_answers(page)
    while want not in answers and loop.time() < deadline:
        await asyncio.sleep(0.25)
        answers = await stored_answers(page)
    return answers


async def server_answer(http: aiohttp.ClientSession, srv: ServerProcess, body: dict[str, Any]) -> str:
    """What the server answers the WebUI's request alone, without streaming, parks or kvctl."""
    alone = {**body, "stream": False, "cache_prompt": False}
    alone.pop("return_progress", None)
    async with http.post(srv.url + "/v1/chat/completions", json=alone) as resp:
        assert resp.status == 200, await resp.text()
        out = await resp.json()
    assert out["usage"]["completion_tokens"] == N_PREDICT
    content: str = out["choices"][0]["message"]["content"]
    return content


async def wait_idle(http: aiohttp.ClientSession, srv: ServerProcess, timeout_s: float = 60) -> list[dict[str, Any]]:
    """The server's slots once none is processing a request (or at the timeout)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    slots: list[dict[str, Any]] = await get_json(http, srv.url + "/slots")
    while any(s["is_processing"] for s in slots) and loop.time() < deadline:
        await asyncio.sleep(0.1)
        slots = await get_json(http, srv.url + "/slots")
    return slots


async def parks(http: aiohttp.ClientSession, srv: ServerProcess) -> float:
    async with http.get(srv.url + "/metrics") as resp:
        return parse_metrics(await resp.text())["llamacpp:slot_parks_total"]


async def test_a_message_gets_its_whole_answer_while_the_server_parks(
    start_server: ServerFactory, http: aiohttp.ClientSession, browser: Browser
) -> None:
    srv = start(start_server)
    async with running_app(srv.url) as (_app, url, _admin):
        page = await open_ui(browser, url, http)
        body = await send(page, "Tell me a story.")
        await wait_answer_done(page)
        n_parks = await parks(http, srv)
        want = await server_answer(http, srv, body)
        answers = await wait_stored(page, want)
        assert answers == [want], "the answer the WebUI shows is not the one the server generates"
        assert n_parks >= N_PREDICT // 50 - 2, "the answer was not parked every 50 tokens"


async def test_a_reload_mid_answer_resumes_the_stream(
    start_server: ServerFactory, http: aiohttp.ClientSession, browser: Browser
) -> None:
    srv = start(start_server)
    async with running_app(srv.url) as (_app, url, _admin):
        page = await open_ui(browser, url, http)
        body = await send(page, "Tell me a long story.")
        await stop_button(page).first.wait_for(timeout=30_000)
        slots = await get_json(http, srv.url + "/slots")
        assert any(s["is_processing"] for s in slots), "the answer ended before the reload"
        async with page.expect_response(
            lambda r: r.request.method == "GET" and urlsplit(r.url).path.endswith("/v1/stream"), timeout=30_000
        ) as info:
            await page.reload()
        reattached = await info.value
        assert reattached.status == 200, "after the reload the WebUI did not re-attach to the running stream"
        await wait_answer_done(page)
        assert not any(s["is_processing"] for s in await wait_idle(http, srv))
        want = await server_answer(http, srv, body)
        answers = await wait_stored(page, want, timeout_s=120)
        assert answers == [want]


async def test_stop_ends_generation_on_the_server(
    start_server: ServerFactory, http: aiohttp.ClientSession, browser: Browser
) -> None:
    srv = start(start_server)
    async with running_app(srv.url) as (_app, url, _admin):
        page = await open_ui(browser, url, http)
        await send(page, "Count to a million.")
        await stop_button(page).first.wait_for(timeout=30_000)
        # the button is rendered again with every token: a locator's click retries on a detached element until
        # the answer ends; a click from the page itself is one step
        clicked = await page.evaluate(CLICK_STOP)
        assert clicked, "no Stop button while the answer streams"
        slots = await wait_idle(http, srv, timeout_s=30)
        assert not any(s["is_processing"] for s in slots), "the server still generates after Stop"
        async with http.get(srv.url + "/metrics") as resp:
            predicted = parse_metrics(await resp.text())["llamacpp:tokens_predicted_total"]
        assert 0 < predicted < N_PREDICT, f"{predicted} tokens predicted: Stop did not end the request early"
