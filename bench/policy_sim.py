"""Restore order without the noise: kvctl's policy replayed on a simulated server, its order against the seed's.

    python -m bench.policy_sim [--random 500] [--poll-steps 16]

On a real server, the longest parked wait of one run moves by several percent with the machine's
speed, and where two orders make the same decisions their waits differ by noise alone. Here the
real ``controller.policy.decide`` and ``admission`` run on a step-exact model of the server: each
decode step adds one cell per generating request, a prompt is prefilled in ``n_batch`` chunks,
a finished request frees its cells, parks and resumes take effect at the poll that decides them,
and the controller polls every ``--poll-steps`` steps (50 ms at ~3 ms a step). Waits are counted
in decode steps, so both orders are compared on the same clock.

Workloads: the pressure benchmark's own (bench/pressure.py, arrivals tied to progress as there),
and ``--random`` seeded random mixes of 4 to 16 requests. The table gives the longest parked wait
of kvctl's default order (``aging``), the seed's and ``fifo``, the parks, the steps to finish
everything, and any step that would not have fit (the server's safety net would have caught it;
kvctl's goal is none).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass, field, replace

from bench.common import save, table
from bench.pressure import Req, workloads
from controller.policy import ActionKind, PolicyConfig, PolicyInput, TaskHistory, admission, decide
from controller.proxy.admission import AdmissionGate
from controller.settings import PolicySettings, RestoreOrder
from controller.upstream.models import KvSnapshot, SlotState
from tests.unit.snapshots import S
from tests.unit.snapshots import kv as build_kv

STEP_MS = 3  # one decode step of the tiny model on one core, for the policy's clock only
RESERVE = 512  # proxy.admission_reserve_cells


@dataclass
class _Req:
    i: int
    spec: Req
    state: SlotState = SlotState.IDLE  # IDLE here: not started yet
    cells: int = 0
    prompt_left: int = 0
    decoded: int = 0
    t_arrival: int = 0
    parks: int = 0
    parked_since: int | None = None
    parked_cells: int = 0
    done: bool = False
    started: bool = False

    def park(self, step: int) -> None:
        """Its cells go to a host snapshot, as the server's park does."""
        self.state, self.parked_cells, self.cells = SlotState.PARKED, self.cells, 0
        self.parked_since, self.parks = step, self.parks + 1


@dataclass
class Outcome:
    max_wait: int = 0
    waits: list[int] = field(default_factory=list)
    parks: int = 0
    overflows: int = 0
    steps: int = 0
    completed: int = 0
    total: int = 0


