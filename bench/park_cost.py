"""Park and resume cost of both modes against the request's length, beside a prefill of as many tokens.

    python bench/park_cost.py [--model bench|tiny|smollm2|gemma3] [--repeat 5] [--cells 256,1024,4096,16384]

For sequences of 256 to 16384 cells, parks and resumes a generating request through the API:
  swap       the server's own park_ms / resume_ms, the snapshot size and the resulting bandwidth,
             next to a numpy copy of the same number of bytes measured in the same run;
  recompute  the park's round trip, the resume until the stream's next token (the server answers
             at once, re-evaluates the tokens, then decodes one step), and the server's own time
             for the re-evaluation (timings.recompute_ms per resume);
  prefill    the server's prompt_ms for a fresh prompt of the same length (no cache).
A recompute resume of N tokens should cost about a prefill of N tokens: the last column is the ratio of
the server's re-evaluation time to its prompt_ms.
Recompute rows above 4096 cells are measured once (a CPU prefill of 16k cells takes minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import aiohttp
import numpy as np

from bench.common import build, cli, model, pct, save, server, table
from testkit.llama import post_action


def memcpy_gbps(n_bytes: int, repeat: int = 5) -> float:
    src = np.ones(max(n_bytes, 1), dtype=np.uint8)
    dst = np.ones_like(src)  # touched: no page faults in the timing
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return n_bytes / best / 1e9


def long_request(n_cells: int, **extra: object) -> dict[str, object]:
    return {
        "prompt": [1000 + (i % 20000) for i in range(n_cells)],
        "n_predict": 100000,
        "ignore_eos": True,
        "id_slot": 0,
        "cache_prompt": False,
        **extra,
    }


async def first_token(resp: aiohttp.ClientResponse) -> None:
    """Read the stream up to its first token: a ping or a notice can come first; a stream that ends first (an
    error answer) ends the bench."""
    while not (line := await resp.content.readline()).startswith(b"data: "):
        if not line:
            raise RuntimeError(f"the request ended before its first token: HTTP {resp.status}")


async def measure(url: str, n_cells: int, repeat: int) -> tuple[list[float], list[float], int]:
    park_ms, resume_ms, n_bytes = [], [], 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.post(url + "/completion", json=long_request(n_cells, stream=True)) as resp:
            await first_token(resp)
            for _ in range(repeat):
                st, b, _ = await post_action(s, url, 0, "park")
                assert st == 200, b
                park_ms.append(b["timings"]["park_ms"])
                n_bytes = b["n_bytes"]
                st, b, _ = await post_action(s, url, 0, "resume")
                assert st == 200, b
                resume_ms.append(b["timings"]["resume_ms"])
                await asyncio.sleep(0.05)
            resp.close()
    return park_ms, resume_ms, n_bytes


async def measure_recompute(
    url: str, n_cells: int, repeat: int, prefills: bool = True
) -> tuple[list[float], list[float], float, list[float]]:
    """Round trips of recompute parks, resumes until the next token (client side), the server's mean re-evaluation
    time per resume (its timings.recompute_ms), and (``prefills``) a prefill's prompt_ms of the same length."""
    park_ms, resume_ms, prefill_ms = [], [], []
    reeval_ms = float("nan")
    timeout = aiohttp.ClientTimeout(total=None)  # a CPU prefill of 16k tokens takes minutes
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=timeout) as s:
        # short enough to read the final timings, long enough for every park to find the request generating
        body = long_request(n_cells, stream=True, n_predict=20 * repeat + 20)
        async with s.post(url + "/completion", json=body) as resp:
            await first_token(resp)
            for _ in range(repeat):
                t0 = time.perf_counter()
                st, b, _ = await post_action(s, url, 0, "park", {"mode": "recompute"})
                assert st == 200 and b["mode"] == "recompute", b
                park_ms.append((time.perf_counter() - t0) * 1e3)
                while (line := await resp.content.readline()) != b": parked\n":
                    if not line:  # tokens streamed before the park, then the notice
                        raise RuntimeError("the stream ended before the park")
                t0 = time.perf_counter()
                st, b, _ = await post_action(s, url, 0, "resume")
                assert st == 200, b
                await first_token(resp)  # ": resumed", keep-alives, blank lines
                resume_ms.append((time.perf_counter() - t0) * 1e3)
            async for line in resp.content:
                event = json.loads(line[6:]) if line.startswith(b"data: ") else {}
                if event.get("stop"):
                    reeval_ms = event["timings"]["recompute_ms"] / repeat
        for _ in range(repeat if prefills else 0):
            async with s.post(url + "/completion", json=long_request(n_cells, n_predict=1)) as r:
                prefill_ms.append((await r.json())["timings"]["prompt_ms"])
    return park_ms, resume_ms, reeval_ms, prefill_ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="bench", choices=["bench", "tiny", "smollm2", "gemma3"])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cells", default="256,1024,4096,16384", help="request lengths to measure")
    ap.add_argument("--out", default="park_cost", help="name of the table and plot in bench/results/")
    args = ap.parse_args(argv)
    cells = [int(c) for c in args.cells.split(",")]
    binary = build()
    gguf = model(args.model, binary)
    rows = []
    n_ctx = str(max(cells) + 4096)
    with server(binary, gguf, "-c", n_ctx, "-np", "1", "-kvu", "--slots", "-fa", "on", "-b", "2048") as srv:
        for n_cells in cells:
            park, resume, n_bytes = asyncio.run(measure(srv.url, n_cells, args.repeat))
            # a re-evaluation is a prefill: quadratic in length, minutes for 16k cells on a CPU, so fewer repeats
            rc_repeat = args.repeat if n_cells <= 4096 else 1
            rc_park, rc_resume, reeval, prefill = asyncio.run(measure_recompute(srv.url, n_cells, rc_repeat))
            p50_park, p50_resume = statistics.median(park), statistics.median(resume)
            rows.append(
                (
                    n_cells,
                    n_bytes / 2**20,
                    p50_park,
                    pct(park, 0.9),
                    p50_resume,
                    pct(resume, 0.9),
                    n_bytes / (p50_park / 1e3) / 1e9,
                    n_bytes / (p50_resume / 1e3) / 1e9,
                    memcpy_gbps(n_bytes),
                    statistics.median(rc_park),
                    statistics.median(rc_resume),
                    pct(rc_resume, 0.9),
                    reeval,
                    statistics.median(prefill),
                    reeval / statistics.median(prefill),
                )
            )
    out = table(
        [
            "cells",
            "snapshot MiB",
            "park p50 ms",
            "park p90 ms",
            "resume p50 ms",
            "resume p90 ms",
            "park GB/s",
            "resume GB/s",
            "memcpy GB/s",
            "recompute park p50 ms",
            "recompute resume p50 ms",
            "recompute resume p90 ms",
            "re-evaluation ms",
            "prefill p50 ms",
            "recompute / prefill",
        ],
        rows,
    )
    out = f"model: {args.model} ({gguf.name}), -fa on, CPU\n\n" + out
    print(out)
    save(f"{args.out}.md", out + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ax.loglog([r[1] for r in rows], [r[2] for r in rows], "o-", label="park")
        ax.loglog([r[1] for r in rows], [r[4] for r in rows], "s-", label="resume")
        ax.set_xlabel("snapshot size (MiB)")
        ax.set_ylabel("latency (ms, p50)")
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(save(f"{args.out}.png", "").parent / f"{args.out}.png")
    except ImportError:
        print("(matplotlib not installed: no plot)")
    return 0


if __name__ == "__main__":
    cli(main)
