"""Error framing: the one place that writes what kvctl says when it answers a request itself.

Before a response has started, an error is kvctl's OpenAI envelope with its status (``controller.errors``), the
Origin's CORS header and Retry-After where waiting helps; a refused credential gets the server's own 401 body.
Once a client has SSE headers, the error is an event in the framing the server uses on that route (Anthropic's
``event: error`` or OpenAI's ``data: {"error": ...}``), and a server's error body is carried the same way.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from controller.errors import Code, proxy_error_object, proxy_error_response
from controller.proxy.auth import UNAUTHORIZED_BODY
from controller.proxy.config import ProxyConfig
from controller.proxy.context import End, RequestContext, ServerState, Silence, Stop
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.routes import Route, RouteTable
from controller.proxy.writer import Writer

__all__ = ["CorsHeaders", "Errors", "error_event", "error_from_body", "frame_error"]

log = structlog.get_logger("kvctl.proxy")

# the Access-Control-Allow-Origin the server would send this request (the front door's CORS)
CorsHeaders = Callable[[web.Request], Awaitable[dict[str, str]]]


def error_event(route: Route | None, status: int, message: str, code: str) -> bytes:
    """An error inside an SSE stream, framed as the server frames one on that route."""
    return frame_error(route, proxy_error_object(status, message, code))


def frame_error(route: Route | None, err: dict[str, Any]) -> bytes:
    data = json.dumps(err, ensure_ascii=False).encode()
    if route is not None and route.stream_framing == "anthropic":
        return b"event: error\ndata: " + data + b"\n\n"
    return b'data: {"error": ' + data + b"}\n\n"


def error_from_body(route: Route | None, status: int, data: bytes) -> bytes:
    """The server's error answer as an event of the route's stream (its own error object when it has one)."""
    try:
        err = json.loads(data)["error"]
        if not isinstance(err, dict):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        err = proxy_error_object(status, f"llama-server answered {status}", Code.UPSTREAM_ERROR)
    return frame_error(route, err)


class Errors:
    def __init__(
        self,
        config: ProxyConfig,
        metrics: ProxyMetrics,
        routes: RouteTable,
        cors: CorsHeaders,
        writer: Writer,
        state: ServerState,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.routes = routes
        self.cors = cors
        self.writer = writer
        self.state = state

    def retry_after(self, code: str) -> int | None:
        return None if code == Code.SERVER_FAILED else self.config.retry_after_s

    def end_message(self, reason: Stop) -> tuple[str, Code]:
        """What a client is told of a request kvctl ended itself."""
        if reason is Stop.SHUTDOWN:
            return "kvctl is shutting down; the request was ended", Code.SHUTTING_DOWN
        if reason is Stop.FAILED:
            return self.state.failed or "llama-server failed to start", Code.SERVER_FAILED
        if reason is Stop.REPLACED:
            message = "llama-server was restarted with another model; this answer cannot be continued on it"
            return message, Code.SERVER_REPLACED
        silent = self.config.upstream_read_timeout_s + self.config.replay_timeout_s
        return f"llama-server has not answered for {silent:g} s; the request was ended", Code.UPSTREAM_TIMEOUT

    def unreachable(self, error: BaseException, waited: bool = False) -> tuple[str, Code]:
        """What a client is told when the server cannot be reached: why it is not coming back, once it is not;
        ``waited``: the request waited proxy.replay_timeout_s for it. Never the server's address or the exception
        (the caller logs those)."""
        if self.state.failed is not None:
            return self.state.failed, Code.SERVER_FAILED
        if self.state.expected_back():
            if waited:
                return self._restarting_message(), Code.SERVER_RESTARTING
            # not sent again (replay off for it, or a conversation stream): it is answered at once
            return "llama-server went away before it answered (it is restarting)", Code.SERVER_RESTARTING
        return "llama-server is unreachable", Code.UPSTREAM_UNAVAILABLE

    def _restarting_message(self) -> str:
        return f"llama-server is restarting and did not come back within {self.config.replay_timeout_s:g} s"

    async def restarting(self, request: web.Request) -> web.Response:
        """503 for a request that waited proxy.replay_timeout_s for the server to come back."""
        return await self.service_unavailable(request, self._restarting_message(), Code.SERVER_RESTARTING)

    async def service_unavailable(self, request: web.Request, message: str, code: str) -> web.Response:
        """503 before the response started, with Retry-After where waiting helps."""
        return await self.kvctl_error(request, 503, message, code, self.retry_after(code))

    async def private_route(self, request: web.Request) -> web.Response:
        """403 for a controller route on the client port: it is on kvctl's admin API."""
        where = f"port {self.config.admin_port}" if self.config.admin_port is not None else "its own listener"
        message = (
            f"{request.method} {request.path} is the controller's: use kvctl's admin API ({where}: GET /status, "
            "POST /slots/{id}/park, POST /slots/{id}/resume)"
        )
        return await self.kvctl_error(request, 403, message, Code.PRIVATE_ROUTE)

    def stream_error(self, ctx: RequestContext, end: End) -> tuple[int, str, Code]:
        """The status, message and code of the error event that ends a started stream."""
        status = 504 if isinstance(end, Silence) else 502
        stop = ctx.entry.stop if ctx.entry is not None else None
        if isinstance(end, Silence):
            silent = self.config.upstream_read_timeout_s
            message, code = f"llama-server sent nothing for {silent:g} s; the stream was ended", Code.UPSTREAM_TIMEOUT
        elif stop is not None:
            message, code = self.end_message(stop)
        else:
            message, code = "llama-server went away mid-stream", Code.UPSTREAM_DISCONNECTED
        return (503 if code == Code.SERVER_FAILED else status), message, code

    async def kvctl_error(
        self, request: web.Request, status: int, message: str, code: str, retry_after: int | None = None
    ) -> web.Response:
        known = self.routes.lookup(request.method, request.path) is not None
        self.metrics.count(request.path if known else "other", status)
        return proxy_error_response(status, message, code, retry_after, await self.cors(request))

    async def failed_error(self, request: web.Request) -> web.Response:
        assert self.state.failed is not None
        return await self.kvctl_error(request, 503, self.state.failed, Code.SERVER_FAILED)

    async def unauthorized(self, request: web.Request) -> web.Response:
        """The server's own 401, byte for byte."""
        self.metrics.auth_failures.inc()
        self.metrics.count("other", 401)
        return web.Response(
            status=401,
            body=UNAUTHORIZED_BODY,
            content_type="application/json",
            charset="utf-8",
            headers=await self.cors(request),
        )

    async def unavailable(self, ctx: RequestContext, message: str, code: str) -> web.StreamResponse:
        """A 503, or its error event when the client already has SSE headers (admission's heartbeats)."""
        if ctx.response is not None:
            await self.writer.write(ctx, error_event(ctx.route, 503, message, code))
            return ctx.response
        return await self.service_unavailable(ctx.request, message, code)

    async def refuse(self, ctx: RequestContext, message: str, code: str) -> web.StreamResponse:
        """Admission refused the request (queue full, timed out, or kvctl ended it while it waited)."""
        log.warning("admission.refused", route=ctx.request.path, reason=code)
        if ctx.response is not None:
            self.metrics.count(ctx.request.path, 503)
        return await self.unavailable(ctx, message, code)

    async def ended_before_start(self, ctx: RequestContext, reason: Stop) -> web.StreamResponse:
        message, code = self.end_message(reason)
        self.metrics.stream_errors.labels(stage=code).inc()
        return await self.unavailable(ctx, message, code)
