"""kvctl's process: the control loop, the admin listener and, with ``--spawn``, the supervisor.

Root tasks are created by name and guarded: a root task that ends on its own is logged and stops
the process in bounded steps (the supervisor's server first, then the loop, then the listeners),
as does SIGTERM or SIGINT, and, with ``supervisor.exit_on_failed``, the supervisor giving up on the server
(``run()`` then returns EXIT_SERVER_FAILED).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from controller.admin.app import make_admin_app
from controller.errors import Code, KvctlError
from controller.keeper_link import KeeperError, KeeperLink
from controller.loop.control import ControlLoop
from controller.metrics import Metrics
from controller.planned import PlannedRestart
from controller.policy.pool import pressure
from controller.policy.types import QueuedRequest
from controller.probes.gpu import GpuProbe
from controller.proxy.admission import AdmissionGate
from controller.proxy.app import PROXY_KEY, Proxy, make_proxy_app
from controller.proxy.config import ProxyConfig
from controller.proxy.context import Phase, Stop
from controller.proxy.endpoint_metrics import EndpointMetrics, EndpointSample
from controller.proxy.routes import predict_route_from_env
from controller.proxy.site import run_site, tls_context
from controller.settings import LogFormat, LogSettings, MetricsCompat, Settings, split_host_port
from controller.upstream.client import UpstreamClient, UpstreamError
from controller.upstream.models import SlotState
from controller.upstream.supervisor import Supervisor

__all__ = ["EXIT_SERVER_FAILED", "App", "configure_logging"]

log = structlog.get_logger("kvctl.app")

ERROR_ANSWERS_REFUSED = 3
"""Polls in a row answered with an error other than 503 before new requests are refused rather than held."""

EXIT_SERVER_FAILED = 3
"""``kvctl run``'s status when the supervised server failed to start supervisor.failed_after times in a row and
supervisor.exit_on_failed is set (LSB's "program is not running")."""


def configure_logging(settings: LogSettings) -> None:
    """structlog: JSON lines when not on a terminal (journald, files), a readable console otherwise."""
    console = settings.format is LogFormat.CONSOLE or (settings.format is LogFormat.AUTO and sys.stderr.isatty())
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    )
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if not console:
        processors.append(structlog.processors.dict_tracebacks)
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(settings.level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


def notify_socket() -> socket.socket | None:
    """The systemd notification socket ($NOTIFY_SOCKET), connected; None when not started by systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return None
    if addr.startswith("@"):
        addr = "\0" + addr[1:]  # abstract namespace
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.connect(addr)
    except OSError as e:
        sock.close()
        log.warning("systemd.notify_unavailable", socket=os.environ.get("NOTIFY_SOCKET"), error=str(e))
        return None
    sock.setblocking(False)
    return sock


def sd_notify(sock: socket.socket, message: bytes) -> bool:
    """Send one notification; a failure (systemd restarting, a full socket buffer) is logged, never raised: kvctl
    keeps serving, and a watchdog that misses pings restarts it as it should."""
    try:
        sock.send(message)
    except OSError as e:
        log.warning("systemd.notify_failed", message=message.split(b"\n")[0].decode(), error=str(e))
        return False
    return True


def watchdog_interval_s() -> float:
    """A third of systemd's WatchdogSec ($WATCHDOG_USEC), as the unit file says: one ping may be late or lost without
    a restart; 10 s when no watchdog is set."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    return int(usec) / 3e6 if usec.isdigit() and int(usec) > 0 else 10.0


_SOURCE = os.path.dirname(os.path.realpath(__file__))  # where this worker's code is: an upgrade changes it


class RouterMode(Exception):
    """The server is a router of several models; kvctl fronts one model's server."""


class App:
    """Everything ``kvctl run`` starts; ``run()`` returns when ``stop`` is set or a root task fails."""

    def __init__(
        self,
        settings: Settings,
        registry: CollectorRegistry | None = None,
        reload: Callable[[], Settings] | None = None,
    ) -> None:
        self.settings = settings
        self._reload = reload  # the settings read again (the file and the environment), for a planned restart
        self.metrics = Metrics(registry if registry is not None else CollectorRegistry())
        self.client = UpstreamClient(
            str(settings.upstream.url), api_key=settings.upstream.api_key, timeout_s=settings.upstream.timeout_s
        )
        self.link = KeeperLink.from_env()  # under the keeper: it holds the listener and the clients' connections
        self.gpu = GpuProbe()
        self.loop = ControlLoop(self.client, settings, self.metrics, gpu=self.gpu)
        self.supervisor: Supervisor | None = None
        if settings.supervisor.spawn:
            self.supervisor = Supervisor(
                settings, self.metrics, on_start=self._server_started, on_failed=self._server_failed
            )
        if self.supervisor is not None:
            supervisor = self.supervisor
            supervisor.keeper = self.link
            self.loop.add_poll_listener(lambda: supervisor.answered() if self.loop.state.upstream_up else None)
        self.admin_addresses: list[str] = []
        self.gate = AdmissionGate()
        # until the first poll says otherwise, the server is coming back: a spawned one loads its model, and an
        # attached one is refused at once only once a poll finds that it never answered
        self.gate.server_down()
        self._proxy_cleanup: Callable[[], Awaitable[None]] | None = None
        self.proxy: Proxy | None = None
        self.planned: PlannedRestart | None = None
        if self.supervisor is not None:
            self.planned = PlannedRestart(
                self.supervisor,
                lambda: self.proxy,
                self.gate,
                self._model_ids,
                settings.proxy.replay_timeout_s,
                self._reload_spawn if reload is not None else None,
            )
        self._started_monotonic = time.monotonic()
        self._hung_reported = False
        self.started = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    def _server_started(self) -> None:
        self.loop.forget("the supervised server (re)started")

    def _server_failed(self, message: str) -> None:
        """The supervisor gave up: requests waiting for the server end now, new ones are answered at once."""
        self.gate.refuse(message, Code.SERVER_FAILED)  # what waits in the admission queue ends at once
        if self.proxy is not None:
            ended = self.proxy.fail(message)
            log.error("proxy.ended_waiting_requests", count=ended, reason="server failed")

    async def _model_ids(self) -> list[str] | None:
        try:
            return await self.client.model_ids()
        except UpstreamError as e:
            log.warning("restart.models_unknown", error=str(e))
            return None

    def _reload_spawn(self) -> list[str] | None:
        """``supervisor.spawn`` as the settings file and the environment say now (None when they cannot be read)."""
        assert self._reload is not None
        try:
            return self._reload().supervisor.spawn
        except (ValueError, OSError) as e:
            log.warning("restart.settings_unreadable", error=str(e))
            return None

    async def restart_server(self, argv: list[str] | None, force: bool) -> dict[str, Any]:
        """POST /server/restart (controller.planned)."""
        assert self.planned is not None
        outcome = await self.planned.run(argv, force)
        return {"moved": outcome.moved, "failed": outcome.failed, "seconds": outcome.seconds}

    async def drain(self, peers: list[str] | None) -> dict[str, Any]:
        """POST /drain (controller.proxy.drain): every request to a peer, then the spawned server stopped."""
        if self.proxy is None:
            raise KvctlError(409, Code.SERVER_NOT_READY, "the proxy is not listening yet", 2)
        supervisor = self.supervisor
        outcome = await self.proxy.drainer.run(peers, supervisor.stop if supervisor is not None else None)
        return {
            "moved": outcome.moved,
            "finished_here": outcome.finished_here,
            "failed": outcome.failed,
            "seconds": outcome.seconds,
        }

    async def _supervise(self) -> None:
        assert self.supervisor is not None
        await self.supervisor.run()
        if self.proxy is not None and self.proxy.drainer.done:
            # drained: the server was stopped on purpose, and kvctl relays the moved streams until it is stopped
            await asyncio.Event().wait()

    def _server_comes_back(self) -> bool:
        """Whether a server that does not answer now is expected back: a spawned one until the supervisor gives up
        on it; an attached one once it has answered (kvctl cannot know that one that never did ever will)."""
        if self.supervisor is not None:
            return self.supervisor.status.failure is None
        return self.loop.state.last_answer_monotonic is not None

    def _loop_alive(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    def _check_hung(self) -> None:
        """After every poll: a server whose main loop has not answered /kv for proxy.upstream_read_timeout_s is hung
        (its HTTP thread may still answer /health). Requests still waiting for its response end, and a spawned
        server is killed, so the supervisor restarts it."""
        limit = self.settings.proxy.upstream_read_timeout_s
        # an error answer (a 401, a 503 while loading) is an answer: only silence (timeouts, refused connections)
        since = self.loop.state.last_answer_monotonic
        if self.loop.state.last_action_end_monotonic is not None:
            # a park or resume in between (answered or not) was no poll: silence counts from its end
            since = max(since or 0.0, self.loop.state.last_action_end_monotonic)
        if self.supervisor is not None and self.supervisor.status.ready_since_unix is not None:
            # a (re)started server's clock starts when it is ready, not at the last answer of the one before
            ready_for = time.time() - self.supervisor.status.ready_since_unix
            since = max(since or 0.0, time.monotonic() - ready_for)
        silent = time.monotonic() - (since if since is not None else self._started_monotonic)
        if silent < limit:
            self._hung_reported = False
            return
        if self.supervisor is not None:
            # the requests it had not answered are sent again to the new server (proxy/replay.py): held, not ended
            self.supervisor.kill_hung(f"/kv not answered for {silent:.0f} s")
            return
        if self.proxy is not None and silent >= limit + self.settings.proxy.replay_timeout_s:
            # an attached server cannot be restarted by kvctl: its unanswered requests wait replay_timeout_s longer
            ended = self.proxy.tracker.end(Stop.HUNG, Phase.UPSTREAM)
            if ended:
                log.error("proxy.ended_waiting_requests", count=ended, silent_s=round(silent, 1))
        if not self._hung_reported:
            log.error("upstream.not_answering", silent_s=round(silent, 1), error=self.loop.state.last_error)
        self._hung_reported = True

    def _update_gate(self) -> None:
        """After every poll: what the policy says about new requests becomes the proxy's gate."""
        verdict = self.loop.admission(self.settings.proxy.admission_reserve_cells)
        if verdict is None:
            failure = self.supervisor.status.failure if self.supervisor is not None else None
            state = self.loop.state
            if failure is not None:
                self.gate.refuse(failure, Code.SERVER_FAILED)
            elif state.error_answers >= ERROR_ANSWERS_REFUSED:
                # it keeps answering with an error that waiting does not mend (a wrong upstream.api_key: 401; not the
                # patched server: 404); one such answer may be a blip, and the requests wait it out
                message = f"llama-server answers kvctl's poll with HTTP {state.last_error_status}"
                self.gate.refuse(message, Code.UPSTREAM_UNAVAILABLE)
            elif self._server_comes_back():
                self.gate.server_down()  # new requests wait for it (proxy.replay_timeout_s), in their order
            else:
                # an attached server that never answered: nothing says it ever will (the details are in the log)
                self.gate.refuse("llama-server is not answering", Code.UPSTREAM_UNAVAILABLE)
            return
        self.gate.server_up()
        self.gate.update(
            None if verdict.admit else verdict.reason,
            verdict.allowance,
            self.loop.state.snapshot_asked_monotonic,
            room_cells=verdict.room_cells,
            empty=verdict.empty,
            min_priority=verdict.min_priority,
        )

    def _queued_head(self) -> QueuedRequest | None:
        """The head of the proxy's admission queue, for the policy (displacement, restores held for it)."""
        head = self.proxy.queue.head() if self.proxy is not None else None
        if head is None:
            return None
        priority, cells, waited_s = head
        return QueuedRequest(priority, cells, int(waited_s * 1000))

    def endpoint_sample(self) -> EndpointSample:
        """The endpoint picker's numbers (controller.proxy.endpoint_metrics), from the latest poll and the proxy."""
        state = self.loop.state
        kv = state.snapshot
        age = time.monotonic() - state.last_poll_monotonic if state.last_poll_monotonic is not None else None
        queued = self.proxy.queue.queued if self.proxy is not None else 0
        if kv is None:
            return EndpointSample(up=False, poll_age_s=age, queued=queued, running=0, usage=1.0, n_cells=0)
        queued += self.gate.admitted_since(state.snapshot_asked_monotonic)
        queued += sum(1 for s in kv.slots if s.state is SlotState.PARKED)
        decision = state.decision
        return EndpointSample(
            up=state.upstream_up,
            poll_age_s=age,
            queued=queued,
            running=sum(1 for s in kv.slots if s.is_resident),
            usage=decision.pressure.value if decision is not None else pressure(kv).value,
            n_cells=kv.n_cells,
        )

    async def _start_proxy(self) -> None:
        """The client-facing reverse proxy: relays to the upstream, asks the gate before admitting."""
        p = self.settings.proxy
        config = ProxyConfig.from_settings(self.settings, predict_route=predict_route_from_env())
        self.loop.add_poll_listener(self._update_gate)
        self.loop.add_poll_listener(self._check_hung)
        self.loop.queued = self._queued_head
        self.gate.on_wait = self.loop.poll_soon
        host, port = split_host_port(p.listen)
        app = make_proxy_app(config, self.gate, self.metrics.registry)
        self.proxy = app[PROXY_KEY]
        self.proxy.state.comes_back = self._server_comes_back
        if self.supervisor is not None:
            supervisor = self.supervisor
            self.proxy.state.restarts = lambda: supervisor.status.restarts
            if supervisor.status.failure is not None:  # gave up while the proxy was starting
                self.proxy.fail(supervisor.status.failure)
        self.proxy.endpoint = EndpointMetrics(
            self.endpoint_sample,
            vllm_names=p.metrics_compat is MetricsCompat.VLLM,
            poll_interval_s=self.settings.loop.poll_interval_s,
        )
        tls = tls_context(
            str(p.tls_cert_file) if p.tls_cert_file else None, str(p.tls_key_file) if p.tls_key_file else None
        )
        if self.link is not None:
            self._proxy_cleanup = await self._keep(app)
        else:
            self._proxy_cleanup = await run_site(app, host, port, tls)
        log.info(
            "proxy.started",
            listen=p.listen,
            tls=tls is not None,
            auth="kvctl keys" if config.api_keys else "server key" if config.upstream_api_key else "none",
            keys=len(config.api_keys),
        )

    async def _keep(self, app: web.Application) -> Callable[[], Awaitable[None]]:
        """Serve the requests the keeper passes in, and the responses a previous worker began."""
        assert self.link is not None and self.proxy is not None
        return await self.proxy.kept(self.link).serve(app, self.settings.proxy.max_body_bytes)

    async def _refuse_router(self) -> None:
        """A server in router mode (several models) has no /kv or parking of its own: each child has. Refuse it."""
        while True:
            try:
                props = await self.client.props()
            except UpstreamError:
                await asyncio.sleep(1.0)
                continue
            if props.get("role") == "router":
                raise RouterMode(
                    "llama-server runs in router mode (several models): /kv and parking are per child, so kvctl "
                    "must front each child server instead"
                )
            await asyncio.Event().wait()  # checked: nothing more to do

    async def _notify_systemd(self) -> None:
        """Type=notify: READY=1 once the proxy listens and a poll was answered, then WATCHDOG=1 while the loop runs."""
        sock = notify_socket()
        if sock is None:
            await asyncio.Event().wait()  # not under systemd: nothing to do, ever
            return
        answered = asyncio.Event()
        self.loop.add_poll_listener(lambda: answered.set() if self.loop.state.polls > 0 else None)
        await answered.wait()
        if sd_notify(sock, b"READY=1\nSTATUS=kvctl is polling llama-server"):
            log.info("systemd.ready")
        interval = watchdog_interval_s()
        while True:
            await asyncio.sleep(interval)
            if self._loop_alive() and not self.loop.stalled(interval * 2):
                sd_notify(sock, b"WATCHDOG=1")

    def _keeper_lost(self) -> None:
        """The keeper died (the one case documented as lost): its clients' connections went with it, so this worker
        goes too, at once, as the whole of kvctl did before the keeper (a spawned server with it, SIGKILL)."""
        log.error("keeper.lost", reason="the keeper process exited: every client connection is gone")
        if self.supervisor is not None:
            self.supervisor.kill_now()
        os._exit(1)

    async def _keeper_hello(self) -> list[socket.socket]:
        """The keeper binds the listeners (once, for every worker) and says when this worker takes over: at once,
        or, on a reload, once the worker before it is gone."""
        assert self.link is not None
        self.link.on_lost = self._keeper_lost
        self.link.start()
        admin = await self.link.hello(
            split_host_port(self.settings.proxy.listen),
            split_host_port(self.settings.admin.listen),
            self.settings.keeper.poison_window_s,
        )
        go, fds = await self.link.ready()
        if self.supervisor is not None:
            self.supervisor.adopt, self.supervisor.adopt_fds = go.get("server") or None, fds  # still running
        else:
            for fd in fds:
                os.close(fd)
        # where this worker's code is, which an upgrade changes (pip install, then kvctl reload)
        log.info("keeper.took_over", source=_SOURCE)
        return admin

    async def run(self, stop: asyncio.Event) -> int:
        host, port = split_host_port(self.settings.admin.listen)
        runner = web.AppRunner(
            make_admin_app(
                self.settings,
                self.loop,
                supervisor=self.supervisor,
                loop_alive=self._loop_alive,
                draining=lambda: self.proxy is not None and self.proxy.draining,
                restart_server=self.restart_server if self.planned is not None else None,
                drain=self.drain,
                keeper=self.link,
            ),
            handle_signals=False,
            access_log=None,
        )
        await runner.setup()
        tasks: dict[str, asyncio.Task[None]] = {}
        try:
            try:
                if self.link is not None:
                    for sock in await self._keeper_hello():
                        await web.SockSite(runner, sock).start()
                else:
                    await web.TCPSite(runner, host, port).start()
            except (OSError, KeeperError) as e:
                log.error("admin.listen_failed", listen=self.settings.admin.listen, error=str(e))
                return 1
            self.admin_addresses = [f"{a[0]}:{a[1]}" for a in runner.addresses if isinstance(a, tuple)]
            log.info(
                "kvctl.started",
                upstream=str(self.settings.upstream.url),
                admin=self.admin_addresses,
                spawn=self.supervisor is not None,
                policy=self.settings.policy.model_dump(mode="json"),
            )
            if self.supervisor is not None:
                tasks["supervisor"] = asyncio.create_task(self._supervise(), name="supervisor")
            self._loop_task = tasks["control loop"] = asyncio.create_task(self.loop.run(), name="control loop")
            try:
                await self._start_proxy()
            except OSError as e:
                log.error("proxy.listen_failed", listen=self.settings.proxy.listen, error=str(e))
                return 1
            tasks["systemd notify"] = asyncio.create_task(self._notify_systemd(), name="systemd notify")
            tasks["router check"] = asyncio.create_task(self._refuse_router(), name="router check")
            self.started.set()
            stopper = asyncio.create_task(stop.wait(), name="stop flag")
            flags = [stopper]
            if self.supervisor is not None and self.settings.supervisor.exit_on_failed:
                flags.append(asyncio.create_task(self.supervisor.failed.wait(), name="server failed flag"))
            done, _ = await asyncio.wait([*flags, *tasks.values()], return_when=asyncio.FIRST_COMPLETED)
            for flag in flags:
                flag.cancel()
            code = 0
            if len(flags) > 1 and flags[1] in done:
                log.error("kvctl.server_failed", reason=self.supervisor.status.failure if self.supervisor else None)
                code = EXIT_SERVER_FAILED
            for name, task in tasks.items():
                if task in done:
                    # root tasks run until cancelled: one that ended is a bug, and the process goes down with it
                    exc = task.exception() if not task.cancelled() else None
                    if isinstance(exc, RouterMode):
                        log.error("kvctl.refused", reason=str(exc))
                        code = 2
                        continue
                    log.error("kvctl.task_ended", task=name, error=repr(exc) if exc else None)
                    code = 1
            return code
        finally:
            log.info("kvctl.stopping")
            if self.proxy is not None and self.settings.proxy.drain_peers and not self.proxy.drainer.done:
                # peers configured: the requests move there first, and the server stops once it holds none
                with contextlib.suppress(KvctlError):
                    await self.drain(None)
            if self.proxy is not None:
                # readiness turns 503 and new requests get 503 at once; open ones get proxy.drain_s to finish
                # (counted from a drain to peers, when one ran: it is the moved streams' time too)
                t0 = time.monotonic()
                began = self.proxy.drainer.started
                budget = self.settings.proxy.drain_s - (t0 - began if began is not None else 0.0)
                ended = await self.proxy.drain(max(0.0, budget))
                log.info("proxy.drained", ended=ended, after_s=round(time.monotonic() - t0, 3))
            if self.supervisor is not None:
                await self.supervisor.stop()  # the server last: the drain needed it
            for task in tasks.values():
                task.cancel()
            for task in tasks.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(task, self.settings.supervisor.stop_timeout_s + 5)
            if self._proxy_cleanup is not None:
                await self._proxy_cleanup()
            await runner.cleanup()
            await self.client.close()
            self.gpu.close()
            log.info("kvctl.stopped")
