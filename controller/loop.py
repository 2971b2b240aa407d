"""The control loop: poll ``GET /kv``, decide (controller.policy), act (park, resume), record.

One task owns the loop's state; manual overrides from the admin API are queued to it, so no lock
is needed. Every request to the server carries ``X-Park-Lease: 1`` (the client adds it): while
the loop polls, the server leaves auto-parked requests to it. When the server does not answer,
the loop backs off (never longer than half the lease) and reports ``upstream down``; after it
comes back, or after the supervisor restarted it, the loop forgets what it knew of its tasks. An
unexpected exception is logged and the loop restarted: it never takes the process down.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeVar

import structlog

from controller.gpu_room import NO_GPU, GpuBaseline, GpuRoom
from controller.metrics import Metrics
from controller.policy import (
    Action,
    ActionKind,
    Admission,
    Decision,
    PolicyConfig,
    PolicyInput,
    Reason,
    SkipReason,
    TaskHistory,
    admission,
    decide,
)
from controller.probes import GpuProbe, GpuReading, HostMemory, read_host_memory
from controller.settings import Settings
from controller.upstream import (
    KvSnapshot,
    ParkMode,
    ParkResult,
    ResumeResult,
    SlotState,
    UpstreamApiError,
    UpstreamClient,
    UpstreamError,
    UpstreamUnavailable,
)

__all__ = ["ControlLoop", "LoopState", "ManualAction", "ManualError", "ManualResult"]

log = structlog.get_logger("kvctl.loop")

_T = TypeVar("_T")

ASSUMED_COPY_BYTES_PER_S = 1e9  # a park's copy rate until the server has measured one
GPU_READ_INTERVAL_S = 1.0  # NVML reads block a thread; GPU memory does not move at the pool's pace

# parks the policy wants but a resource limit forbids; the server's safety net (--park-ram) still parks. A server
# that parks by recompute is never short of memory for a park: only an older one (swap only) meets the first two
_BLOCKING = {
    SkipReason.HOST_RAM: "the host's available RAM is under policy.host_ram_reserve_mib plus the snapshot: kvctl "
    "parks nothing until RAM is freed (a server with park by recompute would not need it)",
    SkipReason.BUDGET: "parked snapshots fill policy.snapshot_budget_mib (or the server's --park-ram)",
    SkipReason.PARKING_OFF: "the server parks by no mode (--no-park): only its idle-slot clearing relieves the pool",
}


class ManualAction(StrEnum):
    PARK = "park"
    RESUME = "resume"


@dataclass(frozen=True, slots=True)
class ManualResult:
    slot: int
    id_task: int
    action: ManualAction
    pinned: bool
    detail: str
    n_cells: int = 0
    n_bytes: int = 0
    mode: str | None = None
    """The mode the server parked (or had parked) it by; None where it does not say (an older server)."""


class ManualError(Exception):
    """A manual override that could not be carried out; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class _Command:
    action: ManualAction
    slot: int
    done: asyncio.Future[ManualResult]
    mode: ParkMode | None = None


@dataclass(slots=True)
class LoopState:
    """What the loop knows; read by the admin API and the tests, written only by the loop."""

    upstream_up: bool = False
    last_error: str | None = None
    polls: int = 0
    last_poll_monotonic: float | None = None
    last_answer_monotonic: float | None = None
    """When the server last answered a poll at all (an API error is an answer: its main loop is not hung)."""
    snapshot_asked_monotonic: float | None = None
    """When the current snapshot was asked for: what the proxy admitted after it is not in it."""
    heartbeat_monotonic: float = field(default_factory=time.monotonic)
    busy_until_monotonic: float = 0.0
    last_action_end_monotonic: float | None = None
    """When the last park or resume returned (answered or not): the hang check counts silence from there."""
    """While the loop waits on a call to the server, when that call's own timeout ends it: a long park is not a
    stalled loop (see ControlLoop.stalled())."""
    snapshot: KvSnapshot | None = None
    decision: Decision | None = None
    history: dict[int, TaskHistory] = field(default_factory=dict)
    host: HostMemory | None = None
    gpu: GpuReading | None = None
    """NVML's reading of the devices the server reports (None until read, or when it reports none)."""
    gpu_room: GpuRoom = NO_GPU
    """The server's devices, what others take of them, and whether that holds restores and admissions back."""
    parks: int = 0
    resumes: int = 0
    ends: int = 0
    action_failures: int = 0
    max_pressure: float = 0.0
    """The largest pressure seen at a poll since start (or since the last reset_maxima())."""
    max_growth: float = 0.0
    """The largest rise of the pressure between a decision's expectation and the next poll."""
    loop_restarts: int = 0
    backoff_s: float | None = None
    """The current back-off after failed polls; None while the server answers."""


