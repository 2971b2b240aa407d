"""The watermark policy: a snapshot in, ordered park and restore actions out, each with its reason.

Pure functions: no I/O and no clock (the time comes in with the snapshot), so the same input
always gives the same decision, whatever order the slots are listed in.

Projected cells of a pool = cells held by requests in progress + the cells the next decode step may
add + the unprefilled rest of every prompt in progress, for the target pool and for the draft pool
when there is one; projected occupancy (the pressure) is projected cells / pool cells, the larger of
the two. Cells held by *idle* slots are left out: they are only a prompt cache, which the server
clears before a decode step fails (upstream's idle-slot clearing, the safety net's second rung) and
before a resume lacks room.

Decisions compare cells, never ratios: each watermark is turned once per pool size into whole cells,
exactly, from its decimal value as the settings write it (0.94 of 1000 cells is 940, with no float
rounding at the edge), so "at or above HIGH" is projected cells >= ceil(high x n), "below HIGH" is at
most ceil(high x n) - 1 and "at or below LOW" is at most floor(low x n), in every pool. The ratios
(``Pressure``, ``projected_after``) are for reporting alone.

What the projection reserves beyond the cells held, the *step*, is
``n_gen + n_draft_max + max(n_prompt_max, sum of n_prefill_left over slots in state prompt)``: the
server's ``next_step.n_prompt_max`` bounds one step only (a batch), while a prompt goes on taking cells
until it is evaluated, and a restore or an admission decided now must leave it that room. It is the max,
not the sum, since the next step's prompt tokens are part of that rest. So a request resumed by
recompute, evaluating its tokens again (state ``prompt``, ``park.recomputing``), counts at its full
length until it generates again, and a parked request counts at its full length (``park.n_cells``)
when a restore is weighed, whichever mode it was parked by.

* At or above HIGH, park victims until the projection is below HIGH: newest first (latest
  ``t_arrival_ms``, ties by ``id_task``), passing over requests parked before while another
  candidate exists; never the largest resident request.
* Each victim's park mode (``ModeReason`` says why): by swap (a copy of its cells in host RAM) when
  its snapshot (the server's ``park.snapshot_bytes``, else n_cells x bytes_per_cell) fits what is left
  of the snapshot budget (the smaller of ``snapshot_budget_mib`` and the server's ``--park-ram``, less
  what is parked) and of the host-RAM headroom (the smaller of psutil's and the server's available
  memory, less ``host_ram_reserve_mib``), unless the server's measured rates say evaluating its tokens
  again takes less time than copying the snapshot out and back; by recompute otherwise (its cells freed,
  evaluated again on resume: no host RAM), and always when the server offers only recompute or
  ``snapshot_budget_mib`` is 0. Only swaps use up budget and headroom. With a server that offers
  recompute, no victim is passed over for memory; an older server that lists no modes parks by swap
  only, and a victim whose snapshot does not fit is passed over (``budget``, ``host_ram``).
* Restore while the projection after restoring (the request's cells, its next-step cells and a
  margin) stays at or below LOW. Default order (``aging``): the seed's order (most-parked first, then
  longest-waiting, passing over what does not fit), except that requests parked for half of
  ``max_wait`` or longer go ahead of the others. A request parked again soon after its resume
  comes back first, as in the seed; one that has waited long is not kept behind it. ``seed`` is
  the seed's order alone; ``fifo`` is head-of-line by park time (nobody overtakes the head).
* Priorities (higher = more important): victims go lowest effective priority first, then as above, and the
  protected request is the largest resident one of the highest priority present; restores go highest first,
  then in the restore order. A request parked (or queued in kvctl) longer than ``priority_max_wait`` counts as
  the highest priority present. The head of kvctl's admission queue holds back restores of lower priorities
  while a slot is free for it and, when the pool has no room for it, displaces running requests of strictly lower
  priority (``displacement``).
* No request waits forever: when nothing is resident, the head is restored if it fits the pool
  alone; when the head has waited longer than ``max_wait``, it is restored below HIGH, LOW
  notwithstanding, parking newer requests to make room if it must (never the largest: someone must
  be able to finish; never one of higher priority than the head). A request that cannot fit the pool even alone
  is ended.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from fractions import Fraction
from typing import TypeAlias

from controller.priorities import priority_class
from controller.settings import MiB, PolicySettings, RestoreOrder
from controller.upstream.models import KvSnapshot, ParkMode, ParkRates, Slot, SlotState

__all__ = [
    "Action",
    "ActionKind",
    "Admission",
    "Decision",
    "ModeReason",
    "PolicyConfig",
    "PolicyInput",
    "Pressure",
    "QueuedRequest",
    "Reason",
    "Skip",
    "SkipReason",
    "TaskHistory",
    "admission",
    "decide",
    "effective_priorities",
    "largest_resident",
    "pressure",
    "priority_class",
]


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
    """recompute: the server does not park by swap (--park-ram 0), or policy.snapshot_budget_mib is 0."""


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
        held to its size, not to the watermarks (see ``_Pool``)."""
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
    priority: int = 0
    """The request's own priority (its metrics class); the policy ordered by its effective priority."""


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

