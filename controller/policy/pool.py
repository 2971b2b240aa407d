"""Pool arithmetic: exact watermarks in whole cells, projected occupancy, and what a victim's snapshot costs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from controller.policy.types import PerPool, PolicyConfig, PolicyInput, Pressure
from controller.upstream.models import KvSnapshot, ParkDisk, ParkRates, ParkTier, Slot, SlotState


def exact(watermark: float) -> Fraction:
    """The watermark's decimal value, as the settings write it: ``Fraction(0.94)``, the float's binary value, is
    0.93999999999999994671..., and its product with a pool size lands a hair off whole cells."""
    return Fraction(str(watermark))


@dataclass(slots=True)
class Pool:
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

    def sizes(self) -> PerPool:
        return (self.n_target, self.n_draft) if self.n_draft else (self.n_target,)

    def _swa_cells(self, cells: int) -> int:
        return min(cells, self.window) if self.window > 0 else cells

    def projected(self, extra_cells: int = 0, extra_step: int = 0, *, swa: bool = True) -> PerPool:
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

    def _with_swa(self, caps: PerPool) -> PerPool:
        return (*caps, self.n_swa) if self.n_swa else caps

    def below(self, watermark: float) -> PerPool:
        """The most projected cells each pool may hold and stay strictly below ``watermark``: ceil(w x n) - 1, since
        ceil(w x n) cells are at or above it (the window pool: its size)."""
        return self._with_swa(tuple(math.ceil(exact(watermark) * n) - 1 for n in self.sizes()))

    def up_to(self, watermark: float) -> PerPool:
        """The most projected cells each pool may hold and stay at or below ``watermark``: floor(w x n) (the window
        pool: its size)."""
        return self._with_swa(tuple(math.floor(exact(watermark) * n) for n in self.sizes()))

    def within(self, cap: PerPool, extra_cells: int = 0, extra_step: int = 0) -> bool:
        """Every pool's projected cells, with the extra ones, are at most its ``cap``."""
        return all(cells <= most for cells, most in zip(self.projected(extra_cells, extra_step), cap, strict=True))

    def room(self, cap: PerPool) -> int:
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
            self.step = max(0, self.step - step_cells(slot))

    def add(self, slot: Slot) -> None:
        self.used_target += slot.cells
        self.used_draft += slot.cells
        self.used_swa += self._swa_cells(slot.cells)
        self.step += step_cells(slot)


def step_cells(slot: Slot) -> int:
    """What a generating request adds in one decode step: a token and its drafts."""
    return 1 + max(0, slot.n_draft_max)


def pool_of(kv: KvSnapshot) -> Pool:
    idle = sum(s.cells for s in kv.slots if s.state is SlotState.IDLE)
    # every prompt in progress reserves its whole rest, not only the next step's share (module docstring)
    prefill = sum(max(0, s.n_prefill_left) for s in kv.slots if s.state is SlotState.PROMPT)
    step = kv.next_step.n_total_max + max(0, prefill - kv.next_step.n_prompt_max)
    swa = kv.swa if kv.swa is not None and kv.swa.n_cells > 0 else None
    window = swa.n_swa if swa is not None else 0
    return Pool(
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
    pool = pool_of(kv)
    ratios = list(pool.ratios())
    swa = ratios.pop() if pool.n_swa else None
    return Pressure(ratios[0], ratios[1] if len(ratios) > 1 else None, gpu_low, swa)


def arrival(slot: Slot) -> int:
    return slot.t_arrival_ms if slot.t_arrival_ms is not None else 0


def task_id(slot: Slot) -> int:
    return slot.id_task if slot.id_task is not None else -1


def largest_resident(slots: Sequence[Slot]) -> Slot | None:
    """The request holding the most cells; ties go to the oldest (it has waited for its cells longest)."""
    resident = [s for s in slots if s.is_resident]
    if not resident:
        return None
    return max(resident, key=lambda s: (s.cells, -arrival(s), -task_id(s), -s.id))


def snapshot_bytes(slot: Slot, kv: KvSnapshot) -> int:
    """Host RAM a swap park of a generating slot takes: the server's exact size, else n_cells x bytes_per_cell
    (an older server; it underestimates hybrid and iSWA models)."""
    if slot.park.snapshot_bytes is not None:
        return slot.park.snapshot_bytes
    return slot.cells * kv.bytes_per_cell


DISK_FILE_HEADER = 4096
"""Bytes a snapshot file takes beyond its snapshot (the server's header page)."""
DISK_FIXED_S = 0.02
"""A disk park's and resume's cost beyond its bytes (creating, syncing, opening and mapping the file; a worker thread
each way): why a short request recomputes rather than go to disk, where its bytes alone would say disk."""


def ram_parked_bytes(kv: KvSnapshot) -> int:
    """Host RAM the parked snapshots hold: the server's parked bytes less those of snapshots on disk."""
    on_disk = sum(s.park.bytes for s in kv.slots if s.state is SlotState.PARKED and s.park.tier is ParkTier.DISK)
    return max(0, kv.parked_bytes - on_disk)


def disk_left(kv: KvSnapshot) -> float:
    """What is left of the server's disk budget for snapshot files; 0 without a disk tier."""
    d = kv.park_disk
    if d is None or kv.park_tiers is None or ParkTier.DISK not in kv.park_tiers:
        return 0.0
    return float(max(0, d.budget_bytes - d.used_bytes))


def disk_slower(n_cells: int, n_bytes: int, rates: ParkRates, disk: ParkDisk | None) -> bool:
    """Evaluating the tokens again takes less time than parking the snapshot to disk and reading it back, at the
    rates the server measured, with DISK_FIXED_S for each way's fixed cost; False while a rate is unmeasured."""
    prompt = rates.prompt_tokens_per_s
    write = disk.write_bytes_per_s if disk is not None else None
    read = disk.read_bytes_per_s if disk is not None else None
    if not prompt or not write or not read or prompt <= 0 or write <= 0 or read <= 0:
        return False
    return n_cells / prompt < 2 * DISK_FIXED_S + n_bytes / write + n_bytes / read


def recompute_cheaper(n_cells: int, n_bytes: int, rates: ParkRates) -> bool:
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
