"""Relayed: the requests that are not generations, from the coordinator's dispatch to the relay.

Held while the server comes back (the model list answered from the last answer), conversation streams and control
requests acted on only for the key that started them, and everything else relayed as it is.
"""

from __future__ import annotations

from aiohttp import web

from controller.errors import Code
from controller.proxy.admission import AdmissionGate
from controller.proxy.config import ProxyConfig
from controller.proxy.context import RequestContext
from controller.proxy.forward import Upstream
from controller.proxy.framing import Errors
from controller.proxy.inspection import BadRequest
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.owners import Ownership
from controller.proxy.relay import Relay
from controller.proxy.restart import ModelsCache
from controller.proxy.routes import Kind, Route

__all__ = ["Relayed"]


class Relayed:
    def __init__(
        self,
        config: ProxyConfig,
        gate: AdmissionGate,
        upstream: Upstream,
        relay: Relay,
        errors: Errors,
        metrics: ProxyMetrics,
        ownership: Ownership,
        models_cache: ModelsCache,
    ) -> None:
        self.config, self.gate, self.upstream, self.relay = config, gate, upstream, relay
        self.errors, self.metrics, self.ownership, self.models_cache = errors, metrics, ownership, models_cache
        self._held = 0  # requests other than generations waiting in hold() for the server
        self.passing = 0  # requests other than generations relayed now

    async def hold(self, ctx: RequestContext) -> web.StreamResponse | None:
        """A request that is not a generation, while the server is coming back: the model list as the server last
        answered it, else a wait for the server (proxy.replay_timeout_s). None: go on now."""
        if self.gate.down_since is None:
            return None
        route, request = ctx.route, ctx.request
        if route is not None and self.relay.cacheable(ctx):
            cached = self.models_cache.response(route.path, await self.errors.cors(request))
            if cached is not None:
                self.metrics.count(request.path, 200)
                return cached
        if self._held >= self.config.queue_depth:
            # as many wait here as may wait for admission: past it, what a full queue answers
            message = f"{self._held} requests are waiting for llama-server to come back"
            return await self.errors.service_unavailable(request, message, Code.QUEUE_FULL)
        self._held += 1
        try:
            up = await self.gate.wait_up(self.config.replay_timeout_s)
        finally:
            self._held -= 1
        if up:
            return None
        if self.gate.refuse_reason is not None:
            return await self.errors.service_unavailable(request, self.gate.refuse_reason, self.gate.refuse_code)
        return await self.errors.restarting(request)

    async def passthrough(self, ctx: RequestContext, body: bytes | None = None) -> web.StreamResponse:
        """Anything that is not a generation: relayed as it is, streamed, with its encodings untouched."""
        self.passing += 1  # a drain stops the server only once these are answered too
        try:
            return await self._passthrough(ctx, body)
        finally:
            self.passing -= 1

    async def _passthrough(self, ctx: RequestContext, body: bytes | None) -> web.StreamResponse:
        request, route = ctx.request, ctx.route
        ctx.body = await request.read() if body is None else body
        # an asset probe (kvctl's keys, none given) carries no credential: the headers drop kvctl's keys
        ctx.headers = self.upstream.headers(ctx, generation=False)
        if ctx.slots_view or self.relay.cacheable(ctx):
            ctx.headers["Accept-Encoding"] = "identity"  # kvctl reads the answer (proxy/slots.py, proxy/restart.py)
        ctx.raw = route is not None and route.kind is Kind.CONVERSATION and request.method == "GET"
        return await self.relay.forward(ctx)

    async def scoped(self, ctx: RequestContext, route: Route) -> web.StreamResponse:
        """Conversation streams act only on what the same key started."""
        owner = ctx.ident.name if ctx.ident is not None else None
        if route.path == "/v1/streams/lookup":
            ctx.lookup_owner = owner
            return await self.passthrough(ctx)
        if route.path == "/v1/stream":
            ctx.query = self.ownership.scope_query(ctx.request.query_string, owner)
            # no body: cpp-httplib would read a form body's conv_id into the same parameters, past the check above
            return await self.passthrough(ctx, body=b"")
        return await self.passthrough(ctx)

    async def control(self, ctx: RequestContext) -> web.StreamResponse:
        """``/v1/chat/completions/control`` acts on a running completion by the id its client knows."""
        owner = ctx.ident.name if ctx.ident is not None else None
        try:
            body = self.ownership.scope_control(await ctx.request.read(), owner)
        except BadRequest as e:
            return await self.errors.kvctl_error(ctx.request, e.status, e.message, e.code)
        return await self.passthrough(ctx, body=body)
