"""Start llama-server and keep it running (``kvctl run --spawn -- ARGV``).

One task drives an explicit state machine; nothing else changes the state, so no lock is needed::

    STOPPED --run()--> STARTING --/health 200--> READY
    STARTING --exit, or no 200 in ready_timeout_s--> BACKOFF    (the exit is reported at once, marked early)
    READY --exit--> BACKOFF --restart delay--> STARTING         (the delay doubles, reset once READY lasted)
    STARTING --the failed_after-th early exit in a row--> FAILED  (no more starts; READY resets the count)
    any --stop()--> STOPPING --SIGTERM, then SIGKILL after stop_timeout_s--> STOPPED
    READY --restart(argv)--> STARTING                           (planned: no delay, not counted as an exit)

The server runs in its own process group, so signals reach whatever it started too, and the group is killed
when the server exits; the server dies with kvctl (a parent-death signal, Linux), even by kill -9. Readiness is
``/health`` answering 200 or the child exiting, whichever comes first. Attaching to a server
started elsewhere needs no supervisor: the control loop's back-off covers its restarts.

Each exit keeps the server's last log lines (controller.upstream.server_log) and, killed by a signal, the signal's name;
FAILED is reported (``supervisor.failed``, ``/status``, the ``on_failed`` callback that ends the proxy's waiting
requests) rather than looped, and stays until kvctl is reloaded or restarted: a server that died before it was ready
that many times needs a person (a model path, a flag, a driver), not a sixth try.
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
from typing import Any

import structlog

from controller.keeper_link import KeeperLink
from controller.metrics import Metrics
from controller.settings import Settings, sse_ping_interval
from controller.upstream.client import UpstreamClient, UpstreamError
from controller.upstream.server_log import ServerOutput

__all__ = ["ExitInfo", "Supervisor", "SupervisorState", "SupervisorStatus", "describe_exit", "signal_name"]

log = structlog.get_logger("kvctl.supervisor")


class SupervisorState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    BACKOFF = "backoff"
    FAILED = "failed"
    """It died before it was ready supervisor.failed_after times in a row: not started again."""
    STOPPING = "stopping"


def signal_name(returncode: int) -> str | None:
    """``SIGSEGV`` for a process killed by SIGSEGV (returncode -11); None for one that exited."""
    if returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


@dataclass(frozen=True, slots=True)
class ExitInfo:
    returncode: int
    """Negative: killed by that signal."""
    at_unix: float
    early: bool
    """It exited before it ever answered /health with 200."""
    uptime_s: float
    log_tail: tuple[str, ...] = ()
    """The last lines it wrote (server_log.TAIL_LINES at most); for a start that failed, kvctl's error."""

    @property
    def signal(self) -> str | None:
        return signal_name(self.returncode)


def describe_exit(info: ExitInfo) -> str:
    """``killed by SIGSEGV after 0.4 s``: an exit in words, for logs and error messages."""
    how = f"killed by {info.signal}" if info.signal is not None else f"exit code {info.returncode}"
    return f"{how} after {info.uptime_s:.1f} s"


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
    early_exits: int = 0
    """Starts in a row that died before the server was ready; reset once it is ready."""
    failure: str | None = None
    """Why the supervisor gave up (FAILED), in words; None before."""

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


async def _first_set(events: tuple[asyncio.Event, ...], timeout_s: float) -> None:
    """Until one of ``events`` is set, or ``timeout_s``."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


def spawn_argv(settings: Settings, argv: list[str] | None = None) -> list[str]:
    """The server's command line (``argv``, else ``supervisor.spawn``), with ``--exact`` when supervisor.exact is
    set, and an SSE ping interval of a third of proxy.upstream_read_timeout_s when it sets none: a stream that is
    quiet for a while (parked, or a slow step) must get the server's ping before kvctl's read timeout ends it."""
    argv = list(argv if argv is not None else settings.supervisor.spawn or [])
    if settings.supervisor.exact and "--exact" not in argv:
        argv.append("--exact")
    if sse_ping_interval(argv) is None:
        argv += ["--sse-ping-interval", str(max(1, int(settings.proxy.upstream_read_timeout_s // 3)))]
    return argv


class Adopted:
    """A server a previous kvctl worker started (under the keeper, which reaps it): ``pid``, ``returncode`` and
    ``wait()`` as asyncio's Process has them, through a pidfd."""

    def __init__(self, pid: int, keeper: KeeperLink) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._keeper = keeper
        self._fd = os.pidfd_open(pid)

    async def wait(self) -> int:
        if self.returncode is None:
            loop = asyncio.get_running_loop()
            gone: asyncio.Future[None] = loop.create_future()

            def readable() -> None:
                if not gone.done():
                    gone.set_result(None)

            loop.add_reader(self._fd, readable)
            try:
                await gone
            finally:
                loop.remove_reader(self._fd)
            os.close(self._fd)
            self.returncode = await self._keeper.exit_status(self.pid)
        return self.returncode


