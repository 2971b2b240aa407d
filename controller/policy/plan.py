"""One decision: relieve pressure above HIGH (victims, park modes), restore below LOW, displace for the queue head."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from controller.policy.pool import (
    DISK_FILE_HEADER,
    Pool,
    arrival,
    disk_left,
    disk_slower,
    effective_priorities,
    largest_resident,
    pool_of,
    pressure,
    ram_parked_bytes,
    recompute_cheaper,
    snapshot_bytes,
    step_cells,
    task_id,
)
from controller.policy.types import (
    Action,
    ActionKind,
    Decision,
    ModeReason,
    PerPool,
    PolicyConfig,
    PolicyInput,
    Pressure,
    Reason,
    Skip,
    SkipReason,
    TaskHistory,
)
from controller.settings import ParkTierChoice, RestoreOrder
from controller.upstream.models import ParkMode, ParkTier, Slot, SlotState

# --- one decision --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParkChoice:
    """How one victim is parked."""

    mode: ParkMode
    why: ModeReason
    n_bytes: int = 0
    """Host RAM it takes: a swap to RAM's snapshot."""
    tier: ParkTier | None = None
    """Where its cells go, on a server with tiers."""
    disk_bytes: int = 0
    """Disk it takes: a swap to disk's file, or the files of the snapshots it spills."""
    spilled: tuple[Slot, ...] = ()
    """RAM-parked snapshots the server moves to disk to make room for it (ModeReason.SPILL)."""

    @property
    def spill_bytes(self) -> int:
        """The host RAM the spilled snapshots give back."""
        return sum(s.park.bytes for s in self.spilled)


