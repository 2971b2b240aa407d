"""``kvctl run | status | park | resume``.

``status`` renders the admin API's ``GET /status`` model (controller.status) as text, or prints it
as served; the rendering lives here, the model stays data only. The client commands print text
on a terminal and the admin API's JSON otherwise (``--text`` and ``--json`` choose), and share
their exit codes (after LSB, see EPILOG).
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import structlog
from prometheus_client import disable_created_metrics
from pydantic import BaseModel, TypeAdapter, ValidationError

from controller.admin_models import ExitView, GpuDeviceView, ManualResult, PoolView, SlotView, Status
from controller.settings import Settings, SettingsError, deprecations, load_settings, split_host_port
from controller.upstream.models import ParkMode

__all__ = ["main", "render_status"]

EXIT_OK, EXIT_DEGRADED, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_UNKNOWN = 0, 1, 2, 3, 4

EPILOG = """exit codes:
  0  ok (status); done (park, resume)
  1  degraded (status): upstream down, loading or restarting, the control loop stalled, or the
     pool at or above HIGH for longer than admin.degraded_after_s; refused (park, resume)
  2  usage or invalid settings
  3  kvctl not running or its admin address unreachable; (run, with supervisor.exit_on_failed) the
     spawned server died before it was ready supervisor.failed_after times in a row
  4  unknown: an answer kvctl could not read, or the admin token was missing or wrong"""
CLIENT_EPILOG = (
    "output: text on a terminal, the admin API's JSON as served otherwise (--text, --json choose)\n\n" + EPILOG
)

STATUS_TIMEOUT_S = 5.0
MANUAL_TIMEOUT_S = 15.0  # the admin API gives the loop 10 s to carry out a park or resume
CLEAR_SCREEN = "\x1b[H\x1b[2J"


def _host_port(value: str) -> str:
    try:
        _, port = split_host_port(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if port == 0:
        raise argparse.ArgumentTypeError("port 0 is not an address to connect to")
    return value


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value!r}")
    return seconds


def _slot_id(value: str) -> int:
    if not (value.isascii() and value.isdigit()):  # str.isdigit() also takes '①', which int() refuses
        raise argparse.ArgumentTypeError(f"expected a slot id (0, 1, ...), got {value!r}")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvctl",
        description="Keep llama-server's chats alive when its unified KV pool fills: park and resume requests.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, help="TOML settings file (tables named after the settings groups)")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run", help="run the controller", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    run.add_argument("--upstream", metavar="URL", help="the patched llama-server (upstream.url)")
    run.add_argument("--listen", metavar="HOST:PORT", help="the client-facing proxy's address (proxy.listen)")
    run.add_argument("--admin", metavar="HOST:PORT", help="the admin listener's address (admin.listen)")
    run.add_argument(
        "--spawn",
        action="store_true",
        help="start and supervise the server: kvctl run --spawn -- llama-server ARGS...",
    )

    for name, text in (
        ("status", "print kvctl's status: upstream, pool, parked requests, memory and slots"),
        ("park", "park a slot's request and pin it (the policy leaves it parked)"),
        ("resume", "resume a slot's request (and unpin it)"),
    ):
        c = sub.add_parser(
            name,
            help=text,
            description=text,
            epilog=CLIENT_EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        c.add_argument(
            "--admin",
            metavar="HOST:PORT",
            type=_host_port,
            help="kvctl's admin address, as given to kvctl run --admin (default: admin.listen, KVCTL_ADMIN__LISTEN)",
        )
        c.add_argument("--token", help="admin bearer token (default: admin.token, KVCTL_ADMIN__TOKEN)")
        form = c.add_mutually_exclusive_group()
        form.add_argument(
            "--json",
            action="store_true",
            help="print the admin API's answer as served ("
            + ("GET /status" if name == "status" else f"POST /slots/ID/{name}")
            + "; the default when stdout is not a terminal)",
        )
        form.add_argument("--text", action="store_true", help="print the text view (the default on a terminal)")
        if name == "status":
            c.add_argument(
                "-w",
                "--watch",
                metavar="SECONDS",
                type=_seconds,
                help="redraw the text view every SECONDS until Ctrl-C (which exits 0); not with --json",
            )
        else:
            c.add_argument("slot", type=_slot_id, help="slot id")
        if name == "park":
            c.add_argument(
                "--mode",
                choices=[m.value for m in ParkMode],
                help="park by swap (a snapshot in host RAM) or by recompute (evaluated again on resume); "
                "default: the server's choice",
            )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    server_argv: list[str] | None = None
    if "--" in args_in:
        cut = args_in.index("--")
        args_in, server_argv = args_in[:cut], args_in[cut + 1 :]
    parser = _parser()
    try:
        args = parser.parse_args(args_in)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else EXIT_USAGE
    if args.command == "run":
        return _run(parser, args, server_argv)
    if server_argv is not None:
        print("kvctl: '--' is only for run --spawn", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "status" and args.watch is not None and args.json:
        print("kvctl status: --watch cannot be combined with --json", file=sys.stderr)
        return EXIT_USAGE
    try:
        settings = load_settings(args.config)
    except SettingsError as e:
        print(f"kvctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        base = admin_url(args.admin or settings.admin.listen)
    except ValueError as e:
        print(f"kvctl: invalid admin address: {e}; pass --admin HOST:PORT", file=sys.stderr)
        return EXIT_USAGE
    token = args.token or (settings.admin.token.get_secret_value() if settings.admin.token is not None else None)
    admin = _Admin(base, token)
    # text for a person at a terminal, the JSON as served for a pipe or a script
    as_json = args.json or (not args.text and not sys.stdout.isatty())
    if args.command == "status":
        if args.watch is not None:
            try:
                return asyncio.run(_watch(admin, args.watch))
            except KeyboardInterrupt:
                return EXIT_OK
        return asyncio.run(_status(admin, as_json))
    return asyncio.run(_manual(admin, args.command, args.slot, as_json, getattr(args, "mode", None)))


# --- run -------------------------------------------------------------------------------------------


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, server_argv: list[str] | None) -> int:
    if args.spawn and not server_argv:
        parser.print_usage(sys.stderr)
        print("kvctl run: --spawn needs the server's command line after '--'", file=sys.stderr)
        return EXIT_USAGE
    if server_argv is not None and not args.spawn:
        print("kvctl run: a command line after '--' needs --spawn", file=sys.stderr)
        return EXIT_USAGE
    overrides: dict[str, dict[str, Any]] = {}
    if args.upstream:
        overrides.setdefault("upstream", {})["url"] = args.upstream
    if args.listen:
        overrides.setdefault("proxy", {})["listen"] = args.listen
    if args.admin:
        overrides.setdefault("admin", {})["listen"] = args.admin
    if server_argv:
        overrides.setdefault("supervisor", {})["spawn"] = server_argv
    try:
        settings = load_settings(args.config, overrides)
    except SettingsError as e:
        print(f"kvctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    return asyncio.run(_serve(settings))


async def _serve(settings: Settings) -> int:
    from controller.app import App, configure_logging

    configure_logging(settings.log)
    for message in deprecations():
        structlog.get_logger("kvctl.settings").warning("settings.deprecated", message=message)
    disable_created_metrics()  # type: ignore[no-untyped-call]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return await App(settings).run(stop)


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
class _Admin:
    base: str
    token: str | None

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def request(self, session: aiohttp.ClientSession, method: str, path: str) -> tuple[int, str]:
        try:
            async with session.request(method, self.base + path, headers=self.headers) as resp:
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


async def _fetch_status(session: aiohttp.ClientSession, admin: _Admin) -> _Fetched:
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


async def _status(admin: _Admin, as_json: bool) -> int:
    async with _session(STATUS_TIMEOUT_S) as session:
        try:
            got = await _fetch_status(session, admin)
        except _Failure as e:
            print(f"kvctl: {e}", file=sys.stderr)
            return e.code
    out = sys.stdout
    # --json prints it even when degraded: a script reads the model and the exit code
    out.write(got.body.rstrip("\n") + "\n" if as_json else render_status(got.status, unicode=_utf8(out)) + "\n")
    out.flush()
    return _exit_code(got.status)


async def _watch(admin: _Admin, interval_s: float) -> int:
    """Redraw until interrupted (main turns Ctrl-C into exit 0); an unreachable kvctl is shown, not fatal."""
    async with _session(min(STATUS_TIMEOUT_S, max(1.0, interval_s))) as session:
        while True:
            try:
                got = await _fetch_status(session, admin)
                frame = render_status(got.status, unicode=_utf8(sys.stdout))
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
    size = f"{r.n_cells} cells" + (f", {_bytes(r.n_bytes)}" if r.n_bytes else "")
    if r.mode is not None:
        size += f", by {r.mode}"
    return f"slot {r.slot}: {r.detail} (task {r.id_task}, {size})"


async def _manual(admin: _Admin, action: str, slot: int, as_json: bool, mode: str | None = None) -> int:
    path = f"/slots/{slot}/{action}" + (f"?mode={mode}" if mode is not None else "")
    async with _session(MANUAL_TIMEOUT_S) as session:
        try:
            code, body = await admin.request(session, "POST", path)
            if (failure := admin.refused_token(code)) is not None:
                raise failure
        except _Failure as e:
            print(f"kvctl: {e}", file=sys.stderr)
            return e.code
    if code == 200:
        try:
            result = _MANUAL_ANSWER.validate_json(body)
        except ValidationError:
            print(f"kvctl: unreadable answer from {admin.base} ({code}): {body[:200]}", file=sys.stderr)
            return EXIT_UNKNOWN
        print(body.rstrip("\n") if as_json else _manual_line(result))
        return EXIT_OK
    try:
        message = _ErrorEnvelope.model_validate_json(body).error.message
    except ValidationError:
        print(f"kvctl: unreadable answer from {admin.base} ({code}): {body[:200]}", file=sys.stderr)
        return EXIT_UNKNOWN
    print(f"kvctl {action} {slot}: refused: {message} ({code})", file=sys.stderr)
    return EXIT_DEGRADED


# --- the text view of the status model -------------------------------------------------------------

BAR_WIDTH = 40


def _utf8(stream: TextIO) -> bool:
    encoding = getattr(stream, "encoding", None)
    if not encoding:
        return False
    try:
        return codecs.lookup(encoding).name == "utf-8"
    except LookupError:
        return False


def _pct(ratio: float) -> str:
    text = f"{ratio * 100:.1f}".removesuffix(".0")
    return f"{text} %"


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _duration(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.1f} s"
    whole = int(s)
    if whole < 3600:
        return f"{whole // 60}m {whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d {whole % 86400 // 3600:02d}h"


def pool_bar(used: float, high: float, low: float, *, unicode: bool, width: int = BAR_WIDTH) -> str:
    """``[█████░░░|░|░]``: the pool's occupancy, with LOW and HIGH as ``|`` between the cells they fall on."""
    full, empty = ("\u2588", "\u2591") if unicode else ("#", ".")

    def position(ratio: float) -> int:
        return round(min(1.0, max(0.0, ratio)) * width)

    filled = position(used)
    cells = [full] * filled + [empty] * (width - filled)
    for mark in sorted((position(low), position(high)), reverse=True):
        cells.insert(mark, "|")
    return "[" + "".join(cells) + "]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: frozenset[int]) -> list[str]:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    return [
        "  ".join(
            cell.rjust(width) if i in right else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in (header, *rows)
    ]


