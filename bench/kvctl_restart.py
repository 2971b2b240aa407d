"""kvctl's own restart under load: what 16 streaming clients see while kvctl's worker is SIGKILLed or reloaded.

    python -m bench.kvctl_restart [--streams 16] [--n-predict 300] [--spawn] [--repeat 3]

On the real model (SmolLM2-135M-Instruct, the server on one thread), kvctl in front of it (attached, or with
``--spawn`` spawning it), the same streams three times in one run:

- **none, without the keeper**: ``proxy.keeper = false``, nothing happens (what the keeper's extra hop costs);
- **none**: nothing happens to kvctl (the baseline: the decode step at this load);
- **SIGKILL**: the worker is killed once every stream has decoded a third of its answer; the keeper starts a new one;
- **reload**: ``kvctl reload`` at the same point (a new worker beside the old one, then the hand-over);
- **20 reloads** (SIGHUP to the keeper) and **10 SIGKILLs**, from a tenth of the way on, each once every client
  has received a token from the worker before it (so each lands mid-stream, and the next worker streams first).

The pool holds about 60 % of what the streams need, so parks happen in every scenario (the parks column). Each
scenario runs ``--repeat`` times; the gap columns are the median over the runs with their range (min-max), which
separates a kill's gap from the run-to-run noise.

Prints per scenario whether every chat completed with its full length and every token once (ids = n_predict, their
text the streamed text), the tokens the server evaluated beyond the prompts (a continuation by replay would evaluate
each stream's tokens again: the goal is 0), the longest gap between two tokens any client saw against the median
gap, and the new worker's start-up (from the kill or the reload to the keeper's ``serving``, from kvctl's log).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import build, cli, model, save, server, table
from testkit.llama import StreamResult, free_port, parse_metrics, server_argv, stream_completion
from testkit.stack import stack_admin, start_stack

NO_KEEPER = "none, without the keeper"  # proxy.keeper off: what the keeper's hop costs
MANY = {"20 reloads": ("hup", 20), "10 SIGKILLs": ("kill", 10)}  # events placed by the streams' progress


class Client:
    """One streaming completion, with the time each of its chunks arrived."""

    def __init__(self, http: aiohttp.ClientSession, url: str, i: int, n_predict: int) -> None:
        self.arrivals: list[float] = []
        self.t0 = time.monotonic()
        body = {"prompt": f"Story {i}: once upon a time", "n_predict": n_predict, "ignore_eos": True}
        self.task = asyncio.ensure_future(stream_completion(http, url, body, on_chunk=self._tick))

    async def _tick(self, _res: StreamResult) -> None:
        self.arrivals.append(time.monotonic())

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


async def _json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as r:
        return await r.json()


async def _counters(http: aiohttp.ClientSession, server_url: str) -> tuple[float, float, float]:
    """The server's evaluated prompt tokens, recomputed tokens and parks so far."""
    async with http.get(server_url + "/metrics") as r:
        m = parse_metrics(await r.text())
    return m["llamacpp:prompt_tokens_total"], m["llamacpp:recomputed_tokens_total"], m["llamacpp:slot_parks_total"]


async def _worker(http: aiohttp.ClientSession, admin: str, other_than: int | None) -> int:
    """The serving worker's pid, once it is not ``other_than``."""
    deadline = time.monotonic() + 60
    while True:
        with contextlib.suppress(aiohttp.ClientError, KeyError, TypeError, ValueError):
            pid = int((await _json(http, admin + "/status"))["keeper"]["pid"])
            if pid != other_than:
                return pid
        if time.monotonic() > deadline:
            raise RuntimeError("no worker took over within 60 s")
        await asyncio.sleep(0.05)


