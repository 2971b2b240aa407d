"""``kvctl run | status | park | resume``.

Exit codes (after LSB): 0 ok, 1 degraded or refused, 2 usage, 3 kvctl not running or unreachable,
4 unknown (an answer kvctl could not read).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import disable_created_metrics
from pydantic import ValidationError

from controller.settings import Settings, SettingsError, load_settings
from controller.status import Status

__all__ = ["main"]

EXIT_OK, EXIT_DEGRADED, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_UNKNOWN = 0, 1, 2, 3, 4

EPILOG = """exit codes: 0 ok, 1 degraded (status) or refused (park, resume), 2 usage or invalid settings,
3 kvctl not running or unreachable, 4 unknown (an unreadable answer)"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvctl",
        description="Keep llama-server's chats alive when its unified KV pool fills: park and resume requests.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", type=Path, help="TOML settings file (tables named after the settings groups)")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the controller", epilog=EPILOG)
    run.add_argument("--upstream", metavar="URL", help="the patched llama-server (upstream.url)")
    run.add_argument("--listen", metavar="HOST:PORT", help="the client-facing proxy's address (proxy.listen)")
    run.add_argument("--admin", metavar="HOST:PORT", help="the admin listener's address (admin.listen)")
    run.add_argument(
        "--spawn",
        action="store_true",
        help="start and supervise the server: kvctl run --spawn -- llama-server ARGS...",
    )

    for name, text in (
        ("status", "print kvctl's status"),
        ("park", "park a slot's request and pin it"),
        ("resume", "resume a slot's request (and unpin it)"),
    ):
        c = sub.add_parser(name, help=text, epilog=EPILOG)
        c.add_argument("--admin", metavar="HOST:PORT", help="kvctl's admin address (default: admin.listen)")
        c.add_argument("--token", help="admin bearer token (default: admin.token, KVCTL_ADMIN__TOKEN)")
        if name == "status":
            c.add_argument("--json", action="store_true", help="print the status model as JSON (the default for now)")
        else:
            c.add_argument("slot", type=int, help="slot id")
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
    try:
        settings = load_settings(args.config)
    except SettingsError as e:
        print(f"kvctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    admin = args.admin or settings.admin.listen
    token = args.token or (settings.admin.token.get_secret_value() if settings.admin.token is not None else None)
    if args.command == "status":
        return asyncio.run(_status(admin, token))
    return asyncio.run(_manual(admin, token, args.command, args.slot))


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
    disable_created_metrics()  # type: ignore[no-untyped-call]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return await App(settings).run(stop)


# --- clients of the admin API ----------------------------------------------------------------------


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


async def _status(admin: str, token: str | None) -> int:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.get(f"http://{admin}/status", headers=_headers(token)) as resp:
                body = await resp.read()
                code = resp.status
    except (aiohttp.ClientError, TimeoutError) as e:
        print(f"kvctl: not reachable at {admin}: {e}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    if code != 200:
        print(f"kvctl: {admin} answered {code}: {body.decode(errors='replace')[:200]}", file=sys.stderr)
        return EXIT_UNKNOWN
    try:
        status = Status.model_validate_json(body)
    except ValidationError as e:
        print(f"kvctl: unreadable status from {admin}: {e.errors()[0]['msg']}", file=sys.stderr)
        return EXIT_UNKNOWN
    print(status.model_dump_json(indent=2))
    return EXIT_OK if status.ready else EXIT_DEGRADED


async def _manual(admin: str, token: str | None, action: str, slot: int) -> int:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=15)) as session:
            async with session.post(f"http://{admin}/slots/{slot}/{action}", headers=_headers(token)) as resp:
                body = await resp.read()
                code = resp.status
    except (aiohttp.ClientError, TimeoutError) as e:
        print(f"kvctl: not reachable at {admin}: {e}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    try:
        data = json.loads(body)
    except ValueError:
        print(f"kvctl: unreadable answer from {admin} ({code})", file=sys.stderr)
        return EXIT_UNKNOWN
    if code == 200:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    message = data.get("error", {}).get("message") if isinstance(data, dict) else None
    print(f"kvctl {action} {slot}: {message or body.decode(errors='replace')[:200]} ({code})", file=sys.stderr)
    return EXIT_DEGRADED


if __name__ == "__main__":
    sys.exit(main())
