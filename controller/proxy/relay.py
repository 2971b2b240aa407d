"""Relay: the server's response to the client, as it arrives.

:meth:`Relay.forward` opens the request upstream (through replay's resend policy) and answers what cannot be
opened; then the response goes out as bytes (anything that is not a generation's event stream: streamed, nothing
of kvctl's own, a silence past the read timeout aborts the connection) or as events (a generation's SSE: event by
event, byte for byte, heartbeats over silences and only between complete events, the route's error event when the
stream breaks, and replay's continuation when the server died under it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from controller.errors import Code
from controller.proxy.config import ProxyConfig
from controller.proxy.context import Broken, End, Phase, RequestContext, Silence, Tracker, Truncated
from controller.proxy.forward import ANSWER_HEADER, Opened, Upstream, UpstreamEnded
from controller.proxy.framing import Errors, error_event, error_from_body
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.owners import Ownership
from controller.proxy.replay import Replay
from controller.proxy.restart import MODELS_PATHS, ModelsCache, loading_response
from controller.proxy.routes import Kind
from controller.proxy.slots import slots_view
from controller.proxy.sse import SSEFramer, comment_text, has_data, is_comment
from controller.proxy.transcript import ANNOUNCE_HEADER
from controller.proxy.writer import Writer, abort

__all__ = ["Relay", "Reopen"]

# a stream a previous worker began, opened again (controller.proxy.takeover); None: it cannot go on
Reopen = Callable[[RequestContext], Awaitable[Opened | None]]

log = structlog.get_logger("kvctl.proxy")


@dataclass(eq=False)
class _Events:
    """A generation's event stream as the relay goes through it."""

    upstream: aiohttp.ClientResponse
    t0: float  # when the request arrived: the first token's latency is from here
    framer: SSEFramer = field(default_factory=SSEFramer)
    held: list[bytes] = field(default_factory=list)  # a result's events whose ids are still on the way
    first: bool = True
    last: float = field(default_factory=time.monotonic)  # the latest byte from the server
    replaced: Any = None  # the context of a continuation's response: ours to close


