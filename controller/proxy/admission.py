"""Admission: new generation requests wait in a bounded FIFO while the policy says hold.

The gate is set by the control loop (from its latest /kv snapshot and the policy); the proxy
only reads it. Without a controller the gate stays open.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from dataclasses import dataclass


class QueueFull(Exception):
    """The admission queue is at its depth: answer 503 with Retry-After."""


class QueueTimeout(Exception):
    """A request waited longer than the queue timeout."""


class AdmissionGate:
    """Open or held, with the reason; waiters wake whenever it changes."""

    def __init__(self) -> None:
        self._reason: str | None = None
        self._changed = asyncio.Event()
        self.refuse_reason: str | None = None
        """Set while new requests must be refused at once (the server is down or not answering)."""

    @property
    def hold_reason(self) -> str | None:
        return self._reason

    def update(self, hold_reason: str | None) -> None:
        if hold_reason != self._reason:
            self._reason = hold_reason
            self._changed.set()
            self._changed = asyncio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()


@dataclass
class _Waiter:
    fut: asyncio.Future[None]


class AdmissionQueue:
    """FIFO of requests waiting for the gate; one is admitted per gate opening, in order."""

    def __init__(self, gate: AdmissionGate, depth: int, timeout_s: float, pace_s: float = 0.05) -> None:
        self.gate = gate
        self.depth = depth
        self.timeout_s = timeout_s
        self.pace_s = pace_s
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._pump: asyncio.Task[None] | None = None

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def admit(self) -> None:
        """Return when the request may go upstream; raise QueueFull or QueueTimeout."""
        if not self._waiters and self.gate.hold_reason is None:
            return
        if len(self._waiters) >= self.depth:
            raise QueueFull(f"admission queue is full ({self.depth} waiting)")
        waiter = _Waiter(asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        self._ensure_pump()
        try:
            async with asyncio.timeout(self.timeout_s):
                await waiter.fut
        except TimeoutError:
            raise QueueTimeout(f"waited {self.timeout_s:.0f} s for admission") from None
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run(), name="kvctl-admission-pump")

    async def _run(self) -> None:
        # releases the head of the queue while the gate is open, one per pace interval, so the
        # control loop's next poll sees the admitted request's cells before the next one goes
        while self._waiters:
            if self.gate.hold_reason is None:
                waiter = self._waiters.popleft()
                if not waiter.fut.done():
                    waiter.fut.set_result(None)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.pace_s):
                        await self.gate.wait_changed()
                continue
            await self.gate.wait_changed()

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            try:
                await self._pump
            except asyncio.CancelledError:
                pass
