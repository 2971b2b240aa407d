"""Priorities in the policy (issue 20): higher = more important. Victims go lowest first, restores highest first, a
wait past policy.priority_max_wait_s counts as the highest priority present, the starvation restore parks nothing
above the request it restores, and only a strictly higher priority displaces a running request."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from controller.policy.admission import admission
from controller.policy.plan import decide
from controller.policy.pool import effective_priorities
from controller.policy.types import ActionKind, PolicyConfig, PolicyInput, QueuedRequest, Reason, SkipReason
from controller.proxy.admission import AdmissionGate
from controller.upstream.models import ParkMode
from testkit.snapshots import S, kv

CFG = PolicyConfig(
    high=0.94, low=0.80, budget_bytes=10**12, host_reserve_bytes=0, margin_cells=0, max_wait_ms=30_000,
    priority_max_wait_ms=120_000,
)  # fmt: skip
NOW = 10_000_000
BOTH = (ParkMode.SWAP, ParkMode.RECOMPUTE)


def gen(cells: int, priority: int, arrival: int) -> S:
    return S("generating", cells, t_arrival_ms=arrival, priority=priority)


def test_the_lowest_priority_is_parked_first_even_when_it_is_older() -> None:
    snap = kv(1000, [gen(300, 5, 1), gen(300, 0, 2), gen(380, -3, 3)], park_modes=BOTH)
    # the newest is the high one (arrival 3 would go first by age): priority comes first
    snap2 = kv(1000, [gen(300, -3, 1), gen(380, 0, 2), gen(300, 5, 3)], park_modes=BOTH)
    for s, low in ((snap, 2), (snap2, 0)):
        d = decide(PolicyInput(kv=s, now_ms=NOW), CFG)
        assert [a.slot for a in d.parks] == [low]


def test_the_protected_request_is_the_largest_of_the_highest_priority() -> None:
    # the largest overall is low priority: it is parked, the largest high one is kept
    snap = kv(1000, [gen(600, -1, 1), gen(200, 3, 2), gen(170, 3, 3)], park_modes=BOTH)
    d = decide(PolicyInput(kv=snap, now_ms=NOW), CFG)
    assert [a.slot for a in d.parks] == [0]


PRIORITIES = st.integers(-2, 2)


@given(
    cells=st.lists(st.integers(50, 400), min_size=2, max_size=8),
    priorities=st.lists(PRIORITIES, min_size=8, max_size=8),
)
def test_a_higher_priority_request_is_never_parked_while_a_lower_parkable_one_is_resident(
    cells: list[int], priorities: list[int]
) -> None:
    slots = [gen(c, priorities[i], i + 1) for i, c in enumerate(cells)]
    n = max(64, sum(cells) * 100 // 96)  # about 96 %: over HIGH
    snap = kv(n, slots, park_modes=BOTH)
    d = decide(PolicyInput(kv=snap, now_ms=NOW), CFG)
    parked = {a.slot for a in d.parks}
    for a in d.parks:
        kept_lower = [
            i for i, s in enumerate(slots) if i not in parked and (s.priority or 0) < (slots[a.slot].priority or 0)
        ]
        assert not kept_lower, (a, kept_lower)


def test_restores_go_highest_priority_first() -> None:
    parked = [
        S("parked", 200, t_arrival_ms=1, parked_since_ms=NOW - 5000, priority=0),
        S("parked", 200, t_arrival_ms=2, parked_since_ms=NOW - 1000, priority=4),
    ]
    snap = kv(1000, [gen(500, 0, 3), *parked], park_modes=BOTH)  # room for one: 500 + 200 + steps <= 800
    d = decide(PolicyInput(kv=snap, now_ms=NOW), CFG)
    assert [a.slot for a in d.resumes] == [2], "the later but higher one"


def test_a_wait_past_priority_max_wait_counts_as_the_highest_priority_present() -> None:
    low = S("parked", 200, t_arrival_ms=1, parked_since_ms=NOW - 121_000, priority=-5)
    high = S("parked", 200, t_arrival_ms=2, parked_since_ms=NOW - 1000, priority=4)
    snap = kv(1000, [gen(500, 0, 3), low, high], park_modes=BOTH)
    inp = PolicyInput(kv=snap, now_ms=NOW)
    eff, _ = effective_priorities(inp, CFG)
    assert eff[1] == 4, "aged to the top"
    d = decide(inp, CFG)
    assert [a.slot for a in d.resumes] == [1], "equal effective priorities: the seed's order, the longer wait"


@given(waited_s=st.integers(0, 400), low=PRIORITIES, highs=st.lists(PRIORITIES, min_size=1, max_size=5))
def test_every_parked_request_is_restored_within_a_bound_of_the_settings(
    waited_s: int, low: int, highs: list[int]
) -> None:
    # a pool full of running requests of any priorities; one parked request: once it has waited
    # priority_max_wait + max_wait it is the head of the order and is restored below HIGH, parking others
    residents = [gen(150, p, 10 + i) for i, p in enumerate(highs)]
    parked = S("parked", 150, t_arrival_ms=1, parked_since_ms=NOW - waited_s * 1000, priority=low)
    n = (150 * len(highs) + 150) * 100 // 97
    snap = kv(n, [*residents, parked], park_modes=BOTH)
    d = decide(PolicyInput(kv=snap, now_ms=NOW), CFG)
    if waited_s * 1000 >= CFG.priority_max_wait_ms + CFG.max_wait_ms and len(highs) > 1:
        assert [a.slot for a in d.resumes] == [len(highs)], d


def test_the_starvation_restore_parks_nothing_of_higher_priority_than_the_one_it_restores() -> None:
    starving = S("parked", 300, t_arrival_ms=1, parked_since_ms=NOW - 40_000, priority=0)
    snap = kv(1000, [gen(350, 5, 2), gen(300, 5, 3), starving], park_modes=BOTH)
    d = decide(PolicyInput(kv=snap, now_ms=NOW), CFG)
    assert not d.parks and not d.resumes
    assert [(s.slot, s.reason) for s in d.skipped if s.kind is ActionKind.RESUME] == [(2, SkipReason.NO_ROOM)]
    # the same with a running request of its own priority: that one makes room
    snap = kv(1000, [gen(350, 5, 2), gen(300, 0, 3), starving], park_modes=BOTH)
    d = decide(PolicyInput(kv=snap, now_ms=NOW), CFG)
    assert [a.slot for a in d.parks] == [1] and [a.slot for a in d.resumes] == [2]


def full(p_running: int) -> PolicyInput:
    return PolicyInput(
        kv=kv(1000, [gen(450, p_running, 1), gen(450, p_running, 2), S("idle")], park_modes=BOTH), now_ms=NOW
    )


def with_head(inp: PolicyInput, priority: int, waited_ms: int = 0) -> PolicyInput:
    return PolicyInput(kv=inp.kv, now_ms=inp.now_ms, queued=QueuedRequest(priority, 200, waited_ms))


def test_a_queued_request_of_strictly_higher_priority_displaces_a_running_one() -> None:
    d = decide(with_head(full(0), 3), CFG)
    assert [(a.slot, a.reason) for a in d.parks] == [(1, Reason.DISPLACE)], "the newer of the two"


@given(p=PRIORITIES, q=PRIORITIES)
def test_equal_priorities_never_displace_each_other(p: int, q: int) -> None:
    d = decide(with_head(full(p), q), CFG)
    displaced = [a for a in d.parks if a.reason is Reason.DISPLACE]
    assert bool(displaced) == (q > p)


def test_displacement_can_be_turned_off_and_waits_for_parked_requests_of_its_priority() -> None:
    off = PolicyConfig(
        high=0.94, low=0.80, budget_bytes=10**12, host_reserve_bytes=0, margin_cells=0, displacement=False
    )
    assert not decide(with_head(full(0), 3), off).parks
    parked = S("parked", 100, t_arrival_ms=0, parked_since_ms=NOW - 1000, priority=3)
    snap = kv(1000, [gen(450, 0, 1), gen(450, 0, 2), parked, S("idle")], park_modes=BOTH)
    d = decide(PolicyInput(kv=snap, now_ms=NOW, queued=QueuedRequest(3, 200, 0)), CFG)
    assert not [a for a in d.parks if a.reason is Reason.DISPLACE], "the parked one of its priority comes first"


def test_admission_lets_a_higher_priority_request_past_parked_lower_ones() -> None:
    parked = S("parked", 100, t_arrival_ms=0, parked_since_ms=NOW - 1000, priority=0)
    snap = kv(1000, [gen(200, 0, 1), parked, S("idle")], park_modes=BOTH)
    inp = PolicyInput(kv=snap, now_ms=NOW)
    assert not admission(inp, CFG, 100).admit
    assert not admission(inp, CFG, 100, priority=0).admit, "equal: the parked one first"
    assert admission(inp, CFG, 100, priority=1).admit
    # a queued request of higher priority holds the parked lower one back (a slot is free for it)
    d = decide(with_head(inp, 1), CFG)
    assert not d.resumes and any(s.reason is SkipReason.PRIORITY and s.kind is ActionKind.RESUME for s in d.skipped)


def test_the_admission_past_parked_requests_is_for_higher_priorities_only() -> None:
    # the gate's allowance, opened for a queued head of priority 1, must not let a request of priority 0 behind it
    # past the parked request of priority 0
    parked = S("parked", 100, t_arrival_ms=0, parked_since_ms=NOW - 1000, priority=0)
    snap = kv(1000, [gen(200, 0, 1), parked, S("idle"), S("idle")], park_modes=BOTH)
    verdict = admission(PolicyInput(kv=snap, now_ms=NOW), CFG, 100, priority=1)
    assert verdict.admit and verdict.min_priority == 1
    gate = AdmissionGate()
    gate.update(None, verdict.allowance, room_cells=verdict.room_cells, min_priority=verdict.min_priority)
    assert not gate.take(10, priority=0), "equal to the parked one: it comes back first"
    assert gate.take(10, priority=1)
    assert admission(PolicyInput(kv=kv(1000, [gen(200, 0, 1), S("idle")], park_modes=BOTH), now_ms=NOW), CFG, 100)
    assert (
        admission(PolicyInput(kv=kv(1000, [gen(200, 0, 1)], park_modes=BOTH), now_ms=NOW), CFG, 100).min_priority
        is None
    )
