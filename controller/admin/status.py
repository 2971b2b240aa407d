"""Build the status (controller.admin.models.Status: what ``GET /status`` answers and ``kvctl status`` prints) from
the loop's and the supervisor's state. Data only; rendering is the caller's."""

from __future__ import annotations

import time

from controller.admin.models import (
    DiskView,
    ExitView,
    GpuDeviceView,
    KeeperView,
    LoopView,
    PoolView,
    SlotView,
    Status,
    SupervisorView,
    SwaPoolView,
    UpstreamView,
)
from controller.loop.gpu_room import DeviceRoom
from controller.loop.state import LoopState
from controller.policy.pool import effective_priorities, pressure, ram_parked_bytes
from controller.policy.types import PolicyConfig, PolicyInput
from controller.probes.gpu import GpuState
from controller.upstream.models import KvSnapshot, SlotState
from controller.upstream.supervisor import SupervisorState, SupervisorStatus

__all__ = ["build_status", "upstream_state"]

_SUPERVISED_STATE = {
    SupervisorState.STARTING: "loading",
    SupervisorState.BACKOFF: "restarting",
    SupervisorState.FAILED: "failed",
    SupervisorState.STOPPING: "stopped",
    SupervisorState.STOPPED: "stopped",
}


def upstream_state(up: bool, supervisor: SupervisorStatus | None) -> str:
    """One word for the server: ``up`` or ``down``; a supervised server not ready says why."""
    if supervisor is not None and supervisor.state in _SUPERVISED_STATE:
        return _SUPERVISED_STATE[supervisor.state]
    return "up" if up else "down"


def build_status(
    *,
    version: str,
    url: str,
    state: LoopState,
    config: PolicyConfig,
    loop_alive: bool,
    ready: bool,
    degraded: bool,
    problems: list[str],
    supervisor: SupervisorStatus | None,
    uptime_s: float,
    failed_after: int = 0,
    above_high_s: float | None = None,
    now_ms: int | None = None,
    keeper: KeeperView | None = None,
) -> Status:
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    mono = time.monotonic()
    kv = state.snapshot if state.upstream_up else None
    snapshot = state.snapshot
    room = state.gpu_room
    gpu_state = str(GpuState.OK) if room.devices else str(GpuState.ABSENT)
    if state.gpu is not None and state.gpu.state is GpuState.ERROR and room.devices:
        gpu_state = str(GpuState.ERROR)
    return Status(
        version=version,
        uptime_s=uptime_s,
        ready=ready,
        degraded=degraded,
        problems=problems,
        upstream=UpstreamView(
            url=url,
            state=upstream_state(state.upstream_up, supervisor),
            up=state.upstream_up,
            last_error=state.last_error,
            polls=state.polls,
            last_poll_age_s=mono - state.last_poll_monotonic if state.last_poll_monotonic is not None else None,
            backoff_s=state.backoff_s,
            lease_held=snapshot.lease.held if snapshot is not None and snapshot.lease is not None else None,
            exact=kv.server.exact if kv is not None and kv.server is not None else None,
        ),
        supervisor=_supervisor_view(supervisor, failed_after) if supervisor is not None else None,
        pool=_pool_view(kv, state, config, above_high_s) if kv is not None else None,
        slots=_slot_views(kv, state, config, now_ms) if kv is not None else [],
        loop=LoopView(
            alive=loop_alive,
            heartbeat_age_s=mono - state.heartbeat_monotonic,
            restarts=state.loop_restarts,
            parks=state.parks,
            resumes=state.resumes,
            ends=state.ends,
            action_failures=state.action_failures,
        ),
        host_available_bytes=state.host.available_bytes if state.host is not None else None,
        host_total_bytes=state.host.total_bytes if state.host is not None else None,
        gpu=gpu_state,
        gpu_devices=[_gpu_device_view(i, d) for i, d in enumerate(room.devices)],
        gpu_held=room.held,
        keeper=keeper,
    )


