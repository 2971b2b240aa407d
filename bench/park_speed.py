"""Park and resume at memory speed, and what a park costs the other streams (issue 17).

    python -m bench.park_speed [--sizes 16,64,256,1024] [--slices 16M,0] [--fa on,off] [--cache f32,q8_0]
                               [--model kvheavy|kv64] [--prompt-mib N] [--long all|one] [--pinned on] [--threads 1,2]
                               [--server-args "-ngl 99"] [--out park_speed]

Model "kvheavy" (32 layers x 16 KV heads x 128, f32 cache: 512 KiB a cell) or "kv64" (64 layers x 64 KV
channels: 32 KiB a cell in f32, small rows in many layers), four slots in one unified pool, four streams
generating together, so the cells of each interleave with the three others'. With --prompt-mib, stream 0
(--long one) or every stream (--long all) starts with a prompt of that much KV, prefilled in runs of
contiguous cells. When stream 0 holds a snapshot of each size, it is parked and resumed through the API
(mode swap), and:
  park / resume GB/s   snapshot bytes over the server's timings.copy_ms (time spent copying, summed
                       over the slices), the best of 3 parks and resumes after the first (the arena reused;
                       the first, which grows the arena and faults its pages in, is its own column),
                       beside a numpy copy of a buffer >= 4x the last-level cache and
                       of a 16 MiB one, measured in the same run, and beside numpy doing the same
                       copy (every 4th row; with -fa off, V every 4th f32 element): what this
                       machine's memory gives the layout (a gather reads n times the bytes it copies);
  stall                the longest and the median gap between tokens of streams 1-3 from the park
                       request until stream 0's next token, against the same streams' gaps over as long
                       a window just before, and at least their last 8 (no park); "bound" is 2 decode
                       steps (their median gap without a park) + 5 ms, the target of issue 35.
  RSS                  the server's resident memory right before the last park (the other streams
                       stopped), and --park-arena-keep (30 s, its default) + 5 s after the last resume, with
                       stream 0 stopped: the arena gives its memory back to the OS (--rss off skips it).
--prompt-mib auto (with --long one) runs each size on its own server, stream 0's prompt holding all but 1 MiB
of it: the snapshot is one contiguous run of cells, the layout a long prompt leaves.
--slices runs the whole table for each --park-slice (0: a park copies at once, as before slicing);
--threads for each --park-threads (the threads a copy of host memory runs on; 1: the server loop's only);
--pinned off adds --no-park-pinned (pageable arena on a CUDA build; the CPU has no pinned memory).
--tier disk parks to a --park-disk directory under --disk-dir instead (--park-ram 0): its "arena" column says
disk, park GB/s is the copy into the file's mapping (its write-back follows on a worker thread, within
park_ms), resume GB/s the copy back once a worker has read the file against its checksum (within resume_ms).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import shlex
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.common import build, cli, model, save, server, table
from bench.park_cost import memcpy_gbps
from testkit.llama import post_action, sse_events
from testkit.models import SIZES

REUSED = 3  # parks and resumes at each size after the first, which grows the arena: the best speed of these
KEEP_S = 30  # --park-arena-keep for these runs (the default): the second park at a size must come within it


def layout_gbps(
    fa: str, n_bytes: int, row: int, el: int, n_layer: int, width: int, n_ctx: int, streams: int = 4, repeat: int = 3
) -> float:
    """The same copy as a park of n_bytes of one stream's KV out of a cache where `streams` streams interleave
    cell by cell, done by numpy on arrays of the cache's shape: K (and V with flash attention on) every
    `streams`-th row of `row` bytes; V with flash attention off (stored transposed: a row of n_ctx elements of `el`
    bytes per layer and channel) every `streams`-th element of each channel's row. With streams=1 (one long
    request's contiguous cells) K is one block and a transposed V a run of the request's cells in each row of
    n_ctx cells. What this machine's memory gives that layout."""
    half = n_bytes // 2 // row * row
    src = np.ones(half * streams, dtype=np.uint8)
    dst = np.ones(half, dtype=np.uint8)
    dt = {2: np.uint16, 4: np.uint32}[el]
    n = max(1, half // (n_layer * width * el))  # the stream's cells a layer
    # a channel's row: the cells in use and a gap before the next row (one request: the whole pool's row)
    kv = n_ctx if streams == 1 else min(n_ctx, streams * n + 1024)
    v_src = np.ones((n_layer * width, kv), dtype=dt)
    v_dst = np.ones((n_layer * width, n), dtype=dt)

    def rows() -> None:
        np.copyto(dst.reshape(-1, row), src.reshape(-1, streams, row)[:, 0, :])

    def gather() -> None:
        np.copyto(v_dst, v_src[:, 0 : n * streams : streams])

    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        rows()
        (rows if fa == "on" else gather)()
        best = min(best, time.perf_counter() - t0)
    return 2 * half / best / 1e9


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def llc_bytes() -> int:
    best = 0
    for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = p.read_text().strip()
        mult = {"K": 1024, "M": 1024**2}.get(text[-1], 1)
        best = max(best, int(text.rstrip("KM")) * mult)
    return best or 32 * 1024**2


class Streams:
    """Four streaming completions; records each token's arrival time per stream."""

    def __init__(self, url: str, session: aiohttp.ClientSession, n_prompts: list[int]) -> None:
        self.url, self.session, self.n_prompts = url, session, n_prompts
        self.arrivals: list[list[float]] = [[] for _ in range(4)]
        self.tasks: list[asyncio.Task[None]] = []

    async def _run(self, i: int) -> None:
        # a long prompt fills its cells in prefill chunks (contiguous runs), the tail interleaves
        prompt: str | list[int] = f"stream {i} once upon a time"
        if self.n_prompts[i]:
            prompt = [10 + (i * 7 + k) % 200 for k in range(self.n_prompts[i])]
        body = {
            "prompt": prompt,
            "n_predict": 100000,
            "ignore_eos": True,
            "id_slot": i,
            "cache_prompt": False,
            "stream": True,
        }
        async with self.session.post(f"{self.url}/completion", json=body) as resp:
            async for ev in sse_events(resp):
                if ev.data is not None:
                    self.arrivals[i].append(time.perf_counter())

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._run(i)) for i in range(4)]

    async def stop(self, which: range = range(4)) -> None:
        for i in which:
            self.tasks[i].cancel()
        await asyncio.gather(*(self.tasks[i] for i in which), return_exceptions=True)