@dataclass(slots=True)
class _Plan:
    cfg: PolicyConfig
    inp: PolicyInput
    pool: Pool
    high: PerPool
    """The most projected cells below HIGH, per pool."""
    low: PerPool
    """The most projected cells at or below LOW, per pool."""
    gpu_low: bool
    budget_left: float
    host_left: float
    disk_left: float
    """What is left of the server's disk budget; 0 without a disk tier."""
    protected: Slot | None
    """The largest resident request of the highest priority present: never parked, so someone finishes."""
    slots: list[Slot]
    """Every slot, by id."""
    residents: list[Slot]
    eff: dict[int, int]
    """Effective priorities by slot id (effective_priorities())."""
    queued: int | None
    """The queued head's effective priority; None: nobody waits in kvctl's queue."""
    spilled: set[int] = field(default_factory=set)
    """Slots whose snapshots this plan's parks move from RAM to disk."""
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
        pool = pool_of(kv)
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
            budget_left=max(0.0, min(cfg.budget_bytes, server_budget) - ram_parked_bytes(kv)),
            host_left=host_left,
            disk_left=disk_left(kv),
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
        self.skipped.append(Skip(kind, slot.id, task_id(slot), reason))

    def history(self, slot: Slot) -> TaskHistory:
        return self.inp.history.get(task_id(slot), TaskHistory())

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
        return sorted(cands, key=lambda s: (self.priority(s), self.parked_before(s), -arrival(s), -task_id(s), -s.id))

    def park_mode(self, slot: Slot) -> ParkChoice | SkipReason:
        """How to park this victim now (policy.park_tier): host RAM, the disk tier or recompute, with why; or why
        it cannot be parked."""
        kv = self.inp.kv
        modes = (ParkMode.SWAP,) if kv.park_modes is None else kv.park_modes  # an older server swaps only
        tiers = kv.park_tiers  # None: a server without tiers, whose swaps are in RAM
        recompute = ParkMode.RECOMPUTE in modes
        pick = self.cfg.park_tier
        none = ParkTier.NONE if tiers is not None else None
        ram = (
            ParkMode.SWAP in modes
            and pick in (ParkTierChoice.AUTO, ParkTierChoice.RAM)
            and (tiers is None or ParkTier.RAM in tiers)
            and not (recompute and self.cfg.budget_bytes == 0)
        )
        disk = pick in (ParkTierChoice.AUTO, ParkTierChoice.DISK) and tiers is not None and ParkTier.DISK in tiers
        if not ram and not disk and not (recompute and pick is ParkTierChoice.RECOMPUTE):
            if recompute:
                return ParkChoice(ParkMode.RECOMPUTE, ModeReason.RECOMPUTE_ONLY, tier=none)
            return SkipReason.PARKING_OFF
        if pick is ParkTierChoice.RECOMPUTE:
            return ParkChoice(ParkMode.RECOMPUTE, ModeReason.RECOMPUTE_ONLY, tier=none)
        n_bytes = snapshot_bytes(slot, kv)
        why, skip = ModeReason.RECOMPUTE_ONLY, SkipReason.PARKING_OFF
        if ram:
            spill = self.spill_for(slot, n_bytes) if pick is ParkTierChoice.AUTO else None
            freed = sum(s.park.bytes for s in spill or ())
            if n_bytes > self.budget_left + freed:
                why, skip = ModeReason.BUDGET, SkipReason.BUDGET
            elif n_bytes > self.host_left + freed:
                why, skip = ModeReason.HOST_RAM, SkipReason.HOST_RAM
            elif recompute and recompute_cheaper(slot.cells, n_bytes, kv.park_rates):
                return ParkChoice(ParkMode.RECOMPUTE, ModeReason.CHEAPER, tier=none)
            elif spill:
                files = freed + DISK_FILE_HEADER * len(spill)
                return ParkChoice(ParkMode.SWAP, ModeReason.SPILL, n_bytes, ParkTier.RAM, files, tuple(spill))
            else:
                return ParkChoice(ParkMode.SWAP, ModeReason.FITS, n_bytes, ParkTier.RAM if tiers is not None else None)
        if disk:
            if n_bytes + DISK_FILE_HEADER > self.disk_left:
                why = ModeReason.DISK_BUDGET
            elif recompute and disk_slower(slot.cells, n_bytes, kv.park_rates, kv.park_disk):
                return ParkChoice(ParkMode.RECOMPUTE, ModeReason.CHEAPER, tier=none)
            else:
                return ParkChoice(ParkMode.SWAP, ModeReason.DISK, 0, ParkTier.DISK, n_bytes + DISK_FILE_HEADER)
        return ParkChoice(ParkMode.RECOMPUTE, why, tier=none) if recompute else skip

    def spill_for(self, slot: Slot, n_bytes: int) -> list[Slot] | None:
        """The RAM-parked snapshots the server moves to disk for this victim's park when RAM is short (patch 40): of a
        lower priority than the victim's own (the server resumes them after it), the lowest and newest first, as many
        as the shortfall needs; None when nothing moves: RAM suffices, the server does not move snapshots, or they
        would not make room on the disk and in RAM."""
        kv = self.inp.kv
        short = n_bytes - min(self.budget_left, self.host_left)
        if short <= 0 or kv.park_disk is None or kv.park_disk.spills is None or self.disk_left <= 0:
            return None
        mine = slot.priority or 0
        later = [
            s
            for s in self.slots
            if s.state is SlotState.PARKED
            and s.park.tier is ParkTier.RAM
            and s.id not in self.spilled
            and (s.priority or 0) < mine
        ]
        later.sort(key=lambda s: (s.priority or 0, -(s.park.parked_since_ms or 0)))
        out: list[Slot] = []
        freed, disk = 0, self.disk_left
        for s in later:
            if freed >= short:
                break
            disk -= s.park.bytes + DISK_FILE_HEADER
            if disk < 0:
                return None
            out.append(s)
            freed += s.park.bytes
        return out if freed >= short else None

    def park_until(
        self, done: Callable[[], bool], reason: Reason, *, all_or_nothing: bool, at_most: int | None = None
    ) -> bool:
        """Park victims in order until ``done()``, only those of effective priority ``at_most`` or lower when given.
        With ``all_or_nothing``, nothing is planned unless it gets there."""
        saved = (replace(self.pool), self.budget_left, self.host_left, self.disk_left, list(self.residents))
        spilled = set(self.spilled)
        planned: list[Action] = []
        skips: list[Skip] = []
        for slot in self.victims():
            if done():
                break
            if at_most is not None and self.priority(slot) > at_most:
                skips.append(Skip(ActionKind.PARK, slot.id, task_id(slot), SkipReason.PRIORITY))
                continue
            if self.protected is not None and slot.id == self.protected.id:
                skips.append(Skip(ActionKind.PARK, slot.id, task_id(slot), SkipReason.LARGEST))
                continue
            choice = self.park_mode(slot)
            if isinstance(choice, SkipReason):
                skips.append(Skip(ActionKind.PARK, slot.id, task_id(slot), choice))
                continue
            self.pool.remove(slot)
            self.residents.remove(slot)
            self.budget_left -= choice.n_bytes - choice.spill_bytes  # only a swap to RAM holds host RAM
            self.host_left -= choice.n_bytes - choice.spill_bytes
            self.disk_left -= choice.disk_bytes
            self.spilled.update(s.id for s in choice.spilled)
            planned.append(
                Action(
                    ActionKind.PARK,
                    slot.id,
                    task_id(slot),
                    reason,
                    slot.cells,
                    choice.n_bytes,
                    self.pool.ratio(),
                    mode=choice.mode,
                    mode_reason=choice.why,
                    tier=choice.tier,
                    priority=slot.priority or 0,
                    spill_bytes=choice.spill_bytes,
                )
            )
        if all_or_nothing and not done():
            self.pool, self.budget_left, self.host_left, self.disk_left, self.residents = saved
            self.spilled = spilled
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
        elif slot.park.copying is not None:
            plan.skip(ActionKind.RESUME, slot, SkipReason.MOVING)
        else:
            waiting.append(slot)
    return waiting