def _overall(status: Status) -> str:
    if status.degraded:
        return "degraded"
    return "ok" if status.ready else "ok, not ready"


def _upstream_line(status: Status) -> str:
    up = status.upstream
    parts = [up.state, up.url]
    if up.up and up.last_poll_age_s is not None:
        parts.append(f"polled {_duration(up.last_poll_age_s)} ago")
    if not up.up and up.last_error:
        parts.append(f"last error: {up.last_error}")
    if not up.up and up.backoff_s is not None:
        parts.append(f"retrying every {_duration(up.backoff_s)} or less")
    sup = status.supervisor
    if sup is not None:
        text = f"supervised: {sup.state}"
        if sup.pid is not None:
            text += f", pid {sup.pid}"
        text += f", {sup.restarts} restart" + ("" if sup.restarts == 1 else "s")
        if sup.early_exits:
            text += f", {sup.early_exits}" + (f" of {sup.failed_after}" if sup.failed_after else "") + " early exits"
        if sup.next_start_in_s is not None:
            text += f", next start in {_duration(sup.next_start_in_s)}"
        parts.append(f"({text})")
    return "  ".join(parts)


def _exit_text(last: ExitView) -> str:
    how = f"killed by {last.signal}" if last.signal is not None else f"exit code {last.returncode}"
    return f"{how} after {_duration(last.uptime_s)}" + (", before it was ready" if last.early else "")