_PerPool: TypeAlias = tuple[int, ...]
"""One number of cells per pool: the target pool's, then the draft pool's when there is one."""


def _exact(watermark: float) -> Fraction:
    """The watermark's decimal value, as the settings write it: ``Fraction(0.94)``, the float's binary value, is
    0.93999999999999994671..., and its product with a pool size lands a hair off whole cells."""
    return Fraction(str(watermark))


@dataclass(slots=True)
class _Pool:
    """Cell accounting of one decision, updated as actions are planned."""

    n_target: int
    used_target: int  # physically used, idle caches included
    n_draft: int | None
    used_draft: int
    idle: int  # cells held by idle slots: a prompt cache the server clears when a step or a resume needs room
    step: int  # cells the next decode step may add
    # an iSWA model's sliding-window pool (None: the model has none). A sequence holds at most ``window`` cells
    # there (the window of its last positions; the cells it has left are reused), and llama.cpp sizes the pool to
    # one window per slot plus a batch, so it is held to its size, not to the watermarks: parking before it is
    # full would park requests that fit. It takes part in the checks that a step, a park or a restore keeps every
    # pool within its cap, not in the room admission offers (a new request's window always fits a free slot's).
    n_swa: int | None = None
    used_swa: int = 0  # cells inside some sequence's window
    idle_swa: int = 0
    step_swa: int = 0  # one decode step's cells: a window pool needs only the next batch beyond the windows
    window: int = 0

    def sizes(self) -> _PerPool:
        return (self.n_target, self.n_draft) if self.n_draft else (self.n_target,)

    def _swa_cells(self, cells: int) -> int:
        return min(cells, self.window) if self.window > 0 else cells

    def projected(self, extra_cells: int = 0, extra_step: int = 0, *, swa: bool = True) -> _PerPool:
        """Projected cells of each pool, with ``extra_cells`` more held and ``extra_step`` more in the next step; the
        window pool's last, where there is one (and ``swa``)."""
        step = max(0, self.step + extra_step)
        target = max(0, self.used_target - self.idle) + extra_cells + step
        out: tuple[int, ...] = (target,)
        if self.n_draft:
            out += (max(0, self.used_draft - self.idle) + extra_cells + step,)
        if swa and self.n_swa:
            out += (
                max(0, self.used_swa - self.idle_swa)
                + self._swa_cells(extra_cells)
                + max(0, self.step_swa + self._swa_cells(max(0, extra_step))),
            )
        return out

    def _with_swa(self, caps: _PerPool) -> _PerPool:
        return (*caps, self.n_swa) if self.n_swa else caps

    def below(self, watermark: float) -> _PerPool:
        """The most projected cells each pool may hold and stay strictly below ``watermark``: ceil(w x n) - 1, since
        ceil(w x n) cells are at or above it (the window pool: its size)."""
        return self._with_swa(tuple(math.ceil(_exact(watermark) * n) - 1 for n in self.sizes()))

    def up_to(self, watermark: float) -> _PerPool:
        """The most projected cells each pool may hold and stay at or below ``watermark``: floor(w x n) (the window
        pool: its size)."""
        return self._with_swa(tuple(math.floor(_exact(watermark) * n) for n in self.sizes()))

    def within(self, cap: _PerPool, extra_cells: int = 0, extra_step: int = 0) -> bool:
        """Every pool's projected cells, with the extra ones, are at most its ``cap``."""
        return all(cells <= most for cells, most in zip(self.projected(extra_cells, extra_step), cap, strict=True))

    def room(self, cap: _PerPool) -> int:
        """Cells that may still be added to the target and draft pools, held or in the next step, within ``cap``
        (negative: over)."""
        return min(most - cells for cells, most in zip(self.projected(swa=False), cap, strict=False))

    def ratios(self) -> tuple[float, ...]:
        """Projected occupancy of the target (and draft) pool, then of the window pool where there is one; for
        reporting only: decisions compare cells."""
        sizes = self._with_swa(self.sizes())
        return tuple(cells / n for cells, n in zip(self.projected(), sizes, strict=True))

    def ratio(self) -> float:
        ratios = self.ratios()
        if not self.n_swa:
            return max(ratios)
        *rest, swa = ratios
        return max(*rest, swa) if swa > 1.0 else max(rest)

    def free(self) -> int:
        """Cells a resume can have: the free ones and those of idle slots, which a resume clears."""
        free = self.n_target - self.used_target + self.idle
        if self.n_draft:
            free = min(free, self.n_draft - self.used_draft + self.idle)
        return free

    def fits(self, cells: int) -> bool:
        """A request of ``cells`` cells fits the free cells of every pool (its window's share of the window pool)."""
        if cells > self.free():
            return False
        return not self.n_swa or self._swa_cells(cells) <= self.n_swa - self.used_swa + self.idle_swa

    def capacity(self) -> int:
        return min(self.sizes())

    def remove(self, slot: Slot) -> None:
        self.used_target = max(0, self.used_target - slot.cells)
        self.used_draft = max(0, self.used_draft - slot.cells)  # the draft sequence mirrors the target's
        self.used_swa = max(0, self.used_swa - self._swa_cells(slot.cells))
        if slot.state is SlotState.GENERATING:
            self.step = max(0, self.step - _step_cells(slot))

    def add(self, slot: Slot) -> None:
        self.used_target += slot.cells
        self.used_draft += slot.cells
        self.used_swa += self._swa_cells(slot.cells)
        self.step += _step_cells(slot)


