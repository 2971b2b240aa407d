"""Admission: may a new request start now, given the pool and the requests already waiting."""

from __future__ import annotations

from controller.policy.pool import effective_priorities, pool_of, task_id
from controller.policy.types import Admission, PolicyConfig, PolicyInput, TaskHistory
from controller.upstream.models import SlotState


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
        and not inp.history.get(task_id(s), TaskHistory()).pinned
        and (priority is None or eff.get(s.id, 0) >= priority)
    ]
    if waiting:
        return Admission(False, "parked requests are restored first", 0)
    parked = [
        eff.get(s.id, 0)
        for s in kv.slots
        if s.state is SlotState.PARKED and not inp.history.get(task_id(s), TaskHistory()).pinned
    ]
    floor = max(parked) + 1 if parked else None  # a request at or below a parked one's priority waits for it
    if kv.n_cells <= 0:
        return Admission(True, "pool size unknown")
    pool = pool_of(kv)
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
