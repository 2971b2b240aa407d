"""Policy at scale: decision time per poll for 4 to 1024 slots, on simulated snapshots.

    python bench/policy_scale.py [--polls 200]

The policy is a pure function, so this needs no server: it builds /kv snapshots with N slots
(a mix of generating, prompt, idle and parked, at pressures below LOW, between LOW and HIGH,
and above HIGH) and times decide() and admission() over many polls, next to the poll interval
(50 ms) they must fit in. It also reports this process's CPU and peak memory.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
from typing import Any

from bench.common import cli, pct, save, table
from controller.policy.admission import admission
from controller.policy.plan import decide
from controller.policy.types import PolicyConfig, PolicyInput
from controller.settings import load_settings
from controller.upstream.models import KvSnapshot


def snapshot(n_slots: int, pressure: float, rng: random.Random) -> KvSnapshot:
    n_cells = 1024 * n_slots
    slots: list[dict[str, Any]] = []
    used = 0
    target = int(n_cells * pressure)
    now = 1_764_500_000_000
    for i in range(n_slots):
        state = rng.choices(["generating", "prompt", "idle", "parked"], [6, 1, 2, 1])[0]
        n = rng.randint(64, 2048)
        resident = state in ("generating", "prompt", "idle") and used + n <= target
        if state != "parked" and not resident:
            state, n_cells_slot = "idle", 0
        else:
            n_cells_slot = n if state != "parked" else 0
        used += n_cells_slot
        slots.append(
            {
                "id": i,
                "id_task": None if state == "idle" else 1000 + i,
                "state": state,
                "n_cells": n_cells_slot,
                "n_prompt": 32,
                "t_arrival_ms": None if state == "idle" else now - rng.randint(0, 60_000),
                "n_decoded": n if state in ("generating", "parked") else 0,
                "n_draft_max": 0,
                "request_id": None,
                "park": {
                    "count": 1 if state == "parked" else 0,
                    "bytes": n * 512 if state == "parked" else 0,
                    "t_parked_total_ms": 0,
                    "parked_since_ms": now - 1000 if state == "parked" else None,
                    "auto": False,
                    "test": False,
                },
            }
        )
    n_gen = sum(s["state"] == "generating" for s in slots)
    return KvSnapshot.model_validate(
        {
            "n_cells": n_cells,
            "n_cells_used": used,
            "n_cells_free": n_cells - used,
            "used_ratio": used / n_cells,
            "source": "exact",
            "draft": None,
            "bytes_per_cell": 512,
            "next_step": {"n_gen": n_gen, "n_draft_max": 0, "n_prompt_max": 0, "n_total_max": n_gen},
            "n_slots": n_slots,
            "n_slots_idle": sum(s["state"] == "idle" for s in slots),
            "n_parked": sum(s["state"] == "parked" for s in slots),
            "parked_bytes": sum(s["park"]["bytes"] for s in slots),
            "park_ram_budget_bytes": 8 << 30,
            "slots": slots,
        }
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--polls", type=int, default=200)
    args = ap.parse_args(argv)
    cfg = PolicyConfig.from_settings(load_settings().policy)
    rng = random.Random(0)
    rows = []
    cpu0 = time.process_time()
    for n_slots in (4, 16, 64, 256, 1024):
        times = []
        for p in range(args.polls):
            kv = snapshot(n_slots, (0.5, 0.88, 0.99)[p % 3], rng)
            inp = PolicyInput(
                kv=kv, now_ms=1_764_500_000_000, history={}, host_available_bytes=64 << 30, gpu_free_bytes=None
            )
            t0 = time.perf_counter()
            decide(inp, cfg)
            admission(inp, cfg, 512)
            times.append(time.perf_counter() - t0)
        rows.append(
            (
                n_slots,
                statistics.median(times) * 1e3,
                pct(times, 0.99) * 1e3,
                max(times) * 1e3,
                100 * statistics.median(times) / 0.05,
            )
        )
    cpu = time.process_time() - cpu0
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = table(["slots", "decision p50 ms", "p99 ms", "max ms", "% of a 50 ms poll (p50)"], rows)
    text = f"{out}\n\nprocess CPU for all polls: {cpu:.2f} s; peak RSS {peak_mib:.0f} MiB\n"
    print(text)
    save("policy_scale.md", text)
    return 0


if __name__ == "__main__":
    cli(main)
