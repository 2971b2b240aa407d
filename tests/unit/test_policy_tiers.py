"""policy.park_tier: host RAM, the server's disk tier (--park-disk) or recompute, per victim."""

from __future__ import annotations

from dataclasses import replace

from controller.policy.plan import decide
from controller.policy.pool import ram_parked_bytes
from controller.policy.types import ActionKind, ModeReason, PolicyConfig, PolicyInput, SkipReason
from controller.settings import ParkTierChoice
from controller.upstream.models import KvSnapshot, ParkDisk, ParkInfo, ParkMode, ParkRates, ParkTier
from testkit.snapshots import S, kv
from tests.harness import BOTH
from tests.harness import POLICY_NOW as NOW

CFG = PolicyConfig(high=0.94, low=0.80, budget_bytes=10**12, host_reserve_bytes=0, margin_cells=0, max_wait_ms=30_000)
# 962 of 1000 projected: slot 1 (460 cells, a 4700-byte snapshot) is the one to park
MODAL = [S("generating", 500, t_arrival_ms=1), S("generating", 460, t_arrival_ms=2, snapshot_bytes=4700)]
DISK = ParkDisk(dir="/var/lib/kvpark", budget_bytes=10**9, used_bytes=0, files=0)


def snap(disk: ParkDisk | None = DISK, **kw: object) -> KvSnapshot:
    return kv(1000, MODAL, bytes_per_cell=10, park_modes=BOTH, disk=disk, **kw)  # type: ignore[arg-type]


def parks(snapshot: KvSnapshot, cfg: PolicyConfig = CFG) -> list[tuple[ParkMode | None, ModeReason | None, object]]:
    d = decide(PolicyInput(kv=snapshot, now_ms=NOW), cfg)
    return [(a.mode, a.mode_reason, a.tier) for a in d.parks]


def test_ram_first_then_disk_then_recompute() -> None:
    assert parks(snap()) == [(ParkMode.SWAP, ModeReason.FITS, ParkTier.RAM)]
    # host RAM cannot hold it: the disk tier does
    assert parks(snap(), replace(CFG, budget_bytes=4699)) == [(ParkMode.SWAP, ModeReason.DISK, ParkTier.DISK)]
    assert parks(snap(host_ram=4699)) == [(ParkMode.SWAP, ModeReason.DISK, ParkTier.DISK)]
    # nor does the disk: recompute
    full = DISK.model_copy(update={"budget_bytes": 4700 + 4095})
    assert parks(snap(disk=full), replace(CFG, budget_bytes=4699)) == [
        (ParkMode.RECOMPUTE, ModeReason.DISK_BUDGET, ParkTier.NONE)
    ]
    # a server without a disk tier: as before, no tier named
    assert parks(snap(disk=None), replace(CFG, budget_bytes=4699)) == [(ParkMode.RECOMPUTE, ModeReason.BUDGET, None)]


def test_park_tier_pins_the_tier() -> None:
    def pinned(choice: ParkTierChoice, **kw: object) -> list[tuple[ParkMode | None, ModeReason | None, object]]:
        return parks(snap(**kw), replace(CFG, park_tier=choice))

    assert pinned(ParkTierChoice.DISK) == [(ParkMode.SWAP, ModeReason.DISK, ParkTier.DISK)]
    assert pinned(ParkTierChoice.RAM, host_ram=4699) == [(ParkMode.RECOMPUTE, ModeReason.HOST_RAM, ParkTier.NONE)]
    assert pinned(ParkTierChoice.RECOMPUTE) == [(ParkMode.RECOMPUTE, ModeReason.RECOMPUTE_ONLY, ParkTier.NONE)]
    # disk pinned on a server without one: recompute
    assert parks(snap(disk=None), replace(CFG, park_tier=ParkTierChoice.DISK)) == [
        (ParkMode.RECOMPUTE, ModeReason.RECOMPUTE_ONLY, None)
    ]