def gaps(arrivals: list[float], t0: float, t1: float) -> list[float]:
    ts = [t for t in arrivals if t0 <= t <= t1]
    return [(b - a) * 1e3 for a, b in itertools.pairwise(ts)]


async def wait_kv(session: aiohttp.ClientSession, url: str, done: Callable[[dict[str, Any]], bool]) -> None:
    """Poll /kv until ``done`` holds for its answer."""
    while True:
        async with session.get(f"{url}/kv") as r:
            if done(await r.json()):
                return
        await asyncio.sleep(0.02)


async def park_and_resume(
    session: aiohttp.ClientSession, url: str, streams: Streams, tier: str = "ram"
) -> tuple[dict[str, Any], dict[str, Any], list[float], list[float]]:
    """Park (to tier) and resume stream 0; the other streams' gaps before (as long a window) and during it."""
    others = streams.arrivals[1:]
    n_before = len(streams.arrivals[0])
    t_park = time.perf_counter()
    st, park, _ = await post_action(session, url, 0, "park", {"mode": "swap", "tier": tier})
    assert st == 200 and park["tier"] == tier, park
    st, resume, _ = await post_action(session, url, 0, "resume")
    assert st == 200, resume
    while len(streams.arrivals[0]) <= n_before:  # noqa: ASYNC110 - stream 0's next token ends the park
        await asyncio.sleep(0.001)
    t_end = streams.arrivals[0][n_before]
    window = t_end - t_park
    # the baseline: as long a window before the park, and at least each stream's last 8 gaps
    base = []
    for a in others:
        before = [t for t in a if t < t_park]
        t0 = min(t_park - window, before[-9] if len(before) >= 9 else before[0])
        base += gaps(a, t0, t_park)
    during = [g for a in others for g in gaps(a, t_park, t_end)]
    # a park window can be shorter than one gap: count the gap that spans it
    for a in others:
        spanning = [t for t in a if t < t_park][-1:] + [t for t in a if t > t_park][:1]
        if len(spanning) == 2:
            during.append((spanning[1] - spanning[0]) * 1e3)
    # the next window's baseline starts after this park's effects
    while len(streams.arrivals[0]) <= n_before + 8:  # noqa: ASYNC110
        await asyncio.sleep(0.001)
    return park, resume, base, during