def _restore_order(plan: _Plan, waiting: list[Slot]) -> list[Slot]:
    """The highest effective priority first; within one priority, the order of policy.restore_order."""
    cfg = plan.cfg

    def since(s: Slot) -> int:
        return s.park.parked_since_ms if s.park.parked_since_ms is not None else 0

    if cfg.order is RestoreOrder.FIFO:
        return sorted(waiting, key=lambda s: (-plan.priority(s), since(s), task_id(s), s.id))
    if cfg.order is RestoreOrder.SEED:
        return sorted(waiting, key=lambda s: (-plan.priority(s), -s.park.count, since(s), task_id(s), s.id))
    # aging: the seed's order, but whoever has waited half of max_wait goes first; the seed's order alone
    # keeps a request parked once behind others parked again and again until it starves
    aged = plan.inp.now_ms - cfg.max_wait_ms // 2
    return sorted(
        waiting, key=lambda s: (-plan.priority(s), since(s) > aged, -s.park.count, since(s), task_id(s), s.id)
    )


def _cannot_fit(plan: _Plan, slot: Slot) -> None:
    """A request larger than the pool even alone: ended once nothing else is resident, passed over until then."""
    if plan.residents:
        plan.skip(ActionKind.RESUME, slot, SkipReason.AWAIT_EMPTY_POOL)
        return
    plan.actions.append(
        Action(
            ActionKind.END,
            slot.id,
            task_id(slot),
            Reason.CANNOT_FIT,
            slot.cells,
            0,
            plan.pool.ratio(),
            plan.waited(slot),
        )
    )


def _restore_one(plan: _Plan, slot: Slot, *, is_head: bool) -> SkipReason | None:
    """Restore one parked request if a rule lets it in now (below LOW, an empty pool, or a starving head); else
    why not."""
    waited = plan.waited(slot)
    fits_free = plan.pool.fits(slot.cells)
    # its cells, its next step and a margin for the steps before the next poll
    at_or_below_low = plan.pool.within(plan.low, slot.cells, step_cells(slot) + plan.cfg.margin_cells)
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
            task_id(slot),
            reason,
            slot.cells,
            0 if slot.park.tier is ParkTier.DISK else slot.park.bytes,  # host RAM it frees
            plan.pool.ratio(),
            waited,
            priority=slot.priority or 0,
        )
    )


def _restore_starving(plan: _Plan, slot: Slot, waited: int) -> bool:
    """Restore a head that waited too long below HIGH, parking newer requests to make room."""
    step = step_cells(slot)

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
