"""The status model: what ``GET /status`` answers and ``kvctl status`` prints, built from the
loop's and the supervisor's state. Data only; rendering is the caller's."""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from controller.loop import LoopState
from controller.policy import PolicyConfig, pressure
from controller.supervisor import SupervisorStatus
from controller.upstream import SlotState

__all__ = ["SCHEMA_VERSION", "Status", "build_status"]

SCHEMA_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class UpstreamView(_Model):
    url: str
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
    n_parked: int
    parked_bytes: int


class SlotView(_Model):
    id: int
    id_task: int | None
    state: str
    n_cells: int
    """Resident cells; for a parked request, the cells its resume needs."""
    park_count: int
    parked_since_ms: int | None
    waited_s: float | None
    pinned: bool
    auto_parked: bool


class LoopView(_Model):
    alive: bool
    heartbeat_age_s: float
    restarts: int
    parks: int
    resumes: int
    ends: int
    action_failures: int


class Status(_Model):
    schema_version: int = SCHEMA_VERSION
    version: str
    ready: bool
    """Upstream up and the pool not saturated (with hysteresis): what ``/readyz`` answers."""
    problems: list[str]
    """Why it is not ready, in words; empty when ready."""
    upstream: UpstreamView
    supervisor: SupervisorView | None
    pool: PoolView | None
    slots: list[SlotView]
    loop: LoopView
    host_available_bytes: int | None
    gpu: str


def build_status(
    *,
    version: str,
    url: str,
    state: LoopState,
    config: PolicyConfig,
    loop_alive: bool,
    ready: bool,
    problems: list[str],
    supervisor: SupervisorStatus | None,
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
            n_parked=kv.n_parked,
            parked_bytes=kv.parked_bytes,
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
                    park_count=s.park.count,
                    parked_since_ms=since,
                    waited_s=(now_ms - since) / 1000 if since is not None else None,
                    pinned=history is not None and history.pinned,
                    auto_parked=s.park.auto,
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
    return Status(
        version=version,
        ready=ready,
        problems=problems,
        upstream=UpstreamView(
            url=url,
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
        gpu=str(state.gpu.state) if state.gpu is not None else "absent",
    )