def _step_cells(slot: Slot) -> int:
    """What a generating request adds in one decode step: a token and its drafts."""
    return 1 + max(0, slot.n_draft_max)


def _pool(kv: KvSnapshot) -> _Pool:
    idle = sum(s.cells for s in kv.slots if s.state is SlotState.IDLE)
    # every prompt in progress reserves its whole rest, not only the next step's share (module docstring)
    prefill = sum(max(0, s.n_prefill_left) for s in kv.slots if s.state is SlotState.PROMPT)
    step = kv.next_step.n_total_max + max(0, prefill - kv.next_step.n_prompt_max)
    swa = kv.swa if kv.swa is not None and kv.swa.n_cells > 0 else None
    window = swa.n_swa if swa is not None else 0
    return _Pool(
        n_target=kv.n_cells,
        used_target=kv.n_cells_used,
        n_draft=kv.draft.n_cells if kv.draft is not None and kv.draft.n_cells > 0 else None,
        used_draft=kv.draft.n_cells_used if kv.draft is not None else 0,
        idle=idle,
        step=step,
        n_swa=swa.n_cells if swa is not None else None,
        used_swa=swa.n_cells_used if swa is not None else 0,
        idle_swa=sum(min(s.cells, window) for s in kv.slots if s.state is SlotState.IDLE) if window else 0,
        step_swa=kv.next_step.n_total_max,
        window=window,
    )


