"""What the policy takes and gives: its configuration, its input snapshot, its actions, decisions and reasons."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TypeAlias

from controller.priorities import priority_class
from controller.settings import MiB, ParkTierChoice, PolicySettings, RestoreOrder
from controller.upstream.models import KvSnapshot, ParkMode, ParkTier


class ActionKind(StrEnum):
    PARK = "park"
    RESUME = "resume"
    END = "end"


class Reason(StrEnum):
    """Why an action was taken."""

    PRESSURE = "pressure"
    """park: the projected occupancy is at or above HIGH."""
    MAKE_ROOM = "make_room"
    """park: room for a request that has waited longer than max_wait."""
    DISPLACE = "displace"
    """park: room for a request waiting in kvctl's queue whose priority is strictly higher (policy.displacement)."""
    BELOW_LOW = "below_low"
    """resume: the projection after restoring stays at or below LOW."""
    NOTHING_RESIDENT = "nothing_resident"
    """resume: nothing else holds cells and the request fits the pool alone."""
    STARVATION = "starvation"
    """resume: the head of the restore order waited longer than max_wait; restored below HIGH."""
    CANNOT_FIT = "cannot_fit"
    """end: the request needs more cells than the pool holds, even alone."""
    MANUAL = "manual"
    """park or resume asked for through the admin API (never produced by the policy)."""


class ModeReason(StrEnum):
    """Why a park is by swap or by recompute."""

    FITS = "fits"
    """swap: the snapshot fits the budget and the host-RAM headroom, and copying is not slower (or unmeasured)."""
    BUDGET = "budget"
    """recompute: the snapshot exceeds what is left of the snapshot budget."""
    HOST_RAM = "host_ram"
    """recompute: the snapshot exceeds the host's available RAM less the reserve."""
    CHEAPER = "cheaper"
    """recompute: evaluating its tokens again takes less time than copying the snapshot out and back, as measured."""
    RECOMPUTE_ONLY = "recompute_only"
    """recompute: the server does not park by swap (--park-ram 0), or policy.snapshot_budget_mib is 0, or
    policy.park_tier is recompute."""
    DISK = "disk"
    """swap to the disk tier: host RAM cannot hold the snapshot (budget or headroom) or policy.park_tier is disk, the
    file fits the disk budget, and reading it back is not slower than evaluating the tokens again (or unmeasured)."""
    DISK_BUDGET = "disk_budget"
    """recompute: host RAM cannot hold the snapshot and the file exceeds what is left of the server's disk budget."""
    SPILL = "spill"
    """swap to RAM: the snapshot fits once the server moves parked snapshots of a lower priority from RAM to disk
    (they resume after it); the park waits for that move."""


class SkipReason(StrEnum):
    """Why a candidate was passed over."""

    LARGEST = "largest"
    BUDGET = "budget"
    """an older server (swap only): the snapshot exceeds what is left of the snapshot budget."""
    HOST_RAM = "host_ram"
    """an older server (swap only): the snapshot exceeds the host's available RAM less the reserve."""
    PARKING_OFF = "parking_off"
    """the server parks by no mode (--no-park)."""
    UNRESOLVED = "unresolved"
    """still at or above HIGH after every candidate: the server's safety net covers the rest."""
    ABOVE_LOW = "above_low"
    NO_FREE_CELLS = "no_free_cells"
    GPU_PRESSURE = "gpu_pressure"
    HEAD_OF_LINE = "head_of_line"
    PINNED = "pinned"
    NO_ROOM = "no_room"
    """a starving head that no permitted park can make room for."""
    PRIORITY = "priority"
    """park: its priority is above what the park is for; restore: a request of higher priority waits first."""
    AWAIT_EMPTY_POOL = "await_empty_pool"
    """cannot fit the pool even alone; ended once nothing else is resident."""
    MOVING = "moving"
    """restore: its snapshot is being copied (a park's copy not yet done, or a spill from RAM to disk); the server
    answers a resume 409 until that ends, a moment later."""


