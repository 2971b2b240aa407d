"""The poller: when to ask the server for ``GET /kv``, how long to wait for it, and who answered.

* Cadence: one iteration every ``loop.poll_interval_s``; at once when woken (poll_soon(): a request waits for
  admission, or an action timed out); after a failed poll, a back-off doubling from ``loop.backoff_initial_s`` up to
  ``loop.backoff_max_s``, never longer than half the server's lease (past it, the server would take its parked
  requests back from a controller it thinks is gone).
* Timeout: the server answers between two batches, so a poll may wait behind the longest batch it may run: the
  longer of the server's published step time (patch 24) and the next step's cells at its measured prompt rate,
  twice over, within ``upstream.poll_timeout_max_s``; the poll right after an action that timed out waits as long
  as that action could have (wait_longer()).
* Identity: a server that names its boot (patch 22) is a new process when the name changes, and what the loop knew
  of its tasks is forgotten then (their ids start again); only polls, and only after their own timeout, mark the
  server down. A server that does not name itself is taken as restarted when it comes back after being down.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Protocol

import structlog

from controller.loop.calls import ServerCalls
from controller.loop.recorder import Recorder
from controller.loop.state import LoopState
from controller.settings import Settings
from controller.upstream.client import UpstreamApiError, UpstreamError, UpstreamProtocolError, UpstreamUnavailable
from controller.upstream.models import KvSnapshot, SlotState

__all__ = ["Clock", "MonotonicClock", "Poller"]

log = structlog.get_logger("kvctl.loop")


class Clock(Protocol):
    """The poller's sense of time: a monotonic clock, and a wait that a wake-up cuts short (tests use a fake)."""

    def monotonic(self) -> float: ...

    async def wait(self, wake: asyncio.Event, timeout_s: float) -> None:
        """Return when ``wake`` is set or after timeout_s, whichever comes first."""
        ...


class MonotonicClock:
    def monotonic(self) -> float:
        return time.monotonic()

    async def wait(self, wake: asyncio.Event, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout_s)


