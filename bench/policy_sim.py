"""Restore order without the noise: kvctl's policy replayed on a simulated server, its order against the seed's.

    python -m bench.policy_sim [--random 500] [--priority-random 100] [--poll-steps 16] [--only orders|priority]

On a real server, the longest parked wait of one run moves by several percent with the machine's
speed, and where two orders make the same decisions their waits differ by noise alone. Here the
real ``controller.policy.plan.decide`` and ``admission`` run on a step-exact model of the server: each
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
simulated ``/kv`` reports and the server's safety net heeds (lowest priority first, then newest, as patch 24). A
request whose start condition holds waits in kvctl's admission queue, ordered as the proxy's ``AdmissionQueue``
(highest priority first, FIFO within, one that waited past ``priority_max_wait`` to the front); the head goes into
``PolicyInput.queued`` at every poll (displacement) and ``admission`` is asked with its effective priority. Every
priority workload runs twice, with its priorities and with every priority 0, the same requests otherwise.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from bench.common import RESULTS, cli, save, table
from bench.pressure import Req, workloads
from controller.policy.admission import admission
from controller.policy.plan import decide
from controller.policy.pool import effective_priorities
from controller.policy.types import ActionKind, PolicyConfig, PolicyInput, QueuedRequest, Reason, TaskHistory
from controller.proxy.admission import AdmissionGate
from controller.settings import PolicySettings, RestoreOrder
from controller.upstream.models import KvSnapshot, SlotState
from testkit.snapshots import S
from testkit.snapshots import kv as build_kv

STEP_MS = 3  # one decode step of the tiny model on one core, for the policy's clock only
RESERVE = 512  # proxy.admission_reserve_cells
HIGH, LOW = 5, 0  # the priority workloads' high and (default) low priorities
PRIORITY_MARK = "Priorities (issue 20)"  # the results file's priority part starts with this
AGING_WORKLOAD = "high-stream"  # run once more with a short priority_max_wait


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
    priority: int = 0
    t_queued: int | None = None  # when its start condition held: it joined kvctl's admission queue
    done_at: int | None = None
    waits: list[int] = field(default_factory=list)  # each stretch waited: in the queue, then each park

    def park(self, step: int) -> None:
        """Its cells go to a host snapshot, as the server's park does."""
        self.state, self.parked_cells, self.cells = SlotState.PARKED, self.cells, 0
        self.parked_since, self.parks = step, self.parks + 1

    def resume(self, step: int) -> int:
        assert self.parked_since is not None
        waited = step - self.parked_since
        self.waits.append(waited)
        self.state, self.cells, self.parked_since = SlotState.GENERATING, self.parked_cells, None
        return waited

    @property
    def cells_asked(self) -> int:
        """What the proxy's queue and gate count for its prompt."""
        return max(RESERVE, self.spec.n_prompt)


@dataclass(frozen=True)
class ReqOutcome:
    priority: int
    completion: int | None
    """Decode steps from its arrival (joining the queue) to its last token; None: not completed."""
    longest_wait: int
    """Its longest stretch of waiting: in the queue, or one park."""
    parks: int


@dataclass
class Outcome:
    max_wait: int = 0
    waits: list[int] = field(default_factory=list)
    parks: int = 0
    overflows: int = 0
    steps: int = 0
    completed: int = 0
    total: int = 0
    requests: list[ReqOutcome] = field(default_factory=list)
    displacing: int = 0
    """Parks that made room for a queued request of higher priority (Reason.DISPLACE)."""


