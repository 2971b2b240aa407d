"""Replay at the proxy, against a fake server whose connections die on cue: the memory bound, the splice, the limit.

The real server's continuation (patch 0027) is tested in the series' own tests and in tests/integration.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from controller.proxy.admission import AdmissionGate
from controller.proxy.app import PROXY_KEY, make_proxy_app
from controller.proxy.config import ProxyConfig
from controller.proxy.transcript import ReplayMemory, Transcript


class Upstream:
    """Streams ``total`` tokens as OpenAI chat chunks of ``per_event`` tokens, each followed by its ids when asked
    (X-Token-Ids: 1); a continuation (continuation_tokens) streams the rest under a new id. ``die`` holds, for each
    request in turn, after how many events its connection drops (None: it completes)."""

    def __init__(self, total: int = 20, per_event: int = 1, hold_until: int = 0) -> None:
        self.total = total
        self.per_event = per_event
        self.hold_until = hold_until  # a stream's last event waits until this many requests have come
        self.all_came = asyncio.Event()
        self.controls: list[dict[str, Any]] = []
        self.honours = True  # announces ids when asked (an older server does not)
        self.refuse = False  # answers a continuation with a 400
        self.error_after: int | None = None  # events before a server error event
        self.eof = False  # dying: the response ends cleanly instead of the connection breaking
        self.die: list[int | None] = []
        self.bodies: list[dict[str, Any]] = []
        self.announced: list[bool] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/chat/completions/control", self.control)
        app.router.add_get("/health", self.health)
        return app

    async def control(self, request: web.Request) -> web.Response:
        self.controls.append(await request.json())
        return web.json_response({"ok": True})

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if len(self.bodies) >= self.hold_until:
            self.all_came.set()
        self.announced.append(request.headers.get("X-Token-Ids") == "1")
        n = len(self.bodies)
        die = self.die.pop(0) if self.die else None
        if self.refuse and body.get("continuation_tokens"):
            return web.json_response(
                {"error": {"code": 400, "message": "no", "type": "invalid_request_error"}}, status=400
            )
        headers = {"Content-Type": "text/event-stream"}
        if self.announced[-1] and self.honours:
            headers["X-Token-Ids"] = "1"  # this server announces the ids (patch 0026)
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        start = len(body.get("continuation_tokens", []))
        for k, i in enumerate(range(start, self.total, self.per_event)):
            if die is not None and k >= die:
                # what was sent is read before the connection ends (aiohttp's reader drops what it has not handed
                # out when the connection breaks: that much neither the client nor the transcript ever gets)
                await asyncio.sleep(0.1)
                if self.eof:
                    return resp  # the response ends cleanly, without its final event
                assert request.transport is not None
                request.transport.close()  # the server died: its kernel closes the connection after what it sent
                return resp
            ids = list(range(i, min(i + self.per_event, self.total)))
            chunk = {"id": f"chatcmpl-{n}", "created": 1000 + n, "choices": [{"delta": {"content": f"<{i}>"}}]}
            out = b"data: " + json.dumps(chunk).encode() + b"\n\n"
            if self.announced[-1] and self.honours:
                out += (": tokens " + " ".join(map(str, ids)) + "\n\n").encode()
            await resp.write(out)
            if self.error_after is not None and k + 1 >= self.error_after:
                await resp.write(b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n')
                return resp  # a server error ends the response, without [DONE]
        if self.hold_until:
            await self.all_came.wait()
            await asyncio.sleep(0.5)  # the proxy reads every stream's ids meanwhile
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, str]]:
    up = Upstream()
    server = TestServer(up.app())
    await server.start_server()
    yield up, str(server.make_url("")).rstrip("/")
    await server.close()


async def start_proxy(url: str, **config: Any) -> TestServer:
    server = TestServer(
        make_proxy_app(ProxyConfig(upstream=url, heartbeat_s=0.2, **config), AdmissionGate(), CollectorRegistry())
    )
    await server.start_server()
    return server


async def chat(proxy: TestServer, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The data events (JSON) the client receives."""
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    url = proxy.make_url("/v1/chat/completions")
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
        assert r.status == 200
        text = (await r.read()).decode()
    blocks = text.split("\n\n")
    return [json.loads(b[len("data: ") :]) for b in blocks if b.startswith("data: ") and b != "data: [DONE]"]


