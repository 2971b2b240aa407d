"""No hung sockets and a shutdown with numbers: a frozen server ends its streams with an error event, a hung
spawned server is killed and restarted, SIGTERM drains open streams before the server is stopped."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from testkit.llama import free_port, server_argv, sse_events
from tests.harness import POOL, ProxyFactory, ServerFactory, request, running_app
from tests.integration.faults import wait_until

pytestmark = pytest.mark.server


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """The server's process group stopped (SIGSTOP) for the block: a hung main loop and HTTP threads alike."""
    os.killpg(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGCONT)


async def frozen_mid_stream(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], pid: int
) -> list[Any]:
    """Stream, freeze the server after 20 data events, return the events read after that (name, data)."""
    after: list[Any] = []
    n = 0
    t_frozen = 0.0
    with contextlib.ExitStack() as stack:
        async with http.post(url + path, json=body) as resp:
            assert resp.status == 200
            event_name = None
            while True:
                raw = await resp.content.readline()
                if not raw:
                    break
                line = raw.decode().rstrip("\r\n")
                if line.startswith("event:"):
                    event_name = line[6:].strip()
                elif line.startswith("data:"):
                    n += 1
                    if t_frozen:
                        after.append((event_name, json.loads(line[5:])))
                    if n == 20:
                        stack.enter_context(frozen(pid))
                        t_frozen = time.monotonic()
                elif line == "":
                    event_name = None
        assert t_frozen and time.monotonic() - t_frozen < 15, "the stream ended in time"
    return after


async def test_a_frozen_server_ends_streams_with_their_protocols_error_event(
    start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL)
    assert srv.proc is not None
    url = await start_proxy(srv.url, upstream_read_timeout_s=2.0, heartbeat_s=0.5)
    msgs = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100000, "stream": True}
    events = await frozen_mid_stream(http, url, "/v1/messages", {**msgs, "ignore_eos": True}, srv.proc.pid)
    name, data = events[-1]
    assert name == "error" and data["kvctl_code"] == "upstream_timeout" and data["type"] == "unavailable_error"
    chat = {k: v for k, v in msgs.items() if k != "model"}
    events = await frozen_mid_stream(http, url, "/v1/chat/completions", {**chat, "ignore_eos": True}, srv.proc.pid)
    name, data = events[-1]
    assert name is None and data["error"]["kvctl_code"] == "upstream_timeout"


def spawn_settings(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path, **proxy: Any
) -> tuple[str, dict[str, dict[str, Any]]]:
    """The spawned server's URL, and the settings groups that spawn it."""
    port = free_port()
    return f"http://127.0.0.1:{port}", {
        "supervisor": {
            "spawn": server_argv(llama_server_bin, tiny_model, port, *POOL),
            "log_file": str(tmp_path / "spawned.log"),
            "restart_backoff_initial_s": 0.2,
        },
        "proxy": proxy,
    }


async def test_a_hung_spawned_server_is_killed_and_restarted(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    upstream, groups = spawn_settings(llama_server_bin, tiny_model, tmp_path, upstream_read_timeout_s=3.0)
    async with running_app(upstream, **groups, start_timeout_s=60, stop_timeout_s=60) as (app, url, _):
        sup = app.supervisor
        assert sup is not None
        await wait_until(lambda: app.loop.state.upstream_up and sup.status.state == "ready", 30, "a ready server")
        assert "--sse-ping-interval" in sup.status.argv, "a spawned server pings within a third of the timeout"
        pid = sup.status.pid
        assert pid is not None
        os.killpg(pid, signal.SIGSTOP)  # SIGKILL still ends a stopped process: no SIGCONT needed
        t0 = time.monotonic()
        # a request whose response has not started when the server hangs: no per-request timer, the poll's; the
        # server is killed, and the request, never answered, is sent again to the new one
        async with http.post(url + "/completion", json=request("hung", 8)) as resp:
            body = await resp.json()
        assert resp.status == 200 and body["tokens_predicted"] == 8, body
        assert time.monotonic() - t0 >= 3.0, "answered by the restarted server"
        assert sup.status.restarts == 1 and sup.status.pid != pid
        assert sup.status.last_exit is not None and sup.status.last_exit.returncode == -signal.SIGKILL
        await wait_until(lambda: app.loop.state.upstream_up, 60, "the restarted server")
        async with http.post(url + "/completion", json=request("back", 8)) as resp:
            assert resp.status == 200 and (await resp.json())["tokens_predicted"] == 8


async def test_sigterm_drains_open_streams_then_stops_the_server(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    upstream, groups = spawn_settings(llama_server_bin, tiny_model, tmp_path, drain_s=3.0)
    stop = asyncio.Event()
    outcomes: dict[int, tuple[str, float]] = {}
    # kvctl must stop cleanly once the drain is over: running_app's exit waits for its exit code 0
    async with running_app(upstream, **groups, stop=stop, start_timeout_s=60) as (app, url, admin):
        sup = app.supervisor
        assert sup is not None and app.proxy is not None
        await wait_until(lambda: app.loop.state.upstream_up, 30, "the first poll")

        async def stream(i: int, n_predict: int) -> None:
            async with http.post(
                url + "/completion", json={**request(f"drain {i}", n_predict), "stream": True}
            ) as resp:
                assert resp.status == 200
                async for ev in sse_events(resp):
                    if ev.data is None:
                        continue
                    chunk = json.loads(ev.data)
                    if "error" in chunk:
                        outcomes[i] = (chunk["error"]["kvctl_code"], time.monotonic())
                        return
                    if chunk.get("stop"):
                        outcomes[i] = ("done", time.monotonic())
                        return
            outcomes[i] = ("cut", time.monotonic())

        # two streams that finish inside the drain, two that cannot
        streams = [asyncio.create_task(stream(i, n)) for i, n in enumerate((300, 300, 100000, 100000))]
        await wait_until(lambda: len(app.proxy.inflight) == 4, 10, "four open streams")  # type: ignore[union-attr]
        t_term = time.monotonic()
        stop.set()  # what SIGTERM does (cli.py)
        await wait_until(lambda: app.proxy.draining, 5, "the drain")  # type: ignore[union-attr]
        async with http.get(admin + "/readyz") as resp:
            assert resp.status == 503 and "shutting down" in json.dumps(await resp.json())
        async with http.post(url + "/completion", json=request("late", 8)) as resp:
            assert resp.status == 503 and (await resp.json())["error"]["kvctl_code"] == "shutting_down"
        assert sup.status.pid is not None and sup.status.last_exit is None, "the server is still up during the drain"
        await asyncio.wait_for(asyncio.gather(*streams), 30)
    assert [outcomes[i][0] for i in range(4)] == ["done", "done", "shutting_down", "shutting_down"]
    for i in (2, 3):
        assert 3.0 <= outcomes[i][1] - t_term < 6.0, "ended at the end of the drain"
    # the server last: stopped (SIGTERM) after the streams ended, within its stop timeout
    assert sup.status.last_exit is not None and sup.status.last_exit.returncode in (0, -signal.SIGTERM)
    assert sup.status.last_exit.at_unix >= time.time() - (time.monotonic() - max(o[1] for o in outcomes.values()))
