"""Restore order without the noise: kvctl's policy replayed on a simulated server, its order against the seed's.

    python -m bench.policy_sim [--random 500] [--priority-random 100] [--poll-steps 16] [--only orders|priority]

On a real server, the longest parked wait of one run moves by several percent with the machine's
speed, and where two orders make the same decisions their waits differ by noise alone. Here the
real ``controller.policy.plan.decide`` and ``admission`` run on a step-exact model of the server
(``testkit.policy_sim``, which the policy's tests run too): each
decode step adds one cell per generating request, a prompt is prefilled in ``n_batch`` chunks,
a finished request frees its cells, parks and resumes take effect at the poll that decides them,
and the controller polls every ``--poll-steps`` steps (50 ms at ~3 ms a step). Waits are counted
in decode steps, so both orders are compared on the same clock.

Workloads: the pressure benchmark's own (bench/pressure.py, arrivals tied to progress as there),
and ``--random`` seeded random mixes of 4 to 16 requests. The table gives the longest parked wait
of kvctl's default order (``aging``), the seed's and ``fifo``, the parks, the steps to finish
everything, and any step that would not have fit (the server's safety net would have caught it;
kvctl's goal is none).

Priorities (issue 20, ``--only priority`` alone): each request has a priority (higher = more important), which the
simulated ``/kv`` reports and the server's safety net heeds (lowest priority first, then newest, as patch 25). A
request whose start condition holds waits in kvctl's admission queue, ordered as the proxy's ``AdmissionQueue``
(highest priority first, FIFO within, one that waited past ``priority_max_wait`` to the front); the head goes into
``PolicyInput.queued`` at every poll (displacement) and ``admission`` is asked with its effective priority. Every
priority workload runs twice, with its priorities and with every priority 0, the same requests otherwise.
"""

from __future__ import annotations

import argparse
import random
import statistics
from dataclasses import dataclass, field

from bench.common import RESULTS, cli, save, table
from bench.pressure import workloads
from controller.settings import PolicySettings, RestoreOrder
from testkit.policy_sim import STEP_MS, Outcome, Req, random_workload, simulate

HIGH, LOW = 5, 0  # the priority workloads' high and (default) low priorities
PRIORITY_MARK = "Priorities (issue 20)"  # the results file's priority part starts with this
AGING_WORKLOAD = "high-stream"  # run once more with a short priority_max_wait


@dataclass
class _OrderTally:
    """One order's random workloads against the seed's order."""

    shorter: int = 0
    same: int = 0
    longer: int = 0
    worst: float = 0.0
    ratios: list[float] = field(default_factory=list)
    overflows: int = 0


def orders(args: argparse.Namespace) -> str:
    """The restore orders' tables: the pressure workloads, then the random mixes."""
    ours, seed, fifo = RestoreOrder.AGING, RestoreOrder.SEED, RestoreOrder.FIFO
    rows = []
    for n_ctx in (8192, 16384):
        for name, reqs in workloads(n_ctx).items():
            k, s, f = (simulate(n_ctx, reqs, o, args.poll_steps) for o in (ours, seed, fifo))
            rows.append(
                (
                    n_ctx,
                    name,
                    f"{k.completed}/{k.total}",
                    k.max_wait,
                    s.max_wait,
                    f.max_wait,
                    k.parks,
                    s.parks,
                    k.steps,
                    s.steps,
                    k.overflows,
                    s.overflows,
                )
            )
            print(rows[-1], flush=True)
    out = table(
        [
            "n_ctx",
            "workload",
            "completed (kvctl)",
            "max wait kvctl",
            "max wait seed",
            "max wait fifo",
            "parks kvctl",
            "parks seed",
            "steps kvctl",
            "steps seed",
            "overflows kvctl",
            "overflows seed",
        ],
        rows,
    )
    rng = random.Random(args.seed)
    tally = {(n, o): _OrderTally() for n in (8192, 16384) for o in (ours, fifo)}
    overflows_seed = {8192: 0, 16384: 0}
    for n_ctx in (8192, 16384):
        for _ in range(args.random):
            reqs = random_workload(rng, n_ctx)
            s = simulate(n_ctx, reqs, seed, args.poll_steps)
            overflows_seed[n_ctx] += s.overflows
            for o in (ours, fifo):
                r = simulate(n_ctx, reqs, o, args.poll_steps)
                t = tally[(n_ctx, o)]
                t.shorter += r.max_wait < s.max_wait
                t.same += r.max_wait == s.max_wait
                t.longer += r.max_wait > s.max_wait
                if r.max_wait > s.max_wait:
                    t.worst = max(t.worst, r.max_wait / max(1, s.max_wait))
                if s.max_wait:
                    t.ratios.append(r.max_wait / s.max_wait)
                t.overflows += r.overflows
    summary = [
        (
            n_ctx,
            "kvctl (aging)" if o is ours else "fifo",
            args.random,
            t.shorter,
            t.same,
            t.longer,
            t.worst or "-",
            statistics.median(t.ratios) if t.ratios else "-",
            t.overflows,
            overflows_seed[n_ctx],
        )
        for (n_ctx, o), t in tally.items()
    ]
    for row in summary:
        print(row, flush=True)
    out2 = table(
        [
            "n_ctx",
            "order",
            "random workloads",
            "shorter than seed",
            "same",
            "longer than seed",
            "worst order/seed",
            "median order/seed",
            "overflows",
            "overflows seed",
        ],
        summary,
    )
    head = (
        f"Simulated server, controller polling every {args.poll_steps} decode steps; waits in decode steps. "
        "kvctl's default order is `aging`; `fifo` is shown for comparison."
    )
    return f"{head}\n\n{out}\n\n{out2}\n"


