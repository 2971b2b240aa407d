"""What one request carries through the stages, and how its stream can end.

A :class:`RequestContext` is made per request by the coordinator (``proxy/app.py``) and passed to every stage, so
that no stage takes the request's values one parameter at a time. An :class:`Inflight` entry is what kvctl can end
from outside the request (a hung server, a shutdown, a failed server): :class:`Stop` says why. How a stream's
response ended, seen from the relay, is an :data:`End`.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import aiohttp
from aiohttp import web

from controller.keys import Identity
from controller.proxy.routes import Kind, Route
from controller.proxy.transcript import Transcript

__all__ = [
    "Broken",
    "End",
    "Inflight",
    "Phase",
    "RequestContext",
    "ServerState",
    "Silence",
    "Stop",
    "Tracker",
    "Truncated",
    "priority_var",
    "request_id_var",
]

# what the access log line names: set by the generation path, read when the handler ends
request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvctl_request_id", default=None)
priority_var: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvctl_priority", default=None)


class Stop(StrEnum):
    """Why kvctl ended a request itself."""

    SHUTDOWN = "shutdown"  # the drain ran out
    FAILED = "failed"  # the supervisor gave up on the server
    HUNG = "timeout"  # the server stopped answering before the response started
    REPLACED = "replaced"  # a planned restart with another model: it cannot be continued


class Phase(StrEnum):
    """Where a tracked request is: what kvctl may end it for (end_waiting ends those sent and not answered)."""

    QUEUED = "queued"
    UPSTREAM = "upstream"  # sent, waiting for the response to start
    STREAMING = "streaming"
    REPLAYING = "replaying"  # waiting for a restarted server


@dataclass(frozen=True, slots=True)
class Truncated:
    """The server's response ended (before its final event, when a transcript says so)."""

    def __str__(self) -> str:
        return "the server's response ended before its final event"


@dataclass(frozen=True, slots=True)
class Broken:
    """The connection to the server broke mid-response."""

    error: str

    def __str__(self) -> str:
        return self.error


@dataclass(frozen=True, slots=True)
class Silence:
    """No byte for ``upstream_read_timeout_s``."""

    def __str__(self) -> str:
        return "timeout"


End = Truncated | Broken | Silence
"""How a response ended under the relay; ``str()`` of each is what the logs have always said of it."""


@dataclass(eq=False)
class Inflight:
    """A request as kvctl can end it from outside: a drain, a failed or hung server."""

    request_id: str
    client_request_id: str | None
    route: str
    t_start: float
    state: Phase = Phase.QUEUED
    key: str | None = None  # the name of the kvctl key that sent it (GET /slots shows a tenant its own)
    sent_epoch: int = -1  # the server's restart count when it was last sent (a planned restart counts the moved)
    ended: asyncio.Future[Stop] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    """Set (to the reason) when kvctl ends the request itself: a hung server, a shutdown."""
    upstream: aiohttp.ClientResponse | None = None
    context: RequestContext | None = None  # the request itself (a drain reads what it can move)
    peers: tuple[str, ...] = ()
    """A drain's peers for this request, in the order to try them (set before ``move`` is)."""
    move: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by a drain: go to a peer (a queued request whole, a stream continued from its ids)."""
    on_peer: str | None = None  # the peer that took it
    stays: bool = False  # a drain left it here: it cannot move, or no peer took it
    handover: asyncio.Future[str | None] | None = None
    """A drain's handover file of its cells (controller.proxy.handover), once saved; None: none was made."""
    errored: bool = False  # its client got an error (an error event, or an error answer kvctl wrote)

    def end(self, reason: Stop) -> None:
        if not self.ended.done():
            self.ended.set_result(reason)
        if self.upstream is not None:
            self.upstream.close()  # a pending read raises ClientConnectionError at once

    @property
    def stop(self) -> Stop | None:
        return self.ended.result() if self.ended.done() else None


