"""The admin listener: status, metrics, probes, and manual park/resume overrides.

| route | what |
|---|---|
| ``GET /status`` | the Status model (controller.admin.status) as JSON |
| ``GET /metrics`` | kvctl's own Prometheus metrics |
| ``GET /healthz`` | liveness: the process and its control loop run (200/503) |
| ``GET /readyz`` | readiness: upstream up and the pool not saturated, with hysteresis (200/503) |
| ``POST /slots/{id}/park`` | park the slot's request and pin it: the policy leaves it parked (``?mode=``: see below) |
| ``POST /slots/{id}/resume`` | resume it (and unpin) |
| ``POST /server/restart`` | restart the spawned server, optionally with a new command line, continuing every request |
| ``POST /drain`` | move every request to peers (``{"peers": [...]}``, or ``proxy.drain_peers``), stop the server |

A park goes by the server's choice of mode (swap when the snapshot fits its ``--park-ram``, else recompute)
unless ``?mode=swap`` or ``?mode=recompute`` asks for one; an explicit swap that does not fit is the server's 503.

With ``admin.token`` set, every route but the two probes needs ``Authorization: Bearer TOKEN``.
Errors use the OpenAI envelope, ``code`` being kvctl's reason code, with ``X-Kvctl-Error: <code>`` (and, for one
more release, ``X-Kvctl-Origin: kvctl``), so they are told apart from the server's (controller.errors).
"""

from __future__ import annotations

import hmac
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import structlog
from aiohttp import web
from prometheus_client.aiohttp import make_aiohttp_handler

from controller.admin.models import KeeperView, ManualAction, Status
from controller.admin.status import build_status
from controller.errors import ORIGIN_HEADER, Code, KvctlError, admin_error_response
from controller.httputil import unsupported_expect
from controller.loop.control import ControlLoop
from controller.metrics import kvctl_version
from controller.policy.types import PolicyConfig
from controller.settings import Settings
from controller.upstream.models import ParkMode, SlotState
from controller.upstream.supervisor import Supervisor, SupervisorState

__all__ = ["Readiness", "make_admin_app"]

log = structlog.get_logger("kvctl.admin")

LOOP_STALL_S = 30.0  # an iteration takes a few polls' timeouts plus the longest back-off, or a park's own timeout


@dataclass(slots=True)
class Readiness:
    """Ready when the upstream is up and the pool is not saturated, with hysteresis.

    Saturated: requests wait to be restored and the pool is above LOW, so nothing more can start.
    It must last ``unready_after_s`` to turn readiness off, and relief (nobody waiting, or the pool
    at or below LOW) must last ``ready_after_s`` to turn it on again. A lost upstream turns it off
    at once; the first time the upstream is seen up, it turns on at once.
    """

    unready_after_s: float
    ready_after_s: float
    ready: bool = False
    _saturated_since: float | None = None
    _relieved_since: float | None = None
    _held_back: bool = False  # made unready by saturation: coming back needs sustained relief

    def update(self, upstream_up: bool, saturated: bool, now: float) -> bool:
        if not upstream_up:
            self.ready, self._held_back = False, False
            self._saturated_since = self._relieved_since = None
            return False
        if saturated:
            self._relieved_since = None
            if self._saturated_since is None:
                self._saturated_since = now
            if self.ready and now - self._saturated_since >= self.unready_after_s:
                self.ready, self._held_back = False, True
            elif not self.ready and not self._held_back and now - self._saturated_since >= self.unready_after_s:
                self._held_back = True
        else:
            self._saturated_since = None
            if self._relieved_since is None:
                self._relieved_since = now
            if not self.ready and (not self._held_back or now - self._relieved_since >= self.ready_after_s):
                self.ready, self._held_back = True, False
        return self.ready


def _saturated(loop: ControlLoop, config: PolicyConfig) -> bool:
    kv = loop.state.snapshot
    decision = loop.state.decision
    if kv is None or decision is None:
        return False
    waiting = any(
        s.state is SlotState.PARKED
        and not (s.id_task is not None and s.id_task in loop.state.history and loop.state.history[s.id_task].pinned)
        for s in kv.slots
    )
    return waiting and decision.pressure.value > config.low


@dataclass(frozen=True, slots=True)
class _Verdict:
    ready: bool
    degraded: bool
    problems: list[str]