def simulate(
    n_ctx: int, reqs: list[Req], order: RestoreOrder, poll_steps: int = 16, n_slots: int = 8, n_batch: int = 512
) -> Outcome:
    cfg = PolicyConfig.from_settings(PolicySettings(restore_order=order))
    rs = [_Req(i, r) for i, r in enumerate(reqs)]
    out = Outcome(total=len(rs))
    history: dict[int, TaskHistory] = {}
    gate = AdmissionGate()
    gate.update("no poll yet", 0)
    step = 0
    limit = 40 * sum(r.n_predict + r.n_prompt for r in reqs) + 10_000

    def used() -> int:
        return sum(r.cells for r in rs if r.state in (SlotState.PROMPT, SlotState.GENERATING))

    def snapshot() -> KvSnapshot:
        """What the server's /kv would report now, built by the policy tests' own snapshot builder."""
        live = [
            S(
                r.state.value,
                r.parked_cells if r.state is SlotState.PARKED else r.cells,
                id_task=r.i,
                t_arrival_ms=r.t_arrival * STEP_MS,
                park_count=r.parks,
                parked_since_ms=r.parked_since * STEP_MS if r.parked_since is not None else None,
                n_prompt_left=r.prompt_left,
            )
            for r in rs
            if r.state is not SlotState.IDLE and not r.done
        ]
        return build_kv(n_ctx, live + [S("idle")] * (n_slots - len(live)), bytes_per_cell=1, n_batch=n_batch)

    def progress(j: int) -> int:
        return 1 << 62 if rs[j].done else rs[j].decoded

    while not all(r.done for r in rs) and step < limit:
        if step % poll_steps == 0:
            kv = snapshot()
            d = decide(PolicyInput(kv, step * STEP_MS, history), cfg)
            by_slot = {s.id: s.id_task for s in kv.slots}
            for a in d.actions:
                r = rs[by_slot[a.slot]]  # type: ignore[index]
                if a.kind is ActionKind.PARK:
                    r.park(step)
                    history[r.i] = history.get(r.i, TaskHistory()).parked()
                    out.parks += 1
                elif a.kind is ActionKind.RESUME:
                    assert r.parked_since is not None
                    out.waits.append(step - r.parked_since)
                    r.state, r.cells, r.parked_since = SlotState.GENERATING, r.parked_cells, None
                else:  # END: cannot fit the pool even alone
                    r.done = True
            verdict = admission(PolicyInput(kv, step * STEP_MS, history), cfg, RESERVE)
            allowance = min(verdict.allowance if verdict.allowance is not None else n_slots, kv.n_slots_idle)
            if kv.n_slots_idle == 0:
                verdict = replace(verdict, admit=False, reason="no idle slot")
            gate.update(
                None if verdict.admit else verdict.reason, allowance, room_cells=verdict.room_cells, empty=verdict.empty
            )
        # arrivals, in order (first come, first served), through the proxy's own gate
        for r in rs:
            if r.started or (r.spec.after is not None and progress(r.spec.after[0]) < r.spec.after[1]):
                continue
            if not gate.take(max(RESERVE, r.spec.n_prompt)):
                break
            r.started, r.state, r.t_arrival, r.prompt_left = True, SlotState.PROMPT, step, r.spec.n_prompt
        # one decode step: generating requests add a cell each, prompts take what is left of the batch
        gen = [r for r in rs if r.state is SlotState.GENERATING]
        budget = n_batch - len(gen)
        for r in rs:
            if r.state is SlotState.PROMPT and budget > 0:
                take = min(r.prompt_left, budget)
                r.prompt_left -= take
                r.cells += take
                budget -= take
                if r.prompt_left == 0:
                    r.state, r.decoded = SlotState.GENERATING, 1  # the first token comes with the prompt's last batch
        for r in gen:
            r.cells += 1
            r.decoded += 1
        if used() > n_ctx:
            # the decode would not fit: the server's safety net parks the newest generating request
            out.overflows += 1
            victim = max((r for r in rs if r.state is SlotState.GENERATING), key=lambda r: r.t_arrival)
            victim.park(step)
        for r in rs:
            if r.state is SlotState.GENERATING and r.decoded >= r.spec.n_predict:
                r.done, r.state, r.cells = True, SlotState.IDLE, 0
                out.completed += 1
        step += 1
    out.steps = step
    out.max_wait = max(out.waits, default=0)
    return out


def random_workload(rng: random.Random, n_ctx: int) -> list[Req]:
    n = rng.randint(4, 16)
    reqs: list[Req] = []
    for i in range(n):
        n_prompt = rng.choice([5, rng.randint(16, n_ctx // 4)])
        n_predict = rng.randint(64, n_ctx // 2)
        after = None if i < 2 or rng.random() < 0.3 else (rng.randrange(i), rng.randint(0, n_ctx // 4))
        reqs.append(Req([1] * n_prompt if n_prompt > 5 else f"R{i}", n_predict, after=after))
    return reqs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--random", type=int, default=500, help="random workloads per band")
    ap.add_argument("--poll-steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
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
    tally = {(n, o): [0, 0, 0, 0.0, [], 0] for n in (8192, 16384) for o in (ours, fifo)}
    overflows_seed = {8192: 0, 16384: 0}
    for n_ctx in (8192, 16384):
        for _ in range(args.random):
            reqs = random_workload(rng, n_ctx)
            s = simulate(n_ctx, reqs, seed, args.poll_steps)
            overflows_seed[n_ctx] += s.overflows
            for o in (ours, fifo):
                r = simulate(n_ctx, reqs, o, args.poll_steps)
                t = tally[(n_ctx, o)]
                t[0 if r.max_wait < s.max_wait else 1 if r.max_wait == s.max_wait else 2] += 1
                if r.max_wait > s.max_wait:
                    t[3] = max(t[3], r.max_wait / max(1, s.max_wait))
                if s.max_wait:
                    t[4].append(r.max_wait / s.max_wait)
                t[5] += r.overflows
    summary = [
        (
            n_ctx,
            "kvctl (aging)" if o is ours else "fifo",
            args.random,
            t[0],
            t[1],
            t[2],
            t[3] or "-",
            statistics.median(t[4]) if t[4] else "-",
            t[5],
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
    text = f"{head}\n\n{out}\n\n{out2}\n"
    print()
    print(text)
    save("policy_sim.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
