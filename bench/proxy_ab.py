"""The proxy of two revisions side by side: did a change to kvctl cost first-token latency or throughput?

    python -m bench.proxy_ab [--before REV] [--rounds 20] [--model bench]

One patched server; three ways to it, taken in turn each round (the order rotates, so drift on a shared
machine hits all three): direct, kvctl as it was at ``--before`` (a ``git worktree`` of that revision, default
``HEAD~1``), and kvctl as the checkout has it now. Each round measures the time to first token of one short
stream (5 times) and the throughput of 4 concurrent streams. The table reports each side's median and its
spread (the interquartile range), and the mean of the paired per-round ratios now/before with its 95 %
confidence interval: a change costs nothing measurable when the interval covers 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.common import ROOT, build, cli, mean_ci, model, placement, save, server, table
from bench.overhead import run
from testkit.stack import start_stack

TTFT_TRIES = 5


def kvctl_of(tree: Path) -> list[str]:
    """The kvctl command of a source tree, whatever its layout (controller/cli.py or controller/cli/)."""
    program = (
        f"import runpy, sys; sys.path.insert(0, {str(tree)!r}); runpy.run_module('controller.cli', run_name='__main__')"
    )
    return [sys.executable, "-c", program]


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="kvctl-ab-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), rev], check=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=False)


def quartiles(values: list[float]) -> tuple[float, float]:
    """Median and interquartile range."""
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q2, q3 - q1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default="HEAD~1", help="the revision to compare the checkout with")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--model", default="bench", choices=["bench", "tiny", "gpu", "smollm2", "gemma3"])
    ap.add_argument("--out", default="proxy_ab", help="name of the table in bench/results/")
    args = ap.parse_args(argv)
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.before], check=True, capture_output=True, text=True
    ).stdout.strip()
    patched = build()
    gguf = model(args.model, patched)
    srv_cpus, other_cpus = placement(True)
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)
    base = ("-c", "8192", "-np", "4", "-kvu", "--slots", "--metrics")
    sides = ("direct", f"kvctl {rev}", "kvctl now")
    ttft: dict[str, list[float]] = {s: [] for s in sides}
    tps: dict[str, list[float]] = {s: [] for s in sides}
    with (
        server(patched, gguf, *base, cpus=srv_cpus) as srv,
        worktree(args.before) as old,
        start_stack(srv.url, cpus=other_cpus, kvctl=kvctl_of(old)) as before,
        start_stack(srv.url, cpus=other_cpus, kvctl=kvctl_of(ROOT)) as now,
    ):
        urls = dict(zip(sides, (srv.url, before, now), strict=True))
        for url in urls.values():  # warm each way in
            asyncio.run(run(url, 4, 16))
        for i in range(args.rounds):
            order = sides[i % 3 :] + sides[: i % 3]
            for side in order:
                for _ in range(TTFT_TRIES):
                    first = asyncio.run(run(urls[side], 1, 8)).res[0]
                    assert first.ok and first.t_first is not None, first.error
                    ttft[side].append(first.t_first - first.t_start)
                tps[side].append(asyncio.run(run(urls[side], 4, args.n_predict)).tok_s)
            print(f"round {i + 1}/{args.rounds}", {s: round(tps[s][-1], 1) for s in sides}, flush=True)
    rows = []
    for side in sides:
        t_med, t_iqr = quartiles(ttft[side])
        r_med, r_iqr = quartiles(tps[side])
        rows.append((side, t_med * 1e3, t_iqr * 1e3, r_med, r_iqr))
    out = table(["way in", "TTFT median ms", "TTFT IQR ms", "4-stream tok/s median", "tok/s IQR"], rows)
    old_side, new_side = sides[1], sides[2]
    per_round_ttft = [
        statistics.median(ttft[new_side][k : k + TTFT_TRIES]) / statistics.median(ttft[old_side][k : k + TTFT_TRIES])
        for k in range(0, len(ttft[new_side]), TTFT_TRIES)
    ]
    ratios = [
        ("TTFT now / before", *mean_ci(per_round_ttft)),
        ("tok/s now / before", *mean_ci([n / b for n, b in zip(tps[new_side], tps[old_side], strict=True)])),
        ("tok/s now / direct", *mean_ci([n / d for n, d in zip(tps[new_side], tps["direct"], strict=True)])),
    ]
    paired = table(["paired per round", "mean", "95 % CI ±"], ratios)
    head = (
        f"model: {args.model}, {args.rounds} rounds, {TTFT_TRIES} first-token probes (8 tokens) and one 4-stream run "
        f"({args.n_predict} tokens each) per side per round; before = {rev}"
    )
    text = f"{head}\n\n{out}\n\n{paired}\n"
    print(text)
    save(f"{args.out}.md", text)
    return 0


if __name__ == "__main__":
    cli(main)