def content(events: list[dict[str, Any]]) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in events if "choices" in e)


async def test_a_stream_whose_server_dies_goes_on_from_the_tokens_its_client_has(
    upstream: tuple[Upstream, str],
) -> None:
    up, url = upstream
    up.die = [7, 5]  # killed twice in one stream
    proxy = await start_proxy(url)
    try:
        events = await chat(proxy)
        # a control of the completion by the id its client knows reaches the continuation on the server
        async with aiohttp.ClientSession() as s:
            for cid in ("chatcmpl-1", "chatcmpl-other"):
                async with s.post(proxy.make_url("/v1/chat/completions/control"), json={"id": cid}) as r:
                    assert r.status == 200
    finally:
        await proxy.close()
    assert [c["id"] for c in up.controls] == ["chatcmpl-3", "chatcmpl-other"]
    assert content(events) == "".join(f"<{i}>" for i in range(20)), "a token lost or repeated"
    assert {e["id"] for e in events} == {"chatcmpl-1"} and {e["created"] for e in events} == {1001}
    assert [b.get("continuation_tokens") for b in up.bodies] == [None, list(range(7)), list(range(12))]
    assert all(up.announced)
    assert not any("error" in e for e in events)


async def test_past_the_limit_the_client_gets_the_error_event(upstream: tuple[Upstream, str]) -> None:
    up, url = upstream
    up.die = [3, 0, 0]
    proxy = await start_proxy(url, replay_limit=2)
    try:
        with capture_logs() as logs:
            events = await chat(proxy)
        registry = proxy.app[PROXY_KEY].metrics.registry
    finally:
        await proxy.close()
    assert events[-1]["error"]["kvctl_code"] == "upstream_disconnected"
    assert len(up.bodies) == 3  # the request, then two continuations
    assert any(e["event"] == "replay.gave_up" for e in logs)
    assert registry.get_sample_value("kvctl_proxy_replays_total", {"outcome": "gave_up"}) == 1


async def test_a_client_that_opts_out_gets_the_error_at_once(upstream: tuple[Upstream, str]) -> None:
    up, url = upstream
    up.die = [3]
    proxy = await start_proxy(url)
    try:
        events = await chat(proxy, {"X-Kvctl-Replay": "off"})
    finally:
        await proxy.close()
    assert events[-1]["error"]["kvctl_code"] == "upstream_disconnected"
    assert len(up.bodies) == 1 and up.announced == [False]
    assert "X-Kvctl-Replay" not in str(up.bodies)


async def test_the_memory_bound_holds_for_64_streams_of_4000_ids() -> None:
    up = Upstream(total=4000, per_event=100, hold_until=64)  # all 64 streams open at once
    server = TestServer(up.app())
    await server.start_server()
    limit = 512 << 10  # 64 x 4000 ids take 1000 KiB: about half the streams fit
    proxy = await start_proxy(str(server.make_url("")).rstrip("/"), replay_memory_bytes=limit)
    memory = proxy.app[PROXY_KEY].replay_memory
    peak = 0
    take = memory.take

    def watched(n: int) -> bool:
        nonlocal peak
        ok = take(n)
        peak = max(peak, memory.used)
        return ok

    memory.take = watched  # type: ignore[method-assign]
    try:
        with capture_logs() as logs:
            results = await asyncio.gather(*[chat(proxy) for _ in range(64)])
    finally:
        await proxy.close()
        await server.close()
    assert all(content(events) == "".join(f"<{i}>" for i in range(0, 4000, 100)) for events in results)
    assert 0 < peak <= limit
    dropped = [e for e in logs if e["event"] == "replay.not_replayable"]
    assert 0 < len(dropped) < 64, "some streams, not all, over the bound"
    assert memory.used == 0, "every stream gave its memory back"


def test_a_transcript_over_the_bound_drops_its_ids_and_says_so() -> None:
    memory = ReplayMemory(100)
    t = Transcript.start("/completion", {"prompt": "x"}, 40, memory, "r1")
    with capture_logs() as logs:
        t.observe(b": tokens 1 2 3\n\n")
        assert t.replayable and list(t.ids) == [1, 2, 3] and memory.used == 52
        t.observe(b": tokens " + b" ".join(b"7" for _ in range(20)) + b"\n\n")
    assert not t.replayable and list(t.ids) == [] and memory.used == 0
    assert [e["event"] for e in logs] == ["replay.not_replayable"]
    t.release()
    assert memory.used == 0


