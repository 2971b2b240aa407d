"""A drain's edges apart from the server (controller.proxy.drain, controller.proxy.peers): the admin route's body
checks, `kvctl drain`, what makes two replicas serve the same model, and the peer key at the front door."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.cli.main import main
from controller.errors import Code, KvctlError, admin_error_response
from controller.proxy.app import make_proxy_app
from controller.proxy.config import ProxyConfig
from controller.proxy.peers import model_list
from tests.harness import AdminCase, admin_app, admin_posts


def test_two_servers_serve_the_same_model_when_their_ids_and_metadata_agree() -> None:
    def models(*entries: tuple[str, Any]) -> bytes:
        return json.dumps({"object": "list", "data": [{"id": i, "meta": m} for i, m in entries]}).encode()

    meta = {"n_params": 134515008, "size": 88000000, "n_vocab": 49152, "n_ctx_train": 8192}
    a = model_list(models(("smollm2", meta)))
    assert a is not None and a == model_list(models(("smollm2", dict(reversed(meta.items())))))
    assert a != model_list(models(("smollm2", {**meta, "size": 99000000}))), "another quantization"
    assert a != model_list(models(("other", meta)))
    assert model_list(b"<html>") is None and model_list(b'{"data": [{}]}') is None and model_list(None) is None


async def test_the_admin_route_checks_its_body_and_answers_what_the_drain_says() -> None:
    calls: list[Any] = []

    async def drain(peers: list[str] | None) -> dict[str, Any]:
        calls.append(peers)
        if peers is None:
            raise KvctlError(400, Code.INVALID_PEERS, "no peer to drain to")
        return {"moved": 2, "finished_here": 1, "failed": 0, "seconds": 1.5}

    cases: list[AdminCase] = [
        (b'{"peers": ["http://10.0.0.7:8080", "https://b.example/kvctl"]}', 200, None),
        (b"", 400, "invalid_peers"),  # none given, none configured: the drain's own refusal
        (b'{"peers": "http://10.0.0.7:8080"}', 400, "invalid_peers"),
        (b'{"peers": ["10.0.0.7:8080"]}', 400, "invalid_peers"),
        (b'{"peers": ["ftp://h/"]}', 400, "invalid_peers"),
        (b'{"peers": ["http://h/?x=1"]}', 400, "invalid_peers"),
        (b'{"peers": [], "force": true}', 400, "invalid_peers"),
        (b"{not json", 400, "invalid_peers"),
    ]
    answers = await admin_posts(admin_app(drain=drain), "/drain", cases)
    assert answers == [{"moved": 2, "finished_here": 1, "failed": 0, "seconds": 1.5}]
    assert calls == [["http://10.0.0.7:8080", "https://b.example/kvctl"], None]


async def test_kvctl_drain_sends_its_peers_and_says_what_moved(capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[Any] = []

    async def drain(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if not body:
            return admin_error_response(400, "no peer to drain to", "invalid_peers")
        failed = 1 if len(body["peers"]) > 1 else 0
        return web.json_response({"moved": 3, "finished_here": 1, "failed": failed, "seconds": 2.5})

    app = web.Application()
    app.router.add_post("/drain", drain)
    server = TestServer(app)
    await server.start_server()
    try:
        admin = f"127.0.0.1:{server.port}"

        def run(*args: str) -> int:
            return main(["drain", "--admin", admin, *args])

        assert await asyncio.to_thread(run, "--text", "--to", "http://a:1") == 0
        assert "3 moved, 1 finished here, 0 failed" in capsys.readouterr().out
        assert await asyncio.to_thread(run, "--json", "--to", "http://a:1", "--to", "http://b:2") == 1
        assert json.loads(capsys.readouterr().out)["failed"] == 1
        assert await asyncio.to_thread(run) == 1
        assert "no peer to drain to" in capsys.readouterr().err
    finally:
        await server.close()
    assert seen == [{"peers": ["http://a:1"]}, {"peers": ["http://a:1", "http://b:2"]}, {}]


@pytest.mark.parametrize(
    ("configured", "sent", "status"),
    [(None, "k", 403), ("k", "wrong", 403), ("k", "", 403), ("k", "k", 200)],
)
async def test_a_moved_request_needs_the_peer_key_and_never_carries_it_to_the_server(
    configured: str | None, sent: str, status: int
) -> None:
    """Behind kvctl keys: the peer key stands for the client's, and the server gets its own key, not the peer's."""
    got: list[dict[str, str]] = []

    async def models(request: web.Request) -> web.Response:
        got.append(dict(request.headers))
        return web.json_response({"data": []})

    upstream = web.Application()
    upstream.router.add_get("/v1/models", models)
    fake = TestServer(upstream)
    await fake.start_server()
    config = ProxyConfig(
        upstream=str(fake.make_url("")).rstrip("/"),
        upstream_api_key="server-key",
        api_keys=(),
        peer_api_key=configured,
    )
    proxy = TestServer(make_proxy_app(config))
    await proxy.start_server()
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(proxy.make_url("/v1/models"), headers={"X-Kvctl-Peer": sent, "Authorization": "Bearer c"}) as r,
        ):
            assert r.status == status, await r.text()
            if status == 403:
                assert r.headers["X-Kvctl-Error"] == "peer_forbidden" and not got
            else:
                (headers,) = got
                assert headers["Authorization"] == "Bearer server-key" and "X-Kvctl-Peer" not in headers
    finally:
        await proxy.close()
        await fake.close()
