"""The admin API's wire models: what ``GET /status`` and ``POST /slots/{id}/park|resume`` answer, which ``kvctl
status``, ``kvctl park`` and ``kvctl resume`` read back. Data only, importing nothing of the running controller,
so that the CLI reads them without importing the loop (controller.admin.status builds the status from the loop's state).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict

__all__ = [
    "SCHEMA_VERSION",
    "DiskView",
    "ExitView",
    "GpuDeviceView",
    "LoopView",
    "ManualAction",
    "ManualResult",
    "PoolView",
    "SlotView",
    "Status",
    "SupervisorView",
    "SwaPoolView",
    "UpstreamView",
]

SCHEMA_VERSION = 9
"""2: added ``degraded``, ``uptime_s``, ``upstream.state``, the pool's ``parked_budget_bytes`` and
``above_high_s``, the slots' ``age_s`` and ``n_decoded``, ``host_total_bytes`` and ``gpu_devices``.
3: added the slots' ``park_mode`` and ``recomputing``. 4: added the slots' ``priority`` and
``effective_priority``. 5: added the pool's ``swa`` (an iSWA model's window pool). 6: added the supervisor's
``failed`` state (also ``upstream.state``), its ``early_exits``, ``failed_after`` and ``failure``, and the last
exit's ``signal`` and ``log_tail``; the supervisor's ``pid`` is null once the server has exited. 7: added the
supervisor's ``argv`` (a planned restart may change it). 8: added the pool's ``disk`` (the server's disk tier;
``parked_bytes`` is host RAM only) and the slots' ``park_tier``. 9: added the disk tier's ``spills``."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True)


class UpstreamView(_Model):
    url: str
    state: str
    """``up``, ``down``, or with ``--spawn`` the supervised server's ``loading``, ``restarting``, ``failed``,
    ``stopped``."""
    up: bool
    last_error: str | None
    polls: int
    last_poll_age_s: float | None
    backoff_s: float | None
    lease_held: bool | None
    exact: bool | None = None
    """The server runs in the batch-invariant mode (`--exact`): every request's tokens equal the same request's run
    alone, whatever else runs beside it and through every park; None when it is down or does not say."""


class ExitView(_Model):
    returncode: int
    """Negative: killed by that signal (``signal``); 127: it could not be started."""
    at_unix: float
    early: bool
    """It exited before it was ready (``/health`` 200)."""
    uptime_s: float
    signal: str | None = None
    """The signal's name (``SIGSEGV``, ``SIGKILL``) when a signal killed it; None when it exited."""
    log_tail: list[str] = []
    """The last lines it wrote (at most 20, each cut at 500 characters); for a start that failed, kvctl's error."""


class SupervisorView(_Model):
    state: str
    """``stopped``, ``starting``, ``ready``, ``backoff``, ``failed`` (no more starts: ``failure`` says why) or
    ``stopping``."""
    pid: int | None
    starts: int
    restarts: int
    ready_since_unix: float | None
    next_start_in_s: float | None
    last_exit: ExitView | None
    early_exits: int = 0
    """Starts in a row that died before the server was ready; reset once it is ready."""
    failed_after: int = 0
    """supervisor.failed_after: the early exits in a row that make the state ``failed``; 0: never."""
    failure: str | None = None
    """Why the state is ``failed``, in words (the message requests get meanwhile); None before."""
    argv: list[str] = []
    """The command line the server runs with: ``supervisor.spawn``, or the last planned restart's."""


class SwaPoolView(_Model):
    """An iSWA model's sliding-window pool (held to its size, not to the watermarks)."""

    n_cells: int
    n_cells_used: int
    """Cells inside some sequence's window; those a window has left are reused and count as free."""
    n_swa: int
    projected: float


class PoolView(_Model):
    n_cells: int
    n_cells_used: int
    used_ratio: float
    projected_target: float
    projected_draft: float | None
    swa: SwaPoolView | None = None
    """The sliding-window pool of an iSWA model (Gemma 2 and 3, ...); None for other models."""
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
    """What parked snapshots may hold in host RAM: the smaller of policy.snapshot_budget_mib and the server's
    --park-ram."""
    disk: DiskView | None = None
    """The server's disk tier (--park-disk); None: it has none."""


class DiskView(_Model):
    """The server's disk tier for snapshots that host RAM does not hold."""

    dir: str
    used_bytes: int
    budget_bytes: int
    files: int
    write_bytes_per_s: float | None
    read_bytes_per_s: float | None
    fallbacks: int
    """Snapshot files the server could not write or read back whole since it started (recomputed instead)."""
    spills: int | None = None
    """Snapshots the server moved from RAM to disk for a newer park of a higher priority since it started; None: a
    server that does not move them."""


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
    park_tier: str | None = None
    """Where a parked request's cells are: ``ram``, ``disk``, or ``none`` (a recompute); None otherwise."""
    recomputing: bool = False
    """Resumed after a recompute park, evaluating its tokens again."""
    priority: int | None = None
    """Its request's priority (higher = more important); None: idle, or a server that does not say."""
    effective_priority: int | None = None
    """The priority the policy orders it by: its own, or the highest present once it has waited (parked) longer
    than policy.priority_max_wait_s."""


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


class KeeperView(_Model):
    """The worker under the keeper (controller.keeper): which process serves now, and how its reloads went."""

    pid: int
    """This worker's process id: ``kvctl reload`` waits for another one to answer."""
    reloads_failed: int
    """Reloads whose new worker died before it took over (this one went on serving)."""
    last_reload_error: str | None
    listen_unchanged: str | None = None
    """Listen addresses this worker's settings ask for that the keeper did not take: it bound its listeners once, and
    they change only when kvctl restarts (a reload keeps them); None when the settings and the listeners agree."""


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
    keeper: KeeperView | None = None
    """Under the keeper: the worker's process and reloads; None when kvctl runs without it."""
    """Why restores and admissions wait for GPU memory (others took memory since the server started); None if not."""


class ManualAction(StrEnum):
    PARK = "park"
    RESUME = "resume"


class ManualResult(_Model):
    """The answer to a manual park or resume."""

    slot: int
    id_task: int
    action: ManualAction
    pinned: bool
    """The policy leaves the request parked until it is resumed by hand."""
    detail: str
    n_cells: int = 0
    n_bytes: int = 0
    mode: str | None = None
    """The mode the server parked (or had parked) it by; None where it does not say (an older server)."""