def pressure(kv: KvSnapshot, gpu_low: bool = False) -> Pressure:
    """Projected occupancy of the target and draft pools (see the module docstring)."""
    if kv.n_cells <= 0:
        return Pressure(0.0, None, gpu_low)
    pool = _pool(kv)
    ratios = list(pool.ratios())
    swa = ratios.pop() if pool.n_swa else None
    return Pressure(ratios[0], ratios[1] if len(ratios) > 1 else None, gpu_low, swa)


def _arrival(slot: Slot) -> int:
    return slot.t_arrival_ms if slot.t_arrival_ms is not None else 0


def _task(slot: Slot) -> int:
    return slot.id_task if slot.id_task is not None else -1


def largest_resident(slots: Sequence[Slot]) -> Slot | None:
    """The request holding the most cells; ties go to the oldest (it has waited for its cells longest)."""
    resident = [s for s in slots if s.is_resident]
    if not resident:
        return None
    return max(resident, key=lambda s: (s.cells, -_arrival(s), -_task(s), -s.id))


def _snapshot_bytes(slot: Slot, kv: KvSnapshot) -> int:
    """Host RAM a swap park of a generating slot takes: the server's exact size, else n_cells x bytes_per_cell
    (an older server; it underestimates hybrid and iSWA models)."""
    if slot.park.snapshot_bytes is not None:
        return slot.park.snapshot_bytes
    return slot.cells * kv.bytes_per_cell


def _recompute_cheaper(n_cells: int, n_bytes: int, rates: ParkRates) -> bool:
    """Evaluating the tokens again takes less time than copying the snapshot out and back (a park and its resume),
    at the rates the server measured; False while either is unmeasured."""
    copy, prompt = rates.copy_bytes_per_s, rates.prompt_tokens_per_s
    if copy is None or prompt is None or copy <= 0 or prompt <= 0:
        return False
    return n_cells / prompt < 2 * n_bytes / copy


def effective_priorities(inp: PolicyInput, cfg: PolicyConfig) -> tuple[dict[int, int], int | None]:
    """Each request's effective priority by slot id, and the queued head's (None without one): its own priority, or,
    once it has waited (parked, or queued) longer than ``priority_max_wait``, the highest priority present, so that
    every wait is bounded by a setting whatever the priorities."""
    kv = inp.kv
    own = {s.id: s.priority or 0 for s in kv.slots if s.id_task is not None}
    q = inp.queued
    top = max([*own.values(), *([q.priority] if q is not None else [])], default=0)
    eff = dict(own)
    for slot in kv.slots:
        since = slot.park.parked_since_ms
        if slot.id in own and slot.state is SlotState.PARKED and since is not None:
            if inp.now_ms - since >= cfg.priority_max_wait_ms:
                eff[slot.id] = top
    head = None if q is None else top if q.waited_ms >= cfg.priority_max_wait_ms else q.priority
    return eff, head


# --- one decision --------------------------------------------------------------------------------


