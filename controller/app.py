"""kvctl's process: the control loop, the admin listener and, with ``--spawn``, the supervisor.

Root tasks are created by name and guarded: a root task that ends on its own is logged and stops
the process in bounded steps (the supervisor's server first, then the loop, then the listeners),
as does SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from controller.admin import make_admin_app
from controller.loop import ControlLoop
from controller.metrics import Metrics
from controller.probes import GpuProbe
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
        self.started = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    def _server_started(self) -> None:
        self.loop.forget("the supervised server (re)started")

    def _loop_alive(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done()

    async def _start_proxy(self) -> None:
        """Hook for the client-facing reverse proxy (controller/proxy, its own issue).

        It will listen on ``settings.proxy.listen``, relay to the upstream and ask
        ``controller.policy.admission`` before admitting a request. Until it is wired here,
        clients talk to the server directly and the controller only parks and resumes.
        """
        log.info("proxy.not_started", listen=self.settings.proxy.listen, reason="not wired into kvctl run yet")

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
            await self._start_proxy()
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
            await runner.cleanup()
            await self.client.close()
            self.gpu.close()
            log.info("kvctl.stopped")
