"""Bad input at the admin API and the proxy, against a fake server: the cases the fuzzers found, kept
here so that they run without the real one (tests/integration/test_fuzz_kvctl.py fuzzes the real stack)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from controller.admin.app import make_admin_app
from controller.loop.control import ControlLoop
from controller.metrics import Metrics
from controller.proxy.admission import AdmissionGate
from controller.proxy.app import make_proxy_app
from controller.proxy.config import ProxyConfig
from controller.settings import load_settings
from controller.upstream.client import UpstreamClient
from tests.fakes.llama_server import FakeLlamaServer, kv_body

TOKEN = b"unit-token"
AUTH = (b"Authorization", b"Bearer " + TOKEN)


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def error(self) -> dict[str, Any]:
        assert self.headers.get("content-type", "").startswith("application/json"), (self.status, self.body)
        err = json.loads(self.body)["error"]
        assert err["message"] and err["type"]
        if "kvctl_code" in err:
            # the proxy: the server's own error object {code: status, message, type}, marked as kvctl's
            assert err["code"] == self.status and err["message"].startswith("kvctl: "), err
            assert self.headers["x-kvctl-error"] == err["kvctl_code"]
            return {**err, "code": err["kvctl_code"]}
        assert "param" in err and isinstance(err["code"], str)  # the admin API: the OpenAI envelope
        return dict(err)


async def raw(server: TestServer, method: str, target: str, *headers: tuple[bytes, bytes], body: bytes = b"") -> Answer:
    """One request written byte for byte: aiohttp's client would refuse most of these headers."""
    assert server.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    head = f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(body)}\r\n".encode()
    for name, value in headers:
        head += name + b": " + value + b"\r\n"
    writer.write(head + b"\r\n" + body)
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    if lines[0].split()[1] == "100":  # Expect: 100-continue, then the real answer
        head_bytes, _, rest = rest.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return Answer(int(lines[0].split()[1]), {k.lower(): v for k, v in fields.items()}, rest)


@pytest.fixture
async def fake() -> AsyncIterator[tuple[FakeLlamaServer, TestServer]]:
    f = FakeLlamaServer()
    f.kv = kv_body(1000, [{}, {}])
    server = TestServer(f.app())
    await server.start_server()
    yield f, server
    await server.close()


@pytest.fixture
async def admin(fake: tuple[FakeLlamaServer, TestServer]) -> AsyncIterator[TestServer]:
    settings = load_settings(
        overrides={"upstream": {"url": str(fake[1].make_url(""))}, "admin": {"token": TOKEN.decode()}}
    )
    async with UpstreamClient(str(settings.upstream.url)) as client:
        server = TestServer(make_admin_app(settings, ControlLoop(client, settings, Metrics(CollectorRegistry()))))
        await server.start_server()
        yield server
        await server.close()


async def test_admin_answers_what_aiohttp_would_answer_in_plain_text_in_the_envelope(admin: TestServer) -> None:
    ans = await raw(admin, "GET", "/no/such/route", AUTH)
    assert ans.status == 404 and ans.error["type"] == "not_found_error"
    ans = await raw(admin, "GET", "/slots/0/park", AUTH)
    assert ans.status == 405 and ans.headers["allow"] == "POST" and ans.error["type"] == "invalid_request_error"
    ans = await raw(admin, "GET", "/status", AUTH, (b"Expect", b"\x80"))
    assert ans.status == 417 and ans.error["code"] == "expectation_failed"
    ans = await raw(admin, "GET", "/nowhere", AUTH, (b"Expect", b"later"))
    assert ans.status == 417 and ans.error["code"] == "expectation_failed"
    ans = await raw(admin, "GET", "/healthz", (b"Expect", b"100-continue"))
    assert ans.status == 200


async def test_admin_refuses_credentials_and_slot_ids_it_cannot_read(admin: TestServer) -> None:
    for value in (b"Bearer \xff", b"Bearer unit-toke\xc3\xa9", b""):
        ans = await raw(admin, "GET", "/status", (b"Authorization", value))
        assert ans.status == 401 and ans.error["type"] == "authentication_error"
    for slot in ("%E2%91%A0", "%D9%A3", "-1", "1e3", "9999999999"):  # ①, an Arabic-Indic 3
        ans = await raw(admin, "POST", f"/slots/{slot}/park", AUTH)
        assert ans.status == 400 and ans.error["code"] == "invalid_slot", slot


@pytest.fixture
async def proxy(fake: tuple[FakeLlamaServer, TestServer]) -> AsyncIterator[tuple[TestServer, AdmissionGate]]:
    gate = AdmissionGate()
    config = ProxyConfig(upstream=str(fake[1].make_url("")).rstrip("/"), max_body_bytes=200_000, queue_timeout_s=30)
    server = TestServer(make_proxy_app(config, gate, CollectorRegistry()))
    await server.start_server()
    yield server, gate
    await server.close()