async def test_a_server_error_event_ends_the_stream_as_it_is(upstream: tuple[Upstream, str]) -> None:
    up, url = upstream
    up.error_after = 4  # a failure the continuation would meet again: passed on, not replayed
    proxy = await start_proxy(url)
    try:
        events = await chat(proxy)
    finally:
        await proxy.close()
    assert content(events) == "<0><1><2><3>"
    assert events[-1]["error"]["message"] == "boom"
    assert len(up.bodies) == 1


async def test_a_refused_continuation_ends_the_stream_with_the_server_s_error(upstream: tuple[Upstream, str]) -> None:
    up, url = upstream
    up.die, up.refuse = [5], True
    proxy = await start_proxy(url)
    try:
        events = await chat(proxy)
    finally:
        await proxy.close()
    assert content(events) == "<0><1><2><3><4>"
    assert events[-1]["error"]["message"] == "no" and len(up.bodies) == 2


async def test_a_server_that_does_not_announce_ids_is_not_replayed(upstream: tuple[Upstream, str]) -> None:
    up, url = upstream
    up.die, up.honours = [5], False  # an older server: the header is ignored, so nothing could be continued
    proxy = await start_proxy(url)
    try:
        events = await chat(proxy)
    finally:
        await proxy.close()
    assert content(events) == "<0><1><2><3><4>", "events are not held for ids that never come"
    assert events[-1]["error"]["kvctl_code"] == "upstream_disconnected" and len(up.bodies) == 1


def test_a_continuation_keeps_the_client_s_own_continuation_tokens() -> None:
    t = Transcript.start("/completion", {"prompt": "x", "continuation_tokens": [5, 6]}, 10, ReplayMemory(1000), "r")
    t.observe(b": tokens 7 8\n\n")
    assert json.loads(t.continuation())["continuation_tokens"] == [5, 6, 7, 8]


def test_responses_ids_map_by_position_and_kind() -> None:
    t = Transcript.start("/v1/responses", {"input": "x"}, 10, ReplayMemory(1000), "r")
    for doc in (
        {"type": "response.created", "response": {"id": "resp_A"}},
        {"type": "response.output_item.added", "item": {"id": "fc_A1", "call_id": "call_A1"}},
        {"type": "response.output_item.added", "item": {"id": "fc_A2", "call_id": "call_A2"}},
    ):
        t.observe(b"data: " + json.dumps(doc).encode() + b"\n\n")
    t.continuation()
    t.replays = 1
    later = {"type": "response.function_call_arguments.delta", "item_id": "fc_B1", "delta": "fc_B1 is text"}
    spliced = json.loads(t.splice(b"data: " + json.dumps(later).encode() + b"\n\n")[len(b"data: ") :])
    assert spliced["item_id"] == "fc_A1" and spliced["delta"] == "fc_B1 is text"
    done = {
        "type": "response.completed",
        "response": {
            "id": "resp_B",
            "output": [{"id": "fc_B1", "call_id": "call_B1"}, {"id": "fc_B2", "call_id": "call_B2"}, {"id": "fc_B3"}],
        },
    }
    spliced = json.loads(t.splice(b"data: " + json.dumps(done).encode() + b"\n\n")[len(b"data: ") :])
    assert spliced["response"]["id"] == "resp_A"
    assert [o["id"] for o in spliced["response"]["output"]] == ["fc_A1", "fc_A2", "fc_B3"]
    assert [o.get("call_id") for o in spliced["response"]["output"]] == ["call_A1", "call_A2", None]


async def test_a_response_ending_early_past_the_limit_gets_the_error_event(upstream: tuple[Upstream, str]) -> None:
    up, url = upstream
    up.die, up.eof = [3, 0, 0], True
    proxy = await start_proxy(url, replay_limit=2)
    try:
        events = await chat(proxy)
    finally:
        await proxy.close()
    assert content(events) == "<0><1><2>" and len(up.bodies) == 3
    assert events[-1]["error"]["kvctl_code"] == "upstream_disconnected"