@dataclass(slots=True)
class _Admin:
    settings: Settings
    loop: ControlLoop
    supervisor: Supervisor | None
    loop_alive: Callable[[], bool]
    readiness: Readiness
    draining: Callable[[], bool] = lambda: False
    restart_server: RestartServer | None = None
    drain: DrainReplica | None = None
    keeper: KeeperControl | None = None
    started: float = field(default_factory=time.monotonic)
    _above_high_since: float | None = None

    def _above_high_s(self, now: float) -> float | None:
        """Track how long the pressure has stayed at or above HIGH, from the last decision."""
        state = self.loop.state
        decision = state.decision
        if not state.upstream_up or decision is None or decision.pressure.value < self.loop.config.high:
            self._above_high_since = None
            return None
        if self._above_high_since is None:
            self._above_high_since = now
        return now - self._above_high_since

    def evaluate(self) -> _Verdict:
        state = self.loop.state
        now = time.monotonic()
        ready = self.readiness.update(state.upstream_up, _saturated(self.loop, self.loop.config), now)
        above_high = self._above_high_s(now)
        problems = []
        degraded = False
        if not state.upstream_up:
            problems.append(f"upstream down: {state.last_error or 'not polled yet'}")
            degraded = True
        elif not ready:
            problems.append("saturated: parked requests wait and the pool is above LOW")
        limit = self.settings.admin.degraded_after_s
        if above_high is not None and above_high >= limit:
            problems.append(f"pressure at or above HIGH for {above_high:.0f} s (admin.degraded_after_s: {limit:g} s)")
            degraded = True
        if not self.loop_healthy():
            problems.append("control loop not running")
            degraded = True
        if self.supervisor is not None and self.supervisor.status.failure is not None:
            problems.append(f"supervised server failed: {self.supervisor.status.failure}")
            degraded = True
        elif self.supervisor is not None and self.supervisor.status.state is not SupervisorState.READY:
            problems.append(f"supervised server {self.supervisor.status.state}")
            degraded = True
        if self.draining():
            problems.append("shutting down: new requests are refused while open ones finish")
            ready = False
        return _Verdict(ready and self.loop_healthy(), degraded, problems)

    def _keeper_view(self) -> KeeperView | None:
        k = self.keeper
        if k is None:
            return None
        return KeeperView(
            pid=os.getpid(),
            reloads_failed=k.reloads_failed,
            last_reload_error=k.reload_error,
            listen_unchanged=k.listen_unchanged,
        )

    def loop_healthy(self) -> bool:
        return self.loop_alive() and not self.loop.stalled(LOOP_STALL_S)

    def status(self) -> Status:
        verdict = self.evaluate()
        now = time.monotonic()
        return build_status(
            version=kvctl_version(),
            url=str(self.settings.upstream.url),
            state=self.loop.state,
            config=self.loop.config,
            loop_alive=self.loop_healthy(),
            ready=verdict.ready,
            degraded=verdict.degraded,
            problems=verdict.problems,
            supervisor=self.supervisor.status if self.supervisor is not None else None,
            uptime_s=now - self.started,
            failed_after=self.settings.supervisor.failed_after,
            above_high_s=now - self._above_high_since if self._above_high_since is not None else None,
            keeper=self._keeper_view(),
        )


RestartServer = Callable[[list[str] | None, bool], Awaitable[dict[str, Any]]]
"""A planned restart of the spawned server (controller.planned): the new command line or None, force; the answer's
body, or KvctlError."""


class KeeperControl(Protocol):
    """The worker's link to the keeper, as the admin API uses it (controller.keeper_link)."""

    reloads_failed: int
    reload_error: str | None
    listen_unchanged: str | None

    def reload(self, environment: dict[str, str] | None = None) -> None: ...


DrainReplica = Callable[[list[str] | None], Awaitable[dict[str, Any]]]
"""A drain to peers (controller.proxy.drain): the peers or None (proxy.drain_peers); the answer's body, or
KvctlError."""

