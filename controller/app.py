"""kvctl's process: the control loop, the admin listener and, with ``--spawn``, the supervisor.

Root tasks are created by name and guarded: a root task that ends on its own is logged and stops
the process in bounded steps (the supervisor's server first, then the loop, then the listeners),
as does SIGTERM or SIGINT.
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

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from controller.admin import make_admin_app
from controller.loop import ControlLoop
from controller.metrics import Metrics
from controller.probes import GpuProbe
from controller.proxy import AdmissionGate, ProxyConfig, make_proxy_app
from controller.proxy.app import run_site
from controller.settings import LogFormat, LogSettings, Settings, split_host_port
from controller.supervisor import Supervisor
from controller.upstream import UpstreamClient

__all__ = ["App", "configure_logging"]

log = structlog.get_logger("kvctl.app")


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
    sock.connect(addr)
    sock.setblocking(False)
    return sock


def watchdog_interval_s() -> float:
    """Half of systemd's WatchdogSec ($WATCHDOG_USEC), or 10 s when no watchdog is set."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    return int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 else 10.0


class App:
    """Everything ``kvctl run`` starts; ``run()`` returns when ``stop`` is set or a root task fails."""

    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        self.settings = settings
        self.metrics = Metrics(registry if registry is not None else CollectorRegistry())
        self.client = UpstreamClient(
            str(settings.upstream.url), api_key=settings.upstream.api_key, timeout_s=settings.upstream.timeout_s
        )
        self.gpu = GpuProbe()
        self.loop = ControlLoop(self.client, settings, self.metrics, gpu=self.gpu)
        self.supervisor: Supervisor | None = None
        if settings.supervisor.spawn:
            self.supervisor = Supervisor(settings, self.metrics, on_start=self._server_started)
        self.admin_addresses: list[str] = []
        self.gate = AdmissionGate()
        self._proxy_cleanup: Callable[[], Awaitable[None]] | None = None
        self.started = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    def _server_started(self) -> None:
        self.loop.forget("the supervised server (re)started")

    def _loop_alive(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    def _update_gate(self) -> None:
        """After every poll: what the policy says about new requests becomes the proxy's gate."""
        verdict = self.loop.admission(self.settings.proxy.admission_reserve_cells)
        if verdict is None:
            self.gate.refuse_reason = f"llama-server is not answering ({self.loop.state.last_error})"
            self.gate.update(None)
            return
        self.gate.refuse_reason = None
        self.gate.update(
            None if verdict.admit else verdict.reason,
            verdict.allowance,
            self.loop.state.snapshot_asked_monotonic,
            room_cells=verdict.room_cells,
            empty=verdict.empty,
        )

    async def _start_proxy(self) -> None:
        """The client-facing reverse proxy: relays to the upstream, asks the gate before admitting."""
        p = self.settings.proxy
        config = ProxyConfig(
            upstream=str(self.settings.upstream.url).rstrip("/"),
            upstream_api_key=self.settings.upstream.api_key.get_secret_value()
            if self.settings.upstream.api_key
            else None,
            heartbeat_s=p.heartbeat_s,
            queue_grace_s=p.queue_grace_s,
            queue_depth=p.queue_depth,
            queue_timeout_s=p.queue_timeout_s,
            write_timeout_s=p.write_timeout_s,
            max_body_bytes=p.max_body_bytes,
            connect_timeout_s=self.settings.upstream.timeout_s,
            expose_private_routes=p.expose_private_routes,
            retry_after_s=p.retry_after_s,
            reserve_cells=p.admission_reserve_cells,
        )
        self.loop.add_poll_listener(self._update_gate)
        self.gate.on_wait = self.loop.poll_soon
        host, port = split_host_port(p.listen)
        self._proxy_cleanup = await run_site(make_proxy_app(config, self.gate, self.metrics.registry), host, port)
        log.info("proxy.started", listen=p.listen)

    async def _notify_systemd(self) -> None:
        """Type=notify: READY=1 once the proxy listens and a poll was answered, then WATCHDOG=1 while the loop runs."""
        sock = notify_socket()
        if sock is None:
            await asyncio.Event().wait()  # not under systemd: nothing to do, ever
            return
        answered = asyncio.Event()
        self.loop.add_poll_listener(lambda: answered.set() if self.loop.state.polls > 0 else None)
        await answered.wait()
        sock.send(b"READY=1\nSTATUS=kvctl is polling llama-server")
        log.info("systemd.ready")
        interval = watchdog_interval_s()
        while True:
            await asyncio.sleep(interval)
            if self._loop_alive() and time.monotonic() - self.loop.state.heartbeat_monotonic < interval * 2:
                sock.send(b"WATCHDOG=1")

    async def run(self, stop: asyncio.Event) -> int:
        host, port = split_host_port(self.settings.admin.listen)
        runner = web.AppRunner(
            make_admin_app(self.settings, self.loop, supervisor=self.supervisor, loop_alive=self._loop_alive),
            handle_signals=False,
            access_log=None,
        )
        await runner.setup()
        tasks: dict[str, asyncio.Task[None]] = {}
        try:
            try:
                await web.TCPSite(runner, host, port).start()
            except OSError as e:
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
                tasks["supervisor"] = asyncio.create_task(self.supervisor.run(), name="supervisor")
            self._loop_task = tasks["control loop"] = asyncio.create_task(self.loop.run(), name="control loop")
            try:
                await self._start_proxy()
            except OSError as e:
                log.error("proxy.listen_failed", listen=self.settings.proxy.listen, error=str(e))
                return 1
            tasks["systemd notify"] = asyncio.create_task(self._notify_systemd(), name="systemd notify")
            self.started.set()
            stopper = asyncio.create_task(stop.wait(), name="stop flag")
            done, _ = await asyncio.wait([stopper, *tasks.values()], return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            code = 0
            for name, task in tasks.items():
                if task in done:
                    # root tasks run until cancelled: one that ended is a bug, and the process goes down with it
                    exc = task.exception() if not task.cancelled() else None
                    log.error("kvctl.task_ended", task=name, error=repr(exc) if exc else None)
                    code = 1
            return code
        finally:
            log.info("kvctl.stopping")
            if self.supervisor is not None:
                await self.supervisor.stop()
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
