"""The supervisor's state machine against a fake child (a small Python server scripted by mode, or a one-line
command that dies), on short timings; giving up (failed) as kvctl reports it: /status, the exit code of kvctl run,
and the proxy's answers.

The real server under the supervisor is tested in tests/integration/test_controller.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from controller.admin.models import Status
from controller.app import EXIT_SERVER_FAILED, App
from controller.cli.render import render_status
from controller.errors import ERROR_HEADER
from controller.metrics import Metrics
from controller.proxy.admission import AdmissionGate
from controller.proxy.app import PROXY_KEY, make_proxy_app
from controller.proxy.config import ProxyConfig
from controller.settings import Settings, load_settings
from controller.upstream.server_log import LINE_MAX_CHARS, Tail
from controller.upstream.supervisor import Supervisor, SupervisorState
from testkit.llama import free_port

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import http.server, os, subprocess, sys, threading, time
mode, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]  # then --sse-ping-interval N, ignored
if mode == "crash":
    sys.exit(3)
if mode == "alternate":  # odd starts die before they are ready, even ones are ready, then exit
    n = int(open(out).read()) + 1 if os.path.exists(out) else 1
    open(out, "w").write(str(n))
    if n % 2:
        sys.exit(5)
    mode = "ready_then_exit:0.1"
if mode == "grandchild":  # starts a helper in its process group, then exits
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(out, "w").write(str(g.pid))
    sys.exit(0)
if mode == "silent":  # never ready
    open(out, "w").write("started")
    time.sleep(60)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
srv = http.server.HTTPServer(("127.0.0.1", port), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
if mode.startswith("ready_then_exit:"):
    time.sleep(float(mode.split(":")[1]))
    sys.exit(4)
time.sleep(60)
"""


def child_settings(tmp_path: Path, mode: str, **supervisor: Any) -> Settings:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    return spawn_settings([sys.executable, str(script), mode, "{port}", str(tmp_path / "out")], **supervisor)


def spawn_settings(argv: list[str], **supervisor: Any) -> Settings:
    """``{port}`` in argv: the free port the server's URL names (nothing listens there unless the child does)."""
    port = free_port()
    timings = {
        "restart_backoff_initial_s": 0.05,
        "restart_backoff_max_s": 0.2,
        "stable_after_s": 0.5,
        "ready_timeout_s": 2.0,
        "health_interval_s": 0.05,
        "stop_timeout_s": 1.0,
        **supervisor,
    }
    return load_settings(
        overrides={
            "supervisor": {"spawn": [a.replace("{port}", str(port)) for a in argv], **timings},
            "upstream": {"url": f"http://127.0.0.1:{port}", "timeout_s": 0.3},
        }
    )


@contextlib.asynccontextmanager
async def supervising(settings: Settings, metrics: Metrics | None = None) -> AsyncIterator[Supervisor]:
    sup = Supervisor(settings, metrics or Metrics(CollectorRegistry()))
    task = asyncio.create_task(sup.run())
    try:
        yield sup
    finally:
        await sup.stop()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def dead(pid: int) -> bool:
    """Gone, or a zombie nobody reaped yet (a container's PID 1 may not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def backoff_delays(sup: Supervisor, n: int) -> list[float]:
    """The restart delay of each of the first n exits (keyed by the start it follows)."""
    delays: dict[int, float] = {}

    def seen() -> bool:
        d = sup.status.next_start_in_s
        if d is not None:
            delays.setdefault(sup.status.starts, d)
        return len(delays) >= n

    await until(seen)
    return [delays[k] for k in sorted(delays)][:n]


async def test_a_crash_loop_backs_off_doubling_up_to_the_ceiling(tmp_path: Path) -> None:
    async with supervising(child_settings(tmp_path, "crash", failed_after=0)) as sup:
        delays = await backoff_delays(sup, 5)
        last = sup.status.last_exit
        assert last is not None and last.returncode == 3 and last.early
    assert delays == [0.05, 0.1, 0.2, 0.2, 0.2]


async def test_a_server_that_stayed_up_long_enough_restarts_after_the_initial_delay(tmp_path: Path) -> None:
    async with supervising(child_settings(tmp_path, "ready_then_exit:0.6")) as sup:
        delays = await backoff_delays(sup, 3)
        last = sup.status.last_exit
        assert last is not None and last.returncode == 4 and not last.early
    assert delays == [0.05, 0.05, 0.05], "each run was ready for longer than stable_after_s"


async def test_a_server_never_ready_is_stopped_at_the_ready_timeout(tmp_path: Path) -> None:
    async with supervising(child_settings(tmp_path, "silent", ready_timeout_s=0.5)) as sup:
        await until(lambda: sup.status.last_exit is not None)
        last = sup.status.last_exit
        assert last is not None and last.early and last.returncode == -signal.SIGTERM
        assert 0.5 <= last.uptime_s < 3
        assert sup.status.state in (SupervisorState.BACKOFF, SupervisorState.STARTING)


async def test_what_the_server_started_goes_with_it(tmp_path: Path) -> None:
    out = tmp_path / "out"
    async with supervising(child_settings(tmp_path, "grandchild")) as sup:
        await until(lambda: sup.status.last_exit is not None and out.exists() and out.read_text())
        grandchild = int(out.read_text())
        await until(lambda: dead(grandchild), timeout_s=5)


def test_the_server_dies_with_kvctl_even_by_kill_9(tmp_path: Path) -> None:
    settings = child_settings(tmp_path, "silent", ready_timeout_s=60)
    program = f"""
