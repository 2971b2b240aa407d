"""The reverse proxy in front of the patched llama-server.

Each generation request is tagged with its own X-Request-Id, so the controller knows which slot
serves which stream (llama-server echoes it in /slots). Streams are relayed event by event,
byte for byte; heartbeat comments fill silences (a parked or queued request) between complete
events. A client that hangs up cancels the upstream request at once (handler_cancellation).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.httputil import unsupported_expect
from controller.proxy.admission import AdmissionGate, AdmissionQueue, QueueFull, QueueTimeout
from controller.proxy.sse import SSEFramer, comment_text, has_data, is_comment

log = structlog.get_logger("kvctl.proxy")

# generation routes: they take cells, so they pass admission
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/completion", "/completions")
# other POST routes that are passed through as they are
PASSTHROUGH_POST = ("/v1/embeddings", "/tokenize", "/detokenize")
# never reachable from the public listener unless allowed: a client must not park someone
# else's chat, read other users' requests or renew the controller's lease
PRIVATE_GET = ("/slots", "/kv", "/metrics")

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "TE",
        "Trailer",
        "Upgrade",
        "Proxy-Authorization",
        "Proxy-Authenticate",
        "Proxy-Connection",
        "Content-Length",
        "Content-Encoding",
        "Host",
    )
)

REQUEST_ID_KEY = web.AppKey("kvctl_request_ids", dict)


@dataclass(frozen=True)
class ProxyConfig:
    upstream: str = "http://127.0.0.1:8081"
    upstream_api_key: str | None = None
    heartbeat_s: float = 5.0  # longest silence on a stream before a heartbeat comment
    queue_grace_s: float = 2.0  # a streaming request queued longer than this gets SSE headers and heartbeats
    queue_depth: int = 256
    queue_timeout_s: float = 300.0
    write_timeout_s: float = 60.0  # a client that accepts no bytes for this long is cut off
    max_body_bytes: int = 16 * 1024 * 1024
    connect_timeout_s: float = 5.0
    expose_private_routes: bool = False
    retry_after_s: int = 2
    reserve_cells: int = 512  # the least a new request is assumed to need (admission_reserve_cells)


@dataclass
class Inflight:
    request_id: str
    client_request_id: str | None
    route: str
    t_start: float
    state: str = "queued"  # queued | upstream | streaming


@dataclass
class ProxyMetrics:
    registry: CollectorRegistry
    requests: Counter = field(init=False)
    inflight: Gauge = field(init=False)
    queued: Gauge = field(init=False)
    admission_wait: Histogram = field(init=False)
    ttft: Histogram = field(init=False)
    disconnects: Counter = field(init=False)
    stream_errors: Counter = field(init=False)
    heartbeats: Counter = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("kvctl_proxy_requests", "Requests by route and status", ["route", "status"], registry=r)
        self.inflight = Gauge("kvctl_proxy_inflight_requests", "Requests in flight", registry=r)
        self.queued = Gauge("kvctl_proxy_queued_requests", "Requests waiting for admission", registry=r)
        self.admission_wait = Histogram(
            "kvctl_proxy_admission_wait_seconds",
            "Time waiting for admission",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
        )
        self.ttft = Histogram(
            "kvctl_proxy_time_to_first_token_seconds",
            "Time to first token as the client sees it",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.disconnects = Counter("kvctl_proxy_client_disconnects", "Clients that hung up mid-request", registry=r)
        self.stream_errors = Counter("kvctl_proxy_stream_errors", "Stream errors by stage", ["stage"], registry=r)
        self.heartbeats = Counter("kvctl_proxy_heartbeats", "Heartbeat comments sent", registry=r)


def is_utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def has_dot_segments(path: str) -> bool:
    """``.`` or ``..`` as a segment of the (percent-decoded) path."""
    return any(segment in (".", "..") for segment in path.split("/"))


def refused_by_server(route: str, payload: dict[str, Any]) -> bool:
    """A generation request the server refuses before it takes a slot: no prompt, no message list, or a stream
    flag that is not a boolean. Conservative: anything else goes through admission."""
    if "stream" in payload and not isinstance(payload["stream"], bool):
        return True
    if route == "/v1/chat/completions":
        return not isinstance(payload.get("messages"), list)
    return payload.get("prompt") is None


def estimate_prompt_cells(route: str, payload: dict[str, Any]) -> int:
    """Cells a request's prompt will take, before the server tokenizes it: exact for token ids, and for
    text one token per 3 bytes of UTF-8 (most tokenizers average 3.5 to 4.5 on prose, so this errs
    towards holding a large prompt back rather than letting it overflow the pool)."""

    def text(n_bytes: int) -> int:
        return -(-n_bytes // 3)

    def one(p: Any) -> int:
        if isinstance(p, str):
            return text(len(p.encode("utf-8", "replace")))
        if isinstance(p, list):
            if all(isinstance(t, int) for t in p):
                return len(p)
            return sum(one(x) for x in p)  # several prompts: each takes a slot, but all their cells count
        if isinstance(p, dict):  # a multimodal or templated part: its text
            return sum(one(v) for k, v in p.items() if k in ("text", "content", "prompt_string"))
        return 0

    if route == "/v1/chat/completions":
        messages = payload.get("messages")
        # roles and the chat template add a few tokens per message
        return (
            sum(one(m.get("content")) + 8 for m in messages if isinstance(m, dict)) if isinstance(messages, list) else 0
        )
    return one(payload.get("prompt"))


def error_body(message: str, code: str, etype: str = "server_error") -> dict[str, Any]:
    """The OpenAI envelope, marked as kvctl's own so an operator can tell it from the server's."""
    return {"error": {"message": f"kvctl: {message}", "type": etype, "param": None, "code": code}}


def error_response(
    status: int, message: str, code: str, retry_after: int | None = None, etype: str = "server_error"
) -> web.Response:
    headers = {"X-Kvctl-Error": "1"}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return web.json_response(error_body(message, code, etype), status=status, headers=headers)


def error_event(message: str, code: str) -> bytes:
    return b"data: " + json.dumps(error_body(message, code)).encode() + b"\n\n"


class AdmissionRefused(Exception):
    """Queue full or timed out; carries the SSE response if the client already has one."""

    def __init__(self, prepared: web.StreamResponse | None, code: str) -> None:
        super().__init__(code)
        self.prepared = prepared
        self.code = code


class Proxy:
    def __init__(self, config: ProxyConfig, gate: AdmissionGate, registry: CollectorRegistry) -> None:
        self.config = config
        self.gate = gate
        self.queue = AdmissionQueue(gate, config.queue_depth, config.queue_timeout_s)
        self.metrics = ProxyMetrics(registry)
        self.inflight: dict[str, Inflight] = {}
        self.session: aiohttp.ClientSession | None = None

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        # one connection per request: llama-server closes idle keep-alive connections, and a pooled one
        # that it closed fails on write ("Can not write request body"); on loopback a connect costs ~0.1 ms
        self.session = aiohttp.ClientSession(
            timeout=timeout, auto_decompress=False, connector=aiohttp.TCPConnector(limit=0, force_close=True)
        )

    async def stop(self, app: web.Application) -> None:
        await self.queue.close()
        if self.session is not None:
            await self.session.close()

    # --- helpers -------------------------------------------------------------------------

    def upstream_headers(self, request: web.Request, request_id: str) -> dict[str, str]:
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in HOP_BY_HOP and k.lower() not in ("x-request-id", "x-park-lease")
        }
        headers["X-Request-Id"] = request_id
        headers["Accept-Encoding"] = "identity"
        if self.config.upstream_api_key and "Authorization" not in headers:
            headers["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        return headers

    @staticmethod
    def response_headers(
        upstream: aiohttp.ClientResponse, client_request_id: str | None, request_id: str
    ) -> dict[str, str]:
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
        headers["X-Request-Id"] = client_request_id or request_id
        return headers

    def count(self, route: str, status: int) -> None:
        self.metrics.requests.labels(route=route, status=str(status)).inc()

    # --- handlers ------------------------------------------------------------------------

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        value = await unsupported_expect(request)
        if value is None:
            return None
        self.count("other", 417)
        return error_response(
            417, f"unsupported Expect header {value!r}", "expectation_failed", etype="invalid_request_error"
        )

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self.route(request)
        except web.HTTPRequestEntityTooLarge:
            self.count("other", 413)
            return error_response(
                413,
                f"request body larger than {self.config.max_body_bytes} bytes",
                "body_too_large",
                etype="invalid_request_error",
            )

    async def route(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        bad = next((k for k, v in request.headers.items() if not is_utf8(v)), None)
        if bad is not None:
            # aiohttp hands such bytes over as surrogates, which no upstream request or response header can carry
            self.count("other", 400)
            return error_response(
                400, f"header {bad!r} is not valid UTF-8", "invalid_header", etype="invalid_request_error"
            )
        if has_dot_segments(path):
            # the upstream URL is normalized on the way out: /v1/../kv would reach the server as /kv, past the
            # private-route check below
            self.count("other", 400)
            return error_response(
                400, f"path with dot segments: {path!r}", "invalid_path", etype="invalid_request_error"
            )
        if request.method == "POST" and path in GENERATION_ROUTES:
            return await self.generation(request)
        if request.method == "POST" and path in PASSTHROUGH_POST:
            return await self.passthrough(request)
        if request.method == "GET" and (not path.startswith(PRIVATE_GET) or self.config.expose_private_routes):
            return await self.passthrough(request)
        if request.method == "POST" and path.startswith("/slots") and self.config.expose_private_routes:
            return await self.passthrough(request)
        self.count("other", 404)
        return error_response(
            404, f"no route {request.method} {path} on the public listener", "not_found", etype="not_found_error"
        )

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        request_id = f"kvctl-{uuid.uuid4().hex}"
        body = await request.read()
        return await self.forward(request, body, request_id, None, stream=False)

    async def generation(self, request: web.Request) -> web.StreamResponse:
        client_request_id = request.headers.get("X-Request-Id")
        request_id = f"kvctl-{uuid.uuid4().hex}"
        body = await request.read()
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser's stack
            payload = None
        if not isinstance(payload, dict) or refused_by_server(request.path, payload):
            # malformed: the server answers it at once, exactly as it would without kvctl; it takes no cells, so it
            # must not wait in the admission queue for a slot it would never use
            return await self.forward(request, body, request_id, client_request_id, stream=False)
        stream = payload.get("stream", False) is True
        if self.gate.refuse_reason is not None:
            self.count(request.path, 503)
            return error_response(
                503, self.gate.refuse_reason, "upstream_unavailable", retry_after=self.config.retry_after_s
            )

        entry = Inflight(request_id, client_request_id, request.path, time.monotonic())
        self.inflight[request_id] = entry
        self.metrics.inflight.inc()
        log.info(
            "request.start",
            request_id=request_id,
            client_request_id=client_request_id,
            route=request.path,
            stream=stream,
        )
        try:
            t_queue = time.monotonic()
            try:
                cells = max(self.config.reserve_cells, estimate_prompt_cells(request.path, payload))
                early = await self.wait_for_admission(request, stream, cells)
            except AdmissionRefused as e:
                return await self.refuse(request, e.prepared, str(e.__cause__), e.code)
            self.metrics.admission_wait.observe(time.monotonic() - t_queue)
            entry.state = "upstream"
            return await self.forward(
                request, body, request_id, client_request_id, stream=stream, prepared=early, entry=entry
            )
        finally:
            self.inflight.pop(request_id, None)
            self.metrics.inflight.dec()

    async def refuse(
        self, request: web.Request, early: web.StreamResponse | None, message: str, code: str
    ) -> web.StreamResponse:
        self.count(request.path, 503)
        log.warning("admission.refused", route=request.path, reason=code)
        if early is not None:
            # the client already has SSE headers: the failure comes as an OpenAI error event
            await self.write(request, early, error_event(message, code))
            return early
        return error_response(503, message, code, retry_after=self.config.retry_after_s)

    async def wait_for_admission(self, request: web.Request, stream: bool, cells: int) -> web.StreamResponse | None:
        """Queue while the gate holds; a streaming client waiting past the grace period gets
        SSE headers and heartbeats, so neither it nor a reverse proxy in between times out."""
        if self.queue.queued == 0 and self.gate.take(cells):
            return None
        self.metrics.queued.inc()
        admit = asyncio.ensure_future(self.queue.admit(cells))
        try:
            prepared: web.StreamResponse | None = None
            deadline = time.monotonic() + self.config.queue_grace_s
            while True:
                wait = deadline - time.monotonic() if prepared is None else self.config.heartbeat_s
                done, _ = await asyncio.wait({admit}, timeout=max(0.0, wait))
                if done:
                    try:
                        admit.result()
                    except QueueFull as e:
                        raise AdmissionRefused(prepared, "queue_full") from e
                    except QueueTimeout as e:
                        raise AdmissionRefused(prepared, "queue_timeout") from e
                    return prepared
                if not stream:
                    deadline = float("inf")
                    continue
                if prepared is None:
                    prepared = await self.prepare_sse(request, None, None)
                await self.heartbeat(request, prepared, "queued")
        finally:
            if not admit.done():
                admit.cancel()
            self.metrics.queued.dec()

    async def prepare_sse(
        self, request: web.Request, upstream: aiohttp.ClientResponse | None, headers: dict[str, str] | None
    ) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=headers or {})
        resp.content_type = "text/event-stream"
        resp.headers["Cache-Control"] = "no-cache"
        resp.headers["X-Accel-Buffering"] = "no"
        await resp.prepare(request)
        return resp

    async def write(self, request: web.Request, resp: web.StreamResponse, data: bytes) -> None:
        try:
            async with asyncio.timeout(self.config.write_timeout_s):
                await resp.write(data)
        except TimeoutError:
            # a stalled client: cut it off rather than hold the slot for it
            self.metrics.stream_errors.labels(stage="client_stalled").inc()
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("client stalled") from None

    async def heartbeat(self, request: web.Request, resp: web.StreamResponse, why: str) -> None:
        self.metrics.heartbeats.inc()
        await self.write(request, resp, f": kvctl keep-alive ({why})\n\n".encode())

    async def forward(
        self,
        request: web.Request,
        body: bytes,
        request_id: str,
        client_request_id: str | None,
        *,
        stream: bool,
        prepared: web.StreamResponse | None = None,
        entry: Inflight | None = None,
    ) -> web.StreamResponse:
        assert self.session is not None
        route = request.path if request.path in GENERATION_ROUTES + PASSTHROUGH_POST else "other"
        url = self.config.upstream.rstrip("/") + request.path_qs
        t0 = time.monotonic()
        try:
            upstream_cm = self.session.request(
                request.method, url, data=body if body else None, headers=self.upstream_headers(request, request_id)
            )
            upstream = await upstream_cm.__aenter__()
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            self.metrics.stream_errors.labels(stage="connect").inc()
            log.warning("upstream.unreachable", request_id=request_id, error=str(e))
            if prepared is not None:
                await self.write(
                    request, prepared, error_event(f"llama-server is unreachable: {e}", "upstream_unavailable")
                )
                return prepared
            self.count(route, 503)
            return error_response(
                503, f"llama-server is unreachable: {e}", "upstream_unavailable", retry_after=self.config.retry_after_s
            )
        try:
            is_sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
            if not is_sse or upstream.status != 200:
                data = await upstream.read()
                self.count(route, upstream.status)
                if prepared is not None:
                    # too late for a status: the server's error becomes an error event
                    await self.write(
                        request,
                        prepared,
                        b"data: " + data + b"\n\n"
                        if data
                        else error_event(f"llama-server answered {upstream.status}", "upstream_error"),
                    )
                    return prepared
                return web.Response(
                    status=upstream.status,
                    body=data,
                    headers=self.response_headers(upstream, client_request_id, request_id),
                )
            resp = prepared or await self.prepare_sse(
                request, upstream, self.response_headers(upstream, client_request_id, request_id)
            )
            if entry is not None:
                entry.state = "streaming"
            await self.relay(request, upstream, resp, t0, request_id)
            self.count(route, 200)
            return resp
        except asyncio.CancelledError:
            # the client hung up: leaving the upstream context closes that connection, and
            # llama-server releases the slot
            self.metrics.disconnects.inc()
            log.info("client.disconnected", request_id=request_id)
            raise
        except ConnectionResetError:
            self.metrics.disconnects.inc()
            raise
        finally:
            await upstream_cm.__aexit__(None, None, None)

    async def relay(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        resp: web.StreamResponse,
        t0: float,
        request_id: str,
    ) -> None:
        framer = SSEFramer()
        first = True
        while True:
            try:
                async with asyncio.timeout(self.config.heartbeat_s):
                    chunk = await upstream.content.readany()
            except TimeoutError:
                if not framer.pending:
                    await self.heartbeat(request, resp, "silence")
                continue
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                self.metrics.stream_errors.labels(stage="upstream").inc()
                log.warning("upstream.disconnected", request_id=request_id, error=str(e))
                await self.write(
                    request, resp, error_event(f"llama-server went away mid-stream: {e}", "upstream_disconnected")
                )
                return
            if not chunk:
                rest = framer.flush()
                if rest:
                    await self.write(request, resp, rest)
                return
            for event in framer.feed(chunk):
                if first and has_data(event):
                    first = False
                    self.metrics.ttft.observe(time.monotonic() - t0)
                if is_comment(event):
                    text = comment_text(event)
                    if text in ("parked", "resumed"):
                        log.info(f"stream.{text}", request_id=request_id)
                await self.write(request, resp, event)


def make_proxy_app(
    config: ProxyConfig, gate: AdmissionGate | None = None, registry: CollectorRegistry | None = None
) -> web.Application:
    """The public listener's app. Run it with handler_cancellation=True (see run_site)."""
    proxy = Proxy(config, gate or AdmissionGate(), registry or CollectorRegistry())
    app = web.Application(client_max_size=config.max_body_bytes)
    app[PROXY_KEY] = proxy
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_route("*", "/{tail:.*}", proxy.handle, expect_handler=proxy.expect)
    return app


PROXY_KEY = web.AppKey("kvctl_proxy", Proxy)


async def run_site(app: web.Application, host: str, port: int) -> Callable[[], Awaitable[None]]:
    """Serve app; a client that hangs up cancels its handler, so the upstream request ends at once."""
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner.cleanup