@dataclass(slots=True)
class _Plan:
    cfg: PolicyConfig
    inp: PolicyInput
    pool: _Pool
    high: _PerPool
    """The most projected cells below HIGH, per pool."""
    low: _PerPool
    """The most projected cells at or below LOW, per pool."""
    gpu_low: bool
    budget_left: float
    host_left: float
    protected: Slot | None
    """The largest resident request of the highest priority present: never parked, so someone finishes."""
    slots: list[Slot]
    """Every slot, by id."""
    residents: list[Slot]
    eff: dict[int, int]
    """Effective priorities by slot id (effective_priorities())."""
    queued: int | None
    """The queued head's effective priority; None: nobody waits in kvctl's queue."""
    actions: list[Action] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)

    @classmethod
    def start(cls, inp: PolicyInput, cfg: PolicyConfig, gpu_low: bool) -> _Plan:
        """Before any action: the watermarks in cells, what is left of the snapshot budget (the smaller of ours and
        the server's, less what is parked) and of the host-RAM headroom, and the request never parked."""
        kv = inp.kv
        server_budget = kv.park_ram_budget_bytes if kv.park_ram_budget_bytes is not None else math.inf
        host_left: float = math.inf
        available = [b for b in (inp.host_available_bytes, kv.host_ram_available_bytes) if b is not None]
        if available:
            host_left = max(0, min(available) - cfg.host_reserve_bytes)
        pool = _pool(kv)
        slots = sorted(kv.slots, key=lambda s: s.id)
        eff, queued = effective_priorities(inp, cfg)
        residents = [s for s in slots if s.is_resident]
        top = max((eff.get(s.id, 0) for s in residents), default=0)
        return cls(
            cfg=cfg,
            inp=inp,
            pool=pool,
            high=pool.below(cfg.high),
            low=pool.up_to(cfg.low),
            gpu_low=gpu_low,
            budget_left=max(0.0, min(cfg.budget_bytes, server_budget) - kv.parked_bytes),
            host_left=host_left,
            protected=largest_resident([s for s in residents if eff.get(s.id, 0) == top]),
            slots=slots,
            residents=residents,
            eff=eff,
            queued=queued,
        )

    def below_high(self) -> bool:
        return self.pool.within(self.high)

    def decision(self, start: Pressure) -> Decision:
        return Decision(start, tuple(self.actions), tuple(self.skipped), self.pool.ratio())

    def skip(self, kind: ActionKind, slot: Slot, reason: SkipReason) -> None:
        self.skipped.append(Skip(kind, slot.id, _task(slot), reason))

    def history(self, slot: Slot) -> TaskHistory:
        return self.inp.history.get(_task(slot), TaskHistory())

    def priority(self, slot: Slot) -> int:
        return self.eff.get(slot.id, 0)

    def waited(self, slot: Slot) -> int:
        since = slot.park.parked_since_ms
        return self.inp.now_ms - since if since is not None else 0

    def parked_before(self, slot: Slot) -> bool:
        return slot.park.count > 0 or self.history(slot).parks > 0

    def victims(self) -> list[Slot]:
        """Park candidates in order: the lowest effective priority first; within one, never parked before first,
        then newest first."""
        cands = [s for s in self.residents if s.state is SlotState.GENERATING and s.id_task is not None]
        return sorted(cands, key=lambda s: (self.priority(s), self.parked_before(s), -_arrival(s), -_task(s), -s.id))

    def park_mode(self, slot: Slot) -> tuple[ParkMode, ModeReason, int] | SkipReason:
        """How to park this victim now, with why and the host RAM it takes; or why it cannot be parked."""
        kv = self.inp.kv
        modes = (ParkMode.SWAP,) if kv.park_modes is None else kv.park_modes  # an older server swaps only
        recompute = ParkMode.RECOMPUTE in modes
        if ParkMode.SWAP not in modes or (recompute and self.cfg.budget_bytes == 0):
            if recompute:
                return ParkMode.RECOMPUTE, ModeReason.RECOMPUTE_ONLY, 0
            return SkipReason.PARKING_OFF
        n_bytes = _snapshot_bytes(slot, kv)
        if n_bytes > self.budget_left:
            why, skip = ModeReason.BUDGET, SkipReason.BUDGET
        elif n_bytes > self.host_left:
            why, skip = ModeReason.HOST_RAM, SkipReason.HOST_RAM
        elif recompute and _recompute_cheaper(slot.cells, n_bytes, kv.park_rates):
            return ParkMode.RECOMPUTE, ModeReason.CHEAPER, 0
        else:
            return ParkMode.SWAP, ModeReason.FITS, n_bytes
        return (ParkMode.RECOMPUTE, why, 0) if recompute else skip

    def park_until(
        self, done: Callable[[], bool], reason: Reason, *, all_or_nothing: bool, at_most: int | None = None
    ) -> bool:
        """Park victims in order until ``done()``, only those of effective priority ``at_most`` or lower when given.
        With ``all_or_nothing``, nothing is planned unless it gets there."""
        saved = (replace(self.pool), self.budget_left, self.host_left, list(self.residents))
        planned: list[Action] = []
        skips: list[Skip] = []
        for slot in self.victims():
            if done():
                break
            if at_most is not None and self.priority(slot) > at_most:
                skips.append(Skip(ActionKind.PARK, slot.id, _task(slot), SkipReason.PRIORITY))
                continue
            if self.protected is not None and slot.id == self.protected.id:
                skips.append(Skip(ActionKind.PARK, slot.id, _task(slot), SkipReason.LARGEST))
                continue
            choice = self.park_mode(slot)
            if isinstance(choice, SkipReason):
                skips.append(Skip(ActionKind.PARK, slot.id, _task(slot), choice))
                continue
            mode, why, n_bytes = choice
            self.pool.remove(slot)
            self.residents.remove(slot)
            self.budget_left -= n_bytes  # only a swap holds host RAM: a recompute's n_bytes is 0
            self.host_left -= n_bytes
            planned.append(
                Action(
                    ActionKind.PARK,
                    slot.id,
                    _task(slot),
                    reason,
                    slot.cells,
                    n_bytes,
                    self.pool.ratio(),
                    mode=mode,
                    mode_reason=why,
                    priority=slot.priority or 0,
                )
            )
        if all_or_nothing and not done():
            self.pool, self.budget_left, self.host_left, self.residents = saved
            return False
        self.skipped.extend(skips)
        self.actions.extend(planned)
        return done()