import asyncio, sys
sys.path.insert(0, {str(ROOT)!r})
from prometheus_client import CollectorRegistry
from controller.metrics import Metrics
from controller.settings import load_settings
from controller.upstream.supervisor import Supervisor
settings = load_settings(overrides={settings.model_dump(mode="json", include={"supervisor", "upstream"})!r})
async def main():
    sup = Supervisor(settings, Metrics(CollectorRegistry()))
    task = asyncio.create_task(sup.run())
    while sup.status.pid is None:
        await asyncio.sleep(0.01)
    print("PID", sup.status.pid, flush=True)
    await task
asyncio.run(main())
"""
    kvctl = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        assert kvctl.stdout is not None
        line = ""
        while not line.startswith("PID "):  # structlog's default output comes on stdout too
            line = kvctl.stdout.readline()
            assert line, "kvctl ended before it started the server"
        pid = int(line.split()[1])
        out = tmp_path / "out"
        deadline = time.monotonic() + 10
        while not (out.exists() and out.read_text()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not dead(pid)
        kvctl.kill()  # SIGKILL: no cleanup runs in kvctl
        kvctl.wait()
        deadline = time.monotonic() + 5
        while not dead(pid):
            assert time.monotonic() < deadline, "the spawned server outlived kvctl"
            time.sleep(0.01)
    finally:
        kvctl.kill()
        kvctl.wait()
        if kvctl.stdout is not None:
            kvctl.stdout.close()


# --- giving up: failed ---------------------------------------------------------------------------------

BOOM = "import sys; print('loading the model'); print('boom', file=sys.stderr); sys.exit(7)"
# no core file: a crash test must not fill the disk or wait for a crash reporter
SEGV = (
    "import os, resource, signal, sys; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
    "print('loading the model', flush=True); print('ggml: bad tensor', file=sys.stderr, flush=True); "
    "os.kill(os.getpid(), signal.SIGSEGV)"
)


async def test_starts_that_die_before_ready_end_in_failed_with_the_exit_and_the_tail(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    settings = spawn_settings([sys.executable, "-c", BOOM], failed_after=3)
    with capture_logs() as logs:
        async with supervising(settings, Metrics(registry)) as sup:
            await until(lambda: sup.status.state is SupervisorState.FAILED)
            assert sup.failed.is_set() and sup.status.starts == 3 and sup.status.early_exits == 3
            await asyncio.sleep(0.5)  # past twice the longest restart delay (0.2 s)
            assert sup.status.state is SupervisorState.FAILED and sup.status.starts == 3, "no start after failed"
            last = sup.status.last_exit
            assert last is not None and last.early and last.returncode == 7 and last.signal is None
            # stdout and stderr (copied to kvctl's own, since no log file is set) are both in the tail; two pipes,
            # so in the order kvctl read them
            assert sorted(last.log_tail) == ["boom", "loading the model"]
            assert sup.status.pid is None and sup.status.next_start_in_s is None
            assert registry.get_sample_value("kvctl_upstream_failed") == 1
            failure = sup.status.failure
    assert failure is not None and "failed to start 3 times in a row" in failure and "exit code 7" in failure
    failed = [e for e in logs if e["event"] == "supervisor.failed"]
    assert len(failed) == 1
    assert failed[0]["early_exits"] == 3 and failed[0]["returncode"] == 7 and failed[0]["signal"] is None
    assert sorted(failed[0]["log_tail"]) == ["boom", "loading the model"] and failed[0]["log_level"] == "error"


async def test_a_signal_is_named_and_the_tail_comes_from_the_log_file(tmp_path: Path) -> None:
    log_file = tmp_path / "server.log"
    log_file.write_text("a line from an earlier run\n")
    settings = spawn_settings([sys.executable, "-c", SEGV], failed_after=2, log_file=str(log_file))
    with capture_logs() as logs:
        async with supervising(settings) as sup:
            await until(lambda: sup.status.state is SupervisorState.FAILED)
            last = sup.status.last_exit
            assert last is not None and last.returncode == -signal.SIGSEGV and last.signal == "SIGSEGV"
            assert last.log_tail == ("loading the model", "ggml: bad tensor"), "this run's lines only"
            assert sup.status.failure is not None and "killed by SIGSEGV" in sup.status.failure
    # the file is the server's as before: every run appended to it
    assert log_file.read_text().count("ggml: bad tensor") == 2
    assert log_file.read_text().startswith("a line from an earlier run\n")
    early = [e for e in logs if e["event"] == "supervisor.exited_early"]
    assert len(early) == 2 and all(e["signal"] == "SIGSEGV" for e in early)


async def test_a_server_that_was_ready_resets_the_count(tmp_path: Path) -> None:
    async with supervising(child_settings(tmp_path, "alternate", failed_after=2)) as sup:
        await until(lambda: sup.status.starts >= 5)
        assert sup.status.state is not SupervisorState.FAILED and not sup.failed.is_set()
        assert sup.status.early_exits <= 1
    assert sup.status.failure is None


async def test_a_command_that_cannot_start_fails_with_kvctl_s_error(tmp_path: Path) -> None:
    async with supervising(spawn_settings([str(tmp_path / "no-such-server")], failed_after=2)) as sup:
        await until(lambda: sup.status.state is SupervisorState.FAILED)
        last = sup.status.last_exit
        assert last is not None and last.returncode == 127
        assert len(last.log_tail) == 1 and "cannot start" in last.log_tail[0] and "No such file" in last.log_tail[0]


def test_the_tail_keeps_the_last_lines_of_each_stream_cut_and_without_escapes() -> None:
    tail = Tail(lines=3)
    tail.feed(b"one\ntw", 0)
    tail.feed(b"err", 1)  # another stream's partial line does not join this one
    tail.feed(b"o\n\x1b[31mred\x1b[0m\r\n" + b"x" * 2000 + b"\n", 0)
    tail.feed(b"or: out of memory", 1)
    assert tail.lines() == ["red", "x" * (LINE_MAX_CHARS - 1) + "\u2026", "error: out of memory"]


# --- giving up, as kvctl reports it ---------------------------------------------------------------------


def app_settings(argv: list[str], **supervisor: Any) -> Settings:
    base = spawn_settings(argv, **supervisor)
    return load_settings(
        overrides={
            "supervisor": base.supervisor.model_dump(mode="json"),
            "upstream": {"url": str(base.upstream.url), "timeout_s": 0.3},
            "proxy": {"listen": f"127.0.0.1:{free_port()}"},
            "admin": {"listen": "127.0.0.1:0"},
            "loop": {"poll_interval_s": 0.01, "backoff_initial_s": 0.01, "backoff_max_s": 0.05},
        }
    )


async def test_exit_on_failed_ends_kvctl_run_with_its_code() -> None:
    settings = app_settings([sys.executable, "-c", BOOM], failed_after=2, exit_on_failed=True)
    with capture_logs() as logs:
        code = await asyncio.wait_for(App(settings).run(asyncio.Event()), 10)
    assert code == EXIT_SERVER_FAILED == 3
    assert any(e["event"] == "kvctl.server_failed" for e in logs)


async def test_failed_shows_in_the_status_and_new_requests_get_it_at_once(tmp_path: Path) -> None:
    app = App(app_settings([sys.executable, "-c", SEGV], failed_after=2, log_file=str(tmp_path / "server.log")))
    stop = asyncio.Event()
    task = asyncio.create_task(app.run(stop))
    try:
        await asyncio.wait_for(app.started.wait(), 5)
        assert app.supervisor is not None and app.proxy is not None
        await asyncio.wait_for(app.supervisor.failed.wait(), 5)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{app.admin_addresses[0]}/status") as r:
                status = Status.model_validate_json(await r.read())
            body = {"messages": [{"role": "user", "content": "hi"}]}
            t0 = time.monotonic()
            async with s.post(f"http://{app.settings.proxy.listen}/v1/chat/completions", json=body) as r:
                assert r.status == 503 and time.monotonic() - t0 < 1
                assert r.headers[ERROR_HEADER] == "server_failed" and "Retry-After" not in r.headers
                error = (await r.json())["error"]
        assert error["kvctl_code"] == "server_failed" and error["type"] == "unavailable_error"
        assert error["message"].startswith("kvctl: llama-server failed to start 2 times in a row (last exit: killed")
        sup = status.supervisor
        assert sup is not None and sup.state == "failed" and status.upstream.state == "failed" and status.degraded
        assert sup.early_exits == 2 and sup.failed_after == 2 and sup.pid is None
        assert sup.last_exit is not None and sup.last_exit.signal == "SIGSEGV"
        assert sup.last_exit.log_tail == ["loading the model", "ggml: bad tensor"]
        failure = "supervised server failed: llama-server failed to start 2 times in a row"
        assert any(p.startswith(failure) for p in status.problems)
        text = render_status(status)
        assert "supervised: failed, 1 restart, 2 of 2 early exits" in text
        assert "last exit   killed by SIGSEGV after" in text and ", before it was ready" in text
        assert "server log  loading the model\n            ggml: bad tensor" in text
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 10) == 0


class Dying:
    """A server that took a request and died before it answered; its /health says it is loading (a restart that
    never comes up)."""

    def __init__(self) -> None:
        self.took = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        return app

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.took.set()
        assert request.transport is not None
        request.transport.close()  # no answer: the client sees the connection end
        return web.Response()

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"error": {"code": 503, "message": "Loading model"}}, status=503)


async def test_requests_waiting_for_the_server_end_at_once_when_it_failed() -> None:
    dying = Dying()
    upstream = TestServer(dying.app())
    await upstream.start_server()
    gate = AdmissionGate()
    config = ProxyConfig(upstream=str(upstream.make_url("")).rstrip("/"), heartbeat_s=0.2, replay_timeout_s=60)
    app = make_proxy_app(config, gate, CollectorRegistry())
    proxy = TestServer(app)
    await proxy.start_server()
    url = str(proxy.make_url("/v1/chat/completions"))
    body = {"messages": [{"role": "user", "content": "hi"}]}
    try:
        async with aiohttp.ClientSession() as s:

            async def ask() -> tuple[int, dict[str, str], dict[str, Any]]:
                async with s.post(url, json=body) as r:
                    return r.status, dict(r.headers), await r.json()

            # one request sent and waiting for the server to come back (to be sent again), one queued
            resent = asyncio.create_task(ask())
            await asyncio.wait_for(dying.took.wait(), 5)
            gate.update("the pool is full")
            queued = asyncio.create_task(ask())
            await until(lambda: app[PROXY_KEY].queue.queued == 1)
            await asyncio.sleep(0.3)
            assert not resent.done() and not queued.done(), "both wait (up to replay_timeout_s, queue_timeout_s)"
            t0 = time.monotonic()
            assert app[PROXY_KEY].fail("llama-server failed to start 5 times in a row") == 2
            answers = await asyncio.wait_for(asyncio.gather(resent, queued), 2)
            assert time.monotonic() - t0 < 0.5
            answers.append(await ask())  # and one that comes after
        for status, headers, doc in answers:
            assert status == 503 and headers[ERROR_HEADER] == "server_failed" and "Retry-After" not in headers
            assert doc["error"]["message"] == "kvctl: llama-server failed to start 5 times in a row"
    finally:
        await proxy.close()
        await upstream.close()


def test_kvctl_run_exits_3_once_the_server_failed_with_exit_on_failed() -> None:
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")},
        "KVCTL_SUPERVISOR__FAILED_AFTER": "2",
        "KVCTL_SUPERVISOR__EXIT_ON_FAILED": "true",
        "KVCTL_SUPERVISOR__RESTART_BACKOFF_INITIAL_S": "0.05",
        "KVCTL_LOG__FORMAT": "json",
    }
    listen = ["--upstream", f"http://127.0.0.1:{port}", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"]
    argv = [sys.executable, "-m", "controller.cli", "run", *listen, "--spawn", "--", sys.executable, "-c", BOOM]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 3, done.stderr[-2000:]
    assert '"event": "supervisor.failed"' in done.stderr and '"event": "kvctl.server_failed"' in done.stderr
    assert "boom" in done.stderr, "the server's stderr still reaches kvctl's"


# --- planned restarts ----------------------------------------------------------------------------


async def test_a_planned_restart_replaces_the_server_at_once_and_is_no_crash(tmp_path: Path) -> None:
    settings = child_settings(tmp_path, "serve", restart_backoff_initial_s=5.0, restart_backoff_max_s=5.0)
    async with supervising(settings) as sup:
        await until(lambda: sup.status.state is SupervisorState.READY)
        first = sup.status.pid
        new_argv = [*sup.argv[:2], "serve", *sup.argv[3:5], "--flag"]
        with capture_logs() as logs:
            t0 = time.monotonic()
            assert await sup.restart(new_argv)
            assert time.monotonic() - t0 < 3.0, "no restart delay (it is 5 s here)"
        assert sup.status.pid != first and dead(first or 0)
        assert sup.status.restarts == 1 and sup.status.early_exits == 0 and "--flag" in sup.status.argv
        events = [e["event"] for e in logs]
        assert "supervisor.restart_planned" in events and "supervisor.exited" not in events


async def test_a_restart_to_a_command_that_dies_says_so_and_the_old_one_starts_again(tmp_path: Path) -> None:
    settings = child_settings(tmp_path, "serve", restart_backoff_initial_s=5.0, restart_backoff_max_s=5.0)
    async with supervising(settings) as sup:
        await until(lambda: sup.status.state is SupervisorState.READY)
        good = sup.argv
        crashing = [*good[:2], "crash", *good[3:]]
        assert not await sup.restart(crashing), "the new command line died before it was ready"
        assert sup.status.state is SupervisorState.BACKOFF
        t0 = time.monotonic()
        assert await sup.restart(good), "between starts: the old command line starts now"
        assert time.monotonic() - t0 < 3.0 and sup.status.state is SupervisorState.READY


async def test_a_planned_restart_to_a_command_line_that_dies_is_rolled_back(tmp_path: Path) -> None:
    from controller.errors import KvctlError
    from controller.planned import PlannedRestart

    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    other = tmp_path / "other.gguf"
    other.write_bytes(b"other weights")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    argv = [sys.executable, str(script), "serve", "{port}", str(tmp_path / "out"), "-m", str(model)]
    settings = spawn_settings(argv, restart_backoff_initial_s=5.0, restart_backoff_max_s=5.0)
    gate = AdmissionGate()

    async def models() -> list[str]:
        return ["m"]

    async with supervising(settings) as sup:
        await until(lambda: sup.status.state is SupervisorState.READY)
        planned = PlannedRestart(sup, lambda: None, gate, models, replay_timeout_s=5.0)
        first = sup.status.pid
        with pytest.raises(KvctlError) as e:
            await planned.run([*sup.argv[:2], "serve", *sup.argv[3:5], "-m", str(other)])
        assert e.value.code == "model_changed" and "model: 'm.gguf' -> 'other.gguf'" in e.value.message
        assert sup.status.pid == first and gate.down_since is None, "refused before anything stopped"
        crashing = [*sup.argv[:2], "crash", *sup.argv[3:]]
        with pytest.raises(KvctlError) as e:
            await planned.run(crashing)
        assert "old command line" in e.value.message
        assert sup.status.state is SupervisorState.READY and sup.status.argv[2] == "serve", "rolled back"
        outcome = await planned.run(None)
        assert (outcome.moved, outcome.failed) == (0, 0) and sup.status.state is SupervisorState.READY


async def test_a_poll_answered_while_starting_makes_the_server_ready_whatever_health_meets(tmp_path: Path) -> None:
    """The loop's /kv was answered (the patched server answers it once loaded); the server stopped before the
    supervisor's next /health probe, which now never answers. It is ready, so a hang check can kill it."""
    async with supervising(child_settings(tmp_path, "silent")) as sup:
        await until(lambda: sup.status.state is SupervisorState.STARTING and sup.status.pid is not None)
        await asyncio.sleep(0.2)
        assert sup.status.state is SupervisorState.STARTING, "nothing answers /health here"
        sup.answered()
        await until(lambda: sup.status.state is SupervisorState.READY, 2.0)
        assert sup.kill_hung("test: hung right after it loaded")
