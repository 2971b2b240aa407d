"""While the server comes back, at the proxy: requests are held, not refused; what routers and frontends see; no
client-facing error names an internal address or an exception; GET /slots as a client may see it.

A small upstream that can be stopped and started again on its port stands in for llama-server here; the real
server's restarts are in tests/integration/test_restart_hold.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from controller.keys import ApiKey
from controller.proxy.admission import AdmissionGate
from controller.proxy.app import PROXY_KEY, Proxy, make_proxy_app
from controller.proxy.config import ProxyConfig
from controller.proxy.restart import LOADING_BODY
from testkit.llama import free_port
from tests.fakes.llama_server import FakeLlamaServer, error
from tests.harness import FAST_LOOP, running_app

MODELS = {"object": "list", "data": [{"id": "tiny", "object": "model"}]}
LEAKS = re.compile(r"127\.0\.0\.1:|localhost:|\b[A-Z][A-Za-z]*(Error|Exception)\b|Errno|errno")


class Upstream:
    """llama-server's shape on a fixed port: chat (streamed or not), /v1/models, /props, /health, /slots, /tokenize.
    ``hold``: chats wait for it before they answer; ``die_mid_stream``: a stream's connection breaks after one
    event."""

    def __init__(self, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.hold = asyncio.Event()
        self.hold.set()
        self.die_mid_stream = False
        self.request_ids: list[str] = []
        self._runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            if self.api_key and request.path != "/health":
                if request.headers.get("Authorization") != f"Bearer {self.api_key}":
                    body = {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}
                    return web.json_response(body, status=401)
            return await handler(request)

        def answer(body: Any, status: int = 200) -> Any:
            async def handler(_: web.Request) -> web.Response:
                return web.json_response(body, status=status) if body is not None else web.Response(status=status)

            return handler

        app = web.Application(middlewares=[auth])
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/messages", self.chat)
        app.router.add_get("/v1/models", answer(MODELS))
        app.router.add_get("/models", answer(MODELS))
        app.router.add_get("/props", answer({"n_ctx": 4096}))
        app.router.add_post("/tokenize", answer({"tokens": [1, 2]}))
        app.router.add_get("/health", answer({"status": "ok"}))
        app.router.add_get("/slots", self.slots)
        app.router.add_route("OPTIONS", "/{tail:.*}", answer(None, 204))
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app())
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.request_ids.append(request.headers.get("X-Request-Id", ""))
        await self.hold.wait()
        if not body.get("stream"):
            return web.json_response({"choices": [{"message": {"content": "Paris"}}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"content":"Par"}}]}\n\n')
        if self.die_mid_stream:
            assert request.transport is not None
            request.transport.abort()
            return resp
        await resp.write(b'data: {"choices":[{"delta":{"content":"is"}}]}\n\ndata: [DONE]\n\n')
        return resp

    async def slots(self, _: web.Request) -> web.Response:
        rid = self.request_ids[-1] if self.request_ids else None
        return web.json_response(
            [
                {"id": 0, "is_processing": rid is not None, "request_id": rid},
                {"id": 1, "is_processing": True, "request_id": "someone-else"},
                {"id": 2, "is_processing": False, "request_id": None},
            ]
        )


@contextlib.asynccontextmanager
async def proxy_for(
    upstream: Upstream, *, comes_back: bool, **config: Any
) -> AsyncIterator[tuple[str, Proxy, AdmissionGate]]:
    gate = AdmissionGate()
    cfg = ProxyConfig(upstream=upstream.url, queue_grace_s=0.2, heartbeat_s=0.2, admin_port=8091, **config)
    app = make_proxy_app(cfg, gate, CollectorRegistry())
    proxy = app[PROXY_KEY]
    proxy.state.comes_back = lambda: comes_back
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/"), proxy, gate
    finally:
        await server.close()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    u = Upstream()
    yield u
    await u.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


CHAT = {"messages": [{"role": "user", "content": "capital of France?"}]}


async def read_stream(resp: aiohttp.ClientResponse) -> str:
    return (await resp.read()).decode()


async def test_requests_sent_while_the_server_comes_back_wait_for_it_and_complete(
    upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    async with proxy_for(upstream, comes_back=True) as (url, _, gate):
        gate.server_down()  # the server was killed: the loop's poll says so
        plain = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=CHAT))
        stream = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json={**CHAT, "stream": True}))
        props = asyncio.ensure_future(http.get(url + "/props"))
        await asyncio.sleep(0.8)
        assert not plain.done() and not props.done(), "held, not refused"
        await upstream.start()
        gate.server_up()
        gate.update(None)
        async with await plain as r:
            assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == "Paris"
        async with await stream as r:
            text = await read_stream(r)
            assert r.status == 200 and ": kvctl keep-alive (server restarting)" in text, "heartbeats while it waited"
            assert '"Par"' in text and '"is"' in text and "data: [DONE]" in text
        async with await props as r:
            assert r.status == 200 and (await r.json()) == {"n_ctx": 4096}


async def test_during_the_wait_the_model_list_is_cached_and_health_says_loading(
    upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    await upstream.start()
    async with proxy_for(upstream, comes_back=True, replay_timeout_s=0.5) as (url, _, gate):
        async with http.get(url + "/v1/models") as r:
            assert r.status == 200 and await r.json() == MODELS
        await upstream.stop()
        gate.server_down()
        for path in ("/v1/models", "/models"):
            async with http.get(url + path) as r:
                # /models was never asked of the server: it waits (here: until the bound), /v1/models is cached
                if path == "/v1/models":
                    assert r.status == 200 and await r.json() == MODELS and r.headers["X-Kvctl-Cached"] == "1"
                else:
                    assert r.status == 503 and r.headers["X-Kvctl-Error"] == "server_restarting"
        for path in ("/health", "/v1/health"):
            async with http.get(url + path) as r:
                assert r.status == 503 and await r.read() == LOADING_BODY, "the server's own answer while loading"


async def test_past_the_bound_each_protocol_gets_its_error(upstream: Upstream, http: aiohttp.ClientSession) -> None:
    async with proxy_for(upstream, comes_back=True, replay_timeout_s=0.6) as (url, _, gate):
        gate.server_down()
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503 and r.headers["X-Kvctl-Error"] == "server_restarting" and "Retry-After" in r.headers
            assert "did not come back within 0.6 s" in (await r.json())["error"]["message"]
        async with http.post(url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
            text = await read_stream(r)
            assert r.status == 200 and '"kvctl_code": "server_restarting"' in text and text.startswith(": kvctl")
        body = {"model": "m", "max_tokens": 8, "stream": True, **CHAT}
        async with http.post(url + "/v1/messages", json=body) as r:
            text = await read_stream(r)
            assert "event: error\n" in text and "server_restarting" in text
        async with http.get(url + "/props") as r:
            assert r.status == 503 and r.headers["X-Kvctl-Error"] == "server_restarting"


async def test_the_queue_bound_holds_during_a_restart(upstream: Upstream, http: aiohttp.ClientSession) -> None:
    async with proxy_for(upstream, comes_back=True, queue_depth=2) as (url, _, gate):
        gate.server_down()
        held = [asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=CHAT)) for _ in range(2)]
        await asyncio.sleep(0.3)
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503 and r.headers["X-Kvctl-Error"] == "queue_full" and "Retry-After" in r.headers
        await upstream.start()
        gate.server_up()
        gate.update(None)
        for fut in held:
            async with await fut as r:
                assert r.status == 200


async def test_an_attached_server_that_never_answered_is_refused_at_once(
    upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    async with proxy_for(upstream, comes_back=False) as (url, _, gate):
        gate.server_down()
        waiting = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.3)
        gate.refuse("llama-server is not answering", "upstream_unavailable")  # the loop's first poll found nothing
        async with await asyncio.wait_for(waiting, 2) as r:
            assert r.status == 503 and r.headers["X-Kvctl-Error"] == "upstream_unavailable"
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            assert r.status == 503 and r.headers["X-Kvctl-Error"] == "upstream_unavailable"


async def test_a_server_that_died_since_the_last_poll_is_waited_for(
    upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    """The gate is still open (no poll has seen the death yet): nothing listens, and the request, never delivered,
    is sent once the server answers again."""
    async with proxy_for(upstream, comes_back=True) as (url, _, _gate):
        sent = asyncio.ensure_future(http.post(url + "/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.5)
        assert not sent.done()
        await upstream.start()
        async with await sent as r:
            assert r.status == 200


async def wait_until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def leaks(text: str) -> list[str]:
    return [m.group(0) for m in LEAKS.finditer(text)]


async def collect(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, str]:
    async with http.request(method, url, **kw) as r:
        head = " ".join(f"{k}: {v}" for k, v in r.headers.items())
        return r.status, head + "\n" + (await r.read()).decode(errors="replace")


async def test_no_client_facing_error_names_an_address_or_an_exception(
    upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    seen: list[tuple[str, int, str]] = []

    async def every_route(url: str, label: str) -> None:
        for method, path, body in (
            ("POST", "/v1/chat/completions", CHAT),
            ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
            ("POST", "/v1/messages", {"model": "m", "max_tokens": 8, "stream": True, **CHAT}),
            ("GET", "/props", None),
            ("GET", "/v1/models", None),
            ("GET", "/health", None),
            ("GET", "/slots", None),
            ("POST", "/tokenize", {"content": "x"}),
            ("GET", "/", None),
            ("OPTIONS", "/v1/chat/completions", None),
        ):
            status, text = await collect(http, method, url + path, json=body)
            seen.append((f"{label} {method} {path}", status, text))

    # nothing listens and nothing says it will come back: answered at once
    async with proxy_for(upstream, comes_back=False) as (url, _, _gate):
        await every_route(url, "dead")
    async with proxy_for(upstream, comes_back=False, upstream_api_key="k") as (url, _, _gate):
        await every_route(url, "dead, server key")
    # it comes back, but not within the bound
    async with proxy_for(upstream, comes_back=True, replay_timeout_s=0.3) as (url, _, gate):
        await every_route(url, "race")
        await upstream.stop()
        status, text = await collect(http, "GET", url + "/health")
        assert status == 503 and text.endswith(LOADING_BODY.decode()), "a health probe is answered at once"
        gate.server_down()
        await every_route(url, "restarting")
    # it goes away mid-stream (no replay: the stream ends with its error event)
    await upstream.start()
    upstream.die_mid_stream = True
    async with proxy_for(upstream, comes_back=False, replay_limit=0) as (url, _, _gate):
        status, text = await collect(http, "POST", url + "/v1/chat/completions", json={**CHAT, "stream": True})
        assert "upstream_disconnected" in text
        seen.append(("mid-stream", status, text))
        for path in ("/slots/0?action=park", "/slots/1?action=erase"):
            status, text = await collect(http, "POST", url + path)
            assert status == 403 and "port 8091" in text and "private_route" in text
            seen.append((path, status, text))
        status, text = await collect(http, "GET", url + "/kv")
        assert status == 403
    errors = [(what, status, text) for what, status, text in seen if status >= 400 or "error" in text]
    assert len(errors) >= 30
    found = [(what, leaks(text)) for what, _, text in errors if leaks(text)]
    assert not found, found


async def test_slots_are_relayed_and_each_tenant_sees_its_own(upstream: Upstream, http: aiohttp.ClientSession) -> None:
    await upstream.start()
    keys = (ApiKey("ka", "alice"), ApiKey("kb", "bob"), ApiKey("ko", "ops", operator=True))
    upstream.hold.clear()
    async with proxy_for(upstream, comes_back=False, api_keys=keys, upstream_api_key=None) as (url, _, _gate):
        chat = asyncio.ensure_future(
            http.post(
                url + "/v1/chat/completions",
                json=CHAT,
                headers={"Authorization": "Bearer ka", "X-Request-Id": "alice-1"},
            )
        )
        for _ in range(100):
            if upstream.request_ids:
                break
            await asyncio.sleep(0.02)

        async def slots(key: str | None) -> tuple[int, Any]:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with http.get(url + "/slots", headers=headers) as r:
                return r.status, await r.json()

        status, body = await slots(None)
        assert status == 401 and body["error"]["message"] == "Invalid API Key"
        status, alice = await slots("ka")
        assert status == 200 and alice == [{"id": 0, "is_processing": True, "request_id": "alice-1"}]
        status, bob = await slots("kb")
        assert status == 200 and bob == []
        status, ops = await slots("ko")
        assert [s["id"] for s in ops] == [0, 1, 2] and ops[0]["request_id"] == "alice-1"
        upstream.hold.set()
        async with await chat as r:
            assert r.status == 200


async def test_slots_with_the_server_key_need_a_key_as_the_server_does(
    http: aiohttp.ClientSession,
) -> None:
    u = Upstream(api_key="secret")
    await u.start()
    try:
        async with proxy_for(u, comes_back=False, upstream_api_key="secret") as (url, _, _gate):
            async with http.get(url + "/slots") as r:
                assert r.status == 401
            async with http.get(url + "/slots", headers={"Authorization": "Bearer secret"}) as r:
                assert r.status == 200 and len(await r.json()) == 3
    finally:
        await u.stop()


def test_the_slots_view_leaves_a_body_it_cannot_read_alone_but_not_for_a_tenant() -> None:
    from controller.keys import Identity
    from controller.proxy.slots import slots_view

    assert slots_view(b"not json", Identity(None), False, {}) == b"not json"
    assert slots_view(b'{"a": 1}', Identity("alice", ApiKey("k", "alice")), True, {}) == b"[]"
    assert json.loads(slots_view(b'[{"id": 0, "request_id": null}]', Identity(None), False, {})) == [
        {"id": 0, "request_id": None}
    ]


async def test_a_server_answering_polls_with_an_error_that_waiting_does_not_mend_is_refused_at_once(
    http: aiohttp.ClientSession,
) -> None:
    """A wrong upstream.api_key: the server answers every poll with 401. It is not coming back by waiting."""
    fake = FakeLlamaServer()
    fake.queue("GET /kv", *[error(401, "authentication_error", "Invalid API Key")] * 10_000)
    async with running_app(fake, loop=FAST_LOOP) as (app, url, _):
        await wait_until(lambda: app.gate.refuse_reason is not None, 5, "the first poll")
        t0 = asyncio.get_running_loop().time()
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            body = await r.json()
            assert r.status == 503 and r.headers["X-Kvctl-Error"] == "upstream_unavailable"
            assert "HTTP 401" in body["error"]["message"] and not leaks(json.dumps(body))
        assert asyncio.get_running_loop().time() - t0 < 1


async def test_kvctl_holds_requests_from_its_start_until_an_attached_server_first_answers(
    http: aiohttp.ClientSession,
) -> None:
    """Before the first poll nothing is known: a request waits for it, and is refused only once it finds no server
    that ever answered."""
    port = free_port()
    async with running_app(f"http://127.0.0.1:{port}", loop=FAST_LOOP) as (app, url, admin):
        await wait_until(lambda: app.gate.refuse_reason is not None, 5, "the first poll")
        async with http.post(url + "/v1/chat/completions", json=CHAT) as r:
            body = await r.json()
            assert r.status == 503 and r.headers["X-Kvctl-Error"] == "upstream_unavailable"
            assert body["error"]["message"] == "kvctl: llama-server is not answering", body
        async with http.get(admin + "/status") as r:
            assert "Cannot connect" in json.dumps(await r.json()), "the details are the operator's, on /status"


def test_a_predict_instance_cannot_reach_the_slot_view_past_its_filter() -> None:
    from controller.proxy.inspection import predict_refused
    from controller.proxy.routes import RouteTable

    table = RouteTable(predict_route="/predict")
    for fmt in ("/slots", "slots"):
        assert predict_refused(table, {"instances": [{"@requestFormat": fmt}]}), fmt
    assert not predict_refused(table, {"instances": [{"@requestFormat": "chatCompletions"}]})


async def test_one_error_answer_holds_requests_and_only_a_run_of_them_refuses() -> None:
    fake = FakeLlamaServer()
    fake.queue("GET /kv", error(500, "server_error", "blip"))
    async with running_app(fake, loop=FAST_LOOP) as (app, _, _admin):
        await wait_until(lambda: app.loop.state.polls >= 3, 5, "polls after the blip")
        assert app.gate.refuse_reason is None and app.gate.down_since is None


async def test_a_remembered_credential_holds_only_for_a_while() -> None:
    from controller.proxy.auth import Answer, ServerCheck

    async def probe(creds: dict[str, str]) -> Answer:
        return Answer(200)

    check = ServerCheck(probe, ttl_s=0.05)
    headers = {"Authorization": "Bearer k"}
    assert check.last(headers, 10) is None, "never asked: nothing to remember"
    assert (await check.check(headers)).status == 200
    assert check.last(headers, 10) == Answer(200)
    await asyncio.sleep(0.2)
    assert check.last(headers, 10) == Answer(200) and check.last(headers, 0.1) is None


async def test_with_the_server_key_a_refused_server_is_refused_with_its_own_code(
    upstream: Upstream, http: aiohttp.ClientSession
) -> None:
    async with proxy_for(upstream, comes_back=False, upstream_api_key="k") as (url, _, gate):
        gate.server_down()
        asyncio.get_running_loop().call_later(0.2, gate.refuse, "llama-server is not answering", "upstream_unavailable")
        async with http.get(url + "/props", headers={"Authorization": "Bearer k"}) as r:
            assert r.status == 503 and r.headers["X-Kvctl-Error"] == "upstream_unavailable"
