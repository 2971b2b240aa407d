"""Park and resume at memory speed, and what a park costs the other streams (issue 17).

    python -m bench.park_speed [--sizes 16,64,256,1024] [--slices 16M,0] [--fa on,off]

Model "kvheavy" (32 layers x 16 KV heads x 128, f32 cache: 512 KiB a cell), four slots in one unified
pool, four streams generating together, so the cells of each interleave with the three others'. When
stream 0 holds a snapshot of each size, it is parked and resumed through the API (mode swap), and:
  park / resume GB/s   snapshot bytes over the server's timings.copy_ms (time spent copying, summed
                       over the slices), beside a numpy copy of a buffer >= 4x the last-level cache and
                       of a 16 MiB one, measured in the same run;
  stall                the longest and the median gap between tokens of streams 1-3 from the park
                       request until stream 0's next token, against the same streams' gaps over as many
                       tokens just before (no park); "bound" is that baseline's longest gap + 2 decode
                       steps (their median gap) + 5 ms, the issue's target.
--slices runs the whole table for each --park-slice (0: a park copies at once, as before slicing).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

from bench.common import build, model, save, server, table
from tests.integration.llama import post_action

CELL_BYTES = 32 * 2 * 2048 * 4  # kvheavy, f32 K and V


def llc_bytes() -> int:
    best = 0
    for p in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = p.read_text().strip()
        mult = {"K": 1024, "M": 1024**2}.get(text[-1], 1)
        best = max(best, int(text.rstrip("KM")) * mult)
    return best or 32 * 1024**2


def memcpy_gbps(n_bytes: int, repeat: int = 5) -> float:
    src = np.ones(n_bytes, dtype=np.uint8)
    dst = np.ones_like(src)  # touched: no page faults in the timing
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return n_bytes / best / 1e9


class Streams:
    """Four streaming completions; records each token's arrival time per stream."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url, self.session = url, session
        self.arrivals: list[list[float]] = [[] for _ in range(4)]
        self.tasks: list[asyncio.Task[None]] = []

    async def _run(self, i: int) -> None:
        body = {
            "prompt": f"stream {i} once upon a time",
            "n_predict": 100000,
            "ignore_eos": True,
            "id_slot": i,
            "cache_prompt": False,
            "stream": True,
        }
        async with self.session.post(f"{self.url}/completion", json=body) as resp:
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n" in buf:  # split on \n only: tokens may hold U+2028
                    line, buf = buf.split(b"\n", 1)
                    if line.startswith(b"data: "):
                        self.arrivals[i].append(time.perf_counter())

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._run(i)) for i in range(4)]

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def gaps(arrivals: list[float], t0: float, t1: float) -> list[float]:
    ts = [t for t in arrivals if t0 <= t <= t1]
    return [(b - a) * 1e3 for a, b in itertools.pairwise(ts)]


async def wait_cells(session: aiohttp.ClientSession, url: str, n: int) -> None:
    while True:
        async with session.get(f"{url}/kv") as r:
            kv = await r.json()
        if kv["slots"][0]["n_cells"] >= n:
            return
        await asyncio.sleep(0.02)


async def measure(url: str, sizes_mib: list[int]) -> list[dict[str, float]]:
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        streams = Streams(url, session)
        streams.start()
        for mib in sizes_mib:
            await wait_cells(session, url, mib * 1024**2 // CELL_BYTES)
            others = streams.arrivals[1:]
            n_before = len(streams.arrivals[0])
            t_park = time.perf_counter()
            st, park, _ = await post_action(session, url, 0, "park", {"mode": "swap"})
            assert st == 200, park
            st, resume, _ = await post_action(session, url, 0, "resume")
            assert st == 200, resume
            while len(streams.arrivals[0]) <= n_before:  # noqa: ASYNC110 - stream 0's next token ends the park
                await asyncio.sleep(0.001)
            t_end = streams.arrivals[0][n_before]
            window = t_end - t_park
            # as many tokens before the park, while stream 0 still generated
            base = [g for a in others for g in gaps(a, t_park - max(window, 0.5), t_park)]
            during = [g for a in others for g in gaps(a, t_park, t_end)]
            # a park window can be shorter than one gap: count the gap that spans it
            for a in others:
                spanning = [t for t in a if t < t_park][-1:] + [t for t in a if t > t_park][:1]
                if len(spanning) == 2:
                    during.append((spanning[1] - spanning[0]) * 1e3)
            n_bytes = park["n_bytes"]
            out.append(
                {
                    "mib": n_bytes / 2**20,
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
        await streams.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16,64,256,1024", help="snapshot sizes in MiB")
    ap.add_argument("--slices", default="16M,0", help="--park-slice values to compare")
    ap.add_argument("--fa", default="on,off", help="flash attention modes (off: V is stored transposed)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]
    binary = build()
    gguf = model("kvheavy", binary)
    n_ctx = 4 * (max(sizes) * 1024**2 // CELL_BYTES + 256)
    big = max(4 * llc_bytes(), 256 * 1024**2)
    rows = []
    for fa in args.fa.split(","):
        for sl in args.slices.split(","):
            argv_srv = (
                "-c",
                str(n_ctx),
                "-np",
                "4",
                "-kvu",
                "--slots",
                "-fa",
                fa,
                "-ctk",
                "f32",
                "-ctv",
                "f32",
                "--park-slice",
                sl,
                "--park-ram",
                str(2 * max(sizes) + 256),
            )
            with server(binary, gguf, *argv_srv) as srv:
                res = asyncio.run(measure(srv.url, sizes))
            mc_big, mc_small = memcpy_gbps(big), memcpy_gbps(16 * 1024**2)
            for r in res:
                bound = r["base_max"] + 2 * r["base_p50"] + 5
                rows.append(
                    (
                        fa,
                        sl,
                        f"{r['mib']:.0f}",
                        r["park_gbps"],
                        r["resume_gbps"],
                        mc_big,
                        mc_small,
                        r["park_gbps"] / mc_big,
                        r["resume_gbps"] / mc_big,
                        r["park_ms"],
                        r["resume_ms"],
                        r["base_p50"],
                        r["base_max"],
                        r["stall_p50"],
                        r["stall_max"],
                        bound,
                        "yes" if r["stall_max"] <= bound else "no",
                    )
                )
    out = table(
        [
            "-fa",
            "--park-slice",
            "snapshot MiB",
            "park GB/s",
            "resume GB/s",
            f"memcpy {big >> 20} MiB GB/s",
            "memcpy 16 MiB GB/s",
            "park / memcpy",
            "resume / memcpy",
            "park_ms",
            "resume_ms",
            "gap p50 ms (no park)",
            "gap max ms (no park)",
            "gap p50 ms (park)",
            "gap max ms (park)",
            "bound ms",
            "within bound",
        ],
        rows,
    )
    header = (
        f"model: kvheavy (512 KiB a cell, f32 cache), 4 streams interleaved, CPU; last-level cache "
        f"{llc_bytes() >> 20} MiB\n\n"
    )
    print(header + out)
    save("park_speed.md", header + out + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
