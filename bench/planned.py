"""Planned restarts under load: what a client sees while kvctl restarts its server or drains it to a peer.

    python -m bench.planned [--streams 4,16] [--n-predict 300]

On the real model (SmolLM2-135M-Instruct), each kvctl spawning its server (`-t 1`), for each number of streams:

- **restart**: `kvctl restart-server` (the same command line: an upgrade in place) while the streams run on one
  replica;
- **drain**: `kvctl drain` from replica A to replica B while the streams run on A;
- **drain, handover**: the same with the KV cells handed over in files (`proxy.handover_dir`, the servers'
  `--slot-save-path`): B evaluates no context again;
- **rolling**: a two-replica rolling restart under load: the streams spread over A and B; A is drained to B and a
  new A' started (its server and model loaded), then B is drained to A' while the moved streams still run.

Prints per scenario the operation's time (the admin API's answer), what it says moved and failed, whether every
chat completed with its full length and every token once (ids = n_predict, their text the streamed text), and the
longest gap between two tokens any client saw against the clients' median gap (the decode step).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import build, cli, model, save, table
from testkit.llama import StreamResult, free_port, server_argv, stream_completion
from testkit.stack import stack_admin, start_stack

PEER_KEY = "bench-peer-key"


class Client:
    """One streaming chat, with the time each of its chunks arrived."""

    def __init__(self, http: aiohttp.ClientSession, url: str, i: int, n_predict: int) -> None:
        self.arrivals: list[float] = []
        body = {"prompt": f"Story {i}: once upon a time", "n_predict": n_predict, "ignore_eos": True}
        self.task = asyncio.ensure_future(stream_completion(http, url, body, on_chunk=self._tick))
        self.n_predict = n_predict

    async def _tick(self, _res: StreamResult) -> None:
        self.arrivals.append(time.monotonic())

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


def admin(url: str, *args: str) -> tuple[float, str]:
    """A kvctl client command against ``url``'s admin listener: (seconds, its JSON answer)."""
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "controller.cli", *args[:1], "--admin", stack_admin(url).removeprefix("http://")]
    done = subprocess.run([*cmd, "--json", *args[1:]], capture_output=True, text=True, timeout=600)
    return time.monotonic() - t0, (done.stdout.strip() or done.stderr.strip())


class Replicas:
    def __init__(self, stack: ExitStack, binary: Path, gguf: Path, streams: int, handover: Path | None) -> None:
        self.stack, self.binary, self.gguf, self.handover = stack, binary, gguf, handover
        self.pool: tuple[str, ...] = ("-c", str(max(4096, 512 * streams)), "-np", str(streams), "-kvu", "--slots")
        self.pool += ("--metrics",)
        if handover is not None:
            self.pool += ("--slot-save-path", str(handover) + os.sep)

    def start(self) -> str:
        sport = free_port()
        argv = server_argv(self.binary, self.gguf, sport, *self.pool)
        env = {"KVCTL_PROXY__PEER_API_KEY": PEER_KEY, "KVCTL_PROXY__DRAIN_S": "600"}
        if self.handover is not None:
            env["KVCTL_PROXY__HANDOVER_DIR"] = str(self.handover)
        return self.stack.enter_context(start_stack(f"http://127.0.0.1:{sport}", "--spawn", "--", *argv, env=env))


async def running(http: aiohttp.ClientSession, urls: list[str], n: int) -> None:
    """Until ``n`` requests decode (8 tokens or more) on the servers behind ``urls``."""
    while True:
        busy = 0
        for url in urls:
            async with http.get(url + "/slots") as resp:
                slots = await resp.json()
            busy += sum(1 for s in slots if s.get("is_processing") and s["next_token"][0]["n_decoded"] >= 8)
        if busy >= n:
            return
        await asyncio.sleep(0.1)


async def scenario(kind: str, binary: Path, gguf: Path, streams: int, n_predict: int) -> list[Any]:
    with ExitStack() as stack:
        handover = Path(stack.enter_context(tempfile.TemporaryDirectory())) if kind == "drain, handover" else None
        reps = Replicas(stack, binary, gguf, streams, handover)
        a = reps.start()
        b = reps.start() if kind != "restart" else None
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as http:
            targets = [a, b] if kind == "rolling" and b is not None else [a]
            clients = [Client(http, targets[i % len(targets)], i, n_predict) for i in range(streams)]
            await running(http, targets, streams)
            steps: list[str] = []
            t_op = 0.0
            check = a  # a server still up at the end, for /detokenize
            if kind == "restart":
                t, out = await asyncio.to_thread(admin, a, "restart-server")
                t_op, steps = t, [out]
            else:
                assert b is not None
                t, out = await asyncio.to_thread(admin, a, "drain", "--to", b)
                t_op, steps, check = t, [out], b
                if kind == "rolling":
                    a2 = await asyncio.to_thread(reps.start)  # A upgraded: a new replica, its model loaded
                    t, out = await asyncio.to_thread(admin, b, "drain", "--to", a2)
                    t_op += t
                    steps.append(out)
                    check = a2
            results = await asyncio.gather(*(c.task for c in clients))
            complete = 0
            for res in results:
                ids = res.announced_ids  # every id (a chunk's `tokens` leave out held-back UTF-8)
                ok = res.error is None and len(ids) == n_predict
                async with http.post(check + "/detokenize", json={"tokens": ids}) as resp:
                    ok = ok and (await resp.json())["content"] == res.content
                complete += ok
        gaps = [g for c in clients for g in c.gaps()]
        worst = max(max(c.gaps()) for c in clients)
        return [
            kind,
            streams,
            round(t_op, 2),
            " / ".join(steps),
            f"{complete}/{streams}",
            round(worst * 1000),
            round(statistics.median(gaps) * 1000, 1),
        ]


def scenarios(counts: list[int]) -> Iterator[tuple[str, int]]:
    for streams in counts:
        for kind in ("restart", "drain", "drain, handover", "rolling"):
            yield kind, streams


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", default="4,16", help="stream counts, comma-separated")
    ap.add_argument("--n-predict", type=int, default=300)
    args = ap.parse_args(argv)
    binary = build()
    gguf = model("smollm2", binary)
    rows = [
        asyncio.run(scenario(kind, binary, gguf, streams, args.n_predict))
        for kind, streams in scenarios([int(s) for s in args.streams.split(",")])
    ]
    out = table(
        [
            "scenario",
            "streams",
            "operation s",
            "answer",
            "chats complete, every token once",
            "longest gap ms",
            "median gap ms",
        ],
        rows,
    )
    print(out)
    save("planned.md", out + "\n")
    return 0


if __name__ == "__main__":
    cli(main)
