"""Cost when parking never fires: paired A/B throughput with confidence intervals.

    python -m bench.overhead [--pairs 150] [--n-predict 256] [--model bench] [--no-pin] [--shared-core]

(a) the patched server against the unpatched one, both direct (the seed's comparison);
(b) the whole stack (patched server behind kvctl's proxy, the controller polling) against the
    unpatched server direct;
plus the proxy's added latency per streamed chunk and to the first token (same patched server,
direct and through the proxy), and the controller's CPU share while it polls.
Runs alternate A and B in pairs (ABBA), so drift on a shared machine hits both; the table reports
the mean ratio B/A of client throughput and of the server's CPU seconds per generated token, each
with its 95 % confidence interval. The servers are pinned to their own core(s) and the client and
kvctl to the others (``--no-pin`` to share), as a sidecar with its own CPU request would run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import statistics
import time
from dataclasses import dataclass

import aiohttp
import psutil

from bench.common import build, cli, mean_ci, model, placement, save, server, table
from bench.streams import Timed, timed_stream
from testkit.llama import NO_BYTE_TOKENS, ServerProcess
from testkit.stack import stack_pid, start_stack


def cpu_seconds(pid: int | None) -> float:
    """CPU time of every thread of a process, from the scheduler's nanosecond counters (schedstat)."""
    if pid is None:
        return math.nan
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return sum(psutil.Process(pid).cpu_times()[:2])  # no procfs: 10 ms ticks
    for tid in tids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
    return total / 1e9


@dataclass
class Run:
    tok_s: float  # aggregate generated tokens per second, at the client
    cpu_per_tok: float  # server process CPU seconds (all threads) per generated token
    res: list[Timed]


