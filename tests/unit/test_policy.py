"""The watermark policy: examples of each rule, and hypothesis properties over arbitrary snapshots."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controller.policy.admission import admission
from controller.policy.plan import decide
from controller.policy.pool import pressure
from controller.policy.types import (
    ActionKind,
    Decision,
    ModeReason,
    PolicyConfig,
    PolicyInput,
    Reason,
    SkipReason,
    TaskHistory,
)
from controller.settings import RestoreOrder
from controller.upstream.models import KvSnapshot, ParkMode, ParkRates, Slot, SlotState
from testkit.snapshots import S, kv
from tests.harness import BOTH, PROPS, snapshots
from tests.harness import POLICY_NOW as NOW

CFG = PolicyConfig(high=0.94, low=0.80, budget_bytes=10**12, host_reserve_bytes=0, margin_cells=0, max_wait_ms=30_000)


def run(snapshot: KvSnapshot, cfg: PolicyConfig = CFG, **kw: object) -> Decision:
    return decide(PolicyInput(kv=snapshot, now_ms=kw.pop("now_ms", NOW), **kw), cfg)  # type: ignore[arg-type]


def parked_slots(d: Decision) -> list[int]:
    return [a.slot for a in d.parks]


def resumed_slots(d: Decision) -> list[int]:
    return [a.slot for a in d.resumes]


# --- a parked request's size --------------------------------------------------------------------


def test_a_parked_request_needs_its_prompt_and_generated_tokens_but_the_pending_one() -> None:
    snap = kv(1000, [S("parked", 300, parked_since_ms=NOW)])
    slot = snap.slots[0]
    assert slot.n_cells == 0 and slot.cells == 300
    reported = slot.model_copy(update={"park": slot.park.model_copy(update={"n_cells": 123})})
    assert reported.cells == 123, "the server's own count wins when it reports one"


# --- projected occupancy ---------------------------------------------------------------------------


def test_projection_counts_next_step_and_leaves_idle_caches_out() -> None:
    snap = kv(1000, [S("generating", 400, n_draft_max=3), S("generating", 300), S("idle", 200)])
    p = pressure(snap)
    assert p.target == pytest.approx((700 + 1 + 3 + 1) / 1000)
    assert p.draft is None and p.value == p.target


def test_a_prompt_reserves_its_whole_unprefilled_rest_not_only_the_next_batch() -> None:
    # n_batch 64: the server's next step bounds the prompt at 63 tokens, but it goes on to take 500
    snap = kv(1000, [S("generating", 300, t_arrival_ms=1), S("prompt", 100, n_prompt_left=500)], n_batch=64)
    assert snap.next_step.n_prompt_max == 63
    assert pressure(snap).target == pytest.approx((400 + 1 + 500) / 1000)
    # the next step's share is part of the rest: counted once
    small = kv(1000, [S("generating", 300, t_arrival_ms=1), S("prompt", 100, n_prompt_left=40)], n_batch=64)
    assert small.next_step.n_prompt_max == 40
    assert pressure(small).target == pytest.approx((400 + 1 + 40) / 1000)


def test_the_draft_pool_counts_when_it_is_the_tighter_one() -> None:
    snap = kv(1000, [S("generating", 400), S("generating", 300)], draft_cells=720)
    p = pressure(snap)
    assert p.draft == pytest.approx(702 / 720)
    assert p.value == p.draft
    d = run(snap)
    assert d.parks, "the draft pool is above HIGH: something must be parked"


# --- parking ---------------------------------------------------------------------------------------


def test_below_high_nothing_is_parked() -> None:
    snap = kv(1000, [S("generating", 450, t_arrival_ms=1), S("generating", 480, t_arrival_ms=2)])
    assert pressure(snap).value < 0.94
    assert run(snap).actions == ()


def test_newest_is_parked_first_and_only_as_many_as_needed() -> None:
    snap = kv(
        1000,
        [
            S("generating", 400, t_arrival_ms=1),
            S("generating", 200, t_arrival_ms=3),
            S("generating", 200, t_arrival_ms=2),
            S("generating", 150, t_arrival_ms=4),
        ],
    )
    d = run(snap)
    assert parked_slots(d) == [3]
    assert all(a.reason is Reason.PRESSURE for a in d.parks)
    assert d.projected_after < 0.94


def test_ties_in_arrival_go_by_task_id() -> None:
    snap = kv(
        1000,
        [
            S("generating", 500, t_arrival_ms=1),
            S("generating", 230, t_arrival_ms=5, id_task=7),
            S("generating", 230, t_arrival_ms=5, id_task=9),
        ],
    )
    assert parked_slots(run(snap)) == [2]


def test_the_largest_resident_request_is_never_parked() -> None:
    # the newest is also the largest: the next newest goes instead
    snap = kv(1000, [S("generating", 300, t_arrival_ms=1), S("generating", 660, t_arrival_ms=2)])
    d = run(snap)
    assert parked_slots(d) == [0]
    assert any(s.reason is SkipReason.LARGEST and s.slot == 1 for s in d.skipped)


def test_a_request_parked_before_is_passed_over_while_another_candidate_exists() -> None:
    snap = kv(
        1000,
        [
            S("generating", 500, t_arrival_ms=1),
            S("generating", 220, t_arrival_ms=2),
            S("generating", 220, t_arrival_ms=3, park_count=1),
        ],
    )
    assert parked_slots(run(snap)) == [1]
    # the controller's own history counts as well as the server's park count
    snap2 = kv(
        1000,
        [
            S("generating", 500, t_arrival_ms=1),
            S("generating", 220, t_arrival_ms=2),
            S("generating", 220, t_arrival_ms=3, id_task=42),
        ],
    )
    assert parked_slots(run(snap2, history={42: TaskHistory(parks=1)})) == [1]


def test_a_repeat_victim_is_still_parked_when_it_is_the_only_candidate() -> None:
    snap = kv(1000, [S("generating", 600, t_arrival_ms=1), S("generating", 350, t_arrival_ms=2, park_count=3)])
    assert parked_slots(run(snap)) == [1]


def test_snapshots_never_exceed_the_budget() -> None:
    slots = [
        S("generating", 500, t_arrival_ms=1),
        S("generating", 300, t_arrival_ms=2),
        S("generating", 150, t_arrival_ms=3),
    ]
    # room for 200 cells of snapshot: the 150-cell one fits, the 300-cell one does not
    d = run(kv(1000, slots, bytes_per_cell=10), replace(CFG, budget_bytes=2000))
    assert parked_slots(d) == [2]
    # the server's budget is the tighter one here, less what is already parked
    snap = kv(1000, [*slots, S("parked", 100, parked_since_ms=1)], bytes_per_cell=10, budget=2400)
    d = run(snap)
    assert d.parks == ()
    assert [s.slot for s in d.skipped if s.reason is SkipReason.BUDGET] == [2, 1]


def test_snapshots_never_exceed_the_host_ram_headroom() -> None:
    snap = kv(1000, [S("generating", 500, t_arrival_ms=1), S("generating", 460, t_arrival_ms=2)], bytes_per_cell=10)
    d = run(snap, replace(CFG, host_reserve_bytes=1000), host_available_bytes=5000)
    assert d.parks == ()
    assert any(s.reason is SkipReason.HOST_RAM for s in d.skipped)
    d = run(snap, replace(CFG, host_reserve_bytes=1000), host_available_bytes=6000)
    assert parked_slots(d) == [1]


def test_prompt_processing_slots_are_not_parked_but_count() -> None:
    snap = kv(
        1000,
        [
            S("generating", 500, t_arrival_ms=1),
            S("prompt", 300, t_arrival_ms=3, n_prompt_left=200),
            S("generating", 100, t_arrival_ms=2),
        ],
    )
    d = run(snap)
    assert parked_slots(d) == [2]


def test_when_every_candidate_is_parked_and_it_is_still_high_it_says_so() -> None:
    snap = kv(1000, [S("generating", 900, t_arrival_ms=1), S("generating", 60, t_arrival_ms=2)])
    d = run(snap)
    assert parked_slots(d) == [1]
    assert d.projected_after < 0.94
    snap = kv(1000, [S("generating", 960, t_arrival_ms=1), S("generating", 10, t_arrival_ms=2)])
    d = run(snap)
    assert parked_slots(d) == [1]
    assert any(s.reason is SkipReason.UNRESOLVED for s in d.skipped)


# --- park modes ------------------------------------------------------------------------------------

# 962 of 1000 projected: slot 1 (the newest, 460 cells, not the largest) must be parked; its exact snapshot is
# 4700 bytes, more than its 460 cells x 10 bytes (a hybrid model's recurrent state, say)
MODAL = [S("generating", 500, t_arrival_ms=1), S("generating", 460, t_arrival_ms=2, snapshot_bytes=4700)]


def modal(**kw: object) -> KvSnapshot:
    return kv(1000, MODAL, bytes_per_cell=10, **{"park_modes": BOTH, **kw})  # type: ignore[arg-type]


def park_modes(d: Decision) -> list[tuple[int, ParkMode | None, ModeReason | None, int]]:
    return [(a.slot, a.mode, a.mode_reason, a.n_bytes) for a in d.parks]


def test_a_snapshot_that_fits_is_parked_by_swap_at_its_exact_size() -> None:
    d = run(modal(host_ram=10**9))
    assert park_modes(d) == [(1, ParkMode.SWAP, ModeReason.FITS, 4700)]
    assert d.skipped == ()


def test_a_snapshot_over_the_budget_is_parked_by_recompute() -> None:
    d = run(modal(), replace(CFG, budget_bytes=4699))
    assert park_modes(d) == [(1, ParkMode.RECOMPUTE, ModeReason.BUDGET, 0)]
    assert d.skipped == (), "a server that recomputes: nobody is passed over for memory"
    # the server's --park-ram, less what is parked, is the tighter one here
    snap = kv(1000, [*MODAL, S("parked", 10, parked_since_ms=NOW)], bytes_per_cell=10, park_modes=BOTH, budget=4750)
    assert park_modes(run(snap)) == [(1, ParkMode.RECOMPUTE, ModeReason.BUDGET, 0)]
    # a recompute-parked request holds no host RAM: it leaves the budget to the swap
    snap = kv(
        1000,
        [*MODAL, S("parked", 10, parked_since_ms=NOW, mode=ParkMode.RECOMPUTE)],
        bytes_per_cell=10,
        park_modes=BOTH,
        budget=4750,
    )
    assert park_modes(run(snap)) == [(1, ParkMode.SWAP, ModeReason.FITS, 4700)]


def test_a_snapshot_over_the_host_headroom_is_parked_by_recompute() -> None:
    cfg = replace(CFG, host_reserve_bytes=1000)
    # the smaller of what kvctl (psutil) and the server see, less the reserve
    assert park_modes(run(modal(host_ram=5700), cfg, host_available_bytes=10**9)) == [
        (1, ParkMode.SWAP, ModeReason.FITS, 4700)
    ]
    for server, ours in ((5699, 10**9), (10**9, 5699), (5699, None)):
        d = run(modal(host_ram=server), cfg, host_available_bytes=ours)
        assert park_modes(d) == [(1, ParkMode.RECOMPUTE, ModeReason.HOST_RAM, 0)], (server, ours)


def test_recompute_when_the_measured_rates_say_it_is_cheaper_than_the_copy() -> None:
    # evaluating 460 tokens at 1000/s: 0.46 s; copying 4700 bytes out and back at 10 kB/s: 0.94 s
    slow_copy = ParkRates(copy_bytes_per_s=10_000, prompt_tokens_per_s=1000)
    assert park_modes(run(modal(rates=slow_copy))) == [(1, ParkMode.RECOMPUTE, ModeReason.CHEAPER, 0)]
    fast_copy = ParkRates(copy_bytes_per_s=25_000, prompt_tokens_per_s=1000)  # 0.376 s
    assert park_modes(run(modal(rates=fast_copy))) == [(1, ParkMode.SWAP, ModeReason.FITS, 4700)]
    unmeasured = ParkRates(copy_bytes_per_s=None, prompt_tokens_per_s=1000)
    assert park_modes(run(modal(rates=unmeasured))) == [(1, ParkMode.SWAP, ModeReason.FITS, 4700)]


def test_recompute_only_on_a_server_without_swap_or_with_a_zero_budget() -> None:
    only = (ParkMode.RECOMPUTE,)
    assert park_modes(run(modal(park_modes=only, budget=0))) == [(1, ParkMode.RECOMPUTE, ModeReason.RECOMPUTE_ONLY, 0)]
    assert park_modes(run(modal(), replace(CFG, budget_bytes=0))) == [
        (1, ParkMode.RECOMPUTE, ModeReason.RECOMPUTE_ONLY, 0)
    ]


def test_an_older_server_parks_by_swap_only_and_passes_over_what_does_not_fit() -> None:
    snap = kv(1000, MODAL, bytes_per_cell=10)  # no park_modes: the snapshot size is n_cells x bytes_per_cell
    assert park_modes(run(snap)) == [(1, ParkMode.SWAP, ModeReason.FITS, 4600)]
    for d in (run(snap, replace(CFG, budget_bytes=4599)), run(snap, replace(CFG, budget_bytes=0))):
        assert d.parks == ()
        assert [(s.slot, s.reason) for s in d.skipped][:2] == [(1, SkipReason.BUDGET), (0, SkipReason.LARGEST)]
    d = run(snap, host_available_bytes=4599)
    assert d.parks == () and any(s.reason is SkipReason.HOST_RAM for s in d.skipped)


def test_a_server_that_parks_by_no_mode_gets_no_parks() -> None:
    d = run(modal(park_modes=()))
    assert d.parks == ()
    assert (d.skipped[0].slot, d.skipped[0].reason) == (1, SkipReason.PARKING_OFF)


def test_a_budget_that_holds_one_snapshot_swaps_the_first_victim_and_recomputes_the_second() -> None:
    slots = [
        S("generating", 600, t_arrival_ms=1),
        S("generating", 300, t_arrival_ms=2),
        S("generating", 40, t_arrival_ms=3),
        S("generating", 40, t_arrival_ms=4),
    ]
    # 984 projected: parking the newest leaves 943, still at HIGH; the next one makes it 902
    d = run(kv(1000, slots, bytes_per_cell=10, park_modes=BOTH), replace(CFG, budget_bytes=500))
    assert park_modes(d) == [
        (3, ParkMode.SWAP, ModeReason.FITS, 400),
        (2, ParkMode.RECOMPUTE, ModeReason.BUDGET, 0),
    ]
    # the host headroom is used up the same way, by swaps only
    d = run(kv(1000, slots, bytes_per_cell=10, park_modes=BOTH, host_ram=500))
    assert park_modes(d) == [
        (3, ParkMode.SWAP, ModeReason.FITS, 400),
        (2, ParkMode.RECOMPUTE, ModeReason.HOST_RAM, 0),
    ]


# --- restoring -------------------------------------------------------------------------------------


def test_restore_while_it_stays_at_or_below_low() -> None:
    snap = kv(
        1000,
        [
            S("generating", 400, t_arrival_ms=1),
            S("parked", 300, parked_since_ms=NOW - 10),
            S("parked", 200, parked_since_ms=NOW - 5),
        ],
    )
    d = run(snap)
    assert resumed_slots(d) == [1]  # 400 + 300 + 2 = 702; adding the other would make 903 > 800
    assert d.resumes[0].reason is Reason.BELOW_LOW
    assert any(s.reason is SkipReason.ABOVE_LOW and s.slot == 2 for s in d.skipped)


def test_a_request_evaluating_its_tokens_again_counts_at_its_full_length() -> None:
    # slot 1 was resumed by recompute: 100 of its 600 tokens evaluated again, 500 to go (63 in the next batch)
    slots = [
        S("generating", 300, t_arrival_ms=1),
        S("prompt", 100, t_arrival_ms=2, n_prompt_left=500, mode=ParkMode.RECOMPUTE, recomputing=True),
        S("parked", 300, parked_since_ms=NOW - 10),
    ]
    snap = kv(1000, slots, park_modes=BOTH, n_batch=64)
    assert snap.slots[1].park.recomputing and snap.next_step.n_prompt_max == 63
    # 300 + 1 + 100 + 500 + 300 + 1 = 1202 > 800
    d = run(snap)
    assert d.resumes == ()
    assert any(s.reason is SkipReason.ABOVE_LOW and s.slot == 2 for s in d.skipped)
    # counting only the next batch, it would fit: 300 + 1 + 100 + 63 + 300 + 1 = 765
    unreserved = snap.model_copy(
        update={"slots": tuple(s.model_copy(update={"n_prefill_left": 0}) for s in snap.slots)}
    )
    assert resumed_slots(run(unreserved)) == [2]


def test_a_test_park_is_left_to_the_server() -> None:
    """--park-test-interval parks are resumed by the server on its next iteration: a resume of one would race it."""
    snap = kv(1000, [S("generating", 400, t_arrival_ms=1), S("parked", 300, parked_since_ms=NOW - 10)])
    assert resumed_slots(run(snap)) == [1]
    test_park = snap.slots[1].park.model_copy(update={"test": True})
    snap = snap.model_copy(update={"slots": [snap.slots[0], snap.slots[1].model_copy(update={"park": test_park})]})
    assert resumed_slots(run(snap)) == []


def test_a_request_parked_by_recompute_is_restored_at_its_full_length() -> None:
    snap = kv(
        1000,
        [S("generating", 300, t_arrival_ms=1), S("parked", 450, parked_since_ms=NOW - 10, mode=ParkMode.RECOMPUTE)],
        park_modes=BOTH,
    )
    assert snap.slots[1].park.n_cells == 450 and snap.slots[1].park.bytes == 0
    d = run(snap)
    assert [(a.slot, a.n_cells, a.n_bytes) for a in d.resumes] == [(1, 450, 0)]  # 752 <= 800; it frees no host RAM
    assert run(snap, replace(CFG, margin_cells=49)).resumes == ()  # 801 > 800


def test_the_margin_counts() -> None:
    snap = kv(1000, [S("generating", 400, t_arrival_ms=1), S("parked", 390, parked_since_ms=NOW - 10)])
    assert resumed_slots(run(snap)) == [1]
    assert resumed_slots(run(snap, replace(CFG, margin_cells=20))) == []


def test_fifo_is_head_of_line_and_seed_order_passes_over() -> None:
    slots = [
        S("generating", 300, t_arrival_ms=1),
        S("parked", 600, parked_since_ms=NOW - 20, park_count=1),  # the head: does not fit below LOW
        S("parked", 100, parked_since_ms=NOW - 10, park_count=2),  # fits, but must not overtake (fifo)
    ]
    assert resumed_slots(run(kv(1000, slots), replace(CFG, order=RestoreOrder.FIFO))) == []
    for order in (RestoreOrder.SEED, RestoreOrder.AGING):
        assert resumed_slots(run(kv(1000, slots), replace(CFG, order=order))) == [2]


def test_seed_order_is_most_parked_then_longest_waiting() -> None:
    slots = [
        S("parked", 100, parked_since_ms=NOW - 30, park_count=1),
        S("parked", 100, parked_since_ms=NOW - 10, park_count=3),
        S("parked", 100, parked_since_ms=NOW - 20, park_count=3),
        S("generating", 50, t_arrival_ms=1),
    ]
    d = run(kv(1000, slots), replace(CFG, order=RestoreOrder.SEED))
    assert resumed_slots(d) == [2, 1, 0]
    assert resumed_slots(run(kv(1000, slots))) == [2, 1, 0], "aging: nobody has waited half of max_wait"
    d = run(kv(1000, slots), replace(CFG, order=RestoreOrder.FIFO))
    assert resumed_slots(d) == [0, 2, 1]


def test_aging_puts_whoever_waited_half_of_max_wait_ahead_of_the_most_parked() -> None:
    half = CFG.max_wait_ms // 2
    slots = [
        S("generating", 500, t_arrival_ms=1),
        S("parked", 200, parked_since_ms=NOW - half + 1, park_count=3),  # parked again and again, not for long
        S("parked", 200, parked_since_ms=NOW - half, park_count=1),  # parked once, half of max_wait ago
    ]
    # room below LOW for one of the two: the seed's order restores the most-parked, aging the long waiter
    assert resumed_slots(run(kv(1000, slots), replace(CFG, order=RestoreOrder.SEED))) == [1]
    d = run(kv(1000, slots))
    assert resumed_slots(d) == [2]
    assert d.resumes[0].waited_ms == half
    # among the aged, the seed's order again: most-parked first
    older = [*slots, S("parked", 200, parked_since_ms=NOW - half - 5000, park_count=1)]
    older[1] = S("parked", 200, parked_since_ms=NOW - half - 1, park_count=3)
    assert resumed_slots(run(kv(1000, older))) == [1]


def test_nothing_resident_restores_the_head_above_low() -> None:
    snap = kv(
        1000, [S("parked", 900, parked_since_ms=NOW - 10), S("parked", 50, parked_since_ms=NOW - 5), S("idle", 100)]
    )
    d = run(snap)
    assert [(a.slot, a.reason) for a in d.resumes] == [(0, Reason.NOTHING_RESIDENT)]


def test_a_request_that_cannot_fit_alone_is_ended_once_nothing_is_resident() -> None:
    d = run(kv(1000, [S("parked", 1000, parked_since_ms=NOW - 10), S("parked", 50, parked_since_ms=NOW - 5)]))
    assert [(a.kind, a.slot) for a in d.actions] == [(ActionKind.END, 0), (ActionKind.RESUME, 1)]
    assert d.actions[0].reason is Reason.CANNOT_FIT
    d = run(
        kv(
            1000,
            [
                S("generating", 100, t_arrival_ms=1),
                S("parked", 1000, parked_since_ms=NOW - 10),
                S("parked", 50, parked_since_ms=NOW - 5),
            ],
        )
    )
    assert [(a.kind, a.slot) for a in d.actions] == [(ActionKind.RESUME, 2)]
    assert any(s.reason is SkipReason.AWAIT_EMPTY_POOL for s in d.skipped)


def test_a_starving_head_is_restored_below_high_and_room_is_made_for_it() -> None:
    slots = [
        S("generating", 400, t_arrival_ms=1),
        S("generating", 200, t_arrival_ms=5),
        S("parked", 300, parked_since_ms=NOW - 10_000),
    ]
    assert run(kv(1000, slots)).actions == ()
    # waited too long: 400 + 200 + 300 + 3 = 903 < 940, restored above LOW
    slots[2] = replace(slots[2], parked_since_ms=NOW - 31_000)
    d = run(kv(1000, slots))
    assert [(a.kind, a.slot, a.reason) for a in d.actions] == [(ActionKind.RESUME, 2, Reason.STARVATION)]
    # a bigger one: the newest resident makes room, never the largest
    slots[2] = replace(slots[2], n_cells=450)
    d = run(kv(1000, slots))
    assert [(a.kind, a.slot, a.reason) for a in d.actions] == [
        (ActionKind.PARK, 1, Reason.MAKE_ROOM),
        (ActionKind.RESUME, 2, Reason.STARVATION),
    ]
    # no permitted park makes room: nothing is done at all
    slots[0] = replace(slots[0], n_cells=600)
    d = run(kv(1000, slots))
    assert d.actions == ()
    assert any(s.reason is SkipReason.NO_ROOM for s in d.skipped)


def test_pinned_requests_stay_parked_and_do_not_block_others() -> None:
    snap = kv(1000, [S("parked", 100, parked_since_ms=NOW - 10, id_task=5), S("parked", 100, parked_since_ms=NOW)])
    d = run(snap, history={5: TaskHistory(pinned=True)})
    assert resumed_slots(d) == [1]
    assert any(s.reason is SkipReason.PINNED and s.slot == 0 for s in d.skipped)


def test_gpu_memory_under_the_floor_holds_restores() -> None:
    snap = kv(1000, [S("generating", 100, t_arrival_ms=1), S("parked", 100, parked_since_ms=NOW)])
    assert resumed_slots(run(snap, gpu_free_bytes=10 * 1024**3)) == [1]
    d = run(snap, gpu_free_bytes=1)
    assert d.pressure.gpu_low and d.resumes == ()
    assert any(s.reason is SkipReason.GPU_PRESSURE for s in d.skipped)
    # no GPU: nothing changes
    assert resumed_slots(run(snap, gpu_free_bytes=None)) == [1]


def test_no_restore_in_the_decision_that_parks_for_pressure() -> None:
    snap = kv(
        1000,
        [
            S("generating", 700, t_arrival_ms=1),
            S("generating", 250, t_arrival_ms=2),
            S("parked", 10, parked_since_ms=NOW - 100_000),
        ],
    )
    d = run(snap)
    assert parked_slots(d) == [1] and d.resumes == ()


def test_admission_waits_for_parked_requests_and_room() -> None:
    cfg = CFG
    parked = kv(1000, [S("generating", 100, t_arrival_ms=1), S("parked", 100, parked_since_ms=NOW)])
    assert not admission(PolicyInput(parked, NOW), cfg, 10).admit
    assert admission(PolicyInput(parked, NOW, history={101: TaskHistory(pinned=True)}), cfg, 10).admit
    busy = kv(1000, [S("generating", 800, t_arrival_ms=1)])
    assert admission(PolicyInput(busy, NOW), cfg, 100).admit
    assert not admission(PolicyInput(busy, NOW), cfg, 200).admit
    assert admission(PolicyInput(kv(1000, [S("idle", 900)]), NOW), cfg, 900).admit


def test_admission_allowance_is_how_many_reserved_requests_fit_below_high() -> None:
    empty = kv(1000, [S("idle", 900)])  # an idle slot's cells are a cache: they do not count
    a = admission(PolicyInput(empty, NOW), CFG, 100)
    assert a.allowance == 9  # 9 x (100 + 1) = 909 < 940; 10 would reach HIGH
    assert a.room_cells == 939 and a.empty
    busy = kv(1000, [S("generating", 800, t_arrival_ms=1)])  # 800 + 1 of its next step
    assert admission(PolicyInput(busy, NOW), CFG, 60).allowance == 2  # 801 + 2 x 61 = 923 < 940
    assert admission(PolicyInput(busy, NOW), CFG, 60).room_cells == 138  # 801 + 138 = 939 < 940
    assert admission(PolicyInput(busy, NOW), CFG, 200).allowance == 0
    # a request larger than the reserve still starts on an empty pool
    assert admission(PolicyInput(kv(1000, []), NOW), CFG, 5000).allowance == 1
    parked = kv(1000, [S("parked", 100, parked_since_ms=NOW)])
    assert admission(PolicyInput(parked, NOW), CFG, 10).allowance == 0


def test_admission_reserves_the_unprefilled_rest_of_prompts_in_progress() -> None:
    snap = kv(1000, [S("prompt", 100, t_arrival_ms=1, n_prompt_left=600)], n_batch=64)
    a = admission(PolicyInput(snap, NOW), CFG, 100)
    assert a.allowance == 2  # 700 + 2 x 101 = 902 < 940; 3 would reach HIGH
    assert a.room_cells == 239
    # a re-evaluation after a recompute resume reserves the same way
    snap = kv(1000, [S("prompt", 100, t_arrival_ms=1, n_prompt_left=600, recomputing=True)], n_batch=64)
    assert admission(PolicyInput(snap, NOW), CFG, 100).allowance == 2


@given(st.integers(1, 4096), st.integers(0, 4096), st.integers(1, 2000), st.none() | st.integers(1, 8192))
def test_admission_allowance_is_exact(n_cells: int, used: int, reserve: int, draft: int | None) -> None:
    used = min(used, n_cells, draft or n_cells)
    snap = kv(n_cells, [S("generating", used, t_arrival_ms=1)] if used else [], draft_cells=draft)
    a = admission(PolicyInput(snap, NOW), CFG, reserve)
    k = a.allowance
    assert k is not None and a.room_cells is not None and a.admit == (k > 0)
    projected = used + (1 if used else 0)
    # in cells: HIGH (0.94) is reached at ceil(94 n / 100) cells of a pool; both hold the same cells
    high = min(-(-94 * n // 100) for n in (n_cells, draft or n_cells))
    assert a.room_cells == max(0, high - 1 - projected)
    if used:
        assert k == 0 or projected + k * (reserve + 1) < high
        assert projected + (k + 1) * (reserve + 1) >= high
    else:
        assert k >= 1


# --- properties ------------------------------------------------------------------------------------


def largest(slots: tuple[Slot, ...]) -> Slot | None:
    res = [s for s in slots if s.state in (SlotState.PROMPT, SlotState.GENERATING)]
    if not res:
        return None
    best = res[0]
    for s in res[1:]:
        a_s = s.t_arrival_ms or 0
        a_b = best.t_arrival_ms or 0
        if (s.n_cells, -a_s, -(s.id_task or -1), -s.id) > (best.n_cells, -a_b, -(best.id_task or -1), -best.id):
            best = s
    return best


@PROPS
@given(snapshots(), st.sampled_from([None, 1, 10**12]))
def test_parks_never_exceed_the_budget_or_the_host_headroom(
    case: tuple[KvSnapshot, PolicyConfig, int | None], gpu: int | None
) -> None:
    snap, cfg, host = case
    d = decide(PolicyInput(snap, NOW, host_available_bytes=host, gpu_free_bytes=gpu), cfg)
    parked = sum(a.n_bytes for a in d.parks)
    server = snap.park_ram_budget_bytes if snap.park_ram_budget_bytes is not None else float("inf")
    assert parked <= max(0, min(cfg.budget_bytes, server) - snap.parked_bytes)
    for available in (host, snap.host_ram_available_bytes):
        if available is not None:
            assert parked <= max(0, available - cfg.host_reserve_bytes)
    modes = snap.park_modes
    by_id = {s.id: s for s in snap.slots}
    for a in d.parks:
        size = by_id[a.slot].park.snapshot_bytes
        if a.mode is ParkMode.SWAP:
            assert modes is None or ParkMode.SWAP in modes
            assert a.n_bytes == (size if size is not None else a.n_cells * snap.bytes_per_cell)
        else:
            assert a.mode is ParkMode.RECOMPUTE and modes is not None and ParkMode.RECOMPUTE in modes
            assert a.n_bytes == 0
    memory = {SkipReason.BUDGET, SkipReason.HOST_RAM}
    if modes is not None and ParkMode.RECOMPUTE in modes:
        assert not [s for s in d.skipped if s.reason in memory], "a server that recomputes: nobody waits for memory"
    if modes == ():
        assert d.parks == ()


@PROPS
@given(snapshots())
def test_the_largest_resident_request_is_never_parked_whatever_the_snapshot(
    case: tuple[KvSnapshot, PolicyConfig, int | None],
) -> None:
    snap, cfg, host = case
    d = decide(PolicyInput(snap, NOW, host_available_bytes=host), cfg)
    big = largest(snap.slots)
    for a in d.parks:
        assert big is not None and a.slot != big.id
        victim = next(s for s in snap.slots if s.id == a.slot)
        assert victim.state is SlotState.GENERATING and a.id_task == victim.id_task


@PROPS
@given(snapshots(), st.sampled_from([None, 1]))
def test_restores_stay_at_or_below_low_except_through_the_no_starvation_rule(
    case: tuple[KvSnapshot, PolicyConfig, int | None], gpu: int | None
) -> None:
    snap, cfg, host = case
    d = decide(PolicyInput(snap, NOW, host_available_bytes=host, gpu_free_bytes=gpu), cfg)
    by_id = {s.id: s for s in snap.slots}
    idle = sum(s.n_cells for s in snap.slots if s.state is SlotState.IDLE)
    active = snap.n_cells_used - idle
    # every prompt in progress reserves its whole rest, of which the next step's prompt tokens are part
    prefill = sum(s.n_prefill_left for s in snap.slots if s.state is SlotState.PROMPT)
    nxt = snap.next_step
    step = nxt.n_gen + nxt.n_draft_max + max(nxt.n_prompt_max, prefill)
    residents = sum(1 for s in snap.slots if s.state in (SlotState.PROMPT, SlotState.GENERATING))
    pools = [snap.n_cells] + ([snap.draft.n_cells] if snap.draft and snap.draft.n_cells > 0 else [])
    draft_used = snap.draft.n_cells_used - idle if snap.draft else 0
    head_waits = []
    for a in d.actions:
        s = by_id[a.slot]
        if a.kind is ActionKind.PARK:
            active -= s.n_cells
            draft_used -= s.n_cells
            step -= 1 + s.n_draft_max
            residents -= 1
        elif a.kind is ActionKind.RESUME:
            own = 1 + s.n_draft_max
            used = [active, draft_used][: len(pools)]
            # exactly, in the watermarks' decimal values: no float tolerance at the edge
            after = max(
                Fraction(u + s.cells + step + own + cfg.margin_cells, n) for u, n in zip(used, pools, strict=True)
            )
            if a.reason is Reason.BELOW_LOW:
                assert after <= Fraction(str(cfg.low))
                assert not d.pressure.gpu_low
            elif a.reason is Reason.NOTHING_RESIDENT:
                assert residents == 0
                assert s.cells + 1 <= min(pools)
            else:
                assert a.reason is Reason.STARVATION
                assert NOW - (s.park.parked_since_ms or 0) >= cfg.max_wait_ms
                high = Fraction(str(cfg.high))
                assert max(Fraction(u + s.cells + step + own, n) for u, n in zip(used, pools, strict=True)) < high
                head_waits.append(a.slot)
            active += s.cells
            draft_used += s.cells
            step += own
            residents += 1
        else:
            assert a.reason is Reason.CANNOT_FIT and residents == 0 and s.cells + 1 > min(pools)
    assert len(head_waits) <= 1, "only the head of the restore order may starve its way in"


@PROPS
@given(snapshots(), st.randoms(use_true_random=False))
def test_the_same_input_gives_the_same_decision(
    case: tuple[KvSnapshot, PolicyConfig, int | None], rnd: random.Random
) -> None:
    snap, cfg, host = case
    inp = PolicyInput(snap, NOW, host_available_bytes=host)
    first = decide(inp, cfg)
    assert decide(inp, cfg) == first
    shuffled = list(snap.slots)
    rnd.shuffle(shuffled)
    assert (
        decide(PolicyInput(snap.model_copy(update={"slots": tuple(shuffled)}), NOW, host_available_bytes=host), cfg)
        == first
    )


# --- liveness: a small simulated server ------------------------------------------------------------


@dataclass
class Req:
    task: int
    cells: int
    left: int  # tokens still to generate
    arrival: int
    draft: int = 0
    parked: bool = False
    park_count: int = 0
    parked_since: int = 0


@dataclass
class Sim:
    n: int
    slots: dict[int, Req]
    now: int = NOW
    ended: list[int] = field(default_factory=list)
    history: dict[int, TaskHistory] = field(default_factory=dict)  # kept as the control loop keeps it
    cfg: PolicyConfig = CFG

    def input(self) -> PolicyInput:
        return PolicyInput(self.snapshot(), self.now, self.history)

    def snapshot(self) -> KvSnapshot:
        specs = []
        for i in range(max(self.slots, default=-1) + 1):
            r = self.slots.get(i)
            if r is None:
                specs.append(S("idle"))
            else:
                specs.append(
                    S(
                        "parked" if r.parked else "generating",
                        r.cells,
                        id_task=r.task,
                        t_arrival_ms=r.arrival,
                        park_count=r.park_count,
                        parked_since_ms=r.parked_since,
                        n_draft_max=r.draft,
                    )
                )
        return kv(self.n, specs, bytes_per_cell=1)

    def used(self) -> int:
        return sum(r.cells for r in self.slots.values() if not r.parked)

    def apply(self, d: Decision) -> None:
        for a in d.actions:
            r = self.slots.get(a.slot)
            assert r is not None and r.task == a.id_task
            if a.kind is ActionKind.PARK:
                assert not r.parked
                r.parked, r.park_count, r.parked_since = True, r.park_count + 1, self.now
                self.history[r.task] = self.history.get(r.task, TaskHistory()).parked()
            elif a.kind is ActionKind.RESUME:
                assert r.parked
                if r.cells > self.n - self.used():
                    return  # 503: not enough free cells; the rest of the decision is dropped
                r.parked = False
            else:
                self.ended.append(r.task)
                del self.slots[a.slot]

    def advance(self) -> None:
        """One decode step: the oldest requests get room first; a request alone at the pool's end finishes."""
        running = sorted((r for r in self.slots.values() if not r.parked), key=lambda r: r.arrival)
        for r in running:
            if self.used() + 1 <= self.n:
                r.cells += 1
                r.left -= 1
            elif len(running) == 1:
                r.left = 0  # the context limit: the server stops it
        for i, r in list(self.slots.items()):
            if not r.parked and r.left <= 0:
                del self.slots[i]
        self.now += 100


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Sim, PolicyConfig]:
    n = draw(st.integers(50, 600))
    reqs: dict[int, Req] = {}
    free = n
    for i in range(draw(st.integers(1, 6))):
        parked = draw(st.booleans())
        cells = draw(st.integers(1, n if parked else max(1, free)))
        if not parked:
            if cells > free:
                continue
            free -= cells
        reqs[i] = Req(
            task=100 + i,
            cells=cells,
            left=draw(st.integers(1, 200)),
            arrival=draw(st.integers(0, 10)),
            draft=draw(st.sampled_from([0, 0, 2])),
            parked=parked,
            park_count=int(parked),
            parked_since=NOW - draw(st.integers(0, 5000)),
        )
    cfg = PolicyConfig(
        high=draw(st.floats(0.6, 0.98)),
        low=0.0,
        budget_bytes=10**9,
        host_reserve_bytes=0,
        margin_cells=draw(st.integers(0, 8)),
        order=draw(st.sampled_from(list(RestoreOrder))),
        max_wait_ms=draw(st.integers(1000, 60_000)),
    )
    cfg = replace(cfg, low=draw(st.floats(0.1, cfg.high - 0.05)))
    return Sim(n, reqs, cfg=cfg), cfg


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_once_arrivals_stop_every_parked_request_is_restored_or_ended(case: tuple[Sim, PolicyConfig]) -> None:
    sim, cfg = case
    work = sum(r.left for r in sim.slots.values())
    bound = 2 * work + 4 * (cfg.max_wait_ms // 100 + 10) * max(1, len(sim.slots))
    too_big = {r.task for r in sim.slots.values() if r.parked and r.cells + 1 > sim.n}
    steps = 0
    while sim.slots:
        assert steps < bound, f"still waiting after {steps} steps: {sim.slots}"
        sim.apply(decide(sim.input(), cfg))
        sim.advance()
        steps += 1
    assert set(sim.ended) == too_big, "only requests larger than the pool are ended"


def test_a_request_larger_than_low_times_the_pool_is_restored_once_arrivals_stop() -> None:
    sim = Sim(
        1000,
        {
            0: Req(1, 300, 100, arrival=1),
            1: Req(2, 900, 50, arrival=2, parked=True, park_count=1, parked_since=NOW - 10),
        },
    )
    restored_at = None
    for step in range(400):
        sim.apply(decide(sim.input(), CFG))
        if 1 in sim.slots and not sim.slots[1].parked and restored_at is None:
            restored_at = step
        sim.advance()
        if not sim.slots:
            break
    assert not sim.slots and restored_at is not None


# --- an iSWA model's window pool ------------------------------------------------------------------


def test_a_full_window_pool_that_fits_parks_nothing() -> None:
    # Gemma 3 at -np 4: a window pool of 4 windows of 512 plus a batch; long requests fill their windows
    snap = kv(8192, [S("generating", 2500, t_arrival_ms=i) for i in range(1, 4)], swa=(1539, 512))
    p = pressure(snap)
    assert p.swa == pytest.approx(1.0), "exactly full: the next step fits"
    assert p.value == p.target, "the window pool is held to its size, not to the watermarks"
    assert run(snap).actions == ()


def test_the_window_pool_parks_when_it_would_overflow() -> None:
    # a window pool smaller than its windows (a server sized for fewer slots): the target pool has room
    snap = kv(8192, [S("generating", 2000, t_arrival_ms=i) for i in range(1, 4)], swa=(1100, 512))
    p = pressure(snap)
    assert p.target < 0.8 and p.swa is not None and p.swa > 1.0
    assert p.value == p.swa
    d = run(snap)
    assert parked_slots(d) == [2], "the newest is parked until the windows fit"
    assert d.projected_after <= 1.0


def test_a_restore_needs_room_for_its_window_only() -> None:
    # one window of room: a parked 3000-cell request comes back (it needs 512 window cells, not 3000)
    snap = kv(
        8192,
        [S("generating", 3000, t_arrival_ms=1), S("parked", 3000, t_arrival_ms=2, parked_since_ms=NOW - 10)],
        swa=(1280, 512),
        park_modes=BOTH,
    )
    assert resumed_slots(run(snap)) == [1]
    # no room for a second window: it stays parked
    tight = kv(
        8192,
        [S("generating", 3000, t_arrival_ms=1), S("parked", 3000, t_arrival_ms=2, parked_since_ms=NOW - 10)],
        swa=(1000, 512),
        park_modes=BOTH,
    )
    assert resumed_slots(run(tight)) == []