def _supervisor_lines(status: Status) -> list[tuple[str, str]]:
    """The last exit (with the server's last lines once the supervisor gave up)."""
    sup = status.supervisor
    if sup is None or sup.last_exit is None:
        return []
    lines = [("last exit", _exit_text(sup.last_exit))]
    if sup.state == "failed":
        tail = sup.last_exit.log_tail or ["(nothing)"]
        lines += [("server log" if i == 0 else "", text) for i, text in enumerate(tail)]
    return lines


def _pool_lines(pool: PoolView | None, *, unicode: bool) -> list[tuple[str, str]]:
    if pool is None:
        return [("pool", "unknown (upstream down)")]
    bar = pool_bar(pool.used_ratio, pool.high, pool.low, unicode=unicode)
    projected = f"target {_pct(pool.projected_target)}"
    projected += f"  draft {_pct(pool.projected_draft)}" if pool.projected_draft is not None else "  no draft pool"
    if pool.swa is not None:
        projected += f"  window {_pct(pool.swa.projected)} of {pool.swa.n_cells} cells"
    projected += f"  peak {_pct(pool.max_pressure)}"
    if pool.above_high_s is not None:
        projected += f"  at or above HIGH for {_duration(pool.above_high_s)}"
    budget = f" of {_bytes(pool.parked_budget_bytes)} budget"
    if pool.parked_budget_bytes > 0:
        budget += f" ({_pct(pool.parked_bytes / pool.parked_budget_bytes)})"
    requests = "request" if pool.n_parked == 1 else "requests"
    return [
        (
            "pool",
            f"{bar} {_pct(pool.used_ratio)}  HIGH {_pct(pool.high)}  LOW {_pct(pool.low)}"
            f"  ({pool.n_cells_used} of {pool.n_cells} cells)",
        ),
        ("projected", projected),
        ("parked", f"{pool.n_parked} {requests}, {_bytes(pool.parked_bytes)}{budget}"),
    ]


