"""The reverse proxy in front of the patched llama-server: the server's whole API, behind the server's own
authentication rules.

This module is the coordinator; each stage of a request's life has its own module, and every stage works on the
request's :class:`~controller.proxy.context.RequestContext`:

- ``frontdoor``: header and path checks, ``Expect``, ``GET /metrics``, authentication, CORS, draining;
- ``routes`` and ``inspection``: what the route is, what a generation's body says and how many cells it needs;
- ``owners``: with several keys, conversations and completions act only for the key that started them;
- ``waiting``: admission in priority order, heartbeats while queued (``admission``: the gate and the queue);
- ``forward``: the headers, the send, the response headers; ``replay``: sending again, continuing a stream;
- ``drain``, ``peers`` and ``handover``: a replica's requests moved to other kvctl replicas before its server stops;
- ``relay``: the response as it arrives, bytes or events; ``framing``: every error kvctl writes itself.

Generation routes get their effective priority, pass admission, get their own X-Request-Id (so the controller
knows which slot serves which stream: llama-server echoes it in /slots), the effective X-Priority, and heartbeats
while queued or parked; the controller's private routes are refused; everything else is relayed as it is. SSE
streams are relayed event by event, byte for byte; what kvctl itself says on a stream (a heartbeat, an error)
comes between complete events and in the framing the server uses on that route. Resumable (conversation) streams
are relayed byte for byte with nothing of kvctl's own. A client that hangs up cancels the upstream request at
once (handler_cancellation), except a conversation stream, which the server keeps generating.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from controller.errors import Code
from controller.keeper_link import KeeperLink
from controller.keys import Identity, KeyRing
from controller.priorities import priority_class
from controller.proxy.admission import AdmissionGate, AdmissionQueue
from controller.proxy.config import ProxyConfig
from controller.proxy.context import (
    Inflight,
    Phase,
    RequestContext,
    ServerState,
    Stop,
    Tracker,
    priority_var,
    request_id_var,
)
from controller.proxy.drain import DRAIN_GRACE_S, Drain
from controller.proxy.endpoint_metrics import EndpointMetrics
from controller.proxy.forward import Upstream
from controller.proxy.framing import Errors
from controller.proxy.frontdoor import AskServer, Cors, FrontDoor
from controller.proxy.handover import HANDOVER_HEADER, Handover
from controller.proxy.inspection import BadRequest, GenerationBody, read_generation
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.owners import Ownership
from controller.proxy.peers import Peers
from controller.proxy.priority import (
    PRIORITY_HEADER,
    InvalidPriority,
    Priority,
    PriorityRules,
    header_priority,
    resolve_priority,
)
from controller.proxy.relay import Relay, Reopen
from controller.proxy.relayed import Relayed
from controller.proxy.replay import Replay
from controller.proxy.restart import ModelsCache, loading_response
from controller.proxy.routes import Kind, Route, RouteTable
from controller.proxy.takeover import Takeover
from controller.proxy.transcript import ReplayMemory
from controller.proxy.waiting import Admission, AdmissionRefused
from controller.proxy.writer import Writer

__all__ = ["DRAIN_GRACE_S", "PROXY_KEY", "Proxy", "make_proxy_app"]

log = structlog.get_logger("kvctl.proxy")
access_log = structlog.get_logger("kvctl.access")

# routes polled many times a second: no access-log line
QUIET_PATHS = frozenset({"/health", "/v1/health", "/metrics"})


class Proxy:
    def __init__(self, config: ProxyConfig, gate: AdmissionGate, registry: CollectorRegistry) -> None:
        self.config = config
        self.gate = gate
        self.queue = AdmissionQueue(
            gate,
            config.queue_depth,
            config.queue_timeout_s,
            config.priority_max_wait_s,
            restart_timeout_s=config.replay_timeout_s,
        )
        self.priority_rules = PriorityRules(config.client_priority, config.objective_priorities)
        self.metrics = ProxyMetrics(registry)
        self.state = ServerState()
        self.tracker = Tracker()
        self.keys = KeyRing(config.api_keys)
        self.routes = RouteTable(urlsplit(config.upstream).path, config.predict_route)
        self.upstream = Upstream(config, self.keys, self.routes.api_prefix)
        self.replay_memory = ReplayMemory(config.replay_memory_bytes)
        self.ownership = Ownership(len(self.keys) > 1)
        writer = Writer(config, self.metrics)
        cors = Cors(self.upstream, gate)
        self.errors = Errors(config, self.metrics, self.routes, cors.headers, writer, self.state)
        self.front = FrontDoor(
            config, self.upstream, self.routes, self.keys, self.metrics, self.errors, self.state, gate
        )
        self.models_cache = ModelsCache()
        self.admission = Admission(config, gate, self.queue, self.metrics, writer, self.errors, self.upstream)
        self.replay = Replay(
            config, self.upstream, writer, self.metrics, self.state, self.replay_memory, self.ownership.completion_ids
        )
        self.relay = Relay(
            config, self.upstream, writer, self.errors, self.replay, self.ownership, self.tracker, self.metrics
        )
        self.relay.models_cache = self.models_cache
        self.peers = Peers(config, self.upstream)
        self.handover = Handover(config, self.upstream)
        self.replay.peers, self.replay.handover = self.peers, self.handover
        self.drainer = Drain(config, self.tracker, self.peers, self.state, self.metrics, self.handover)
        self.others = Relayed(
            config, gate, self.upstream, self.relay, self.errors, self.metrics, self.ownership, self.models_cache
        )
        self.drainer.others = lambda: self.others.passing
        self._active: set[asyncio.Task[Any]] = set()  # every handler running now
        self._idle = asyncio.Event()
        self._idle.set()
        self.link: KeeperLink | None = None
        self.takeover: Takeover | None = None

    def kept(self, link: KeeperLink) -> Takeover:
        """Run under the keeper: requests come through ``link``, streams outlive this worker."""
        self.link = link
        self.takeover = self.replay.takeover = Takeover(self, link)
        return self.takeover

    # what the App and the tests read and set
    @property
    def inflight(self) -> dict[str, Inflight]:
        """Generation requests, by request id."""
        return self.tracker.inflight

    @property
    def draining(self) -> bool:
        return self.state.draining

    @property
    def endpoint(self) -> EndpointMetrics | None:
        return self.front.endpoint

    @endpoint.setter
    def endpoint(self, value: EndpointMetrics | None) -> None:
        self.front.endpoint = value

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self, app: web.Application) -> None:
        await self.upstream.start()

    async def stop(self, app: web.Application) -> None:
        self.admission.close()
        await self.queue.close()
        await self.upstream.close()

    async def drain(self, timeout_s: float | None = None) -> int:
        """Refuse new requests (503), give the open ones ``timeout_s`` (proxy.drain_s) to finish, then end the rest
        with their protocol's error; returns how many were ended."""
        self.state.draining = True
        self.state.drain_peers = ()  # shutting down: new requests get 503, not a peer's relay cut at the deadline
        timeout = self.config.drain_s if timeout_s is None else timeout_s
        return await self.drainer.shutdown(timeout, self._idle, self._active)

    def fail(self, message: str) -> int:
        """The supervisor gave up on the server: every request that needs it is answered at once with ``message``
        (503, no Retry-After), and those already waiting (queued, waiting for a response or for a restart to replay
        on) end now; returns how many ended."""
        self.state.failed = message
        return self.tracker.end(Stop.FAILED)

    def priority_class_of(self, priority: int) -> str:
        """The priority_class label of a priority (high, normal, low): never the number itself."""
        return priority_class(priority, self.config.priority_high_at, self.config.priority_low_at)

    # --- handlers ------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._active.add(task)
        self._idle.clear()
        t0 = time.monotonic()
        request_id_var.set(None)
        priority_var.set(None)
        status = 499  # the client went away before an answer
        ident: Identity | None = None
        try:
            resp, ident = await self.dispatch(request)
            status = resp.status
            return resp
        except web.HTTPRequestEntityTooLarge:
            status = 413
            return await self.errors.kvctl_error(
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
                    request_id=request_id_var.get(),
                    key=ident.name if ident is not None else None,
                    priority=priority_var.get(),
                )

    async def dispatch(self, request: web.Request) -> tuple[web.StreamResponse, Identity | None]:
        refused = await self.front.screen(request)
        if refused is not None:
            return refused, None
        if request.method == "OPTIONS":
            # a CORS preflight: browsers send no credentials, and the server answers it before any check
            return await self.others.passthrough(RequestContext(request, None)), None
        route = self.routes.lookup(request.method, request.path)
        if self.front.is_metrics(request, route):
            return await self.front.endpoint_metrics(request), None
        if route is not None and route.kind is Kind.PUBLIC and self.gate.down_since is not None:
            # while the server comes back: its own answer while it loads, so a router sends elsewhere; a router that
            # probes asks the loop to look (it backs off while the server is down)
            self.gate.want_poll()
            self.metrics.count(request.path, 503)
            return loading_response(await self.errors.cors(request)), None
        ident = await self.front.authenticate(request)
        if isinstance(ident, AskServer):
            return await self.others.passthrough(RequestContext(request, None, asset_probe=True)), None
        if not isinstance(ident, Identity):
            return ident, None
        refused = await self.front.turn_away(request, route, ident)
        if refused is not None:
            return refused, ident
        ctx = RequestContext(request, route, ident)
        if route is not None and route.kind is Kind.GENERATION:
            return await self.generation(ctx, route), ident
        held = await self.others.hold(ctx)
        if held is not None:
            return held, ident
        if route is not None and route.kind is Kind.SLOTS:
            ctx.slots_view = True
        if route is not None and route.kind is Kind.CONTROL:
            return await self.others.control(ctx), ident
        if route is not None and route.kind is Kind.CONVERSATION and self.ownership.several_keys:
            return await self.others.scoped(ctx, route), ident
        return await self.others.passthrough(ctx), ident

    async def generation(self, ctx: RequestContext, route: Route) -> web.StreamResponse:
        """A request that takes cells: inspected, given its priority, admitted, then forwarded and relayed."""
        request, ident = ctx.request, ctx.ident
        ctx.client_request_id = request.headers.get("X-Request-Id")
        pair = self.link.pair(request) if self.link is not None else None
        ctx.request_id = f"kvctl-{uuid.uuid4().hex}" if pair is None else self.link.request_id(pair)  # type: ignore[union-attr]
        request_id_var.set(ctx.request_id)
        ctx.body = await request.read()
        try:
            body = read_generation(route, self.routes, request.headers, request.content_type, ctx.body)
            key = ident.key if ident is not None else None
            if ident is not None and ident.peer:
                # moved by a drain: the priority the other replica gave it, whatever the body asks
                value = header_priority(request.headers.getall(PRIORITY_HEADER, []))
                priority = Priority(value if value is not None else 0, "peer")
            else:
                priority = resolve_priority(body.fields, request.headers, key, self.priority_rules)
        except BadRequest as e:
            return await self.errors.kvctl_error(request, e.status, e.message, e.code)
        except InvalidPriority as e:
            return await self.errors.kvctl_error(request, 400, str(e), Code.INVALID_PRIORITY)
        priority_var.set(priority.value)
        if pair is not None:
            self.link.taken(pair)  # type: ignore[union-attr]
        ctx.headers = self.upstream.headers(ctx, generation=True)
        ctx.headers[PRIORITY_HEADER] = str(priority.value)
        if body.malformed:
            # the server answers it at once, exactly as it would without kvctl; it takes no cells, so it must not
            # wait in the admission queue for a slot it would never use
            return await self.relay.forward(ctx)
        if self.gate.refuse_reason is not None:
            return await self.errors.service_unavailable(request, self.gate.refuse_reason, self.gate.refuse_code)
        ctx.owner = ident.name if ident is not None and self.ownership.several_keys else None
        if body.conversation and ctx.owner is not None and not self.ownership.claim(body.conversation, ctx.owner):
            return await self.errors.kvctl_error(
                request, 409, "this conversation id belongs to another key", Code.CONVERSATION_TAKEN
            )
        self.replay.begin(ctx, body)
        # a resumable stream's bytes are counted by its client: nothing of kvctl's own goes into it
        ctx.raw = bool(body.conversation)
        if pair is not None and not body.conversation and not body.predict:
            # on the server as a conversation: a stream's bytes, or a non-streamed answer (patch 0047), outlive this
            # worker, and the next attaches to them instead of sending the request again
            ctx.conv_prefix, ctx.again = self.link.conv_prefix(pair), pair.again  # type: ignore[union-attr]
        return await self.admitted(ctx, body, priority)

    def _track(self, ctx: RequestContext, body: GenerationBody, priority: Priority, event: str) -> Inflight:
        assert ctx.request_id is not None
        entry = ctx.track(body.route.path)
        entry.key = ctx.ident.name if ctx.ident is not None else None
        self.inflight[ctx.request_id] = entry
        self.metrics.inflight.inc()
        log.info(
            event,
            request_id=ctx.request_id,
            client_request_id=ctx.client_request_id,
            route=body.route.path,
            stream=body.stream,
            conversation=bool(body.conversation),
            priority=priority.value,
            priority_source=priority.source,
        )
        return entry

    def _untrack(self, ctx: RequestContext, entry: Inflight) -> None:
        assert ctx.request_id is not None
        if ctx.transcript is not None:
            ctx.transcript.release()
        if entry.handover is not None and entry.handover.done():
            self.handover.discard(entry.handover.result())  # a file no move used (the stream ended first)
        if ctx.conv is not None and self.takeover is not None:
            # ended here (done, its client left, kvctl ended it): so on the server, whose buffer of it goes too
            self.takeover.end_session(ctx.conv)
        if self.inflight.get(ctx.request_id) is entry:
            del self.inflight[ctx.request_id]
        self.metrics.inflight.dec()

    async def resumed(
        self, ctx: RequestContext, body: GenerationBody, priority: Priority, reopen: Reopen
    ) -> web.StreamResponse:
        """A stream a previous worker had begun (controller.proxy.takeover): from the server's stream of it on."""
        entry = self._track(ctx, body, priority, "request.resumed")
        entry.state = Phase.UPSTREAM
        try:
            return await self.relay.forward(ctx, reopen)
        finally:
            self._untrack(ctx, entry)

    async def admitted(self, ctx: RequestContext, body: GenerationBody, priority: Priority) -> web.StreamResponse:
        """The generation from its place in the admission queue to the end of its response."""
        assert ctx.request_id is not None
        entry = self._track(ctx, body, priority, "request.start")
        try:
            t_queue = time.monotonic()
            if self.state.draining and ctx.raw:
                # a resumable conversation lives in this server's buffer, which is about to stop
                message = "kvctl is draining to its peers; send the conversation to another replica"
                return await self.errors.kvctl_error(
                    ctx.request, 503, message, Code.SHUTTING_DOWN, self.config.retry_after_s
                )
            if self.state.drain_peers and self.state.draining:
                entry.peers = self.drainer.order()  # draining: it goes to a peer whole, not to this server
                entry.move.set()
            try:
                if not entry.move.is_set():
                    await self.admission.wait(ctx, body, priority.value)
            except AdmissionRefused as e:
                entry.errored = True
                return await self.errors.refuse(ctx, e.message, e.code)
            self.metrics.admission_wait.labels(priority_class=self.priority_class_of(priority.value)).observe(
                time.monotonic() - t_queue
            )
            entry.state = Phase.UPSTREAM
            if ctx.ident is not None and ctx.ident.peer and HANDOVER_HEADER in ctx.request.headers:
                claimed: int | None = None
                try:
                    claimed = await self.handover.restore(ctx)  # a moved stream's cells, read into a slot here
                    return await self.relay.forward(ctx)
                finally:
                    self.handover.release(claimed, ctx.request_id)
            return await self.relay.forward(ctx)
        finally:
            self._untrack(ctx, entry)


def make_proxy_app(
    config: ProxyConfig, gate: AdmissionGate | None = None, registry: CollectorRegistry | None = None
) -> web.Application:
    """The public listener's app. Run it with handler_cancellation=True (see run_site)."""
    proxy = Proxy(config, gate or AdmissionGate(), registry or CollectorRegistry())
    app = web.Application(client_max_size=config.max_body_bytes)
    app[PROXY_KEY] = proxy
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    app.router.add_route("*", "/{tail:.*}", proxy.handle, expect_handler=proxy.front.expect)
    return app


PROXY_KEY = web.AppKey("kvctl_proxy", Proxy)
