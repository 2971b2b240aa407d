"""Calls from the control loop to the server, each made within its own timeout (controller.loop.poller sizes a poll's,
controller.loop.actuator a park's or resume's).

Until a call returns, the loop counts as busy, not stalled (the admin API's liveness and the systemd watchdog ask
ControlLoop.stalled()). A call that may outlast half the server's lease keeps the lease meanwhile: ``GET /health``
with the lease header, which the server answers without its main loop (patch 23). The end of a park or resume is
noted for the hang check, which counts the server's silence from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import TypeVar

from controller.loop.state import LoopState
from controller.upstream.client import UpstreamClient, UpstreamError

__all__ = ["ServerCalls"]

_T = TypeVar("_T")

BUSY_SLACK_S = 1.0  # a call is answered a little after its timeout at worst (the event loop's own delay)


class ServerCalls:
    def __init__(self, client: UpstreamClient, state: LoopState, lease_s: float) -> None:
        self.client = client
        self.state = state
        self.lease_s = lease_s
        self.last_action_timeout_s = 0.0
        """The timeout of the last park or resume: how long a poll right after one that timed out waits."""

    async def timed(self, call: Awaitable[_T], timeout_s: float, *, action: bool) -> _T:
        """Await one call to the server, made with timeout_s (see the module docstring)."""
        self.state.busy_until_monotonic = time.monotonic() + timeout_s + BUSY_SLACK_S
        if action:
            self.last_action_timeout_s = timeout_s
        keeper = None
        if timeout_s > self.lease_s / 2:
            keeper = asyncio.create_task(self._keep_lease(self.lease_s / 3), name="kvctl lease keeper")
        try:
            return await call
        finally:
            self.state.busy_until_monotonic = 0.0
            if action:
                self.state.last_action_end_monotonic = time.monotonic()
            if keeper is not None:
                keeper.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await keeper

    async def _keep_lease(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            with contextlib.suppress(UpstreamError):
                await self.client.health()
