"""The worker's side of the keeper (controller.keeper): its control channel, and the requests it passes in.

Under the keeper, ``kvctl run`` is a worker: it binds no public listener. The keeper hands it each request on a socket
pair of its own (SCM_RIGHTS); :meth:`KeeperLink.serve` feeds those to the proxy's aiohttp server, and a *resume*
(a response the previous worker had begun) to the resume server. Each request is known by the keeper's connection
and sequence number, from which the worker derives its request id, so that a worker after a crash finds the
server's stream of the same request again (``request_id``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from controller.keeper import EPOCH_ENV, FD_ENV, PROTOCOL
from controller.keeper_conns import recv_message, send_message

__all__ = ["KeeperError", "KeeperLink", "Pair"]

log = structlog.get_logger("kvctl.keeper")


class KeeperError(Exception):
    """The keeper refused (a listen address it could not bind) or went away."""


@dataclass(frozen=True, slots=True)
class Pair:
    conn: int
    seq: int
    again: bool  # sent again: the worker that had it died before the response started
    resume: bool  # a response the client has part of


class KeeperLink:
    def __init__(self, fd: int, epoch: str) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.setblocking(False)
        self.epoch = epoch
        self.pairs: dict[int, Pair] = {}  # by the pair's fd in this process
        self._msgs: asyncio.Queue[tuple[dict[str, Any], list[int]]] = asyncio.Queue()
        self._serve: Callable[[dict[str, Any], socket.socket], None] | None = None
        self._early: list[tuple[dict[str, Any], socket.socket]] = []
        self.lost = asyncio.Event()  # the keeper is gone: nothing more reaches this worker
        self.on_lost: Callable[[], None] | None = None
        self.abandoned: list[str] = []  # requests whose clients left while no worker had them (the keeper's word)
        self.on_abandoned: Callable[[], None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.reloads_failed = 0
        self._exits: dict[int, asyncio.Future[int]] = {}
        self.reload_error: str | None = None
        self.listen_unchanged: str | None = None  # what this worker's settings asked of the listeners, not in force

    @classmethod
    def from_env(cls) -> KeeperLink | None:
        fd = os.environ.pop(FD_ENV, None)
        epoch = os.environ.pop(EPOCH_ENV, "0")
        if not fd or not fd.isdigit():
            return None
        return cls(int(fd), epoch)

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self.sock.fileno(), self._readable)

    def _readable(self) -> None:
        while True:
            try:
                data, fds = recv_message(self.sock)
            except (BlockingIOError, InterruptedError):
                return
            if not data:
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
                self.lost.set()
                if self.on_lost is not None:
                    self.on_lost()
                return
            msg = json.loads(data)
            if msg.get("op") == "conn" and fds:
                self._conn(msg, socket.socket(fileno=fds[0]))
            elif msg.get("op") == "abandoned":
                self.abandoned += [str(k) for k in msg.get("requests", [])]
                if self.on_abandoned is not None:
                    self.on_abandoned()
            elif msg.get("op") == "server_exited":
                fut = self._exits.setdefault(int(msg["pid"]), asyncio.get_running_loop().create_future())
                if not fut.done():
                    fut.set_result(int(msg["status"]))
            elif msg.get("op") == "reload_failed":
                self.reloads_failed += 1
                self.reload_error = str(msg.get("error"))
                log.error("keeper.reload_failed", error=self.reload_error)
            else:
                self._msgs.put_nowait((msg, fds))

    def _conn(self, msg: dict[str, Any], pair: socket.socket) -> None:
        info = Pair(int(msg["id"]), int(msg["seq"]), again=bool(msg.get("again")), resume=bool(msg["resume"]))
        self.pairs[pair.fileno()] = info
        if self._serve is None:
            self._early.append((msg, pair))
        else:
            self._serve(msg, pair)

    def send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        send_message(self.sock, msg, fds)

    async def _expect(self, op: str) -> tuple[dict[str, Any], list[int]]:
        lost = asyncio.ensure_future(self.lost.wait())
        try:
            while True:
                get = asyncio.ensure_future(self._msgs.get())
                done, _ = await asyncio.wait({get, lost}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    raise KeeperError("the keeper went away")
                msg, fds = get.result()
                if msg.get("op") == op:
                    return msg, fds
                for fd in fds:
                    os.close(fd)
        finally:
            lost.cancel()

    async def hello(
        self, listen: tuple[str, int], admin: tuple[str, int], poison_window_s: float
    ) -> list[socket.socket]:
        """Ask the keeper for the listeners: it binds them once, for every worker; the admin listener's sockets.
        ``poison_window_s`` (keeper.poison_window_s) holds once this worker serves."""
        hello = {
            "op": "hello",
            "protocols": [PROTOCOL],
            "listen": list(listen),
            "admin": list(admin),
            "poison_window_s": poison_window_s,
        }
        self.send({**hello, "pid": os.getpid()})
        msg, fds = await self._expect("sockets")
        if "error" in msg:
            raise KeeperError(str(msg["error"]))
        kept = (tuple(msg.get("listen") or listen), tuple(msg.get("admin") or admin))
        if kept != (tuple(listen), tuple(admin)):
            self.listen_unchanged = (
                f"proxy.listen {listen[0]}:{listen[1]} and admin.listen {admin[0]}:{admin[1]} asked; still listening "
                f"on {kept[0][0]}:{kept[0][1]} and {kept[1][0]}:{kept[1][1]} until kvctl restarts"
            )
            log.warning(
                "keeper.listen_unchanged",
                listening=[f"{h}:{p}" for h, p in kept],
                asked=[f"{h}:{p}" for h, p in (listen, admin)],
                hint="proxy.listen and admin.listen change only when kvctl restarts (systemctl restart kvctl)",
            )
        return [socket.socket(fileno=fd) for fd in fds]

    async def ready(self) -> tuple[dict[str, Any], list[int]]:
        """Ready to take over: the keeper stops the worker before this one (a reload) and says go, with what this
        one takes over (the spawned server's pid and output pipes, requests whose clients left meanwhile)."""
        self.send({"op": "ready"})
        return await self._expect("go")

    def serve(self, clients: web.Server, resumes: web.Server) -> None:
        """Feed each pair to its server, then tell the keeper to route requests here."""
        loop = asyncio.get_running_loop()

        def one(msg: dict[str, Any], pair: socket.socket) -> None:
            server = resumes if msg.get("resume") else clients
            task = loop.create_task(loop.connect_accepted_socket(server, pair))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._serve = one
        for msg, pair in self._early:
            one(msg, pair)
        self._early.clear()
        self.send({"op": "serving"})

    def pair(self, request: web.BaseRequest) -> Pair | None:
        transport = request.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        return self.pairs.get(sock.fileno()) if sock is not None else None

    def conv_prefix(self, pair: Pair) -> str:
        """What the names of a request's server streams begin with, the same in every worker; from the keeper's secret
        epoch, so that no client can name another's stream (the request id it sees is a hash of this)."""
        return f"kvctl-{self.epoch}-{pair.conn}-{pair.seq}"

    def request_id(self, pair: Pair) -> str:
        """A request's id (X-Request-Id upstream, in /slots, echoed to its client), the same in every worker."""
        return "kvctl-" + hashlib.sha256(self.conv_prefix(pair).encode()).hexdigest()[:32]

    def taken(self, pair: Pair) -> None:
        """This worker read and inspected the request on ``pair`` (or set up its resume): whatever kills this worker
        from here on, it was not the request's bytes (the keeper's poison rule, keeper.poison_window_s)."""
        self.send({"op": "taken", "id": pair.conn, "seq": pair.seq})

    def reload(self, environment: dict[str, str] | None = None) -> None:
        """Ask the keeper for a new worker (``environment``: its KVCTL_ variables instead of the ones it has)."""
        self.send({"op": "reload", "environment": environment})

    def server_started(self, pid: int, argv0: str, read_ends: list[int]) -> None:
        """A spawned server: the keeper keeps its pid (and what it runs, to know it again) and copies of its output
        pipes for the next worker."""
        self.send({"op": "server", "pid": pid, "argv0": argv0}, read_ends)

    def server_gone(self) -> None:
        """The spawned server exited (reaped here): nothing for the next worker to adopt."""
        self.send({"op": "server", "pid": None})

    async def exit_status(self, pid: int) -> int:
        """The exit status of an adopted server, as the keeper reaped it (-1 when it does not say within 2 s)."""
        if pid not in self._exits:
            self._exits[pid] = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(self._exits[pid]), 2.0)
        return -1

    def bye(self, code: int) -> None:
        self.send({"op": "bye", "code": code})
