"""Replay: a request whose server died goes on in the restarted server.

The stage owns the resend policy and its waiting: a request the server died under before answering is sent again
once the server answers ``/health``; a stream it died (or, spawned, hung) under is continued from the tokens its
client has (``controller.proxy.transcript``). While it waits, the client gets heartbeats; a result's events reach
the client only once their token ids have come (:meth:`Replay.pass_event`), so that the client never holds a token
the continuation would send again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import aiohttp
import structlog

from controller.proxy.config import ProxyConfig
from controller.proxy.context import End, Inflight, Phase, RequestContext, ServerState, Silence
from controller.proxy.forward import Moving, Opened, Upstream, UpstreamEnded
from controller.proxy.framing import error_from_body
from controller.proxy.handover import Handover
from controller.proxy.inspection import GenerationBody, one_completion
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.owners import Owners
from controller.proxy.peers import PeerRefused, Peers
from controller.proxy.routes import Kind
from controller.proxy.sse import has_data
from controller.proxy.transcript import ANNOUNCE_HEADER, OPT_OUT_HEADER, ReplayMemory, Transcript
from controller.proxy.writer import Writer

if TYPE_CHECKING:
    from controller.proxy.takeover import Takeover

__all__ = ["Replay"]

log = structlog.get_logger("kvctl.proxy")


class Replay:
    def __init__(
        self,
        config: ProxyConfig,
        upstream: Upstream,
        writer: Writer,
        metrics: ProxyMetrics,
        state: ServerState,
        memory: ReplayMemory,
        completion_ids: Owners,
    ) -> None:
        self.config = config
        self.upstream = upstream
        self.writer = writer
        self.metrics = metrics
        self.state = state
        self.memory = memory
        self.completion_ids = completion_ids
        self.peers: Peers | None = None  # where a drain moves requests (controller.proxy.drain)
        self.handover: Handover | None = None  # the files of moved cells (controller.proxy.handover)
        self.takeover: Takeover | None = None  # under the keeper: the server's streams of a previous worker's requests

    def begin(self, ctx: RequestContext, body: GenerationBody) -> None:
        """Whether the request may be sent again, and its transcript when its stream may be continued (a client
        can opt out with X-Kvctl-Replay: off)."""
        on = self.config.replay_limit > 0 and ctx.request.headers.get(OPT_OUT_HEADER, "").strip().lower() != "off"
        if on and body.stream and not body.conversation and not body.predict and one_completion(body.payload):
            # the server follows each result's events with its tokens' ids: what a continuation starts from
            assert ctx.request_id is not None
            ctx.transcript = Transcript.start(body.route.path, body.payload, len(ctx.body), self.memory, ctx.request_id)
            if ctx.transcript.replayable:
                ctx.headers[ANNOUNCE_HEADER] = "1"
        ctx.resend = on and not body.conversation

    async def open(self, ctx: RequestContext) -> Opened:
        """Send the request. Nothing listened (any request) while the server is expected back, or sent and the
        server died before it answered (a generation, replay on): the client has seen nothing of it, so it is sent
        again once the server is back. A server not expected back is answered at once."""
        assert ctx.entry is not None
        resends = 0
        deadline: float | None = None
        if ctx.again and ctx.conv_prefix is not None and self.takeover is not None:
            attached = await self.takeover.attach_again(ctx)  # the previous worker had sent it: its stream, whole
            if attached is not None:
                return attached
        while True:
            if ctx.entry.move.is_set():
                opened = await self.to_peer(ctx, ctx.body)
                if opened is not None:
                    return opened
            try:
                ctx.entry.sent_epoch = self.epoch()
                if ctx.conv_prefix is not None:
                    ctx.conv = f"{ctx.conv_prefix}::0"
                return await self.upstream.send(ctx, ctx.body)
            except Moving:
                if ctx.conv is not None and self.takeover is not None:
                    self.takeover.end_session(ctx.conv)  # a conversation goes on without its connection: stopped
                    ctx.conv = None
                continue  # withdrawn here: to a peer whole
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                refused = isinstance(e, aiohttp.ClientConnectorError)
                public = ctx.route is not None and ctx.route.kind is Kind.PUBLIC  # a health probe: answered at once
                if refused and (public or not self.state.expected_back()):
                    raise
                limit = self.config.replay_limit if not refused else max(1, self.config.replay_limit)
                if not (ctx.resend or refused) or resends >= limit:
                    raise
                if deadline is None:
                    deadline = time.monotonic() + self.config.replay_timeout_s
                ctx.entry.state = Phase.REPLAYING  # not "waiting for a response" while the server restarts
                ready = await self.wait_ready(ctx, deadline)
                ctx.entry.state = Phase.UPSTREAM
                if not ready:
                    ctx.waited = True
                    raise
                resends += 1
                log.warning("replay.resend", request_id=ctx.request_id, attempt=resends, error=str(e))

    def epoch(self) -> int:
        """Which server a request goes to now: the supervisor's restart count (0 when kvctl spawned none)."""
        return self.state.restarts() if self.state.restarts is not None else 0

    def replayable(self, ctx: RequestContext, end: End) -> bool:
        """Whether a stream that ended so goes on: it has a transcript and its final event has not come; a hung
        server's stream only once kvctl has killed and restarted the server it spawned."""
        t = ctx.transcript
        return (
            t is not None
            and t.replayable
            and not t.done
            and (not isinstance(end, Silence) or self.state.restarts is not None)
        )

    async def resume(self, ctx: RequestContext, end: End) -> Opened | None:
        """The server died (or hung) under this stream: wait (heartbeating the client) for it to answer ``/health``
        again, then send the request continued from the ids the client has. The continuation's response, or None:
        kvctl ended the request, the server refused the continuation (``transcript.refused``), or past
        ``replay_limit`` or ``replay_timeout_s``."""
        transcript, entry = ctx.transcript, ctx.entry
        assert transcript is not None and entry is not None
        restarts = self.state.restarts
        after_restart = restarts() if isinstance(end, Silence) and restarts is not None else None
        if entry.ended.done():
            return None
        why = str(end)
        if entry.move.is_set():
            # a drain cut the stream: continued on a peer, else here (the server here still runs)
            if ctx.conv is not None and self.takeover is not None:
                self.takeover.end_session(ctx.conv)  # its stream here would go on generating for nobody
            transcript.replays += 1
            opened = await self.to_peer(ctx, transcript.continuation(), continued=True)
            if opened is not None:
                return opened
            transcript.replays -= 1
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
            if not await self.wait_ready(ctx, deadline, after_restart):
                break
            if entry.move.is_set():  # a drain began while it waited for this server: a peer continues it
                opened = await self.to_peer(ctx, transcript.continuation(), continued=True)
                if opened is not None:
                    return opened
            after_restart = None  # restarted once: a later death is an ordinary one
            entry.sent_epoch = self.epoch()
            if ctx.conv_prefix is not None:
                ctx.conv = f"{ctx.conv_prefix}::{len(transcript.ids)}"  # after the ids it continues from
            try:
                cm, upstream = await self._beating(ctx, self.upstream.send(ctx, transcript.continuation()))
            except UpstreamEnded:
                return None
            except Moving:
                transcript.replays -= 1  # not sent: the next pass moves it
                continue
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                why = str(e)
                continue
            return await self._answered(ctx, transcript, cm, upstream)
        self.metrics.replays.labels(outcome="gave_up").inc()
        log.warning("replay.gave_up", request_id=transcript.request_id, attempts=transcript.replays)
        return None

    async def to_peer(self, ctx: RequestContext, body: bytes, continued: bool = False) -> Opened | None:
        """A drain moves the request: ``body`` (the request whole, or ``continued`` from its ids, with the file of
        its cells when the drain made one) to its peers in turn; the first one's response, or None when none took it
        (the request then stays here, and is not moved again)."""
        entry = ctx.entry
        assert entry is not None and self.peers is not None
        handover: str | None = None
        if continued and entry.handover is not None:
            either: set[asyncio.Future[Any]] = {entry.handover, entry.ended}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if entry.handover.done() and not entry.handover.cancelled():
                handover = entry.handover.result()
            if entry.ended.done():
                if self.handover is not None:
                    self.handover.discard(handover)
                return None
        try:
            return await self._to_peers(ctx, entry, body, handover)
        finally:
            if self.handover is not None:
                self.handover.discard(handover)  # taken or not: the peer has read it by its answer

    async def _to_peers(self, ctx: RequestContext, entry: Inflight, body: bytes, handover: str | None) -> Opened | None:
        assert self.peers is not None
        for peer in entry.peers:
            try:
                sending = self.peers.send(ctx, peer, body, handover)
                # a client that has a response gets heartbeats while the peer has not started its own
                opened = await (self._beating(ctx, sending) if ctx.response is not None else sending)
            except (PeerRefused, aiohttp.ClientError, OSError, TimeoutError) as e:
                self.metrics.moves.labels(outcome="refused").inc()
                log.warning("drain.peer_refused", request_id=ctx.request_id, peer=peer, error=str(e) or repr(e))
                if entry.ended.done():
                    return None
                continue
            entry.on_peer = peer
            self.metrics.moves.labels(outcome="moved").inc()
            log.info("drain.moved", request_id=ctx.request_id, peer=peer, tokens=self._tokens(ctx))
            return opened
        entry.stays = True
        entry.move.clear()
        self.metrics.moves.labels(outcome="stayed").inc()
        log.warning("drain.stays", request_id=ctx.request_id, reason="no peer took it")
        return None

    @staticmethod
    def _tokens(ctx: RequestContext) -> int | None:
        return len(ctx.transcript.ids) if ctx.transcript is not None and ctx.transcript.replays else None

    async def _answered(
        self, ctx: RequestContext, transcript: Transcript, cm: Any, upstream: aiohttp.ClientResponse
    ) -> Opened | None:
        """The continuation's response: its stream (``cm`` goes with it, to the relay), or the server's refusal kept
        for the client (``cm`` is closed here)."""
        if upstream.status == 200 and upstream.headers.get("Content-Type", "").startswith("text/event-stream"):
            self.metrics.replays.labels(outcome="sent").inc()
            log.info("replay.sent", request_id=transcript.request_id, tokens=len(transcript.ids))
            return cm, upstream
        try:
            data = await self.upstream.read_all(upstream)
            self.metrics.replays.labels(outcome="refused").inc()
            log.warning(
                "replay.refused",
                request_id=transcript.request_id,
                status=upstream.status,
                body=(data or b"")[:300],
            )
            transcript.refused = error_from_body(ctx.route, upstream.status, data or b"")
            return None
        finally:
            await cm.__aexit__(None, None, None)

    async def _beating(self, ctx: RequestContext, sending: Awaitable[Opened]) -> Opened:
        """Await ``sending`` (a continuation whose response has not started: it may wait in the server's queue
        behind the others), heartbeating the client meanwhile. Cancelled, ``send`` closes what it opened."""
        task = asyncio.ensure_future(sending)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.config.heartbeat_s)
                if done:
                    return task.result()
                await self.writer.heartbeat(ctx, "server restarting")
        finally:
            if not task.done():
                task.cancel()

    async def wait_ready(self, ctx: RequestContext, deadline: float, after_restart: int | None = None) -> bool:
        """Until the server answers ``/health`` with 200 (restarted and loaded) and, with ``after_restart``, the
        supervisor has restarted it since; a heartbeat to a client with a response every ``heartbeat_s``; False
        past the deadline or when kvctl ends the request."""
        assert self.upstream.session is not None
        entry = ctx.entry
        if entry is None:
            return False
        next_beat = time.monotonic() + self.config.heartbeat_s
        while time.monotonic() < deadline and not entry.ended.done():
            if entry.move.is_set():
                return True  # a drain moves it to a peer: no need to wait for this server
            restarts = self.state.restarts
            restarted = after_restart is None or restarts is None or restarts() > after_restart
            # a hung server still answers /health from its HTTP thread: wait for the new one
            if restarted and await self.upstream.healthy():
                return True
            if ctx.response is not None and time.monotonic() >= next_beat:
                await self.writer.heartbeat(ctx, "server restarting")
                next_beat = time.monotonic() + self.config.heartbeat_s
            await asyncio.wait({entry.ended}, timeout=0.25)  # kvctl ending it (the server failed) ends this at once
        return False

    def pass_event(self, ctx: RequestContext, event: bytes, held: list[bytes]) -> list[bytes]:
        """The events to write now, given the next one: a replayable stream's data events wait in ``held`` until
        the ids of their tokens (``: tokens``, which ends each result) have come; a continuation's are spliced into
        the client's stream."""
        transcript = ctx.transcript
        if transcript is None or not transcript.replayable:
            return [event]
        if transcript.replays:
            event = transcript.splice(event)
            if transcript.upstream_id is not None and transcript.first_id is not None:
                self.completion_ids.set(transcript.first_id, transcript.upstream_id)
        transcript.observe(event)
        if event.startswith(b": tokens") or transcript.done:
            out = [*held, event]
            held.clear()
            return out
        if has_data(event):
            held.append(event)
            return []
        return [event]  # the server's comments (parked, resumed, keep-alive)