class Poller:
    def __init__(
        self,
        settings: Settings,
        state: LoopState,
        calls: ServerCalls,
        recorder: Recorder,
        clock: Clock | None = None,
    ) -> None:
        self.settings = settings
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self.state = state
        self.calls = calls
        self.recorder = recorder
        self.wake = asyncio.Event()
        self._forget_pending = False
        self._lease_warned = False
        self._wait_at_least_s = 0.0

    # --- cadence ---------------------------------------------------------------------------------

    def poll_soon(self) -> None:
        """Poll now instead of at the next tick."""
        self.wake.set()

    def wait_longer(self, timeout_s: float) -> None:
        """The next poll waits at least timeout_s: an action that timed out may still be running on the server, which
        answers the poll only once it is done."""
        self._wait_at_least_s = max(self._wait_at_least_s, timeout_s)
        self.poll_soon()

    def max_backoff(self) -> float:
        limit = self.settings.loop.backoff_max_s
        kv = self.state.snapshot
        if kv is not None and kv.lease is not None and kv.lease.ttl_s > 0:
            # the server's lease may be shorter than the settings assumed: stay under half of it
            if limit >= kv.lease.ttl_s / 2:
                if not self._lease_warned:
                    log.warning("loop.lease_shorter", lease_s=kv.lease.ttl_s, backoff_max_s=limit)
                    self._lease_warned = True
                limit = kv.lease.ttl_s / 2 * 0.8
        return limit

    def next_backoff(self, backoff: float | None) -> float:
        initial = self.settings.loop.backoff_initial_s
        return min(initial if backoff is None else backoff * 2, self.max_backoff())

    async def run(self, iteration: Callable[[], Awaitable[bool]], pending: Callable[[], bool]) -> None:
        """Call iteration() at the cadence above, forever; pending() says that work is queued (no wait then)."""
        backoff: float | None = None
        while True:
            t0 = self.clock.monotonic()
            self.state.heartbeat_monotonic = time.monotonic()
            # cleared before the iteration: a poll_soon() while it runs wakes the next wait at once
            self.wake.clear()
            ok = await iteration()
            self.state.heartbeat_monotonic = time.monotonic()  # a long step is over: the wait that follows is none
            if ok:
                backoff = None
                delay = max(0.0, self.settings.loop.poll_interval_s - (self.clock.monotonic() - t0))
            else:
                backoff = self.next_backoff(backoff)
                delay = backoff
            self.state.backoff_s = backoff
            if not pending():
                await self.clock.wait(self.wake, delay)

    # --- one poll --------------------------------------------------------------------------------

    def timeout_s(self) -> float:
        """How long the next poll may take (see the module docstring), within loop.poll_timeout_max_s."""
        up = self.settings.upstream
        base = up.timeout_s
        kv = self.state.snapshot
        batch_s = 0.0
        if kv is not None:
            # the step time decays over iterations that only copy a park's slices (microseconds each): the next
            # step's batch at the prompt rate keeps the poll from timing out behind the first decode after them
            rates = kv.park_rates
            if rates.step_ms:
                batch_s = rates.step_ms / 1000
            if rates.prompt_tokens_per_s:
                batch_s = max(batch_s, kv.next_step.n_total_max / rates.prompt_tokens_per_s)
        timeout_s = min(base + 2 * batch_s, max(base, up.poll_timeout_max_s))
        return max(timeout_s, self._wait_at_least_s)

    async def poll(self) -> KvSnapshot:
        """GET /kv within timeout_s(); the answer, or its absence, is recorded before it returns (or raises)."""
        if self._forget_pending:
            self.state.history.clear()
            self._forget_pending = False
        timeout_s = self.timeout_s()
        self._wait_at_least_s = 0.0
        try:
            kv = await self.calls.timed(self.calls.client.get_kv(timeout_s=timeout_s), timeout_s, action=False)
        except UpstreamError as e:
            if not isinstance(e, UpstreamUnavailable):
                self.state.last_answer_monotonic = time.monotonic()  # an API error is an answer: not hung
            self._down(e)
            raise
        self.state.last_answer_monotonic = time.monotonic()
        self._up(kv)
        return kv

    # --- identity --------------------------------------------------------------------------------

    def forget(self, why: str) -> None:
        """Drop what the loop knows about the server's tasks (it restarted); done before the next poll."""
        self._forget_pending = True
        self.recorder.forgot(why)

    def _forget_now(self, why: str) -> None:
        if self.state.history:
            self.state.history.clear()
            self.recorder.forgot(why)

    def _down(self, e: UpstreamError) -> None:
        self.recorder.poll_failed(e)
        self.state.upstream_up = False
        self.state.last_error = str(e)
        status = e.status if isinstance(e, UpstreamApiError | UpstreamProtocolError) else None
        self.state.last_error_status = status
        self.state.error_answers = self.state.error_answers + 1 if status is not None and status != 503 else 0

    def _up(self, kv: KvSnapshot) -> None:
        prev = self.state.snapshot
        prev_boot = prev.server.boot_id if prev is not None and prev.server is not None else None
        boot = kv.server.boot_id if kv.server is not None else None
        came_up = not self.state.upstream_up
        if prev_boot is not None and boot is not None and prev_boot != boot:
            # a new process: its task ids start again, so what we knew would be misapplied (whether or not a poll
            # failed in between)
            self._forget_now("the server restarted (new boot id)")
        if came_up:
            if boot is None and self.state.polls > 0:
                self._forget_now("upstream came back")  # one that does not say who it is may have restarted
        elif prev is not None and (prev.n_cells, prev.n_slots) != (kv.n_cells, kv.n_slots):
            self._forget_now("the server's pool changed")
        self.state.upstream_up = True
        self.state.last_error = None
        self.state.last_error_status = None
        self.state.error_answers = 0
        self.state.polls += 1
        self.state.last_poll_monotonic = time.monotonic()
        self.state.snapshot = kv
        self.recorder.poll_answered(kv, came_up=came_up)
        # a task that is gone (finished, cancelled, client went away) takes its pin and history along
        live = {s.id_task for s in kv.slots if s.id_task is not None}
        for task in [t for t in self.state.history if t not in live]:
            del self.state.history[task]
        # a manual park that timed out: the server's word now says whether it happened, and the pin with it
        parked = {s.id_task for s in kv.slots if s.state is SlotState.PARKED}
        for task in self.state.unconfirmed_pins:
            h = self.state.history.get(task)
            if h is not None and h.pinned and task not in parked:
                self.state.history[task] = replace(h, pinned=False)
                self.recorder.pin_dropped(task)
        self.state.unconfirmed_pins.clear()
