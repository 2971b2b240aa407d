"""The actuator: one path, carry_out(), for every park, resume and end, whether the policy chose it or an operator
asked for it by hand (a manual park is an action with reason ``manual`` and a pin).

It sizes each call's timeout by its work (action_timeout_s()), makes the call, maps the server's answer or silence,
and has the recorder record the outcome. A park or resume that fails or times out never marks the server down:
only polls do (controller.loop.poller). One that timed out may still complete on the server (a large copy), so the next
poll comes at once and waits as long as the action could have, and a manual park's pin stays only if the park
happened (the poller reconciles it).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from controller.loop.calls import ServerCalls
from controller.loop.poller import Poller
from controller.loop.recorder import Recorder, action_fields
from controller.loop.state import LoopState
from controller.policy.types import Action, ActionKind, Reason
from controller.settings import ParkTierChoice, UpstreamSettings
from controller.upstream.client import UpstreamApiError, UpstreamError, UpstreamUnavailable
from controller.upstream.models import ParkMode, ParkResult, ParkTier, ResumeResult, Slot, SlotState

__all__ = ["ASSUMED_COPY_BYTES_PER_S", "Actuator", "Outcome"]

ASSUMED_COPY_BYTES_PER_S = 1e9  # a park's copy rate until the server has measured one
AUTO = ParkTierChoice.AUTO
ASSUMED_DISK_BYTES_PER_S = 1e8
"""A disk park's or resume's rate until the server has measured one: a slow disk, so that a first timeout is long."""
COPY_SLOWDOWN = 4.0
"""With only the copy rate known (an older server), a park or resume may take this many times its copy: the server
slices it between the other requests' steps (about twice its copy time on a busy server), with room to spare."""
WALL_SLACK = 2.0
"""With the server's measured wall-clock rate of parks and resumes (patch 24), room to spare over it."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """How an action went: done (with the server's answer) or not (with its error)."""

    action: Action
    park: ParkResult | None = None
    resume: ResumeResult | None = None
    error: UpstreamError | None = None

    @property
    def done(self) -> bool:
        return self.error is None


class Actuator:
    def __init__(
        self,
        settings: UpstreamSettings,
        state: LoopState,
        calls: ServerCalls,
        poller: Poller,
        recorder: Recorder,
        on_end: Callable[[int, int], Awaitable[bool]] | None = None,
    ) -> None:
        self.settings = settings
        self.state = state
        self.calls = calls
        self.poller = poller
        self.recorder = recorder
        # a proxy may end a request that cannot fit by closing its client's stream
        self._on_end = on_end

    def action_timeout_s(self, n_bytes: int, disk: bool = False, spill_bytes: int = 0) -> float:
        """How long a park or resume of an n_bytes snapshot may take: it is answered once its copy is done, at the
        server's measured wall-clock rate (WALL_SLACK), else its copy rate (COPY_SLOWDOWN; 1 GB/s until measured);
        to or from disk, at the slower of the disk tier's measured rates (WALL_SLACK; 100 MB/s until measured), as
        are the spill_bytes a park to RAM waits for; within upstream.action_timeout_min_s and action_timeout_max_s."""
        up = self.settings
        kv = self.state.snapshot
        rates = kv.park_rates if kv is not None else None
        d = kv.park_disk if kv is not None else None
        measured = [r for r in (d.write_bytes_per_s, d.read_bytes_per_s) if r] if d is not None else []
        disk_rate = min(measured, default=ASSUMED_DISK_BYTES_PER_S)
        disk_s = WALL_SLACK * spill_bytes / disk_rate
        if disk:
            work_s = WALL_SLACK * n_bytes / disk_rate
        elif rates is not None and rates.wall_bytes_per_s:
            work_s = WALL_SLACK * n_bytes / rates.wall_bytes_per_s
        else:
            copy = (rates.copy_bytes_per_s if rates is not None else None) or ASSUMED_COPY_BYTES_PER_S
            work_s = COPY_SLOWDOWN * n_bytes / copy
        return min(max(up.timeout_s + work_s + disk_s, up.action_timeout_min_s), up.action_timeout_max_s)

    def _slot(self, slot_id: int) -> Slot | None:
        """The slot as the last poll saw it; None when unknown."""
        kv = self.state.snapshot
        return next((s for s in kv.slots if s.id == slot_id), None) if kv is not None else None

    def action_bytes(self, slot_id: int) -> int:
        """The snapshot a park or resume of this slot copies, as the last poll saw it (0 when unknown)."""
        kv = self.state.snapshot
        slot = self._slot(slot_id)
        if kv is None or slot is None:
            return 0
        if slot.state is SlotState.PARKED:
            return slot.park.bytes
        return slot.park.snapshot_bytes if slot.park.snapshot_bytes is not None else slot.n_cells * kv.bytes_per_cell

    async def carry_out(self, a: Action, *, pin: bool = False) -> Outcome:
        """Carry out one action and record how it went. ``pin`` (a manual park): the policy leaves the request parked
        until it is resumed by hand; pinned before the park is asked for, so that one that times out and completes
        on the server keeps its pin."""
        fields = action_fields(a)
        if a.kind is ActionKind.END:
            return await self._end(a, fields)
        history = self.state.history
        before = history.get(a.id_task)
        if pin:
            self.recorder.pinned(a.id_task)
        elif a.kind is ActionKind.RESUME and a.reason is Reason.MANUAL and before is not None and before.pinned:
            # unpinned first: should the resume fail for lack of room, the policy restores it when there is
            history[a.id_task] = replace(before, pinned=False)
        t0 = time.perf_counter()
        try:
            if a.kind is ActionKind.PARK:
                park = await self._park(a, fields)
            else:
                resume = await self._resume(a.slot, a.id_task)
        except UpstreamError as e:
            self.recorder.failed(a.kind, e, fields)
            if isinstance(e, UpstreamUnavailable):
                self.poller.wait_longer(self.calls.last_action_timeout_s)
            if pin and isinstance(e, UpstreamApiError):  # refused: nothing changed
                if before is not None:
                    history[a.id_task] = before
                else:
                    history.pop(a.id_task, None)
            elif pin:
                self.state.unconfirmed_pins.add(a.id_task)
            return Outcome(a, error=e)
        seconds = time.perf_counter() - t0
        if a.kind is ActionKind.PARK:
            self.recorder.parked(a, park, seconds, fields, pin)
            return Outcome(a, park=park)
        self.recorder.resumed(a, resume, seconds, fields)
        return Outcome(a, resume=resume)

    def _wire_mode(self, a: Action) -> ParkMode | None:
        """The mode to ask for: the policy's, unless the server lists no modes (an older one, which swaps only); a
        manual park's as asked (None: the server's choice)."""
        kv = self.state.snapshot
        if a.reason is Reason.MANUAL:
            return a.mode
        return a.mode if kv is not None and kv.park_modes is not None else None

    def _tiers(self) -> tuple[ParkTier, ...]:
        kv = self.state.snapshot
        return kv.park_tiers if kv is not None and kv.park_tiers is not None else ()

    async def _park(self, a: Action, fields: dict[str, object]) -> ParkResult:
        """Park as asked; a policy's swap the server cannot hold now (503: its snapshot arena cannot grow, host memory
        ran short, the disk is full) goes to the disk tier where the policy allows it and the server has one, else
        becomes a park by recompute, since the request must still give up its cells."""
        mode = self._wire_mode(a)
        tier = a.tier if a.tier is not None and a.tier in self._tiers() and mode is not None else None
        try:
            return await self._park_call(a.slot, a.id_task, mode, tier, a.spill_bytes)
        except UpstreamApiError as e:
            kv = self.state.snapshot
            modes = kv.park_modes if kv is not None else None
            if a.reason is Reason.MANUAL or mode is not ParkMode.SWAP or e.status != 503:
                raise
            self.recorder.swap_refused(fields, e)
            if tier is ParkTier.RAM and ParkTier.DISK in self._tiers() and self.recorder.config.park_tier is AUTO:
                fields["tier"] = str(ParkTier.DISK)
                try:
                    return await self._park_call(a.slot, a.id_task, mode, ParkTier.DISK)
                except UpstreamApiError as e2:
                    if e2.status != 503:
                        raise
                    self.recorder.swap_refused(fields, e2)
            if not modes or ParkMode.RECOMPUTE not in modes:
                raise
            fields["mode"] = str(ParkMode.RECOMPUTE)
            fields.pop("tier", None)
            return await self._park_call(a.slot, a.id_task, ParkMode.RECOMPUTE)

    async def _park_call(
        self, slot: int, id_task: int, mode: ParkMode | None, tier: ParkTier | None = None, spill_bytes: int = 0
    ) -> ParkResult:
        timeout_s = self.action_timeout_s(self.action_bytes(slot), disk=tier is ParkTier.DISK, spill_bytes=spill_bytes)
        call = self.calls.client.park(slot, id_task, mode, timeout_s=timeout_s, tier=tier)
        return await self.calls.timed(call, timeout_s, action=True)

    def _parked_on_disk(self, slot_id: int) -> bool:
        slot = self._slot(slot_id)
        return slot is not None and slot.park.tier is ParkTier.DISK

    async def _resume(self, slot: int, id_task: int) -> ResumeResult:
        timeout_s = self.action_timeout_s(self.action_bytes(slot), disk=self._parked_on_disk(slot))
        call = self.calls.client.resume(slot, id_task, timeout_s=timeout_s)
        return await self.calls.timed(call, timeout_s, action=True)

    async def _end(self, a: Action, fields: dict[str, object]) -> Outcome:
        """A parked request that cannot fit the pool even alone: end it rather than let it wait forever."""
        self.recorder.ended(fields)
        if self._on_end is not None and await self._on_end(a.slot, a.id_task):
            return Outcome(a)
        # without a proxy to end its stream, resume it alone: the server's own context limit then ends it
        try:
            resume = await self._resume(a.slot, a.id_task)
        except UpstreamError as e:
            self.recorder.failed(ActionKind.RESUME, e, fields)
            if isinstance(e, UpstreamUnavailable):
                self.poller.wait_longer(self.calls.last_action_timeout_s)
            return Outcome(a, error=e)
        return Outcome(a, resume=resume)