@pytest.mark.parametrize(
    "target", ["/v1/../kv", "/./slots", "/v1/%2e%2e/slots", "/health/..%2Fmetrics", "/v1/models/%2E%2E/%2e%2E/kv"]
)
async def test_the_proxy_refuses_dot_segments_before_they_reach_a_private_route(
    proxy: tuple[TestServer, AdmissionGate], fake: tuple[FakeLlamaServer, TestServer], target: str
) -> None:
    ans = await raw(proxy[0], "GET", target)
    assert ans.status == 400 and ans.error["code"] == "invalid_path"
    assert fake[0].seen == [], "nothing reached the server"


async def test_the_proxy_refuses_what_it_cannot_forward(
    proxy: tuple[TestServer, AdmissionGate], fake: tuple[FakeLlamaServer, TestServer]
) -> None:
    server, _ = proxy
    ans = await raw(server, "POST", "/completion", body=b"x" * 300_000)
    assert ans.status == 413 and ans.error["code"] == "body_too_large"
    ans = await raw(server, "POST", "/completion", (b"X-Note", b"caf\xe9"), body=b"{}")
    assert ans.status == 400 and ans.error["code"] == "invalid_header"
    ans = await raw(server, "POST", "/completion", (b"Expect", b"\x80"), body=b"{}")
    assert ans.status == 417 and ans.error["code"] == "expectation_failed"
    assert fake[0].seen == []


async def test_requests_the_server_refuses_at_once_skip_the_admission_queue(
    proxy: tuple[TestServer, AdmissionGate],
) -> None:
    server, gate = proxy
    gate.update("test: hold everything")
    bodies = [
        ("/completion", b'{"prompt": null}'),
        ("/completion", b'{"prompt": "x", "stream": "yes"}'),
        ("/v1/completions", b"{}"),
        ("/v1/chat/completions", b'{"messages": "hi"}'),
    ]
    for route, body in bodies:
        t0 = time.monotonic()
        ans = await raw(server, "POST", route, body=body)
        assert time.monotonic() - t0 < 1.0, (route, "waited in the queue")
        assert (ans.status, ans.body) == (404, b"404: Not Found"), "the fake's own answer: it was forwarded"
    # nested deeper than Python's parser goes, it may still be a valid request to the server's parser: it waits
    # its turn like any other rather than slipping past admission
    deep = asyncio.create_task(
        raw(server, "POST", "/completion", body=b'{"prompt": "x", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    )
    await asyncio.sleep(0.5)
    assert not deep.done()
    gate.update(None)
    assert (await deep).status == 404


async def test_no_spelling_of_a_private_route_reaches_the_server(
    proxy: tuple[TestServer, AdmissionGate], fake: tuple[FakeLlamaServer, TestServer]
) -> None:
    server, _ = proxy
    for method, target, status in (
        ("POST", "/slots/0/?action=park", 403),
        ("POST", "/slots/0%2F?action=erase", 403),
        ("HEAD", "/kv", 403),
        ("HEAD", "/metrics", 404),
    ):
        ans = await raw(server, method, target)
        assert ans.status == status, (method, target)
    assert fake[0].seen == [], "nothing reached the server"


async def test_predict_instances_cannot_reach_private_routes(fake: tuple[FakeLlamaServer, TestServer]) -> None:
    config = ProxyConfig(upstream=str(fake[1].make_url("")).rstrip("/"), predict_route="/predict")
    server = TestServer(make_proxy_app(config, AdmissionGate(), CollectorRegistry()))
    await server.start_server()
    try:
        for fmt in ("kv", "/slots/:id_slot", "slots", "stream", "chatCompletionsControl", "metrics"):
            body = json.dumps({"instances": [{"@requestFormat": "chatCompletions"}, {"@requestFormat": fmt}]})
            ans = await raw(server, "POST", "/predict?id_slot=0&action=park", body=body.encode())
            assert ans.status == 400 and ans.error["code"] == "invalid_predict", fmt
        deep = b'{"instances": [' + b"[" * 5000 + b"]" * 5000 + b"]}"
        ans = await raw(server, "POST", "/predict", body=deep)
        assert ans.status == 400 and ans.error["code"] == "invalid_predict"
        assert fake[0].seen == []
    finally:
        await server.close()


async def test_two_conversation_ids_are_refused(
    proxy: tuple[TestServer, AdmissionGate], fake: tuple[FakeLlamaServer, TestServer]
) -> None:
    server, _ = proxy
    body = b'{"messages": [{"role": "user", "content": "hi"}], "stream": true}'
    ans = await raw(
        server, "POST", "/v1/chat/completions", (b"X-Conversation-Id", b"a"), (b"x-conversation-id", b"b"), body=body
    )
    assert ans.status == 400 and ans.error["code"] == "invalid_header"
    assert fake[0].seen == []
