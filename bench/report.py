"""Assemble bench/RESULTS.md from the tables the benchmark scripts wrote into bench/results/.

    python -m bench.report

Each section names the exact command that produced it; the header names the machine.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys

from bench.common import RESULTS, ROOT

SECTIONS = [
    (
        "pressure.md",
        "Pressure: every request completes when the pool overflows",
        "python -m bench.pressure",
        "Bands of context size x workload x mode, one run. `upstream` is the unpatched pinned server, `safety-net` "
        "the patched server alone, `kvctl` the patched server with its safety net off behind `kvctl run` (proxy "
        "and controller), `kvctl-seed` the same with the seed's restore order. Parked waits are measured by the "
        "client between the `: parked` and `: resumed` comments; slowdown is a request's time over the same "
        "request run solo.",
    ),
    (
        "overhead.md",
        "Cost when parking never fires",
        "python -m bench.overhead",
        "Paired A/B runs alternating A and B, 95 % confidence interval of the mean throughput ratio B/A.",
    ),
    (
        "park_cost.md",
        "Park and resume cost against snapshot size",
        "python -m bench.park_cost",
        "The server's own park_ms/resume_ms for a generating request, next to a numpy copy of the same bytes.",
    ),
    (
        "exactness.md",
        "Exactness under forced parks",
        "python -m bench.exactness",
        "`--park-test-interval 50`: each stream is parked and resumed every 50 tokens, compared with the same "
        "streams on a server that never parks.",
    ),
    (
        "policy_scale.md",
        "Policy at scale",
        "python -m bench.policy_scale",
        "Decision time of the pure policy on simulated /kv snapshots of 4 to 1024 slots.",
    ),
    (
        "soak.md",
        "Soak",
        "python -m bench.soak --minutes 10 --streams 16 --via-proxy",
        "16 concurrent streams through kvctl's proxy with forced parks every 50 tokens.",
    ),
]


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return (
        f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, no GPU, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}, kvctl commit {commit}, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d}"
    )


def main() -> int:
    parts = [
        "# kvctl benchmark results",
        "",
        f"Machine: {machine()}.",
        "",
        "Shared 2-core machines are noisy: read ratios and paired comparisons, not absolute times. The "
        "models are random-weight GGUFs the scripts generate (`tiny`: 64-dim, 2 layers; `bench`: 512-dim, "
        "2 layers, ~10 ms/token on one core; `qwen35`: the hybrid model with an MTP layer).",
        "",
    ]
    for name, title, cmd, what in SECTIONS:
        path = RESULTS / name
        parts += [f"## {title}", "", f"Command: `{cmd}`", "", what, ""]
        parts += [path.read_text().strip() if path.exists() else "_not run yet_", ""]
        png = path.with_suffix(".png")
        if png.exists():
            parts += [f"![{title}](results/{png.name})", ""]
    (ROOT / "bench" / "RESULTS.md").write_text("\n".join(parts))
    print(ROOT / "bench" / "RESULTS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