def test_a_short_request_recomputes_and_a_long_one_goes_to_disk() -> None:
    # no RAM for snapshots; the disk writes and reads 1 MB/s, the server evaluates 1000 tokens/s
    cfg = replace(CFG, budget_bytes=0)
    rates = ParkRates(copy_bytes_per_s=10**9, prompt_tokens_per_s=1000)
    slow = DISK.model_copy(update={"write_bytes_per_s": 1e6, "read_bytes_per_s": 1e6})
    # 460 tokens: 0.46 s again, against 0.04 s fixed + 9.4 ms of bytes on disk: disk
    assert parks(snap(disk=slow, rates=rates), replace(cfg, budget_bytes=1)) == [
        (ParkMode.SWAP, ModeReason.DISK, ParkTier.DISK)
    ]
    # a request of 460 tokens whose snapshot is 1 MB (a model with a large KV per cell): recompute
    big = [S("generating", 500, t_arrival_ms=1), S("generating", 460, t_arrival_ms=2, snapshot_bytes=10**6)]
    snapshot = kv(1000, big, bytes_per_cell=10, park_modes=BOTH, disk=slow, rates=rates)
    assert parks(snapshot, replace(cfg, budget_bytes=1)) == [(ParkMode.RECOMPUTE, ModeReason.CHEAPER, ParkTier.NONE)]
    # unmeasured: disk
    assert parks(kv(1000, big, bytes_per_cell=10, park_modes=BOTH, disk=DISK), replace(cfg, budget_bytes=1)) == [
        (ParkMode.SWAP, ModeReason.DISK, ParkTier.DISK)
    ]


def test_two_victims_share_what_is_left_of_the_disk() -> None:
    slots = [
        S("generating", 600, t_arrival_ms=1),
        S("generating", 300, t_arrival_ms=2, snapshot_bytes=3000),
        S("generating", 40, t_arrival_ms=3, snapshot_bytes=400),
        S("generating", 40, t_arrival_ms=4, snapshot_bytes=400),
    ]
    disk = DISK.model_copy(update={"budget_bytes": 400 + 4096 + 10})
    snapshot = kv(1000, slots, bytes_per_cell=10, park_modes=BOTH, disk=disk)
    assert parks(snapshot, replace(CFG, budget_bytes=1)) == [
        (ParkMode.SWAP, ModeReason.DISK, ParkTier.DISK),
        (ParkMode.RECOMPUTE, ModeReason.DISK_BUDGET, ParkTier.NONE),
    ]


def test_snapshots_on_disk_leave_the_ram_budget_alone() -> None:
    slots = [*MODAL, S("parked", 300, parked_since_ms=NOW, tier=ParkTier.DISK)]
    snapshot = kv(1000, slots, bytes_per_cell=10, park_modes=BOTH, disk=DISK, budget=4700)
    assert snapshot.parked_bytes == 3000 and ram_parked_bytes(snapshot) == 0
    assert parks(snapshot) == [(ParkMode.SWAP, ModeReason.FITS, ParkTier.RAM)]


SPILL_DISK = DISK.model_copy(update={"spills": 0})  # a server that moves RAM snapshots to disk (patch 40)


def spill_snap(parked: S, disk: ParkDisk = SPILL_DISK, budget: int = 5000) -> KvSnapshot:
    """Slot 1 (priority 5, a 4700-byte snapshot) is the victim; RAM holds 2000 more bytes beside parked's 3000."""
    slots = [
        S("generating", 500, t_arrival_ms=1, priority=5),
        S("generating", 460, t_arrival_ms=2, snapshot_bytes=4700, priority=5),
        parked,
    ]
    return kv(1000, slots, bytes_per_cell=10, park_modes=BOTH, disk=disk, budget=budget)  # type: ignore[arg-type]


