"""Build consistent /kv snapshots: for the policy tests, and for testkit.policy_sim's simulated server."""

from __future__ import annotations

from dataclasses import dataclass

from controller.upstream.models import (
    KvSnapshot,
    Lease,
    NextStep,
    ParkDisk,
    ParkInfo,
    ParkMode,
    ParkRates,
    ParkTier,
    PoolInfo,
    Slot,
    SlotState,
    WindowPool,
)


@dataclass(frozen=True)
class S:
    """One slot of a test snapshot."""

    state: str
    n_cells: int = 0
    id_task: int | None = None
    t_arrival_ms: int = 0
    park_count: int = 0
    parked_since_ms: int | None = None
    n_draft_max: int = 0
    n_prompt_left: int = 0  # prompt state: tokens still to prefill (or to re-evaluate, with recomputing)
    snapshot_bytes: int | None = None  # generating: what a swap park of it takes (the server's exact figure)
    mode: ParkMode | None = None  # parked: how (None: swap)
    recomputing: bool = False  # prompt state: resumed by recompute, evaluating its tokens again
    priority: int | None = None  # the request's priority (patch 25); None: a server that does not say
    tier: ParkTier | None = None  # parked by swap on a server with tiers: where (None: RAM)


def kv(
    n_cells: int,
    slots: list[S],
    *,
    draft_cells: int | None = None,
    bytes_per_cell: int = 1000,
    budget: int | None = None,
    n_batch: int = 512,
    park_modes: tuple[ParkMode, ...] | None = None,
    host_ram: int | None = None,
    rates: ParkRates | None = None,
    swa: tuple[int, int] | None = None,
    disk: ParkDisk | None = None,
) -> KvSnapshot:
    """park_modes None: an older server (swap only, no costs published); host_ram and rates: what a newer server
    reports of the host's available memory and of its measured copy and prompt rates; swa (cells, window): an iSWA
    model's window pool, each resident slot holding min(its cells, window) cells there; disk: the server's disk tier
    (its tiers then ram, disk and none; ram only while budget is not 0)."""
    tiers = None
    if disk is not None:
        tiers = ((ParkTier.RAM,) if budget != 0 else ()) + (ParkTier.DISK, ParkTier.NONE)
    out = []
    used = 0
    parked_bytes = 0
    n_gen = n_draft = n_prompt = 0
    for i, s in enumerate(slots):
        state = SlotState(s.state)
        task = s.id_task if s.id_task is not None else (None if state is SlotState.IDLE else 100 + i)
        recompute = state is SlotState.PARKED and s.mode is ParkMode.RECOMPUTE
        held = 0 if recompute else s.n_cells * bytes_per_cell
        if state is SlotState.PARKED:
            parked_bytes += held
        else:
            used += s.n_cells
        if state is SlotState.GENERATING:
            n_gen += 1
            n_draft += s.n_draft_max
        if state is SlotState.PROMPT:
            n_prompt += s.n_prompt_left
        # like the server: a parked slot holds no cells; its size shows in its prompt and generated tokens
        slot_prompt = s.n_cells // 2
        slot_decoded = s.n_cells - slot_prompt + 1 if s.n_cells else 0
        parked = state is SlotState.PARKED
        newer = park_modes is not None  # an older server reports no mode, full length or snapshot size
        out.append(
            Slot(
                id=i,
                id_task=task,
                state=state,
                n_cells=0 if state is SlotState.PARKED else s.n_cells,
                n_prompt=slot_prompt,
                n_decoded=slot_decoded,
                t_arrival_ms=s.t_arrival_ms if task is not None else None,
                n_draft_max=s.n_draft_max,
                n_prefill_left=s.n_prompt_left if state is SlotState.PROMPT else 0,
                priority=s.priority if task is not None else None,
                park=ParkInfo(
                    count=s.park_count,
                    bytes=held if state is SlotState.PARKED else 0,
                    t_parked_total_ms=0,
                    parked_since_ms=s.parked_since_ms if state is SlotState.PARKED else None,
                    n_cells=s.n_cells if parked and newer else None,
                    mode=(s.mode or ParkMode.SWAP) if parked and newer else s.mode,
                    tier=(s.tier or (ParkTier.NONE if recompute else ParkTier.RAM)) if parked and tiers else None,
                    recomputing=s.recomputing,
                    snapshot_bytes=(held if parked else s.snapshot_bytes) if newer else None,
                ),
            )
        )
    n_prompt = min(n_prompt, max(0, n_batch - n_gen - n_draft))
    draft = None
    if draft_cells is not None:
        draft = PoolInfo(
            n_cells=draft_cells,
            n_cells_used=used,
            n_cells_free=draft_cells - used,
            used_ratio=used / draft_cells,
            source="exact",
        )
    window_pool = None
    if swa is not None:
        swa_cells, window = swa
        live = sum(min(s.n_cells, window) for s in slots if SlotState(s.state) is not SlotState.PARKED)
        window_pool = WindowPool(
            n_cells=swa_cells,
            n_cells_used=live,
            n_cells_free=swa_cells - live,
            used_ratio=live / swa_cells,
            source="exact",
            n_swa=window,
        )
    return KvSnapshot(
        n_cells=n_cells,
        n_cells_used=used,
        n_cells_free=n_cells - used,
        used_ratio=used / n_cells,
        source="exact",
        draft=draft,
        swa=window_pool,
        bytes_per_cell=bytes_per_cell,
        next_step=NextStep(
            n_gen=n_gen, n_draft_max=n_draft, n_prompt_max=n_prompt, n_total_max=n_gen + n_draft + n_prompt
        ),
        n_slots=len(out),
        n_slots_idle=sum(1 for s in out if s.state is SlotState.IDLE),
        n_parked=sum(1 for s in out if s.state is SlotState.PARKED),
        parked_bytes=parked_bytes,
        park_ram_budget_bytes=budget,
        park_modes=park_modes,
        park_tiers=tiers,
        park_disk=disk,
        host_ram_available_bytes=host_ram,
        park_rates=rates or ParkRates(),
        lease=Lease(held=True, ttl_s=10, age_ms=0),
        slots=tuple(out),
    )
