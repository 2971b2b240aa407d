"""Pressure: does every request complete when concurrent chats overflow the KV pool?

    python bench/pressure.py [--bands 8192,16384] [--modes upstream,safety-net,kvctl] [--quick]
                             [--park-ram 1]

Bands of context size x workload mix x mode, measured side by side in one run:
  upstream    the unpatched llama-server (pinned tree, no patches)
  safety-net  the patched server alone (--auto-park, no controller)
  kvctl       the patched server with kvctl's controller (and proxy) in front, its safety net off
  kvctl-seed  the same with the seed's restore order (most-parked, then longest-waiting)
With ``--park-ram 1`` every band runs a second time with a snapshot budget of 1 MiB, smaller than one
request's snapshot: the patched server then parks by recompute (the band's label says ``ram=1``;
upstream has no such flag and runs as in the first pass).
Per cell: completed/total, errors, parks (and how many by recompute), max and p99 parked wait,
time to first token p50/p99, aggregate tokens/s, per-request slowdown against the same request
run solo, and a digest of the schedule (which requests were parked and resumed, in what order):
where kvctl and kvctl-seed show the same digest, the two orders made the same decisions and their
waits differ by the machine alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from bench.common import build, cli, model, pct, save, server, table
from bench.streams import Timed, timed_stream
from testkit.llama import NO_BYTE_TOKENS, parse_metrics
from testkit.policy_sim import Req


def workloads(n_ctx: int) -> dict[str, list[Req]]:
    long = int(n_ctx * 0.37)  # 4 of these overflow the pool mid-generation
    return {
        "equal-long": [Req(f"Story {i}:", long) for i in range(4)],
        # three long generations that together outgrow the pool, short chats arriving while they run
        "mixed": [Req(f"Long {i}:", int(n_ctx * 0.4)) for i in range(3)]
        + [Req(f"Short {i}:", 256, after=(0, int(n_ctx * 0.05 * (i + 1)))) for i in range(6)],
        # three chats that fit together, then two long prompts arriving while they generate: each
        # prompt takes a quarter of the pool when the chats hold two thirds and more of it
        "late-prompts": [Req(f"Chat {i}:", int(n_ctx * 0.3)) for i in range(3)]
        + [
            Req([1000 + j + 7919 * i for j in range(n_ctx // 4)], 256, after=(0, int(n_ctx * (0.22 + 0.04 * i))))
            for i in range(2)
        ],
        # each reaches n_ctx - 1 logical tokens: they can only take turns in a pool of n_ctx cells
        "full-ctx": [Req(f"Full {i}:", n_ctx - 16) for i in range(4)],
    }


async def run_cell(
    url: str, reqs: list[Req], metrics_url: str | None
) -> tuple[list[Timed], float, tuple[float, float]]:
    # a request that starts after another's progress waits on an event its chunks (or its end) set
    watch: dict[int, list[tuple[int, asyncio.Event]]] = {}
    for r in reqs:
        if r.after is not None:
            watch.setdefault(r.after[0], []).append((r.after[1], asyncio.Event()))

    def progressed(i: int, n: int) -> None:
        for need, ev in watch.get(i, []):
            if n >= need:
                ev.set()

    async def one(s: aiohttp.ClientSession, i: int, r: Req) -> Timed:
        if r.after is not None:
            j, n = r.after
            await next(ev for need, ev in watch[j] if need == n).wait()
        try:
            return await timed_stream(
                s,
                url,
                {
                    "prompt": r.prompt,
                    "n_predict": r.n_predict,
                    "ignore_eos": True,
                    "cache_prompt": False,
                    "logit_bias": NO_BYTE_TOKENS,
                },
                on_chunk=lambda n: progressed(i, n),
            )
        finally:
            progressed(i, 1 << 62)  # it ended: whoever waits on it starts now

    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0), timeout=timeout) as s:
        parks0 = await parks(s, metrics_url)
        t0 = time.monotonic()
        results = await asyncio.gather(*[one(s, i, r) for i, r in enumerate(reqs)])
        wall = time.monotonic() - t0
        parks1 = await parks(s, metrics_url)
        return list(results), wall, (parks1[0] - parks0[0], parks1[1] - parks0[1])


def schedule(results: list[Timed], gap_s: float = 0.025) -> str:
    """The order in which requests were parked and resumed, as a short digest: two runs with the same digest made
    the same decisions, so a difference in their waits is the machine's speed, not the policy. Events closer than
    ``gap_s`` (one controller poll carries out its actions within milliseconds; polls are 50 ms apart) form one
    unordered group."""
    events = sorted((t, i, kind) for i, r in enumerate(results) for t, kind in r.events)
    groups: list[list[str]] = []
    last = -1.0
    for t, i, kind in events:
        if not groups or t - last > gap_s:
            groups.append([])
        groups[-1].append(f"{kind[0]}{i}")
        last = t
    text = "|".join(",".join(sorted(g)) for g in groups)
    return hashlib.sha1(text.encode()).hexdigest()[:8] if text else "-"


async def parks(s: aiohttp.ClientSession, metrics_url: str | None) -> tuple[float, float]:
    """The server's parks so far: all of them, and those by recompute."""
    if metrics_url is None:
        return 0.0, 0.0
    async with s.get(metrics_url + "/metrics") as resp:
        m = parse_metrics(await resp.text())
    return m.get("llamacpp:slot_parks_total", 0.0), m.get("llamacpp:slot_recompute_parks_total", 0.0)


