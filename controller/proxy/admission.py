"""Admission: new generation requests wait in a bounded queue, by priority, while the policy says hold.

The gate is set by the control loop (from its latest /kv snapshot and the policy); the proxy
only reads it. Without a controller the gate stays open.

Besides the policy's hold, the gate knows the server's state: **coming back** (kvctl restarts the server it
spawned, the spawned server loads its model, an attached server that answered before stopped answering), when
new requests wait in the queue in their normal order, each for at most ``restart_timeout_s`` (the proxy's
``replay_timeout_s``) of the outage, then get :class:`RestartTimeout`; or **refused** (an attached server that never
answered, a spawned one the supervisor gave up on), when every request gets :class:`Refused` at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

from controller.priorities import INT32_MAX

HELD_POLL_S = 0.5
"""While the server is down and requests are held, how often they ask the control loop for a poll."""


class QueueFull(Exception):
    """The admission queue is at its depth: answer 503 with Retry-After."""


class QueueTimeout(Exception):
    """A request waited longer than the queue timeout."""


class RestartTimeout(Exception):
    """The server did not come back within the restart bound of this request's wait."""


class Refused(Exception):
    """The server is not coming back: every waiting request ends at once, with the gate's reason and code."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class AdmissionGate:
    """Open or held, with the reason, and how much the last snapshot had room for.

    The control loop updates it after every poll: how many requests may start (idle slots, and the
    reserve per request) and how many cells they may add below HIGH. The proxy takes one admission
    per request, with the cells its prompt is estimated to need. Requests admitted after the
    snapshot was asked for are not in it yet: they are taken off the new allowance. Waiters wake
    whenever an update may let one through.
    """

    def __init__(self) -> None:
        self._reason: str | None = None
        self._allowance: int | None = None  # None: no limit
        self._room: int | None = None  # cells; None: no limit
        self._empty = False
        self._min_priority: int | None = None  # requests below it wait: parked requests of theirs come back first
        self._admitted: collections.deque[tuple[float, int]] = collections.deque(maxlen=4096)  # (monotonic, cells)
        self._changed = asyncio.Event()
        self.refuse_reason: str | None = None
        """Set while new requests must be refused at once (the server is not coming back), with ``refuse_code``."""
        self.refuse_code: str = "upstream_unavailable"
        self.down_since: float | None = None
        """Monotonic time since which the server is coming back (restarting, loading); None while it answers."""
        self.on_wait: Callable[[], object] | None = None
        """Called when a request starts waiting: a fresh poll may open the gate sooner than the next tick."""

    @property
    def hold_reason(self) -> str | None:
        if self.down_since is not None:
            return "llama-server is restarting"
        if self._reason is not None:
            return self._reason
        if self._allowance is not None and self._allowance <= 0:
            return "as many requests started as the last poll had room for"
        return None

    @property
    def allowance(self) -> int | None:
        return self._allowance

    @property
    def room_cells(self) -> int | None:
        return self._room

    def update(
        self,
        hold_reason: str | None,
        allowance: int | None = None,
        as_of: float | None = None,
        *,
        room_cells: int | None = None,
        empty: bool = False,
        min_priority: int | None = None,
    ) -> None:
        """What the snapshot asked for at ``as_of`` (monotonic) had room for: ``allowance`` requests,
        ``room_cells`` cells; ``empty``: nothing resident, so one request starts whatever its size;
        ``min_priority``: the allowance is for requests of this priority or higher only (parked requests of lower
        ones wait; the others are restored first)."""
        if as_of is not None:
            unseen = [cells for t, cells in self._admitted if t >= as_of]
            if unseen:
                empty = False
                if allowance is not None:
                    allowance = max(0, allowance - len(unseen))
                if room_cells is not None:
                    room_cells = max(0, room_cells - sum(c + 1 for c in unseen))
        self._reason = hold_reason
        self._allowance = allowance
        self._room = room_cells
        self._empty = empty
        self._min_priority = min_priority
        if self.hold_reason is None:
            self._wake()

    def server_down(self, since: float | None = None) -> None:
        """The server is coming back: new requests wait (bounded) instead of being refused."""
        was = self.down_since, self.refuse_reason
        if self.down_since is None:
            self.down_since = time.monotonic() if since is None else since
        self.refuse_reason = None
        if was != (self.down_since, self.refuse_reason):
            self._wake()

    def refuse(self, reason: str, code: str) -> None:
        """The server is not coming back: every request, new or waiting, is refused at once with ``reason``."""
        changed = self.refuse_reason != reason
        self.refuse_reason, self.refuse_code, self.down_since = reason, code, None
        if changed:
            self._wake()

    def server_up(self) -> None:
        """The server answers: the policy's verdicts (``update``) decide again."""
        changed = self.down_since is not None or self.refuse_reason is not None
        self.down_since = None
        self.refuse_reason = None
        if changed:
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_up(self, timeout_s: float) -> bool:
        """Until the server answers again (True), is refused or ``timeout_s`` passes (False); at once when it
        answers now."""
        deadline = time.monotonic() + timeout_s
        while self.down_since is not None and self.refuse_reason is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.want_poll()  # the loop backs off while the server is down: a waiting request asks it to look
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, HELD_POLL_S)):
                    await self._changed.wait()
        return self.refuse_reason is None

    def take(self, cells: int = 0, priority: int = 0) -> bool:
        """One admission of a request whose prompt needs ``cells``, of (effective) ``priority``, if the gate lets it
        through now."""
        if self.hold_reason is not None:
            return False
        if self._min_priority is not None and priority < self._min_priority:
            return False
        if self._room is not None and cells + 1 > self._room and not self._empty:
            return False
        if self._allowance is not None:
            self._allowance -= 1
        if self._room is not None:
            self._room = max(0, self._room - cells - 1)
        self._empty = False
        self._admitted.append((time.monotonic(), cells))
        return True

    def admitted_since(self, as_of: float | None) -> int:
        """Requests admitted at or after ``as_of`` (monotonic; a snapshot's asking time): not in that snapshot yet."""
        if as_of is None:
            return 0
        return sum(1 for t, _ in self._admitted if t >= as_of)

    def wait_changed(self) -> Coroutine[Any, Any, Literal[True]]:
        """A wait for the next change, bound to the gate's state now: a change between this call and the first await
        of what it returns still ends the wait."""
        return self._changed.wait()

    def want_poll(self) -> None:
        if self.on_wait is not None:
            self.on_wait()


