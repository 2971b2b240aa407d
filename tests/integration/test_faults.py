"""The fault matrix: what kvctl and the patched server do when a part of the stack fails.

Each fault runs on the real patched server, except the two that need a server that misbehaves on
demand (hung, malformed answers): those use a test double. The "Reliability" section of docs/operations.md lists
each fault and what a user sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from controller.loop.control import ControlLoop
from controller.metrics import Metrics
from controller.policy.admission import admission
from controller.policy.plan import decide
from controller.policy.pool import pressure
from controller.policy.types import Decision, PolicyConfig, PolicyInput
from controller.probes.host import HostMemory
from controller.settings import load_settings
from controller.upstream.client import UpstreamClient
from controller.upstream.models import KvSnapshot
from controller.upstream.supervisor import SupervisorState
from testkit.llama import StreamResult, free_port, get_json, parse_metrics, server_argv, stream_completion
from tests.fakes.llama_server import FakeLlamaServer, Reply, kv_body
from tests.harness import ServerFactory, assert_complete, request, running_app
from tests.integration.faults import (
    ROOT,
    KvctlProcess,
    Outcome,
    metrics_text,
    poll_json,
    post_and_read,
    samples,
    wait_until,
)


async def server_metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        return parse_metrics(await resp.text())


async def admin_post(http: aiohttp.ClientSession, admin: str, path: str) -> tuple[int, Any]:
    async with http.post(admin + path) as resp:
        return resp.status, await resp.json()


def generating(n: int, min_decoded: int = 10) -> Any:
    return lambda slots: sum(s["state"] == "generating" and s["n_decoded"] >= min_decoded for s in slots) >= n


# --- kvctl killed with SIGKILL while requests are parked -----------------------------------------


async def test_kvctl_killed_while_requests_are_parked(
    start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Direct clients are resumed by the lapsed lease and complete; proxied streams end at once and the
    server frees their slots and snapshots; a restarted kvctl finds nothing to redo."""
    srv = start_server("-c", "8192", "-np", "4", "-kvu", "--slots", "--metrics", "--park-lease", "3", "--no-auto-park")
    first = KvctlProcess(srv.url, tmp_path / "kvctl-first.log")
    second = KvctlProcess(srv.url, tmp_path / "kvctl-second.log")
    try:
        await first.start(http)
        direct = [
            asyncio.create_task(
                stream_completion(
                    http, srv.url, request(f"Direct client {i}:", 2500), headers={"X-Request-Id": f"direct-{i}"}
                )
            )
            for i in range(2)
        ]
        proxied = [
            asyncio.create_task(stream_completion(http, first.proxy, request(f"Proxied client {i}:", 1000)))
            for i in range(2)
        ]
        slots = await poll_json(http, srv.url + "/slots", generating(4), 30, "four generating slots")
        for s in slots:
            status, body = await admin_post(http, first.admin, f"/slots/{s['id']}/park")
            assert status == 200 and body["pinned"], body
        kv = await get_json(http, srv.url + "/kv")
        assert kv["n_parked"] == 4 and kv["lease"]["held"]
        await asyncio.sleep(1.0)  # pinned, and the running controller holds the lease: they stay parked
        assert (await get_json(http, srv.url + "/kv"))["n_parked"] == 4

        first.kill()
        t_kill = time.monotonic()

        # proxied streams end with kvctl: their connections drop, nobody hangs
        ended = await asyncio.wait_for(asyncio.gather(*proxied, return_exceptions=True), 10)
        for outcome in ended:
            if isinstance(outcome, StreamResult):
                assert outcome.final is None, "a stream cut short must not look complete"
            else:
                assert isinstance(outcome, aiohttp.ClientError), repr(outcome)

        # the server's lease lapses and it resumes the direct clients' requests itself
        await poll_json(
            http,
            srv.url + "/slots",
            lambda slots: (
                all(s["state"] != "parked" for s in slots)
                and all(s["state"] == "generating" for s in slots if s["request_id"] in ("direct-0", "direct-1"))
            ),
            15,
            "the lease to lapse and the server to resume the direct requests",
        )
        assert time.monotonic() - t_kill >= 2.0, "resumed by the lease, which lasts 3 s"
        kv = await get_json(http, srv.url + "/kv")
        assert kv["lease"]["held"] is False

        # a new kvctl, while the resumed requests still run: it must neither resume nor park them again
        resumes_before = (await server_metrics(http, srv.url))["llamacpp:slot_resumes_total"]
        await second.start(http)
        results = await asyncio.wait_for(asyncio.gather(*direct), 60)
        assert_complete(results, 2500)
        for res in results:
            assert res.comments.count("parked") == 1 and res.comments.count("resumed") == 1

        # the proxied requests' slots and snapshots are gone: nothing stranded, nothing leaked
        kv = await poll_json(
            http,
            srv.url + "/kv",
            lambda kv: kv["n_parked"] == 0 and kv["parked_bytes"] == 0 and kv["n_slots_idle"] == 4,
            10,
            "every slot idle and no snapshot left",
        )
        sm = await server_metrics(http, srv.url)
        assert sm["llamacpp:slot_parks_total"] == 4 and sm["llamacpp:slot_auto_parks_total"] == 0
        assert sm["llamacpp:slot_resumes_total"] == resumes_before, "the new kvctl resumed nothing"
        assert 2 <= sm["llamacpp:slot_resumes_total"] <= 4  # proxied ones: cancelled while parked, or after a resume
        assert sm["llamacpp:slot_park_failures_total"] == 0 and sm["llamacpp:slot_resume_failures_total"] == 0
        assert sm["llamacpp:slots_parked"] == 0 and sm["llamacpp:parked_bytes"] == 0

        status = await second.status(http)
        assert status["upstream"]["polls"] > 10
        loop = status["loop"]
        assert (loop["parks"], loop["resumes"], loop["action_failures"], loop["restarts"]) == (0, 0, 0, 0)
        m = await metrics_text(http, second.admin)
        assert samples(m, "kvctl_parks_total") == 0 and samples(m, "kvctl_resumes_total") == 0
        assert samples(m, "kvctl_action_failures_total") == 0
        acted = [e for e in second.events() if e["event"].startswith(("park.", "restore.", "request.cannot_fit"))]
        assert acted == [], acted
        assert_complete([await stream_completion(http, second.proxy, request("After the restart", 20))], 20)
        assert await second.stop() == 0
    finally:
        await first.stop()
        await second.stop()


