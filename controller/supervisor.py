"""Start llama-server and keep it running (``kvctl run --spawn -- ARGV``).

One task drives an explicit state machine; nothing else changes the state, so no lock is needed::

    STOPPED --run()--> STARTING --/health 200--> READY
    STARTING --exit, or no 200 in ready_timeout_s--> BACKOFF    (the exit is reported at once, marked early)
    READY --exit--> BACKOFF --restart delay--> STARTING         (the delay doubles, reset once READY lasted)
    any --stop()--> STOPPING --SIGTERM, then SIGKILL after stop_timeout_s--> STOPPED

The server runs in its own process group, so signals reach whatever it started too, and the group is killed
when the server exits; the server dies with kvctl (a parent-death signal, Linux), even by kill -9. Readiness is
``/health`` answering 200 or the child exiting, whichever comes first. Attaching to a server
started elsewhere needs no supervisor: the control loop's back-off covers its restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import IO, Any

import structlog

from controller.metrics import Metrics
from controller.settings import Settings, sse_ping_interval
from controller.upstream import UpstreamClient, UpstreamError

__all__ = ["ExitInfo", "Supervisor", "SupervisorState", "SupervisorStatus"]

log = structlog.get_logger("kvctl.supervisor")


class SupervisorState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"
    STOPPING = "stopping"


@dataclass(frozen=True, slots=True)
class ExitInfo:
    returncode: int
    """Negative: killed by that signal."""
    at_unix: float
    early: bool
    """It exited before it ever answered /health with 200."""
    uptime_s: float


@dataclass(slots=True)
class SupervisorStatus:
    state: SupervisorState = SupervisorState.STOPPED
    pid: int | None = None
    starts: int = 0
    restarts: int = 0
    ready_since_unix: float | None = None
    last_exit: ExitInfo | None = None
    next_start_in_s: float | None = None
    argv: list[str] = field(default_factory=list)

    @property
    def ready_since(self) -> float | None:
        return self.ready_since_unix


_PR_SET_PDEATHSIG = 1


def _resolve_prctl() -> Any:
    """prctl, looked up once in kvctl: a symbol lookup after fork could take the dynamic loader's lock that another
    thread of kvctl held at the fork."""
    if sys.platform != "linux":
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = (ctypes.c_int, ctypes.c_ulong)
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _resolve_prctl()


def die_with_parent(parent: int) -> None:
    """Run in the child between fork and exec (Linux), with kvctl's pid: the kernel sends the child SIGKILL when kvctl
    dies, however it dies (kill -9, the OOM killer), so a spawned server is never orphaned holding its GPU and port.
    The signal is tied to the forking thread: kvctl forks from its event loop's thread, which lives as long as kvctl.
    Only a system call runs here."""
    if _PRCTL is None:
        return
    if _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0 or os.getppid() != parent:
        os._exit(1)  # no signal would come (or kvctl died before the prctl): do not start an orphan


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    """Signal a process group that may be gone already."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def spawn_argv(settings: Settings) -> list[str]:
    """The server's command line, with an SSE ping interval of a third of proxy.upstream_read_timeout_s when it sets
    none: a stream that is quiet for a while (parked, or a slow step) must get the server's ping before kvctl's read
    timeout ends it."""
    argv = list(settings.supervisor.spawn or [])
    if sse_ping_interval(argv) is None:
        argv += ["--sse-ping-interval", str(max(1, int(settings.proxy.upstream_read_timeout_s // 3)))]
    return argv


class Supervisor:
    """Spawns, watches and restarts one llama-server; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        *,
        on_start: Callable[[], None] | None = None,
    ) -> None:
        argv = settings.supervisor.spawn
        if not argv:
            raise ValueError("supervisor.spawn is not set: nothing to supervise")
        self.settings = settings
        self.metrics = metrics
        self.status = SupervisorStatus(argv=spawn_argv(settings))
        self._argv = spawn_argv(settings)
        self._on_start = on_start
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = asyncio.Event()
        self._health = UpstreamClient(
            str(settings.upstream.url), api_key=settings.upstream.api_key, timeout_s=settings.upstream.timeout_s
        )

    def _set(self, state: SupervisorState) -> None:
        if self.status.state is not state:
            log.debug("supervisor.state", state=str(state), previous=str(self.status.state))
        self.status.state = state

    async def run(self) -> None:
        """Keep the server running until stop() (or cancellation, which also stops it)."""
        cfg = self.settings.supervisor
        delay = cfg.restart_backoff_initial_s
        try:
            while not self._stopping.is_set():
                if self.status.starts > 0:
                    self.status.restarts += 1
                    self.metrics.upstream_restarts.inc()
                ready = await self._start_and_watch()
                if self._stopping.is_set():
                    break
                last = self.status.last_exit
                if ready and last is not None and last.uptime_s >= cfg.stable_after_s:
                    delay = cfg.restart_backoff_initial_s
                self._set(SupervisorState.BACKOFF)
                self.status.next_start_in_s = delay
                log.info("supervisor.restart_scheduled", in_s=delay)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)
                self.status.next_start_in_s = None
                delay = min(delay * 2, cfg.restart_backoff_max_s)
        finally:
            try:
                await asyncio.shield(self._terminate())
            finally:
                # also when cancelled while the server is being stopped: the health client is closed either way
                await self._health.close()
                self._set(SupervisorState.STOPPED)

    def kill_hung(self, why: str) -> bool:
        """SIGKILL a ready server that stopped answering (a hung server is as dead as a crashed one); the watch
        then restarts it. False when there is nothing to kill (not started, starting, stopping)."""
        proc = self._proc
        if self.status.state is not SupervisorState.READY or proc is None or proc.returncode is not None:
            return False
        log.error("supervisor.kill_hung", pid=proc.pid, reason=why)
        kill_group(proc.pid)
        return True

    async def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after stop_timeout_s; no restart after."""
        self._stopping.set()
        await self._terminate()

    def _log_target(self) -> IO[bytes] | None:
        path = self.settings.supervisor.log_file
        return path.open("ab") if path is not None else None

    async def _start_and_watch(self) -> bool:
        """Start the server, wait for it to be ready, then for it to exit; True if it was ready."""
        self._set(SupervisorState.STARTING)
        self.status.ready_since_unix = None
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}  # systemd's socket is kvctl's
        out = self._log_target()
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT if out is not None else None,
                start_new_session=True,
                env=env,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),  # a prctl, see die_with_parent()
            )
        except OSError as e:
            log.error("supervisor.spawn_failed", argv0=self._argv[0], error=str(e))
            self.status.last_exit = ExitInfo(returncode=127, at_unix=time.time(), early=True, uptime_s=0.0)
            return False
        finally:
            if out is not None:
                out.close()
        self._proc = proc
        self.status.pid = proc.pid
        self.status.starts += 1
        started = time.monotonic()
        log.info("supervisor.started", pid=proc.pid, start=self.status.starts)
        if self._on_start is not None:
            self._on_start()
        ready = await self._wait_ready(proc)
        if ready:
            self._set(SupervisorState.READY)
            self.status.ready_since_unix = time.time()
            log.info("supervisor.ready", pid=proc.pid, after_s=round(time.monotonic() - started, 3))
            await proc.wait()
        # the leader is gone: whatever it started (a helper, a grandchild) must not outlive it holding the GPU
        kill_group(proc.pid)
        rc = proc.returncode if proc.returncode is not None else -1
        info = ExitInfo(returncode=rc, at_unix=time.time(), early=not ready, uptime_s=time.monotonic() - started)
        self.status.last_exit = info
        self.status.ready_since_unix = None
        if not self._stopping.is_set():
            event = "supervisor.exited_early" if info.early else "supervisor.exited"
            log.error(event, pid=proc.pid, returncode=rc, uptime_s=round(info.uptime_s, 3))
        return ready

    async def _wait_ready(self, proc: asyncio.subprocess.Process) -> bool:
        """/health 200 (True) or the child's exit (False), whichever comes first."""
        cfg = self.settings.supervisor
        exited = asyncio.create_task(proc.wait(), name="llama-server exit")
        deadline = time.monotonic() + cfg.ready_timeout_s
        try:
            while not exited.done():
                with contextlib.suppress(UpstreamError):
                    if await self._health.health():
                        return True
                if time.monotonic() > deadline:
                    log.error("supervisor.not_ready", pid=proc.pid, timeout_s=cfg.ready_timeout_s)
                    await self._terminate()
                    break
                await asyncio.wait({exited}, timeout=cfg.health_interval_s)
            return False
        finally:
            if not exited.done():
                exited.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await exited

    async def _terminate(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        if self._stopping.is_set():
            self._set(SupervisorState.STOPPING)
        kill_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.settings.supervisor.stop_timeout_s)
        except TimeoutError:
            log.warning("supervisor.kill", pid=proc.pid, after_s=self.settings.supervisor.stop_timeout_s)
            kill_group(proc.pid)
            await proc.wait()
        kill_group(proc.pid)  # the leader stopped; the rest of its group goes with it