_ADMIN = web.AppKey("admin", _Admin)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def make_admin_app(
    settings: Settings,
    loop: ControlLoop,
    *,
    supervisor: Supervisor | None = None,
    loop_alive: Callable[[], bool] = lambda: True,
    draining: Callable[[], bool] = lambda: False,
    restart_server: RestartServer | None = None,
    drain: DrainReplica | None = None,
    keeper: KeeperControl | None = None,
) -> web.Application:
    token = settings.admin.token.get_secret_value() if settings.admin.token is not None else None

    @web.middleware
    async def envelope(request: web.Request, handler: Handler) -> web.StreamResponse:
        """aiohttp's own answers (no such route, wrong method, body too large) in the same envelope as ours."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            message = f"{request.method} {request.path}: {e.reason}"
            resp = admin_error_response(e.status, message, "http_" + str(e.status))
            if "Allow" in e.headers:
                resp.headers["Allow"] = e.headers["Allow"]
            return resp

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is not None and request.path not in ("/healthz", "/readyz"):
            # surrogateescape: a header that is not UTF-8 must fail the comparison, not the handler
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, f"Bearer {token}".encode()):
                return admin_error_response(401, "a bearer token is required", Code.UNAUTHORIZED)
        return await handler(request)

    app = web.Application(middlewares=[envelope, auth])
    admin = _Admin(
        settings,
        loop,
        supervisor,
        loop_alive,
        Readiness(settings.admin.unready_after_s, settings.admin.ready_after_s),
        draining,
        restart_server,
        drain,
        keeper,
    )
    app[_ADMIN] = admin
    loop.add_poll_listener(admin.evaluate)  # readiness' timers follow every poll, not only probe calls
    metrics_handler = make_aiohttp_handler(loop.metrics.registry)
    app.router.add_get("/status", _status, expect_handler=_expect)
    app.router.add_get("/metrics", metrics_handler, expect_handler=_expect)
    app.router.add_get("/healthz", _healthz, expect_handler=_expect)
    app.router.add_get("/readyz", _readyz, expect_handler=_expect)
    app.router.add_post("/slots/{id}/park", _manual, expect_handler=_expect)
    app.router.add_post("/slots/{id}/resume", _manual, expect_handler=_expect)
    app.router.add_post("/server/restart", _restart_server, expect_handler=_expect)
    app.router.add_post("/drain", _drain, expect_handler=_expect)
    app.router.add_post("/reload", _reload, expect_handler=_expect)
    app.router.add_route("*", "/{tail:.*}", _no_route, expect_handler=_expect)  # last: what no route above takes
    return app


async def _expect(request: web.Request) -> web.StreamResponse | None:
    value = await unsupported_expect(request)
    if value is None:
        return None
    return admin_error_response(417, f"unsupported Expect header {value!r}", Code.EXPECTATION_FAILED)


async def _no_route(request: web.Request) -> web.StreamResponse:
    """A path no route takes: 405 when another route has it with another method, 404 otherwise."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource is not request.match_info.route.resource:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


async def _status(request: web.Request) -> web.StreamResponse:
    status = request.app[_ADMIN].status()
    return web.Response(text=status.model_dump_json(), content_type="application/json")


async def _healthz(request: web.Request) -> web.StreamResponse:
    if request.app[_ADMIN].loop_healthy():
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "control loop not running"}, status=503)


async def _readyz(request: web.Request) -> web.StreamResponse:
    verdict = request.app[_ADMIN].evaluate()
    if verdict.ready:
        return web.json_response({"status": "ready"})
    return web.json_response({"status": "not ready", "problems": verdict.problems}, status=503)


async def _manual(request: web.Request) -> web.StreamResponse:
    admin = request.app[_ADMIN]
    raw = request.match_info["id"]
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9:  # str.isdigit() also takes '①' and '٣'
        return admin_error_response(400, f"invalid slot id {raw!r}: expected a non-negative integer", Code.INVALID_SLOT)
    action = ManualAction.PARK if request.path.endswith("/park") else ManualAction.RESUME
    mode: ParkMode | None = None
    if "mode" in request.query:
        raw_mode = request.query["mode"]
        if action is not ManualAction.PARK or raw_mode not in {m.value for m in ParkMode}:
            message = f"invalid mode {raw_mode!r}: a park takes {', '.join(ParkMode)}"
            return admin_error_response(400, message, Code.INVALID_MODE)
        mode = ParkMode(raw_mode)
    try:
        result = await admin.loop.manual(action, int(raw), mode=mode)
    except KvctlError as e:
        log.warning("manual.failed", action=str(action), slot=int(raw), status=e.status, code=e.code, error=e.message)
        return admin_error_response(e.status, e.message, e.code, e.retry_after_s)
    log.info("manual.done", action=str(action), slot=result.slot, id_task=result.id_task, pinned=result.pinned)
    return web.json_response(result.model_dump(mode="json"), headers={ORIGIN_HEADER: "kvctl"})