def _gpu_text(device: GpuDeviceView) -> str:
    name = f"#{device.index}" + (f" {device.name}" if device.name else "")
    if device.used_bytes is None or device.total_bytes is None:
        return f"{name}  memory not reported"
    text = f"{name}  {_bytes(device.used_bytes)} used of {_bytes(device.total_bytes)}"
    if device.free_bytes is not None:
        text += f" ({_bytes(device.free_bytes)} free)"
    if device.server_bytes is not None and device.others_bytes is not None:
        text += f", the server {_bytes(device.server_bytes)}, others {_bytes(device.others_bytes)}"
        if device.others_growth_bytes:
            text += f" ({_bytes(device.others_growth_bytes)} since it started)"
    return text


def _memory_lines(status: Status) -> list[tuple[str, str]]:
    if status.host_available_bytes is None:
        host = "unknown (not read yet)"
    else:
        host = f"{_bytes(status.host_available_bytes)} available"
        if status.host_total_bytes is not None:
            host += f" of {_bytes(status.host_total_bytes)}"
    lines = [("host RAM", host)]
    if status.gpu == "ok" and status.gpu_devices:
        lines += [("GPU", _gpu_text(d)) for d in status.gpu_devices]
        if status.gpu_held:
            lines.append(("GPU held", status.gpu_held))
    elif status.gpu == "ok":
        lines.append(("GPU", "no devices"))
    else:
        lines.append(("GPU", status.gpu))
    return lines


def _slot_row(slot: SlotView) -> list[str]:
    flags = [name for name, on in (("pinned", slot.pinned), ("auto", slot.auto_parked)) if on]
    if slot.park_mode is not None:
        flags.append("re-evaluating" if slot.recomputing else slot.park_mode)
    busy = slot.id_task is not None
    return [
        str(slot.id),
        slot.state,
        str(slot.n_cells) if busy or slot.n_cells else "-",
        _duration(slot.age_s) if slot.age_s is not None else "-",
        str(slot.n_decoded) if busy else "-",
        str(slot.park_count) if busy else "-",
        _duration(slot.waited_s) if slot.waited_s is not None else "-",
        _priority(slot) if busy else "-",
        " ".join(flags),
    ]


def _priority(slot: SlotView) -> str:
    """Its priority, and what it counts as when that differs (aged past policy.priority_max_wait_s)."""
    own = slot.priority if slot.priority is not None else 0
    eff = slot.effective_priority
    return f"{own}\u2192{eff}" if eff is not None and eff != own else str(own)


def render_status(status: Status, *, unicode: bool = True) -> str:
    """The text view: a header of labelled lines, then the slots table. ``unicode=False``: plain ASCII."""
    dot = " \u00b7 " if unicode else " - "
    title = f"kvctl {status.version}{dot}{_overall(status)}{dot}up {_duration(status.uptime_s)}"
    header: list[tuple[str, str]] = [("upstream", _upstream_line(status))]
    header += _supervisor_lines(status)
    header += _pool_lines(status.pool, unicode=unicode)
    header += _memory_lines(status)
    header += [("problem", p) for p in status.problems]
    width = max(len(label) for label, _ in header)
    lines = [title, *(f"{label.ljust(width)}  {text}" for label, text in header), ""]
    if status.slots:
        rows = [_slot_row(s) for s in status.slots]
        columns = ("slot", "state", "cells", "age", "decoded", "parks", "parked for", "prio", "")
        if not unicode:
            rows = [[c.replace("\u2192", "->") for c in row] for row in rows]
        lines += _table(columns, rows, right=frozenset({0, 2, 3, 4, 5, 6, 7}))
        if any(s.pinned or s.auto_parked for s in status.slots):
            lines.append("pinned: parked by hand, stays parked until resumed by hand; auto: parked by the server's net")
        if any(s.park_mode is not None for s in status.slots):
            lines.append(
                "swap: its cells wait in host RAM; recompute: only its tokens are kept, evaluated again on resume "
                "(re-evaluating)"
            )
    else:
        lines.append("no slots (upstream down)" if status.pool is None else "no slots")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
