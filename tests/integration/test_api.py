"""The proxy is the server's whole API: real client libraries, every route of the pinned server, the WebUI's
resumable streams, all through kvctl over the real patched server."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from controller.proxy.admission import AdmissionGate
from controller.proxy.routes import Kind, RouteTable
from testkit.llama import parse_metrics
from tests.harness import POOL, ProxyFactory, ServerFactory, pinned_routes

pytestmark = pytest.mark.server

EXTRA = {"ignore_eos": True, "temperature": 0}
N = 120


async def anthropic_text(base_url: str, api_key: str = "none") -> str:
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        parts: list[str] = []
        async with client.messages.stream(
            model="m",
            max_tokens=N,
            messages=[{"role": "user", "content": "Tell me a story."}],
            extra_body=EXTRA,
        ) as stream:
            async for text in stream.text_stream:
                parts.append(text)
        return "".join(parts)
    finally:
        await client.close()


async def responses_text(base_url: str, api_key: str = "none") -> str:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0)
    try:
        parts: list[str] = []
        stream = await client.responses.create(
            model="m", input="Tell me a story.", max_output_tokens=N, stream=True, extra_body=EXTRA
        )
        async for event in stream:
            if event.type == "response.output_text.delta":
                parts.append(event.delta)
        return "".join(parts)
    finally:
        await client.close()


async def parks(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as resp:
        return parse_metrics(await resp.text())["llamacpp:slot_parks_total"]


async def test_anthropic_and_responses_sdks_through_kvctl_with_forced_parks(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    direct = start_server(*POOL)
    parking = start_server(*POOL, "--park-test-interval", "50")
    url = await start_proxy(parking.url)
    want_messages = await anthropic_text(direct.url)
    want_responses = await responses_text(direct.url)
    assert len(want_messages) > 20 and len(want_responses) > 20
    assert await anthropic_text(url) == want_messages
    assert await responses_text(url) == want_responses
    assert "test park" not in parking.log_text()  # every forced park went through
    assert await parks(http, parking.url) >= 4  # each stream of 120 tokens was parked twice


async def test_a_kvctl_error_reaches_each_sdk_as_an_exception(
    start_server: ServerFactory, start_proxy: ProxyFactory
) -> None:
    srv = start_server(*POOL)
    gate = AdmissionGate()
    gate.update("test: pool above HIGH")
    # held past the grace period, the stream has its SSE headers: the queue timeout comes as an error event
    url = await start_proxy(srv.url, gate, queue_grace_s=0.2, queue_timeout_s=1.0, heartbeat_s=0.3)
    with pytest.raises(anthropic.APIStatusError) as a:
        await anthropic_text(url)
    assert "kvctl: waited" in str(a.value)
    with pytest.raises(openai.APIError) as o:
        await responses_text(url)
    assert "kvctl: waited" in str(o.value)


def request_for(method: str, path: str) -> dict[str, Any]:
    if method == "POST":
        return {"json": {}}
    return {}


async def test_every_route_answers_through_kvctl_as_it_does_directly(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL, "--metrics")
    url = await start_proxy(srv.url)
    table = RouteTable()
    checked = []
    for method, path in sorted(pinned_routes()):
        route = table.lookup(method, path.replace(":id_slot", "0"))
        assert route is not None, (method, path)
        if route.kind is Kind.PRIVATE:
            continue  # refused on the public listener: test_private_routes_are_refused
        target = path.replace(":id_slot", "0")
        async with http.request(method, srv.url + target, **request_for(method, path)) as d:
            want = d.status
        async with http.request(method, url + target, **request_for(method, path)) as p:
            got = p.status
        assert got == want, (method, path, got, want)
        checked.append((method, path, want))
    assert len(checked) >= 40, checked
    # kvctl relays what the pinned table does not name (static assets, newer routes) too
    for method, target in (("GET", "/"), ("GET", "/no/such/route"), ("PUT", "/v1/models")):
        async with http.request(method, srv.url + target) as d, http.request(method, url + target) as p:
            assert p.status == d.status, target


async def test_private_routes_are_refused(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL, "--metrics")
    url = await start_proxy(srv.url)
    for method, path in (("GET", "/kv"), ("POST", "/slots/0?action=park"), ("POST", "/slots/0?action=erase")):
        async with http.request(method, url + path) as resp:
            assert resp.status == 403, path
            body = await resp.json()
            assert body["error"]["type"] == "permission_error" and resp.headers["X-Kvctl-Error"] == "private_route"
            assert "admin API" in body["error"]["message"]
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 404, "no control loop feeds the endpoint gauges here; the server's are never relayed"
    # the slot view is the server's, as a client reads it directly
    async with http.get(srv.url + "/slots") as d, http.get(url + "/slots") as p:
        assert p.status == d.status == 200
        assert [s["id"] for s in await p.json()] == [s["id"] for s in await d.json()]
    opened = await start_proxy(srv.url, expose_private_routes=True)
    async with http.get(opened + "/kv") as resp:
        assert resp.status == 200
    async with http.get(opened + "/metrics") as resp:
        assert resp.status == 404, "the server's llamacpp:* series never leave through the proxy"


async def read_some(session: aiohttp.ClientSession, method: str, url: str, n: int, **kw: Any) -> bytes:
    """The first n bytes of a response body, then hang up."""
    got = b""
    async with session.request(method, url, **kw) as resp:
        assert resp.status == 200, await resp.text()
        while len(got) < n:
            chunk = await resp.content.readany()
            if not chunk:
                break
            got += chunk
        resp.close()
    return got[:n] if len(got) > n else got


async def read_all(session: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, bytes]:
    async with session.request(method, url, **kw) as resp:
        return resp.status, await resp.read()


async def test_resumable_streams_through_kvctl_byte_for_byte(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL, "--park-test-interval", "40")
    url = await start_proxy(srv.url, heartbeat_s=0.2)  # heartbeats would show up in the bytes if kvctl sent any
    conv = f"conv-{uuid.uuid4().hex}"
    body = {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 400,
        "stream": True,
        **EXTRA,
    }
    first = await read_some(
        http, "POST", url + "/v1/chat/completions", 3000, json=body, headers={"X-Conversation-Id": conv}
    )
    assert len(first) == 3000
    # the server keeps generating after the client left; the WebUI finds it and resumes where it stopped
    status, found = await read_all(http, "POST", url + "/v1/streams/lookup", json={"conversation_ids": [conv]})
    assert status == 200 and json.loads(found)[0]["conversation_id"] == conv
    status, rest = await read_all(http, "GET", url + f"/v1/stream?conv_id={conv}&from={len(first)}")
    assert status == 200
    status, direct = await read_all(http, "GET", srv.url + f"/v1/stream?conv_id={conv}&from=0")
    assert status == 200
    assert first + rest == direct
    assert b"[DONE]" in direct and b"kvctl" not in direct
    assert direct.count(b": parked") >= 2  # the server's own notices are its bytes: relayed as they are
    # the Stop button: DELETE through kvctl evicts it
    status, _ = await read_all(http, "DELETE", url + f"/v1/stream?conv_id={conv}")
    assert status == 204
    status, _ = await read_all(http, "GET", srv.url + f"/v1/stream?conv_id={conv}&from=0")
    assert status == 404


async def test_a_conversation_stream_keeps_generating_when_its_client_leaves_while_queued(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL)
    gate = AdmissionGate()
    gate.update("test: pool above HIGH")
    url = await start_proxy(srv.url, gate)
    conv = f"conv-{uuid.uuid4().hex}"
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "stream": True, **EXTRA}

    async def leave() -> None:
        async with http.post(url + "/v1/chat/completions", json=body, headers={"X-Conversation-Id": conv}):
            pass

    task = asyncio.create_task(leave())
    await asyncio.sleep(0.5)
    task.cancel()  # the client hangs up while kvctl still holds the request in its queue
    await asyncio.gather(task, return_exceptions=True)
    gate.update(None)
    for _ in range(100):
        status, found = await read_all(http, "POST", srv.url + "/v1/streams/lookup", json={"conversation_ids": [conv]})
        if json.loads(found) and json.loads(found)[0]["is_done"]:
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"the queued conversation never ran: {found!r}")
    status, direct = await read_all(http, "GET", srv.url + f"/v1/stream?conv_id={conv}&from=0")
    assert status == 200 and b"[DONE]" in direct