class Tracker:
    """The requests kvctl may end from outside: generations (by request id) and other requests still waiting for
    the server's response to start."""

    def __init__(self) -> None:
        self.inflight: dict[str, Inflight] = {}
        self.relays: set[Inflight] = set()

    def end(self, reason: Stop, phase: Phase | None = None) -> int:
        """End every tracked request (in ``phase``, when given); returns how many."""
        entries = [e for e in (*self.inflight.values(), *self.relays) if phase is None or e.state == phase]
        for entry in entries:
            entry.end(reason)
        return len(entries)

    def end_sent(self, reason: Stop) -> int:
        """End every generation sent to the server (a planned restart with another model: ``server_replaced``);
        those still queued go on."""
        entries = [e for e in self.inflight.values() if e.state is not Phase.QUEUED]
        for entry in entries:
            entry.end(reason)
        return len(entries)


@dataclass
class ServerState:
    """What the coordinator knows of the server beyond one request, shared by the stages."""

    failed: str | None = None
    """Why the spawned server is not coming back (the supervisor gave up); None while it may."""
    restarts: Callable[[], int] | None = None
    """The supervisor's restart count when kvctl spawned the server: a hung server's streams wait for its restart."""
    draining: bool = False
    drain_peers: tuple[str, ...] = ()
    """While a drain to peers runs: the peers that can take requests (new generations go to them)."""
    comes_back: Callable[[], bool] | None = None
    """Whether a server that does not answer now is expected back (spawned and not given up on, or attached and
    answered before); set by the App. None (a proxy without a controller): it is not, and is answered at once."""

    def expected_back(self) -> bool:
        return self.failed is None and self.comes_back is not None and self.comes_back()


@dataclass(eq=False)
class RequestContext:
    """One request on its way through the stages."""

    request: web.Request
    route: Route | None
    ident: Identity | None = None
    request_id: str | None = None  # kvctl's, on a generation (the server echoes it in /slots)
    client_request_id: str | None = None  # the client's X-Request-Id, given back in its place
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)  # for the server
    owner: str | None = None  # the key whose completion ids this stream's are (several keys only)
    lookup_owner: str | None = None  # POST /v1/streams/lookup: only this key's conversations
    query: str | None = None  # the query string to send instead of the client's
    raw: bool = False  # relayed byte for byte, nothing of kvctl's own (a conversation stream)
    asset_probe: bool = False  # kvctl's keys and none given: the server's 404 becomes a 401
    slots_view: bool = False  # GET /slots: the server's answer as this client may see it (proxy/slots.py)
    resend: bool = False  # sent again when the server died before answering (replay is on)
    waited: bool = False  # waited proxy.replay_timeout_s for a server that did not come back
    entry: Inflight | None = None  # what kvctl can end from outside
    response: web.StreamResponse | None = None  # the client's, once prepared (early: by admission's heartbeats)
    transcript: Transcript | None = None  # what a replay continues from
    on_response: Callable[[], None] | None = None  # called once the server's response has started
    # under the keeper (controller.proxy.takeover): the server's stream of this request outlives this worker
    conv_prefix: str | None = None  # what its conversation ids begin with (from the keeper's secret, never shown)
    conv: str | None = None  # the conversation id of the stream sent or attached last
    again: bool = False  # the keeper sent it again: the worker before this one had it
    attached: bool = False  # relayed from the server's stream buffer (GET /v1/stream), not a response of its own
    skip_tokens: int = 0  # what the client has of that stream already, in token ids: not relayed again

    @property
    def label(self) -> str:
        """The route label of kvctl_proxy_requests: the path of a known route, else "other"."""
        return self.request.path if self.route is not None else "other"

    @property
    def generation(self) -> bool:
        return self.route is not None and self.route.kind is Kind.GENERATION

    def track(self, route: str, state: Phase = Phase.QUEUED) -> Inflight:
        """A new entry for this request, started now."""
        self.entry = Inflight(self.request_id or "", self.client_request_id, route, time.monotonic(), state)
        self.entry.context = self
        return self.entry