def _pool_view(kv: KvSnapshot, state: LoopState, config: PolicyConfig, above_high_s: float | None) -> PoolView:
    p = pressure(kv)
    swa = None
    if kv.swa is not None:
        projected = p.swa if p.swa is not None else kv.swa.used_ratio
        swa = SwaPoolView(
            n_cells=kv.swa.n_cells, n_cells_used=kv.swa.n_cells_used, n_swa=kv.swa.n_swa, projected=projected
        )
    server_budget = kv.park_ram_budget_bytes if kv.park_ram_budget_bytes is not None else config.budget_bytes
    return PoolView(
        n_cells=kv.n_cells,
        n_cells_used=kv.n_cells_used,
        used_ratio=kv.used_ratio,
        projected_target=p.target,
        projected_draft=p.draft,
        swa=swa,
        pressure=p.value,
        high=config.high,
        low=config.low,
        max_pressure=state.max_pressure,
        max_growth=state.max_growth,
        above_high_s=above_high_s,
        n_parked=kv.n_parked,
        parked_bytes=ram_parked_bytes(kv),
        parked_budget_bytes=min(config.budget_bytes, server_budget),
        disk=None
        if kv.park_disk is None
        else DiskView(
            dir=kv.park_disk.dir,
            used_bytes=kv.park_disk.used_bytes,
            budget_bytes=kv.park_disk.budget_bytes,
            files=kv.park_disk.files,
            write_bytes_per_s=kv.park_disk.write_bytes_per_s,
            read_bytes_per_s=kv.park_disk.read_bytes_per_s,
            fallbacks=kv.park_disk.fallbacks,
            spills=kv.park_disk.spills,
        ),
    )


def _slot_views(kv: KvSnapshot, state: LoopState, config: PolicyConfig, now_ms: int) -> list[SlotView]:
    eff, _ = effective_priorities(PolicyInput(kv=kv, now_ms=now_ms), config)
    views = []
    for s in kv.slots:
        since = s.park.parked_since_ms if s.state is SlotState.PARKED else None
        history = state.history.get(s.id_task) if s.id_task is not None else None
        arrived = s.t_arrival_ms if s.id_task is not None else None  # an age only while it serves a request
        views.append(
            SlotView(
                id=s.id,
                id_task=s.id_task,
                state=str(s.state),
                n_cells=s.cells,
                age_s=max(0, now_ms - arrived) / 1000 if arrived is not None else None,
                n_decoded=s.n_decoded,
                park_count=s.park.count,
                parked_since_ms=since,
                waited_s=(now_ms - since) / 1000 if since is not None else None,
                pinned=history is not None and history.pinned,
                auto_parked=s.park.auto,
                park_mode=str(s.park.mode) if s.park.mode is not None else None,
                park_tier=str(s.park.tier) if s.park.tier is not None else None,
                recomputing=s.park.recomputing,
                priority=s.priority,
                effective_priority=eff.get(s.id) if s.id_task is not None else None,
            )
        )
    return views


def _supervisor_view(supervisor: SupervisorStatus, failed_after: int) -> SupervisorView:
    last = supervisor.last_exit
    last_exit = None
    if last is not None:
        last_exit = ExitView(
            returncode=last.returncode,
            at_unix=last.at_unix,
            early=last.early,
            uptime_s=last.uptime_s,
            signal=last.signal,
            log_tail=list(last.log_tail),
        )
    return SupervisorView(
        state=str(supervisor.state),
        pid=supervisor.pid,
        starts=supervisor.starts,
        restarts=supervisor.restarts,
        ready_since_unix=supervisor.ready_since_unix,
        next_start_in_s=supervisor.next_start_in_s,
        last_exit=last_exit,
        early_exits=supervisor.early_exits,
        failed_after=failed_after,
        failure=supervisor.failure,
        argv=list(supervisor.argv),
    )


def _gpu_device_view(index: int, d: DeviceRoom) -> GpuDeviceView:
    return GpuDeviceView(
        index=index,
        name=d.name,
        used_bytes=d.used_bytes,
        free_bytes=d.free_bytes,
        total_bytes=d.total_bytes,
        server_bytes=d.server_bytes,
        others_bytes=d.others_bytes,
        others_growth_bytes=d.others_growth_bytes,
        device_id=d.device_id,
        source=d.source,
    )
