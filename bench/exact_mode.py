"""The batch-invariant server mode (`--exact`): is every continuation a solo run's, and what does it cost?

    python -m bench.exact_mode [--model smollm2] [--part exact,cost] [--streams 1,4,16] [--tokens 128]

exact: one server a row, each in `--exact`; three target chats run alone one after the other, then
the same three beside three longer prompts that arrive while they decode (bench/exact_causes.py's
schedule); a target is exact when its token ids equal its solo run's. Rows: flash attention on and
off, f16 and q8_0 caches, one and two threads.

cost: the same build, the default mode and `--exact` side by side, one server each: N streams at
once, each a short chat and `--tokens` greedy tokens (ignore_eos); generated tokens per second of
wall time, and the exact mode's share of the default's.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import build, cli, model, save, server, table
from bench.exact_causes import measure
from testkit.llama import stream_completion
from testkit.realmodels import user_turn

EXACT_ROWS: list[tuple[str, tuple[str, ...]]] = [
    ("-fa on, f16", ("-fa", "on")),
    ("-fa off, f16", ("-fa", "off")),
    ("-fa on, q8_0", ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0")),
    ("-fa off, q8_0 K", ("-fa", "off", "-ctk", "q8_0")),
    ("-fa on, f16, -t 2", ("-fa", "on", "-t", "2", "-tb", "2")),
    ("-fa off, f16, -t 2", ("-fa", "off", "-t", "2", "-tb", "2")),
]
COST_PROMPT = "Write a long story about a lighthouse keeper and the ships she watched over the years."


async def throughput(url: str, streams: int, tokens: int, model_name: str) -> float:
    """Generated tokens per second of wall time, ``streams`` chats at once."""
    payload: dict[str, Any] = {"prompt": user_turn(model_name, COST_PROMPT), "n_predict": tokens, "ignore_eos": True}
    payload["cache_prompt"] = False
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as s:
        await stream_completion(s, url, {**payload, "n_predict": 8})  # warm the server's first step
        t0 = time.monotonic()
        res = await asyncio.gather(*[stream_completion(s, url, payload) for _ in range(streams)])
        wall = time.monotonic() - t0
    assert all(len(r.tokens) == tokens for r in res), [r.error for r in res]
    return streams * tokens / wall


def part_exact(binary: Any, gguf: Any, tokens: int, rounds: int, extra: tuple[str, ...], which: str) -> str:
    rows = []
    for i, (name, flags) in enumerate(EXACT_ROWS):
        if which and str(i + 1) not in which.split(","):
            continue
        base = ("-c", "4096", "-np", "8", "-kvu", "--slots", "--exact", *flags, *extra)
        departures: list[int | None] = []
        with server(binary, gguf, *base) as srv:
            for _ in range(rounds):
                departures += asyncio.run(measure(srv.url, tokens, Path(gguf).name))
        exact = sum(d is None for d in departures)
        firsts = ", ".join("-" if d is None else str(d) for d in departures)
        rows.append((name, f"{exact}/{len(departures)}", firsts))
        print(rows[-1], flush=True)
    return table(["--exact and", "targets exact", "first different token (each target, each round)"], rows)


def part_cost(binary: Any, gguf: Any, streams: list[int], tokens: int, fa: list[str], extra: tuple[str, ...]) -> str:
    rows = []
    for f in fa:
        rates: dict[str, list[float]] = {}
        for mode, mode_flags in (("default", ()), ("exact", ("--exact",))):
            np_ = str(max(streams))
            with server(binary, gguf, "-c", "8192", "-np", np_, "-kvu", "-fa", f, *mode_flags, *extra) as srv:
                rates[mode] = [asyncio.run(throughput(srv.url, n, tokens, Path(gguf).name)) for n in streams]
        for n, d, e in zip(streams, rates["default"], rates["exact"], strict=True):
            rows.append((f"-fa {f}", n, f"{d:.1f}", f"{e:.1f}", f"{100 * e / d:.0f} %"))
            print(rows[-1], flush=True)
    return table(["flash attention", "streams", "default tok/s", "--exact tok/s", "exact / default"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, gemma3, or a random-weight size (tiny, bench)")
    ap.add_argument("--part", default="exact,cost", help="exact, cost, or both")
    ap.add_argument("--tokens", type=int, default=96, help="greedy tokens a chat generates")
    ap.add_argument("--rounds", type=int, default=2, help="mixed runs per exactness row")
    ap.add_argument("--streams", default="1,4,16", help="concurrent chats of the cost rows")
    ap.add_argument("--fa", default="on,off", help="flash attention of the cost rows")
    ap.add_argument("--server-args", default="", help="more server flags for every row (bench/gpu.sh: '-ngl 99')")
    ap.add_argument("--rows", default="", help="exactness rows to run, by number (default all)")
    ap.add_argument("--out", default=None, help="bench/results/ file name (default exact_mode_MODEL)")
    args = ap.parse_args(argv)
    extra = tuple(args.server_args.split())
    binary = build()
    gguf = model(args.model, binary)
    parts = args.part.split(",")
    out = f"{args.model}, {args.tokens} greedy tokens\n\n"
    if "exact" in parts:
        out += "Exactness: 3 targets alone, then beside 3 late arrivals, " + f"{args.rounds} rounds\n\n"
        out += part_exact(binary, gguf, args.tokens, args.rounds, extra, args.rows) + "\n"
    if "cost" in parts:
        streams = [int(n) for n in args.streams.split(",")]
        out += "Cost: the same build, default against --exact, generated tokens per second\n\n"
        out += part_cost(binary, gguf, streams, args.tokens, args.fa.split(","), extra) + "\n"
    print(out)
    save(f"{args.out or 'exact_mode_' + args.model}.md", out)
    return 0


if __name__ == "__main__":
    cli(main)
