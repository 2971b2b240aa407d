"""Admission, the stage: a generation waits here, in priority order, until the gate lets it through.

One :meth:`Admission.wait` for every generation: through at once when nobody waits and the gate has room, else in
the queue (``controller.proxy.admission``). A streaming client waiting past ``proxy.queue_grace_s`` gets SSE
headers and heartbeats, so neither it nor a reverse proxy in between times out; kvctl ending the request (a
shutdown) ends the wait. A resumable (conversation) stream keeps its place when its client leaves: the server's
contract is that it goes on generating, and the WebUI finds it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from controller.errors import Code
from controller.proxy.admission import AdmissionGate, AdmissionQueue, QueueFull, QueueTimeout, Refused, RestartTimeout
from controller.proxy.config import ProxyConfig
from controller.proxy.context import RequestContext
from controller.proxy.forward import Upstream
from controller.proxy.framing import Errors
from controller.proxy.inspection import GenerationBody
from controller.proxy.metrics import ProxyMetrics
from controller.proxy.writer import Writer

__all__ = ["Admission", "AdmissionRefused"]


class AdmissionRefused(Exception):
    """Queue full, timed out, or ended by kvctl while waiting."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


_QUEUE_ENDS = (QueueFull, QueueTimeout, RestartTimeout, Refused)


def _refused(e: Exception) -> AdmissionRefused:
    if isinstance(e, Refused):
        return AdmissionRefused(e.message, e.code)
    if isinstance(e, RestartTimeout):
        return AdmissionRefused(str(e), Code.SERVER_RESTARTING)
    return AdmissionRefused(str(e), Code.QUEUE_FULL if isinstance(e, QueueFull) else Code.QUEUE_TIMEOUT)


class Admission:
    def __init__(
        self,
        config: ProxyConfig,
        gate: AdmissionGate,
        queue: AdmissionQueue,
        metrics: ProxyMetrics,
        writer: Writer,
        errors: Errors,
        upstream: Upstream,
    ) -> None:
        self.config = config
        self.gate = gate
        self.queue = queue
        self.metrics = metrics
        self.writer = writer
        self.errors = errors
        self.upstream = upstream
        self._orphans: set[asyncio.Future[None]] = set()  # conversation requests whose client left while queued

    async def wait(self, ctx: RequestContext, body: GenerationBody, priority: int) -> None:
        """Return once admitted; AdmissionRefused otherwise. ``ctx.response`` is set when the client got SSE
        headers while it waited."""
        cells = body.cells(self.config.reserve_cells)
        if self.gate.refuse_reason is not None:
            raise AdmissionRefused(self.gate.refuse_reason, self.gate.refuse_code)
        if self.queue.queued == 0 and self.gate.take(cells, priority):
            return
        self.metrics.queued.inc()
        admit = asyncio.ensure_future(self.queue.admit(cells, priority))
        if body.conversation:
            await self._keep_place(ctx, admit)
        else:
            await self._heartbeating(ctx, admit, body.stream)

    async def _keep_place(self, ctx: RequestContext, admit: asyncio.Future[None]) -> None:
        """A resumable stream's wait: a client that leaves while it is queued leaves it queued, and once admitted
        it is sent, and the server generates into its stream buffer."""
        admit.add_done_callback(lambda _: self.metrics.queued.dec())
        try:
            await asyncio.shield(admit)
        except _QUEUE_ENDS as e:
            raise _refused(e) from e
        except asyncio.CancelledError:
            request = ctx.request
            task = asyncio.ensure_future(
                self._send_orphan(admit, request.method, self.upstream.url(ctx), ctx.body, ctx.headers)
            )
            self._orphans.add(task)
            task.add_done_callback(self._orphans.discard)
            raise

    async def _send_orphan(
        self, admit: asyncio.Future[None], method: str, url: str, body: bytes, headers: dict[str, str]
    ) -> None:
        with contextlib.suppress(*_QUEUE_ENDS):
            await admit
            await self.upstream.send_detached(method, url, body, headers)

    async def _heartbeating(self, ctx: RequestContext, admit: asyncio.Future[None], stream: bool) -> None:
        assert ctx.entry is not None
        entry = ctx.entry
        moving = asyncio.ensure_future(entry.move.wait())
        try:
            deadline = time.monotonic() + self.config.queue_grace_s
            while True:
                wait = deadline - time.monotonic() if ctx.response is None else self.config.heartbeat_s
                either: set[asyncio.Future[Any]] = {admit, entry.ended, moving}
                done, _ = await asyncio.wait(either, timeout=max(0.0, wait), return_when=asyncio.FIRST_COMPLETED)
                if entry.ended.done():
                    raise AdmissionRefused(*self.errors.end_message(entry.ended.result()))
                if moving.done():
                    return  # a drain sends it to a peer whole (controller.proxy.drain)
                if done:
                    try:
                        admit.result()
                    except _QUEUE_ENDS as e:
                        raise _refused(e) from e
                    return
                if not stream:
                    deadline = float("inf")
                    continue
                if ctx.response is None:
                    ids = {"X-Request-Id": entry.client_request_id or entry.request_id}
                    await self.writer.prepare_sse(ctx, {**await self.errors.cors(ctx.request), **ids})
                await self.writer.heartbeat(ctx, "server restarting" if self.gate.down_since is not None else "queued")
        finally:
            moving.cancel()
            if not admit.done():
                admit.cancel()
            elif not admit.cancelled():
                admit.exception()  # ended by kvctl as the queue ended it too: the queue's reason is read, not lost
            self.metrics.queued.dec()

    def close(self) -> None:
        for task in list(self._orphans):
            task.cancel()