class ControlLoop:
    """Poll, decide, act, record; see the module docstring."""

    def __init__(
        self,
        client: UpstreamClient,
        settings: Settings,
        metrics: Metrics,
        *,
        gpu: GpuProbe | None = None,
        host: Callable[[], HostMemory] = read_host_memory,
        clock_ms: Callable[[], int] = lambda: int(time.time() * 1000),
        on_end: Callable[[int, int], Awaitable[bool]] | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.config = PolicyConfig.from_settings(settings.policy)
        self.state = LoopState()
        self._gpu = gpu
        self._gpu_read_at = -GPU_READ_INTERVAL_S
        self._host = host
        self._clock_ms = clock_ms
        # the proxy (a later issue) ends a request that cannot fit by closing its client's stream
        self._on_end = on_end
        self._commands: asyncio.Queue[_Command] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._lease_warned = False
        self._forget_pending = False
        self._poll_listeners: list[Callable[[], object]] = []
        self._skip_labels: set[tuple[str, str]] = set()
        self._blocked: set[SkipReason] = set()
        self._unconfirmed_pins: set[int] = set()
        self._next_poll_timeout_s = 0.0
        self._last_action_timeout_s = 0.0
        self._gpu_baseline = GpuBaseline()

    # --- public ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until cancelled; an unexpected exception restarts the loop after a delay."""
        while True:
            try:
                await self._poll_forever()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.state.loop_restarts += 1
                self.metrics.loop_restarts.inc()
                log.exception("loop.crashed", restart_in_s=self.settings.loop.restart_delay_s)
                await asyncio.sleep(self.settings.loop.restart_delay_s)

    def add_poll_listener(self, listener: Callable[[], object]) -> None:
        """Called after every poll, answered or not (readiness keeps its timers with it)."""
        self._poll_listeners.append(listener)

    def poll_soon(self) -> None:
        """Poll now instead of at the next tick (a request is waiting for admission)."""
        self._wake.set()

    def forget(self, why: str) -> None:
        """Drop what the loop knows about the server's tasks (it restarted); done before the next poll."""
        self._forget_pending = True
        log.info("loop.forget", reason=why)

    def admission(self, n_prompt_cells: int) -> Admission | None:
        """What the policy says about a new request now, from the last answered poll; None while the server is down."""
        kv = self.state.snapshot
        if kv is None or not self.state.upstream_up:
            return None
        if kv.n_slots_idle == 0:
            # parked requests keep their slots: a request the server has no slot for would wait inside the
            # server, invisible to the queue
            return Admission(False, "no idle slot", 0)
        verdict = admission(self._input(kv), self.config, n_prompt_cells)
        if verdict.allowance is None or verdict.allowance > kv.n_slots_idle:
            return replace(verdict, allowance=kv.n_slots_idle)
        return verdict

    def stalled(self, limit_s: float) -> bool:
        """No iteration began for limit_s, and no call to the server with a longer timeout is in flight."""
        now = time.monotonic()
        return now - self.state.heartbeat_monotonic >= limit_s and now >= self.state.busy_until_monotonic

    async def _timed(self, call: Awaitable[_T], timeout_s: float, *, action: bool) -> _T:
        """One call to the server, made with timeout_s: until it returns the loop counts as busy, not stalled; a call
        that may outlast half the lease keeps the lease meanwhile (GET /health with the lease header, which the server
        answers without its main loop: patch 22); and the end of an action is noted for the hang check, which counts
        the server's silence from there (only polls decide that the server is down or hung)."""
        self.state.busy_until_monotonic = time.monotonic() + timeout_s + 1.0
        if action:
            self._last_action_timeout_s = timeout_s
        lease_s = self.settings.upstream.lease_s
        keeper = asyncio.create_task(self._keep_lease(lease_s / 3)) if timeout_s > lease_s / 2 else None
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

    async def _poll_kv(self) -> KvSnapshot:
        """GET /kv within the poll's timeout (poll_timeout_s())."""
        timeout_s = self.poll_timeout_s()
        self._next_poll_timeout_s = 0.0
        return await self._timed(self.client.get_kv(timeout_s=timeout_s), timeout_s, action=False)

    async def _park_slot(self, slot: int, id_task: int, mode: ParkMode | None) -> ParkResult:
        """Park within the timeout its snapshot calls for (action_timeout_s())."""
        timeout_s = self.action_timeout_s(self._action_bytes(slot))
        return await self._timed(self.client.park(slot, id_task, mode, timeout_s=timeout_s), timeout_s, action=True)

    async def _resume_slot(self, slot: int, id_task: int) -> ResumeResult:
        """Resume within the timeout its snapshot calls for (action_timeout_s())."""
        timeout_s = self.action_timeout_s(self._action_bytes(slot))
        return await self._timed(self.client.resume(slot, id_task, timeout_s=timeout_s), timeout_s, action=True)

    async def _keep_lease(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            with contextlib.suppress(UpstreamError):
                await self.client.health()

    def poll_timeout_s(self) -> float:
        """How long a poll may take: the server answers between two batches, so a poll can wait behind the longest
        batch it may run (the next step's cells at its measured prompt rate) before it counts as unanswered; the
        poll right after an action that timed out waits as long as that action could."""
        base = self.settings.upstream.timeout_s
        kv = self.state.snapshot
        rate = kv.park_rates.prompt_tokens_per_s if kv is not None else None
        timeout_s = base
        if kv is not None and rate:
            batch_s = kv.next_step.n_total_max / rate
            timeout_s = min(base + 2 * batch_s, max(base, self.settings.upstream.poll_timeout_max_s))
        return max(timeout_s, self._next_poll_timeout_s)

    def action_timeout_s(self, n_bytes: int) -> float:
        """How long a park or resume of an n_bytes snapshot may take: it is answered once the copy is done, which the
        server slices between the other requests' steps (about twice its copy time on a busy server), at its
        measured copy rate (1 GB/s until it has one), with room to spare; within the settings' floor and ceiling."""
        up = self.settings.upstream
        kv = self.state.snapshot
        rate = (kv.park_rates.copy_bytes_per_s if kv is not None else None) or ASSUMED_COPY_BYTES_PER_S
        return min(max(up.timeout_s + 4 * n_bytes / rate, up.action_timeout_min_s), up.action_timeout_max_s)

    def reset_maxima(self) -> None:
        self.state.max_pressure = 0.0
        self.state.max_growth = 0.0

    async def manual(
        self, action: ManualAction, slot: int, timeout_s: float | None = None, mode: ParkMode | None = None
    ) -> ManualResult:
        """A manual park (pinned until resumed by hand) or resume, carried out by the loop's task. A park goes by
        ``mode``; None: the server's choice. By default it waits as long as the loop's poll and the action may take
        (plus a step of the loop), so that the action's own answer, or its timeout, comes back."""
        if timeout_s is None:
            timeout_s = self.poll_timeout_s() + self.action_timeout_s(self._action_bytes(slot)) + 5.0
        done: asyncio.Future[ManualResult] = asyncio.get_running_loop().create_future()
        await self._commands.put(_Command(action, slot, done, mode))
        self._wake.set()
        try:
            return await asyncio.wait_for(done, timeout_s)
        except TimeoutError:
            raise ManualError(
                504, "the control loop did not carry out the request in time; it may still complete (see GET /status)"
            ) from None

    # --- the loop --------------------------------------------------------------------------------

    def _max_backoff(self) -> float:
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

    async def _poll_forever(self) -> None:
        backoff: float | None = None
        while True:
            t0 = time.monotonic()
            self.state.heartbeat_monotonic = t0
            # cleared before the step: a poll_soon() while it runs wakes the next wait at once
            self._wake.clear()
            await self._run_commands()
            ok = await self.step()
            self.state.heartbeat_monotonic = time.monotonic()  # a long step is over: the wait that follows is no stall
            for listener in self._poll_listeners:
                listener()
            if ok:
                backoff = None
                delay = max(0.0, self.settings.loop.poll_interval_s - (time.monotonic() - t0))
            else:
                initial = self.settings.loop.backoff_initial_s
                backoff = min(initial if backoff is None else backoff * 2, self._max_backoff())
                delay = backoff
            self.state.backoff_s = backoff
            if self._commands.empty():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)

    async def step(self) -> bool:
        """One poll, decision and its actions; False when the server did not answer."""
        if self._forget_pending:
            self.state.history.clear()
            self._forget_pending = False
        asked = time.monotonic()
        try:
            kv = await self._poll_kv()
        except UpstreamError as e:
            if not isinstance(e, UpstreamUnavailable):
                self.state.last_answer_monotonic = time.monotonic()
            self._down(e)
            return False
        self.state.last_answer_monotonic = time.monotonic()
        self._up(kv)
        self.state.snapshot_asked_monotonic = asked
        await self.read_gpu()
        inp = self._input(kv)
        t0 = time.perf_counter()
        decision = decide(inp, self.config)
        self.metrics.decision_seconds.observe(time.perf_counter() - t0)
        self._record_poll(kv, decision)
        await self._act(decision)
        return True

    def _down(self, e: UpstreamError) -> None:
        kind = type(e).__name__
        self.metrics.poll_errors.labels(kind=kind).inc()
        self.metrics.upstream_up.set(0)
        if self.state.upstream_up or self.state.last_error is None:
            log.warning("upstream.down", error=str(e))
        self.state.upstream_up = False
        self.state.last_error = str(e)

    def _up(self, kv: KvSnapshot) -> None:
        prev = self.state.snapshot
        prev_boot = prev.server.boot_id if prev is not None and prev.server is not None else None
        boot = kv.server.boot_id if kv.server is not None else None
        if prev_boot is not None and boot is not None and prev_boot != boot:
            # a new process: its task ids start again, so what we knew would be misapplied (whether or not a poll
            # failed in between)
            if self.state.history:
                self.state.history.clear()
                log.info("loop.forget", reason="the server restarted (new boot id)")
        if not self.state.upstream_up:
            if boot is None and self.state.polls > 0 and self.state.history:
                # a server that does not say who it is may have restarted while it did not answer
                self.state.history.clear()
                log.info("loop.forget", reason="upstream came back")
            log.info("upstream.up", n_cells=kv.n_cells, n_slots=kv.n_slots, draft=kv.draft is not None, boot_id=boot)
        elif prev is not None and (prev.n_cells, prev.n_slots) != (kv.n_cells, kv.n_slots):
            self.state.history.clear()
            log.info("loop.forget", reason="the server's pool changed")
        self.state.upstream_up = True
        self.state.last_error = None
        self.state.polls += 1
        self.state.last_poll_monotonic = time.monotonic()
        self.state.snapshot = kv
        self.metrics.upstream_up.set(1)
        self.metrics.polls.inc()
        # a task that is gone (finished, cancelled, client went away) takes its pin and history along
        live = {s.id_task for s in kv.slots if s.id_task is not None}
        for task in [t for t in self.state.history if t not in live]:
            del self.state.history[task]
        # a manual park that timed out: the server's word now says whether it happened, and the pin with it
        parked = {s.id_task for s in kv.slots if s.state is SlotState.PARKED}
        for task in self._unconfirmed_pins:
            h = self.state.history.get(task)
            if h is not None and h.pinned and task not in parked:
                self.state.history[task] = replace(h, pinned=False)
                log.info("park.pin_dropped", id_task=task, reason="the park that timed out did not happen")
        self._unconfirmed_pins.clear()

    def _input(self, kv: KvSnapshot) -> PolicyInput:
        host = self._host()
        self.state.host = host
        gpu_free = self._gpu_input(kv).free_bytes
        return PolicyInput(
            kv=kv,
            now_ms=self._clock_ms(),
            history=dict(self.state.history),
            host_available_bytes=host.available_bytes,
            gpu_free_bytes=gpu_free,
        )

    async def read_gpu(self) -> None:
        """Refresh NVML's reading (at most once a second), only where the server reports devices it runs on: NVML
        then refines their numbers (matched by bus id); a device the server does not use plays no part."""
        kv = self.state.snapshot
        if self._gpu is None or self._gpu.absent or kv is None or not kv.devices:
            return
        now = time.monotonic()
        if now - self._gpu_read_at < GPU_READ_INTERVAL_S:
            return
        self._gpu_read_at = now
        self.state.gpu = await self._gpu.read()

    def _gpu_input(self, kv: KvSnapshot) -> GpuRoom:
        """The GPU room this poll: per device of the server, what others took since it started; published in
        /status and the metrics, and logged when it starts or stops holding restores and admissions back."""
        room = self._gpu_baseline.room(kv, self.state.gpu, self.config.gpu_floor_bytes)
        prev = self.state.gpu_room
        self.state.gpu_room = room
        if room.held != prev.held:
            if room.held is not None:
                log.warning("gpu.held", reason=room.held)
            else:
                log.info("gpu.released")
        m = self.metrics
        for d in room.devices:
            m.gpu_memory_used_bytes.labels(gpu=d.name).set(d.used_bytes)
            m.gpu_memory_free_bytes.labels(gpu=d.name).set(d.free_bytes)
            m.gpu_memory_server_bytes.labels(gpu=d.name).set(d.server_bytes)
            m.gpu_memory_others_bytes.labels(gpu=d.name).set(d.others_bytes)
        return room

    def _record_poll(self, kv: KvSnapshot, decision: Decision) -> None:
        p = decision.pressure
        prev = self.state.decision
        if prev is not None:
            self.state.max_growth = max(self.state.max_growth, p.value - prev.projected_after)
        self.state.max_pressure = max(self.state.max_pressure, p.value)
        self.state.decision = decision
        m = self.metrics
        m.kv_used_ratio.labels(pool="target").set(kv.used_ratio)
        m.kv_projected_ratio.labels(pool="target").set(p.target)
        if kv.draft is not None and p.draft is not None:
            m.kv_used_ratio.labels(pool="draft").set(kv.draft.used_ratio)
            m.kv_projected_ratio.labels(pool="draft").set(p.draft)
        m.kv_pressure_ratio.set(p.value)
        m.parked_requests.set(kv.n_parked)
        m.parked_bytes.set(kv.parked_bytes)
        m.pinned_requests.set(sum(1 for h in self.state.history.values() if h.pinned))
        if self.state.host is not None:
            m.host_available_bytes.set(self.state.host.available_bytes)
        now = self._clock_ms()
        since = [s.park.parked_since_ms for s in kv.slots if s.state is SlotState.PARKED and s.park.parked_since_ms]
        m.longest_wait_seconds.set(max(0, now - min(since)) / 1000 if since else 0)
        counts = Counter((str(s.kind), str(s.reason)) for s in decision.skipped)
        for labels in self._skip_labels - counts.keys():
            m.skipped.labels(*labels).set(0)
        for labels, n in counts.items():
            m.skipped.labels(*labels).set(n)
        self._skip_labels |= counts.keys()
        if decision.skipped and (prev is None or prev.skipped != decision.skipped):
            log.info(
                "decision.skipped",
                pressure=round(p.value, 4),
                skipped=[f"{s.kind}:{s.slot}/{s.id_task}:{s.reason}" for s in decision.skipped],
            )
        self._report_blocked_parks(decision)

    def _report_blocked_parks(self, decision: Decision) -> None:
        """A park the policy wanted but a resource limit forbids: a warning once, until a park goes through again
        (pressure crossing HIGH back and forth must not repeat it)."""
        blocked = {s.reason for s in decision.skipped if s.kind is ActionKind.PARK} & _BLOCKING.keys()
        for reason in sorted(blocked - self._blocked):
            host = self.state.host
            log.warning(
                "park.blocked",
                reason=str(reason),
                pressure=round(decision.pressure.value, 4),
                host_available_bytes=host.available_bytes if host is not None else None,
                host_ram_reserve_bytes=self.config.host_reserve_bytes,
                budget_bytes=self.config.budget_bytes,
                parked_bytes=self.state.snapshot.parked_bytes if self.state.snapshot is not None else None,
                hint=_BLOCKING[reason],
            )
        if decision.parks:
            for reason in sorted(self._blocked - blocked):
                log.info("park.unblocked", reason=str(reason))
            self._blocked = blocked
        else:
            self._blocked |= blocked

    async def _act(self, decision: Decision) -> None:
        for action in decision.actions:
            if not await self._carry_out(action):
                return  # the server's state is not what the decision assumed: decide again on a fresh poll

    def _wire_mode(self, a: Action) -> ParkMode | None:
        """The mode to ask for: the policy's, unless the server lists no modes (an older one, which swaps only)."""
        kv = self.state.snapshot
        return a.mode if kv is not None and kv.park_modes is not None else None

    def _action_bytes(self, slot_id: int) -> int:
        """The snapshot a park or resume of this slot copies, as the last poll saw it (0 when unknown)."""
        kv = self.state.snapshot
        slot = next((s for s in kv.slots if s.id == slot_id), None) if kv is not None else None
        if kv is None or slot is None:
            return 0
        if slot.state is SlotState.PARKED:
            return slot.park.bytes
        return slot.park.snapshot_bytes if slot.park.snapshot_bytes is not None else slot.n_cells * kv.bytes_per_cell

    async def _park(self, a: Action, fields: dict[str, object]) -> ParkResult:
        """Park as the policy chose; a swap the server cannot hold now (503: its snapshot arena cannot grow, host
        memory ran short) becomes a park by recompute, since the request must still give up its cells."""
        mode = self._wire_mode(a)
        try:
            return await self._park_slot(a.slot, a.id_task, mode)
        except UpstreamApiError as e:
            kv = self.state.snapshot
            modes = kv.park_modes if kv is not None else None
            if mode is not ParkMode.SWAP or e.status != 503 or not modes or ParkMode.RECOMPUTE not in modes:
                raise
            log.warning("park.swap_refused", **fields, error=e.message)
            fields["mode"] = str(ParkMode.RECOMPUTE)
            return await self._park_slot(a.slot, a.id_task, ParkMode.RECOMPUTE)

    async def _carry_out(self, a: Action) -> bool:
        fields: dict[str, object] = {
            "slot": a.slot,
            "id_task": a.id_task,
            "reason": str(a.reason),
            "n_cells": a.n_cells,
            "projected_after": round(a.projected_after, 4),
        }
        if a.kind is ActionKind.PARK:
            fields["mode"] = str(a.mode) if a.mode is not None else None
            fields["mode_reason"] = str(a.mode_reason) if a.mode_reason is not None else None
        if a.kind is ActionKind.END:
            return await self._end(a, fields)
        t0 = time.perf_counter()
        try:
            if a.kind is ActionKind.PARK:
                park = await self._park(a, fields)
            else:
                resume = await self._resume_slot(a.slot, a.id_task)
        except UpstreamError as e:
            self._action_failed(str(a.kind), e, fields)
            return False
        dt = time.perf_counter() - t0
        if a.kind is ActionKind.PARK:
            self._parked(park, a.reason, dt, fields, requested=a.mode)
        else:
            self._resumed(resume, a.reason, dt, fields, waited_ms=a.waited_ms)
        return True

    def _parked(
        self,
        r: ParkResult,
        reason: Reason,
        dt: float,
        fields: dict[str, object],
        pin: bool = False,
        requested: ParkMode | None = None,
    ) -> None:
        self.state.parks += 1
        old = self.state.history.get(r.id_task, TaskHistory()).parked()
        self.state.history[r.id_task] = replace(old, pinned=old.pinned or pin)
        # the server's word on the mode; one that does not say it is an older server, which swaps only
        mode = r.mode or requested or ParkMode.SWAP
        self.metrics.parks.labels(reason=str(reason), mode=str(mode)).inc()
        self.metrics.park_seconds.observe(dt)
        log.info(
            "park.done",
            **{**fields, "n_cells": r.n_cells, "mode": str(mode)},
            server_mode_reason=r.mode_reason,
            n_bytes=r.n_bytes + r.n_bytes_draft,
            park_ms=r.timings.park_ms,
            copy_ms=r.timings.copy_ms,
            park_count=r.park_count,
            pinned=pin,
        )

    def _resumed(
        self, r: ResumeResult, reason: Reason, dt: float, fields: dict[str, object], waited_ms: int | None
    ) -> None:
        old = self.state.history.get(r.id_task)
        if old is not None and old.pinned:
            self.state.history[r.id_task] = replace(old, pinned=False)
        self.state.resumes += 1
        self.metrics.resumes.labels(reason=str(reason)).inc()
        self.metrics.resume_seconds.observe(dt)
        log.info(
            "restore.done",
            **{**fields, "n_cells": r.n_cells},
            mode=str(r.mode) if r.mode is not None else None,
            expected_cells=fields.get("n_cells"),
            resume_ms=r.timings.resume_ms,
            parked_ms=r.t_parked_ms,
            waited_ms=waited_ms,
        )

    def _action_failed(self, action: str, e: UpstreamError, fields: dict[str, object]) -> None:
        """Count and log a failed park or resume. Only polls decide that the server is down: an action that timed out
        may still complete on the server (a large copy), and the next poll shows how it went."""
        self.state.action_failures += 1
        status = str(e.status) if isinstance(e, UpstreamApiError) else "none"
        self.metrics.action_failures.labels(action=action, status=status).inc()
        event = "park.failed" if action == "park" else "restore.failed"
        log.warning(event, **fields, error=str(e))
        if isinstance(e, UpstreamUnavailable):
            # reconcile from the server's word, waiting as long as the action could have: a copy the server runs at
            # once (an older server, --park-slice 0, a full pool) answers the poll only when it is done
            self._next_poll_timeout_s = max(self._next_poll_timeout_s, self._last_action_timeout_s)
            self.poll_soon()

    async def _end(self, a: Action, fields: dict[str, object]) -> bool:
        """A parked request that cannot fit the pool even alone: end it rather than let it wait forever."""
        self.state.ends += 1
        self.metrics.ends.inc()
        log.error(
            "request.cannot_fit", **fields, pool_cells=self.state.snapshot.n_cells if self.state.snapshot else None
        )
        if self._on_end is not None and await self._on_end(a.slot, a.id_task):
            return True
        # without a proxy to end its stream, resume it alone: the server's own context limit then ends it
        try:
            await self._resume_slot(a.slot, a.id_task)
        except UpstreamError as e:
            self._action_failed("resume", e, fields)
            return False
        return True

    # --- manual overrides ------------------------------------------------------------------------

    async def _run_commands(self) -> None:
        while not self._commands.empty():
            cmd = self._commands.get_nowait()
            if cmd.done.done():  # the caller gave up waiting
                continue
            try:
                result = await self._manual(cmd)
            except ManualError as e:
                if not cmd.done.done():
                    cmd.done.set_exception(e)
                continue
            # the caller may have given up while the action ran (its future is cancelled): the action stands
            if not cmd.done.done():
                cmd.done.set_result(result)

    async def _manual(self, cmd: _Command) -> ManualResult:
        try:
            kv = await self._poll_kv()
        except UpstreamError as e:
            self._down(e)
            raise ManualError(503, f"upstream down: {e}", retry_after_s=1.0) from None
        self._up(kv)
        slot = next((s for s in kv.slots if s.id == cmd.slot), None)
        if slot is None:
            raise ManualError(404, f"no slot {cmd.slot} (the server has {kv.n_slots})")
        if slot.id_task is None:
            raise ManualError(409, f"slot {cmd.slot} serves no request")
        task = slot.id_task
        fields: dict[str, object] = {"slot": slot.id, "id_task": task, "reason": str(Reason.MANUAL)}
        old = self.state.history.get(task, TaskHistory())
        known = task in self.state.history
        if cmd.action is ManualAction.PARK:
            if slot.state is SlotState.PARKED:
                self.state.history[task] = replace(old, pinned=True)
                log.info("park.pinned", **fields)
                mode = str(slot.park.mode) if slot.park.mode is not None else None
                return ManualResult(
                    slot.id, task, cmd.action, True, "already parked; now pinned", slot.n_cells, mode=mode
                )
            if cmd.mode is not None:
                fields["mode"] = str(cmd.mode)
            # pinned before it is asked for: a park that times out may still complete on the server, and the next
            # poll keeps the pin if it did (see _up())
            self.state.history[task] = replace(old, pinned=True)
            t0 = time.perf_counter()
            try:
                park = await self._park_slot(slot.id, task, cmd.mode)
            except UpstreamError as e:
                self._action_failed("park", e, fields)
                if isinstance(e, UpstreamApiError):
                    # refused: nothing changed
                    if known:
                        self.state.history[task] = old
                    else:
                        self.state.history.pop(task, None)
                    raise _manual_error(e) from None
                self._unconfirmed_pins.add(task)
                waited = f"did not answer the park in {self._last_action_timeout_s:g} s"
                what = waited if isinstance(e, UpstreamUnavailable) else str(e)
                raise ManualError(
                    504,
                    f"the server {what}; the park may still complete, and then the request stays parked and pinned "
                    f"(see GET /status)",
                    retry_after_s=1.0,
                ) from None
            self._parked(park, Reason.MANUAL, time.perf_counter() - t0, fields, pin=True, requested=cmd.mode)
            mode = str(park.mode) if park.mode is not None else None
            return ManualResult(slot.id, task, cmd.action, True, "parked and pinned", park.n_cells, park.n_bytes, mode)
        if slot.state is not SlotState.PARKED:
            raise ManualError(409, f"slot {cmd.slot} is not parked (state '{slot.state}')")
        # unpinned first: should the resume fail for lack of room, the policy restores it when there is
        self.state.history[task] = replace(old, pinned=False)
        t0 = time.perf_counter()
        try:
            resume = await self._resume_slot(slot.id, task)
        except UpstreamError as e:
            self._action_failed("resume", e, fields)
            raise _manual_error(e) from None
        self._resumed(resume, Reason.MANUAL, time.perf_counter() - t0, fields, waited_ms=None)
        mode = str(resume.mode) if resume.mode is not None else None
        return ManualResult(slot.id, task, cmd.action, False, "resumed", resume.n_cells, resume.n_bytes, mode)


def _manual_error(e: UpstreamError) -> ManualError:
    if isinstance(e, UpstreamApiError):
        return ManualError(e.status, f"the server refused: {e.message}", e.retry_after_s)
    return ManualError(503, f"upstream down: {e}", retry_after_s=1.0)
