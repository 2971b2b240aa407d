"""Authentication through kvctl answers exactly as the server does directly: with the server's --api-key checked
by the server, and with kvctl's own keys; on an idle pool and on a busy one with requests queued."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
import structlog

from controller.proxy.admission import AdmissionGate
from tests.harness import POOL, ProxyFactory, ServerFactory

pytestmark = pytest.mark.server

SERVER_KEY = "sk-server-3f9a1c"
ALICE, BOB = "sk-alice-77e2b0", "sk-bob-0c41d9"
ORIGIN = {"Origin": "http://webui.example"}

# (what the client sends) with {K} standing for a valid key
CREDENTIALS: list[tuple[str, dict[str, str]]] = [
    ("none", {}),
    ("wrong bearer", {"Authorization": "Bearer sk-wrong"}),
    ("right bearer", {"Authorization": "Bearer {K}"}),
    ("right, no Bearer prefix", {"Authorization": "{K}"}),
    ("right x-api-key", {"X-Api-Key": "{K}"}),
    ("wrong Authorization wins over a right x-api-key", {"Authorization": "Bearer sk-wrong", "X-Api-Key": "{K}"}),
    ("empty Authorization, right x-api-key", {"Authorization": "", "X-Api-Key": "{K}"}),
    ("lower-case bearer", {"Authorization": "bearer {K}"}),
]

SMALL_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
REQUESTS: list[tuple[str, str, Any]] = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", SMALL_CHAT),
    ("POST", "/v1/messages", {**SMALL_CHAT, "model": "m"}),
    ("POST", "/tokenize", {"content": "hello"}),
    ("GET", "/props", None),
    ("GET", "/slots", None),
    ("GET", "/health", None),
    ("GET", "/v1/health", None),
    ("OPTIONS", "/v1/chat/completions", None),
    ("GET", "/no/such/route", None),
    ("POST", "/no/such/route", {}),
]


def fill(headers: dict[str, str], key: str) -> dict[str, str]:
    return {k: v.replace("{K}", key) for k, v in headers.items()}


async def answer(
    http: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str], body: Any
) -> tuple[int, bytes | None, str | None]:
    """(status, the body when it is an error, Access-Control-Allow-Origin)."""
    kw: dict[str, Any] = {"headers": {**ORIGIN, **headers}}
    if body is not None:
        kw["json"] = body
    async with http.request(method, url, **kw) as resp:
        data = await resp.read()
        return resp.status, data if resp.status == 401 else None, resp.headers.get("Access-Control-Allow-Origin")


async def matrix(http: aiohttp.ClientSession, direct: str, proxied: str, client_key: str) -> None:
    for label, headers in CREDENTIALS:
        for method, path, body in REQUESTS:
            want = await answer(http, method, direct + path, fill(headers, SERVER_KEY), body)
            got = await answer(http, method, proxied + path, fill(headers, client_key), body)
            assert got == want, (label, method, path)


@pytest.fixture
def logs() -> Any:
    with structlog.testing.capture_logs() as captured:
        yield captured


def assert_no_key_logged(captured: list[dict[str, Any]]) -> None:
    assert captured, "kvctl logged nothing: the check would prove nothing"
    text = json.dumps(captured, default=str)
    for key in (SERVER_KEY, ALICE, BOB):
        assert key not in text


async def test_the_servers_key_checked_by_the_server(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession, logs: Any
) -> None:
    srv = start_server(*POOL, "--api-key", SERVER_KEY)
    url = await start_proxy(srv.url, upstream_api_key=SERVER_KEY)
    await matrix(http, srv.url, url, SERVER_KEY)
    assert_no_key_logged(logs)


async def test_kvctls_own_keys_answer_as_the_server_does(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession, logs: Any
) -> None:
    from controller.keys import ApiKey

    srv = start_server(*POOL, "--api-key", SERVER_KEY)
    url = await start_proxy(srv.url, upstream_api_key=SERVER_KEY, api_keys=(ApiKey(ALICE, "alice"), ApiKey(BOB, "bob")))
    await matrix(http, srv.url, url, ALICE)
    await matrix(http, srv.url, url, BOB)
    # the server's key is the server's: it is not one of kvctl's
    status, _, _ = await answer(http, "GET", url + "/v1/models", {"Authorization": f"Bearer {SERVER_KEY}"}, None)
    assert status == 401
    # and a server without a key takes kvctl's verified requests as they are, kvctl's keys never reaching it
    open_srv = start_server(*POOL)
    open_url = await start_proxy(open_srv.url, api_keys=(ApiKey(ALICE, "alice"),))
    for label, headers in CREDENTIALS:
        want = await answer(http, "GET", srv.url + "/v1/models", fill(headers, SERVER_KEY), None)
        got = await answer(http, "GET", open_url + "/v1/models", fill(headers, ALICE), None)
        assert got[0] == want[0], label
    assert any(e.get("key") == "alice" for e in logs), "the access log names the key"
    assert_no_key_logged(logs)


@pytest.mark.parametrize("mode", ["server key", "kvctl keys"])
async def test_a_rejected_client_never_holds_a_queue_place(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession, mode: str
) -> None:
    from controller.keys import ApiKey

    srv = start_server(*POOL, "--api-key", SERVER_KEY)
    gate = AdmissionGate()
    gate.update("test: pool above HIGH")
    keys = (ApiKey(ALICE, "alice"),) if mode == "kvctl keys" else ()
    good = ALICE if keys else SERVER_KEY
    url = await start_proxy(srv.url, gate, upstream_api_key=SERVER_KEY, api_keys=keys, queue_depth=2)
    auth = {"Authorization": f"Bearer {good}"}
    body = {**SMALL_CHAT, "stream": True}

    async def chat(headers: dict[str, str]) -> tuple[int, bytes]:
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            return resp.status, await resp.read()

    queued = [asyncio.create_task(chat(auth)) for _ in range(2)]
    await asyncio.sleep(0.5)
    assert not any(t.done() for t in queued)
    # the queue is full of verified requests: bad credentials still get the server's 401 at once, not a 503
    for label, headers in CREDENTIALS:
        if "{K}" in json.dumps(headers) and "wrong" not in label and "lower" not in label:
            continue
        direct = await answer(http, "POST", srv.url + "/v1/chat/completions", fill(headers, SERVER_KEY), body)
        got = await answer(http, "POST", url + "/v1/chat/completions", fill(headers, good), body)
        assert got == direct and got[0] == 401, label
    # private routes: 401 without a key, refused with one; the slot view relayed, as the server answers it
    for method, path in (("GET", "/slots"), ("GET", "/kv"), ("POST", "/slots/0?action=park")):
        async with http.request(method, url + path) as resp:
            assert resp.status == 401, path
        async with http.request(method, url + path, headers=auth) as resp:
            assert resp.status == (200 if path == "/slots" else 403), path
    status, data = await chat(auth)
    assert status == 503 and json.loads(data)["error"]["kvctl_code"] == "queue_full"
    gate.update(None)
    for status, data in await asyncio.gather(*queued):
        assert status == 200 and b"[DONE]" in data


async def test_with_several_keys_conversations_belong_to_the_key_that_started_them(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    from controller.keys import ApiKey

    srv = start_server(*POOL)
    url = await start_proxy(srv.url, api_keys=(ApiKey(ALICE, "alice"), ApiKey(BOB, "bob")))
    alice, bob = {"Authorization": f"Bearer {ALICE}"}, {"X-Api-Key": BOB}
    conv = "conv-owned-by-alice"
    body = {**SMALL_CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    completion_id = None
    async with http.post(url + "/v1/chat/completions", json=body, headers={**alice, "X-Conversation-Id": conv}) as resp:
        assert resp.status == 200
        line = await resp.content.readline()
        completion_id = json.loads(line.decode().removeprefix("data: "))["id"]
        # still generating: Bob can neither see, read, stop nor steer it
        lookup = {"conversation_ids": [conv]}
        async with http.post(url + "/v1/streams/lookup", json=lookup, headers=bob) as r:
            assert r.status == 200 and await r.json() == []
        async with http.get(url + f"/v1/stream?conv_id={conv}&from=0", headers=bob) as r:
            assert r.status == 404
        async with http.delete(url + f"/v1/stream?conv_id={conv}", headers=bob) as r:
            assert r.status == 204
        # nor replace it with one of his own under the same id
        taken = {"X-Conversation-Id": conv, **bob}
        async with http.post(url + "/v1/chat/completions", json=body, headers=taken) as r:
            assert r.status == 409 and (await r.json())["error"]["kvctl_code"] == "conversation_taken"
        # a form body naming her conversation does not get past the check of the query either
        form = {"Content-Type": "application/x-www-form-urlencoded", **bob}
        async with http.delete(url + "/v1/stream?conv_id=mine", data=f"conv_id={conv}", headers=form) as r:
            assert r.status == 204
        control = {"id": completion_id, "action": "reasoning_end"}
        async with http.post(url + "/v1/chat/completions/control", json=control, headers=bob) as r:
            assert "no active completion" in await r.text()
        async with http.post(url + "/v1/chat/completions/control", json=control, headers=alice) as r:
            assert "no active completion" not in await r.text(), "Alice's own completion is found"
        async with http.post(url + "/v1/streams/lookup", json=lookup, headers=alice) as r:
            found = await r.json()
            assert r.status == 200 and [s["conversation_id"] for s in found] == [conv]
        async with http.get(url + f"/v1/stream?conv_id={conv}&from=0", headers=alice) as r:
            assert r.status == 200
            assert (await r.content.readline()).startswith(b"data: ")
        async with http.delete(url + f"/v1/stream?conv_id={conv}", headers=alice) as r:
            assert r.status == 204
    async with http.post(srv.url + "/v1/streams/lookup", json={"conversation_ids": [conv]}) as r:
        assert await r.json() == [], "Alice's Stop evicted it"
