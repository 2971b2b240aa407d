"""Takeover: a request or a response that a previous kvctl worker had, found again on the server.

Under the keeper (controller.keeper) every streaming generation goes to the server with a conversation id derived
from its request id (``<request id>::<ids it continues from>``), so that the server keeps generating into its stream
buffer when the worker that sent it dies, instead of dropping the request. The next worker then:

- for a request the keeper sends again (its response had not started): attaches to the server's stream of it, if the
  server has one, instead of sending it again (:meth:`Takeover.attach_again`); a non-streamed generation goes to the
  server as a conversation too, whose session keeps its answer (patch 0047): the next worker waits for that answer
  and relays it as it is, so the server evaluates and generates it once whatever the workers do meanwhile;
- for a response under way (``POST /resume`` on a pair of the keeper's: the request, the head the client has and the
  body it has): rebuilds the stream's transcript from what the client has, attaches to the server's stream and skips
  the events the client has (by the token ids it has), or, when the server has no stream of it (restarted
  meanwhile), continues it from those ids as a replay does (:meth:`Takeover.resume`);
- ends the server's streams of requests whose clients left while no worker ran (:meth:`Takeover.end_abandoned`).

A stream that ends here (done, its client left, kvctl ended it, a drain moved it) ends the server's stream too
(:meth:`Takeover.end_session`): the server no longer stops a conversation's generation when its connection closes,
and keeps a finished one's buffer for 300 s unless told.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from controller.keeper_conns import RECORD_BYTES
from controller.keeper_link import KeeperLink
from controller.keys import Identity
from controller.proxy.context import Broken, Phase, RequestContext
from controller.proxy.forward import ANSWER_HEADER, Opened, close_response
from controller.proxy.inspection import BadRequest, read_generation
from controller.proxy.priority import PRIORITY_HEADER, InvalidPriority, Priority, resolve_priority
from controller.proxy.routes import Kind
from controller.proxy.sse import SSEFramer

if TYPE_CHECKING:
    from controller.proxy.app import Proxy

__all__ = ["CONV_HEADER", "Takeover", "parse_request"]

log = structlog.get_logger("kvctl.proxy")

CONV_HEADER = "X-Conversation-Id"


def _dechunk(data: bytes) -> bytes:
    out, at = bytearray(), 0
    while True:
        eol = data.index(b"\r\n", at)
        size = int(data[at:eol].split(b";")[0].strip(), 16)
        if size == 0:
            return bytes(out)
        out += data[eol + 2 : eol + 2 + size]
        at = eol + 2 + size + 2


def parse_request(raw: bytes) -> tuple[str, str, CIMultiDict[str], bytes]:
    """A request as the keeper kept it: method, target, headers, body (de-chunked)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    start, *lines = head.decode("latin-1").split("\r\n")
    method, target, _ = start.split(" ", 2)
    headers: CIMultiDict[str] = CIMultiDict()
    for line in lines:
        name, _, value = line.partition(":")
        headers.add(name.strip(), value.strip())
    if "chunked" in headers.get("Transfer-Encoding", "").lower():
        body = _dechunk(body)
        del headers["Transfer-Encoding"]
        headers["Content-Length"] = str(len(body))
    return method, target, headers, body


