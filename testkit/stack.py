"""kvctl as an operator runs it: `kvctl run` in its own process, in front of a server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from testkit.llama import free_port

# `kvctl` from this checkout, with the interpreter that runs the caller
KVCTL = (sys.executable, "-m", "controller.cli")


@contextlib.contextmanager
def start_stack(
    upstream: str,
    *extra: str,
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
    kvctl: Sequence[str] = KVCTL,
    log_path: Path | None = None,
    timeout_s: float = 30.0,
    ready: bool = True,
) -> Iterator[str]:
    """Yields the proxy's URL once kvctl is ready (``ready=False``: once its proxy listens, the server perhaps still
    loading); kvctl's admin listener is at `stack_admin(url)`.

    ``kvctl``: the command that is ``kvctl`` (an installed console script, say); ``extra``: more ``run`` arguments
    (``--spawn -- llama-server ...`` last). On the way out kvctl gets SIGTERM (and stops a server it spawned), then
    SIGKILL after 15 s.
    """
    pport, aport = free_port(), free_port()
    log = log_path or Path(tempfile.mkstemp(prefix="kvctl-bench-", suffix=".log")[1])
    cmd = [
        *kvctl,
        "run",
        "--upstream",
        upstream,
        "--listen",
        f"127.0.0.1:{pport}",
        "--admin",
        f"127.0.0.1:{aport}",
        *extra,
    ]
    proc = spawn_group(cmd, log, {**os.environ, "KVCTL_LOG__FORMAT": "json", **(env or {})}, cpus)
    _ADMIN[f"http://127.0.0.1:{pport}"] = (f"http://127.0.0.1:{aport}", proc.pid)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvctl exited with {proc.returncode}: {log.read_text()[-2000:]}")
            if not ready:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", pport), timeout=2):
                    break
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(f"http://127.0.0.1:{aport}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise TimeoutError("kvctl did not become ready:\n" + log.read_text()[-2000:])
            time.sleep(0.1)
        yield f"http://127.0.0.1:{pport}"
    finally:
        stop_group(proc)


def spawn_group(
    cmd: Sequence[str], log: Path, env: dict[str, str], cpus: set[int] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a session of its own (so `stop_group` reaches its children too), its output appended to
    ``log``, on ``cpus`` when given."""
    with log.open("ab") as f:
        return subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=cwd,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )


def stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 15) -> None:
    """SIGTERM to a process started with ``start_new_session``, and to its children (a spawned server); SIGKILL
    to them all after ``timeout_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


_ADMIN: dict[str, tuple[str, int]] = {}


def stack_admin(proxy_url: str) -> str:
    return _ADMIN[proxy_url][0]


def stack_pid(proxy_url: str) -> int:
    return _ADMIN[proxy_url][1]


def kvctl_json(proxy_url: str, command: str, *args: str) -> tuple[int, Any]:
    """``kvctl COMMAND --admin ... --json ARGS`` as an operator types it against the stack at ``proxy_url``: its exit
    code and its answer (parsed JSON, else the text it printed)."""
    admin = stack_admin(proxy_url).removeprefix("http://")
    cmd = [sys.executable, "-m", "controller.cli", command, "--admin", admin, "--json", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = done.stdout.strip() or done.stderr.strip()
    try:
        return done.returncode, json.loads(out)
    except ValueError:
        return done.returncode, out


def drain(proxy_url: str, *peers: str) -> tuple[int, Any]:
    """`kvctl drain --json --to URL ...`: (exit code, the answer)."""
    return kvctl_json(proxy_url, "drain", *[a for peer in peers for a in ("--to", peer)])


def restart_server(proxy_url: str, *argv: str, force: bool = False) -> tuple[int, Any]:
    """`kvctl restart-server --json [--force] -- ARGV`: (exit code, the answer)."""
    return kvctl_json(proxy_url, "restart-server", *(["--force"] if force else []), "--", *argv)
