"""Cost when parking never fires: paired A/B throughput with confidence intervals.

    python bench/overhead.py [--pairs 10] [--n-predict 200] [--model bench]

(a) the patched server against the unpatched one, both direct (the seed's comparison);
(b) the whole stack (patched server behind kvctl's proxy, the controller polling) against the
    unpatched server direct;
plus the proxy's added latency per streamed chunk and to the first token (same patched server,
direct and through the proxy), and the controller's CPU share while it polls.
Runs alternate A and B in pairs, so drift on a shared machine hits both; the table reports the
mean ratio B/A with its 95 % confidence interval.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time

import aiohttp
import psutil

from bench.common import build, mean_ci, model, save, server, table
from bench.kvctl_stack import stack_pid, start_stack
from bench.streams import Timed, timed_stream
from tests.integration.llama import NO_BYTE_TOKENS


async def run(url: str, n_streams: int, n_predict: int) -> tuple[float, list[Timed]]:
    """Aggregate generated tokens per second of n_streams concurrent requests."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as s:
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
    assert all(r.ok for r in res), [r.error for r in res]
    return sum(r.n_tokens for r in res) / wall, list(res)


def paired(a_url: str, b_url: str, pairs: int, n_streams: int, n_predict: int) -> tuple[float, float, float, float]:
    asyncio.run(run(a_url, n_streams, 16))  # warm both
    asyncio.run(run(b_url, n_streams, 16))
    ratios, a_tps, b_tps = [], [], []
    for i in range(pairs):
        first, second = (a_url, b_url) if i % 2 == 0 else (b_url, a_url)
        t1, _ = asyncio.run(run(first, n_streams, n_predict))
        t2, _ = asyncio.run(run(second, n_streams, n_predict))
        a, b = (t1, t2) if first == a_url else (t2, t1)
        a_tps.append(a)
        b_tps.append(b)
        ratios.append(b / a)
    m, ci = mean_ci(ratios)
    return statistics.fmean(a_tps), statistics.fmean(b_tps), m, ci


def chunk_gaps(res: list[Timed]) -> float:
    return statistics.fmean((r.t_end - (r.t_first or r.t_end)) / max(1, r.n_tokens - 1) for r in res)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--n-predict", type=int, default=200)
    ap.add_argument("--model", default="bench", choices=["bench", "tiny"])
    args = ap.parse_args(argv)
    patched, unpatched = build(), build(patched=False)
    gguf = model(args.model, patched)
    base = ("-c", "8192", "-np", "4", "-kvu", "--slots", "--metrics")
    rows = []
    with server(unpatched, gguf, *base) as up, server(patched, gguf, *base) as pt:
        for n in (1, 4):
            a, b, m, ci = paired(up.url, pt.url, args.pairs, n, args.n_predict)
            rows.append(("(a) patched vs unpatched, direct", n, a, b, m, ci))
        with start_stack(pt.url) as proxy:
            kv = psutil.Process(stack_pid(proxy))
            cpu0, t0 = kv.cpu_times(), time.monotonic()
            for n in (1, 4):
                a, b, m, ci = paired(up.url, proxy, args.pairs, n, args.n_predict)
                rows.append(("(b) kvctl stack vs unpatched, direct", n, a, b, m, ci))
            cpu1, t1 = kv.cpu_times(), time.monotonic()
            cpu_share = ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (t1 - t0)
            # the proxy's own cost: the same patched server, direct and through the proxy
            gaps_d, gaps_p, ttft_d, ttft_p = [], [], [], []
            for _ in range(args.pairs):
                _, rd = asyncio.run(run(pt.url, 1, args.n_predict))
                _, rp = asyncio.run(run(proxy, 1, args.n_predict))
                gaps_d.append(chunk_gaps(rd))
                gaps_p.append(chunk_gaps(rp))
                ttft_d.append(rd[0].ttft)
                ttft_p.append(rp[0].ttft)
            # idle polling: the controller alone, nothing generating
            with contextlib.suppress(Exception):
                c0, w0 = kv.cpu_times(), time.monotonic()
                time.sleep(5)
                c1, w1 = kv.cpu_times(), time.monotonic()
                idle_share = ((c1.user + c1.system) - (c0.user + c0.system)) / (w1 - w0)
    out = table(["comparison", "streams", "A tok/s", "B tok/s", "B/A mean", "95 % CI ±"], rows)
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
    head = f"model: {args.model}, {args.pairs} alternating pairs, {args.n_predict} tokens per request"
    text = f"{head}\n\n{out}\n\n{extra}\n\n{cpu}\n"
    print(text)
    save("overhead.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
