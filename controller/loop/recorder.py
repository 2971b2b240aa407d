"""The recorder: what the loop saw, decided and did, into its state, the metrics and the log. No I/O, no waiting.

One place for every record, so that a park asked for by hand and one the policy chose are counted, remembered and
logged alike (``park.done``, ``restore.done``, ``park.failed``, ``restore.failed``, ``request.cannot_fit``,
``decision.skipped``, ``park.blocked``/``park.unblocked``, ``gpu.held``/``gpu.released``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import structlog

from controller.loop.gpu_room import GpuRoom
from controller.loop.host_budget import host_budget
from controller.loop.state import LoopState
from controller.metrics import Metrics
from controller.policy.pool import ram_parked_bytes
from controller.policy.types import Action, ActionKind, Decision, PolicyConfig, SkipReason, TaskHistory
from controller.upstream.client import UpstreamApiError, UpstreamError
from controller.upstream.models import KvSnapshot, ParkMode, ParkResult, ParkTier, ResumeResult, SlotState

__all__ = ["Recorder"]

log = structlog.get_logger("kvctl.loop")

# parks the policy wants but a resource limit forbids; the server's safety net (--park-ram) still parks. A server
# that parks by recompute is never short of memory for a park: only an older one (swap only) meets the first two
BLOCKING = {
    SkipReason.HOST_RAM: "the host's available RAM is under policy.host_ram_reserve_mib plus the snapshot: kvctl "
    "parks nothing until RAM is freed (a server with park by recompute would not need it)",
    SkipReason.BUDGET: "parked snapshots fill policy.snapshot_budget_mib (or the server's --park-ram)",
    SkipReason.PARKING_OFF: "the server parks by no mode (--no-park): only its idle-slot clearing relieves the pool",
}


def action_fields(a: Action) -> dict[str, object]:
    """The log fields of an action (its outcome's lines add to them)."""
    fields: dict[str, object] = {"slot": a.slot, "id_task": a.id_task, "reason": str(a.reason), "n_cells": a.n_cells}
    fields["projected_after"] = round(a.projected_after, 4)
    if a.kind is ActionKind.PARK:
        fields["mode"] = str(a.mode) if a.mode is not None else None
        fields["mode_reason"] = str(a.mode_reason) if a.mode_reason is not None else None
        if a.tier is not None:
            fields["tier"] = str(a.tier)
    return fields


class Recorder:
    def __init__(self, state: LoopState, metrics: Metrics, config: PolicyConfig, clock_ms: Callable[[], int]) -> None:
        self.state = state
        self.metrics = metrics
        self.config = config
        self._clock_ms = clock_ms
        self._skip_labels: set[tuple[str, str]] = set()
        self._blocked: set[SkipReason] = set()
        self._host_checked: str | None = None  # the boot id whose host memory was checked

    # --- polls -----------------------------------------------------------------------------------

    def poll_failed(self, e: UpstreamError) -> None:
        self.metrics.poll_errors.labels(kind=type(e).__name__).inc()
        self.metrics.upstream_up.set(0)
        if self.state.upstream_up or self.state.last_error is None:
            log.warning("upstream.down", error=str(e))

    def poll_answered(self, kv: KvSnapshot, *, came_up: bool) -> None:
        self.metrics.upstream_up.set(1)
        self.metrics.polls.inc()
        if came_up:
            boot = kv.server.boot_id if kv.server is not None else None
            log.info("upstream.up", n_cells=kv.n_cells, n_slots=kv.n_slots, draft=kv.draft is not None, boot_id=boot)

    def forgot(self, why: str) -> None:
        log.info("loop.forget", reason=why)

    def pin_dropped(self, id_task: int) -> None:
        log.info("park.pin_dropped", id_task=id_task, reason="the park that timed out did not happen")

    def gpu(self, room: GpuRoom) -> None:
        """The GPU room of this poll: in /status and the metrics; logged when it starts or stops holding back."""
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

    def decision(self, kv: KvSnapshot, decision: Decision, seconds: float) -> None:
        """A poll's decision: the pressure, its maxima, the gauges, what was passed over and why."""
        self.metrics.decision_seconds.observe(seconds)
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
        if kv.swa is not None and p.swa is not None:
            m.kv_used_ratio.labels(pool="swa").set(kv.swa.used_ratio)
            m.kv_projected_ratio.labels(pool="swa").set(p.swa)
        m.kv_pressure_ratio.set(p.value)
        m.parked_requests.set(kv.n_parked)
        m.parked_bytes.set(ram_parked_bytes(kv))
        d = kv.park_disk
        m.park_disk_used_bytes.set(d.used_bytes if d is not None else 0)
        m.park_disk_budget_bytes.set(d.budget_bytes if d is not None else 0)
        m.park_disk_rate.labels(direction="write").set((d.write_bytes_per_s or 0) if d is not None else 0)
        m.park_disk_rate.labels(direction="read").set((d.read_bytes_per_s or 0) if d is not None else 0)
        m.park_disk_fallbacks.set(d.fallbacks if d is not None else 0)
        m.park_disk_spills.set((d.spills or 0) if d is not None else 0)
        self._host_memory(kv)
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
        self._blocked_parks(decision)

    def _blocked_parks(self, decision: Decision) -> None:
        """A park the policy wanted but a resource limit forbids: a warning once, until a park goes through again
        (pressure crossing HIGH back and forth must not repeat it)."""
        blocked = {s.reason for s in decision.skipped if s.kind is ActionKind.PARK} & BLOCKING.keys()
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
                hint=BLOCKING[reason],
            )
        if decision.parks:
            for reason in sorted(self._blocked - blocked):
                log.info("park.unblocked", reason=str(reason))
            self._blocked = blocked
        else:
            self._blocked |= blocked

    def _host_memory(self, kv: KvSnapshot) -> None:
        """The server's host memory by part, and a warning once per server start when its budgets can outgrow
        what the host has (controller.loop.host_budget)."""
        host = self.state.host
        budget = host_budget(kv, host.available_bytes if host is not None else None)
        if budget is None:
            return
        for part, n in budget.parts.items():
            self.metrics.host_memory_bytes.labels(part=part).set(n)
        self.metrics.host_memory_committed_bytes.set(budget.committed)
        boot = kv.server.boot_id if kv.server is not None else ""
        if self._host_checked == boot:
            return
        self._host_checked = boot
        if not budget.fits:
            log.warning(
                "host_memory.short",
                **{f"{part}_bytes": n for part, n in budget.parts.items()},
                growth_bytes=budget.growth,
                available_bytes=budget.available,
                unbounded=list(budget.unbounded),
                hint="the server's budgets can outgrow the host: lower --park-ram, --cache-ram or --ctx-checkpoints, "
                "or give the host (the container) more memory; docs/operations.md, 'Host memory'",
            )

    # --- actions ---------------------------------------------------------------------------------

    def pinned(self, id_task: int) -> None:
        old = self.state.history.get(id_task, TaskHistory())
        self.state.history[id_task] = replace(old, pinned=True)

    def parked(self, a: Action, r: ParkResult, seconds: float, fields: dict[str, object], pin: bool) -> None:
        self.state.parks += 1
        old = self.state.history.get(r.id_task, TaskHistory()).parked()
        self.state.history[r.id_task] = replace(old, pinned=old.pinned or pin)
        # the server's word on the mode; one that does not say it is an older server, which swaps only
        mode = r.mode or a.mode or ParkMode.SWAP
        # where the cells went: the server's word, else RAM for a swap (a server without tiers)
        tier = r.tier or (ParkTier.RAM if mode is ParkMode.SWAP else ParkTier.NONE)
        cls = self.config.priority_class(a.priority)
        self.metrics.parks.labels(reason=str(a.reason), mode=str(mode), tier=str(tier), priority_class=cls).inc()
        self.metrics.park_seconds.observe(seconds)
        log.info(
            "park.done",
            **{**fields, "n_cells": r.n_cells, "mode": str(mode), "tier": str(tier)},
            server_mode_reason=r.mode_reason,
            fallback=r.fallback,
            n_bytes=r.n_bytes + r.n_bytes_draft,
            park_ms=r.timings.park_ms,
            copy_ms=r.timings.copy_ms,
            park_count=r.park_count,
            pinned=pin,
            priority=a.priority,
        )

    def resumed(self, a: Action, r: ResumeResult, seconds: float, fields: dict[str, object]) -> None:
        old = self.state.history.get(r.id_task)
        if old is not None and old.pinned:
            self.state.history[r.id_task] = replace(old, pinned=False)
        self.state.resumes += 1
        self.metrics.resumes.labels(reason=str(a.reason)).inc()
        if a.waited_ms is not None:
            cls = self.config.priority_class(a.priority)
            self.metrics.restore_wait_seconds.labels(priority_class=cls).observe(a.waited_ms / 1000)
        self.metrics.resume_seconds.observe(seconds)
        log.info(
            "restore.done",
            **{**fields, "n_cells": r.n_cells},
            mode=str(r.mode) if r.mode is not None else None,
            tier=str(r.tier) if r.tier is not None else None,
            fallback=r.fallback,
            expected_cells=a.n_cells,
            resume_ms=r.timings.resume_ms,
            parked_ms=r.t_parked_ms,
            waited_ms=a.waited_ms,
            priority=a.priority,
        )

    def failed(self, kind: ActionKind, e: UpstreamError, fields: dict[str, object]) -> None:
        """A park or resume that failed or was not answered in time."""
        self.state.action_failures += 1
        status = str(e.status) if isinstance(e, UpstreamApiError) else "none"
        self.metrics.action_failures.labels(action=str(kind), status=status).inc()
        log.warning("park.failed" if kind is ActionKind.PARK else "restore.failed", **fields, error=str(e))

    def swap_refused(self, fields: dict[str, object], e: UpstreamApiError) -> None:
        log.warning("park.swap_refused", **fields, error=e.message)

    def ended(self, fields: dict[str, object]) -> None:
        self.state.ends += 1
        self.metrics.ends.inc()
        kv = self.state.snapshot
        log.error("request.cannot_fit", **fields, pool_cells=kv.n_cells if kv is not None else None)