class Takeover:
    def __init__(self, proxy: Proxy, link: KeeperLink) -> None:
        self.proxy = proxy
        self.link = link
        self._tasks: set[asyncio.Task[Any]] = set()

    async def serve(self, app: web.Application, max_body: int) -> Callable[[], Awaitable[None]]:
        """Serve the proxy's ``app`` on the pairs the keeper passes in, and ``POST /resume`` on the resume pairs;
        end the server's streams of the requests the keeper says were abandoned. Returns the cleanup."""
        resumes = web.Application(client_max_size=max_body + RECORD_BYTES + (1 << 20))
        resumes.router.add_post("/resume", self.resume)
        runners = [web.AppRunner(a, handler_cancellation=True, access_log=None) for a in (app, resumes)]
        for runner in runners:
            await runner.setup()
        assert runners[0].server is not None and runners[1].server is not None
        self.link.on_abandoned = self._abandoned
        self.link.serve(runners[0].server, runners[1].server)
        self._abandoned()

        async def cleanup() -> None:
            for runner in runners:
                await runner.cleanup()

        return cleanup

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- the server's streams ---------------------------------------------------------------------------------

    async def sessions(self, prefix: str) -> list[str]:
        """The server's streams of a request (its conversation ids), newest continuation last."""
        up = self.proxy.upstream
        assert up.session is not None
        try:
            async with asyncio.timeout(up.config.connect_timeout_s + up.config.upstream_read_timeout_s):
                async with up.session.post(
                    up.own_url("/v1/streams/lookup"), json={"conversation_ids": [prefix]}, headers=up.own_headers()
                ) as r:
                    doc = await r.json(content_type=None) if r.status == 200 else []
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return []
        ids = [str(s.get("conversation_id")) for s in doc if isinstance(s, dict)] if isinstance(doc, list) else []
        return sorted((i for i in ids if i.startswith(prefix + "::")), key=lambda i: int(i.rsplit("::", 1)[1]))

    async def attach(self, ctx: RequestContext, conv: str) -> Opened | None:
        """The server's stream ``conv`` from its first byte, or None (gone, or its start dropped from the buffer)."""
        up = self.proxy.upstream
        assert up.session is not None
        url = up.own_url("/v1/stream") + "?conv_id=" + conv + "&from=0"
        cm = up.session.get(URL(url, encoded=True), headers=up.own_headers())
        opening = asyncio.ensure_future(cm.__aenter__())
        try:
            upstream = await opening
        except asyncio.CancelledError:
            opening.add_done_callback(close_response)
            raise
        except (aiohttp.ClientError, OSError):
            return None
        whole = upstream.headers.get(ANSWER_HEADER) == "1"  # a non-streamed request's answer, any status (0047)
        sse = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
        if whole or (upstream.status == 200 and sse):
            ctx.conv, ctx.attached = conv, True
            # the stream's name holds the keeper's secret: logged by what it continues from only
            log.info("takeover.attached", request_id=ctx.request_id, after_tokens=int(conv.rsplit("::", 1)[1]))
            return cm, upstream
        await cm.__aexit__(None, None, None)
        return None

    def end_session(self, conv: str) -> None:
        """Stop the server's stream ``conv`` (its generation with it), in the background."""
        up = self.proxy.upstream
        if up.session is None or up.session.closed:
            return

        async def delete() -> None:
            assert up.session is not None
            try:
                url = URL(up.own_url("/v1/stream") + "?conv_id=" + conv, encoded=True)
                async with (
                    asyncio.timeout(up.config.connect_timeout_s + 5),
                    up.session.delete(url, headers=up.own_headers()),
                ):
                    pass
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                log.warning("takeover.end_failed", error=str(e))

        self._spawn(delete())

    def _abandoned(self) -> None:
        keys, self.link.abandoned = self.link.abandoned, []
        if keys:
            self._spawn(self.end_abandoned(keys))

    async def end_abandoned(self, keys: list[str]) -> None:
        """Requests whose clients left while no worker had them: their streams end on the server."""
        for key in keys:
            for conv in await self.sessions(f"kvctl-{self.link.epoch}-{key}"):
                log.info("takeover.abandoned", request=key)
                self.end_session(conv)

    # --- a request sent again ---------------------------------------------------------------------------------

    async def attach_again(self, ctx: RequestContext) -> Opened | None:
        """A request the previous worker sent before it died: its stream on the server, whole, if there is one."""
        assert ctx.conv_prefix is not None
        for conv in await self.sessions(ctx.conv_prefix):
            if conv.endswith("::0"):
                return await self.attach(ctx, conv)
        return None

    # --- a response under way -----------------------------------------------------------------------------------

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """``POST /resume`` from the keeper: go on with a response the client has part of, as chunks of this one."""
        # not read(): the clone below needs the request unread
        raw = await request.content.readexactly(request.content_length or 0)
        n_req, n_head = int(request.headers["X-Request-Bytes"]), int(request.headers["X-Head-Bytes"])
        method, target, headers, body = parse_request(raw[:n_req])
        delivered = raw[n_req + n_head :]
        pair = self.link.pair(request)
        clone = request.clone(method=method, rel_url=URL(target, encoded=True), headers=headers)
        route = self.proxy.routes.lookup(method, clone.path)
        if pair is None or route is None or route.kind is not Kind.GENERATION or CONV_HEADER in headers:
            log.warning("takeover.cannot_resume", path=clone.path, method=method)
            return web.Response(status=409, text="not resumable")
        ident = await self.proxy.front.authenticate(clone)
        ctx = RequestContext(clone, route, ident if isinstance(ident, Identity) else Identity(None))
        ctx.request_id, ctx.conv_prefix = self.link.request_id(pair), self.link.conv_prefix(pair)
        ctx.client_request_id = headers.get("X-Request-Id")
        ctx.body = body
        try:
            gen = read_generation(route, self.proxy.routes, CIMultiDictProxy(headers), clone.content_type, body)
            key = ctx.ident.key if ctx.ident is not None else None
            priority = resolve_priority(gen.fields, headers, key, self.proxy.priority_rules)
        except (BadRequest, InvalidPriority):
            gen, priority = None, Priority(0, "default")
        if gen is None:
            return web.Response(status=409, text="not resumable")
        ctx.headers = self.proxy.upstream.headers(ctx, generation=True)
        ctx.headers[PRIORITY_HEADER] = str(priority.value)
        self.proxy.replay.begin(ctx, gen)
        t = ctx.transcript
        if t is None or not t.replayable:
            return web.Response(status=409, text="not resumable")
        framer = SSEFramer()
        for event in [*framer.feed(delivered), framer.flush()]:
            if event:
                t.observe(event)
        self.link.taken(pair)
        resp = web.StreamResponse(status=200)
        await resp.prepare(request)
        ctx.response = resp
        log.info("takeover.resume", request_id=ctx.request_id, tokens=len(t.ids), done=t.done)
        if t.done:
            t.release()
            return resp
        return await self.proxy.resumed(ctx, gen, priority, self._reopen)

    async def _reopen(self, ctx: RequestContext) -> Opened | None:
        """The server's stream of this response, skipping what the client has; else a continuation from its ids."""
        t = ctx.transcript
        assert t is not None and ctx.conv_prefix is not None and ctx.entry is not None
        for conv in reversed(await self.sessions(ctx.conv_prefix)):
            base = int(conv.rsplit("::", 1)[1])
            if base > len(t.ids):
                continue
            opened = await self.attach(ctx, conv)
            if opened is not None:
                ctx.skip_tokens = len(t.ids) - base
                if base:
                    t.replays = max(t.replays, 1)  # a continuation's ids are spliced to the client's
                return opened
        ctx.entry.state = Phase.REPLAYING
        return await self.proxy.replay.resume(ctx, Broken("kvctl restarted, and the server has no stream of it"))