def decide(inp: PolicyInput, cfg: PolicyConfig) -> Decision:
    """Park and restore actions for one snapshot, in the order they should be carried out."""
    gpu_low = inp.gpu_free_bytes is not None and inp.gpu_free_bytes < cfg.gpu_floor_bytes
    start = pressure(inp.kv, gpu_low)
    if inp.kv.n_cells <= 0:
        return Decision(start, projected_after=start.value)
    plan = _Plan.start(inp, cfg, gpu_low)
    if not plan.below_high():
        _relieve_pressure(plan)
        if plan.actions:
            return plan.decision(start)  # no restore in a decision that parks for pressure
    _restore(plan)
    _displace(plan)
    return plan.decision(start)


def _relieve_pressure(plan: _Plan) -> None:
    """Step 1, at or above HIGH: park victims until the projection is below it.

    When even every permitted park leaves it at or above HIGH, they are still worth doing: the oldest requests get
    the room to finish, and the server's safety net covers the rest.
    """
    if not plan.park_until(plan.below_high, Reason.PRESSURE, all_or_nothing=False):
        plan.skipped.append(Skip(ActionKind.PARK, -1, -1, SkipReason.UNRESOLVED))


def _restore(plan: _Plan) -> None:
    """Step 2: restore parked requests in the restore order, each as far as ``_restore_one`` allows."""
    blocked = head_seen = False
    for slot in _restore_order(plan, _waiting(plan)):
        if slot.cells + 1 > plan.pool.capacity():
            _cannot_fit(plan, slot)
            continue  # it can never be restored: it must not hold up the others
        if plan.queued is not None and plan.queued > plan.priority(slot) and plan.inp.kv.n_slots_idle > 0:
            plan.skip(ActionKind.RESUME, slot, SkipReason.PRIORITY)  # the queued request of higher priority first
            continue
        if blocked:
            plan.skip(ActionKind.RESUME, slot, SkipReason.HEAD_OF_LINE)
            continue
        is_head, head_seen = not head_seen, True
        why_not = _restore_one(plan, slot, is_head=is_head)
        if why_not is not None:
            plan.skip(ActionKind.RESUME, slot, why_not)
            blocked = plan.cfg.order is RestoreOrder.FIFO  # head-of-line: nobody overtakes the one parked longest