def simulate(
    n_ctx: int,
    reqs: list[Req],
    order: RestoreOrder,
    poll_steps: int = 16,
    n_slots: int = 8,
    n_batch: int = 512,
    *,
    priorities: Sequence[int] | None = None,
    priority_max_wait_steps: int | None = None,
    displacement: bool = True,
) -> Outcome:
    """``priorities``: one per request (default all 0); ``priority_max_wait_steps``: policy.priority_max_wait_s in
    decode steps (default the setting's own, 120 s)."""
    settings = PolicySettings(restore_order=order, displacement=displacement)
    if priority_max_wait_steps is not None:
        settings = settings.model_copy(update={"priority_max_wait_s": priority_max_wait_steps * STEP_MS / 1000})
    cfg = PolicyConfig.from_settings(settings)
    prios = list(priorities) if priorities is not None else [0] * len(reqs)
    rs = [_Req(i, r, priority=p) for i, (r, p) in enumerate(zip(reqs, prios, strict=True))]
    out = Outcome(total=len(rs))
    history: dict[int, TaskHistory] = {}
    gate = AdmissionGate()
    gate.update("no poll yet", 0)
    step = 0
    limit = 40 * sum(r.n_predict + r.n_prompt for r in reqs) + 10_000
    remaining = len(rs)
    pending = list(rs)  # not in the queue yet: waiting for their start condition
    queue: list[_Req] = []  # kvctl's admission queue

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
                priority=r.priority,
            )
            for r in rs
            if r.state is not SlotState.IDLE and not r.done
        ]
        return build_kv(n_ctx, live + [S("idle")] * (n_slots - len(live)), bytes_per_cell=1, n_batch=n_batch)

    def progress(j: int) -> int:
        return 1 << 62 if rs[j].done else rs[j].decoded

    def head() -> _Req | None:
        """The queue's next: the highest priority first, FIFO within; one that waited past priority_max_wait counts
        as the highest priority present (the proxy's AdmissionQueue)."""
        if not queue:
            return None
        top = max(r.priority for r in queue)

        def rank(r: _Req) -> tuple[int, int, int]:
            assert r.t_queued is not None
            aged = (step - r.t_queued) * STEP_MS > cfg.priority_max_wait_ms
            return -(top if aged else r.priority), r.t_queued, r.i

        return min(queue, key=rank)

    while remaining and step < limit:
        # arrivals: a request whose start condition holds joins kvctl's queue
        for r in [r for r in pending if r.spec.after is None or progress(r.spec.after[0]) >= r.spec.after[1]]:
            pending.remove(r)
            r.t_queued = step
            queue.append(r)
        if step % poll_steps == 0:
            kv = snapshot()
            first = head()
            queued = None
            if first is not None:
                assert first.t_queued is not None
                queued = QueuedRequest(first.priority, first.cells_asked, (step - first.t_queued) * STEP_MS)
            inp = PolicyInput(kv, step * STEP_MS, history, queued=queued)
            d = decide(inp, cfg)
            by_slot = {s.id: s.id_task for s in kv.slots}
            for a in d.actions:
                r = rs[by_slot[a.slot]]  # type: ignore[index]
                if a.kind is ActionKind.PARK:
                    r.park(step)
                    history[r.i] = history.get(r.i, TaskHistory()).parked()
                    out.parks += 1
                    out.displacing += a.reason is Reason.DISPLACE
                elif a.kind is ActionKind.RESUME:
                    out.waits.append(r.resume(step))
                else:  # END: cannot fit the pool even alone
                    r.done = True
                    remaining -= 1
            # asked for the queue's head: parked requests of its effective priority or higher come back first
            verdict = admission(inp, cfg, RESERVE, priority=effective_priorities(inp, cfg)[1])
            allowance = min(verdict.allowance if verdict.allowance is not None else n_slots, kv.n_slots_idle)
            if kv.n_slots_idle == 0:
                verdict = replace(verdict, admit=False, reason="no idle slot")
            gate.update(
                None if verdict.admit else verdict.reason, allowance, room_cells=verdict.room_cells, empty=verdict.empty
            )
        # the queue's head goes through the proxy's own gate, holding back everyone behind it
        while (nxt := head()) is not None and gate.take(nxt.cells_asked):
            assert nxt.t_queued is not None
            queue.remove(nxt)
            nxt.waits.append(step - nxt.t_queued)
            nxt.started, nxt.state, nxt.t_arrival, nxt.prompt_left = True, SlotState.PROMPT, step, nxt.spec.n_prompt
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
            # the decode would not fit: the server's safety net parks the lowest priority, then the newest
            out.overflows += 1
            victim = min((r for r in rs if r.state is SlotState.GENERATING), key=lambda r: (r.priority, -r.t_arrival))
            victim.park(step)
        for r in rs:
            if r.state is SlotState.GENERATING and r.decoded >= r.spec.n_predict:
                r.done, r.state, r.cells, r.done_at = True, SlotState.IDLE, 0, step
                out.completed += 1
                remaining -= 1
        step += 1
    out.steps = step
    out.max_wait = max(out.waits, default=0)
    out.requests = [
        ReqOutcome(
            r.priority,
            r.done_at - r.t_queued + 1 if r.done_at is not None and r.t_queued is not None else None,
            max(r.waits, default=0),
            r.parks,
        )
        for r in rs
    ]
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
