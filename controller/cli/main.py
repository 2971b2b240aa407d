"""``kvctl run | status | park | resume | restart-server | drain``.

``status`` renders the admin API's ``GET /status`` model (controller.admin.status) as text, or prints it
as served; the rendering lives here, the model stays data only. The client commands print text
on a terminal and the admin API's JSON otherwise (``--text`` and ``--json`` choose), and share
their exit codes (after LSB, see EPILOG).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import disable_created_metrics

from controller.cli.client import (
    EXIT_OK,
    EXIT_USAGE,
    Admin,
    admin_url,
    drain,
    manual,
    reload,
    restart_server,
    show_status,
    watch,
)
from controller.keeper import FD_ENV
from controller.metrics import kvctl_version
from controller.settings import Settings, SettingsError, deprecations, load_settings, split_host_port
from controller.upstream.models import ParkMode

__all__ = ["main"]


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
    p.add_argument("--version", action="version", version=f"kvctl {kvctl_version()}")
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
    run.add_argument(
        "--drain-peer",
        metavar="URL",
        action="append",
        help="another kvctl listener that a drain (kvctl drain, SIGTERM) moves requests to; repeatable "
        "(proxy.drain_peers)",
    )

    for name, text in (
        ("status", "print kvctl's status: upstream, pool, parked requests, memory and slots"),
        ("park", "park a slot's request and pin it (the policy leaves it parked)"),
        ("resume", "resume a slot's request (and unpin it)"),
        (
            "restart-server",
            "restart the server kvctl spawned, losing no chat (an upgrade: kvctl restart-server -- llama-server ARGS)",
        ),
        ("drain", "move every request to peer replicas and stop the server (kvctl drain [--to URL ...])"),
        ("reload", "start kvctl again with its code and settings as they are now, losing no chat (SIGHUP does too)"),
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
            + {
                "status": "GET /status",
                "restart-server": "POST /server/restart",
                "drain": "POST /drain",
                "reload": "POST /reload",
            }.get(name, f"POST /slots/ID/{name}")
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
        elif name == "restart-server":
            c.add_argument(
                "--force",
                action="store_true",
                help="restart even with another model (running requests then end with an error)",
            )
        elif name == "reload":
            c.add_argument(
                "--environment",
                action="store_true",
                help="the new kvctl takes this command's KVCTL_* variables instead of its own (systemd's ExecReload "
                "reads the unit's EnvironmentFile again)",
            )
        elif name == "drain":
            c.add_argument(
                "--to",
                metavar="URL",
                action="append",
                help="a peer kvctl listener, e.g. http://10.0.0.7:8080; repeatable (default: proxy.drain_peers)",
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
        return _run(parser, args, server_argv, exec_keeper=argv is None)
    if server_argv is not None and args.command != "restart-server":
        print("kvctl: '--' is only for run --spawn and restart-server", file=sys.stderr)
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
    admin = Admin(base, token)
    # text for a person at a terminal, the JSON as served for a pipe or a script
    as_json = args.json or (not args.text and not sys.stdout.isatty())
    if args.command == "status":
        if args.watch is not None:
            try:
                return asyncio.run(watch(admin, args.watch))
            except KeyboardInterrupt:
                return EXIT_OK
        return asyncio.run(show_status(admin, as_json))
    if args.command == "restart-server":
        if server_argv is not None and not server_argv:
            print("kvctl restart-server: '--' needs the server's new command line after it", file=sys.stderr)
            return EXIT_USAGE
        return asyncio.run(restart_server(admin, server_argv, args.force, as_json))
    if args.command == "drain":
        return asyncio.run(drain(admin, args.to, as_json))
    if args.command == "reload":
        env = {k: v for k, v in os.environ.items() if k.startswith("KVCTL_")} if args.environment else None
        return asyncio.run(reload(admin, env, as_json))
    return asyncio.run(manual(admin, args.command, args.slot, as_json, getattr(args, "mode", None)))


# --- run -------------------------------------------------------------------------------------------


def _run(
    parser: argparse.ArgumentParser, args: argparse.Namespace, server_argv: list[str] | None, exec_keeper: bool = False
) -> int:
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
    if args.drain_peer:
        overrides.setdefault("proxy", {})["drain_peers"] = args.drain_peer
    try:
        settings = load_settings(args.config, overrides)
    except SettingsError as e:
        print(f"kvctl: {e}", file=sys.stderr)
        return EXIT_USAGE
    if exec_keeper and settings.proxy.keeper and settings.proxy.tls_cert_file is None and FD_ENV not in os.environ:
        # the keeper holds the listener and the clients' connections; this command line runs again as its worker
        worker = [sys.executable, "-m", "controller", *sys.argv[1:]]
        os.execv(sys.executable, [sys.executable, "-m", "controller.keeper", "--", *worker])
    return asyncio.run(_serve(settings, lambda: load_settings(args.config, overrides)))


async def _serve(settings: Settings, reload: Callable[[], Settings] | None = None) -> int:
    from controller.app import App, configure_logging

    configure_logging(settings.log)
    for message in deprecations():
        structlog.get_logger("kvctl.settings").warning("settings.deprecated", message=message)
    disable_created_metrics()  # type: ignore[no-untyped-call]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = App(settings, reload=reload)
    if app.link is not None:
        loop.add_signal_handler(signal.SIGHUP, app.link.reload)  # the keeper's to do; a worker asked directly asks it
    code = await app.run(stop)
    if app.link is not None and (stop.is_set() or code in (2, 3)):
        app.link.bye(code)  # on purpose: the keeper exits with it, and does not start another worker
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        # a signal that comes while the loop closes (a group's SIGTERM and the keeper's, one after the other) would
        # find asyncio's wakeup fd closed: stopping already, ignore it
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    return code
