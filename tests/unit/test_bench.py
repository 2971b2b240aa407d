"""The benchmarks' own logic: the policy simulator, the workloads and the GPU script's plan (no timings)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bench.pressure import schedule, workloads
from bench.streams import Timed
from controller.settings import RestoreOrder
from testkit.policy_sim import simulate

ROOT = Path(__file__).resolve().parents[2]


def test_parked_waits_pair_each_park_with_the_resume_after_it() -> None:
    r = Timed(events=[(1.0, "resumed"), (2.0, "parked"), (5.5, "resumed"), (7.0, "parked"), (8.0, "resumed")])
    assert r.parked_waits == [3.5, 1.0]
    assert Timed(events=[(2.0, "parked")]).parked_waits == []


def test_schedule_digest_tells_decisions_apart_not_timings() -> None:
    def run(t0: float, step: float, first: int) -> list[Timed]:
        a, b = Timed(), Timed()
        (a if first == 0 else b).events += [(t0, "parked"), (t0 + 3 * step, "resumed")]
        (b if first == 0 else a).events += [(t0 + 0.001, "parked"), (t0 + 5 * step, "resumed")]
        return [a, b]

    assert schedule(run(10.0, 1.0, 0)) == schedule(run(50.0, 1.4, 0)), "same decisions, another machine speed"
    assert schedule(run(10.0, 1.0, 0)) != schedule(run(10.0, 1.0, 1)), "the other request resumed first"
    assert schedule([Timed(), Timed()]) == "-"


@pytest.mark.parametrize("name", ["equal-long", "mixed", "late-prompts", "full-ctx"])
def test_every_pressure_workload_outgrows_its_pool(name: str) -> None:
    for n_ctx in (8192, 16384):
        reqs = workloads(n_ctx)[name]
        assert sum(r.n_prompt + r.n_predict for r in reqs) > n_ctx


@pytest.mark.parametrize("n_ctx", [8192, 16384])
@pytest.mark.parametrize("name", ["equal-long", "mixed", "late-prompts", "full-ctx"])
def test_simulated_default_order_completes_everything_and_never_waits_longer_than_the_seed_order(
    name: str, n_ctx: int
) -> None:
    reqs = workloads(n_ctx)[name]
    ours = simulate(n_ctx, reqs, RestoreOrder.AGING)
    seed = simulate(n_ctx, reqs, RestoreOrder.SEED)
    assert ours.completed == ours.total == len(reqs)
    assert ours.overflows == 0, "the controller alone keeps every step inside the pool"
    assert ours.parks > 0, "the workload must make the policy act"
    assert ours.max_wait <= seed.max_wait


def test_gpu_script_plans_every_stage_with_arguments_the_benchmarks_accept() -> None:
    out = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu.sh"), "--dry-run"], check=True, capture_output=True, text=True
    ).stdout
    stages = [line for line in out.splitlines() if line.startswith("[dry-run]")]
    assert [s.split(":")[0] for s in stages] == [
        "[dry-run] build, patched",
        "[dry-run] build, unpatched",
        "[dry-run] model",
        "[dry-run] park speed",
        "[dry-run] park layouts",
        "[dry-run] pressure",
        "[dry-run] cost",
        "[dry-run] exact mode",
    ]
    assert "--cuda" in stages[0] and "--no-patches" in stages[1]
    for line in stages[3:]:
        argv = shlex.split(line.split(": ", 1)[1].replace("-ngl 99", "'-ngl 99'"))
        module = argv[argv.index("-m") + 1]
        # --help last: argparse checks every argument before it, then exits 0
        r = subprocess.run([sys.executable, "-m", module, *argv[argv.index("-m") + 2 :], "--help"], cwd=ROOT)
        assert r.returncode == 0, line
