"""The supervisor's state machine against a fake child (a small Python server scripted by mode), on short timings.

The real server under the supervisor is tested in tests/integration/test_controller.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

from prometheus_client import CollectorRegistry

from controller.metrics import Metrics
from controller.settings import Settings, load_settings
from controller.supervisor import Supervisor, SupervisorState

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import http.server, subprocess, sys, threading, time
mode, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]  # then --sse-ping-interval N, ignored
if mode == "crash":
    sys.exit(3)
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_settings(tmp_path: Path, mode: str, **supervisor: float) -> Settings:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
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
            "supervisor": {"spawn": [sys.executable, str(script), mode, str(port), str(tmp_path / "out")], **timings},
            "upstream": {"url": f"http://127.0.0.1:{port}", "timeout_s": 0.3},
        }
    )


@contextlib.asynccontextmanager
async def supervising(settings: Settings) -> AsyncIterator[Supervisor]:
    sup = Supervisor(settings, Metrics(CollectorRegistry()))
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
    async with supervising(child_settings(tmp_path, "crash")) as sup:
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
from controller.supervisor import Supervisor
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
