"""Drain: a replica hands its requests to its peers before its server stops (``POST /drain``, ``kvctl drain``, and
SIGTERM when ``proxy.drain_peers`` is set).

1. The peers are checked (``controller.proxy.peers``): up, and serving the same model. Those that are not are
   skipped for the whole drain, with the reason in the log.
2. The replica turns not ready (``/readyz`` and the public ``/health`` answer 503) and stops admitting: a new
   generation goes to a peer whole, anything else gets 503 ``shutting_down``.
3. Each request is moved by what its client has seen: one queued, or sent and not answered yet, goes to a peer
   whole (the local send is withdrawn); a stream that has started (running or parked) is cut here and continued on
   a peer from the token ids its client has, spliced into the same connection as a replay is
   (``controller.proxy.replay``). A peer that refuses is skipped for the next (round robin over the usable ones);
   with none left the request goes on here. What cannot move (a non-streamed answer under way, a resumable
   conversation stream, a stream whose ids are not kept) finishes here.
4. Once no request is on this replica's server (or ``proxy.drain_s`` has passed: the rest end with their protocol's
   error, counted as failed), its server is stopped, so its memory is free at once. The moved streams are relayed
   until they end; at shutdown the usual drain gives them ``proxy.drain_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from controller.errors import Code, KvctlError
from controller.proxy.config import ProxyConfig
from controller.proxy.context import Inflight, Phase, ServerState, Stop, Tracker
from controller.proxy.handover import Handover
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.peers import Peers

__all__ = ["Drain", "DrainOutcome"]

log = structlog.get_logger("kvctl.drain")

# after the drain: how long the ended streams get to send their error event, and other relays to finish
DRAIN_GRACE_S = 2.0

_TICK_S = 0.05


@dataclass(frozen=True, slots=True)
class DrainOutcome:
    moved: int
    """Requests a peer took (those here when the drain began, and those that arrived during it)."""
    finished_here: int
    """Requests that ended here without an error: not movable, or no peer took them."""
    failed: int
    """Requests whose client got an error during the drain (ended past ``proxy.drain_s``, or another error)."""
    seconds: float


class Drain:
    """One drain at a time; see the module docstring."""

    def __init__(
        self,
        config: ProxyConfig,
        tracker: Tracker,
        peers: Peers,
        state: ServerState,
        metrics: ProxyMetrics,
        handover: Handover | None = None,
    ) -> None:
        self.config = config
        self.tracker = tracker
        self.peers = peers
        self.handover = handover
        self._saving: set[asyncio.Task[None]] = set()
        self.others: Callable[[], int] = lambda: 0  # requests other than generations on the server now
        self.state = state
        self.metrics = metrics
        self._lock = asyncio.Lock()
        self._turn = 0
        self.done = False  # a drain has moved what it could: the server is stopped, or being stopped
        self.started: float | None = None  # when the drain began (monotonic): the moved streams' proxy.drain_s

    def order(self) -> tuple[str, ...]:
        """The usable peers in the order one request tries them: round robin, so the moves spread."""
        usable = self.state.drain_peers
        if not usable:
            return ()
        self._turn = (self._turn + 1) % len(usable)
        return usable[self._turn :] + usable[: self._turn]

    async def shutdown(self, timeout_s: float, idle: asyncio.Event, active: set[asyncio.Task[Any]]) -> int:
        """kvctl stops: the open requests get ``timeout_s`` to finish (``idle`` once none runs), then the rest end
        with their protocol's error, and what is not a generation ends with its connection; how many were ended."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(idle.wait(), timeout_s)
        left = list(self.tracker.inflight.values())
        for entry in left:
            entry.end(Stop.SHUTDOWN)
        if left:
            log.warning("proxy.drain_ended_streams", count=len(left), after_s=timeout_s)
        # what is not a generation (a relayed download, a conversation stream) ends with its connection
        rest = [t for t in active if not t.done()]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(idle.wait(), DRAIN_GRACE_S)
        for t in rest:
            t.cancel()
        return len(left)

    async def run(self, peers: Sequence[str] | None, stop_server: Callable[[], Awaitable[None]] | None) -> DrainOutcome:
        """Move every request to ``peers`` (default proxy.drain_peers) and stop the server once it holds none;
        KvctlError when a drain runs already or there is no peer."""
        urls = [p.rstrip("/") for p in peers] if peers else list(self.config.drain_peers)
        if self._lock.locked():
            raise KvctlError(409, Code.DRAIN_IN_PROGRESS, "a drain is already under way")
        if self.done:
            raise KvctlError(409, Code.DRAIN_IN_PROGRESS, "this replica is drained: restart kvctl to serve again")
        if not urls:
            raise KvctlError(
                400, Code.INVALID_PEERS, "no peer to drain to: give some, or set proxy.drain_peers (--drain-peer)"
            )
        async with self._lock:
            return await self._run(urls, stop_server)

    async def _run(self, urls: Sequence[str], stop_server: Callable[[], Awaitable[None]] | None) -> DrainOutcome:
        t0 = self.started = time.monotonic()
        checks = await asyncio.gather(*(self.peers.check(u) for u in urls))
        for url, why in zip(urls, checks, strict=True):
            if why is not None:
                log.warning("drain.peer_skipped", peer=url, reason=why)
        self.state.drain_peers = tuple(u for u, why in zip(urls, checks, strict=True) if why is None)
        self.state.draining = True
        log.warning("drain.started", peers=list(self.state.drain_peers), requests=len(self.tracker.inflight))
        seen: dict[str, Inflight] = {}
        deadline = t0 + self.config.drain_s
        while True:
            live = list(self.tracker.inflight.values())
            for entry in live:
                seen.setdefault(entry.request_id, entry)
                self._move(entry)
            here = [e for e in live if e.on_peer is None]
            if not here and not self.others():
                break  # nothing left on the server (an embedding or a tokenize being answered counts too)
            if time.monotonic() >= deadline:
                for entry in here:
                    entry.errored = True
                    entry.end(Stop.SHUTDOWN)
                log.warning("drain.ended_here", count=len(here), after_s=self.config.drain_s)
                break
            await asyncio.sleep(_TICK_S)
        self.done = True  # before the stop: the supervisor's end is then no failure (controller.app)
        if stop_server is not None:
            await stop_server()  # nothing runs on it now: its memory is free at once
        moved = sum(1 for e in seen.values() if e.on_peer is not None)
        failed = sum(1 for e in seen.values() if e.on_peer is None and (e.errored or e.stop is not None))
        outcome = DrainOutcome(moved, len(seen) - moved - failed, failed, round(time.monotonic() - t0, 3))
        log.warning(
            "drain.done",
            moved=outcome.moved,
            finished_here=outcome.finished_here,
            failed=outcome.failed,
            seconds=outcome.seconds,
        )
        return outcome

    def _move(self, entry: Inflight) -> None:
        """Send ``entry`` on its way to a peer if it can go, else leave it to finish here (once decided, left)."""
        if entry.on_peer is not None or entry.stays or entry.move.is_set():
            return
        ctx = entry.context
        movable = False
        if ctx is not None and self.state.drain_peers:
            t = ctx.transcript
            continued = t is not None and t.replayable and not t.done
            if entry.state in (Phase.QUEUED, Phase.UPSTREAM):
                movable = ctx.resend and not ctx.raw  # nothing answered yet: sent whole (not a conversation)
            elif entry.state is Phase.STREAMING:
                movable = continued
            elif entry.state is Phase.REPLAYING:  # waiting for this server to come back: a peer instead
                movable = continued if ctx.response is not None else ctx.resend and not ctx.raw
        if not movable:
            entry.stays = True
            self.metrics.moves.labels(outcome="stayed").inc()
            return
        entry.peers = self.order()
        entry.move.set()
        if entry.state is not Phase.STREAMING:
            return
        if self.handover is not None and self.handover.enabled:
            # its cells go through a file: replay waits for it before it sends the continuation
            entry.handover = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._hand_over(entry))
            self._saving.add(task)
            task.add_done_callback(self._saving.discard)
            return
        if entry.upstream is not None:
            entry.upstream.close()  # the relay sees the stream end, and replay continues it on a peer

    async def _hand_over(self, entry: Inflight) -> None:
        assert self.handover is not None
        if not await self.handover.save(entry) and entry.upstream is not None:
            entry.upstream.close()
