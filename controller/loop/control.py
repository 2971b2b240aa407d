"""The control loop: poll ``GET /kv``, decide (controller.policy), act (park, resume), record.

Its roles live in modules named for them: controller.loop.poller (cadence, back-off, timeout, the server's identity),
controller.loop.actuator (one carry_out() for every action, the policy's and the manual ones), controller.loop.recorder
(state, metrics and log lines; no I/O) and controller.loop.calls (each call within its own timeout). This module joins
them: one task owns the loop's state; manual overrides from the admin API are queued to it, so no lock is needed.
Every request to the server carries ``X-Park-Lease: 1`` (the client adds it): while the loop polls, the server
leaves auto-parked requests to it. An unexpected exception is logged and the loop restarted: it never takes the
process down.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import structlog

from controller.admin.models import ManualAction, ManualResult
from controller.errors import Code, KvctlError
from controller.loop.actuator import Actuator
from controller.loop.calls import ServerCalls
from controller.loop.gpu_room import GpuBaseline
from controller.loop.poller import Clock, Poller
from controller.loop.recorder import Recorder
from controller.loop.state import LoopState
from controller.metrics import Metrics
from controller.policy.admission import admission
from controller.policy.plan import decide
from controller.policy.pool import effective_priorities
from controller.policy.types import Action, ActionKind, Admission, PolicyConfig, PolicyInput, QueuedRequest, Reason
from controller.probes.gpu import GpuProbe
from controller.probes.host import HostMemory, read_host_memory
from controller.settings import Settings
from controller.upstream.client import UpstreamApiError, UpstreamClient, UpstreamError, UpstreamUnavailable
from controller.upstream.models import KvSnapshot, ParkMode, SlotState

__all__ = ["ControlLoop", "LoopState"]

log = structlog.get_logger("kvctl.loop")

GPU_READ_INTERVAL_S = 1.0  # NVML reads block a thread; GPU memory does not move at the pool's pace


@dataclass(slots=True)
class _Command:
    action: ManualAction
    slot: int
    done: asyncio.Future[ManualResult]
    mode: ParkMode | None = None


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
        clock: Clock | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self.metrics = metrics
        self.config = PolicyConfig.from_settings(settings.policy)
        self.state = LoopState()
        self.calls = ServerCalls(client, self.state, settings.upstream.lease_s)
        self.recorder = Recorder(self.state, metrics, self.config, clock_ms)
        self.poller = Poller(settings, self.state, self.calls, self.recorder, clock)
        self.actuator = Actuator(settings.upstream, self.state, self.calls, self.poller, self.recorder, on_end)
        self._gpu = gpu
        self._gpu_read_at = -GPU_READ_INTERVAL_S
        self._gpu_baseline = GpuBaseline()
        self._host = host
        self._clock_ms = clock_ms
        self._commands: asyncio.Queue[_Command] = asyncio.Queue()
        self._poll_listeners: list[Callable[[], object]] = []
        self.queued: Callable[[], QueuedRequest | None] = lambda: None
        """The head of the proxy's admission queue (set by the App): the policy may displace lower priorities for it,
        and holds back restores of lower ones while it waits."""

    # --- public ----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Run until cancelled; an unexpected exception restarts the loop after a delay."""
        while True:
            try:
                await self.poller.run(self._iteration, lambda: not self._commands.empty())
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
        self.poller.poll_soon()

    def forget(self, why: str) -> None:
        """Drop what the loop knows about the server's tasks (it restarted); done before the next poll."""
        self.poller.forget(why)

    def poll_timeout_s(self) -> float:
        return self.poller.timeout_s()

    def action_timeout_s(self, n_bytes: int) -> float:
        return self.actuator.action_timeout_s(n_bytes)

    def admission(self, n_prompt_cells: int) -> Admission | None:
        """What the policy says about a new request now, from the last answered poll; None while the server is down.
        Parked requests of the queued head's effective priority or higher are restored first; with nobody queued,
        all of them."""
        kv = self.state.snapshot
        if kv is None or not self.state.upstream_up:
            return None
        if kv.n_slots_idle == 0:
            # parked requests keep their slots: a request the server has no slot for would wait inside the
            # server, invisible to the queue
            return Admission(False, "no idle slot", 0)
        inp = self._input(kv)
        _, head = effective_priorities(inp, self.config)
        verdict = admission(inp, self.config, n_prompt_cells, priority=head)
        if verdict.allowance is None or verdict.allowance > kv.n_slots_idle:
            return replace(verdict, allowance=kv.n_slots_idle)
        return verdict

    def stalled(self, limit_s: float) -> bool:
        """No iteration began for limit_s, and no call to the server with a longer timeout is in flight."""
        now = time.monotonic()
        return now - self.state.heartbeat_monotonic >= limit_s and now >= self.state.busy_until_monotonic

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
            timeout_s = self.poll_timeout_s() + self.action_timeout_s(self.actuator.action_bytes(slot)) + 5.0
        done: asyncio.Future[ManualResult] = asyncio.get_running_loop().create_future()
        await self._commands.put(_Command(action, slot, done, mode))
        self.poller.poll_soon()
        try:
            return await asyncio.wait_for(done, timeout_s)
        except TimeoutError:
            raise KvctlError(
                504,
                Code.ACTION_TIMEOUT,
                "the control loop did not carry out the request in time; it may still complete (see GET /status)",
            ) from None

    # --- one iteration ---------------------------------------------------------------------------

    async def _iteration(self) -> bool:
        await self._run_commands()
        ok = await self.step()
        for listener in self._poll_listeners:
            listener()
        return ok

    async def step(self) -> bool:
        """One poll, decision and its actions; False when the server did not answer."""
        asked = time.monotonic()
        try:
            kv = await self.poller.poll()
        except UpstreamError:
            return False
        self.state.snapshot_asked_monotonic = asked
        await self.read_gpu()
        inp = self._input(kv)
        t0 = time.perf_counter()
        decision = decide(inp, self.config)
        self.recorder.decision(kv, decision, time.perf_counter() - t0)
        for action in decision.actions:
            if not (await self.actuator.carry_out(action)).done:
                break  # the server's state is not what the decision assumed: decide again on a fresh poll
        return True

    def _input(self, kv: KvSnapshot) -> PolicyInput:
        host = self._host()
        self.state.host = host
        room = self._gpu_baseline.room(kv, self.state.gpu, self.config.gpu_floor_bytes)
        self.recorder.gpu(room)
        return PolicyInput(
            kv=kv,
            now_ms=self._clock_ms(),
            history=dict(self.state.history),
            host_available_bytes=host.available_bytes,
            gpu_free_bytes=room.free_bytes,
            queued=self.queued(),
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

    # --- manual overrides ------------------------------------------------------------------------

    async def _run_commands(self) -> None:
        while not self._commands.empty():
            cmd = self._commands.get_nowait()
            if cmd.done.done():  # the caller gave up waiting
                continue
            try:
                result = await self._manual(cmd)
            except KvctlError as e:
                if not cmd.done.done():
                    cmd.done.set_exception(e)
                continue
            # the caller may have given up while the action ran (its future is cancelled): the action stands
            if not cmd.done.done():
                cmd.done.set_result(result)

    async def _manual(self, cmd: _Command) -> ManualResult:
        try:
            kv = await self.poller.poll()
        except UpstreamError as e:
            raise KvctlError(503, Code.UPSTREAM_UNAVAILABLE, f"upstream down: {e}", retry_after_s=1.0) from None
        slot = next((s for s in kv.slots if s.id == cmd.slot), None)
        if slot is None:
            raise KvctlError(404, Code.NO_SUCH_SLOT, f"no slot {cmd.slot} (the server has {kv.n_slots})")
        if slot.id_task is None:
            raise KvctlError(409, Code.SLOT_IDLE, f"slot {cmd.slot} serves no request")
        task = slot.id_task
        mode = str(slot.park.mode) if slot.park.mode is not None else None
        if cmd.action is ManualAction.PARK and slot.state is SlotState.PARKED:
            self.recorder.pinned(task)
            log.info("park.pinned", slot=slot.id, id_task=task, reason=str(Reason.MANUAL))
            detail = "already parked; now pinned"
            return ManualResult(
                slot=slot.id, id_task=task, action=cmd.action, pinned=True, detail=detail,
                n_cells=slot.n_cells, mode=mode,
            )  # fmt: skip
        if cmd.action is ManualAction.RESUME and slot.state is not SlotState.PARKED:
            raise KvctlError(409, Code.NOT_PARKED, f"slot {cmd.slot} is not parked (state '{slot.state}')")
        park = cmd.action is ManualAction.PARK
        kind = ActionKind.PARK if park else ActionKind.RESUME
        n_bytes = self.actuator.action_bytes(slot.id)
        pressure = self.state.decision.pressure.value if self.state.decision is not None else 0.0
        action = Action(
            kind,
            slot.id,
            task,
            Reason.MANUAL,
            slot.cells,
            n_bytes,
            pressure,
            mode=cmd.mode,
            priority=slot.priority or 0,
        )
        outcome = await self.actuator.carry_out(action, pin=park)
        if outcome.error is not None:
            raise self._manual_error(kind, outcome.error)
        r = outcome.park or outcome.resume
        assert r is not None
        return ManualResult(
            slot=slot.id, id_task=task, action=cmd.action, pinned=park,
            detail="parked and pinned" if park else "resumed",
            n_cells=r.n_cells, n_bytes=r.n_bytes, mode=str(r.mode) if r.mode is not None else None,
        )  # fmt: skip

    def _manual_error(self, kind: ActionKind, e: UpstreamError) -> KvctlError:
        if isinstance(e, UpstreamApiError):
            return KvctlError(e.status, Code.SERVER_REFUSED, f"the server refused: {e.message}", e.retry_after_s)
        if kind is ActionKind.PARK:
            waited = f"did not answer the park in {self.calls.last_action_timeout_s:g} s"
            what = waited if isinstance(e, UpstreamUnavailable) else str(e)
            return KvctlError(
                504,
                Code.ACTION_TIMEOUT,
                f"the server {what}; the park may still complete, and then the request stays parked and pinned "
                f"(see GET /status)",
                retry_after_s=1.0,
            )
        return KvctlError(503, Code.UPSTREAM_UNAVAILABLE, f"upstream down: {e}", retry_after_s=1.0)
