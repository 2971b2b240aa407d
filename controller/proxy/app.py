"""The reverse proxy in front of the patched llama-server: the server's whole API, behind the server's own
authentication rules.

Every request is authenticated first (``controller.proxy.auth``), then classified by the pinned server's
route table (``controller.proxy.routes``): generation routes get their effective priority
(``controller.proxy.priority``), pass admission in priority order, get their own X-Request-Id (so the controller
knows which slot serves which stream: llama-server echoes it in /slots), the effective X-Priority, and heartbeats
while queued or parked; the controller's private routes are refused; everything else is relayed as it
is. Every response is streamed as it arrives. SSE streams are relayed event by event, byte for byte;
what kvctl itself says on a stream (a heartbeat, an error) comes between complete events and in the
framing the server uses on that route. Resumable (conversation) streams are relayed byte for byte with
nothing of kvctl's own. A client that hangs up cancels the upstream request at once
(handler_cancellation), except a conversation stream, which the server keeps generating.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import io
import json
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from yarl import URL

from controller.errors import Code, error_headers, proxy_error_object, proxy_error_response
from controller.httputil import unsupported_expect
from controller.keys import ApiKey, Identity, KeyRing
from controller.priorities import PRIORITY_CLASSES, priority_class
from controller.proxy.admission import AdmissionGate, AdmissionQueue, QueueFull, QueueTimeout
from controller.proxy.auth import PUBLIC_PATHS, UNAUTHORIZED_BODY, Answer, ServerCheck
from controller.proxy.endpoint_metrics import CONTENT_TYPE, EndpointMetrics
from controller.proxy.priority import (
    PRIORITY_HEADER,
    InvalidPriority,
    Priority,
    PriorityRules,
    resolve_priority,
)
from controller.proxy.replay import ANNOUNCE_HEADER, OPT_OUT_HEADER, ReplayMemory, Transcript
from controller.proxy.routes import Kind, Route, RouteTable
from controller.proxy.sse import SSEFramer, comment_text, has_data, is_comment

log = structlog.get_logger("kvctl.proxy")
_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvctl_request_id", default=None)
_priority: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvctl_priority", default=None)
access_log = structlog.get_logger("kvctl.access")

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
        "Host",
    )
)
CREDENTIALS = ("authorization", "x-api-key")
# routes polled many times a second: no access-log line
QUIET_PATHS = frozenset({"/health", "/v1/health", "/metrics"})
# after the drain: how long the ended streams get to send their error event, and other relays to finish
DRAIN_GRACE_S = 2.0
# the server's limit on a request body (cpp-httplib's CPPHTTPLIB_PAYLOAD_MAX_LENGTH)
SERVER_MAX_BODY_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class ProxyConfig:
    upstream: str = "http://127.0.0.1:8081"
    upstream_api_key: str | None = None
    api_keys: tuple[ApiKey, ...] = ()  # kvctl's own keys (proxy.api_keys and proxy.api_keys_file)
    heartbeat_s: float = 5.0  # longest silence on a stream before a heartbeat comment
    queue_grace_s: float = 2.0  # a streaming request queued longer than this gets SSE headers and heartbeats
    queue_depth: int = 256
    queue_timeout_s: float = 300.0
    write_timeout_s: float = 60.0  # a client that accepts no bytes for this long is cut off
    max_body_bytes: int = SERVER_MAX_BODY_BYTES
    connect_timeout_s: float = 5.0
    upstream_read_timeout_s: float = 60.0  # a started response that sends no byte for this long is ended
    drain_s: float = 15.0
    expose_private_routes: bool = False
    retry_after_s: int = 2
    reserve_cells: int = 512  # the least a new request is assumed to need (admission_reserve_cells)
    predict_route: str | None = None  # the Vertex AI predict route, when the server registers one
    auth_cache_s: float = 5.0  # how long the server's acceptance of a credential is kept
    client_priority: bool = True  # without kvctl keys: whether clients may set priorities (proxy.client_priority)
    objective_priorities: Mapping[str, int] = field(default_factory=dict)  # llm-d objective -> priority
    priority_max_wait_s: float = 120.0  # a request queued longer counts as the highest priority present
    priority_high_at: int = 1  # the priority_class label's thresholds (policy.priority_high_at, priority_low_at)
    priority_low_at: int = -1
    replay_limit: int = 3  # continuations of a stream whose server died (proxy.replay_limit); 0: off
    replay_timeout_s: float = 120.0
    replay_memory_bytes: int = 64 << 20


@dataclass(eq=False)
class Inflight:
    request_id: str
    client_request_id: str | None
    route: str
    t_start: float
    state: str = "queued"  # queued | upstream | streaming | replaying (waiting for a restarted server)
    ended: asyncio.Future[str] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    """Set (to the reason) when kvctl ends the request itself: a hung server, a shutdown."""
    upstream: aiohttp.ClientResponse | None = None

    def end(self, reason: str) -> None:
        if not self.ended.done():
            self.ended.set_result(reason)
        if self.upstream is not None:
            self.upstream.close()  # a pending read raises ClientConnectionError at once


_EOF = "the server's response ended before its final event"

# sends a continuation's body as the interrupted request went: its response's context and the response
Reopen = Callable[[bytes], Awaitable[tuple[Any, aiohttp.ClientResponse]]]

# the stages kvctl_proxy_stream_errors counts (kvctl's reason codes of streams it ended)
STREAM_ERROR_STAGES = (
    "connect",
    "upstream",
    "upstream_timeout",
    "upstream_disconnected",
    "client_stalled",
    "shutting_down",
    "server_failed",
)


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
    auth_failures: Counter = field(init=False)
    replays: Counter = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("kvctl_proxy_requests", "Requests by route and status", ["route", "status"], registry=r)
        self.inflight = Gauge("kvctl_proxy_inflight_requests", "Requests in flight", registry=r)
        self.queued = Gauge("kvctl_proxy_queued_requests", "Requests waiting for admission", registry=r)
        self.admission_wait = Histogram(
            "kvctl_proxy_admission_wait_seconds",
            "Time waiting for admission, by priority class (high, normal, low: policy.priority_high_at, low_at)",
            ["priority_class"],
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
        )
        for cls in PRIORITY_CLASSES:
            self.admission_wait.labels(priority_class=cls)
        self.ttft = Histogram(
            "kvctl_proxy_time_to_first_token_seconds",
            "Time to first token as the client sees it",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.disconnects = Counter("kvctl_proxy_client_disconnects", "Clients that hung up mid-request", registry=r)
        self.stream_errors = Counter("kvctl_proxy_stream_errors", "Stream errors by stage", ["stage"], registry=r)
        # every stage a series from the start: rate() and increase() miss the first error of a series born at 1
        for stage in STREAM_ERROR_STAGES:
            self.stream_errors.labels(stage=stage)
        self.heartbeats = Counter("kvctl_proxy_heartbeats", "Heartbeat comments sent", registry=r)
        self.auth_failures = Counter(
            "kvctl_proxy_auth_failures", "Requests refused for their credentials (401)", registry=r
        )
        self.replays = Counter(
            "kvctl_proxy_replays",
            "Streams whose server died, by outcome: continued in the restarted server (sent), or ended with an error "
            "event (gave_up: past proxy.replay_limit or replay_timeout_s; refused: the server refused the "
            "continuation)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("sent", "gave_up", "refused"):
            self.replays.labels(outcome=outcome)


def is_utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def has_dot_segments(path: str) -> bool:
    """``.`` or ``..`` as a segment of the (percent-decoded) path."""
    return any(segment in (".", "..") for segment in path.split("/"))


CHAT_ROUTES = frozenset({"/chat/completions", "/v1/chat/completions", "/v1/messages"})
PROMPT_ROUTES = frozenset({"/completion", "/completions", "/v1/completions"})


def refused_by_server(route: str, payload: dict[str, Any]) -> bool:
    """A generation request the server refuses before it takes a slot: no prompt, no message list, or a stream
    flag that is not a boolean. Conservative: anything else goes through admission."""
    if "stream" in payload and not isinstance(payload["stream"], bool):
        return True
    if route in CHAT_ROUTES:
        return not isinstance(payload.get("messages"), list)
    if route in PROMPT_ROUTES:
        return payload.get("prompt") is None
    return False


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
            if p and all(isinstance(t, int) for t in p):
                return len(p)
            return sum(one(x) for x in p)  # several prompts or parts: each takes cells
        if isinstance(p, dict):  # a multimodal, templated or Responses/Anthropic part: its text
            return sum(one(v) for k, v in p.items() if k in ("text", "content", "prompt_string", "input", "output"))
        return 0

    if route in CHAT_ROUTES:
        messages = payload.get("messages")
        # roles and the chat template add a few tokens per message
        cells = (
            sum(one(m.get("content")) + 8 for m in messages if isinstance(m, dict)) if isinstance(messages, list) else 0
        )
        return cells + one(payload.get("system"))
    if route in ("/v1/responses", "/responses"):
        inp = payload.get("input")
        n_items = len(inp) if isinstance(inp, list) else 1
        return one(inp) + 8 * n_items + one(payload.get("instructions"))
    if route == "/infill":
        extra = payload.get("input_extra")
        return (
            one(payload.get("input_prefix"))
            + one(payload.get("input_suffix"))
            + one(payload.get("prompt"))
            + (sum(one(c.get("text")) for c in extra if isinstance(c, dict)) if isinstance(extra, list) else 0)
        )
    if isinstance(payload.get("instances"), list):  # the Vertex AI predict route: several requests in one
        return sum(estimate_prompt_cells(_predict_route(i), i) for i in payload["instances"] if isinstance(i, dict))
    return one(payload.get("prompt"))


def _predict_route(instance: dict[str, Any]) -> str:
    fmt = instance.get("@requestFormat")
    return {"chatCompletions": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}.get(
        fmt if isinstance(fmt, str) else "", "/completion"
    )


def brackets_balanced(body: bytes) -> bool:
    """Whether every ``[`` and ``{`` outside strings is closed, in order, and nothing but whitespace follows: what
    a JSON document too deep for Python's parser needs to be valid (iterative, so any depth)."""
    closing = {ord("["): ord("]"), ord("{"): ord("}")}
    stack: list[int] = []
    in_string = escaped = False
    ended = False
    for c in body:
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # quote
                in_string = False
            continue
        if ended:
            if c not in b" \t\r\n":
                return False
            continue
        if c == 0x22:
            in_string = True
        elif c in closing:
            stack.append(closing[c])
        elif c in (0x5D, 0x7D):
            if not stack or stack.pop() != c:
                return False
            ended = not stack
    return ended


def one_completion(payload: Any) -> bool:
    """A request for one completion of one prompt: what a continuation (continuation_tokens) can continue."""
    if not isinstance(payload, dict):
        return False
    prompt = payload.get("prompt")
    many = isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)
    return not many and all(payload.get(k) in (None, 1) for k in ("n_cmpl", "n"))


def error_event(route: Route | None, status: int, message: str, code: str) -> bytes:
    """An error inside an SSE stream, framed as the server frames one on that route."""
    return frame_error(route, proxy_error_object(status, message, code))


def frame_error(route: Route | None, err: dict[str, Any]) -> bytes:
    data = json.dumps(err, ensure_ascii=False).encode()
    if route is not None and route.stream_framing == "anthropic":
        return b"event: error\ndata: " + data + b"\n\n"
    return b'data: {"error": ' + data + b"}\n\n"


class AdmissionRefused(Exception):
    """Queue full or timed out; carries the SSE response if the client already has one."""

    def __init__(self, prepared: web.StreamResponse | None, code: str) -> None:
        super().__init__(code)
        self.prepared = prepared
        self.code = code


class Owners:
    """Ids to names, bounded (the oldest are forgotten first): which key started a conversation stream or a
    completion; the id a replayed completion has on the server."""

    def __init__(self, limit: int = 65536) -> None:
        self._owner: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._limit = limit

    def set(self, ident: str, owner: str) -> None:
        self._owner[ident] = owner
        self._owner.move_to_end(ident)
        while len(self._owner) > self._limit:
            self._owner.popitem(last=False)

    def owns(self, ident: str, owner: str | None) -> bool:
        return self._owner.get(ident) == owner

    def get(self, ident: str) -> str | None:
        return self._owner.get(ident)


def unowned_id() -> str:
    """An id no stream or completion has: the server answers for it as for one it does not know."""
    return f"kvctl-not-yours-{uuid.uuid4().hex}"


class Proxy:
    def __init__(self, config: ProxyConfig, gate: AdmissionGate, registry: CollectorRegistry) -> None:
        self.config = config
        self.gate = gate
        self.queue = AdmissionQueue(gate, config.queue_depth, config.queue_timeout_s, config.priority_max_wait_s)
        self.priority_rules = PriorityRules(config.client_priority, config.objective_priorities)
        self.metrics = ProxyMetrics(registry)
        self.inflight: dict[str, Inflight] = {}  # generation requests
        self.endpoint: EndpointMetrics | None = None
        """The endpoint picker's gauges on GET /metrics; set by the App, which feeds them from the control loop."""
        self.relays: set[Inflight] = set()  # other requests still waiting for the server's response to start
        self.session: aiohttp.ClientSession | None = None
        parts = urlsplit(config.upstream)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.routes = RouteTable(parts.path, config.predict_route)
        self.keys = KeyRing(config.api_keys)
        self.server_check = (
            ServerCheck(self._probe_credentials, ttl_s=config.auth_cache_s)
            if not self.keys and config.upstream_api_key
            else None
        )
        self.owners = Owners()  # conversation ids and completion ids, by key name (several keys only)
        self.replay_memory = ReplayMemory(config.replay_memory_bytes)
        self.completion_ids = Owners()  # a replayed stream's id, as its client knows it -> the continuation's
        # the supervisor's restart count when kvctl spawned the server: a hung server's streams wait for its restart
        self.restarts: Callable[[], int] | None = None
        self.failed: str | None = None
        """Why the spawned server is not coming back (the supervisor gave up, see fail()); None while it may."""
        self.draining = False
        self._active: set[asyncio.Task[Any]] = set()  # every handler running now
        self._orphans: set[asyncio.Future[None]] = set()  # conversation requests whose client left while queued
        self._idle = asyncio.Event()
        self._idle.set()
        self._cors: dict[str, tuple[float, str | None]] = {}  # Origin -> (expiry, Access-Control-Allow-Origin)
        self._cors_window: list[float] = [0.0, 0]  # (window start, preflights in it)

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        # one connection per request: llama-server closes idle keep-alive connections, and a pooled one
        # that it closed fails on write ("Can not write request body"); on loopback a connect costs ~0.1 ms
        self.session = aiohttp.ClientSession(
            timeout=timeout, auto_decompress=False, connector=aiohttp.TCPConnector(limit=0, force_close=True)
        )

    async def stop(self, app: web.Application) -> None:
        for task in list(self._orphans):
            task.cancel()
        await self.queue.close()
        if self.session is not None:
            await self.session.close()

    async def drain(self, timeout_s: float | None = None) -> int:
        """Refuse new requests (503), give the open ones ``timeout_s`` (proxy.drain_s) to finish, then end the rest
        with their protocol's error; returns how many were ended."""
        self.draining = True
        timeout = self.config.drain_s if timeout_s is None else timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        left = list(self.inflight.values())
        for entry in left:
            entry.end("shutdown")
        if left:
            log.warning("proxy.drain_ended_streams", count=len(left), after_s=timeout)
        # what is not a generation (a relayed download, a conversation stream) ends with its connection
        rest = [t for t in self._active if not t.done()]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), DRAIN_GRACE_S)
        for t in rest:
            t.cancel()
        return len(left)

    def fail(self, message: str) -> int:
        """The supervisor gave up on the server: every request that needs it is answered at once with ``message``
        (503, no Retry-After), and those already waiting (queued, waiting for a response or for a restart to replay
        on) end now; returns how many ended."""
        self.failed = message
        waiting = [*self.inflight.values(), *self.relays]
        for entry in waiting:
            entry.end("failed")
        return len(waiting)

    def _retry_after(self, code: str) -> int | None:
        return None if code == Code.SERVER_FAILED else self.config.retry_after_s

    async def failed_error(self, request: web.Request) -> web.Response:
        assert self.failed is not None
        return await self.kvctl_error(request, 503, self.failed, Code.SERVER_FAILED)

    def end_waiting(self, reason: str) -> int:
        """End every request still waiting for the server's response to start (the server stopped answering)."""
        waiting = [e for e in (*self.inflight.values(), *self.relays) if e.state == "upstream"]
        for entry in waiting:
            entry.end(reason)
        return len(waiting)

    # --- helpers -------------------------------------------------------------------------

    def upstream_headers(
        self, request: web.Request, request_id: str | None, ident: Identity | None, generation: bool
    ) -> dict[str, str]:
        # kvctl's keys are kvctl's: they never reach the server; the server's key goes only on what kvctl verified
        own_keys = bool(self.keys)
        # X-Priority: kvctl sets the effective one on a generation request (the caller, once it is known), and the
        # server reads it over the body's; on anything else a client's has no business reaching the server
        drop = (
            HOP_BY_HOP
            | {"x-request-id", "x-park-lease", "content-length", PRIORITY_HEADER.lower(), OPT_OUT_HEADER.lower()}
            | (set(CREDENTIALS) if own_keys else set())
        )
        headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        if generation:
            headers["Accept-Encoding"] = "identity"  # the relay reads the SSE events
        if own_keys and ident is not None and ident.key is not None and self.config.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        return headers

    @staticmethod
    def response_headers(
        upstream: aiohttp.ClientResponse, client_request_id: str | None, request_id: str | None, *, keep_length: bool
    ) -> CIMultiDict[str]:
        drop = HOP_BY_HOP if keep_length else HOP_BY_HOP | {"content-length"}
        headers = CIMultiDict((k, v) for k, v in upstream.headers.items() if k.lower() not in drop)
        if request_id is not None:
            headers["X-Request-Id"] = client_request_id or request_id
        return headers

    def count(self, route: str, status: int) -> None:
        self.metrics.requests.labels(route=route, status=str(status)).inc()

    async def cors_headers(self, request: web.Request) -> dict[str, str]:
        """The Access-Control-Allow-Origin the server would send to this request's Origin: asked of the server with
        a preflight (answered before any routing or key check) and kept for a minute per Origin. While the server
        does not answer, the last answer for that Origin (none before the first)."""
        origin = request.headers.get("Origin", "")
        now = time.monotonic()
        hit = self._cors.get(origin)
        value = hit[1] if hit is not None else None
        if (hit is None or hit[0] <= now) and self.gate.refuse_reason is None and self._cors_budget(now):
            assert self.session is not None
            expiry = now + 60.0
            try:
                async with asyncio.timeout(self.config.connect_timeout_s):
                    h = {"Origin": origin} if origin else {}
                    async with self.session.options(self.origin + "/health", headers=h) as r:
                        value = r.headers.get("Access-Control-Allow-Origin")
            except (aiohttp.ClientError, OSError, TimeoutError):
                expiry = now + 5.0  # not again for every error while the server is down
            if len(self._cors) >= 1024:
                self._cors.clear()
            self._cors[origin] = (expiry, value)
        return {"Access-Control-Allow-Origin": value} if value is not None else {}

    def _cors_budget(self, now: float) -> bool:
        """At most 10 preflights a second to learn CORS answers: a client sending a new Origin with every
        unauthenticated request must not turn kvctl into an amplifier against the server."""
        if now - self._cors_window[0] >= 1.0:
            self._cors_window = [now, 0]
        self._cors_window[1] += 1
        return self._cors_window[1] <= 10

    async def kvctl_error(
        self, request: web.Request, status: int, message: str, code: str, retry_after: int | None = None
    ) -> web.Response:
        known = self.routes.lookup(request.method, request.path) is not None
        self.count(request.path if known else "other", status)
        return proxy_error_response(status, message, code, retry_after, await self.cors_headers(request))

    async def endpoint_metrics(self, request: web.Request) -> web.StreamResponse:
        """``GET /metrics``: the gauges an inference gateway's endpoint picker reads (proxy/endpoint_metrics.py),
        without a key; 404 where no control loop feeds them (a plain relay)."""
        if self.endpoint is None or request.path != "/metrics":
            message = f"no route {request.method} {request.path} on the public listener"
            return await self.kvctl_error(request, 404, message, Code.NOT_FOUND)
        if request.method not in ("GET", "HEAD"):
            self.count("/metrics", 405)
            headers = {**error_headers(Code.METHOD_NOT_ALLOWED), "Allow": "GET, HEAD"}
            return proxy_error_response(
                405, f"{request.method} /metrics: use GET", Code.METHOD_NOT_ALLOWED, None, headers
            )
        self.count("/metrics", 200)
        return web.Response(
            body=self.endpoint.render() if request.method == "GET" else None,
            headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-store"},
        )

    async def unauthorized(self, request: web.Request) -> web.Response:
        self.metrics.auth_failures.inc()
        self.count("other", 401)
        return web.Response(
            status=401,
            body=UNAUTHORIZED_BODY,
            content_type="application/json",
            charset="utf-8",
            headers=await self.cors_headers(request),
        )

    async def _probe_credentials(self, creds: dict[str, str]) -> Answer:
        """The server's answer to GET /v1/models with the client's own credentials."""
        assert self.session is not None
        url = self.origin + self.routes.api_prefix + "/v1/models"
        async with asyncio.timeout(self.config.connect_timeout_s + self.config.upstream_read_timeout_s):
            async with self.session.get(url, headers=creds) as r:
                if r.status == 200:
                    return Answer(200)
                body = await r.read()
                keep = [(k, v) for k, v in r.headers.items() if k.lower() not in HOP_BY_HOP | {"content-length"}]
                return Answer(r.status, keep, body)

    # --- handlers ------------------------------------------------------------------------

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        value = await unsupported_expect(request)
        if value is None:
            return None
        self.count("other", 417)
        return proxy_error_response(417, f"unsupported Expect header {value!r}", Code.EXPECTATION_FAILED)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._active.add(task)
        self._idle.clear()
        t0 = time.monotonic()
        _request_id.set(None)
        _priority.set(None)
        status = 499  # the client went away before an answer
        ident: Identity | None = None
        try:
            resp, ident = await self.dispatch(request)
            status = resp.status
            return resp
        except web.HTTPRequestEntityTooLarge:
            status = 413
            return await self.kvctl_error(
                request, 413, f"request body larger than {self.config.max_body_bytes} bytes", Code.BODY_TOO_LARGE
            )
        finally:
            self._active.discard(task)
            if not self._active:
                self._idle.set()
            if request.path not in QUIET_PATHS:
                access_log.info(
                    "access",
                    method=request.method,
                    path=request.path,
                    status=status,
                    duration_ms=round((time.monotonic() - t0) * 1000, 1),
                    request_id=_request_id.get(),
                    key=ident.name if ident is not None else None,
                    priority=_priority.get(),
                )

    async def dispatch(self, request: web.Request) -> tuple[web.StreamResponse, Identity | None]:
        path = request.path
        bad = next((k for k, v in request.headers.items() if not is_utf8(v)), None)
        if bad is not None:
            # aiohttp hands such bytes over as surrogates, which no upstream request or response header can carry
            return await self.kvctl_error(request, 400, f"header {bad!r} is not valid UTF-8", Code.INVALID_HEADER), None
        if has_dot_segments(path):
            # the upstream URL is normalized on the way out: /v1/../kv would reach the server as /kv, past the
            # private-route check below
            return await self.kvctl_error(request, 400, f"path with dot segments: {path!r}", Code.INVALID_PATH), None
        if request.method == "OPTIONS":
            # a CORS preflight: browsers send no credentials, and the server answers it before any check
            return await self.relay(request, None, None), None
        route = self.routes.lookup(request.method, path)
        if path == "/metrics" or (route is not None and route.path == "/metrics"):
            # kvctl's endpoint gauges, public like /health; the server's llamacpp:* series never leave through here
            return await self.endpoint_metrics(request), None

        # --- authentication, before anything else ---
        ident: Identity | None = Identity(None)
        if path not in PUBLIC_PATHS:
            asset = request.method in ("GET", "HEAD") and not self.routes.is_api_path(path)
            if self.keys:
                ident = self.keys.check(request.headers)
                if ident is None:
                    if asset:
                        # the WebUI's static assets are public on the server: ask it without credentials, and
                        # anything it does not serve is a 401, as the server with a key would answer
                        return await self.relay(request, None, None, asset_probe=True), None
                    return await self.unauthorized(request), None
            elif self.server_check is not None and not asset:
                try:
                    answer = await self.server_check.check(request.headers)
                except (aiohttp.ClientError, OSError, TimeoutError) as e:
                    if self.failed is not None:
                        return await self.failed_error(request), None
                    return await self.kvctl_error(
                        request,
                        503,
                        f"llama-server is unreachable: {e}",
                        Code.UPSTREAM_UNAVAILABLE,
                        self.config.retry_after_s,
                    ), None
                if answer.status != 200:
                    if answer.status == 401:
                        self.metrics.auth_failures.inc()
                    self.count("other", answer.status)
                    # the server's own answer; its CORS header was for kvctl's probe: this one is for the Origin sent
                    headers = CIMultiDict(
                        (k, v) for k, v in answer.headers if not k.lower().startswith("access-control-")
                    )
                    headers.update(await self.cors_headers(request))
                    return web.Response(status=answer.status, body=answer.body, headers=headers), None

        if self.draining:
            return await self.kvctl_error(
                request, 503, "kvctl is shutting down", Code.SHUTTING_DOWN, self.config.retry_after_s
            ), ident
        if self.failed is not None:
            return await self.failed_error(request), ident
        if route is not None and route.kind is Kind.PRIVATE and not self.config.expose_private_routes:
            return await self.kvctl_error(
                request, 404, f"no route {request.method} {path} on the public listener", Code.NOT_FOUND
            ), ident
        if route is not None and route.kind is Kind.GENERATION:
            return await self.generation(request, route, ident), ident
        if route is not None and route.kind is Kind.CONTROL:
            return await self.control(request, route, ident), ident
        if route is not None and route.kind is Kind.CONVERSATION and len(self.keys) > 1:
            return await self.scoped(request, route, ident), ident
        return await self.relay(request, route, ident), ident

    async def scoped(self, request: web.Request, route: Route, ident: Identity | None) -> web.StreamResponse:
        """Conversation streams act only on what the same key started: an id another key started is replaced by
        one nobody has, so the server answers as for an unknown id."""
        owner = ident.name if ident is not None else None
        if route.path == "/v1/streams/lookup":
            return await self.relay(request, route, ident, filter_owner=owner)
        if route.path == "/v1/stream":
            query = parse_qsl(request.query_string, keep_blank_values=True)
            fixed = [
                (k, unowned_id() if k == "conv_id" and v and not self.owners.owns(v, owner) else v) for k, v in query
            ]
            # no body: cpp-httplib would read a form body's conv_id into the same parameters, past the check above
            return await self.relay(request, route, ident, body=b"", query=urlencode(fixed))
        return await self.relay(request, route, ident)

    async def control(self, request: web.Request, route: Route, ident: Identity | None) -> web.StreamResponse:
        """``/v1/chat/completions/control`` acts on a running completion by the id its client knows: the id of a
        stream that was replayed is the continuation's on the server; with several keys, an id another key started
        is replaced by one nobody has, so the server answers as for an unknown id."""
        owner = ident.name if ident is not None else None
        body = await request.read()
        with contextlib.suppress(ValueError):
            try:
                payload = json.loads(body)
            except RecursionError:
                return await self.kvctl_error(request, 400, "request body nested too deeply", Code.BODY_TOO_DEEP)
            cid = payload.get("id") if isinstance(payload, dict) else None
            if isinstance(cid, str) and cid:
                if len(self.keys) > 1 and not self.owners.owns("cmpl:" + cid, owner):
                    payload["id"] = unowned_id()
                else:
                    payload["id"] = self.completion_ids.get(cid) or cid
                if payload["id"] != cid:
                    body = json.dumps(payload).encode()
        return await self.relay(request, route, ident, body=body)

    async def relay(
        self,
        request: web.Request,
        route: Route | None,
        ident: Identity | None,
        *,
        asset_probe: bool = False,
        body: bytes | None = None,
        query: str | None = None,
        filter_owner: str | None = None,
    ) -> web.StreamResponse:
        """Anything that is not a generation: relayed as it is, streamed, with its encodings untouched."""
        if body is None:
            body = await request.read()
        # an asset probe (kvctl's keys, none given) carries no credential: upstream_headers drops kvctl's keys
        headers = self.upstream_headers(request, None, ident, generation=False)
        return await self.forward(
            request,
            body,
            headers,
            route,
            None,
            None,
            raw=route is not None and route.kind is Kind.CONVERSATION and request.method == "GET",
            asset_probe=asset_probe,
            query=query,
            filter_owner=filter_owner,
        )

    async def generation(self, request: web.Request, route: Route, ident: Identity | None) -> web.StreamResponse:
        client_request_id = request.headers.get("X-Request-Id")
        request_id = f"kvctl-{uuid.uuid4().hex}"
        _request_id.set(request_id)
        body = await request.read()
        conversations = request.headers.getall("X-Conversation-Id", [])
        if len(conversations) > 1:
            # which one the server takes depends on its header map's order: refuse rather than guess
            return await self.kvctl_error(request, 400, "more than one X-Conversation-Id header", Code.INVALID_HEADER)
        conversation = conversations[0] if conversations else ""
        multipart = request.content_type.startswith("multipart/")
        payload: Any = None
        too_deep = False
        if not multipart:
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None
            except RecursionError:
                # nested deeper than Python's parser goes, while the server's parser has no limit: when its brackets
                # close, it may be a valid request, which must not slip past admission; when they do not, it is
                # garbage the server refuses at once
                too_deep = brackets_balanced(body)
        predict = route.path == self.config.predict_route
        if predict and (too_deep or (isinstance(payload, dict) and self.predict_refused(payload))):
            return await self.kvctl_error(
                request, 400, "a predict instance may only target a completion or a relayed route", Code.INVALID_PREDICT
            )
        try:
            priority = resolve_priority(
                payload if isinstance(payload, dict) else None,
                request.headers,
                ident.key if ident is not None else None,
                self.priority_rules,
            )
        except InvalidPriority as e:
            return await self.kvctl_error(request, 400, str(e), Code.INVALID_PRIORITY)
        _priority.set(priority.value)
        headers = self.upstream_headers(request, request_id, ident, generation=True)
        headers[PRIORITY_HEADER] = str(priority.value)
        if not multipart and not too_deep and (not isinstance(payload, dict) or refused_by_server(route.path, payload)):
            # malformed: the server answers it at once, exactly as it would without kvctl; it takes no cells, so it
            # must not wait in the admission queue for a slot it would never use
            return await self.forward(request, body, headers, route, request_id, client_request_id)
        stream = isinstance(payload, dict) and payload.get("stream", False) is True
        if self.gate.refuse_reason is not None:
            return await self.kvctl_error(
                request, 503, self.gate.refuse_reason, Code.UPSTREAM_UNAVAILABLE, self.config.retry_after_s
            )
        owner = ident.name if ident is not None and len(self.keys) > 1 else None
        if conversation and owner is not None:
            current = self.owners.get(conversation)
            if current is not None and current != owner:
                # the server would replace that conversation's stream: another key's chat is not this key's to end
                return await self.kvctl_error(
                    request, 409, "this conversation id belongs to another key", Code.CONVERSATION_TAKEN
                )
            self.owners.set(conversation, owner)

        transcript = None
        replay_on = self.config.replay_limit > 0 and request.headers.get(OPT_OUT_HEADER, "").strip().lower() != "off"
        if replay_on and stream and not conversation and not predict and one_completion(payload):
            # the server follows each result's events with its tokens' ids: what a continuation starts from
            transcript = Transcript.start(route.path, payload, len(body), self.replay_memory, request_id)
            if transcript.replayable:
                headers[ANNOUNCE_HEADER] = "1"
        entry = Inflight(request_id, client_request_id, route.path, time.monotonic())
        self.inflight[request_id] = entry
        self.metrics.inflight.inc()
        log.info(
            "request.start",
            request_id=request_id,
            client_request_id=client_request_id,
            route=route.path,
            stream=stream,
            conversation=bool(conversation),
            priority=priority.value,
            priority_source=priority.source,
        )
        try:
            t_queue = time.monotonic()
            try:
                cells = self.config.reserve_cells
                if isinstance(payload, dict):
                    cells = max(cells, estimate_prompt_cells(route.path, payload))
                # a resumable stream's bytes are counted by its client: nothing of kvctl's own goes into it
                if conversation:
                    early = None
                    await self.admit_conversation(request.method, request.raw_path, body, headers, cells, priority)
                else:
                    early = await self.wait_for_admission(request, stream, cells, route, entry, priority)
            except AdmissionRefused as e:
                return await self.refuse(request, route, e.prepared, str(e.__cause__), e.code)
            self.metrics.admission_wait.labels(priority_class=self.priority_class_of(priority.value)).observe(
                time.monotonic() - t_queue
            )
            entry.state = "upstream"
            return await self.forward(
                request,
                body,
                headers,
                route,
                request_id,
                client_request_id,
                prepared=early,
                entry=entry,
                raw=bool(conversation),
                owner=owner,
                transcript=transcript,
                resend=replay_on and not conversation,
            )
        finally:
            if transcript is not None:
                transcript.release()
            self.inflight.pop(request_id, None)
            self.metrics.inflight.dec()

    def priority_class_of(self, priority: int) -> str:
        """The priority_class label of a priority (high, normal, low): never the number itself."""
        return priority_class(priority, self.config.priority_high_at, self.config.priority_low_at)

    def predict_refused(self, payload: dict[str, Any]) -> bool:
        """A predict request with an instance aimed at a private, conversation or control route (the server
        dispatches each instance to any registered handler named by its @requestFormat)."""
        instances = payload.get("instances")
        if not isinstance(instances, list):
            return False
        for instance in instances:
            fmt = instance.get("@requestFormat") if isinstance(instance, dict) else None
            if isinstance(fmt, str) and any(
                r.kind in (Kind.PRIVATE, Kind.CONVERSATION, Kind.CONTROL) for r in self.routes.predict_targets(fmt)
            ):
                return True
        return False

    async def admit_conversation(
        self, method: str, path_qs: str, body: bytes, headers: dict[str, str], cells: int, priority: Priority
    ) -> None:
        """Admission for a resumable stream. Its request keeps going when the client hangs up (the server's
        contract: the WebUI reconnects and finds it with /v1/streams/lookup), so a client that leaves while it is
        queued leaves it queued: once admitted, it is sent, and the server generates into its stream buffer."""
        if self.queue.queued == 0 and self.gate.take(cells, priority.value):
            return
        self.metrics.queued.inc()
        admit = asyncio.ensure_future(self.queue.admit(cells, priority.value))
        admit.add_done_callback(lambda _: self.metrics.queued.dec())
        try:
            await asyncio.shield(admit)
        except QueueFull as e:
            raise AdmissionRefused(None, Code.QUEUE_FULL) from e
        except QueueTimeout as e:
            raise AdmissionRefused(None, Code.QUEUE_TIMEOUT) from e
        except asyncio.CancelledError:
            task = asyncio.ensure_future(self._send_orphan(admit, method, path_qs, body, headers))
            self._orphans.add(task)
            task.add_done_callback(self._orphans.discard)
            raise

    async def _send_orphan(
        self, admit: asyncio.Future[None], method: str, path_qs: str, body: bytes, headers: dict[str, str]
    ) -> None:
        with contextlib.suppress(QueueFull, QueueTimeout):
            await admit
            assert self.session is not None
            try:
                # the response starting means the server took it; its stream buffer has the rest
                url = URL(self.origin + path_qs, encoded=True)
                async with self.session.request(method, url, data=upstream_body(body), headers=headers) as r:
                    log.info(
                        "conversation.sent_for_departed_client", status=r.status, request_id=headers.get("X-Request-Id")
                    )
            except (aiohttp.ClientError, OSError) as e:
                log.warning("conversation.send_failed", error=str(e), request_id=headers.get("X-Request-Id"))

    async def refuse(
        self, request: web.Request, route: Route, early: web.StreamResponse | None, message: str, code: str
    ) -> web.StreamResponse:
        log.warning("admission.refused", route=request.path, reason=code)
        if early is not None:
            # the client already has SSE headers: the failure comes as an error event
            self.count(request.path, 503)
            await self.write(request, early, error_event(route, 503, message, code))
            return early
        return await self.kvctl_error(request, 503, message, code, self._retry_after(code))

    async def wait_for_admission(
        self, request: web.Request, stream: bool, cells: int, route: Route, entry: Inflight, priority: Priority
    ) -> web.StreamResponse | None:
        """Queue while the gate holds; a streaming client waiting past the grace period gets
        SSE headers and heartbeats, so neither it nor a reverse proxy in between times out. kvctl ending the
        request (a shutdown) ends the wait too."""
        if self.queue.queued == 0 and self.gate.take(cells, priority.value):
            return None
        self.metrics.queued.inc()
        admit = asyncio.ensure_future(self.queue.admit(cells, priority.value))
        try:
            prepared: web.StreamResponse | None = None
            deadline = time.monotonic() + self.config.queue_grace_s
            while True:
                wait = deadline - time.monotonic() if prepared is None else self.config.heartbeat_s
                either: set[asyncio.Future[Any]] = {admit, entry.ended}
                done, _ = await asyncio.wait(either, timeout=max(0.0, wait), return_when=asyncio.FIRST_COMPLETED)
                if entry.ended.done():
                    message, code = self.end_message(entry.ended.result())
                    raise AdmissionRefused(prepared, code) from RuntimeError(message)
                if done:
                    try:
                        admit.result()
                    except QueueFull as e:
                        raise AdmissionRefused(prepared, Code.QUEUE_FULL) from e
                    except QueueTimeout as e:
                        raise AdmissionRefused(prepared, Code.QUEUE_TIMEOUT) from e
                    return prepared
                if not stream:
                    deadline = float("inf")
                    continue
                if prepared is None:
                    ids = {"X-Request-Id": entry.client_request_id or entry.request_id}
                    prepared = await self.prepare_sse(request, {**await self.cors_headers(request), **ids})
                await self.heartbeat(request, prepared, "queued")
        finally:
            if not admit.done():
                admit.cancel()
            self.metrics.queued.dec()

    async def prepare_sse(self, request: web.Request, headers: dict[str, str] | CIMultiDict[str]) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers=headers)
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

    async def _send(
        self, request: web.Request, url: str, body: bytes, headers: dict[str, str], entry: Inflight
    ) -> tuple[Any, aiohttp.ClientResponse]:
        """Send the request; wait for the response to start, or for kvctl to end the request (a hung server)."""
        assert self.session is not None
        cm = self.session.request(request.method, URL(url, encoded=True), data=upstream_body(body), headers=headers)
        opening: asyncio.Future[aiohttp.ClientResponse] = asyncio.ensure_future(cm.__aenter__())
        either: set[asyncio.Future[Any]] = {opening, entry.ended}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # the client left: the request is withdrawn, and a response that started meanwhile is closed
            opening.cancel()
            opening.add_done_callback(_close_response)
            raise
        if opening.done() and not entry.ended.done():
            return cm, opening.result()
        opening.cancel()
        opening.add_done_callback(_close_response)
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, OSError):
            await opening
        raise UpstreamEnded(entry.ended.result())

    async def forward(
        self,
        request: web.Request,
        body: bytes,
        headers: dict[str, str],
        route: Route | None,
        request_id: str | None,
        client_request_id: str | None,
        *,
        prepared: web.StreamResponse | None = None,
        entry: Inflight | None = None,
        raw: bool = False,
        asset_probe: bool = False,
        query: str | None = None,
        filter_owner: str | None = None,
        owner: str | None = None,
        transcript: Transcript | None = None,
        resend: bool = False,
    ) -> web.StreamResponse:
        generation = route is not None and route.kind is Kind.GENERATION
        label = request.path if route is not None else "other"
        relayed = entry is None
        if entry is None:  # not a generation: tracked only so that a hung server or a shutdown can end it
            entry = Inflight(request_id or "", client_request_id, label, time.monotonic(), state="upstream")
            self.relays.add(entry)
        # the path and query as the client sent them (a decoded %23 or %26 would change what the server reads)
        raw_path = request.raw_path.split("?", 1)[0]
        path_qs = request.raw_path if query is None else raw_path + ("?" + query if query else "")
        url = self.origin + path_qs
        resends = 0
        deadline: float | None = None
        try:
            while True:
                try:
                    upstream_cm, upstream = await self._send(request, url, body, headers, entry)
                    break
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                    # sent, and the server died before it answered (not: nothing listens, which is answered at once):
                    # the client has seen nothing of it, so it is sent again once the server is back
                    if not resend or isinstance(e, aiohttp.ClientConnectorError) or resends >= self.config.replay_limit:
                        raise
                    if deadline is None:
                        deadline = time.monotonic() + self.config.replay_timeout_s
                    entry.state = "replaying"  # not "waiting for a response" while the server restarts (end_waiting)
                    ready = await self._wait_ready(request, prepared, entry, deadline)
                    entry.state = "upstream"
                    if not ready:
                        raise
                    resends += 1
                    log.warning("replay.resend", request_id=request_id, attempt=resends, error=str(e))
                finally:
                    if relayed:
                        self.relays.discard(entry)
        except UpstreamEnded as e:
            return await self.ended_before_start(request, route, prepared, str(e))
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            if entry.ended.done():  # kvctl ended it while it waited to be sent again (the server failed)
                return await self.ended_before_start(request, route, prepared, entry.ended.result())
            self.metrics.stream_errors.labels(stage="connect").inc()
            log.warning("upstream.unreachable", request_id=request_id, error=str(e))
            message, code = f"llama-server is unreachable: {e}", Code.UPSTREAM_UNAVAILABLE
            if self.failed is not None:
                message, code = self.failed, Code.SERVER_FAILED
            if prepared is not None:
                await self.write(request, prepared, error_event(route, 503, message, code))
                return prepared
            return await self.kvctl_error(request, 503, message, code, self._retry_after(code))
        entry.upstream = upstream
        entry.state = "streaming"  # the response has started: from here the read timeout applies
        try:
            is_sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
            self.count(label, upstream.status)
            if asset_probe and upstream.status == 404:
                return await self.unauthorized(request)
            if prepared is not None:
                if not is_sse or upstream.status != 200:
                    # too late for a status: the server's error becomes an error event in the route's framing
                    data = await self._read_all(upstream)
                    await self.write(request, prepared, self.error_from_body(route, upstream.status, data or b""))
                    return prepared
                resp = prepared
            elif generation and is_sse and upstream.status == 200 and not raw:
                resp = await self.prepare_sse(
                    request, self.response_headers(upstream, client_request_id, request_id, keep_length=False)
                )
            else:
                if filter_owner is not None:
                    return await self.filter_lookup(request, upstream, filter_owner)
                resp = web.StreamResponse(
                    status=upstream.status,
                    reason=upstream.reason,
                    headers=self.response_headers(upstream, client_request_id, request_id, keep_length=True),
                )
                await resp.prepare(request)
                await self.relay_bytes(request, upstream, resp, request_id, owner if is_sse else None)
                return resp

            async def reopen(continuation: bytes) -> tuple[Any, aiohttp.ClientResponse]:
                assert entry is not None
                return await self._send(request, url, continuation, headers, entry)

            await self.relay_events(
                request, upstream, resp, route, request_id, entry, owner, replay=(transcript, reopen)
            )
            return resp
        except asyncio.CancelledError:
            # the client hung up: leaving the upstream context closes that connection, and llama-server releases
            # the slot (a conversation stream goes on generating into the server's buffer: the server's contract)
            self.metrics.disconnects.inc()
            log.info("client.disconnected", request_id=request_id)
            raise
        except ConnectionResetError:
            self.metrics.disconnects.inc()
            raise
        finally:
            entry.upstream = None
            await upstream_cm.__aexit__(None, None, None)

    async def ended_before_start(
        self, request: web.Request, route: Route | None, prepared: web.StreamResponse | None, reason: str
    ) -> web.StreamResponse:
        message, code = self.end_message(reason)
        self.metrics.stream_errors.labels(stage=code).inc()
        if prepared is not None:
            await self.write(request, prepared, error_event(route, 503, message, code))
            return prepared
        return await self.kvctl_error(request, 503, message, code, self._retry_after(code))

    def end_message(self, reason: str) -> tuple[str, str]:
        if reason == "shutdown":
            return "kvctl is shutting down; the request was ended", Code.SHUTTING_DOWN
        if reason == "failed":
            return self.failed or "llama-server failed to start", Code.SERVER_FAILED
        return (
            f"llama-server has not answered for {self.config.upstream_read_timeout_s:g} s; the request was ended",
            Code.UPSTREAM_TIMEOUT,
        )

    def error_from_body(self, route: Route | None, status: int, data: bytes) -> bytes:
        try:
            err = json.loads(data)["error"]
            if not isinstance(err, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            err = proxy_error_object(status, f"llama-server answered {status}", Code.UPSTREAM_ERROR)
        return frame_error(route, err)

    async def filter_lookup(
        self, request: web.Request, upstream: aiohttp.ClientResponse, owner: str
    ) -> web.StreamResponse:
        """POST /v1/streams/lookup with several keys: only the conversations this key started (a small JSON list)."""
        data = await self._read_all(upstream)
        if data is None:
            return await self.kvctl_error(request, 502, "llama-server went away mid-answer", Code.UPSTREAM_DISCONNECTED)
        if upstream.status == 200:
            with contextlib.suppress(ValueError, RecursionError):
                doc = json.loads(data)
                if isinstance(doc, list):
                    mine = [
                        s for s in doc if isinstance(s, dict) and self.owners.owns(str(s.get("conversation_id")), owner)
                    ]
                    data = json.dumps(mine, ensure_ascii=False).encode()
        return web.Response(
            status=upstream.status, body=data, headers=self.response_headers(upstream, None, None, keep_length=False)
        )

    async def _read_all(self, upstream: aiohttp.ClientResponse) -> bytes | None:
        """A small answer kvctl reads whole (an error body, a stream lookup); None when it does not come."""
        try:
            async with asyncio.timeout(self.config.upstream_read_timeout_s):
                return await upstream.read()
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def _read(self, upstream: aiohttp.ClientResponse) -> bytes | None:
        """The next chunk; None when heartbeat_s passed without one (the caller decides about the silence)."""
        try:
            async with asyncio.timeout(self.config.heartbeat_s):
                return await upstream.content.readany()
        except TimeoutError:
            return None

    async def relay_bytes(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        resp: web.StreamResponse,
        request_id: str | None,
        owner: str | None = None,
    ) -> None:
        """Bytes as they arrive, nothing of kvctl's own; a silence past the read timeout, or kvctl ending the
        request, aborts the connection (a client that counts bytes then resumes where it stopped). With ``owner``
        (a conversation stream, several keys), the first event's completion id is recorded for that key."""
        last = time.monotonic()
        framer = SSEFramer() if owner is not None else None
        while True:
            try:
                chunk = await self._read(upstream)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
                self.metrics.stream_errors.labels(stage="upstream").inc()
                log.warning("upstream.disconnected", request_id=request_id, error=str(e))
                self._abort(request)
                return
            if chunk is None:
                if time.monotonic() - last >= self.config.upstream_read_timeout_s:
                    self.metrics.stream_errors.labels(stage="upstream_timeout").inc()
                    log.warning("upstream.timeout", request_id=request_id, path=request.path)
                    self._abort(request)
                    return
                continue
            if not chunk:
                await resp.write_eof()
                return
            last = time.monotonic()
            if framer is not None and owner is not None:
                for event in framer.feed(chunk):  # a read-only copy: the client gets the chunk as it is
                    if has_data(event):
                        self._record_completion_id(event, owner)
                        framer = None
                        break
            await self.write(request, resp, chunk)

    @staticmethod
    def _abort(request: web.Request) -> None:
        if request.transport is not None:
            request.transport.abort()

    async def relay_events(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        resp: web.StreamResponse,
        route: Route | None,
        request_id: str | None,
        entry: Inflight | None,
        owner: str | None,
        replay: tuple[Transcript | None, Reopen] | None = None,
    ) -> None:
        """A generation's events to the client, with heartbeats over silences. With a transcript, a stream whose
        server died (or, spawned, hung) goes on in the restarted server (``_replay``): a result's events are written
        once the ids of its tokens have come after them (``: tokens``, which ends each result), so that the client
        never holds a token the continuation would send again."""
        transcript, reopen = replay if replay is not None else (None, None)
        if transcript is not None and upstream.headers.get(ANNOUNCE_HEADER) != "1":
            transcript.drop("the server does not announce token ids (patch 0025)")
        framer = SSEFramer()
        t0 = entry.t_start if entry is not None else time.monotonic()
        first = True
        last = time.monotonic()
        held: list[bytes] = []  # a result's events whose ids are still on the way
        replaced: Any = None  # the context of a continuation's response: ours to close
        try:
            while True:
                try:
                    chunk = await self._read(upstream)
                    ended = None if chunk is None or chunk else _EOF
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
                    chunk, ended = b"", str(e)
                if chunk is None and time.monotonic() - last >= self.config.upstream_read_timeout_s:
                    ended = "timeout"
                replayable = transcript is not None and transcript.replayable and not transcript.done
                # a hung server's stream goes on only once kvctl has killed and restarted the server it spawned
                if replayable and reopen and ended is not None and (ended != "timeout" or self.restarts is not None):
                    assert transcript is not None
                    restarted = self.restarts() if ended == "timeout" and self.restarts is not None else None
                    again = await self._replay(request, resp, transcript, entry, reopen, ended, restarted)
                    if again is not None:
                        held, framer = [], SSEFramer()  # their ids never came: the continuation sends them again
                        old, (replaced, upstream) = replaced, again
                        if entry is not None:
                            entry.upstream = upstream  # from here kvctl's end() closes the continuation
                        if old is not None:
                            await old.__aexit__(None, None, None)
                        last = time.monotonic()
                        continue
                    if transcript.refused is not None:
                        await self.write(request, resp, b"".join(held) + transcript.refused)
                        return
                    failed = True  # given up: even a response that merely ended gets the error event
                else:
                    failed = ended is not None and ended != _EOF
                if failed:
                    assert ended is not None
                    status = 504 if ended == "timeout" else 502
                    if ended == "timeout":
                        message, code = self.end_message("timeout")
                    elif entry is not None and entry.ended.done():
                        message, code = self.end_message(entry.ended.result())
                    else:
                        message, code = f"llama-server went away mid-stream: {ended}", Code.UPSTREAM_DISCONNECTED
                    if code == Code.SERVER_FAILED:
                        status = 503
                    self.metrics.stream_errors.labels(stage=code).inc()
                    log.warning("stream.ended", request_id=request_id, reason=code, error=ended)
                    if held:
                        await self.write(request, resp, b"".join(held))  # complete events: the client gets them
                    if framer.pending:
                        await self.write(request, resp, b"\n\n")  # close the event the server left open
                    await self.write(request, resp, error_event(route, status, message, code))
                    return
                if chunk is None:
                    if not framer.pending and not held:
                        await self.heartbeat(request, resp, "silence")
                    continue
                if not chunk:
                    rest = b"".join(held) + framer.flush()
                    if rest:
                        await self.write(request, resp, rest)
                    return
                last = time.monotonic()
                out: list[bytes] = []
                for event in framer.feed(chunk):
                    if first and has_data(event):
                        first = False
                        self.metrics.ttft.observe(time.monotonic() - t0)
                        if owner is not None:
                            self._record_completion_id(event, owner)
                    if is_comment(event):
                        text = comment_text(event)
                        if text in ("parked", "resumed"):
                            log.info(f"stream.{text}", request_id=request_id)
                    if transcript is None or not transcript.replayable:
                        out.append(event)
                        continue
                    if transcript.replays:
                        event = transcript.splice(event)
                        if transcript.upstream_id is not None and transcript.first_id is not None:
                            self.completion_ids.set(transcript.first_id, transcript.upstream_id)
                    transcript.observe(event)
                    if event.startswith(b": tokens") or transcript.done:
                        out.extend(held)
                        held = []
                        out.append(event)
                    elif has_data(event):
                        held.append(event)
                    else:
                        out.append(event)  # the server's comments (parked, resumed, keep-alive)
                if out:
                    await self.write(request, resp, b"".join(out))
        finally:
            if replaced is not None:
                await replaced.__aexit__(None, None, None)

    async def _replay(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        transcript: Transcript,
        entry: Inflight | None,
        reopen: Reopen,
        why: str,
        after_restart: int | None = None,
    ) -> tuple[Any, aiohttp.ClientResponse] | None:
        """The server died (or hung) under this stream: wait (heartbeating the client) for it to answer ``/health``
        again, then send the request continued from the ids the client has. The continuation's response (its
        context and the response), or None: kvctl ended the request, the server refused the continuation
        (``transcript.refused``), or past ``replay_limit`` or ``replay_timeout_s``."""
        if entry is None or entry.ended.done():
            return None
        deadline = time.monotonic() + self.config.replay_timeout_s
        while transcript.replays < self.config.replay_limit and time.monotonic() < deadline:
            transcript.replays += 1
            log.warning(
                "replay.waiting",
                request_id=transcript.request_id,
                attempt=transcript.replays,
                tokens=len(transcript.ids),
                reason=why,
            )
            if not await self._wait_ready(request, resp, entry, deadline, after_restart):
                break
            after_restart = None  # restarted once: a later death is an ordinary one
            try:
                cm, upstream = await self._beating(request, resp, reopen(transcript.continuation()))
            except UpstreamEnded:
                return None
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                why = str(e)
                continue
            try:
                if upstream.status == 200 and upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
                    self.metrics.replays.labels(outcome="sent").inc()
                    log.info("replay.sent", request_id=transcript.request_id, tokens=len(transcript.ids))
                    cm, sent = None, cm
                    return sent, upstream
                data = await self._read_all(upstream)
                self.metrics.replays.labels(outcome="refused").inc()
                log.warning(
                    "replay.refused",
                    request_id=transcript.request_id,
                    status=upstream.status,
                    body=(data or b"")[:300],
                )
                route = self.routes.lookup("POST", request.path)
                transcript.refused = self.error_from_body(route, upstream.status, data or b"")
                return None
            finally:
                if cm is not None:
                    await cm.__aexit__(None, None, None)
        self.metrics.replays.labels(outcome="gave_up").inc()
        log.warning("replay.gave_up", request_id=transcript.request_id, attempts=transcript.replays)
        return None

    async def _beating(
        self, request: web.Request, resp: web.StreamResponse, sending: Awaitable[tuple[Any, aiohttp.ClientResponse]]
    ) -> tuple[Any, aiohttp.ClientResponse]:
        """Await ``sending`` (a continuation whose response has not started: it may wait in the server's queue
        behind the others), heartbeating the client meanwhile. Cancelled, ``_send`` closes what it opened."""
        task = asyncio.ensure_future(sending)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.config.heartbeat_s)
                if done:
                    return task.result()
                await self.heartbeat(request, resp, "server restarting")
        finally:
            if not task.done():
                task.cancel()

    async def _wait_ready(
        self,
        request: web.Request,
        resp: web.StreamResponse | None,
        entry: Inflight | None,
        deadline: float,
        after_restart: int | None = None,
    ) -> bool:
        """Until the server answers ``/health`` with 200 (restarted and loaded) and, with ``after_restart``, the
        supervisor has restarted it since; a heartbeat to a stream's client every ``heartbeat_s``; False past the
        deadline or when kvctl ends the request."""
        assert self.session is not None
        if entry is None:
            return False
        next_beat = time.monotonic() + self.config.heartbeat_s
        while time.monotonic() < deadline and not entry.ended.done():
            restarted = after_restart is None or self.restarts is None or self.restarts() > after_restart
            if restarted:  # a hung server still answers /health from its HTTP thread: wait for the new one
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    health = URL(self.origin + "/health", encoded=True)
                    async with asyncio.timeout(2.0), self.session.get(health) as r:
                        if r.status == 200:
                            return True
            if resp is not None and time.monotonic() >= next_beat:
                await self.heartbeat(request, resp, "server restarting")
                next_beat = time.monotonic() + self.config.heartbeat_s
            await asyncio.wait({entry.ended}, timeout=0.25)  # kvctl ending it (the server failed) ends this at once
        return False

    def _record_completion_id(self, event: bytes, owner: str) -> None:
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                with contextlib.suppress(ValueError, RecursionError):
                    doc = json.loads(line[5:])
                    if isinstance(doc, dict) and isinstance(doc.get("id"), str):
                        self.owners.set("cmpl:" + doc["id"], owner)
                return


# aiohttp warns (ResourceWarning) on a bytes body over 1 MiB: it is written in one piece from the event loop
_LARGE_BODY = 1 << 20


def upstream_body(body: bytes) -> bytes | io.BytesIO | None:
    """A request body for aiohttp: large prompts (up to proxy.max_body_bytes) as a file object, which aiohttp
    writes in chunks with its length known, instead of one write that holds the event loop."""
    if not body:
        return None
    return io.BytesIO(body) if len(body) > _LARGE_BODY else body


def _close_response(fut: asyncio.Future[aiohttp.ClientResponse]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()


class UpstreamEnded(Exception):
    """kvctl ended the request before the server's response started."""


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


def tls_context(cert_file: str | None, key_file: str | None) -> ssl.SSLContext | None:
    """The public listener's TLS from a certificate chain and its key (PEM), or None for plain HTTP."""
    if not cert_file:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file or None)
    return ctx


async def run_site(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> Callable[[], Awaitable[None]]:
    """Serve app; a client that hangs up cancels its handler, so the upstream request ends at once."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    return runner.cleanup
