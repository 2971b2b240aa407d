"""kvctl's policy on a simulated server, step by step: for the policy's tests and bench/policy_sim.py's tables.

The real ``controller.policy.plan.decide`` and ``admission`` run on a step-exact model of the server: each decode
step adds one cell per generating request, a prompt is prefilled in ``n_batch`` chunks, a finished request frees its
cells, parks and resumes take effect at the poll that decides them, and the controller polls every ``poll_steps``
steps. Waits are counted in decode steps, so two orders (or two settings) are compared on the same clock. A step
whose cells would not fit the pool is an overflow: the server's safety net parks the lowest priority, then the
newest (as patch 25); kvctl's goal is none.

A request whose start condition holds waits in kvctl's admission queue, ordered as the proxy's ``AdmissionQueue``
(highest priority first, FIFO within, one that waited past ``priority_max_wait`` to the front); the head goes into
``PolicyInput.queued`` at every poll (displacement), and through the proxy's own ``AdmissionGate``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

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


@dataclass(frozen=True)
class Req:
    """One request of a workload: its prompt (text, or token ids), the tokens it generates, when it arrives."""

    prompt: str | list[int]
    n_predict: int
    after: tuple[int, int] | None = None
    """Start once request ``after[0]`` has streamed ``after[1]`` tokens (or ended): arrivals tied to
    progress, not to the clock, so a workload means the same on a fast and a slow machine."""

    @property
    def n_prompt(self) -> int:
        """Prompt tokens (a text prompt here is a few words: BOS and ~4 tokens)."""
        return len(self.prompt) if isinstance(self.prompt, list) else 5


@dataclass
class SimReq:
    """One request's state on the simulated server and in kvctl's queue; waits in decode steps."""

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
    """What a run did: waits and overflows in decode steps, parks, completions, and each request's own."""

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
    peak_cells: int = 0
    """The most cells running requests held after a decode step (over ``n_ctx``: an overflow)."""


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
    rs = [SimReq(i, r, priority=p) for i, (r, p) in enumerate(zip(reqs, prios, strict=True))]
    out = Outcome(total=len(rs))
    history: dict[int, TaskHistory] = {}
    gate = AdmissionGate()
    gate.update("no poll yet", 0)
    step = 0
    limit = 40 * sum(r.n_predict + r.n_prompt for r in reqs) + 10_000
    remaining = len(rs)
    pending = list(rs)  # not in the queue yet: waiting for their start condition
    queue: list[SimReq] = []  # kvctl's admission queue

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

    def head() -> SimReq | None:
        """The queue's next: the highest priority first, FIFO within; one that waited past priority_max_wait counts
        as the highest priority present (the proxy's AdmissionQueue)."""
        if not queue:
            return None
        top = max(r.priority for r in queue)

        def rank(r: SimReq) -> tuple[int, int, int]:
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
        out.peak_cells = max(out.peak_cells, used())
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
