"""The policy on testkit's simulated server (the one bench/policy_sim.py tabulates): short workloads, what it
guarantees. The benchmark's own workloads against the seed's order: tests/unit/test_bench.py."""

from __future__ import annotations

import random

import pytest

from controller.settings import RestoreOrder
from testkit.policy_sim import Req, random_workload, simulate

N_CTX = 4096


def test_streams_that_outgrow_the_pool_all_complete_inside_it() -> None:
    # four streams of 37 % of the pool each: together they overflow it mid-generation
    reqs = [Req(f"Story {i}:", int(N_CTX * 0.37)) for i in range(4)]
    out = simulate(N_CTX, reqs, RestoreOrder.AGING)
    assert out.completed == out.total == len(reqs)
    assert out.parks > 0, "the workload must make the policy act"
    assert out.overflows == 0 and out.peak_cells <= N_CTX, "the controller alone keeps every step inside the pool"
    assert all(r.completion is not None for r in out.requests)


@pytest.mark.parametrize("seed", range(4))
def test_random_mixes_with_priorities_complete_and_never_overflow(seed: int) -> None:
    rng = random.Random(seed)
    reqs = random_workload(rng, N_CTX)
    priorities = [rng.choice([-1, 0, 5]) for _ in reqs]
    out = simulate(N_CTX, reqs, RestoreOrder.AGING, priorities=priorities)
    assert out.completed == out.total == len(reqs), "every request completes, parked ones too"
    assert out.overflows == 0 and out.peak_cells <= N_CTX
    assert out.max_wait == max(out.waits, default=0) and len(out.waits) <= out.parks, "a resume follows a park"