@dataclass(frozen=True, slots=True)
class TaskHistory:
    """What the controller remembers about one task (forgotten when the task or the server goes)."""

    parks: int = 0
    """Times this controller parked it."""
    pinned: bool = False
    """Parked by hand: the policy leaves it parked until it is resumed by hand."""

    def parked(self) -> TaskHistory:
        """The history after one more park by this controller."""
        return replace(self, parks=self.parks + 1)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    high: float = 0.94
    """Park at or above this ratio of a pool: ceil(high x n) projected cells, from its decimal value."""
    low: float = 0.80
    """Restore while the projection stays at or below this ratio of each pool: floor(low x n) cells."""
    budget_bytes: int = 8192 * MiB
    """0: park by recompute only (on a server that offers it; an older server then parks nothing)."""
    park_tier: ParkTierChoice = ParkTierChoice.AUTO
    host_reserve_bytes: int = 1024 * MiB
    margin_cells: int = 16
    order: RestoreOrder = RestoreOrder.AGING
    max_wait_ms: int = 30_000
    gpu_floor_bytes: int = 256 * MiB
    priority_max_wait_ms: int = 120_000
    """A request parked (or queued) longer than this counts as the highest priority present."""
    displacement: bool = True
    priority_high_at: int = 1
    priority_low_at: int = -1

    def priority_class(self, priority: int) -> str:
        return priority_class(priority, self.priority_high_at, self.priority_low_at)

    @classmethod
    def from_settings(cls, s: PolicySettings) -> PolicyConfig:
        return cls(
            high=s.high,
            low=s.low,
            budget_bytes=s.snapshot_budget_mib * MiB,
            park_tier=s.park_tier,
            host_reserve_bytes=s.host_ram_reserve_mib * MiB,
            margin_cells=s.restore_margin_cells,
            order=s.restore_order,
            max_wait_ms=int(s.max_wait_s * 1000),
            gpu_floor_bytes=s.gpu_headroom_mib * MiB,
            priority_max_wait_ms=int(s.priority_max_wait_s * 1000),
            displacement=s.displacement,
            priority_high_at=s.priority_high_at,
            priority_low_at=s.priority_low_at,
        )


@dataclass(frozen=True, slots=True)
class PolicyInput:
    kv: KvSnapshot
    now_ms: int
    """Wall-clock epoch milliseconds, the clock of the server's ``parked_since_ms``."""
    history: Mapping[int, TaskHistory] = field(default_factory=dict)
    """By ``id_task``."""
    host_available_bytes: int | None = None
    """psutil's available memory (the smaller of it and the server's ``host_ram_available_bytes`` applies);
    None: unknown, the server's alone applies (no host-RAM limit when neither is known)."""
    gpu_free_bytes: int | None = None
    """The tightest GPU's free memory; None: no GPU (NVML absent)."""
    queued: QueuedRequest | None = None
    """The head of kvctl's admission queue (the next new request to start), if one waits."""


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    priority: int
    cells: int
    """Its prompt's estimated cells."""
    waited_ms: int


@dataclass(frozen=True, slots=True)
class Pressure:
    target: float
    """Projected occupancy of the target pool."""
    draft: float | None
    """Projected occupancy of the draft pool, when there is one."""
    gpu_low: bool = False
    """A GPU's free memory is under the floor."""
    swa: float | None = None
    """Projected occupancy of an iSWA model's sliding-window pool, when there is one."""

    @property
    def value(self) -> float:
        """The larger of the target's and the draft's; the window pool's only once it would overflow (over 1): it is
        held to its size, not to the watermarks (see ``Pool``)."""
        value = self.target if self.draft is None else max(self.target, self.draft)
        return max(value, self.swa) if self.swa is not None and self.swa > 1.0 else value


@dataclass(frozen=True, slots=True)
class Action:
    kind: ActionKind
    slot: int
    id_task: int
    reason: Reason
    n_cells: int
    n_bytes: int
    """Host RAM the action takes (park) or frees (resume): a swap's snapshot size, 0 for a recompute."""
    projected_after: float
    """The pressure this decision expects once the action is done."""
    waited_ms: int | None = None
    """For resume and end: how long the request has been parked."""
    mode: ParkMode | None = None
    """For a park: by swap or by recompute."""
    mode_reason: ModeReason | None = None
    """For a park: why that mode."""
    tier: ParkTier | None = None
    """For a park on a server with tiers: where its cells go (none: a recompute); None: a server without tiers."""
    priority: int = 0
    """The request's own priority (its metrics class); the policy ordered by its effective priority."""
    spill_bytes: int = 0
    """For a park to RAM (ModeReason.SPILL): the bytes of the snapshots the server moves to disk first."""


@dataclass(frozen=True, slots=True)
class Skip:
    kind: ActionKind
    slot: int
    id_task: int
    reason: SkipReason


@dataclass(frozen=True, slots=True)
class Decision:
    pressure: Pressure
    actions: tuple[Action, ...] = ()
    skipped: tuple[Skip, ...] = ()
    projected_after: float = 0.0

    @property
    def parks(self) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.kind is ActionKind.PARK)

    @property
    def resumes(self) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.kind is ActionKind.RESUME)


@dataclass(frozen=True, slots=True)
class Admission:
    admit: bool
    reason: str
    allowance: int | None = None
    """How many new requests (of the reserved size each) may start before the next snapshot; None: no limit."""
    room_cells: int | None = None
    """Cells new requests may add (a prompt and its first step each) with the projection staying below HIGH."""
    empty: bool = False
    """Nothing is resident: one request starts whatever its size (the pool is all its own)."""
    min_priority: int | None = None
    """The admission is for requests of this effective priority or higher only: parked requests of lower ones wait
    (they are restored first). None: any priority."""


# --- accounting --------------------------------------------------------------------------------

PerPool: TypeAlias = tuple[int, ...]
"""One number of cells per pool: the target pool's, then the draft pool's when there is one."""