async def _many(http: aiohttp.ClientSession, admin: str, clients: list[Client], keeper: int, what: str, n: int) -> int:
    """``n`` reloads (SIGHUP to the keeper) or worker SIGKILLs, each once every running client has a new chunk since
    the one before took over; how many happened before the streams ended."""
    pid = await _worker(http, admin, None)
    for done in range(n):
        marks = [len(c.arrivals) for c in clients]
        while True:  # polled: the clients' chunks come on their own tasks
            if all(c.task.done() or len(c.arrivals) > k for c, k in zip(clients, marks, strict=True)):
                break
            await asyncio.sleep(0.01)
        if all(c.task.done() for c in clients):
            return done
        os.kill(keeper if what == "hup" else pid, signal.SIGHUP if what == "hup" else signal.SIGKILL)
        pid = await _worker(http, admin, pid)
    return n


async def _decoded(http: aiohttp.ClientSession, server_url: str, n: int, at_least: int) -> None:
    while True:
        slots = await _json(http, server_url + "/slots")
        if sum(1 for s in slots if s.get("is_processing") and s["next_token"][0]["n_decoded"] >= at_least) >= n:
            return
        await asyncio.sleep(0.05)


def _took_over(log: Path, after: float) -> float | None:
    """Seconds from ``after`` (a wall-clock time) to the next worker's ``keeper.took_over`` in kvctl's log."""
    for line in log.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("event") == "keeper.took_over":
            t = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            if t > after:
                return t - after
    return None