async def test_a_kvctl_restarted_before_the_lease_lapses_resumes_each_park_once(
    start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Pins live in kvctl's memory: a new kvctl that finds parked requests, with the lease still held,
    resumes each exactly once (the server does not resume them too)."""
    srv = start_server("-c", "4096", "-np", "2", "-kvu", "--slots", "--metrics", "--park-lease", "10", "--no-auto-park")
    first = KvctlProcess(srv.url, tmp_path / "kvctl-first.log")
    second = KvctlProcess(srv.url, tmp_path / "kvctl-second.log")
    killed_at: list[float] = []
    resumed_after: dict[int, float] = {}  # a stream's first token after the kill, seconds after it

    def watch(i: int) -> Callable[[StreamResult], Awaitable[None]]:
        async def on_chunk(_res: StreamResult) -> None:
            if killed_at and i not in resumed_after:
                resumed_after[i] = time.monotonic() - killed_at[0]

        return on_chunk

    try:
        await first.start(http)
        direct = [
            asyncio.create_task(
                stream_completion(http, srv.url, request(f"Parked twice? {i}", 1500), on_chunk=watch(i))
            )
            for i in range(2)
        ]
        slots = await poll_json(http, srv.url + "/slots", generating(2), 30, "two generating slots")
        for s in slots:
            assert (await admin_post(http, first.admin, f"/slots/{s['id']}/park"))[0] == 200
        first.kill()
        killed_at.append(time.monotonic())
        await second.start(http)
        results = await asyncio.wait_for(asyncio.gather(*direct), 30)
        assert_complete(results, 1500)
        # when they resumed, not when they ended: the rest of 1500 tokens takes seconds more on a busy machine
        assert len(resumed_after) == 2 and max(resumed_after.values()) < 8.0, (
            f"resumed by the new kvctl, not by the 10 s lease: {resumed_after}"
        )
        sm = await server_metrics(http, srv.url)
        assert sm["llamacpp:slot_parks_total"] == 2 and sm["llamacpp:slot_resumes_total"] == 2
        assert sm["llamacpp:slot_resume_failures_total"] == 0
        m = await metrics_text(http, second.admin)
        assert samples(m, "kvctl_resumes_total") == 2 and samples(m, "kvctl_action_failures_total") == 0
        restored = [e for e in second.events() if e["event"] == "restore.done"]
        assert sorted(e["slot"] for e in restored) == sorted(s["id"] for s in slots)
    finally:
        await first.stop()
        await second.stop()


# --- an exception inside the control loop ---------------------------------------------------------


async def test_an_exception_in_the_control_loop_restarts_it_and_streams_continue(
    start_server: ServerFactory, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = start_server("-c", "8192", "-np", "4", "-kvu", "--slots", "--metrics")
    real = decide
    crashed: list[float] = []

    def flaky(inp: PolicyInput, cfg: PolicyConfig) -> Decision:
        # once, in the middle of the pressure, when the decisions matter
        if not crashed and pressure(inp.kv).value >= 0.5:
            crashed.append(time.monotonic())
            raise RuntimeError("injected: the policy failed")
        return real(inp, cfg)

    monkeypatch.setattr("controller.loop.control.decide", flaky)
    with capture_logs() as logs:
        async with running_app(srv.url, loop={"restart_delay_s": 0.3}) as (app, url, admin):
            results = await asyncio.gather(
                *[stream_completion(http, url, request(f"Story number {i}:", 3000)) for i in range(4)]
            )
            assert_complete(results, 3000)
            assert crashed, "the pool must reach the pressure that triggers the fault"
            async with http.get(admin + "/status") as resp:
                status = await resp.json()
            assert status["loop"]["restarts"] == 1 and status["loop"]["alive"]
            m = await metrics_text(http, admin)
            assert samples(m, "kvctl_loop_restarts_total") == 1
            async with http.get(admin + "/healthz") as resp:
                assert resp.status == 200
            assert app.loop.state.polls > 20
    crashes = [e for e in logs if e["event"] == "loop.crashed"]
    assert len(crashes) == 1 and crashes[0]["log_level"] == "error" and crashes[0]["exc_info"]
    assert "Context size has been exceeded" not in srv.log_text()


# --- the server killed mid-stream (spawn mode) -----------------------------------------------------


def spawned_server_argv(binary: Path, model: Path, port: int) -> list[str]:
    return server_argv(binary, model, port, "-c", "8192", "-np", "4", "-kvu", "--slots", "--metrics")


def chat(n: int, stream: bool) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": n,
        "stream": stream,
        "ignore_eos": True,
    }


def assert_well_formed_failure(out: Outcome, stream: bool) -> None:
    """An error event at the end of a stream, or a 5xx with kvctl's envelope and Retry-After."""
    assert out.exception is None, f"the client saw a broken connection, not an error: {out.exception!r}"
    if stream and out.status == 200:
        err = out.error_event
        assert err is not None and err["kvctl_code"] == "upstream_disconnected", out.events[-3:]
        assert err["message"].startswith("kvctl:")
        return
    assert out.status is not None and out.status >= 500, (out.status, out.body)
    assert out.headers.get("X-Kvctl-Error") == out.body["error"]["kvctl_code"] and "Retry-After" in out.headers
    assert out.body["error"]["message"].startswith("kvctl:") and out.body["error"]["type"]


async def kvctl_status_cli(admin: str) -> tuple[int, Any]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "controller.cli",
        "status",
        "--json",
        "--admin",
        admin.removeprefix("http://"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert out, err.decode()
    return proc.returncode or 0, json.loads(out)


async def test_without_replay_the_server_killed_mid_stream_is_restarted_and_every_client_gets_an_error(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """proxy.replay_limit 0 (tests/integration/test_replay.py has the default, where the streams go on)."""
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    supervisor = {
        "spawn": spawned_server_argv(llama_server_bin, tiny_model, port),
        "restart_backoff_initial_s": 0.5,
        "restart_backoff_max_s": 4.0,
        "health_interval_s": 0.1,
        "log_file": str(tmp_path / "spawned.log"),
    }
    with capture_logs() as logs:
        async with running_app(upstream, supervisor=supervisor, proxy={"replay_limit": 0}) as (app, url, admin):
            sup = app.supervisor
            assert sup is not None

            def ready() -> bool:
                assert sup is not None
                return sup.status.state is SupervisorState.READY and app.loop.state.upstream_up

            await wait_until(ready, 120, "the spawned server to be ready")
            clients = {
                "completion stream": (url + "/completion", {**request("A", 6000), "stream": True}, True),
                "chat stream": (url + "/v1/chat/completions", chat(6000, True), True),
                "completion": (url + "/completion", {**request("B", 6000), "stream": False}, False),
                "chat": (url + "/v1/chat/completions", chat(6000, False), False),
            }
            tasks = {
                name: asyncio.create_task(post_and_read(http, u, payload)) for name, (u, payload, _) in clients.items()
            }
            slots = await poll_json(http, upstream + "/slots", generating(4), 30, "four generating slots")
            status, body = await admin_post(http, admin, f"/slots/{slots[0]['id']}/park")
            assert status == 200 and body["pinned"]
            assert any(h.pinned for h in app.loop.state.history.values())

            first_pid = sup.status.pid
            assert first_pid is not None
            os.killpg(first_pid, signal.SIGKILL)
            outcomes = dict(zip(tasks, await asyncio.wait_for(asyncio.gather(*tasks.values()), 15), strict=True))
            for name, out in outcomes.items():
                assert_well_formed_failure(out, clients[name][2])

            # while it is down, a new request waits for it (proxy.replay_timeout_s) and is answered by the new server
            out = await asyncio.wait_for(post_and_read(http, url + "/completion", request("Down", 8)), 60)
            assert out.status == 200 and out.body["tokens_predicted"] == 8, (out.status, out.body)

            await wait_until(lambda: sup.status.restarts == 1 and ready(), 60, "the restart")
            assert sup.status.pid != first_pid
            # the snapshot and the pin died with the server, and the controller forgot them
            assert app.loop.state.history == {}
            code, st = await kvctl_status_cli(admin)
            assert st["supervisor"]["restarts"] == 1 and st["supervisor"]["last_exit"]["returncode"] == -signal.SIGKILL
            assert st["pool"]["n_parked"] == 0 and not any(s["pinned"] for s in st["slots"])
            m = await metrics_text(http, admin)
            assert samples(m, "kvctl_upstream_restarts_total") == 1 and samples(m, "kvctl_pinned_requests") == 0

            # a crash loop backs off: the second restart waits twice as long as the first
            second_pid = sup.status.pid
            assert second_pid is not None
            os.killpg(second_pid, signal.SIGKILL)
            await wait_until(lambda: sup.status.restarts == 2 and ready(), 60, "the second restart")
            res = await stream_completion(http, url, request("After the crash", 50))
            assert_complete([res], 50)
            assert code in (0, 1)
    delays = [e["in_s"] for e in logs if e["event"] == "supervisor.restart_scheduled"]
    assert delays[:2] == [0.5, 1.0], delays
    assert sum(1 for e in logs if e["event"] == "loop.forget") >= 2


async def test_a_real_server_that_cannot_load_its_model_ends_in_failed_in_its_own_words(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The issue-32 crash loop, with the real server: ``kvctl run --spawn`` on a model file cut short. kvctl stops
    after supervisor.failed_after early deaths, shows the server's own last lines (relayed to kvctl's output too,
    no log file), an OpenAI client gets server_failed at once; with exit_on_failed kvctl exits 3."""
    from openai import APIStatusError, AsyncOpenAI

    broken = tmp_path / "cut-short.gguf"
    with tiny_model.open("rb") as whole, broken.open("wb") as cut:
        cut.write(whole.read(64 * 1024))
    port, pport, aport = free_port(), free_port(), free_port()
    argv = [sys.executable, "-m", "controller.cli", "run", "--upstream", f"http://127.0.0.1:{port}"]
    argv += ["--listen", f"127.0.0.1:{pport}", "--admin", f"127.0.0.1:{aport}"]
    argv += ["--spawn", "--", *server_argv(llama_server_bin, broken, port)]
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")},
        "KVCTL_SUPERVISOR__FAILED_AFTER": "2",
        "KVCTL_SUPERVISOR__RESTART_BACKOFF_INITIAL_S": "0.1",
        "KVCTL_LOG__FORMAT": "json",
    }
    out_path = tmp_path / "kvctl.out"
    with out_path.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env, cwd=ROOT
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.returncode is None and time.monotonic() < deadline, out_path.read_text(errors="replace")
            with contextlib.suppress(aiohttp.ClientError):
                status = await get_json(http, f"http://127.0.0.1:{aport}/status")
                if status["upstream"]["state"] == "failed":
                    break
            await asyncio.sleep(0.1)
        sup = status["supervisor"]
        assert sup["state"] == "failed" and sup["early_exits"] == 2 and sup["pid"] is None, sup
        last = sup["last_exit"]
        assert last["early"] and last["returncode"] != 0 and last["signal"] is None, last
        # llama.cpp's own words about the file, not a guess of kvctl's
        assert any("failed to load model" in line for line in last["log_tail"]), last["log_tail"]
        assert sup["failure"].startswith("llama-server failed to start 2 times in a row (last exit: exit code")

        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{pport}/v1", api_key="unused", max_retries=0)
        t0 = time.monotonic()
        with pytest.raises(APIStatusError) as err:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert time.monotonic() - t0 < 2, "answered at once, not after a timeout"
        assert err.value.status_code == 503 and err.value.response.headers["X-Kvctl-Error"] == "server_failed"
        body = err.value.body
        assert isinstance(body, dict) and body["kvctl_code"] == "server_failed", body
        await client.close()

        code, st = await kvctl_status_cli(f"http://127.0.0.1:{aport}")
        assert code != 0 and st["supervisor"]["state"] == "failed"
        text = out_path.read_text(errors="replace")
        assert "failed to load model" in text, "the server's output still reaches kvctl's"
        assert '"event": "supervisor.failed"' in text
    finally:
        if proc.returncode is None:
            proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 15) == 0, "kvctl stops cleanly from failed"

    env["KVCTL_SUPERVISOR__EXIT_ON_FAILED"] = "true"
    done = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, env=env, cwd=ROOT
    )
    assert await asyncio.wait_for(done.wait(), 60) == 3


# --- host RAM short ---------------------------------------------------------------------------------


async def test_host_ram_short_kvctl_parks_by_recompute_and_every_request_completes(
    start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server("-c", "8192", "-np", "4", "-kvu", "--slots", "--metrics", "--no-auto-park")  # kvctl alone
    with capture_logs() as logs:
        # a reserve larger than any host's RAM: no snapshot fits in what is left, so no swap
        async with running_app(srv.url, policy={"host_ram_reserve_mib": 1 << 30}) as (app, url, admin):
            results = await asyncio.gather(
                *[stream_completion(http, url, request(f"Story number {i}:", 3000)) for i in range(4)]
            )
            assert_complete(results, 3000)
            assert app.loop.state.parks > 0 and app.loop.state.loop_restarts == 0
            m = await metrics_text(http, admin)
            assert samples(m, "kvctl_parks_total") == app.loop.state.parks
            # every mode's series exists from the start (at 0): the swap ones stay there
            assert samples(m, "kvctl_parks_total", mode="swap") == 0
            assert samples(m, "kvctl_parks_total", mode="recompute") == app.loop.state.parks
            async with http.get(admin + "/healthz") as resp:
                assert resp.status == 200
    done = [e for e in logs if e["event"] == "park.done"]
    assert done and all(e["mode"] == "recompute" and e["mode_reason"] == "host_ram" for e in done)
    assert not [e for e in logs if e["event"] == "park.blocked"], "no victim is passed over for memory"
    sm = await server_metrics(http, srv.url)
    assert sm["llamacpp:slot_recompute_parks_total"] == sm["llamacpp:slot_parks_total"] == app.loop.state.parks
    assert sm["llamacpp:slots_parked"] == 0 and sm["llamacpp:parked_bytes"] == 0
    assert "Context size has been exceeded" not in srv.log_text()


# --- the server hung (a test double) ----------------------------------------------------------------


async def test_a_hung_server_polls_time_out_kvctl_backs_off_and_the_proxy_holds_requests() -> None:
    fake = FakeLlamaServer()
    fake.kv = kv_body(1000, [{}, {}])
    hung = asyncio.Event()
    release = asyncio.Event()

    @web.middleware
    async def hang(request: web.Request, handler: Any) -> web.StreamResponse:
        if hung.is_set():
            await release.wait()  # accepted, read, never answered
        return await handler(request)  # type: ignore[no-any-return]

    fake_app = fake.app()
    fake_app.middlewares.append(hang)
    server = TestServer(fake_app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            async with running_app(
                str(server.make_url("")).rstrip("/"),
                upstream={"timeout_s": 0.3},
                loop={"backoff_initial_s": 0.1, "backoff_max_s": 0.8},
                proxy={"replay_timeout_s": 1.5},
            ) as (app, url, admin):
                await wait_until(lambda: app.loop.state.upstream_up, 5, "the first poll")
                hung.set()
                seen: set[float] = set()

                def at_max() -> bool:
                    if app.loop.state.backoff_s is not None:
                        seen.add(round(app.loop.state.backoff_s, 3))
                    return app.loop.state.backoff_s == pytest.approx(0.8)

                await wait_until(at_max, 10, "the back-off to reach its maximum", interval_s=0.02)
                assert seen <= {0.1, 0.2, 0.4, 0.8} and len(seen) >= 3, seen
                async with http.get(admin + "/status") as resp:
                    status = await resp.json()
                assert status["upstream"]["up"] is False and status["upstream"]["backoff_s"] == pytest.approx(0.8)
                assert "TimeoutError" in status["upstream"]["last_error"]
                m = await metrics_text(http, admin)
                assert samples(m, "kvctl_poll_errors_total", kind="UpstreamUnavailable") >= 3
                assert samples(m, "kvctl_upstream_up") == 0

                # it answered before: it is expected back, so a request waits for it, replay_timeout_s at most
                t0 = time.monotonic()
                out = await post_and_read(http, url + "/v1/chat/completions", chat(8, stream=False))
                assert 1.4 <= time.monotonic() - t0 < 3.0, "held for proxy.replay_timeout_s, then answered"
                assert out.status == 503 and out.headers["Retry-After"] == "2"
                assert out.body["error"]["kvctl_code"] == "server_restarting"
                assert "127.0.0.1" not in json.dumps(out.body) and "Error" not in json.dumps(out.body)
                held = asyncio.ensure_future(post_and_read(http, url + "/v1/chat/completions", chat(8, stream=False)))
                async with http.post(admin + "/slots/0/park") as resp:
                    assert resp.status == 503 and "Retry-After" in resp.headers
                async with http.get(admin + "/healthz") as resp:
                    assert resp.status == 200, "the process and its loop are fine"
                async with http.get(admin + "/readyz") as resp:
                    assert resp.status == 503

                assert not held.done()
                hung.clear()
                release.set()
                await wait_until(lambda: app.loop.state.upstream_up, 5, "recovery")
                await wait_until(lambda: app.loop.state.backoff_s is None, 2, "the back-off to end")
                assert app.gate.refuse_reason is None and app.gate.down_since is None
                out = await asyncio.wait_for(held, 5)
                assert out.status == 404, "sent once the server answered (this fake has no chat route)"
                assert app.loop.state.loop_restarts == 0
    finally:
        release.set()
        await server.close()


# --- malformed or unexpected JSON from the server (a test double) ---------------------------------


GARBAGE_KV = [
    Reply(body=b"not json"),
    Reply(body=b"<html><body>502 Bad Gateway</body></html>", headers={"Content-Type": "text/html"}),
    Reply(body=b'{"n_cells": 1000, "n_cells_used": '),  # truncated
    Reply(body=None),  # null
    Reply(body=[1, 2, 3]),
    Reply(body={"n_cells": "many"}),
    Reply(body={**kv_body(1000, [{}]), "slots": [{"id": "zero", "state": "idle"}]}),
    Reply(body={**kv_body(1000, [{}]), "slots": [{**kv_body(1000, [{}])["slots"][0], "state": "exploded"}]}),
    Reply(body=b'{"n_cells": 1e999}'),
    Reply(status=500, body=b"<html>Internal Server Error</html>"),
    Reply(status=404, body=b"File Not Found"),  # an unpatched llama-server has no /kv
    Reply(status=200, body=b"\xff\xfe\x00garbage"),
]


async def test_malformed_answers_are_reported_and_survived() -> None:
    fake = FakeLlamaServer()
    fake.kv = kv_body(1000, [{}, {}])
    server = TestServer(fake.app())
    await server.start_server()
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
            with capture_logs() as logs:
                async with running_app(
                    str(server.make_url("")).rstrip("/"),
                    upstream={"timeout_s": 0.5},
                    loop={"poll_interval_s": 0.02, "backoff_initial_s": 0.02, "backoff_max_s": 0.1},
                ) as (app, _url, admin):
                    await wait_until(lambda: app.loop.state.upstream_up, 5, "the first poll")
                    fake.queue("GET /kv", *GARBAGE_KV)
                    await wait_until(lambda: not fake.queued["GET /kv"], 10, "every malformed answer to be read")
                    await wait_until(lambda: app.loop.state.upstream_up, 5, "recovery once the answers are good")

                    # a malformed answer to a park: counted, logged, and the loop carries on
                    fake.kv = kv_body(
                        1000,
                        [
                            {"state": "generating", "n_cells": 600, "id_task": 1, "t_arrival_ms": 1},
                            {"state": "generating", "n_cells": 380, "id_task": 2, "t_arrival_ms": 2},
                        ],
                    )
                    fake.queue("POST park", Reply(body=b"{]"), Reply(body={"id_slot": 1}))
                    await wait_until(lambda: app.loop.state.action_failures >= 2, 5, "the failed parks")
                    fake.kv = kv_body(1000, [{}, {}])
                    polls = app.loop.state.polls
                    await wait_until(lambda: app.loop.state.polls > polls + 5, 5, "more polls")

                    m = await metrics_text(http, admin)
                    async with http.get(admin + "/healthz") as resp:
                        assert resp.status == 200
                    async with http.get(admin + "/status") as resp:
                        status = await resp.json()
                    assert status["upstream"]["up"] and app.gate.refuse_reason is None
    finally:
        await server.close()
    assert app.loop.state.loop_restarts == 0, "a malformed answer is an upstream error, not a crash"
    errors = samples(m, "kvctl_poll_errors_total", kind="UpstreamProtocolError")
    errors += samples(m, "kvctl_poll_errors_total", kind="UpstreamApiError")
    assert errors == len(GARBAGE_KV), "each malformed answer is counted"
    assert samples(m, "kvctl_action_failures_total", action="park") == 2
    down = [e for e in logs if e["event"] == "upstream.down"]
    assert down and any("is this the patched llama-server?" in e["error"] for e in down)
    assert [e for e in logs if e["event"] == "park.failed"], "the failed parks are logged"
    assert not [e for e in logs if e["event"] == "loop.crashed"]


# unexpected but well-typed /kv answers (numbers out of range, contradictions): the policy and the
# status never raise on them, so the loop never restarts for what the server says

INTS = st.one_of(st.integers(-3, 5000), st.integers(-(2**63), 2**63))
MAYBE = st.one_of(st.none(), INTS)
POOL = st.fixed_dictionaries(
    {
        "n_cells": INTS,
        "n_cells_used": INTS,
        "n_cells_free": INTS,
        "used_ratio": st.floats(-1e9, 1e9),
        "source": st.sampled_from(["exact", "estimate", ""]),
    }
)
SLOT = st.fixed_dictionaries(
    {
        "id": INTS,
        "id_task": MAYBE,
        "state": st.sampled_from(["idle", "prompt", "generating", "parked"]),
        "n_cells": INTS,
        "n_prompt": INTS,
        "t_arrival_ms": MAYBE,
        "n_decoded": INTS,
        "n_draft_max": INTS,
        "request_id": st.one_of(st.none(), st.text(max_size=4)),
        "park": st.fixed_dictionaries(
            {
                "count": INTS,
                "bytes": INTS,
                "n_cells": MAYBE,
                "t_parked_total_ms": st.floats(-1e9, 1e12),
                "parked_since_ms": MAYBE,
                "auto": st.booleans(),
            }
        ),
    }
)
KV = st.fixed_dictionaries(
    {
        "n_cells": INTS,
        "n_cells_used": INTS,
        "n_cells_free": INTS,
        "used_ratio": st.floats(-1e9, 1e9),
        "source": st.just("exact"),
        "draft": st.one_of(st.none(), POOL),
        "bytes_per_cell": INTS,
        "next_step": st.fixed_dictionaries(
            {"n_gen": INTS, "n_draft_max": INTS, "n_prompt_max": INTS, "n_total_max": INTS}
        ),
        "n_slots": INTS,
        "n_slots_idle": INTS,
        "n_parked": INTS,
        "parked_bytes": INTS,
        "park_ram_budget_bytes": MAYBE,
        "lease": st.one_of(
            st.none(),
            st.fixed_dictionaries({"held": st.booleans(), "ttl_s": st.floats(-10, 1e6), "age_ms": st.floats(0, 1e9)}),
        ),
        "slots": st.lists(SLOT, max_size=6),
    }
)


@settings(max_examples=300, deadline=None)
@given(body=KV, host=MAYBE, gpu=MAYBE, now_ms=INTS)
def test_unexpected_but_well_typed_kv_answers_never_crash_the_loop(
    body: dict[str, Any], host: int | None, gpu: int | None, now_ms: int
) -> None:
    kv = KvSnapshot.model_validate(body)
    # what the loop does with an answer, short of acting on it: record it, decide, record the decision
    loop = ControlLoop(
        UpstreamClient("http://127.0.0.1:1"),
        load_settings(),
        Metrics(CollectorRegistry()),
        host=lambda: HostMemory(available_bytes=host if host is not None else 2**40, total_bytes=2**40),
        clock_ms=lambda: now_ms,
    )
    loop.poller._up(kv)
    inp = loop._input(kv)
    inp = PolicyInput(kv=inp.kv, now_ms=inp.now_ms, history=inp.history, host_available_bytes=host, gpu_free_bytes=gpu)
    decision = decide(inp, loop.config)
    ids = {s.id for s in kv.slots}
    assert all(a.slot in ids for a in decision.actions)
    loop.recorder.decision(kv, decision, 0.0)
    admission(inp, loop.config, 512)
    loop.admission(512)
    loop.poller.max_backoff()
