"""kvctl as an endpoint of an inference gateway (issue 19): how fast its public GET /metrics answers, and what routing
by its gauges does against round robin.

    python -m bench.endpoint [--streams 64] [--model tiny] [--requests 16] [--tokens 700]

1. Scrape latency. One server (64 slots) behind `kvctl run` (its own process, vLLM names on): GET /metrics every
   50 ms, as llm-d's endpoint picker scrapes, first with the stack idle, then while 64 streams run. Also the render
   alone, in this process (the collector with a sample), which is what a scrape costs kvctl beyond HTTP.
2. Routing. Two replicas (server + kvctl each, each server pinned to its own core) and a workload of twice one pool,
   long and short answers alternating (1.5x and 0.5x --tokens): requests arrive every --gap-s and are sent by round
   robin, or by a tiny router that reads the gauges (lowest KV usage, then the shortest queue, the order of llm-d's
   kv-cache-utilization and queue scorers). Parks (both kvctls together) and completion times. Two servers share
   this machine's 2 cores with the clients and kvctl: the absolute times are this machine's; the comparison runs
   both arms on the same servers, one after the other.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import time
import urllib.request
from collections.abc import Awaitable, Callable

import aiohttp

from bench.common import build, cli, model, pct, placement, save, server, table
from controller.proxy.endpoint_metrics import EndpointMetrics, EndpointSample
from testkit.llama import NO_BYTE_TOKENS
from testkit.stack import stack_admin, start_stack

SCRAPE_EVERY_S = 0.05  # llm-d's --refresh-metrics-interval


def body(prompt: str, n: int) -> dict[str, object]:
    return {"prompt": prompt, "n_predict": n, "ignore_eos": True, "logit_bias": NO_BYTE_TOKENS, "stream": True}


async def stream(http: aiohttp.ClientSession, url: str, payload: dict[str, object]) -> float:
    t0 = time.perf_counter()
    async with http.post(url + "/completion", json=payload) as resp:
        assert resp.status == 200, (resp.status, await resp.text())
        async for _ in resp.content.iter_any():
            pass
    return time.perf_counter() - t0


async def scrapes(http: aiohttp.ClientSession, url: str, until: Callable[[], bool]) -> list[float]:
    out = []
    while not until():
        t0 = time.perf_counter()
        async with http.get(url + "/metrics") as resp:
            assert resp.status == 200
            await resp.read()
        out.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(SCRAPE_EVERY_S)
    return out


def render_us(n: int = 20000) -> list[float]:
    sample = EndpointSample(up=True, poll_age_s=0.01, queued=12, running=64, usage=0.87, n_cells=65536)
    metrics = EndpointMetrics(lambda: sample, vllm_names=True, poll_interval_s=0.05)
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        metrics.render()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


async def scrape_latency(kind: str, n_streams: int, tokens: int) -> str:
    binary = build()
    gguf = model(kind, binary)
    server_cpus, other_cpus = placement(True)
    env = {"KVCTL_PROXY__METRICS_COMPAT": "vllm"}
    with (
        server(binary, gguf, "-c", str(n_streams * (tokens + 64)), "-np", str(n_streams), "-kvu", "--slots",
               cpus=server_cpus) as srv,
        start_stack(srv.url, env=env, cpus=other_cpus) as url,
    ):  # fmt: skip
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            t_idle = time.monotonic() + 5
            idle = await scrapes(http, url, lambda: time.monotonic() > t_idle)
            load = [asyncio.create_task(stream(http, url, body(f"Stream {i}:", tokens))) for i in range(n_streams)]
            busy = await scrapes(http, url, lambda: all(t.done() for t in load))
            await asyncio.gather(*load)
    rows = [
        ["idle stack", len(idle), pct(idle, 0.5), pct(idle, 0.99), max(idle)],
        [f"{n_streams} streams running", len(busy), pct(busy, 0.5), pct(busy, 0.99), max(busy)],
    ]
    render = render_us()
    return (
        "Scrape latency of the proxy's public GET /metrics (ms, HTTP included, every 50 ms):\n\n"
        + table(["while", "scrapes", "p50 ms", "p99 ms", "max ms"], rows)
        + f"\n\nRender alone (in process, both name sets): p50 {pct(render, 0.5):.0f} µs, "
        f"p99 {pct(render, 0.99):.0f} µs.\n"
    )


def parks(url: str) -> int:
    with urllib.request.urlopen(stack_admin(url) + "/status", timeout=5) as r:
        return int(json.load(r)["loop"]["parks"])


async def workload(
    http: aiohttp.ClientSession, pick: Callable[[], Awaitable[str]], n: int, tokens: int, gap_s: float
) -> tuple[list[float], dict[str, int]]:
    tasks = []
    sent: dict[str, int] = {}
    for i in range(n):
        url = await pick()
        sent[url] = sent.get(url, 0) + 1
        size = tokens * 3 // 2 if i % 2 == 0 else tokens // 2  # long and short answers alternate
        tasks.append(asyncio.create_task(stream(http, url, body(f"Request {i}:", size))))
        await asyncio.sleep(gap_s)
    return list(await asyncio.gather(*tasks)), sent


async def routing(kind: str, n: int, tokens: int, gap_s: float) -> str:
    binary = build()
    gguf = model(kind, binary)
    cpus = sorted(os.sched_getaffinity(0))
    cores = [{cpus[0]}, {cpus[-1]}]
    demand = n * (tokens + 32)
    cells = str(-(-demand // 2 // 256) * 256)  # the workload is twice one pool's size
    args = ("-c", cells, "-np", "8", "-kvu", "--slots", "--no-auto-park")
    env = {"KVCTL_PROXY__METRICS_COMPAT": "vllm"}
    rows = []
    with contextlib.ExitStack() as stack:
        urls = []
        for core in cores:
            srv = stack.enter_context(server(binary, gguf, *args, cpus=core))
            urls.append(stack.enter_context(start_stack(srv.url, env=env)))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            rr = itertools.cycle(urls)

            async def round_robin() -> str:
                return next(rr)

            async def by_gauges() -> str:
                return await pick(http, urls)

            for name, pick in (("round robin", round_robin), ("kvctl gauges", by_gauges)):
                before = sum(parks(u) for u in urls)
                times, sent = await workload(http, pick, n, tokens, gap_s)
                after = sum(parks(u) for u in urls)
                split = "/".join(str(sent.get(u, 0)) for u in urls)
                rows.append([name, split, after - before, pct(times, 0.5), pct(times, 0.95), max(times)])
    return (
        f"Two replicas ({cells} cells, 8 slots each), {n} requests of {tokens} tokens arriving every {gap_s} s:\n\n"
        + table(["routing", "sent A/B", "parks", "p50 s", "p95 s", "max s"], rows)
        + "\n"
    )


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.endpoint", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=200)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--gap-s", type=float, default=0.05)
    parser.add_argument("--only", choices=["scrape", "routing"])
    args = parser.parse_args()
    out = ["# kvctl as an inference gateway's endpoint\n", f"`python -m bench.endpoint` ({args.model} model)\n"]
    if args.only in (None, "scrape"):
        out.append(asyncio.run(scrape_latency(args.model, args.streams, args.stream_tokens)))
    if args.only in (None, "routing"):
        out.append(asyncio.run(routing(args.model, args.requests, args.tokens, args.gap_s)))
    text = "\n".join(out)
    print(text)
    print(f"saved {save('endpoint.md', text)}")
    return 0


if __name__ == "__main__":
    cli(main)
