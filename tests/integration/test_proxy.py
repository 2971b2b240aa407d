"""The reverse proxy over the real patched server: streams survive parking, clients that leave
free their slots, admission queues and refuses cleanly, bad input gets clear errors."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import openai
import pytest

from controller.proxy.admission import AdmissionGate
from testkit.llama import (
    NO_BYTE_TOKENS,
    StreamResult,
    free_port,
    get_json,
    post_action,
    sse_events,
    stream_completion,
)
from tests.harness import POOL, ProxyFactory, ServerFactory


def chat(n: int) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": n, "temperature": 0}


async def test_openai_sdk_through_the_proxy_with_forced_parks(
    start_server: ServerFactory, start_proxy: ProxyFactory
) -> None:
    direct = start_server(*POOL)
    parking = start_server(*POOL, "--park-test-interval", "50")
    url = await start_proxy(parking.url)
    extra = {"ignore_eos": True}
    ref_client = openai.AsyncOpenAI(base_url=direct.url + "/v1", api_key="none")
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none")
    try:
        ref = await ref_client.chat.completions.create(model="m", **chat(300), extra_body=extra)
        got = await client.chat.completions.create(model="m", **chat(300), extra_body=extra)
        assert got.choices[0].message.content == ref.choices[0].message.content
        assert got.usage is not None and got.usage.completion_tokens == 300

        parts: list[str] = []
        stream = await client.chat.completions.create(model="m", **chat(300), stream=True, extra_body=extra)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        assert "".join(parts) == ref.choices[0].message.content
    finally:
        await ref_client.close()
        await client.close()
    assert "test park" not in parking.log_text()  # every forced park went through


async def test_64_concurrent_streams(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server("-c", "8192", "-np", "16", "-kvu", "--slots", "--metrics")
    url = await start_proxy(srv.url)
    results = await asyncio.gather(
        *[
            stream_completion(
                http, url, {"prompt": f"Stream {i}", "n_predict": 64, "ignore_eos": True, "logit_bias": NO_BYTE_TOKENS}
            )
            for i in range(64)
        ]
    )
    for res in results:
        assert res.status == 200 and res.error is None
        assert res.n_decoded == list(range(1, 65))


async def test_request_ids_and_heartbeats_while_parked(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL)
    url = await start_proxy(srv.url, heartbeat_s=1.0)
    seen: dict[str, Any] = {}

    async def park_for_a_while(res: StreamResult) -> None:
        if len(res.tokens) != 40:
            return
        slots = await get_json(http, srv.url + "/slots")
        busy = [s for s in slots if s["state"] == "generating"]
        seen["request_id"] = busy[0]["request_id"]
        assert (await post_action(http, srv.url, busy[0]["id"], "park"))[0] == 200
        await asyncio.sleep(2.5)
        assert (await post_action(http, srv.url, busy[0]["id"], "resume"))[0] == 200

    # long enough that the server is still generating when the client has read 40 tokens
    req = {"prompt": "Parked behind a proxy", "n_predict": 3000, "ignore_eos": True, "logit_bias": NO_BYTE_TOKENS}
    res = await stream_completion(http, url, req, headers={"X-Request-Id": "client-7"}, on_chunk=park_for_a_while)
    assert res.status == 200 and res.n_decoded == list(range(1, 3001))
    # the proxy's own id is the key; the client's is never trusted as one
    assert seen["request_id"].startswith("kvctl-")
    assert "parked" in res.comments and "resumed" in res.comments
    assert any(c.startswith("kvctl keep-alive") for c in res.comments)

    async with http.post(url + "/completion", json={**req, "n_predict": 4}, headers={"X-Request-Id": "abc"}) as r:
        assert r.headers["X-Request-Id"] == "abc"


@pytest.mark.parametrize("parked", [False, True], ids=["generating", "parked"])
async def test_client_disconnect_frees_the_slot(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession, parked: bool
) -> None:
    srv = start_server(*POOL)
    url = await start_proxy(srv.url)

    class HangUp(Exception):
        pass

    async def leave(res: StreamResult) -> None:
        if len(res.tokens) == 30:
            if parked:
                slot = next(s for s in await get_json(http, srv.url + "/slots") if s["state"] == "generating")
                assert (await post_action(http, srv.url, slot["id"], "park"))[0] == 200
            raise HangUp

    req = {"prompt": "Going away", "n_predict": 5000, "ignore_eos": True, "logit_bias": NO_BYTE_TOKENS}
    with pytest.raises(HangUp):
        async with aiohttp.ClientSession() as client:
            await stream_completion(client, url, req, on_chunk=leave)
    t0 = time.monotonic()
    limit = 3.0 if parked else 1.0
    while True:
        slots = await get_json(http, srv.url + "/slots")
        if all(s["state"] == "idle" for s in slots):
            break
        assert time.monotonic() - t0 < limit, [s["state"] for s in slots]
        await asyncio.sleep(0.05)
    kv = await get_json(http, srv.url + "/kv")
    assert kv["n_parked"] == 0 and kv["parked_bytes"] == 0


async def test_admission_queue_holds_then_admits_and_overflows(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL)
    gate = AdmissionGate()
    gate.update("test: pool above HIGH")
    url = await start_proxy(srv.url, gate, queue_depth=2, queue_grace_s=0.5, heartbeat_s=0.5)
    req = {"prompt": "Queued", "n_predict": 16, "ignore_eos": True, "logit_bias": NO_BYTE_TOKENS}
    waiting = [asyncio.create_task(stream_completion(http, url, req)) for _ in range(2)]
    await asyncio.sleep(1.5)
    assert not any(t.done() for t in waiting)
    # past the queue's depth: 503 with Retry-After and an OpenAI envelope marked as kvctl's
    async with http.post(url + "/completion", json=req) as resp:
        assert resp.status == 503 and resp.headers["Retry-After"] == "2"
        body = await resp.json()
        assert body["error"]["kvctl_code"] == "queue_full" and body["error"]["message"].startswith("kvctl:")
        assert body["error"]["code"] == 503 and resp.headers["X-Kvctl-Error"] == "queue_full"
    gate.update(None)
    for res in await asyncio.gather(*waiting):
        assert res.status == 200 and res.n_decoded == list(range(1, 17))
        # they waited past the grace period, so they got SSE headers and heartbeats first
        assert any(c.startswith("kvctl keep-alive (queued)") for c in res.comments)


async def test_bad_input_and_private_routes(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL)
    url = await start_proxy(srv.url, max_body_bytes=64 * 1024)
    for path in ("/completion", "/v1/chat/completions"):
        async with http.post(srv.url + path, data="{not json") as direct:
            want = (direct.status, await direct.json())
        async with http.post(url + path, data="{not json") as proxied:
            assert (proxied.status, await proxied.json()) == want
    async with http.post(url + "/completion", data=b"x" * (128 * 1024)) as resp:
        assert resp.status == 413
    async with http.get(url + "/no/such/route") as resp:
        assert resp.status in (404,)
    for method, path, status in (("POST", "/slots/0?action=park", 403), ("GET", "/kv", 403), ("GET", "/metrics", 404)):
        async with http.request(method, url + path) as resp:
            assert resp.status == status, path
            assert (await resp.json())["error"]["type"] == ("permission_error" if status == 403 else "not_found_error")
    for path in ("/health", "/v1/models", "/props"):
        async with http.get(url + path) as resp:
            assert resp.status == 200, path
    async with http.post(url + "/tokenize", json={"content": "hello"}) as resp:
        assert resp.status == 200 and (await resp.json())["tokens"]


async def test_upstream_down_and_dying_mid_stream(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    dead = await start_proxy(f"http://127.0.0.1:{free_port()}")
    async with http.post(dead + "/v1/chat/completions", json=chat(8)) as resp:
        assert resp.status == 503 and "Retry-After" in resp.headers
        body = await resp.json()
        assert body["error"]["kvctl_code"] == "upstream_unavailable"
        assert resp.headers["X-Kvctl-Error"] == "upstream_unavailable"

    srv = start_server(*POOL)
    # a server kvctl does not manage and that does not come back: past replay_timeout_s the stream gets its error
    url = await start_proxy(srv.url, replay_timeout_s=1.0)
    req = {"prompt": "The server dies", "n_predict": 100000, "ignore_eos": True, "stream": True}
    errors: list[dict[str, Any]] = []
    n_data = 0
    async with http.post(url + "/completion", json=req) as resp:
        assert resp.status == 200
        async for ev in sse_events(resp):
            if ev.data is None:
                continue
            chunk = json.loads(ev.data)
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            n_data += 1
            if n_data == 50:
                srv.stop()
    assert len(errors) == 1 and errors[0]["kvctl_code"] == "upstream_disconnected"