async def _json_body(request: web.Request, keys: set[str], takes: str, code: Code) -> dict[str, Any] | web.Response:
    """An admin action's optional body: a JSON object with no names but ``keys`` (none: ``{}``), or the 400 to answer
    with ``code``, whose message says the body takes ``takes``."""
    raw = await request.read()
    try:
        body = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return admin_error_response(400, "the body must be a JSON object", code)
    if not isinstance(body, dict) or set(body) - keys:
        return admin_error_response(400, f"the body takes only {takes}", code)
    return body


async def _restart_server(request: web.Request) -> web.StreamResponse:
    """``POST /server/restart`` with an optional ``{"argv": [...], "force": false}``: controller.planned."""
    admin = request.app[_ADMIN]
    if admin.restart_server is None:
        message = "kvctl attaches to this server (no --spawn): restart it yourself; kvctl holds requests meanwhile"
        return admin_error_response(409, message, Code.NOT_SPAWNED)
    body = await _json_body(request, {"argv", "force"}, '"argv" (a list of strings) and "force"', Code.INVALID_ARGV)
    if isinstance(body, web.StreamResponse):
        return body
    argv, force = body.get("argv"), body.get("force", False)
    if argv is not None and not (isinstance(argv, list) and argv and all(isinstance(a, str) and a for a in argv)):
        return admin_error_response(400, '"argv" must be a non-empty list of non-empty strings', Code.INVALID_ARGV)
    if not isinstance(force, bool):
        return admin_error_response(400, '"force" must be true or false', Code.INVALID_ARGV)
    try:
        answer = await admin.restart_server(argv, force)
    except KvctlError as e:
        log.warning("restart.refused", status=e.status, code=e.code, error=e.message)
        return admin_error_response(e.status, e.message, e.code, e.retry_after_s)
    return web.json_response(answer, headers={ORIGIN_HEADER: "kvctl"})


async def _reload(request: web.Request) -> web.StreamResponse:
    """``POST /reload`` with an optional ``{"environment": {"KVCTL_...": "..."}}``: the keeper starts a new worker (the
    code and settings as they are now, with those variables in place of the KVCTL_ ones it has), which takes over
    every connection once it is ready. Answers at once (202) with this worker's pid."""
    admin = request.app[_ADMIN]
    if admin.keeper is None:
        message = "kvctl runs without its keeper (proxy.keeper off, or TLS on the listener): restart it instead"
        return admin_error_response(409, message, Code.NO_KEEPER)
    takes = '"environment": an object of KVCTL_* names to strings'
    body = await _json_body(request, {"environment"}, takes, Code.INVALID_ENVIRONMENT)
    if isinstance(body, web.StreamResponse):
        return body
    env = body.get("environment")
    if env is not None and not (
        isinstance(env, dict)
        and all(isinstance(k, str) and k.startswith("KVCTL_") and isinstance(v, str) for k, v in env.items())
    ):
        return admin_error_response(400, f"the body takes only {takes}", Code.INVALID_ENVIRONMENT)
    admin.keeper.reload(env)
    log.info("reload.asked", environment=sorted(env) if env is not None else None)  # names only: values hold keys
    return web.json_response({"reloading": True, "pid": os.getpid()}, status=202, headers={ORIGIN_HEADER: "kvctl"})


async def _drain(request: web.Request) -> web.StreamResponse:
    """``POST /drain`` with an optional ``{"peers": ["http://host:port", ...]}``: controller.proxy.drain."""
    admin = request.app[_ADMIN]
    if admin.drain is None:
        return admin_error_response(409, "this kvctl has no proxy to drain", Code.SERVER_NOT_READY)
    body = await _json_body(request, {"peers"}, '"peers" (a list of URLs)', Code.INVALID_PEERS)
    if isinstance(body, web.StreamResponse):
        return body
    peers = body.get("peers")
    if peers is not None and not (isinstance(peers, list) and all(isinstance(p, str) and _http_url(p) for p in peers)):
        message = '"peers" must be a list of http(s) URLs of other kvctl listeners, e.g. "http://10.0.0.7:8080"'
        return admin_error_response(400, message, Code.INVALID_PEERS)
    try:
        answer = await admin.drain(peers or None)
    except KvctlError as e:
        log.warning("drain.refused", status=e.status, code=e.code, error=e.message)
        return admin_error_response(e.status, e.message, e.code, e.retry_after_s)
    return web.json_response(answer, headers={ORIGIN_HEADER: "kvctl"})


def _http_url(value: str) -> bool:
    parts = urlsplit(value)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and not parts.query and not parts.fragment