async def scenario(kind: str, binary: Path, gguf: Path, streams: int, n_predict: int, spawn: bool) -> list[Any]:
    cells = max(1024, int((n_predict + 64) * streams * 0.6))  # parks in every scenario
    pool = ("-c", str(cells), "-np", str(streams), "-kvu", "--slots", "--metrics", "--no-cache-prompt")
    with ExitStack() as stack:
        log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "kvctl.log"
        env = {"KVCTL_POLICY__PARK_TIER": "ram"}
        if kind == NO_KEEPER:
            env["KVCTL_PROXY__KEEPER"] = "false"
        if spawn:
            port = free_port()
            surl = f"http://127.0.0.1:{port}"
            argv = server_argv(binary, gguf, port, *pool)
            url = stack.enter_context(start_stack(surl, "--spawn", "--", *argv, env=env, log_path=log, timeout_s=120))
        else:
            srv = stack.enter_context(server(binary, gguf, *pool))
            surl = srv.url
            url = stack.enter_context(start_stack(surl, env=env, log_path=log))
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True, limit=0)) as http:
            status = await _json(http, stack_admin(url) + "/status")
            worker = (status.get("keeper") or {}).get("pid")
            spid = (status.get("supervisor") or {}).get("pid")
            before = await _counters(http, surl)
            clients = [Client(http, url, i, n_predict) for i in range(streams)]
            events = ""
            await _decoded(http, surl, 1, n_predict // 10 if kind in MANY else n_predict // 3)
            t_wall = time.time()
            if kind in MANY:
                what, n = MANY[kind]
                keeper = _keeper_pid(stack_admin(url), status)
                events = f"{await _many(http, stack_admin(url), clients, keeper, what, n)}/{n}"
            elif kind == "SIGKILL":
                assert worker is not None
                os.kill(worker, signal.SIGKILL)
            elif kind == "reload":
                admin = stack_admin(url).removeprefix("http://")
                cmd = [sys.executable, "-m", "controller.cli", "reload", "--admin", admin]
                await asyncio.to_thread(subprocess.run, cmd, capture_output=True, timeout=120, check=True)
            results = await asyncio.gather(*(c.task for c in clients))
            complete = 0
            for res in results:
                ids = res.announced_ids
                ok = res.error is None and len(ids) == n_predict
                async with http.post(surl + "/detokenize", json={"tokens": ids}) as resp:
                    ok = ok and (await resp.json())["content"] == res.content
                complete += ok
            prompts = sum(int(r.final["tokens_evaluated"]) for r in results if r.final)
            now = await _counters(http, surl)
            again, recomputed, parks = now[0] - before[0] - prompts, now[1] - before[1], now[2] - before[2]
            after = await _json(http, stack_admin(url) + "/status")
            same_server = spid is None or (after.get("supervisor") or {}).get("pid") == spid
        gaps = [g for c in clients for g in c.gaps()]
        worst = max(max(c.gaps()) for c in clients)
        start = _took_over(log, t_wall) if kind in ("SIGKILL", "reload") else None
        ttft = statistics.median(c.arrivals[0] - c.t0 for c in clients if c.arrivals)
        return [
            kind,
            "spawn" if spawn else "attach",
            streams,
            events,
            f"{complete}/{streams}",
            int(again),
            int(recomputed),
            int(parks),
            "yes" if same_server else "no",
            worst * 1000,
            statistics.median(gaps) * 1000,
            ttft * 1000,
            round(start * 1000) if start is not None else "",
        ]


def _keeper_pid(admin: str, status: dict[str, Any]) -> int:
    """The keeper's pid: the worker's parent."""
    worker = (status.get("keeper") or {}).get("pid")
    if not isinstance(worker, int):
        raise RuntimeError(f"kvctl at {admin} runs no keeper")
    return int(Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _spread(values: list[float]) -> str:
    """The median of the runs, and their range when there are several."""
    mid = statistics.median(values)
    return f"{mid:.0f}" if len(values) == 1 else f"{mid:.0f} ({min(values):.0f}-{max(values):.0f})"


def _merge(runs: list[list[Any]]) -> list[Any]:
    """One row for a scenario's runs: counts from the worst run, gaps as median (range)."""
    first = runs[0]
    complete = min(runs, key=lambda r: int(str(r[4]).split("/")[0]))[4]
    gaps = [_spread([float(r[i]) for r in runs]) for i in (9, 10, 11)]
    events = " ".join(sorted({str(r[3]) for r in runs}))
    again, recomputed = max(r[5] for r in runs), max(r[6] for r in runs)
    parks = "-".join(sorted({str(min(r[7] for r in runs)), str(max(r[7] for r in runs))}, key=int))
    same = "yes" if all(r[8] == "yes" for r in runs) else "no"
    return [first[0], first[1], first[2], events, complete, again, recomputed, parks, same, *gaps, first[12]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--n-predict", type=int, default=300)
    ap.add_argument("--spawn", action="store_true", help="kvctl spawns the server (default: attached)")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each scenario (default 3)")
    kinds = ("none", NO_KEEPER, "SIGKILL", "reload", *MANY)
    ap.add_argument("--only", help=f"a comma-separated subset of the scenarios ({', '.join(kinds)}); default: all")
    args = ap.parse_args(argv)
    chosen = [k.strip() for k in args.only.split(",")] if args.only else list(kinds)
    if unknown := [k for k in chosen if k not in kinds]:
        ap.error(f"--only: unknown scenario(s) {unknown}; known: {', '.join(kinds)}")
    binary = build()
    gguf = model("smollm2", binary)
    rows = []
    for kind in chosen:
        runs = [
            asyncio.run(scenario(kind, binary, gguf, args.streams, args.n_predict, args.spawn))
            for _ in range(args.repeat)
        ]
        rows.append(_merge(runs))
        print(f"kvctl_restart: {kind}: {rows[-1]}", file=sys.stderr, flush=True)  # a long run's rows as they come
    out = table(
        [
            "kvctl",
            "server",
            "streams",
            "events done",
            "chats complete, every token once",
            "tokens evaluated again",
            "recomputed tokens",
            "parks",
            "same server process",
            "longest gap ms",
            "median gap ms",
            "median first token ms",
            "new worker serving after ms",
        ],
        rows,
    )
    print(out)
    save("kvctl_restart" + ("_spawn" if args.spawn else "") + ".md", out + "\n")
    return 0


if __name__ == "__main__":
    cli(main)
