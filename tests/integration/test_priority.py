"""Priorities on the real patched server (issue 20): through kvctl with the server's safety net off, and the safety
net alone; the parked requests are read from /kv as they happen, with the priority the server holds for each."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from controller.app import App
from testkit.llama import get_json, stream_completion
from tests.harness import ServerFactory, assert_complete, request, running_app


async def watch_parks(http: aiohttp.ClientSession, url: str, done: asyncio.Event) -> dict[int, int | None]:
    """Every task seen parked while it runs, with the priority the server reports for it."""
    seen: dict[int, int | None] = {}
    while not done.is_set():
        kv = await get_json(http, url + "/kv")
        for s in kv["slots"]:
            if s["state"] == "parked":
                seen[s["id_task"]] = s.get("priority")
        await asyncio.sleep(0.02)
    return seen


def decoding(app: App, at_least: int) -> int:
    kv = app.loop.state.snapshot
    return sum(1 for s in kv.slots if s.n_decoded >= at_least) if kv is not None else 0


async def test_high_priority_streams_arriving_mid_overflow_are_never_parked_and_every_low_one_completes(
    start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    # 8192 cells: 6 % above HIGH holds a poll's growth of six streams on this fast model (test_stack does the same)
    srv = start_server("-c", "8192", "-np", "6", "-kvu", "--slots", "--metrics", "--no-auto-park")
    async with running_app(srv.url) as (app, url, _admin):
        done = asyncio.Event()
        watcher = asyncio.create_task(watch_parks(http, srv.url, done))
        # four low-priority streams fill the pool (4 x 2400 tokens > 8192 cells) ...
        low = [
            asyncio.create_task(stream_completion(http, url, request(f"Low {i}:", 2400, priority=-1))) for i in range(4)
        ]
        while decoding(app, 100) < 4:  # noqa: ASYNC110 - the loop is under test
            await asyncio.sleep(0.02)
        # ... then two high-priority ones arrive in the middle, one by the header
        high = [
            asyncio.create_task(stream_completion(http, url, request("High 0:", 800, priority=5))),
            asyncio.create_task(stream_completion(http, url, request("High 1:", 800), headers={"X-Priority": "5"})),
        ]
        highs = await asyncio.gather(*high)
        lows = await asyncio.gather(*low)
        done.set()
        parked = await watcher
    assert_complete(list(highs), 800)
    assert_complete(list(lows), 2400)
    for res in highs:
        assert "parked" not in res.comments, "a high-priority stream was parked"
    assert parked and set(parked.values()) == {-1}, parked
    assert app.loop.state.parks > 0


async def test_the_safety_net_alone_parks_the_low_priority_requests_of_any_route(
    start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server("-c", "1536", "-np", "3", "-kvu", "--slots", "--metrics")  # the safety net on, no kvctl
    done = asyncio.Event()
    watcher = asyncio.create_task(watch_parks(http, srv.url, done))

    async def messages(priority: int) -> int:
        """/v1/messages keeps only a few body fields: the priority goes by the header."""
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "Low"}],
            "max_tokens": 1200,
            "stream": True,
            "ignore_eos": True,
        }
        n = 0
        headers = {"X-Priority": str(priority)}
        async with http.post(srv.url + "/v1/messages", json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                *events, buf = buf.split(b"\n\n")
                for ev in events:
                    for line in ev.split(b"\n"):
                        if line.startswith(b"data: ") and b'"content_block_delta"' in line:
                            n += 1
        return n

    lows: list[Any] = [asyncio.create_task(messages(-1))]
    await asyncio.sleep(0.3)
    highs = [
        asyncio.create_task(stream_completion(http, srv.url, request("High 0:", 600, priority=4))),
        asyncio.create_task(stream_completion(http, srv.url, request("High 1:", 600, priority=4))),
    ]
    assert_complete(list(await asyncio.gather(*highs)), 600)
    assert (await lows[0]) > 0
    done.set()
    parked = await watcher
    assert parked and set(parked.values()) == {-1}, parked
    async with http.get(srv.url + "/metrics") as resp:
        assert "llamacpp:slot_auto_parks_total" in await resp.text()
