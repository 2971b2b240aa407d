"""Priorities at the proxy: where a request's priority comes from, what the server is told, who is admitted first."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from controller.keys import ApiKey
from controller.proxy.admission import AdmissionGate, AdmissionQueue
from controller.proxy.app import PROXY_KEY, Proxy, make_proxy_app
from controller.proxy.config import ProxyConfig
from controller.settings import SettingsError, load_settings
from tests.fakes.llama_server import FakeLlamaServer

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
OBJECTIVES = {"interactive": 10, "batch": -10}
KEYS = (
    ApiKey("sk-a", "a", priority=2, max_priority=5),
    ApiKey("sk-b", "b", max_priority=-1),  # capped below the implicit 0
    ApiKey("sk-c", "c"),  # no limits
)


@dataclass
class Upstream:
    """What the fake server received on the routes it does not script (generation, embeddings, tokenize...)."""

    path: str
    headers: CIMultiDict[str]
    body: bytes

    @property
    def priorities(self) -> list[str]:
        return self.headers.getall("X-Priority", [])


class Backend:
    """The scripted fake server, plus every POST route answered: JSON, or a slow SSE stream when asked to stream."""

    def __init__(self) -> None:
        self.fake = FakeLlamaServer()
        self.seen: list[Upstream] = []
        self.stream_events = 5
        self.stream_gap_s = 0.05

    def app(self) -> web.Application:
        app = self.fake.app()
        app.router.add_post("/{tail:.*}", self._post)
        return app

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(Upstream(request.path, CIMultiDict(request.headers), body))
        try:
            stream = json.loads(body).get("stream") is True
        except (ValueError, AttributeError):
            stream = False
        if not stream:
            return web.json_response({"ok": True})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.stream_events):
            await asyncio.sleep(self.stream_gap_s)
            await resp.write(f'data: {{"n": {i}}}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def generations(self) -> list[Upstream]:
        return [s for s in self.seen if s.path not in ("/tokenize", "/v1/embeddings")]


Start = Callable[..., Awaitable[tuple[TestServer, Proxy]]]


@pytest.fixture
async def backend() -> AsyncIterator[tuple[Backend, str]]:
    b = Backend()
    server = TestServer(b.app())
    await server.start_server()
    yield b, str(server.make_url("")).rstrip("/")
    await server.close()


@pytest.fixture
async def start(backend: tuple[Backend, str]) -> AsyncIterator[Start]:
    servers: list[TestServer] = []

    async def go(gate: AdmissionGate | None = None, **config: Any) -> tuple[TestServer, Proxy]:
        cfg = ProxyConfig(upstream=backend[1], objective_priorities=OBJECTIVES, queue_grace_s=30, **config)
        app = make_proxy_app(cfg, gate or AdmissionGate(), CollectorRegistry())
        server = TestServer(app)
        await server.start_server()
        servers.append(server)
        return server, app[PROXY_KEY]

    yield go
    for s in servers:
        await s.close()


async def post(
    server: TestServer, path: str, body: Any, headers: dict[str, str] | list[tuple[str, str]] | None = None
) -> tuple[int, dict[str, Any], CIMultiDict[str]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as http:
        async with http.post(server.make_url(path), data=data, headers=CIMultiDict(headers or {})) as r:
            text = await r.read()
            doc = json.loads(text) if r.content_type == "application/json" else {}
            return r.status, doc, CIMultiDict(r.headers)


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def upstream_priority(
    server: TestServer,
    backend: Backend,
    body: Any,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
) -> int:
    n = len(backend.seen)
    status, _, _ = await post(server, path, body, headers)
    assert status == 200
    seen = backend.seen[n:]
    assert len(seen) == 1 and len(seen[0].priorities) == 1, [s.priorities for s in seen]
    return int(seen[0].priorities[0])


# --- where the priority comes from ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "headers", "want"),
    [
        ({**CHAT, "priority": 5}, {"X-Priority": "3", "x-llm-d-inference-objective": "interactive"}, 5),
        ({**CHAT, "priority": None}, {"X-Priority": "3", "x-llm-d-inference-objective": "interactive"}, 3),
        (CHAT, {"X-Priority": "-7", "x-llm-d-inference-objective": "interactive"}, -7),
        (CHAT, {"x-llm-d-inference-objective": "interactive"}, 10),
        (CHAT, {"x-llm-d-inference-objective": "batch"}, -10),
        (CHAT, {"x-llm-d-inference-objective": "unknown"}, 0),
        (CHAT, {"X-Priority": " +4 "}, 4),
        ({**CHAT, "priority": 2**31 - 1}, {}, 2**31 - 1),
        ({**CHAT, "priority": -(2**31)}, {}, -(2**31)),
        (CHAT, {}, 0),
    ],
)
async def test_the_body_then_the_header_then_the_objective_then_zero(
    start: Start, backend: tuple[Backend, str], body: dict[str, Any], headers: dict[str, str], want: int
) -> None:
    server, _ = await start()
    assert await upstream_priority(server, backend[0], body, headers) == want


@pytest.mark.parametrize(
    ("key", "body", "headers", "want"),
    [
        ("sk-a", CHAT, {}, 2),  # the key's default
        ("sk-a", {**CHAT, "priority": 9}, {}, 5),  # capped
        ("sk-a", CHAT, {"X-Priority": "-3"}, -3),  # below the cap: as asked, even below the default
        ("sk-a", CHAT, {"x-llm-d-inference-objective": "interactive"}, 5),
        ("sk-b", CHAT, {}, -1),  # the cap bounds the implicit 0 too
        ("sk-b", {**CHAT, "priority": 7}, {}, -1),
        ("sk-c", {**CHAT, "priority": 100}, {}, 100),
        ("sk-c", CHAT, {}, 0),
    ],
)
async def test_a_key_gives_its_default_and_caps_what_its_clients_ask_for(
    start: Start, backend: tuple[Backend, str], key: str, body: dict[str, Any], headers: dict[str, str], want: int
) -> None:
    # with kvctl keys, each key's own fields decide: proxy.client_priority is for a proxy without them
    server, _ = await start(api_keys=KEYS, client_priority=False)
    got = await upstream_priority(server, backend[0], body, {**headers, "Authorization": f"Bearer {key}"})
    assert got == want


async def test_without_client_priority_what_clients_ask_for_is_ignored_but_still_checked(
    start: Start, backend: tuple[Backend, str]
) -> None:
    server, _ = await start(client_priority=False)
    b = backend[0]
    assert await upstream_priority(server, b, {**CHAT, "priority": 5}) == 0
    assert await upstream_priority(server, b, CHAT, {"X-Priority": "5"}) == 0
    assert await upstream_priority(server, b, CHAT, {"x-llm-d-inference-objective": "interactive"}) == 0
    status, doc, _ = await post(server, "/v1/chat/completions", {**CHAT, "priority": "high"})
    assert status == 400 and doc["error"]["kvctl_code"] == "invalid_priority"


# --- what the server is told ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", {"prompt": "hi"}),
        ("/completion", {"prompt": "hi"}),
        ("/v1/messages", {"model": "m", "max_tokens": 8, **CHAT}),
        ("/infill", {"input_prefix": "def f(", "input_suffix": ")"}),
        ("/v1/responses", {"input": "hi"}),
        ("/predict", {"instances": [{"@requestFormat": "chatCompletions", **CHAT}]}),
    ],
)
async def test_every_generation_route_sends_the_effective_priority_in_place_of_the_clients(
    start: Start, backend: tuple[Backend, str], path: str, body: dict[str, Any]
) -> None:
    server, _ = await start(predict_route="/predict")
    assert await upstream_priority(server, backend[0], {**body, "priority": 2}, {"X-Priority": "9"}, path=path) == 2
    assert await upstream_priority(server, backend[0], body, {"X-Priority": "9"}, path=path) == 9
    assert await upstream_priority(server, backend[0], body, path=path) == 0


async def test_other_routes_never_pass_a_clients_priority_on(start: Start, backend: tuple[Backend, str]) -> None:
    server, _ = await start()
    for path, body in (("/tokenize", {"content": "hi"}), ("/v1/embeddings", {"input": "hi"})):
        status, _, _ = await post(server, path, body, {"X-Priority": "9"})
        assert status == 200
        assert backend[0].seen[-1].path == path and backend[0].seen[-1].priorities == []
    async with aiohttp.ClientSession() as http:
        async with http.get(server.make_url("/props"), headers={"X-Priority": "9"}) as r:
            assert r.status == 200
    assert "X-Priority" not in backend[0].fake.seen[-1].headers


# --- bad input -----------------------------------------------------------------------------------------


BAD: list[tuple[dict[str, Any], dict[str, str], str]] = [
    ({"priority": "high"}, {}, "got 'high' (body field)"),
    ({"priority": 1.5}, {}, "got 1.5 (body field)"),
    ({"priority": 5.0}, {}, "got 5.0 (body field)"),
    ({"priority": True}, {}, "got true (body field)"),
    ({"priority": [1]}, {}, "got [1] (body field)"),
    ({"priority": 2**31}, {}, "got 2147483648 (body field)"),
    ({"priority": -(2**31) - 1}, {}, "got -2147483649 (body field)"),
    ({}, {"X-Priority": "abc"}, "got 'abc' (X-Priority header)"),
    ({}, {"X-Priority": "1.5"}, "got '1.5' (X-Priority header)"),
    ({}, {"X-Priority": "2147483648"}, "got '2147483648' (X-Priority header)"),
    ({}, {"X-Priority": "9" * 30}, "(X-Priority header)"),
    ({"priority": 1}, {"X-Priority": ""}, "got '' (X-Priority header)"),  # every value given is checked
]


async def test_a_priority_that_is_no_int32_is_refused_before_it_queues_and_running_streams_go_on(
    start: Start, backend: tuple[Backend, str]
) -> None:
    gate = AdmissionGate()
    server, proxy = await start(gate)
    b = backend[0]
    b.stream_events, b.stream_gap_s = 10, 0.1

    async def stream() -> bytes:
        async with aiohttp.ClientSession() as http:
            async with http.post(server.make_url("/v1/chat/completions"), json={**CHAT, "stream": True}) as r:
                assert r.status == 200
                return await r.read()

    running = asyncio.create_task(stream())
    await until(lambda: bool(b.seen))
    gate.update("test: hold everything", 0)  # a valid request would wait now: these must not
    t0 = time.monotonic()
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/messages", {"model": "m", "max_tokens": 8, **CHAT})):
        for body, headers, says in BAD:
            status, doc, h = await post(server, path, {**base, **body}, headers)
            err = doc["error"]
            # the server's own error object on every route, /v1/messages included (the server answers its
            # Anthropic route's errors in it too): the client's SDK raises it
            assert (status, err["code"], err["type"], err["kvctl_code"]) == (
                400,
                400,
                "invalid_request_error",
                "invalid_priority",
            ), (path, body, headers)
            assert h["X-Kvctl-Error"] == "invalid_priority"
            assert err["message"].startswith("kvctl: priority must be an integer in [-2147483648, 2147483647], ")
            assert says in err["message"], err["message"]
        status, doc, _ = await post(server, path, base, [("X-Priority", "1"), ("X-Priority", "2")])
        assert status == 400 and doc["error"]["message"] == "kvctl: more than one X-Priority header"
    assert time.monotonic() - t0 < 5 and proxy.queue.queued == 0
    assert len(b.seen) == 1, "none reached the server"
    events = (await asyncio.wait_for(running, 5)).split(b"\n\n")
    assert [e for e in events if e.startswith(b"data: {")] == [f'data: {{"n": {i}}}'.encode() for i in range(10)]
    assert b"data: [DONE]" in events


# --- admission order -----------------------------------------------------------------------------------


async def test_the_queue_admits_the_highest_priority_first_fifo_within(
    start: Start, backend: tuple[Backend, str]
) -> None:
    gate = AdmissionGate()
    gate.update("test: hold", 0)
    server, proxy = await start(gate)
    b = backend[0]
    asks = [0, 5, 0, -3, 5]
    with capture_logs() as logs:
        tasks = []
        for i, p in enumerate(asks):
            body = {"prompt": f"r{i}", "priority": p}
            tasks.append(asyncio.create_task(post(server, "/completion", body)))
            await until(lambda: proxy.queue.queued == len(tasks))  # each in the queue before the next arrives
        head = proxy.queue.head()
        assert head is not None and head[:2] == (5, proxy.config.reserve_cells) and head[2] >= 0
        for n in range(1, len(asks) + 1):
            gate.update(None, 1)  # room for one
            await until(lambda: len(b.seen) == n)  # noqa: B023 - awaited here, in this iteration
        await asyncio.gather(*tasks)
    order = [json.loads(s.body)["prompt"] for s in b.seen]
    assert order == ["r1", "r4", "r0", "r2", "r3"]
    assert proxy.queue.head() is None
    starts = {e["request_id"]: e for e in logs if e["event"] == "request.start"}
    assert sorted(e["priority"] for e in starts.values()) == sorted(asks)
    assert all(e["priority_source"] == "body field" for e in starts.values())
    access = [e for e in logs if e["event"] == "access"]
    assert sorted(e["priority"] for e in access) == sorted(asks)
    samples = {
        cls: proxy.metrics.registry.get_sample_value(
            "kvctl_proxy_admission_wait_seconds_count", {"priority_class": cls}
        )
        for cls in ("high", "normal", "low")
    }
    assert samples == {"high": 2, "normal": 2, "low": 1}


def test_the_wait_histogram_has_every_class_from_the_start_and_never_the_raw_number() -> None:
    proxy = Proxy(ProxyConfig(priority_high_at=10, priority_low_at=-10), AdmissionGate(), CollectorRegistry())
    r = proxy.metrics.registry
    for cls in ("high", "normal", "low"):
        assert r.get_sample_value("kvctl_proxy_admission_wait_seconds_count", {"priority_class": cls}) == 0
    assert {proxy.priority_class_of(p) for p in (9, -9, 0)} == {"normal"}
    assert (proxy.priority_class_of(10), proxy.priority_class_of(-10)) == ("high", "low")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_request_waiting_past_max_wait_goes_ahead_of_higher_ones() -> None:
    gate = AdmissionGate()
    gate.update("held", 0)
    clock = Clock()
    queue = AdmissionQueue(gate, depth=10, timeout_s=10, max_wait_s=10, clock=clock)
    order: list[str] = []

    async def client(name: str, priority: int) -> None:
        await queue.admit(5, priority)
        order.append(name)

    tasks = [asyncio.create_task(client("low-old", -5))]
    await asyncio.sleep(0)
    clock.now = 3
    tasks.append(asyncio.create_task(client("low-new", -5)))
    tasks.append(asyncio.create_task(client("high", 5)))
    await asyncio.sleep(0)
    clock.now = 10
    assert queue.head() == (5, 5, 7.0), "not past max_wait yet: the higher one first"
    clock.now = 10.5
    assert queue.head() == (-5, 5, 10.5), "its own priority, and how long it waited: the loop ages it too"
    gate.update(None, 1)
    await asyncio.sleep(0.01)
    assert order == ["low-old"]
    clock.now = 13.5  # low-new aged too: it ranks with the highest present, and came before it
    gate.update(None, 2)
    await asyncio.gather(*tasks)
    assert order == ["low-old", "low-new", "high"]
    await queue.close()


async def test_aging_in_real_time() -> None:
    gate = AdmissionGate()
    gate.update("held", 0)
    queue = AdmissionQueue(gate, depth=10, timeout_s=10, max_wait_s=0.05)
    order: list[int] = []

    async def client(priority: int) -> None:
        await queue.admit(0, priority)
        order.append(priority)

    low = asyncio.create_task(client(-1))
    await asyncio.sleep(0.1)
    high = asyncio.create_task(client(1))
    await asyncio.sleep(0)
    gate.update(None, 2)
    await asyncio.gather(low, high)
    assert order == [-1, 1]
    await queue.close()


async def test_head_of_line_by_order_not_by_size() -> None:
    gate = AdmissionGate()
    gate.update(None, 8, room_cells=100)
    queue = AdmissionQueue(gate, depth=10, timeout_s=10)
    big = asyncio.create_task(queue.admit(500, 0))
    await asyncio.sleep(0)
    small_same = asyncio.create_task(queue.admit(10, 0))
    await asyncio.sleep(0.01)
    assert not big.done() and not small_same.done(), "a large prompt at the head holds back smaller ones"
    assert queue.head() is not None and queue.head()[:2] == (0, 500)  # type: ignore[index]
    small_high = asyncio.create_task(queue.admit(10, 1))
    await asyncio.wait_for(small_high, 1)  # ahead by priority, and it fits: admitted without waiting for a poll
    assert not big.done() and not small_same.done()
    gate.update(None, 8, room_cells=600)
    await asyncio.wait_for(asyncio.gather(big, small_same), 1)
    await queue.close()


@pytest.mark.parametrize(
    ("proxy", "says"),
    [
        ({"objective_priorities": {"batch": 2**31}}, "proxy.objective_priorities"),
        ({"objective_priorities": {"batch": "low"}}, "proxy.objective_priorities"),
        ({"api_keys": [{"key": "k", "priority": 3, "max_priority": 1}]}, "'priority' (3) is above 'max_priority' (1)"),
    ],
)
def test_settings_refuse_priorities_the_proxy_could_not_use(proxy: dict[str, Any], says: str) -> None:
    with pytest.raises(SettingsError) as e:
        load_settings(overrides={"proxy": proxy})
    assert says in str(e.value)