@dataclass(eq=False)
class _Waiter:
    fut: asyncio.Future[None]
    cells: int
    priority: int
    seq: int  # arrival order
    since: float  # the queue's clock when it arrived


class AdmissionQueue:
    """Requests waiting for the gate, admitted one at a time in order, as many as each poll has room for.

    The order: the highest priority first, first come first served within a priority; a request that has waited
    longer than ``max_wait_s`` counts as the highest priority present, so every wait is bounded whatever the
    priorities (among such requests, first come first served). The head holds back every request behind it,
    whatever their sizes: a large prompt is never starved by a stream of small ones, and a low-priority one only by
    requests of higher priority for at most ``max_wait_s``."""

    def __init__(
        self,
        gate: AdmissionGate,
        depth: int,
        timeout_s: float,
        max_wait_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
        restart_timeout_s: float = 120.0,
    ) -> None:
        self.gate = gate
        self.depth = depth
        self.timeout_s = timeout_s
        self.max_wait_s = max_wait_s
        self.restart_timeout_s = restart_timeout_s
        self._clock = clock
        self._waiters: list[_Waiter] = []
        self._seq = 0
        self._pump: asyncio.Task[None] | None = None
        self._reordered = asyncio.Event()  # the head may have changed without the gate changing

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _effective(self, w: _Waiter) -> int:
        """Its priority, or, once it has waited past max_wait_s, the highest there is (the policy counts it as the
        highest priority present, so the gate lets it past any parked request)."""
        return INT32_MAX if self._clock() - w.since > self.max_wait_s else w.priority

    def _head(self) -> _Waiter | None:
        waiters = [w for w in self._waiters if not w.fut.done()]
        if not waiters:
            return None
        now = self._clock()
        top = max(w.priority for w in waiters)

        def rank(w: _Waiter) -> tuple[int, int]:
            aged = now - w.since > self.max_wait_s
            return (-(top if aged else w.priority), w.seq)

        return min(waiters, key=rank)

    def head(self) -> tuple[int, int, float] | None:
        """The request admitted next: (its priority, the cells it needs, seconds it has waited); None when none
        waits. The priority is the request's own: one that has waited past ``max_wait_s`` is ahead of requests of
        higher priority here, and counting it as the highest present elsewhere is the caller's call (it has the
        seconds waited)."""
        w = self._head()
        if w is None:
            return None
        return w.priority, w.cells, max(0.0, self._clock() - w.since)

    async def admit(self, cells: int = 0, priority: int = 0) -> None:
        """Return when a request needing ``cells``, of ``priority``, may go upstream; raise QueueFull, QueueTimeout,
        RestartTimeout (the server did not come back in time) or Refused (it is not coming back)."""
        if self.gate.refuse_reason is not None:
            raise Refused(self.gate.refuse_reason, self.gate.refuse_code)
        if not self._waiters and self.gate.take(cells, priority):
            return
        if len(self._waiters) >= self.depth:
            raise QueueFull(f"admission queue is full ({self.depth} waiting)")
        self._seq += 1
        waiter = _Waiter(asyncio.get_running_loop().create_future(), cells, priority, self._seq, self._clock())
        self._waiters.append(waiter)
        self._ensure_pump()
        self._reordered.set()
        try:
            async with asyncio.timeout(self.timeout_s):
                await waiter.fut
        except TimeoutError:
            raise QueueTimeout(f"waited {self.timeout_s:.0f} s for admission") from None
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                self._reordered.set()

    def _ensure_pump(self) -> None:
        if self._pump is None or self._pump.done():
            self._pump = asyncio.get_running_loop().create_task(self._run(), name="kvctl-admission-pump")

    async def _run(self) -> None:
        # releases the head of the queue while the gate lets requests through; otherwise waits for the gate to
        # change, or for the head to change (an arrival of higher priority, a head that left), asking for a fresh
        # poll once per head (after that, the loop's own cadence: a head that does not fit must not turn polling
        # into a busy loop)
        asked: _Waiter | None = None
        asked_at = 0.0
        while True:
            self._waiters = [w for w in self._waiters if not w.fut.done()]  # clients that left, or timed out
            next_expiry = self._end_held()
            head = self._head()
            if head is None:
                return
            if self.gate.take(head.cells, self._effective(head)):
                self._waiters.remove(head)
                head.fut.set_result(None)
                continue
            down = self.gate.down_since is not None
            if asked is not head or (down and time.monotonic() - asked_at >= HELD_POLL_S):
                # while the server is down the loop backs off (up to loop.backoff_max_s): held requests ask it to
                # look every HELD_POLL_S, so the gate opens as soon as the server answers
                asked, asked_at = head, time.monotonic()
                self.gate.want_poll()
            self._reordered.clear()
            gate_changed = asyncio.ensure_future(self.gate.wait_changed())
            reordered = asyncio.ensure_future(self._reordered.wait())
            try:
                timeout = None if next_expiry is None else max(0.0, next_expiry - self._clock())
                if down:
                    timeout = HELD_POLL_S if timeout is None else min(timeout, HELD_POLL_S)
                await asyncio.wait((gate_changed, reordered), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gate_changed.cancel()
                reordered.cancel()

    def _end_held(self) -> float | None:
        """While the server is refused, every waiter ends; while it is coming back, those held past the restart
        bound (counted from their arrival or the outage's start, whichever is later) end. Returns when the next
        held waiter's bound ends (the queue's clock), None when none is held."""
        gate = self.gate
        if gate.refuse_reason is not None:
            for w in self._waiters:
                if not w.fut.done():
                    w.fut.set_exception(Refused(gate.refuse_reason, gate.refuse_code))
            return None
        if gate.down_since is None:
            return None
        # the gate's clock is the monotonic one; the queue's may be a test's: count the outage in the queue's
        down_for = time.monotonic() - gate.down_since
        start = self._clock() - down_for
        now = self._clock()
        nearest: float | None = None
        for w in self._waiters:
            if w.fut.done():
                continue
            expiry = max(w.since, start) + self.restart_timeout_s
            if expiry <= now:
                message = f"llama-server is restarting and did not come back within {self.restart_timeout_s:g} s"
                w.fut.set_exception(RestartTimeout(message))
            elif nearest is None or expiry < nearest:
                nearest = expiry
        return nearest

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            try:
                await self._pump
            except asyncio.CancelledError:
                pass