async def measure(
    url: str,
    pid: int,
    sizes_mib: list[int],
    cell_bytes: int,
    prompt_mib: int = 0,
    long: str = "all",
    with_rss: bool = True,
    tier: str = "ram",
) -> tuple[list[dict[str, float]], dict[str, float]]:
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        n_prompt = prompt_mib * 1024**2 // cell_bytes
        streams = Streams(url, session, [n_prompt if i == 0 or long == "all" else 0 for i in range(4)])
        streams.start()
        for mib in sizes_mib:

            def holds(kv: dict[str, Any], n: int = mib * 1024**2 // cell_bytes) -> bool:
                return bool(kv["slots"][0]["n_cells"] >= n)

            await wait_kv(session, url, holds)
            # the first park grows the arena (its pages are faulted in as the copy writes them), the next ones
            # reuse it, as every park does within --park-arena-keep of the last: their best speed on this shared
            # machine, and every park's stall
            runs = [await park_and_resume(session, url, streams, tier) for _ in range(1 + REUSED)]
            park0 = runs[0][0]
            n_bytes = runs[1][0]["n_bytes"]
            park = min((r[0] for r in runs[1:]), key=lambda a: a["timings"]["copy_ms"])
            resume = min((r[1] for r in runs[1:]), key=lambda a: a["timings"]["copy_ms"])
            base = [g for r in runs for g in r[2]]
            during = [g for r in runs for g in r[3]]
            out.append(
                {
                    "mib": n_bytes / 2**20,
                    "first_park_gbps": park0["n_bytes"] / (park0["timings"]["copy_ms"] / 1e3) / 1e9,
                    "park_gbps": n_bytes / (park["timings"]["copy_ms"] / 1e3) / 1e9,
                    "resume_gbps": n_bytes / (resume["timings"]["copy_ms"] / 1e3) / 1e9,
                    "park_ms": park["timings"]["park_ms"],
                    "resume_ms": resume["timings"]["resume_ms"],
                    "base_max": max(base),
                    "base_p50": statistics.median(base),
                    "stall_max": max(during),
                    "stall_p50": statistics.median(during),
                }
            )
        if not with_rss:
            async with session.get(f"{url}/kv") as r:
                pinned = (await r.json())["park_arena"]["pinned"]
            await streams.stop()
            return out, {"pinned": float(pinned)}
        # the arena gives its memory back: RSS before the last park, and keep + 5 s after the last resume
        await streams.stop(range(1, 4))
        await wait_kv(session, url, lambda kv: all(s["state"] == "idle" for s in kv["slots"][1:4]))
        rss_before = rss_bytes(pid)
        assert (await post_action(session, url, 0, "park", {"mode": "swap"}))[0] == 200
        async with session.get(f"{url}/kv") as r:
            arena = (await r.json())["park_arena"]
        assert (await post_action(session, url, 0, "resume"))[0] == 200
        await streams.stop(range(1))
        await asyncio.sleep(KEEP_S + 5)
        rss = {"before": rss_before / 2**20, "arena": arena["bytes"] / 2**20, "after": rss_bytes(pid) / 2**20}
        rss["pinned"] = float(arena["pinned"])
    return out, rss


TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32}