class Supervisor:
    """Spawns, watches and restarts one llama-server; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        *,
        on_start: Callable[[], None] | None = None,
        on_failed: Callable[[str], None] | None = None,
    ) -> None:
        argv = settings.supervisor.spawn
        if not argv:
            raise ValueError("supervisor.spawn is not set: nothing to supervise")
        self.settings = settings
        self.metrics = metrics
        self.status = SupervisorStatus(argv=spawn_argv(settings))
        self._on_start = on_start
        self._on_failed = on_failed
        self._proc: asyncio.subprocess.Process | None = None
        self._stopping = asyncio.Event()
        self._planned = False  # the running server is being replaced on purpose (restart())
        self._ready = asyncio.Event()  # set while the server is READY
        self._early_exit = asyncio.Event()  # a start that died before it was ready (restart() waits for either)
        self._start_now = asyncio.Event()  # ends a restart delay early (restart() while in BACKOFF)
        self._answered = False  # the control loop's poll reached the server this start launched (answered())
        self.failed = asyncio.Event()
        """Set on entering FAILED."""
        self.keeper: KeeperLink | None = None
        """Under the keeper: the server outlives this worker (no parent-death signal), and the keeper learns of it."""
        self.adopt: dict[str, Any] | None = None
        """A server a previous worker started, to watch instead of starting one (its pid; fds: its pipes)."""
        self.adopt_fds: list[int] = []
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
                if self._planned:
                    # replaced on purpose: at once, no delay, and not an exit that counts towards failed_after
                    self._planned = False
                    log.info("supervisor.restarting", reason="planned", argv0=self.status.argv[0])
                    continue
                if not ready:
                    self._early_exit.set()
                self.status.early_exits = 0 if ready else self.status.early_exits + 1
                if cfg.failed_after and self.status.early_exits >= cfg.failed_after:
                    self._fail()
                    await self._stopping.wait()
                    break
                last = self.status.last_exit
                if ready and last is not None and last.uptime_s >= cfg.stable_after_s:
                    delay = cfg.restart_backoff_initial_s
                self._set(SupervisorState.BACKOFF)
                self.status.next_start_in_s = delay
                log.info("supervisor.restart_scheduled", in_s=delay)
                await _first_set((self._stopping, self._start_now), delay)
                self._start_now.clear()
                self.status.next_start_in_s = None
                delay = min(delay * 2, cfg.restart_backoff_max_s)
        finally:
            try:
                await asyncio.shield(self._terminate())
            finally:
                # also when cancelled while the server is being stopped: the health client is closed either way
                await self._health.close()
                self._set(SupervisorState.STOPPED)

    def _fail(self) -> None:
        last = self.status.last_exit
        assert last is not None
        n = self.status.early_exits
        times = f"{n} time" + ("" if n == 1 else "s")
        self.status.failure = (
            f"llama-server failed to start {times} in a row (last exit: {describe_exit(last)}); "
            "kvctl does not start it again until kvctl itself is reloaded (kvctl reload) or restarted"
        )
        self._set(SupervisorState.FAILED)
        self.metrics.upstream_failed.set(1)
        log.error(
            "supervisor.failed",
            early_exits=n,
            returncode=last.returncode,
            signal=last.signal,
            uptime_s=round(last.uptime_s, 3),
            log_tail=list(last.log_tail),
            argv0=self.status.argv[0],
        )
        self.failed.set()
        if self._on_failed is not None:
            self._on_failed(self.status.failure)

    def kill_hung(self, why: str) -> bool:
        """SIGKILL a ready server that stopped answering (a hung server is as dead as a crashed one); the watch
        then restarts it. False when there is nothing to kill (not started, starting, stopping)."""
        proc = self._proc
        if self.status.state is not SupervisorState.READY or proc is None or proc.returncode is not None:
            return False
        log.error("supervisor.kill_hung", pid=proc.pid, reason=why)
        kill_group(proc.pid)
        return True

    def kill_now(self) -> None:
        """SIGKILL the server's group, whatever the state (kvctl goes down at once: its keeper died)."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            kill_group(proc.pid)

    async def restart(self, argv: list[str] | None = None, timeout_s: float | None = None) -> bool:
        """A planned restart: the server is killed (SIGKILL: kvctl has checkpointed its requests, nothing in it is
        left to save) and started again at once, with ``argv`` when given (``supervisor.spawn``'s form); between
        starts, the next start comes now. True once the new server is ready; False when it dies before that, is not
        ready within ``timeout_s`` (supervisor.ready_timeout_s), or the supervisor has stopped or given up."""
        state = self.status.state
        if self._stopping.is_set() or state in (SupervisorState.FAILED, SupervisorState.STOPPED):
            return False
        if argv is not None:
            self.status.argv = spawn_argv(self.settings, argv)
        self._ready.clear()
        self._early_exit.clear()
        proc = self._proc
        log.warning("supervisor.restart_planned", pid=proc.pid if proc else None, argv0=self.status.argv[0])
        if proc is not None and proc.returncode is None:
            self._planned = True
            kill_group(proc.pid)
        else:
            self._start_now.set()  # between starts (BACKOFF): the next one now, with this command line
        limit = self.settings.supervisor.ready_timeout_s if timeout_s is None else timeout_s
        await _first_set((self._ready, self._early_exit, self.failed), limit)
        return self._ready.is_set()

    def answered(self) -> None:
        """The control loop's poll of ``/kv`` was answered while the server starts: the patched server answers it only
        once its model is loaded, so it is ready, whatever the next ``/health`` probe meets (a server hung or stopped
        right after it loaded would otherwise stay STARTING, which the hang check does not kill)."""
        if self.status.state is SupervisorState.STARTING:
            self._answered = True

    @property
    def ready(self) -> bool:
        return self.status.state is SupervisorState.READY

    @property
    def argv(self) -> list[str]:
        """The command line the server runs with (after spawn_argv())."""
        return list(self.status.argv)

    async def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after stop_timeout_s; no restart after."""
        self._stopping.set()
        await self._terminate()

    async def _start_and_watch(self) -> bool:
        """Start the server, wait for it to be ready, then for it to exit; True if it was ready."""
        self._set(SupervisorState.STARTING)
        self._answered = False  # a poll answered before this start was the last server's
        self.status.ready_since_unix = None
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}  # systemd's socket is kvctl's
        adopted = self._adopted()
        if adopted is not None:
            proc, out = adopted
            try:
                return await self._watch(proc, out)
            finally:
                out.close()
        out = ServerOutput(self.settings.supervisor.log_file)
        try:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.status.argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out.stdout,
                    stderr=out.stderr,
                    start_new_session=True,
                    env=env,
                    # a prctl, see die_with_parent(); under the keeper the server outlives a worker that dies
                    preexec_fn=functools.partial(die_with_parent, os.getpid()) if self.keeper is None else None,
                )
            except OSError as e:
                log.error("supervisor.spawn_failed", argv0=self.status.argv[0], error=str(e))
                self.status.last_exit = ExitInfo(
                    returncode=127,
                    at_unix=time.time(),
                    early=True,
                    uptime_s=0.0,
                    log_tail=(f"kvctl: cannot start {self.status.argv[0]}: {e}",),
                )
                return False
            if self.keeper is not None:
                self.keeper.server_started(proc.pid, self.status.argv[0], out.read_ends())
            out.spawned()
            return await self._watch(proc, out)
        finally:
            out.close()

    def _adopted(self) -> tuple[Any, ServerOutput] | None:
        """The server a previous worker started, when it still runs: watched as if started here."""
        adopt, fds = self.adopt, self.adopt_fds
        self.adopt, self.adopt_fds = None, []
        if adopt is None or self.keeper is None or not isinstance(adopt.get("pid"), int):
            for fd in fds:
                os.close(fd)
            return None
        try:
            with open(f"/proc/{adopt['pid']}/cmdline", "rb") as f:
                argv0 = f.read().split(b"\0")[0].decode(errors="replace")
            if argv0 != adopt.get("argv0"):
                raise ProcessLookupError(f"pid {adopt['pid']} runs {argv0!r} now")  # the server's pid, reused
            proc = Adopted(adopt["pid"], self.keeper)
        except OSError:  # gone meanwhile: start one
            for fd in fds:
                os.close(fd)
            return None
        log.info("supervisor.adopted", pid=proc.pid)
        out = ServerOutput.adopted(self.settings.supervisor.log_file, fds)
        out.spawned()
        return proc, out

    async def _watch(self, proc: Any, out: ServerOutput) -> bool:
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
            self.status.early_exits = 0
            log.info("supervisor.ready", pid=proc.pid, after_s=round(time.monotonic() - started, 3))
            self._ready.set()
            try:
                await proc.wait()
            finally:
                self._ready.clear()
        # the leader is gone: whatever it started (a helper, a grandchild) must not outlive it holding the GPU
        kill_group(proc.pid)
        if self.keeper is not None:
            self.keeper.server_gone()  # the next worker must not adopt its pid, which another process may get
        rc = proc.returncode if proc.returncode is not None else -1
        at, uptime = time.time(), time.monotonic() - started
        tail = await out.finish()
        info = ExitInfo(returncode=rc, at_unix=at, early=not ready, uptime_s=uptime, log_tail=tuple(tail))
        self.status.last_exit = info
        self.status.ready_since_unix = None
        self.status.pid = None
        if not self._stopping.is_set() and not self._planned:
            event = "supervisor.exited_early" if info.early else "supervisor.exited"
            log.error(event, pid=proc.pid, returncode=rc, signal=info.signal, uptime_s=round(info.uptime_s, 3))
        return ready

    async def _wait_ready(self, proc: Any) -> bool:
        """/health 200 or the control loop's answered poll (True), or the child's exit (False), whichever comes
        first."""
        cfg = self.settings.supervisor
        exited = asyncio.create_task(proc.wait(), name="llama-server exit")
        deadline = time.monotonic() + cfg.ready_timeout_s
        try:
            while not exited.done():
                if self._answered:
                    return True
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