@contextlib.contextmanager
def kvctl_stack(binary: Path, gguf: Path, args: tuple[str, ...], env: dict[str, str]) -> Iterator[tuple[str, str]]:
    """The patched server behind kvctl: yields (client URL, server URL)."""
    from testkit.stack import start_stack  # imported lazily: needs the controller

    with server(binary, gguf, *args) as srv, start_stack(srv.url, env=env) as proxy_url:
        yield proxy_url, srv.url


@contextlib.contextmanager
def start_mode(
    mode: str, patched: Path, unpatched: Path | None, gguf: Path, base: tuple[str, ...]
) -> Iterator[tuple[str, str]]:
    """Yields (URL the clients use, URL of the server's /metrics)."""
    if mode in ("kvctl", "kvctl-seed"):
        env = {"KVCTL_POLICY__RESTORE_ORDER": "seed"} if mode == "kvctl-seed" else {}
        with kvctl_stack(patched, gguf, (*base, "--no-auto-park"), env) as urls:
            yield urls
        return
    binary = unpatched if mode == "upstream" else patched
    assert binary is not None
    with server(binary, gguf, *base) as srv:
        yield srv.url, srv.url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bands", default="8192,16384")
    ap.add_argument("--modes", default="upstream,safety-net,kvctl,kvctl-seed")
    ap.add_argument("--workloads", default="equal-long,mixed,late-prompts,full-ctx")
    ap.add_argument("--quick", action="store_true", help="8192 only, two workloads")
    ap.add_argument("--model", default="tiny", choices=["tiny", "bench", "gpu", "smollm2", "gemma3"])
    ap.add_argument("--server-args", default="", help="extra llama-server flags for every server, e.g. '-ngl 99'")
    ap.add_argument("--out", default="pressure", help="name of the table and plot in bench/results/")
    ap.add_argument(
        "--park-ram",
        default="",
        help="also run every band with these --park-ram values in MiB (comma list), e.g. 1: parks by recompute",
    )
    args = ap.parse_args(argv)
    park_rams: list[int | None] = [None, *(int(v) for v in args.park_ram.split(",") if v)]
    bands = [8192] if args.quick else [int(b) for b in args.bands.split(",")]
    names = ["equal-long", "late-prompts"] if args.quick else args.workloads.split(",")
    modes = args.modes.split(",")

    patched = build()
    unpatched = build(patched=False) if "upstream" in modes else None
    gguf = model(args.model, patched)
    rows = []
    solo: dict[int, float] = {}
    for n_ctx, ram in ((n, r) for n in bands for r in park_rams):
        base = ("-c", str(n_ctx), "-np", "8", "-kvu", "--slots", "--metrics", "-b", "512", *args.server_args.split())
        band = str(n_ctx) if ram is None else f"{n_ctx} ram={ram}"
        for name in names:
            reqs = workloads(n_ctx)[name]
            with server(patched, gguf, *base) as srv:
                for n in {r.n_predict for r in reqs} - solo.keys():
                    one, _, _ = asyncio.run(run_cell(srv.url, [Req("Solo run:", n)], None))
                    solo[n] = one[0].duration
            for mode in modes:
                ram_args = () if ram is None or mode == "upstream" else ("--park-ram", str(ram))
                with start_mode(mode, patched, unpatched, gguf, (*base, *ram_args)) as (url, murl):
                    results, wall, n_parks = asyncio.run(run_cell(url, reqs, None if mode == "upstream" else murl))
                done = [r for r in results if r.ok and not r.error]
                waits = [w for r in results for w in r.parked_waits]
                slow = [r.duration / solo[q.n_predict] for r, q in zip(results, reqs, strict=True) if r.ok]
                rows.append(
                    (
                        band,
                        name,
                        mode,
                        f"{len(done)}/{len(reqs)}",
                        len(reqs) - len(done),
                        f"{int(n_parks[0])} ({int(n_parks[1])} rc)" if n_parks[1] else int(n_parks[0]),
                        max(waits, default=0.0),
                        pct(waits, 0.99),
                        pct([r.ttft for r in done], 0.5),
                        pct([r.ttft for r in done], 0.99),
                        sum(r.n_tokens for r in done) / wall,
                        pct(slow, 0.5),
                        max(slow, default=float("nan")),
                        schedule(results),
                    )
                )
                print(rows[-1], flush=True)
    out = table(
        [
            "n_ctx",
            "workload",
            "mode",
            "completed",
            "errors",
            "parks (by recompute)",
            "max parked s",
            "p99 parked s",
            "TTFT p50 s",
            "TTFT p99 s",
            "tok/s",
            "slowdown p50",
            "slowdown max",
            "schedule",
        ],
        rows,
    )
    print()
    print(out)
    save(f"{args.out}.md", out + "\n")
    plot(rows, modes, args.out)
    return 0


