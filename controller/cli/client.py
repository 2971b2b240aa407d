"""The client commands (``status``, ``park``, ``resume``): the admin API over HTTP, with their exit codes."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import BaseModel, TypeAdapter, ValidationError

from controller.admin.models import ManualResult, Status
from controller.cli.render import human_bytes, render_status, utf8_stream
from controller.settings import split_host_port

EXIT_OK, EXIT_DEGRADED, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_UNKNOWN = 0, 1, 2, 3, 4

STATUS_TIMEOUT_S = 5.0
MANUAL_TIMEOUT_S = 15.0  # the admin API gives the loop 10 s to carry out a park or resume
CLEAR_SCREEN = "\x1b[H\x1b[2J"


# --- clients of the admin API ----------------------------------------------------------------------


def admin_url(listen: str) -> str:
    """The URL to reach an admin listener at ``listen``; a wildcard address is reached over loopback."""
    host, port = split_host_port(listen)
    if port == 0:
        raise ValueError(f"{listen!r} has port 0 (a free port picked at start)")
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "*": "127.0.0.1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


class _Failure(Exception):
    """A client command that got no usable answer; ``code`` is its exit code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Admin:
    base: str
    token: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def request(
        self, session: aiohttp.ClientSession, method: str, path: str, body: Any = None
    ) -> tuple[int, str]:
        try:
            async with session.request(method, self.base + path, headers=self.headers, json=body) as resp:
                return resp.status, (await resp.read()).decode(errors="replace")
        except (aiohttp.ClientError, TimeoutError) as e:
            raise _Failure(EXIT_NOT_RUNNING, f"not reachable at {self.base}: {e or type(e).__name__}") from None

    def refused_token(self, code: int) -> _Failure | None:
        if code != 401:
            return None
        hint = "the token was refused" if self.token else "pass --token or set KVCTL_ADMIN__TOKEN"
        return _Failure(EXIT_UNKNOWN, f"{self.base} needs the admin bearer token: {hint}")


@dataclass(frozen=True, slots=True)
class _Fetched:
    status: Status
    body: str
    """The JSON as served: what --json prints."""


async def _fetch_status(session: aiohttp.ClientSession, admin: Admin) -> _Fetched:
    code, body = await admin.request(session, "GET", "/status")
    if (failure := admin.refused_token(code)) is not None:
        raise failure
    if code != 200:
        raise _Failure(EXIT_UNKNOWN, f"{admin.base}/status answered {code}: {body[:200]}")
    try:
        status = Status.model_validate_json(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise _Failure(
            EXIT_UNKNOWN, f"unreadable status from {admin.base}: {first['msg']}" + (f" at {where}" if where else "")
        ) from None
    return _Fetched(status, body)


def _exit_code(status: Status) -> int:
    return EXIT_DEGRADED if status.degraded else EXIT_OK


def _session(timeout_s: float) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s))


async def show_status(admin: Admin, as_json: bool) -> int:
    async with _session(STATUS_TIMEOUT_S) as session:
        try:
            got = await _fetch_status(session, admin)
        except _Failure as e:
            print(f"kvctl: {e}", file=sys.stderr)
            return e.code
    out = sys.stdout
    # --json prints it even when degraded: a script reads the model and the exit code
    out.write(got.body.rstrip("\n") + "\n" if as_json else render_status(got.status, unicode=utf8_stream(out)) + "\n")
    out.flush()
    return _exit_code(got.status)


async def watch(admin: Admin, interval_s: float) -> int:
    """Redraw until interrupted (main turns Ctrl-C into exit 0); an unreachable kvctl is shown, not fatal."""
    async with _session(min(STATUS_TIMEOUT_S, max(1.0, interval_s))) as session:
        while True:
            try:
                got = await _fetch_status(session, admin)
                frame = render_status(got.status, unicode=utf8_stream(sys.stdout))
            except _Failure as e:
                frame = f"kvctl: {e}"
            out = sys.stdout
            stamp = time.strftime("%H:%M:%S")
            out.write(CLEAR_SCREEN if out.isatty() else "\n")
            out.write(f"every {interval_s:g} s, Ctrl-C to stop    {stamp}\n\n{frame}\n")
            out.flush()
            await asyncio.sleep(interval_s)


class _ErrorBody(BaseModel):
    message: str


class _ErrorEnvelope(BaseModel):
    error: _ErrorBody


_MANUAL_ANSWER: TypeAdapter[ManualResult] = TypeAdapter(ManualResult)


def _manual_line(r: ManualResult) -> str:
    size = f"{r.n_cells} cells" + (f", {human_bytes(r.n_bytes)}" if r.n_bytes else "")
    if r.mode is not None:
        size += f", by {r.mode}"
    return f"slot {r.slot}: {r.detail} (task {r.id_task}, {size})"


async def _post(admin: Admin, path: str, body: Any, timeout_s: float) -> tuple[int, str] | int:
    """POST to the admin API: (status, body), or the exit code of a failure it has printed."""
    async with _session(timeout_s) as session:
        try:
            code, text = await admin.request(session, "POST", path, body)
            if (failure := admin.refused_token(code)) is not None:
                raise failure
        except _Failure as e:
            print(f"kvctl: {e}", file=sys.stderr)
            return e.code
    return code, text


