"""Writing to the client: SSE headers, bytes under the write timeout, heartbeat comments.

Every byte kvctl sends a client on a started response goes through :meth:`Writer.write`, so a client that stops
reading is cut off in one place, whichever stage was writing.
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from multidict import CIMultiDict

from controller.proxy.config import ProxyConfig
from controller.proxy.context import RequestContext
from controller.proxy.metrics import ProxyMetrics

__all__ = ["Writer"]


class Writer:
    def __init__(self, config: ProxyConfig, metrics: ProxyMetrics) -> None:
        self.config = config
        self.metrics = metrics

    async def prepare_sse(self, ctx: RequestContext, headers: dict[str, str] | CIMultiDict[str]) -> web.StreamResponse:
        """Start the client's event stream; it is the request's response from here on."""
        resp = web.StreamResponse(status=200, headers=headers)
        resp.content_type = "text/event-stream"
        resp.headers["Cache-Control"] = "no-cache"
        resp.headers["X-Accel-Buffering"] = "no"
        await resp.prepare(ctx.request)
        ctx.response = resp
        return resp

    async def write(self, ctx: RequestContext, data: bytes) -> None:
        assert ctx.response is not None
        try:
            async with asyncio.timeout(self.config.write_timeout_s):
                await ctx.response.write(data)
        except TimeoutError:
            # a stalled client: cut it off rather than hold the slot for it
            self.metrics.stream_errors.labels(stage="client_stalled").inc()
            abort(ctx.request)
            raise ConnectionResetError("client stalled") from None

    async def heartbeat(self, ctx: RequestContext, why: str) -> None:
        self.metrics.heartbeats.inc()
        await self.write(ctx, f": kvctl keep-alive ({why})\n\n".encode())


def abort(request: web.Request) -> None:
    """Close the client's connection at once (a client that counts bytes then resumes where it stopped)."""
    if request.transport is not None:
        request.transport.abort()
