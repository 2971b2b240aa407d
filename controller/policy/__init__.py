"""The watermark policy (types, pool arithmetic, plan, admission; import from those modules, this package's own
import loads nothing): a snapshot in, ordered park and restore actions out, each with its reason.

Pure functions: no I/O and no clock (the time comes in with the snapshot), so the same input
always gives the same decision, whatever order the slots are listed in.

Projected cells of a pool = cells held by requests in progress + the cells the next decode step may
add + the unprefilled rest of every prompt in progress, for the target pool and for the draft pool
when there is one; projected occupancy (the pressure) is projected cells / pool cells, the larger of
the two. Cells held by *idle* slots are left out: they are only a prompt cache, which the server
clears before a decode step fails (upstream's idle-slot clearing, the safety net's second rung) and
before a resume lacks room.

Decisions compare cells, never ratios: each watermark is turned once per pool size into whole cells,
exactly, from its decimal value as the settings write it (0.94 of 1000 cells is 940, with no float
rounding at the edge), so "at or above HIGH" is projected cells >= ceil(high x n), "below HIGH" is at
most ceil(high x n) - 1 and "at or below LOW" is at most floor(low x n), in every pool. The ratios
(``Pressure``, ``projected_after``) are for reporting alone.

What the projection reserves beyond the cells held, the *step*, is
``n_gen + n_draft_max + max(n_prompt_max, sum of n_prefill_left over slots in state prompt)``: the
server's ``next_step.n_prompt_max`` bounds one step only (a batch), while a prompt goes on taking cells
until it is evaluated, and a restore or an admission decided now must leave it that room. It is the max,
not the sum, since the next step's prompt tokens are part of that rest. So a request resumed by
recompute, evaluating its tokens again (state ``prompt``, ``park.recomputing``), counts at its full
length until it generates again, and a parked request counts at its full length (``park.n_cells``)
when a restore is weighed, whichever mode it was parked by.

* At or above HIGH, park victims until the projection is below HIGH: newest first (latest
  ``t_arrival_ms``, ties by ``id_task``), passing over requests parked before while another
  candidate exists; never the largest resident request.
* Each victim's park mode (``ModeReason`` says why): by swap (a copy of its cells in host RAM) when
  its snapshot (the server's ``park.snapshot_bytes``, else n_cells x bytes_per_cell) fits what is left
  of the snapshot budget (the smaller of ``snapshot_budget_mib`` and the server's ``--park-ram``, less
  what is parked) and of the host-RAM headroom (the smaller of psutil's and the server's available
  memory, less ``host_ram_reserve_mib``), unless the server's measured rates say evaluating its tokens
  again takes less time than copying the snapshot out and back; by recompute otherwise (its cells freed,
  evaluated again on resume: no host RAM), and always when the server offers only recompute or
  ``snapshot_budget_mib`` is 0. Only swaps use up budget and headroom. With a server that offers
  recompute, no victim is passed over for memory; an older server that lists no modes parks by swap
  only, and a victim whose snapshot does not fit is passed over (``budget``, ``host_ram``).
* Restore while the projection after restoring (the request's cells, its next-step cells and a
  margin) stays at or below LOW. Default order (``aging``): the seed's order (most-parked first, then
  longest-waiting, passing over what does not fit), except that requests parked for half of
  ``max_wait`` or longer go ahead of the others. A request parked again soon after its resume
  comes back first, as in the seed; one that has waited long is not kept behind it. ``seed`` is
  the seed's order alone; ``fifo`` is head-of-line by park time (nobody overtakes the head).
* Priorities (higher = more important): victims go lowest effective priority first, then as above, and the
  protected request is the largest resident one of the highest priority present; restores go highest first,
  then in the restore order. A request parked (or queued in kvctl) longer than ``priority_max_wait`` counts as
  the highest priority present. The head of kvctl's admission queue holds back restores of lower priorities
  while a slot is free for it and, when the pool has no room for it, displaces running requests of strictly lower
  priority (``displacement``).
* No request waits forever: when nothing is resident, the head is restored if it fits the pool
  alone; when the head has waited longer than ``max_wait``, it is restored below HIGH, LOW
  notwithstanding, parking newer requests to make room if it must (never the largest: someone must
  be able to finish; never one of higher priority than the head). A request that cannot fit the pool even alone
  is ended.
"""