async def manual(admin: Admin, action: str, slot: int, as_json: bool, mode: str | None = None) -> int:
    path = f"/slots/{slot}/{action}" + (f"?mode={mode}" if mode is not None else "")
    got = await _post(admin, path, None, MANUAL_TIMEOUT_S)
    if isinstance(got, int):
        return got
    code, body = got
    if code == 200:
        try:
            result = _MANUAL_ANSWER.validate_json(body)
        except ValidationError:
            print(f"kvctl: unreadable answer from {admin.base} ({code}): {body[:200]}", file=sys.stderr)
            return EXIT_UNKNOWN
        print(body.rstrip("\n") if as_json else _manual_line(result))
        return EXIT_OK
    return _refused(admin, code, body, f"kvctl {action} {slot}")


async def _counted(
    admin: Admin, path: str, body: dict[str, Any], timeout_s: float, what: str, line: str, as_json: bool
) -> int:
    """A restart or a drain: its answer's counts as ``line`` says them (or the JSON); 1 when some ``failed``."""
    got = await _post(admin, path, body, timeout_s)
    if isinstance(got, int):
        return got
    code, text = got
    if code != 200:
        return _refused(admin, code, text, what)
    try:
        answer = json.loads(text)
        shown = line.format(**answer)
        failed = answer["failed"]
    except (ValueError, KeyError, TypeError, AttributeError):
        print(f"kvctl: unreadable answer from {admin.base} ({code}): {text[:200]}", file=sys.stderr)
        return EXIT_UNKNOWN
    print(text.rstrip("\n") if as_json else shown)
    return EXIT_OK if not failed else EXIT_DEGRADED


RESTART_TIMEOUT_S = 900.0
"""A planned restart waits for the new server to load (supervisor.ready_timeout_s) and for every request to move."""


async def restart_server(admin: Admin, argv: list[str] | None, force: bool, as_json: bool) -> int:
    """``kvctl restart-server [--force] [-- ARGV...]``: POST /server/restart."""
    body: dict[str, Any] = {"force": force}
    if argv:
        body["argv"] = argv
    line = "restarted in {seconds} s: {moved} requests moved, {failed} not"
    return await _counted(admin, "/server/restart", body, RESTART_TIMEOUT_S, "kvctl restart-server", line, as_json)


DRAIN_TIMEOUT_S = 900.0
"""A drain waits for every request to move, or proxy.drain_s for those that finish here, then the server to stop."""


async def drain(admin: Admin, peers: list[str] | None, as_json: bool) -> int:
    """``kvctl drain [--to URL ...]``: POST /drain."""
    body: dict[str, Any] = {"peers": peers} if peers else {}
    line = "drained in {seconds} s: {moved} moved, {finished_here} finished here, {failed} failed"
    return await _counted(admin, "/drain", body, DRAIN_TIMEOUT_S, "kvctl drain", line, as_json)


def _refused(admin: Admin, code: int, text: str, what: str) -> int:
    """An admin API error answer: its message on stderr, and the exit code."""
    try:
        message = _ErrorEnvelope.model_validate_json(text).error.message
    except ValidationError:
        print(f"kvctl: unreadable answer from {admin.base} ({code}): {text[:200]}", file=sys.stderr)
        return EXIT_UNKNOWN
    print(f"{what}: refused: {message} ({code})", file=sys.stderr)
    return EXIT_DEGRADED


RELOAD_TIMEOUT_S = 120.0
"""A reload waits for the new worker to start (its imports, its settings) and take over."""


async def reload(admin: Admin, environment: dict[str, str] | None, as_json: bool) -> int:
    """``kvctl reload [--environment]``: POST /reload, then wait until another worker answers ``GET /status``."""
    got = await _post(admin, "/reload", {"environment": environment} if environment is not None else {}, 10.0)
    if isinstance(got, int):
        return got
    code, text = got
    if code != 202:
        return _refused(admin, code, text, "kvctl reload")
    old = json.loads(text)["pid"]
    deadline = time.monotonic() + RELOAD_TIMEOUT_S
    failed: int | None = None
    async with _session(STATUS_TIMEOUT_S) as session:
        while time.monotonic() < deadline:
            try:
                status = (await _fetch_status(session, admin)).status
            except _Failure:
                await asyncio.sleep(0.2)  # between the two workers
                continue
            keeper = status.keeper
            if keeper is None:
                break
            if failed is None:
                failed = keeper.reloads_failed
            if keeper.pid != old:
                shown = {
                    "reloaded": True,
                    "old_pid": old,
                    "pid": keeper.pid,
                    "listen_unchanged": keeper.listen_unchanged,
                }
                print(json.dumps(shown) if as_json else f"reloaded: worker {old} -> {keeper.pid}, no connection lost")
                if keeper.listen_unchanged is not None:
                    print(f"kvctl reload: {keeper.listen_unchanged} (systemctl restart kvctl)", file=sys.stderr)
                return EXIT_OK
            if keeper.reloads_failed > failed:
                print(f"kvctl reload: failed: {keeper.last_reload_error}; worker {old} serves on", file=sys.stderr)
                return EXIT_DEGRADED
            await asyncio.sleep(0.2)
    print(f"kvctl reload: no new worker within {RELOAD_TIMEOUT_S:g} s; worker {old} serves on", file=sys.stderr)
    return EXIT_DEGRADED