def plot(rows: list[tuple[object, ...]], modes: list[str], name: str = "pressure") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot; pip install -e '.[bench]')")
        return
    cells = sorted({(r[0], r[1]) for r in rows}, key=lambda c: (str(c[0]), str(c[1])))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    width = 0.8 / len(modes)
    for k, mode in enumerate(modes):
        done, waits = [], []
        for c in cells:
            r = next((r for r in rows if (r[0], r[1]) == c and r[2] == mode), None)
            a, b = str(r[3]).split("/") if r else ("0", "1")
            done.append(int(a) / int(b))
            waits.append(float(r[6]) if r else 0.0)  # type: ignore[arg-type]
        xs = [i + k * width for i in range(len(cells))]
        ax1.bar(xs, done, width, label=mode)
        ax2.bar(xs, waits, width, label=mode)
    ax1.set_ylabel("requests completed")
    ax1.set_ylim(0, 1.05)
    ax1.legend(ncol=len(modes), fontsize=8)
    ax2.set_ylabel("longest parked wait (s)")
    ax2.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))])
    ax2.set_xticklabels([f"{c[0]}\n{c[1]}" for c in cells], fontsize=8)
    fig.tight_layout()
    path = save(f"{name}.png", "")
    fig.savefig(path)


if __name__ == "__main__":
    cli(main)
