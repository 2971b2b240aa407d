"""What the proxy's authentication costs: per-request latency direct and through kvctl in each auth mode.

    python -m bench.proxy_auth [--requests 300] [--model tiny]

One patched server with --api-key; four ways in, measured in interleaved rounds (so drift hits all alike):
direct (the server checks its own key), kvctl with the server's key checked by the server (a cached
GET /v1/models per credential), kvctl with its own keys (constant-time digests, the server's key put
in place), and kvctl against a second, keyless server with no auth at all. Rows: a cheap route
(GET /v1/models), a relayed POST (/tokenize), and the time to the first streamed token of a short chat.
The proxy runs in this process (no control loop), pinned away from the server's core.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable

import aiohttp
from prometheus_client import CollectorRegistry

from bench.common import build, cli, model, pct, placement, save, server, table
from controller.keys import ApiKey
from controller.proxy.app import make_proxy_app
from controller.proxy.config import ProxyConfig
from controller.proxy.site import run_site
from testkit.llama import free_port

SERVER_KEY = "sk-bench-server"
KVCTL_KEY = "sk-bench-client"
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": True, "temperature": 0}


async def proxy(upstream: str, **config: object) -> tuple[str, Callable[[], Awaitable[None]]]:
    port = free_port()
    app = make_proxy_app(ProxyConfig(upstream=upstream, **config), None, CollectorRegistry())  # type: ignore[arg-type]
    return f"http://127.0.0.1:{port}", await run_site(app, "127.0.0.1", port)


async def timed(http: aiohttp.ClientSession, method: str, url: str, key: str | None, body: object) -> float:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    async with http.request(method, url, json=body, headers=headers) as resp:
        assert resp.status == 200, (url, resp.status, await resp.text())
        await resp.content.readany()  # the first bytes: the whole answer, or the first streamed event
        dt = time.perf_counter() - t0
        await resp.read()
    return dt


async def run(n: int, kind: str) -> str:
    binary = build()
    gguf = model(kind, binary)
    server_cpus, other_cpus = placement(True)
    if other_cpus:
        os.sched_setaffinity(0, other_cpus)
    args = ("-c", "4096", "-np", "4", "-kvu", "--slots")
    with (
        server(binary, gguf, *args, "--api-key", SERVER_KEY, cpus=server_cpus) as keyed,
        server(binary, gguf, *args, cpus=server_cpus) as open_srv,
    ):
        via_server, stop1 = await proxy(keyed.url, upstream_api_key=SERVER_KEY)
        via_keys, stop2 = await proxy(keyed.url, upstream_api_key=SERVER_KEY, api_keys=(ApiKey(KVCTL_KEY, "bench"),))
        via_open, stop3 = await proxy(open_srv.url)
        modes = {
            "direct (server checks its key)": (keyed.url, SERVER_KEY),
            "kvctl, server key checked by the server": (via_server, SERVER_KEY),
            "kvctl, its own keys": (via_keys, KVCTL_KEY),
            "kvctl, no auth (keyless server)": (via_open, None),
        }
        probes = {
            "GET /v1/models": ("GET", "/v1/models", None),
            "POST /tokenize": ("POST", "/tokenize", {"content": "hello world"}),
            "chat, first token": ("POST", "/v1/chat/completions", CHAT),
        }
        samples: dict[tuple[str, str], list[float]] = {(m, p): [] for m in modes for p in probes}
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
                for i in range(n + 10):
                    for mode, (base, key) in modes.items():
                        for probe, (method, path, body) in probes.items():
                            dt = await timed(http, method, base + path, key, body)
                            if i >= 10:  # warm-up rounds
                                samples[(mode, probe)].append(dt * 1000)
        finally:
            for stop in (stop1, stop2, stop3):
                await stop()
    rows = []
    for probe in probes:
        base = statistics.median(samples[(next(iter(modes)), probe)])
        for mode in modes:
            v = samples[(mode, probe)]
            rows.append([probe, mode, statistics.median(v), pct(v, 0.99), statistics.median(v) - base])
    head = ["request", "way in", "p50 ms", "p99 ms", "p50 added ms"]
    text = f"{n} requests of each kind per way in, interleaved; model `{kind}`\n\n" + table(head, rows) + "\n"
    save("proxy_auth.md", text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.proxy_auth", description=__doc__)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--model", default="tiny", choices=["tiny", "bench"])
    args = ap.parse_args()
    print(asyncio.run(run(args.requests, args.model)))


if __name__ == "__main__":
    cli(main)