def priority_workloads(n_ctx: int) -> dict[str, tuple[list[Req], list[int]]]:
    """Requests and their priorities (HIGH: the important ones)."""
    long = int(n_ctx * 0.37)  # 4 of these overflow the pool mid-generation
    return {
        # issue 20's real-server test, simulated: four low long streams overflow the pool, two high ones arrive
        # while they run, when the pool is half full
        "high-mid": (
            [Req(f"Low {i}:", long) for i in range(4)]
            + [Req(f"High {i}:", int(n_ctx * 0.15), after=(0, int(n_ctx * (0.1 + 0.03 * i)))) for i in range(2)],
            [LOW] * 4 + [HIGH] * 2,
        ),
        # six low streams (0 and -1) fill the pool; two high ones with long prompts arrive when it is nearly full:
        # they only fit if running ones make room
        "many-low": (
            [Req(f"Low {i}:", int(n_ctx * 0.2)) for i in range(6)]
            + [Req([1] * (n_ctx // 8), int(n_ctx * 0.08), after=(0, int(n_ctx * (0.14 + 0.01 * i)))) for i in range(2)],
            [LOW, -1] * 3 + [HIGH] * 2,
        ),
        # two low long streams, then a stream of high ones, each arriving when the one before has streamed 5 % of
        # the pool: the pool stays full of high ones, and without aging the low ones wait until the stream ends
        "high-stream": (
            [Req(f"Low {i}:", int(n_ctx * 0.4)) for i in range(2)]
            + [
                Req(f"High {i}:", int(n_ctx * 0.25), after=(i + 1, int(n_ctx * 0.05)) if i else (0, int(n_ctx * 0.1)))
                for i in range(16)
            ],
            [LOW] * 2 + [HIGH] * 16,
        ),
    }


def random_priorities(rng: random.Random, reqs: list[Req]) -> list[int]:
    """20 % of the requests HIGH, the rest 0 or -1."""
    return [HIGH if rng.random() < 0.2 else rng.choice([LOW, -1]) for _ in reqs]


@dataclass
class _PriorityTally:
    """One row of the priority table: workloads run with their priorities, and with every priority 0."""

    high: list[int] = field(default_factory=list)
    high_flat: list[int] = field(default_factory=list)
    low_wait: int = 0
    low_wait_flat: int = 0
    parks: int = 0
    parks_flat: int = 0
    parks_high: int = 0
    displacing: int = 0
    overflows: int = 0
    overflows_flat: int = 0
    completed: int = 0
    completed_flat: int = 0
    total: int = 0
    sooner: int = 0
    same: int = 0
    later: int = 0

    def add(self, with_p: Outcome, flat: Outcome, prios: list[int]) -> None:
        hi = [i for i, p in enumerate(prios) if p >= HIGH]
        mine = [c for i in hi if (c := with_p.requests[i].completion) is not None]
        theirs = [c for i in hi if (c := flat.requests[i].completion) is not None]
        self.high += mine
        self.high_flat += theirs
        lows = [i for i, p in enumerate(prios) if p < HIGH]
        self.low_wait = max([self.low_wait, *(with_p.requests[i].longest_wait for i in lows)])
        self.low_wait_flat = max([self.low_wait_flat, *(flat.requests[i].longest_wait for i in lows)])
        self.parks += with_p.parks
        self.parks_flat += flat.parks
        self.parks_high += sum(with_p.requests[i].parks for i in hi)
        self.displacing += with_p.displacing
        self.overflows += with_p.overflows
        self.overflows_flat += flat.overflows
        self.completed += with_p.completed
        self.completed_flat += flat.completed
        self.total += with_p.total
        if mine and theirs:
            a, b = statistics.fmean(mine), statistics.fmean(theirs)
            if a < b:
                self.sooner += 1
            elif a == b:
                self.same += 1
            else:
                self.later += 1

    def row(self, n_ctx: int, name: str, max_wait_steps: int) -> tuple[object, ...]:
        done = f"{self.completed}/{self.total}"
        if self.completed_flat != self.completed:
            done += f" (all 0: {self.completed_flat})"
        return (
            n_ctx,
            name,
            max_wait_steps,
            done,
            statistics.fmean(self.high) if self.high else "-",
            statistics.fmean(self.high_flat) if self.high_flat else "-",
            max(self.high, default="-"),
            max(self.high_flat, default="-"),
            f"{self.sooner}/{self.same}/{self.later}",
            self.low_wait,
            self.low_wait_flat,
            self.parks,
            self.parks_high,
            self.displacing,
            self.parks_flat,
            self.overflows,
            self.overflows_flat,
        )


def priority_table(args: argparse.Namespace) -> str:
    """The priority workloads, each with its priorities and with every priority 0."""
    default_steps = int(PolicySettings().priority_max_wait_s * 1000) // STEP_MS

    def run(n_ctx: int, mixes: list[tuple[list[Req], list[int]]], wait_steps: int | None) -> _PriorityTally:
        tally = _PriorityTally()
        for reqs, prios in mixes:
            with_p, flat = (
                simulate(
                    n_ctx, reqs, RestoreOrder.AGING, args.poll_steps, priorities=p, priority_max_wait_steps=wait_steps
                )
                for p in (prios, [0] * len(reqs))
            )
            tally.add(with_p, flat, prios)
        return tally

    rows = []
    for n_ctx in (8192, 16384):
        named = priority_workloads(n_ctx)
        for name, mix in named.items():
            rows.append(run(n_ctx, [mix], None).row(n_ctx, name, default_steps))
            print(rows[-1], flush=True)
        aging = named[AGING_WORKLOAD]
        rows.append(run(n_ctx, [aging], args.aging_steps).row(n_ctx, AGING_WORKLOAD, args.aging_steps))
        print(rows[-1], flush=True)
        rng = random.Random(f"priority {args.seed} {n_ctx}")
        mixes = []
        for _ in range(args.priority_random):
            reqs = random_workload(rng, n_ctx)
            mixes.append((reqs, random_priorities(rng, reqs)))
        name = f"random x{args.priority_random}, 20 % high"
        rows.append(run(n_ctx, mixes, None).row(n_ctx, name, default_steps))
        print(rows[-1], flush=True)
    out = table(
        [
            "n_ctx",
            "workload",
            "priority_max_wait (steps)",
            "completed",
            "high: mean steps",
            "high: mean steps, all 0",
            "high: max steps",
            "high: max steps, all 0",
            "high sooner/same/later",
            "low: longest wait",
            "low: longest wait, all 0",
            "parks",
            "of high",
            "displacing",
            "parks, all 0",
            "overflows",
            "overflows, all 0",
        ],
        rows,
    )
    head = (
        f"{PRIORITY_MARK}: each workload run with its priorities (high = {HIGH}, low = {LOW} or -1) and again with "
        "every priority 0, the same requests otherwise; kvctl's default order, displacement on. `high: ... steps`: "
        "decode steps from a high-priority request's arrival (joining kvctl's queue) to its last token, over the "
        "workload's high requests (pooled over the random mixes); `sooner/same/later`: workloads whose high requests "
        "finish sooner on average with priorities than without, as soon, later. `low: longest wait`: the longest "
        "stretch a low-priority request waited, in the queue or in one park (aging bounds it: a request that waited "
        f"`priority_max_wait` counts as the highest priority present; the default 120 s is {default_steps} steps "
        f"at {STEP_MS} ms a step, longer than these workloads, so one row of each band sets it to "
        f"{args.aging_steps} steps to show aging acting). `parks`: the policy's, with priorities; `of high`: parks "
        "of high-priority requests (the policy's and the safety net's); `displacing`: parks that made room for a "
        "queued request of higher priority. `overflows`: steps the server's safety net had to catch (kvctl's goal "
        "is none)."
    )
    return f"{head}\n\n{out}\n"


def _splice(part: str, text: str) -> str:
    """The results file with one part (``orders`` or ``priority``) replaced, the other kept as it is."""
    path = RESULTS / "policy_sim.md"
    old = path.read_text() if path.exists() else ""
    cut = old.find(PRIORITY_MARK)
    orders_text, priority_text = (old, "") if cut < 0 else (old[:cut], old[cut:])
    if part == "orders":
        orders_text = text
    else:
        priority_text = text
    return "\n\n".join(t.strip() for t in (orders_text, priority_text) if t.strip()) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random", type=int, default=500, help="random workloads per band (restore orders)")
    ap.add_argument("--priority-random", type=int, default=100, help="random workloads per band (priorities)")
    ap.add_argument(
        "--aging-steps", type=int, default=1000, help="priority_max_wait of the aging rows, in decode steps"
    )
    ap.add_argument("--poll-steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--only",
        choices=["orders", "priority"],
        help="run one part; the results file keeps the other part as it was",
    )
    args = ap.parse_args(argv)
    if args.only is None:
        text = f"{orders(args)}\n{priority_table(args)}"
    else:
        text = orders(args) if args.only == "orders" else priority_table(args)
        text = _splice(args.only, text)
    print()
    print(text)
    save("policy_sim.md", text)
    return 0


if __name__ == "__main__":
    cli(main)
