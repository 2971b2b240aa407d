"""The policy's watermarks in whole cells: the exact edges of HIGH and LOW, where float arithmetic can be a cell off.

Each watermark counts as its decimal value: HIGH is reached at ceil(high x n) projected cells, LOW allows up to
floor(low x n). The pool sizes below are ones where the float product is not a whole number although the decimal
one is (0.55 x 100 gives 55.00000000000001, 0.94 x 2150 gives 2020.9999999999998, 0.7 x 90 gives 62.99999999999999),
so rounding the float product would put the edge a cell off.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.policy.admission import admission
from controller.policy.plan import decide
from controller.policy.pool import pressure
from controller.policy.types import Decision, PolicyConfig, PolicyInput, Reason, SkipReason
from controller.upstream.models import KvSnapshot, SlotState
from testkit.snapshots import S, kv
from tests.harness import PROPS, snapshots

CFG = PolicyConfig(high=0.94, low=0.80, budget_bytes=10**12, host_reserve_bytes=0, margin_cells=0, max_wait_ms=30_000)
NOW = 1_000_000


def run(snapshot: KvSnapshot, cfg: PolicyConfig = CFG) -> Decision:
    return decide(PolicyInput(kv=snapshot, now_ms=NOW), cfg)


def two_generating(n: int, projected: int, *, draft_cells: int | None = None) -> KvSnapshot:
    """An older, larger request and a newer one (the victim), ``projected`` cells in all with their next steps."""
    big = projected * 2 // 3
    return kv(
        n,
        [S("generating", big, t_arrival_ms=1), S("generating", projected - 2 - big, t_arrival_ms=2)],
        draft_cells=draft_cells,
    )


# --- HIGH: parks from ceil(high x n) projected cells -----------------------------------------------

HIGH_EDGES = [
    # n, high, ceil(high x n) computed by hand
    (1000, 0.94, 940),
    (100, 0.55, 55),  # 0.55 * 100 == 55.00000000000001: a float ceil would say 56
    (300, 0.81, 243),  # 0.81 * 300 == 243.00000000000003
    (2150, 0.94, 2021),  # 0.94 * 2150 == 2020.9999999999998: truncated, 2020
    (8192, 0.94, 7701),  # 7700.48: the edge between two cells
]


@pytest.mark.parametrize(("n", "high", "edge"), HIGH_EDGES)
def test_a_projection_of_exactly_ceil_high_cells_parks_and_one_fewer_does_not(n: int, high: float, edge: int) -> None:
    cfg = replace(CFG, high=high, low=high / 2)
    at = run(two_generating(n, edge), cfg)
    assert [(a.slot, a.reason) for a in at.parks] == [(1, Reason.PRESSURE)]
    assert at.pressure.value == edge / n
    below = run(two_generating(n, edge - 1), cfg)
    assert below.actions == () and below.skipped == ()


def test_the_high_edge_of_the_draft_pool_is_counted_in_its_own_cells() -> None:
    # the draft pool (1000 cells) is the tighter one; the target's 2000 cells are far from HIGH
    at = run(two_generating(2000, 940, draft_cells=1000))
    assert [a.slot for a in at.parks] == [1]
    assert pressure(two_generating(2000, 940, draft_cells=1000)).draft == 0.94
    assert run(two_generating(2000, 939, draft_cells=1000)).actions == ()


@given(st.integers(8, 200_000), st.integers(50, 99))
def test_the_high_edge_is_exact_for_any_pool_size(n: int, percent: int) -> None:
    edge = -(-percent * n // 100)  # ceil(percent / 100 x n), in integers
    cfg = replace(CFG, high=percent / 100, low=0.25)
    assert [a.slot for a in run(two_generating(n, edge), cfg).parks] == [1]
    assert run(two_generating(n, edge - 1), cfg).actions == ()


def test_parking_for_pressure_stops_at_the_first_projection_below_high() -> None:
    # 938 cells + 3 next-step cells = 941; parking the 1-cell newest leaves 939, strictly below 940: one park is enough
    snap = kv(
        1000,
        [
            S("generating", 500, t_arrival_ms=1),
            S("generating", 437, t_arrival_ms=2),
            S("generating", 1, t_arrival_ms=3),
        ],
    )
    d = run(snap)
    assert [a.slot for a in d.parks] == [2] and d.projected_after == 0.939


def test_a_starving_head_is_restored_strictly_below_high() -> None:
    def starving(n_cells: int) -> KvSnapshot:
        return kv(1000, [S("generating", 400, t_arrival_ms=1), S("parked", n_cells, parked_since_ms=NOW - 31_000)])

    # 400 + 1 + 537 + 1 = 939 projected after the restore: below 940
    d = run(starving(537))
    assert [(a.slot, a.reason) for a in d.resumes] == [(1, Reason.STARVATION)]
    assert d.projected_after == 0.939
    # 940 would reach HIGH, and the only resident is the largest: no park may make room
    d = run(starving(538))
    assert d.actions == ()
    assert [(s.slot, s.reason) for s in d.skipped] == [(1, SkipReason.NO_ROOM)]


@PROPS
@given(snapshots(), st.sampled_from([None, 1]))
def test_parks_for_pressure_start_at_high_and_stop_at_the_first_projection_below_it(
    case: tuple[KvSnapshot, PolicyConfig, int | None], gpu: int | None
) -> None:
    snap, cfg, host = case
    d = decide(PolicyInput(snap, NOW, host_available_bytes=host, gpu_free_bytes=gpu), cfg)
    high = Fraction(str(cfg.high))
    idle = sum(s.n_cells for s in snap.slots if s.state is SlotState.IDLE)
    prefill = sum(s.n_prefill_left for s in snap.slots if s.state is SlotState.PROMPT)
    step = snap.next_step.n_gen + snap.next_step.n_draft_max + max(snap.next_step.n_prompt_max, prefill)
    pools = [snap.n_cells] + ([snap.draft.n_cells] if snap.draft and snap.draft.n_cells > 0 else [])
    used = [snap.n_cells_used - idle, (snap.draft.n_cells_used if snap.draft else 0) - idle][: len(pools)]

    def at_high() -> bool:
        return any(u + step >= high * n for u, n in zip(used, pools, strict=True))

    parks = [a for a in d.parks if a.reason is Reason.PRESSURE]
    unresolved = any(s.reason is SkipReason.UNRESOLVED for s in d.skipped)
    if not at_high():
        assert not parks and not unresolved
        return
    assert parks or unresolved
    by_id = {s.id: s for s in snap.slots}
    for a in parks:
        assert at_high(), "parked although already below HIGH"
        used = [u - a.n_cells for u in used]
        step -= 1 + by_id[a.slot].n_draft_max
        assert a.projected_after == max((u + step) / n for u, n in zip(used, pools, strict=True))
    assert at_high() == unresolved


# --- LOW: restores up to floor(low x n) projected cells ----------------------------------------------

LOW_EDGES = [
    # n, low, floor(low x n) computed by hand
    (1000, 0.80, 800),
    (90, 0.7, 63),  # 0.7 * 90 == 62.99999999999999: a float floor would say 62
    (100, 0.57, 57),  # 0.57 * 100 == 56.99999999999999
    (50, 0.58, 29),  # 0.58 * 50 == 28.999999999999996
]


@pytest.mark.parametrize(("n", "low", "edge"), LOW_EDGES)
def test_a_restore_that_makes_exactly_floor_low_cells_goes_ahead_and_one_more_does_not(
    n: int, low: float, edge: int
) -> None:
    def waiting(after: int) -> KvSnapshot:
        resident = edge // 3
        # the resident, its next step, the parked request and its own next step: ``after`` cells once restored
        return kv(
            n, [S("generating", resident, t_arrival_ms=1), S("parked", after - resident - 2, parked_since_ms=NOW)]
        )

    d = run(waiting(edge), replace(CFG, low=low))
    assert [(a.slot, a.reason) for a in d.resumes] == [(1, Reason.BELOW_LOW)]
    assert d.projected_after == edge / n
    d = run(waiting(edge + 1), replace(CFG, low=low))
    assert d.resumes == ()
    assert [(s.slot, s.reason) for s in d.skipped] == [(1, SkipReason.ABOVE_LOW)]


def test_the_margin_counts_at_the_low_edge() -> None:
    # 400 + 1 + 389 + 1 + 9 = 800: restored; a margin one cell larger is over LOW
    snap = kv(1000, [S("generating", 400, t_arrival_ms=1), S("parked", 389, parked_since_ms=NOW)])
    assert [a.slot for a in run(snap, replace(CFG, margin_cells=9)).resumes] == [1]
    assert run(snap, replace(CFG, margin_cells=10)).resumes == ()


# --- admission: whole requests in the whole cells below HIGH --------------------------------------


@pytest.mark.parametrize("n_requests", [1, 2, 3, 6])
def test_admission_allows_exactly_the_requests_there_is_room_for(n_requests: int) -> None:
    busy = kv(1000, [S("generating", 800, t_arrival_ms=1)])  # 801 projected: 138 cells up to 939, below HIGH
    per = 138 // n_requests  # a prompt and its first step: 138, 69, 46 or 23 cells fill the room exactly
    exact = admission(PolicyInput(busy, NOW), CFG, per - 1)
    assert (exact.admit, exact.allowance, exact.room_cells) == (True, n_requests, 138)
    one_cell_more = admission(PolicyInput(busy, NOW), CFG, per)
    assert one_cell_more.allowance == n_requests - 1
    assert one_cell_more.admit == (n_requests > 1)


ROOM_EDGES = [
    # n, high, generating cells, their next step, ceil(high x n): where the float arithmetic found one cell more room,
    # up to HIGH itself (0.94 x 1050 - 948 == 39.00000000000011)
    (1050, 0.94, 947, 1, 987),
    (50, 0.94, 28, 1, 47),
    (660, 0.5, 182, 3, 330),
]


@pytest.mark.parametrize(("n", "high", "used", "step", "edge"), ROOM_EDGES)
def test_admission_room_stops_one_cell_below_high(n: int, high: float, used: int, step: int, edge: int) -> None:
    cfg = replace(CFG, high=high, low=high / 2)
    snap = kv(n, [S("generating", used, t_arrival_ms=1, n_draft_max=step - 1)])
    assert snap.next_step.n_total_max == step
    room = edge - 1 - (used + step)
    assert admission(PolicyInput(snap, NOW), cfg, 1).room_cells == room
    fits = admission(PolicyInput(snap, NOW), cfg, room - 1)  # a prompt and its first step: exactly the room
    assert (fits.admit, fits.allowance) == (True, 1)
    assert admission(PolicyInput(snap, NOW), cfg, room).allowance == 0