def test_ram_short_moves_a_lower_priority_snapshot_to_disk() -> None:
    low = S("parked", 300, parked_since_ms=NOW, priority=1)
    d = decide(PolicyInput(kv=spill_snap(low), now_ms=NOW), CFG)
    [a] = d.parks
    assert (a.slot, a.mode, a.mode_reason, a.tier) == (1, ParkMode.SWAP, ModeReason.SPILL, ParkTier.RAM)
    assert a.n_bytes == 4700 and a.spill_bytes == 3000
    # the server resumes an equal priority's older park first: the victim is the one to resume last, and goes to disk
    equal = S("parked", 300, parked_since_ms=NOW, priority=5)
    assert parks(spill_snap(equal)) == [(ParkMode.SWAP, ModeReason.DISK, ParkTier.DISK)]
    # on disk already, nothing to move
    on_disk = S("parked", 300, parked_since_ms=NOW, priority=1, tier=ParkTier.DISK)
    assert parks(spill_snap(on_disk, budget=2000)) == [(ParkMode.SWAP, ModeReason.DISK, ParkTier.DISK)]


def test_no_spill_where_it_cannot_make_room() -> None:
    low = S("parked", 300, parked_since_ms=NOW, priority=1)
    # a server that does not move snapshots
    assert parks(spill_snap(low, disk=DISK)) == [(ParkMode.SWAP, ModeReason.DISK, ParkTier.DISK)]
    # moving it would not free enough: 1000 + 3000 < 4700
    assert parks(spill_snap(low, budget=4000)) == [(ParkMode.SWAP, ModeReason.DISK, ParkTier.DISK)]
    # the disk cannot take its file, nor the victim's
    small = SPILL_DISK.model_copy(update={"budget_bytes": 3000 + 4095})
    assert parks(spill_snap(low, disk=small)) == [(ParkMode.RECOMPUTE, ModeReason.DISK_BUDGET, ParkTier.NONE)]
    # a pinned tier leaves the choice to the operator
    assert parks(spill_snap(low), replace(CFG, park_tier=ParkTierChoice.RAM)) == [
        (ParkMode.RECOMPUTE, ModeReason.BUDGET, ParkTier.NONE)
    ]


def test_one_snapshot_moves_for_one_park() -> None:
    # two victims of priority 5 (4700 bytes each) and one 3000-byte snapshot of priority 1 in RAM, 2000 bytes left:
    # the first takes the move, the second goes to disk
    slots = [
        S("generating", 400, t_arrival_ms=1, priority=5),
        S("generating", 300, t_arrival_ms=2, snapshot_bytes=4700, priority=5),
        S("generating", 260, t_arrival_ms=3, snapshot_bytes=4700, priority=5),
        S("parked", 300, parked_since_ms=NOW, priority=1),
    ]
    snapshot = kv(1000, slots, bytes_per_cell=10, park_modes=BOTH, disk=SPILL_DISK, budget=5000)
    d = decide(PolicyInput(kv=snapshot, now_ms=NOW), replace(CFG, high=0.5, low=0.3))
    assert [(a.mode_reason, a.spill_bytes) for a in d.parks] == [(ModeReason.SPILL, 3000), (ModeReason.DISK, 0)]


def test_a_snapshot_being_moved_is_restored_once_the_move_ends() -> None:
    slots = [S("generating", 200, t_arrival_ms=1), S("parked", 300, parked_since_ms=NOW - 1000, priority=1)]
    snapshot = kv(1000, slots, bytes_per_cell=10, park_modes=BOTH, disk=SPILL_DISK, budget=5000)
    d = decide(PolicyInput(kv=snapshot, now_ms=NOW), CFG)
    assert [a.slot for a in d.actions] == [1]  # room to spare: restored
    parked = snapshot.slots[1]
    raw = {**parked.park.model_dump(), "copy": "save"}  # as /slots says it while a spill writes it to disk
    moving = parked.model_copy(update={"park": ParkInfo.model_validate(raw)})
    assert moving.park.copying == "save"
    d = decide(PolicyInput(kv=snapshot.model_copy(update={"slots": [snapshot.slots[0], moving]}), now_ms=NOW), CFG)
    assert d.actions == () and (ActionKind.RESUME, 1, SkipReason.MOVING) in [
        (s.kind, s.slot, s.reason) for s in d.skipped
    ]