async def run(url: str, n_streams: int, n_predict: int, server_pid: int | None = None) -> Run:
    """n_streams concurrent requests; throughput at the client and the server's CPU per token."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as s:
        c0 = cpu_seconds(server_pid)
        t0 = time.monotonic()
        res = await asyncio.gather(
            *[
                timed_stream(
                    s,
                    url,
                    {
                        "prompt": f"Overhead {i}",
                        "n_predict": n_predict,
                        "ignore_eos": True,
                        "cache_prompt": False,
                        "logit_bias": NO_BYTE_TOKENS,
                    },
                )
                for i in range(n_streams)
            ]
        )
        wall = time.monotonic() - t0
        cpu = cpu_seconds(server_pid) - c0
    assert all(r.ok for r in res), [r.error for r in res]
    n = sum(r.n_tokens for r in res)
    return Run(n / wall, cpu / n, list(res))


@dataclass
class Paired:
    a_tps: float
    b_tps: float
    ratio: tuple[float, float]  # B/A throughput: mean, 95 % CI half-width
    cpu_ratio: tuple[float, float]  # B/A server CPU per token: mean, 95 % CI half-width


def paired(a: tuple[str, int], b: tuple[str, int], pairs: int, n_streams: int, n_predict: int) -> Paired:
    """Alternate A and B (ABBA...), so slow drift on a shared machine hits both sides alike."""
    for url, pid in (a, b):  # warm both
        asyncio.run(run(url, n_streams, 16, pid))
    runs_a, runs_b, ratios, cpu_ratios = [], [], [], []
    for i in range(pairs):
        order = (a, b) if i % 2 == 0 else (b, a)
        got = {side: asyncio.run(run(side[0], n_streams, n_predict, side[1])) for side in order}
        ra, rb = got[a], got[b]
        runs_a.append(ra)
        runs_b.append(rb)
        ratios.append(rb.tok_s / ra.tok_s)
        cpu_ratios.append(rb.cpu_per_tok / ra.cpu_per_tok)
    return Paired(
        statistics.fmean(r.tok_s for r in runs_a),
        statistics.fmean(r.tok_s for r in runs_b),
        mean_ci(ratios),
        mean_ci(cpu_ratios),
    )


def chunk_gaps(res: list[Timed]) -> float:
    return statistics.fmean((r.t_end - (r.t_first or r.t_end)) / max(1, r.n_tokens - 1) for r in res)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=150, help="alternating A/B pairs per row (a pair's spread is ~2 %%)")
    ap.add_argument(
        "--shared-core", action="store_true", help="add a row with kvctl and the client on the server's core"
    )
    ap.add_argument("--n-predict", type=int, default=256)
    ap.add_argument("--model", default="bench", choices=["bench", "tiny", "gpu", "smollm2", "gemma3"])
    ap.add_argument("--server-args", default="", help="extra llama-server flags for both servers, e.g. '-ngl 99'")
    ap.add_argument("--no-pin", action="store_true", help="let servers, client and kvctl share every CPU")
    ap.add_argument("--out", default="overhead", help="name of the table in bench/results/")
    args = ap.parse_args(argv)
    patched, unpatched = build(), build(patched=False)
    gguf = model(args.model, patched)
    srv_cpus, other_cpus = placement(not args.no_pin)
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)
    base = ("-c", "8192", "-np", "4", "-kvu", "--slots", "--metrics", *args.server_args.split())
    rows = []

    def pid(s: ServerProcess) -> int:
        assert s.proc is not None
        return s.proc.pid

    def add(name: str, n: int, p: Paired) -> None:
        loss = 100 * (1 - p.ratio[0])
        rows.append(
            (
                name,
                n,
                p.a_tps,
                p.b_tps,
                p.ratio[0],
                p.ratio[1],
                loss,
                loss + 100 * p.ratio[1],
                p.cpu_ratio[0],
                p.cpu_ratio[1],
            )
        )
        print(rows[-1], flush=True)

    with (
        server(unpatched, gguf, *base, cpus=srv_cpus) as up,
        server(patched, gguf, *base, cpus=srv_cpus) as pt,
    ):
        a, b = (up.url, pid(up)), (pt.url, pid(pt))
        for n in (1, 4):
            add("(a) patched vs unpatched, direct", n, paired(a, b, args.pairs, n, args.n_predict))
        with start_stack(pt.url, cpus=other_cpus) as proxy:
            kv = psutil.Process(stack_pid(proxy))
            cpu0, t0 = kv.cpu_times(), time.monotonic()
            for n in (1, 4):
                add(
                    "(b) kvctl stack vs unpatched, direct",
                    n,
                    paired(a, (proxy, pid(pt)), args.pairs, n, args.n_predict),
                )
            cpu1, t1 = kv.cpu_times(), time.monotonic()
            cpu_share = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (t1 - t0)
            # the proxy's own cost: the same patched server, direct and through the proxy
            gaps_d, gaps_p, ttft_d, ttft_p = [], [], [], []
            for _ in range(min(args.pairs, 30)):
                rd = asyncio.run(run(pt.url, 1, args.n_predict)).res
                rp = asyncio.run(run(proxy, 1, args.n_predict)).res
                gaps_d.append(chunk_gaps(rd))
                gaps_p.append(chunk_gaps(rp))
                ttft_d.append(rd[0].ttft)
                ttft_p.append(rp[0].ttft)
            # idle polling: the controller alone, nothing generating
            c0, w0 = kv.cpu_times(), time.monotonic()
            time.sleep(5)
            c1, w1 = kv.cpu_times(), time.monotonic()
            idle_share = ((c1.user + c1.system) - (c0.user + c0.system)) / (w1 - w0)
        if srv_cpus and args.shared_core:
            # what pinning buys: the same stack, with kvctl and the client on the server's core
            os.sched_setaffinity(0, srv_cpus)
            with start_stack(pt.url, cpus=srv_cpus) as proxy:
                add(
                    "(b) the same, kvctl and client on the server's core",
                    4,
                    paired(a, (proxy, pid(pt)), args.pairs, 4, args.n_predict),
                )
            assert other_cpus
            os.sched_setaffinity(0, other_cpus)
    out = table(
        [
            "comparison",
            "streams",
            "A tok/s",
            "B tok/s",
            "B/A tok/s",
            "95 % CI ±",
            "loss %",
            "loss, 95 % upper bound %",
            "B/A server CPU per token",
            "95 % CI ±",
        ],
        rows,
    )
    extra = table(
        ["measure", "direct", "via proxy", "added"],
        [
            (
                "ms per streamed chunk",
                statistics.fmean(gaps_d) * 1e3,
                statistics.fmean(gaps_p) * 1e3,
                (statistics.fmean(gaps_p) - statistics.fmean(gaps_d)) * 1e3,
            ),
            (
                "time to first token ms",
                statistics.median(ttft_d) * 1e3,
                statistics.median(ttft_p) * 1e3,
                (statistics.median(ttft_p) - statistics.median(ttft_d)) * 1e3,
            ),
        ],
    )
    cpu = table(
        ["kvctl process", "CPU share of one core"],
        [("while streaming", cpu_share), ("idle, polling every 50 ms", idle_share)],
    )
    where = (
        f"servers on CPUs {sorted(srv_cpus)}, client and kvctl on {sorted(other_cpus or [])}"
        if srv_cpus
        else "unpinned"
    )
    head = f"model: {args.model}, {args.pairs} alternating pairs, {args.n_predict} tokens per request, {where}"
    text = f"{head}\n\n{out}\n\n{extra}\n\n{cpu}\n"
    print(text)
    save(f"{args.out}.md", text)
    return 0


if __name__ == "__main__":
    cli(main)
