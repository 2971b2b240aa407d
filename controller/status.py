"""The status model: what ``GET /status`` answers and ``kvctl status`` prints, built from the
loop's and the supervisor's state. Data only; rendering is the caller's."""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from controller.loop import LoopState
from controller.policy import PolicyConfig, pressure
from controller.probes.gpu import GpuState
from controller.supervisor import SupervisorState, SupervisorStatus
from controller.upstream import SlotState

__all__ = [
    "SCHEMA_VERSION",
    "GpuDeviceView",
    "LoopView",
    "PoolView",
    "SlotView",
    "Status",
    "SupervisorView",
    "UpstreamView",
    "build_status",
    "upstream_state",
]

SCHEMA_VERSION = 3
"""2: added ``degraded``, ``uptime_s``, ``upstream.state``, the pool's ``parked_budget_bytes`` and
``above_high_s``, the slots' ``age_s`` and ``n_decoded``, ``host_total_bytes`` and ``gpu_devices``.
3: added the slots' ``park_mode`` and ``recomputing``."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class UpstreamView(_Model):
    url: str
    state: str
    """``up``, ``down``, or with ``--spawn`` the supervised server's ``loading``, ``restarting``, ``stopped``."""
    up: bool
    last_error: str | None
    polls: int
    last_poll_age_s: float | None
    backoff_s: float | None
    lease_held: bool | None


class ExitView(_Model):
    returncode: int
    at_unix: float
    early: bool
    uptime_s: float


class SupervisorView(_Model):
    state: str
    pid: int | None
    starts: int
    restarts: int
    ready_since_unix: float | None
    next_start_in_s: float | None
    last_exit: ExitView | None


class PoolView(_Model):
    n_cells: int
    n_cells_used: int
    used_ratio: float
    projected_target: float
    projected_draft: float | None
    pressure: float
    high: float
    low: float
    max_pressure: float
    """The largest pressure seen at a poll since kvctl started."""
    max_growth: float
    """The largest rise of the pressure within one poll interval."""
    above_high_s: float | None
    """Seconds the pressure has stayed at or above HIGH without a poll below it; None while below."""
    n_parked: int
    parked_bytes: int
    parked_budget_bytes: int
    """What parked snapshots may hold: the smaller of policy.snapshot_budget_mib and the server's --park-ram."""


class SlotView(_Model):
    id: int
    id_task: int | None
    state: str
    n_cells: int
    """Resident cells; for a parked request, the cells its resume needs."""
    age_s: float | None
    """Seconds since its request arrived; None for an idle slot."""
    n_decoded: int
    """Tokens generated so far for its request."""
    park_count: int
    parked_since_ms: int | None
    waited_s: float | None
    pinned: bool
    auto_parked: bool
    park_mode: str | None = None
    """``swap`` or ``recompute`` for a parked request (or one evaluating its tokens again); None otherwise."""
    recomputing: bool = False
    """Resumed after a recompute park, evaluating its tokens again."""


class LoopView(_Model):
    alive: bool
    heartbeat_age_s: float
    restarts: int
    parks: int
    resumes: int
    ends: int
    action_failures: int


class GpuDeviceView(_Model):
    """A device the server runs on (it names them in /kv), its memory by NVML where kvctl sees it (matched by PCI bus
    id), else by the server's backend."""

    index: int
    name: str | None
    used_bytes: int | None
    """None where the device does not report it."""
    free_bytes: int | None
    total_bytes: int | None
    server_bytes: int | None = None
    """The server's own buffers on it."""
    others_bytes: int | None = None
    """Everything else on it: other processes and the driver."""
    others_growth_bytes: int | None = None
    """How much others took since the server started: what can hold restores and admissions back."""
    device_id: str | None = None
    source: str | None = None
    """``nvml`` or ``server``."""