class Relay:
    def __init__(
        self,
        config: ProxyConfig,
        upstream: Upstream,
        writer: Writer,
        errors: Errors,
        replay: Replay,
        ownership: Ownership,
        tracker: Tracker,
        metrics: ProxyMetrics,
    ) -> None:
        self.config = config
        self.upstream = upstream
        self.writer = writer
        self.errors = errors
        self.replay = replay
        self.ownership = ownership
        self.tracker = tracker
        self.metrics = metrics
        self.models_cache: ModelsCache | None = None
        """Where the model list's answers are kept for a restart (set by the coordinator)."""

    async def forward(self, ctx: RequestContext, reopen: Reopen | None = None) -> web.StreamResponse:
        """Send the request (or ``reopen`` a stream a previous worker began), relay its response; a client that hangs
        up closes the upstream connection."""
        relayed = ctx.entry is None
        # not a generation: tracked only so that a hung server or a shutdown can end it
        entry = ctx.track(ctx.label, Phase.UPSTREAM) if ctx.entry is None else ctx.entry
        if relayed:
            self.tracker.relays.add(entry)
        try:
            try:
                opened = await (self.replay.open(ctx) if reopen is None else reopen(ctx))
                if opened is None:
                    return await self._not_reopened(ctx)
                upstream_cm, upstream = opened
            finally:
                if relayed:
                    self.tracker.relays.discard(entry)
        except UpstreamEnded as e:
            return await self.errors.ended_before_start(ctx, e.reason)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            if entry.stop is not None:  # kvctl ended it while it waited to be sent again (the server failed)
                return await self.errors.ended_before_start(ctx, entry.stop)
            self.metrics.stream_errors.labels(stage="connect").inc()
            log.warning("upstream.unreachable", request_id=ctx.request_id, path=ctx.request.path, error=str(e))
            if ctx.route is not None and ctx.route.kind is Kind.PUBLIC and self.replay.state.expected_back():
                return loading_response(await self.errors.cors(ctx.request))  # the server's answer while it loads
            return await self.errors.unavailable(ctx, *self.errors.unreachable(e, ctx.waited))
        entry.upstream = upstream
        entry.state = Phase.STREAMING  # the response has started: from here the read timeout applies
        if ctx.on_response is not None:
            ctx.on_response()
        try:
            return await self._respond(ctx, upstream)
        except asyncio.CancelledError:
            # the client hung up: leaving the upstream context closes that connection, and llama-server releases
            # the slot (a conversation stream goes on generating into the server's buffer: the server's contract)
            self.metrics.disconnects.inc()
            log.info("client.disconnected", request_id=ctx.request_id)
            raise
        except ConnectionResetError:
            self.metrics.disconnects.inc()
            raise
        finally:
            entry.upstream = None
            await upstream_cm.__aexit__(None, None, None)

    async def _not_reopened(self, ctx: RequestContext) -> web.StreamResponse:
        """A stream a previous worker began that cannot go on: the server's refusal, or the error event."""
        assert ctx.response is not None
        t = ctx.transcript
        if t is not None and t.refused is not None:
            await self.writer.write(ctx, t.refused)
        else:
            status, message, code = self.errors.stream_error(ctx, Broken("kvctl restarted"))
            await self.writer.write(ctx, error_event(ctx.route, status, message, code))
        return ctx.response

    async def _respond(self, ctx: RequestContext, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        is_sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        self.metrics.count(ctx.label, upstream.status)
        if ctx.asset_probe and upstream.status == 404:
            return await self.errors.unauthorized(ctx.request)
        if ctx.response is not None:
            if not is_sse or upstream.status != 200:
                # too late for a status: the server's error becomes an error event in the route's framing
                data = await self.upstream.read_all(upstream)
                await self.writer.write(ctx, error_from_body(ctx.route, upstream.status, data or b""))
                return ctx.response
        elif ctx.generation and is_sse and upstream.status == 200 and not ctx.raw:
            headers = Upstream.response_headers(upstream, ctx.client_request_id, ctx.request_id, keep_length=False)
            await self.writer.prepare_sse(ctx, headers)
        else:
            if ctx.lookup_owner is not None:
                return await self._lookup(ctx, upstream, ctx.lookup_owner)
            if upstream.status == 200 and (ctx.slots_view or self.cacheable(ctx)):
                return await self._whole(ctx, upstream)
            headers = Upstream.response_headers(upstream, ctx.client_request_id, ctx.request_id, keep_length=True)
            if ctx.attached:
                headers.popall(ANSWER_HEADER, None)  # a previous worker's answer, as the client asked it
            resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
            await resp.prepare(ctx.request)
            ctx.response = resp
            await self.relay_bytes(ctx, upstream, ctx.owner if is_sse else None)
            return resp
        await self.relay_events(ctx, upstream)
        assert ctx.response is not None
        return ctx.response

    def cacheable(self, ctx: RequestContext) -> bool:
        """The model list, asked without a query: kept for a restart (proxy/restart.py)."""
        route, request = ctx.route, ctx.request
        return (
            self.models_cache is not None
            and route is not None
            and route.path in MODELS_PATHS
            and request.method == "GET"
            and not request.query_string
        )

    async def _whole(self, ctx: RequestContext, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        """A small JSON answer read whole: the slots as this client may see them, or the model list (kept for a
        restart)."""
        data = await self.upstream.read_all(upstream)
        if data is None:
            return await self.errors.kvctl_error(
                ctx.request, 502, "llama-server went away mid-answer", Code.UPSTREAM_DISCONNECTED
            )
        headers = Upstream.response_headers(upstream, ctx.client_request_id, ctx.request_id, keep_length=False)
        if ctx.slots_view:
            several = self.ownership.several_keys
            data = slots_view(data, ctx.ident, several, self.tracker.inflight)
        elif self.models_cache is not None and ctx.route is not None and not upstream.headers.get("Content-Encoding"):
            self.models_cache.store(ctx.route.path, data, headers)
        resp = web.Response(status=upstream.status, reason=upstream.reason, body=data, headers=headers)
        ctx.response = resp
        return resp

    async def _lookup(self, ctx: RequestContext, upstream: aiohttp.ClientResponse, owner: str) -> web.StreamResponse:
        """POST /v1/streams/lookup with several keys: only the conversations this key started (a small JSON list)."""
        data = await self.upstream.read_all(upstream)
        if data is None:
            return await self.errors.kvctl_error(
                ctx.request, 502, "llama-server went away mid-answer", Code.UPSTREAM_DISCONNECTED
            )
        if upstream.status == 200:
            data = self.ownership.filter_streams(data, owner)
        return web.Response(
            status=upstream.status,
            body=data,
            headers=Upstream.response_headers(upstream, None, None, keep_length=False),
        )

    async def relay_bytes(self, ctx: RequestContext, upstream: aiohttp.ClientResponse, owner: str | None) -> None:
        """Bytes as they arrive, nothing of kvctl's own; a silence past the read timeout, or kvctl ending the
        request, aborts the connection (a client that counts bytes then resumes where it stopped). With ``owner``
        (a conversation stream, several keys), the first event's completion id is recorded for that key."""
        assert ctx.response is not None
        request = ctx.request
        last = time.monotonic()
        framer = SSEFramer() if owner is not None else None
        while True:
            try:
                chunk = await self.upstream.read(upstream)
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
                self.metrics.stream_errors.labels(stage="upstream").inc()
                log.warning("upstream.disconnected", request_id=ctx.request_id, error=str(e))
                abort(request)
                return
            if chunk is None:
                if time.monotonic() - last >= self.config.upstream_read_timeout_s:
                    self.metrics.stream_errors.labels(stage="upstream_timeout").inc()
                    log.warning("upstream.timeout", request_id=ctx.request_id, path=request.path)
                    abort(request)
                    return
                continue
            if not chunk:
                await ctx.response.write_eof()
                return
            last = time.monotonic()
            if framer is not None and owner is not None:
                for event in framer.feed(chunk):  # a read-only copy: the client gets the chunk as it is
                    if has_data(event):
                        self.ownership.record(event, owner)
                        framer = None
                        break
            await self.writer.write(ctx, chunk)

    async def relay_events(self, ctx: RequestContext, upstream: aiohttp.ClientResponse) -> None:
        """A generation's events to the client, with heartbeats over silences. With a transcript, a stream whose
        server died (or, spawned, hung) goes on in the restarted server (replay)."""
        assert ctx.entry is not None
        if ctx.transcript is not None and upstream.headers.get(ANNOUNCE_HEADER) != "1" and not ctx.attached:
            ctx.transcript.drop("the server does not announce token ids (patch 0026)")
        s = _Events(upstream, ctx.entry.t_start)
        try:
            while True:
                chunk, end = await self._next(s)
                if end is not None:
                    if not await self._ended(ctx, s, end):
                        return
                elif chunk is None:
                    if not s.framer.pending and not s.held:
                        await self.writer.heartbeat(ctx, "silence")
                else:
                    await self._events(ctx, s, chunk)
        finally:
            if s.replaced is not None:
                await s.replaced.__aexit__(None, None, None)

    async def _next(self, s: _Events) -> tuple[bytes | None, End | None]:
        """The next chunk (None: a heartbeat's silence), and how the response ended, if it did."""
        end: End | None
        try:
            chunk = await self.upstream.read(s.upstream)
            end = None if chunk is None or chunk else Truncated()
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            chunk, end = b"", Broken(str(e))
        if chunk is None and time.monotonic() - s.last >= self.config.upstream_read_timeout_s:
            end = Silence()
        return chunk, end

    async def _ended(self, ctx: RequestContext, s: _Events, end: End) -> bool:
        """The response ended: go on in a continuation (True), or finish the client's stream (False)."""
        transcript = ctx.transcript
        if self.replay.replayable(ctx, end):
            assert transcript is not None
            again = await self.replay.resume(ctx, end)
            if again is not None:
                await self._switch(ctx, s, again)
                return True
            if transcript.refused is not None:
                await self.writer.write(ctx, b"".join(s.held) + transcript.refused)
                return False
            # given up: even a response that merely ended gets the error event
        elif isinstance(end, Truncated):
            rest = b"".join(s.held) + s.framer.flush()
            if rest:
                await self.writer.write(ctx, rest)
            return False
        await self._fail(ctx, s, end)
        return False

    async def _switch(self, ctx: RequestContext, s: _Events, again: Opened) -> None:
        """Relay the continuation from here: the held events' ids never came, so it sends them again."""
        assert ctx.entry is not None
        s.held, s.framer = [], SSEFramer()
        old, (s.replaced, s.upstream) = s.replaced, again
        ctx.entry.upstream = s.upstream  # from here kvctl's end() closes the continuation
        if old is not None:
            await old.__aexit__(None, None, None)
        s.last = time.monotonic()

    async def _fail(self, ctx: RequestContext, s: _Events, end: End) -> None:
        status, message, code = self.errors.stream_error(ctx, end)
        if ctx.entry is not None:
            ctx.entry.errored = True
        self.metrics.stream_errors.labels(stage=code).inc()
        log.warning("stream.ended", request_id=ctx.request_id, reason=code, error=str(end))
        if s.held:
            await self.writer.write(ctx, b"".join(s.held))  # complete events: the client gets them
        if s.framer.pending:
            await self.writer.write(ctx, b"\n\n")  # close the event the server left open
        await self.writer.write(ctx, error_event(ctx.route, status, message, code))

    async def _events(self, ctx: RequestContext, s: _Events, chunk: bytes) -> None:
        s.last = time.monotonic()
        out: list[bytes] = []
        for event in s.framer.feed(chunk):
            if ctx.skip_tokens > 0:
                self._skip(ctx, event)  # the client has it: a previous worker relayed it
                continue
            if s.first and has_data(event):
                s.first = False
                self.metrics.ttft.observe(time.monotonic() - s.t0)
                if ctx.owner is not None:
                    self.ownership.record(event, ctx.owner)
            if is_comment(event):
                text = comment_text(event)
                if text in ("parked", "resumed"):
                    log.info(f"stream.{text}", request_id=ctx.request_id)
            out.extend(self.replay.pass_event(ctx, event, s.held))
        if out:
            await self.writer.write(ctx, b"".join(out))

    @staticmethod
    def _skip(ctx: RequestContext, event: bytes) -> None:
        """An event of an attached stream that the client has (up to the ids it has); a continuation's still names
        what the splice maps."""
        t = ctx.transcript
        if t is not None and t.replays:
            t.splice(event)
        if event.startswith(b": tokens"):
            ctx.skip_tokens -= len(event[len(b": tokens") :].split())
            if ctx.skip_tokens < 0:
                log.warning("takeover.skip_overrun", request_id=ctx.request_id, by=-ctx.skip_tokens)
                ctx.skip_tokens = 0