def _waiting(plan: _Plan) -> list[Slot]:
    """The parked requests the policy may restore: all but those pinned by hand (passed over, with why), and
    those the server parked for ``--park-test-interval``, which it resumes itself on its next iteration (a resume
    of one races with the server's and is answered 409)."""
    waiting = []
    for slot in plan.slots:
        if slot.state is not SlotState.PARKED or slot.id_task is None or slot.park.test:
            continue
        if plan.history(slot).pinned:
            plan.skip(ActionKind.RESUME, slot, SkipReason.PINNED)
        else:
            waiting.append(slot)
    return waiting


def _restore_order(plan: _Plan, waiting: list[Slot]) -> list[Slot]:
    """The highest effective priority first; within one priority, the order of policy.restore_order."""
    cfg = plan.cfg

    def since(s: Slot) -> int:
        return s.park.parked_since_ms if s.park.parked_since_ms is not None else 0

    if cfg.order is RestoreOrder.FIFO:
        return sorted(waiting, key=lambda s: (-plan.priority(s), since(s), _task(s), s.id))
    if cfg.order is RestoreOrder.SEED:
        return sorted(waiting, key=lambda s: (-plan.priority(s), -s.park.count, since(s), _task(s), s.id))
    # aging: the seed's order, but whoever has waited half of max_wait goes first; the seed's order alone
    # keeps a request parked once behind others parked again and again until it starves
    aged = plan.inp.now_ms - cfg.max_wait_ms // 2
    return sorted(waiting, key=lambda s: (-plan.priority(s), since(s) > aged, -s.park.count, since(s), _task(s), s.id))


def _cannot_fit(plan: _Plan, slot: Slot) -> None:
    """A request larger than the pool even alone: ended once nothing else is resident, passed over until then."""
    if plan.residents:
        plan.skip(ActionKind.RESUME, slot, SkipReason.AWAIT_EMPTY_POOL)
        return
    plan.actions.append(
        Action(
            ActionKind.END, slot.id, _task(slot), Reason.CANNOT_FIT, slot.cells, 0, plan.pool.ratio(), plan.waited(slot)
        )
    )


def _restore_one(plan: _Plan, slot: Slot, *, is_head: bool) -> SkipReason | None:
    """Restore one parked request if a rule lets it in now (below LOW, an empty pool, or a starving head); else
    why not."""
    waited = plan.waited(slot)
    fits_free = plan.pool.fits(slot.cells)
    # its cells, its next step and a margin for the steps before the next poll
    at_or_below_low = plan.pool.within(plan.low, slot.cells, _step_cells(slot) + plan.cfg.margin_cells)
    if fits_free and not plan.gpu_low and at_or_below_low:
        _resume(plan, slot, Reason.BELOW_LOW, waited)
        return None
    if fits_free and not plan.residents:
        _resume(plan, slot, Reason.NOTHING_RESIDENT, waited)
        return None
    if is_head and waited >= plan.cfg.max_wait_ms:
        return None if _restore_starving(plan, slot, waited) else SkipReason.NO_ROOM
    if not fits_free:
        return SkipReason.NO_FREE_CELLS
    return SkipReason.GPU_PRESSURE if plan.gpu_low else SkipReason.ABOVE_LOW