class Status(_Model):
    schema_version: int = SCHEMA_VERSION
    version: str
    uptime_s: float
    """Seconds since kvctl's admin listener started."""
    ready: bool
    """Upstream up and the pool not saturated (with hysteresis): what ``/readyz`` answers."""
    degraded: bool
    """Upstream down, the supervised server loading or restarting, the control loop stalled, or the pressure at
    or above HIGH for longer than admin.degraded_after_s: what ``kvctl status`` exits 1 for. Crossing HIGH is
    normal operation, and so is a saturated (not ready) pool the policy is working through."""
    problems: list[str]
    """What is wrong, in words: why it is not ready or degraded; empty when neither."""
    upstream: UpstreamView
    supervisor: SupervisorView | None
    pool: PoolView | None
    slots: list[SlotView]
    loop: LoopView
    host_available_bytes: int | None
    host_total_bytes: int | None
    gpu: str
    """``ok`` when the server reports the devices it runs on, ``absent`` when it runs on none (a CPU build, or an
    older server that does not say), ``error`` when NVML failed to read them."""
    gpu_devices: list[GpuDeviceView]
    gpu_held: str | None = None
    """Why restores and admissions wait for GPU memory (others took memory since the server started); None if not."""


_SUPERVISED_STATE = {
    SupervisorState.STARTING: "loading",
    SupervisorState.BACKOFF: "restarting",
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
    above_high_s: float | None = None,
    now_ms: int | None = None,
) -> Status:
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    mono = time.monotonic()
    kv = state.snapshot if state.upstream_up else None
    pool = None
    slots: list[SlotView] = []
    if kv is not None:
        p = pressure(kv)
        pool = PoolView(
            n_cells=kv.n_cells,
            n_cells_used=kv.n_cells_used,
            used_ratio=kv.used_ratio,
            projected_target=p.target,
            projected_draft=p.draft,
            pressure=p.value,
            high=config.high,
            low=config.low,
            max_pressure=state.max_pressure,
            max_growth=state.max_growth,
            above_high_s=above_high_s,
            n_parked=kv.n_parked,
            parked_bytes=kv.parked_bytes,
            parked_budget_bytes=min(
                config.budget_bytes,
                kv.park_ram_budget_bytes if kv.park_ram_budget_bytes is not None else config.budget_bytes,
            ),
        )
        for s in kv.slots:
            since = s.park.parked_since_ms if s.state is SlotState.PARKED else None
            history = state.history.get(s.id_task) if s.id_task is not None else None
            slots.append(
                SlotView(
                    id=s.id,
                    id_task=s.id_task,
                    state=str(s.state),
                    n_cells=s.cells,
                    age_s=max(0, now_ms - s.t_arrival_ms) / 1000
                    if s.t_arrival_ms is not None and s.id_task is not None
                    else None,
                    n_decoded=s.n_decoded,
                    park_count=s.park.count,
                    parked_since_ms=since,
                    waited_s=(now_ms - since) / 1000 if since is not None else None,
                    pinned=history is not None and history.pinned,
                    auto_parked=s.park.auto,
                    park_mode=str(s.park.mode) if s.park.mode is not None else None,
                    recomputing=s.park.recomputing,
                )
            )
    sup = None
    if supervisor is not None:
        last = supervisor.last_exit
        sup = SupervisorView(
            state=str(supervisor.state),
            pid=supervisor.pid,
            starts=supervisor.starts,
            restarts=supervisor.restarts,
            ready_since_unix=supervisor.ready_since_unix,
            next_start_in_s=supervisor.next_start_in_s,
            last_exit=ExitView(
                returncode=last.returncode, at_unix=last.at_unix, early=last.early, uptime_s=last.uptime_s
            )
            if last is not None
            else None,
        )
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
        ),
        supervisor=sup,
        pool=pool,
        slots=slots,
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
        gpu_devices=[
            GpuDeviceView(
                index=i,
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
            for i, d in enumerate(room.devices)
        ],
        gpu_held=room.held,
    )
