"""The front door: what every request passes before it is routed on.

Headers and paths no upstream request can carry safely, ``Expect``, kvctl's endpoint gauges on ``GET /metrics``,
authentication (kvctl's own keys, or the server's asked about the client's credentials), CORS (the server's answer
for the request's Origin, learnt with a preflight), and the listener's state: draining, a server that is not
coming back, the private routes.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict

from controller.errors import Code, error_headers, proxy_error_response
from controller.httputil import unsupported_expect
from controller.keys import Identity, KeyRing
from controller.proxy.admission import AdmissionGate
from controller.proxy.auth import PUBLIC_PATHS, Answer, ServerCheck
from controller.proxy.config import ProxyConfig
from controller.proxy.context import ServerState
from controller.proxy.endpoint_metrics import CONTENT_TYPE, EndpointMetrics
from controller.proxy.forward import Upstream
from controller.proxy.framing import Errors
from controller.proxy.inspection import has_dot_segments, is_utf8
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.peers import PEER_HEADER
from controller.proxy.routes import Kind, Route, RouteTable

__all__ = ["AskServer", "Cors", "FrontDoor"]

log = structlog.get_logger("kvctl.proxy")


class Cors:
    """The Access-Control-Allow-Origin the server would send to a request's Origin: asked of the server with a
    preflight (answered before any routing or key check) and kept for a minute per Origin. While the server does
    not answer, the last answer for that Origin (none before the first)."""

    def __init__(self, upstream: Upstream, gate: AdmissionGate) -> None:
        self.upstream = upstream
        self.gate = gate
        self._cors: dict[str, tuple[float, str | None]] = {}  # Origin -> (expiry, Access-Control-Allow-Origin)
        self._window: list[float] = [0.0, 0]  # (window start, preflights in it)

    async def headers(self, request: web.Request) -> dict[str, str]:
        origin = request.headers.get("Origin", "")
        now = time.monotonic()
        hit = self._cors.get(origin)
        value = hit[1] if hit is not None else None
        down = self.gate.refuse_reason is not None or self.gate.down_since is not None  # no preflight to a down server
        if (hit is None or hit[0] <= now) and not down and self._budget(now):
            expiry = now + 60.0
            try:
                value = await self.upstream.preflight(origin)
            except (aiohttp.ClientError, OSError, TimeoutError):
                expiry = now + 5.0  # not again for every error while the server is down
            if len(self._cors) >= 1024:
                self._cors.clear()
            self._cors[origin] = (expiry, value)
        return {"Access-Control-Allow-Origin": value} if value is not None else {}

    def _budget(self, now: float) -> bool:
        """At most 10 preflights a second to learn CORS answers: a client sending a new Origin with every
        unauthenticated request must not turn kvctl into an amplifier against the server."""
        if now - self._window[0] >= 1.0:
            self._window = [now, 0]
        self._window[1] += 1
        return self._window[1] <= 10


@dataclass(frozen=True, slots=True)
class AskServer:
    """A static asset without one of kvctl's keys: the server serves those without credentials, so it is asked
    without any, and what it does not serve is a 401, as the server with a key would answer."""


class FrontDoor:
    def __init__(
        self,
        config: ProxyConfig,
        upstream: Upstream,
        routes: RouteTable,
        keys: KeyRing,
        metrics: ProxyMetrics,
        errors: Errors,
        state: ServerState,
        gate: AdmissionGate | None = None,
    ) -> None:
        self.config = config
        self.gate = gate or AdmissionGate()
        self.routes = routes
        self.keys = keys
        self.metrics = metrics
        self.errors = errors
        self.state = state
        self.server_check = (
            ServerCheck(upstream.probe_credentials, ttl_s=config.auth_cache_s)
            if not keys and config.upstream_api_key
            else None
        )
        self.endpoint: EndpointMetrics | None = None
        """The endpoint picker's gauges on GET /metrics; set by the App, which feeds them from the control loop."""

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        value = await unsupported_expect(request)
        if value is None:
            return None
        self.metrics.count("other", 417)
        return proxy_error_response(417, f"unsupported Expect header {value!r}", Code.EXPECTATION_FAILED)

    async def screen(self, request: web.Request) -> web.Response | None:
        """A request no upstream request can carry as it is: refused before anything else."""
        path = request.path
        bad = next((k for k, v in request.headers.items() if not is_utf8(v)), None)
        if bad is not None:
            # aiohttp hands such bytes over as surrogates, which no upstream request or response header can carry
            return await self.errors.kvctl_error(
                request, 400, f"header {bad!r} is not valid UTF-8", Code.INVALID_HEADER
            )
        if has_dot_segments(path):
            # the upstream URL is normalized on the way out: /v1/../kv would reach the server as /kv, past the
            # private-route check
            return await self.errors.kvctl_error(request, 400, f"path with dot segments: {path!r}", Code.INVALID_PATH)
        return None

    @staticmethod
    def is_metrics(request: web.Request, route: Route | None) -> bool:
        # kvctl's endpoint gauges, public like /health; the server's llamacpp:* series never leave through here
        return request.path == "/metrics" or (route is not None and route.path == "/metrics")

    async def endpoint_metrics(self, request: web.Request) -> web.StreamResponse:
        """``GET /metrics``: the gauges an inference gateway's endpoint picker reads (proxy/endpoint_metrics.py),
        without a key; 404 where no control loop feeds them (a plain relay)."""
        if self.endpoint is None or request.path != "/metrics":
            message = f"no route {request.method} {request.path} on the public listener"
            return await self.errors.kvctl_error(request, 404, message, Code.NOT_FOUND)
        if request.method not in ("GET", "HEAD"):
            self.metrics.count("/metrics", 405)
            headers = {**error_headers(Code.METHOD_NOT_ALLOWED), "Allow": "GET, HEAD"}
            return proxy_error_response(
                405, f"{request.method} /metrics: use GET", Code.METHOD_NOT_ALLOWED, None, headers
            )
        self.metrics.count("/metrics", 200)
        return web.Response(
            body=self.endpoint.render() if request.method == "GET" else None,
            headers={"Content-Type": CONTENT_TYPE, "Cache-Control": "no-store"},
        )

    async def authenticate(self, request: web.Request) -> Identity | AskServer | web.StreamResponse:
        """Who is asking: the key's identity (``Identity(None)`` without kvctl keys), an asset to ask the server
        about, or the answer that refuses the request (401, the server's own refusal, 503)."""
        path = request.path
        if path in PUBLIC_PATHS:
            return Identity(None)
        given = request.headers.get(PEER_HEADER)
        if given is not None:
            return await self._peer(request, given)
        asset = request.method in ("GET", "HEAD") and not self.routes.is_api_path(path)
        if self.keys:
            ident = self.keys.check(request.headers)
            if ident is not None:
                return ident
            return AskServer() if asset else await self.errors.unauthorized(request)
        if self.server_check is None or asset:
            return Identity(None)
        answer = await self._ask_server(request)
        if not isinstance(answer, Answer):
            return answer
        if answer.status == 200:
            return Identity(None)
        if answer.status == 401:
            self.metrics.auth_failures.inc()
        self.metrics.count("other", answer.status)
        # the server's own answer; its CORS header was for kvctl's probe: this one is for the Origin sent
        headers = CIMultiDict((k, v) for k, v in answer.headers if not k.lower().startswith("access-control-"))
        headers.update(await self.errors.cors(request))
        return web.Response(status=answer.status, body=answer.body, headers=headers)

    async def _peer(self, request: web.Request, given: str) -> Identity | web.StreamResponse:
        """Another kvctl's drain, with the peer key: it checked the client's credentials. A wrong key is a 403."""
        want = self.config.peer_api_key
        # surrogateescape: a header that is not UTF-8 must fail the comparison, not the handler
        if want and hmac.compare_digest(given.encode("utf-8", "surrogateescape"), want.encode()):
            return Identity("peer", peer=True)
        self.metrics.auth_failures.inc()
        message = "wrong X-Kvctl-Peer key" if want else "this kvctl takes no moved requests (proxy.peer_api_key unset)"
        return await self.errors.kvctl_error(request, 403, message, Code.PEER_FORBIDDEN)

    async def _ask_server(self, request: web.Request) -> Answer | web.Response:
        """The server's answer about the client's credential. While the server is coming back: its last answer for
        that credential, else a wait for it (proxy.replay_timeout_s) and the question again."""
        assert self.server_check is not None
        gate = self.gate
        for attempt in (1, 2):
            try:
                answer = await self.server_check.check(request.headers)
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                log.warning("upstream.unreachable", during="credential check", error=str(e))
                answer = None
                error: BaseException = e
            down = answer is None or (answer.status == 503 and gate.down_since is not None)
            if not down:
                return answer  # type: ignore[return-value]
            if not (gate.down_since is not None or self.state.expected_back()):
                break
            known = self.server_check.last(request.headers, self.config.auth_cache_s + self.config.replay_timeout_s)
            if known is not None:
                return known
            if attempt == 2:
                break
            if gate.down_since is None:
                gate.server_down()  # it answered before and does not now: the next poll that it answers says so
            if not await gate.wait_up(self.config.replay_timeout_s):
                if gate.refuse_reason is not None:
                    return await self.errors.service_unavailable(request, gate.refuse_reason, gate.refuse_code)
                return await self.errors.restarting(request)
        if answer is not None:
            return answer
        return await self.errors.service_unavailable(request, *self.errors.unreachable(error))

    async def turn_away(
        self, request: web.Request, route: Route | None, ident: Identity | None = None
    ) -> web.Response | None:
        """An authenticated request the listener does not take now (draining, the server not coming back) or at all
        (a private route). While a drain to peers runs, a client's generation goes on to a peer."""
        to_peer = route is not None and route.kind is Kind.GENERATION and not (ident is not None and ident.peer)
        if self.state.draining and not (to_peer and self.state.drain_peers):
            return await self.errors.kvctl_error(
                request, 503, "kvctl is shutting down", Code.SHUTTING_DOWN, self.config.retry_after_s
            )
        if self.state.failed is not None:
            return await self.errors.failed_error(request)
        if route is not None and route.kind is Kind.PRIVATE and not self.config.expose_private_routes:
            return await self.errors.private_route(request)
        return None
