"""Soak: many concurrent streams with forced parks for a bounded time; nothing lost or duplicated.

    python bench/soak.py [--minutes 10] [--streams 16] [--interval 50] [--via-proxy]

Loopback only, bounded in time and requests. The patched server runs with --park-test-interval,
so every stream is parked and resumed every N tokens. Each stream is checked on the client side:
n_decoded runs 1..n_predict without gap or repeat and the count is exact; token ids are compared
with a greedy solo run of the same prompt on a server without parking (batching can change
floating-point reductions, so a differing id is reported as a divergence, not a loss; with --exact,
the batch-invariant mode, there must be none). With
--via-proxy the streams go through kvctl's proxy running in this process, whose memory, open file
descriptors and asyncio tasks are sampled over time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass, field

import aiohttp
import psutil
from prometheus_client import CollectorRegistry

from bench.common import build, cli, model, save, server, table
from testkit.llama import NO_BYTE_TOKENS, StreamResult, free_port, stream_completion


@dataclass
class Tally:
    streams: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    lost_or_duplicated: int = 0
    diverged: int = 0
    parks: int = 0
    samples: list[tuple[float, float, int, int]] = field(default_factory=list)  # t, rss MiB, fds, tasks


def prompts(n: int) -> list[str]:
    return [f"Soak prompt {i}: the story of number {i * 7919}" for i in range(n)]


async def reference(url: str, texts: list[str], n_predict: int) -> dict[str, list[int]]:
    out = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        for t in texts:
            r = await stream_completion(s, url, body(t, n_predict))
            out[t] = r.tokens
    return out


def body(prompt: str, n_predict: int) -> dict[str, object]:
    return {
        "prompt": prompt,
        "n_predict": n_predict,
        "ignore_eos": True,
        "cache_prompt": False,
        "logit_bias": NO_BYTE_TOKENS,
    }


def check(res: StreamResult, ref: list[int], n_predict: int, tally: Tally) -> None:
    tally.streams += 1
    if res.status != 200 or res.error is not None:
        tally.errors.append(str(res.error))
        return
    tally.tokens += len(res.tokens)
    tally.parks += res.comments.count("parked")
    if res.n_decoded != list(range(1, n_predict + 1)) or len(res.tokens) != n_predict:
        tally.lost_or_duplicated += 1
    elif res.tokens != ref[:n_predict]:
        tally.diverged += 1


async def soak(
    url: str, refs: dict[str, list[int]], n_streams: int, n_predict: int, seconds: float, tally: Tally
) -> None:
    texts = list(refs)
    proc = psutil.Process(os.getpid())
    t_end = time.monotonic() + seconds
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as s:

        async def worker(i: int) -> None:
            k = i
            while time.monotonic() < t_end:
                text = texts[k % len(texts)]
                k += n_streams
                check(await stream_completion(s, url, body(text, n_predict)), refs[text], n_predict, tally)

        async def sampler() -> None:
            while time.monotonic() < t_end:
                tally.samples.append(
                    (time.monotonic() - t0, proc.memory_info().rss / 2**20, proc.num_fds(), len(asyncio.all_tasks()))
                )
                await asyncio.sleep(max(1.0, seconds / 60))

        await asyncio.gather(sampler(), *[worker(i) for i in range(n_streams)])
    # at rest again: what is still open now has leaked
    await asyncio.sleep(1.0)
    tally.samples.append(
        (time.monotonic() - t0, proc.memory_info().rss / 2**20, proc.num_fds(), len(asyncio.all_tasks()))
    )


async def run(args: argparse.Namespace) -> Tally:
    binary = build()
    gguf = model("tiny", binary)
    texts = prompts(8)
    base = (
        "-c",
        str(max(8192, args.streams * (args.n_predict + 64))),
        "-np",
        str(args.streams),
        "-kvu",
        "--slots",
        "--metrics",
        *(("--exact",) if getattr(args, "exact", False) else ()),
    )
    with server(binary, gguf, *base) as ref_srv:
        refs = await reference(ref_srv.url, texts, args.n_predict)
    tally = Tally()
    with server(binary, gguf, *base, "--park-test-interval", str(args.interval)) as srv:
        url = srv.url
        cleanup = None
        if args.via_proxy:
            from controller.proxy.app import make_proxy_app
            from controller.proxy.config import ProxyConfig
            from controller.proxy.site import run_site

            port = free_port()
            cleanup = await run_site(
                make_proxy_app(ProxyConfig(upstream=srv.url), None, CollectorRegistry()), "127.0.0.1", port
            )
            url = f"http://127.0.0.1:{port}"
        try:
            await soak(url, refs, args.streams, args.n_predict, args.minutes * 60, tally)
        finally:
            if cleanup is not None:
                await cleanup()
    return tally


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--n-predict", type=int, default=400)
    ap.add_argument("--interval", type=int, default=50)
    ap.add_argument("--via-proxy", action="store_true")
    ap.add_argument("--exact", action="store_true", help="both servers in the exact mode: every id equals solo")
    args = ap.parse_args(argv)
    tally = asyncio.run(run(args))
    rss = [s[1] for s in tally.samples]
    fds = [s[2] for s in tally.samples]
    tasks = [s[3] for s in tally.samples]
    rows = [
        ("streams", tally.streams),
        ("tokens", tally.tokens),
        ("forced parks seen", tally.parks),
        ("errors", len(tally.errors)),
        ("lost or duplicated", tally.lost_or_duplicated),
        ("diverged from solo (numerics)", tally.diverged),
        ("client RSS MiB start/end", f"{rss[0]:.1f} / {rss[-1]:.1f}" if rss else "-"),
        ("open fds start/end (at rest)", f"{fds[0]} / {fds[-1]}" if fds else "-"),
        ("asyncio tasks start/end (at rest)", f"{tasks[0]} / {tasks[-1]}" if tasks else "-"),
    ]
    out = table(["measure", "value"], rows)
    print(out)
    if tally.errors:
        print("first errors:", tally.errors[:3])
    save("soak.md", out + "\n")
    return 0 if not tally.errors and tally.lost_or_duplicated == 0 else 1


if __name__ == "__main__":
    cli(main)