def _resume(plan: _Plan, slot: Slot, reason: Reason, waited: int) -> None:
    plan.pool.add(slot)
    plan.residents.append(slot)  # resident from now on; still PARKED in state, so never a victim of this decision
    plan.actions.append(
        Action(
            ActionKind.RESUME,
            slot.id,
            _task(slot),
            reason,
            slot.cells,
            slot.park.bytes,
            plan.pool.ratio(),
            waited,
            priority=slot.priority or 0,
        )
    )


def _restore_starving(plan: _Plan, slot: Slot, waited: int) -> bool:
    """Restore a head that waited too long below HIGH, parking newer requests to make room."""
    step = _step_cells(slot)

    def fits() -> bool:
        return plan.pool.fits(slot.cells) and plan.pool.within(plan.high, slot.cells, step)

    made = fits() or plan.park_until(fits, Reason.MAKE_ROOM, all_or_nothing=True, at_most=plan.priority(slot))
    if not made:
        return False
    _resume(plan, slot, Reason.STARVATION, waited)
    return True


def _displace(plan: _Plan) -> None:
    """Step 3 (policy.displacement): the head of kvctl's queue has a strictly higher effective priority than running
    requests and the pool has no room for it: park enough of them (the lowest first) that it fits below HIGH. Only
    when no parked request of its priority or higher waits (they come back first) and a slot is free for it."""
    q = plan.inp.queued
    if not plan.cfg.displacement or q is None or plan.queued is None or plan.inp.kv.n_slots_idle == 0:
        return
    if any(a.kind is ActionKind.RESUME for a in plan.actions):
        return  # restores first; the next poll decides again
    parked = [s for s in plan.slots if s.state is SlotState.PARKED and not plan.history(s).pinned]
    if any(plan.priority(s) >= plan.queued for s in parked):
        return

    def fits() -> bool:
        return plan.pool.fits(q.cells + 1) and plan.pool.within(plan.high, q.cells, 1)

    if not fits():
        plan.park_until(fits, Reason.DISPLACE, all_or_nothing=True, at_most=plan.queued - 1)


def admission(inp: PolicyInput, cfg: PolicyConfig, n_prompt_cells: int, priority: int | None = None) -> Admission:
    """Whether new requests may start now (asked by the proxy), and how many: parked requests of the same effective
    priority or higher are restored first (all of them when ``priority`` is None).

    The allowance is the number of new requests of ``n_prompt_cells`` each (and one cell of the next step
    each) that keep the projection below HIGH in every pool; at least one when nothing is resident, so a
    request larger than the reserve still starts on an empty pool.
    """
    kv = inp.kv
    eff, _ = effective_priorities(inp, cfg)
    waiting = [
        s
        for s in kv.slots
        if s.state is SlotState.PARKED
        and not inp.history.get(_task(s), TaskHistory()).pinned
        and (priority is None or eff.get(s.id, 0) >= priority)
    ]
    if waiting:
        return Admission(False, "parked requests are restored first", 0)
    parked = [
        eff.get(s.id, 0)
        for s in kv.slots
        if s.state is SlotState.PARKED and not inp.history.get(_task(s), TaskHistory()).pinned
    ]
    floor = max(parked) + 1 if parked else None  # a request at or below a parked one's priority waits for it
    if kv.n_cells <= 0:
        return Admission(True, "pool size unknown")
    pool = _pool(kv)
    resident = any(s.is_resident for s in kv.slots)
    if inp.gpu_free_bytes is not None and inp.gpu_free_bytes < cfg.gpu_floor_bytes and resident:
        return Admission(False, "other processes took the GPU memory the server needs (see /status gpu_held)", 0)
    room_cells = max(0, pool.room(pool.below(cfg.high)))
    allowance = room_cells // (max(1, n_prompt_cells) + 1)  # a prompt and its first step each
    if not resident:
        allowance = max(1, allowance)
    if allowance == 0:
        return Admission(False, "the pool would reach HIGH", 0, room_cells)
    return Admission(True, "room", allowance, room_cells, empty=not resident, min_priority=floor)
