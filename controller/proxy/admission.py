"""Admission: new generation requests wait in a bounded FIFO while the policy says hold.

The gate is set by the control loop (from its latest /kv snapshot and the policy); the proxy
only reads it. Without a controller the gate stays open.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass


class QueueFull(Exception):
    """The admission queue is at its depth: answer 503 with Retry-After."""


class QueueTimeout(Exception):
    """A request waited longer than the queue timeout."""


class AdmissionGate:
    """Open or held, with the reason, and how many requests the last snapshot had room for.

    The control loop updates it after every poll; the proxy takes one admission per request.
    Requests admitted after the snapshot was asked for are not in it yet: they are taken off the
    new allowance. Waiters wake whenever an update may let one through.
    """

    def __init__(self) -> None:
        self._reason: str | None = None
        self._allowance: int | None = None  # None: no limit
        self._admitted: collections.deque[float] = collections.deque(maxlen=4096)  # monotonic times
        self._changed = asyncio.Event()
        self.refuse_reason: str | None = None
        """Set while new requests must be refused at once (the server is down or not answering)."""
        self.on_wait: Callable[[], object] | None = None
        """Called when a request starts waiting: a fresh poll may open the gate sooner than the next tick."""

    @property
    def hold_reason(self) -> str | None:
        if self._reason is not None:
            return self._reason
        if self._allowance is not None and self._allowance <= 0:
            return "as many requests started as the last poll had room for"
        return None

    @property
    def allowance(self) -> int | None:
        return self._allowance

    def update(self, hold_reason: str | None, allowance: int | None = None, as_of: float | None = None) -> None:
        """``allowance``: new requests the snapshot taken at ``as_of`` (monotonic) had room for."""
        if allowance is not None and as_of is not None:
            unseen = sum(1 for t in self._admitted if t >= as_of)
            allowance = max(0, allowance - unseen)
        self._reason = hold_reason
        self._allowance = allowance
        if self.hold_reason is None:
            self._changed.set()
            self._changed = asyncio.Event()

    def take(self) -> bool:
        """One admission, if the gate lets one through now."""
        if self.hold_reason is not None:
            return False
        if self._allowance is not None:
            self._allowance -= 1
        self._admitted.append(time.monotonic())
        return True

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def want_poll(self) -> None:
        if self.on_wait is not None:
            self.on_wait()


@dataclass
class _Waiter:
    fut: asyncio.Future[None]


class AdmissionQueue:
    """FIFO of requests waiting for the gate; admitted in order, as many as each poll has room for."""

    def __init__(self, gate: AdmissionGate, depth: int, timeout_s: float) -> None:
        self.gate = gate
        self.depth = depth
        self.timeout_s = timeout_s
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._pump: asyncio.Task[None] | None = None

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def admit(self) -> None:
        """Return when the request may go upstream; raise QueueFull or QueueTimeout."""
        if not self._waiters and self.gate.take():
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
        # releases the head of the queue while the gate lets requests through; otherwise asks
        # for a fresh poll and waits for the gate to change
        while self._waiters:
            head = self._waiters[0]
            if head.fut.done():  # its client left or it timed out
                self._waiters.popleft()
                continue
            if self.gate.take():
                self._waiters.popleft()
                head.fut.set_result(None)
                continue
            self.gate.want_poll()
            await self.gate.wait_changed()

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            try:
                await self._pump
            except asyncio.CancelledError:
                pass