def cell_bytes(kind: str, cache: str) -> int:
    """K and V bytes of a cell of the random model `kind` in a cache of type `cache`."""
    spec = SIZES[kind]
    return int(spec.n_layer * 2 * spec.n_head_kv * spec.head_dim * TYPE_BYTES[cache])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64,256,1024", help="snapshot sizes in MiB")
    ap.add_argument("--slices", default="16M,0", help="--park-slice values to compare")
    ap.add_argument("--threads", default="2", help="--park-threads values to compare")
    ap.add_argument("--fa", default="on,off", help="flash attention modes (off: V is stored transposed)")
    ap.add_argument("--cache", default="f32", help="KV cache types (-ctk/-ctv), e.g. f32,f16,q8_0 (q8_0: -fa on only)")
    ap.add_argument("--model", default="kvheavy", choices=["kvheavy", "kv64"], help="the random model")
    ap.add_argument("--pinned", default="on", help="on,off: the arena in pinned or pageable memory (CUDA)")
    ap.add_argument("--server-args", default="", help='extra llama-server arguments, e.g. "-ngl 99"')
    ap.add_argument(
        "--prompt-mib",
        default="0",
        help="streams start with a prompt of this many MiB of KV (prefilled in contiguous runs), so that "
        "the large sizes do not take thousands of decode steps; only the tail interleaves cell by cell. "
        "auto: each size on its own server, stream 0's prompt all but 1 MiB of it",
    )
    ap.add_argument("--rss", default="on", choices=["on", "off"], help="measure the arena's RSS given back")
    ap.add_argument("--long", default="all", choices=["all", "one"], help="which streams get --prompt-mib")
    ap.add_argument("--tier", default="ram", help="ram,disk: where the parks go (disk: --park-ram 0, no RSS table)")
    ap.add_argument("--disk-dir", default="/var/tmp", help="where --tier disk puts the server's --park-disk")
    ap.add_argument("--out", default="park_speed", help="bench/results/OUT.md")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    binary = build()
    gguf = model(args.model, binary)
    if args.prompt_mib == "auto":
        groups = [([sz], sz - 1) for sz in sizes]
    else:
        groups = [(sizes, int(args.prompt_mib))]
        assert all(sz > int(args.prompt_mib) for sz in sizes), "every size must be above --prompt-mib"
    big = max(4 * llc_bytes(), 256 * 1024**2)
    rows: list[tuple[object, ...]] = []
    rss_rows: list[tuple[object, ...]] = []
    combos = [(f, c) for f in args.fa.split(",") for c in args.cache.split(",") if not (f == "off" and c == "q8_0")]
    runs = [(f, c, sl, p) for f, c in combos for sl in args.slices.split(",") for p in args.pinned.split(",")]
    runs_g = [
        (*r, g, pm, t, n)
        for r in runs
        for g, pm in groups
        for t in args.tier.split(",")
        for n in args.threads.split(",")
    ]
    spec = SIZES[args.model]
    for fa, cache, sl, pin, group, prompt_mib, tier, n_thr in runs_g:
        cb = cell_bytes(args.model, cache)
        n_ctx = 4 * (max(group) * 1024**2 // cb + 256)
        argv_srv = ["-c", str(n_ctx), "-np", "4", "-kvu", "--slots", "-fa", fa, "-ctk", cache, "-ctv", cache]
        ram = str(2 * max(sizes) + 256) if tier == "ram" else "0"
        argv_srv += ["--park-slice", sl, "--park-threads", n_thr, "--park-ram", ram, "--park-arena-keep", str(KEEP_S)]
        argv_srv += [*shlex.split(args.server_args), *([] if pin == "on" else ["--no-park-pinned"])]
        with (
            tempfile.TemporaryDirectory(prefix="kvctl-park-", dir=args.disk_dir) as disk_dir,
            server(
                binary,
                gguf,
                *argv_srv,
                *(["--park-disk", disk_dir, "--park-disk-mib", str(2 * max(sizes) + 256)] if tier == "disk" else []),
            ) as srv,
        ):
            assert srv.proc is not None
            with_rss = args.rss == "on" and tier == "ram"
            res, rss = asyncio.run(measure(srv.url, srv.proc.pid, group, cb, prompt_mib, args.long, with_rss, tier))
        mc_big, mc_small = memcpy_gbps(big), memcpy_gbps(16 * 1024**2)
        width = spec.n_head_kv * spec.head_dim
        el = 2 if cache == "f16" else 4
        row = int(width * TYPE_BYTES[cache])
        layout_bytes = min(256, max(group)) * 1024**2
        streams = 1 if prompt_mib and args.long == "one" else 4  # stream 0's cells: one run, or one in 4
        layout = layout_gbps(
            fa, layout_bytes, row if row % el == 0 else width * el, el, spec.n_layer, width, n_ctx, streams
        )
        arena = "disk" if tier == "disk" else "pinned" if rss["pinned"] else "pageable"
        if "after" in rss:  # measured (--rss on)
            ok = "yes" if rss["after"] <= 1.05 * rss["before"] else "no"
            rss_rows.append((fa, cache, sl, n_thr, arena, rss["before"], rss["arena"], rss["after"], ok))
        for r in res:
            bound = 2 * r["base_p50"] + 5
            within = "yes" if r["stall_max"] <= bound else "no"
            park_gbps, resume_gbps = r["park_gbps"], r["resume_gbps"]
            speed: tuple[float, ...] = (r["first_park_gbps"], park_gbps, resume_gbps, mc_big, mc_small)
            speed = (*speed, park_gbps / mc_big, resume_gbps / mc_big)
            speed = (*speed, layout, park_gbps / layout, resume_gbps / layout)
            gaps_ = (r["base_p50"], r["base_max"], r["stall_p50"], r["stall_max"], bound, within)
            rows.append((fa, cache, sl, n_thr, arena, f"{r['mib']:.0f}", *speed, r["park_ms"], r["resume_ms"], *gaps_))
    heads = [
        "-fa",
        "cache",
        "--park-slice",
        "--park-threads",
        "arena",
        "snapshot MiB",
        "first park GB/s (arena grows)",
        "park GB/s",
    ]
    heads += ["resume GB/s"]
    heads += [f"memcpy {big >> 20} MiB GB/s", "memcpy 16 MiB GB/s", "park / memcpy", "resume / memcpy"]
    heads += ["same layout by numpy GB/s", "park / layout", "resume / layout"]
    heads += ["park_ms", "resume_ms", "gap p50 ms (no park)", "gap max ms (no park)", "gap p50 ms (park)"]
    heads += ["gap max ms (park)", "bound ms", "within bound"]
    out = table(heads, rows)
    rss_heads = ["-fa", "cache", "--park-slice", "--park-threads", "arena", "RSS before the last park MiB", "arena MiB"]
    rss_heads += [f"RSS {KEEP_S} + 5 s after the last resume MiB", "within 5 %"]
    if rss_rows:
        out += "\n\n" + table(rss_heads, rss_rows)
    where = args.server_args or "CPU"
    layout_s = "4 streams interleaved"
    if args.prompt_mib == "auto":
        layout_s = "4 streams, stream 0 a prompt of all but 1 MiB of each size (one run of cells), its own server"
    elif int(args.prompt_mib):
        who = "stream 0" if args.long == "one" else "each"
        layout_s = f"4 streams, {who} a {args.prompt_mib} MiB prompt (prefilled in runs of cells), then interleaved"
    kb = cell_bytes(args.model, "f32") >> 10
    llc = llc_bytes() >> 20
    header = f"model: {args.model} ({kb} KiB a cell in f32), {layout_s}, {where}; last-level cache {llc} MiB\n\n"
    print(header + out)
    save(f"{args.out}.md", header + out + "\n")
    return 0


if __name__ == "__main__":
    cli(main)
