"""The controller on the real patched server: the watermark loop keeps every request alive with the
server's own safety net switched off, and the supervisor starts, watches and restarts the server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from controller.loop.control import ControlLoop
from controller.metrics import Metrics
from controller.settings import load_settings
from controller.upstream.client import UpstreamClient
from controller.upstream.supervisor import Supervisor, SupervisorState
from testkit.llama import (
    StreamResult,
    free_port,
    parse_metrics,
    server_argv,
    stream_completion,
)
from tests.harness import ServerFactory, request


async def watch_park_modes(http: aiohttp.ClientSession, url: str, seen: dict[int, set[str]]) -> None:
    """Record the mode /slots shows for each parked task, until cancelled."""
    while True:
        async with http.get(url + "/slots") as resp:
            for s in await resp.json():
                if s["state"] == "parked":
                    seen.setdefault(s["id_task"], set()).add(s["park"]["mode"])
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("park_ram", [None, 1], ids=["default", "park-ram-1"])
async def test_the_controller_parks_ahead_and_every_request_completes(
    start_server: ServerFactory, http: aiohttp.ClientSession, park_ram: int | None
) -> None:
    # park-ram-1: a budget that holds one snapshot of ~1900 cells (512 bytes each) and no second one,
    # so the first victim is swapped and the later ones are parked by recompute
    ram = ("--park-ram", str(park_ram)) if park_ram is not None else ()
    srv = start_server("-c", "8192", "-np", "4", "-kvu", "--slots", "--metrics", "--no-auto-park", *ram)
    settings = load_settings(overrides={"upstream": {"url": srv.url}})
    high = settings.policy.high
    seen: dict[int, set[str]] = {}
    async with UpstreamClient(srv.url, timeout_s=settings.upstream.timeout_s) as client:
        loop = ControlLoop(client, settings, Metrics(CollectorRegistry()))
        task = asyncio.create_task(loop.run(), name="control loop")
        watch = asyncio.create_task(watch_park_modes(http, srv.url, seen))
        try:
            results: list[StreamResult] = await asyncio.gather(
                *[stream_completion(http, srv.url, request(f"Story number {i}:", 3000)) for i in range(4)]
            )
        finally:
            watch.cancel()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    for res in results:
        assert res.status == 200 and res.error is None, res.error
        assert res.final is not None and res.final["tokens_predicted"] == 3000
    log = srv.log_text()
    assert "Context size has been exceeded" not in log
    state = loop.state
    assert state.parks > 0 and state.resumes == state.parks
    registry = loop.metrics.registry

    def failures(action: str, status: str) -> float:
        return registry.get_sample_value("kvctl_action_failures_total", {"action": action, "status": status}) or 0

    # a 409 can only be a race with a request that just finished; a 503 would mean a wrong size estimate
    assert failures("resume", "503") == 0 and failures("park", "503") == 0
    assert state.action_failures <= 1
    # the pool never went above HIGH by more than one poll's growth, and that growth fits the headroom
    assert state.max_pressure >= high, "the test must drive the pool to HIGH, or it shows nothing"
    assert state.max_pressure <= high + state.max_growth
    assert state.max_growth < 1 - high
    async with http.get(srv.url + "/metrics") as resp:
        m = parse_metrics(await resp.text())
    assert m["llamacpp:slot_auto_parks_total"] == 0, "the server's safety net is off: every park is the controller's"
    assert m["llamacpp:slot_parks_total"] == state.parks
    assert m["llamacpp:slots_parked"] == 0 and m["llamacpp:parked_bytes"] == 0

    def parks(mode: str) -> float:
        return sum(
            s.value
            for metric in registry.collect()
            if metric.name == "kvctl_parks"
            for s in metric.samples
            if s.name == "kvctl_parks_total" and s.labels.get("mode") == mode
        )

    assert parks("swap") + parks("recompute") == state.parks
    assert m["llamacpp:slot_recompute_parks_total"] == parks("recompute")
    modes_seen = set().union(*seen.values()) if seen else set()
    if park_ram is None:
        assert parks("recompute") == 0, "every snapshot fits the default budget, and a copy is cheap here"
        assert modes_seen == {"swap"}
    else:
        assert parks("swap") >= 1 and parks("recompute") >= 1
        assert modes_seen == {"swap", "recompute"}


# --- supervisor ----------------------------------------------------------------------------------


def spawn_settings(argv: list[str], port: int, tmp_path: Path, **sup: Any) -> Any:
    return load_settings(
        overrides={
            "upstream": {"url": f"http://127.0.0.1:{port}"},
            "supervisor": {
                "spawn": argv,
                "restart_backoff_initial_s": 0.2,
                "restart_backoff_max_s": 1.0,
                "health_interval_s": 0.1,
                "log_file": str(tmp_path / "spawned.log"),
                **sup,
            },
        }
    )


def spawned_server_argv(binary: Path, model: Path, port: int) -> list[str]:
    return server_argv(binary, model, port, "-c", "2048", "-np", "2", "-kvu", "--slots")


async def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_spawned_server_that_exits_early_is_reported_at_once(tmp_path: Path, llama_server_bin: Path) -> None:
    port = free_port()
    argv = [str(llama_server_bin), "-m", str(tmp_path / "no-such-model.gguf"), "--port", str(port)]
    settings = spawn_settings(argv, port, tmp_path)
    sup = Supervisor(settings, Metrics(CollectorRegistry()))
    task = asyncio.create_task(sup.run(), name="supervisor")
    try:
        await wait_for(lambda: sup.status.last_exit is not None, 30, "the early exit")
        exit_ = sup.status.last_exit
        assert exit_ is not None and exit_.early and exit_.returncode != 0
        assert sup.status.state in (SupervisorState.BACKOFF, SupervisorState.STARTING)
        assert sup.status.ready_since is None
    finally:
        await sup.stop()
        await asyncio.wait_for(task, 30)  # stop() ends run()
    assert sup.status.state is SupervisorState.STOPPED


async def test_a_killed_server_is_restarted_and_the_status_shows_it(
    tmp_path: Path, llama_server_bin: Path, tiny_model: Path
) -> None:
    port = free_port()
    settings = spawn_settings(spawned_server_argv(llama_server_bin, tiny_model, port), port, tmp_path)
    restarts: list[str] = []
    sup = Supervisor(settings, Metrics(CollectorRegistry()), on_start=lambda: restarts.append("start"))
    task = asyncio.create_task(sup.run(), name="supervisor")
    try:
        await wait_for(lambda: sup.status.state is SupervisorState.READY, 120, "the server to be ready")
        first = sup.status.pid
        assert first is not None and sup.status.restarts == 0
        os.killpg(first, signal.SIGKILL)
        await wait_for(lambda: sup.status.restarts == 1, 30, "the restart")
        await wait_for(lambda: sup.status.state is SupervisorState.READY, 120, "the server to be ready again")
        assert sup.status.pid not in (None, first)
        exit_ = sup.status.last_exit
        assert exit_ is not None and exit_.returncode == -signal.SIGKILL and not exit_.early
        assert len(restarts) == 2
        async with UpstreamClient(f"http://127.0.0.1:{port}") as client:
            assert await client.health()
    finally:
        await sup.stop()
        await asyncio.wait_for(task, 30)  # stop() ends run()
    assert sup.status.state is SupervisorState.STOPPED
    pid = sup.status.pid
    assert pid is None or not _alive(pid), "the server must not outlive its supervisor"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_kvctl_run_spawns_reports_and_stops_the_server(
    tmp_path: Path, llama_server_bin: Path, tiny_model: Path
) -> None:
    port, admin = free_port(), f"127.0.0.1:{free_port()}"
    log = (tmp_path / "kvctl.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "controller.cli",
        "run",
        "--upstream",
        f"http://127.0.0.1:{port}",
        "--admin",
        admin,
        "--spawn",
        "--",
        *spawned_server_argv(llama_server_bin, tiny_model, port),
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        status: dict[str, Any] = {}
        for _ in range(600):
            await asyncio.sleep(0.1)
            code, out = await _kvctl("status", "--admin", admin)
            if code == 0:
                status = json.loads(out)
                break
        assert status.get("ready"), (tmp_path / "kvctl.log").read_text()[-3000:]
        assert status["supervisor"]["state"] == "ready" and status["pool"]["n_cells"] == 2048
        server_pid = status["supervisor"]["pid"]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert not _alive(server_pid), "kvctl stops the server it started"
        assert (await _kvctl("status", "--admin", admin))[0] == 3
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        log.close()


async def _kvctl(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "controller.cli", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()
