"""The keeper: the small process that holds kvctl's client connections while the rest of kvctl dies or is replaced.

``kvctl run`` execs into this module (standard library only, so that what must not crash depends on nothing else).
The keeper binds the public listener, accepts every client connection and relays it (controller.keeper_conns), one
request at a time, to a worker (``python -m controller run ...``: the proxy, the control loop, the supervisor) over a
socket pair per request whose other end it passes to the worker (SCM_RIGHTS). It keeps, for the request in flight
on each connection, the request's bytes and what of the response the client has been sent (whole chunks only: a
chunk the worker wrote in part is never delivered), so that when the worker dies (a crash, an OOM kill, SIGKILL)
or is replaced (``kvctl reload``, SIGHUP) nothing reaches the client but a pause:

- a request whose response had not started is sent again to the next worker, on the same connection and sequence
  number (the worker finds the server's stream it had started, by a conversation id derived from both);
- a chunked response under way is handed to the next worker as a *resume* (``POST /resume`` on a pair of its own:
  the request, the response's head and the body the client has), and the chunks of the resume's answer go on in the
  client's response;
- a response of known length is held until whole (up to HOLD_BYTES), so a crash never cuts one in half.

A connection the next worker cannot continue (a large non-chunked body half sent, a resume it refuses) is closed, as
before. The keeper's own death is the one case that loses connections. Protocol with the worker (a SOCK_SEQPACKET
pair, JSON messages): worker ``hello`` (its listen addresses) -> keeper ``sockets`` (the admin listener's sockets) ->
worker ``ready`` -> keeper ``go`` (the adopted server, if any) -> worker ``serving``; keeper ``conn`` (a request, with
its pair), ``abandoned`` (requests whose clients left while no worker had them); worker ``reload``, ``server`` (a
spawned server's pid), ``taken`` (a request read and inspected: see the poison rule), ``bye`` (exiting on purpose,
with its code).
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import time

from controller.keeper_conns import (
    EOF_GRACE_S,
    POISON_WINDOW_S,
    Conn,
    Connections,
    log,
    recv_message,
    send_message,
)

# what crosses from one worker to the next (these messages, the resume's framing, the conversation ids a worker names
# its server streams by) is protocol 1; a worker names the protocols it speaks, the keeper (never replaced by a
# reload) answers with its own or refuses the worker
PROTOCOL = 1
FD_ENV = "KVCTL_KEEPER_FD"
EPOCH_ENV = "KVCTL_KEEPER_EPOCH"
FAILED_STARTS = 5  # workers in a row that die before serving: give up


class Worker:
    def __init__(self, proc: subprocess.Popen[bytes], ctrl: socket.socket, env: dict[str, str]) -> None:
        self.proc, self.ctrl, self.env = proc, ctrl, env
        self.state = "starting"  # -> ready -> serving -> dead
        self.poison_window_s = POISON_WINDOW_S  # its keeper.poison_window_s, as its hello says


class Keeper(Connections):
    def __init__(self, argv: list[str]) -> None:
        self.argv = argv
        self.sel = selectors.DefaultSelector()
        self.epoch = secrets.token_hex(16)  # names the workers' server streams: never shown to a client
        self.conns: dict[int, Conn] = {}
        self.next_id = 0
        self.listeners: list[socket.socket] = []
        self.admin: list[socket.socket] = []
        self.addr: tuple[object, object] | None = None
        self.worker: Worker | None = None  # the one requests go to
        self.coming: Worker | None = None  # a reload's new worker, until it serves
        self.server: dict[str, object] = {}  # a spawned server the next worker adopts (its pid)
        self.server_fds: list[int] = []  # and the read ends of its output pipes
        self.failed_starts = 0
        self.exit_code: int | None = None
        self.abandoned: list[str] = []  # requests whose client left while no worker ran
        self.left_on: list[tuple[Worker, str, float]] = []
        self.signals: list[int] = []
        self.stopping = False
        self.env = dict(os.environ)  # the workers' environment: a reload may bring new KVCTL_ variables
        self.rfd, self.wfd = os.pipe()
        os.set_blocking(self.wfd, False)

    # --- workers ------------------------------------------------------------------------------------------------

    def spawn(self, env: dict[str, str] | None = None) -> Worker:
        env = self.env if env is None else env
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        proc = subprocess.Popen(
            self.argv, pass_fds=(theirs.fileno(),), env={**env, FD_ENV: str(theirs.fileno()), EPOCH_ENV: self.epoch}
        )
        theirs.close()
        w = Worker(proc, mine, env)
        self.sel.register(mine, selectors.EVENT_READ, ("ctrl", w))
        log("keeper.worker_started", pid=proc.pid)
        return w

    def send(self, w: Worker, msg: dict[str, object], fds: list[int] | None = None) -> bool:
        return send_message(w.ctrl, msg, fds)

    def on_ctrl(self, w: Worker) -> None:
        try:
            data, fds = recv_message(w.ctrl)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            self.worker_died(w)
            return
        try:
            msg = json.loads(data)
            op = msg.get("op")
        except (ValueError, AttributeError):
            log("keeper.bad_message", pid=w.proc.pid, level="error")
            return
        if op == "hello":
            self.on_hello(w, msg)
        elif op == "ready":
            w.state = "ready"
            if w is self.coming and self.worker is not None and self.worker.state != "dead":
                old = self.worker
                log("keeper.replacing", old=old.proc.pid, new=w.proc.pid)
                old.proc.kill()
                old.proc.wait()
                self.worker_died(old, handed_over=True)  # a hand-over: it counts against no request
            self.send(w, {"op": "go", "server": self.server}, self.server_fds)
        elif op == "serving":
            w.state = "serving"
            self.failed_starts = 0
            self.env = w.env  # a reload's settings hold for the workers after it too
            self.worker, self.coming = w, None
            for c in list(self.conns.values()):
                self.dispatch(c)
        elif op == "taken":
            self.taken(w, msg.get("id"), msg.get("seq"))
        elif op == "reload":
            self.reload(msg.get("environment"))
        elif op == "server":  # a server the worker spawned: the next worker adopts it, with its output pipes
            self.forget_server()
            if isinstance(msg.get("pid"), int):  # None: it exited, nothing to adopt
                self.server, self.server_fds = {"pid": msg.get("pid"), "argv0": msg.get("argv0")}, fds
                fds = []
        elif op == "bye":
            self.exit_code = int(msg.get("code", 0))
        for fd in fds:
            os.close(fd)

    def on_hello(self, w: Worker, msg: dict[str, object]) -> None:
        listen, admin = msg.get("listen"), msg.get("admin")
        window = msg.get("poison_window_s")
        if isinstance(window, int | float) and not isinstance(window, bool) and window >= 0:
            w.poison_window_s = float(window)
        spoken = msg.get("protocols")
        if not isinstance(spoken, list) or PROTOCOL not in spoken:
            error = f"this keeper speaks protocol {PROTOCOL}, the new worker {spoken}: restart kvctl to upgrade it"
            self.send(w, {"op": "sockets", "error": error})
            return
        if self.addr is None:
            try:
                self.listeners = self.bind(listen, accept=True)
                self.admin = self.bind(admin, accept=False)
            except OSError as e:
                self.send(w, {"op": "sockets", "error": f"{listen if not self.listeners else admin}: {e}"})
                for lsock in self.listeners:  # bound, but not the admin listener: the next worker binds both again
                    self.sel.unregister(lsock)
                    lsock.close()
                self.listeners = []
                return
            self.addr = (listen, admin)
        elif self.addr != (listen, admin):
            log(
                "keeper.listen_unchanged",
                level="warning",
                kept=self.addr,
                asked=(listen, admin),
                hint="listen addresses change only when kvctl restarts",
            )
        listening = {"listen": self.addr[0], "admin": self.addr[1]}
        self.send(
            w,
            {"op": "sockets", "protocol": PROTOCOL, "epoch": self.epoch, **listening},
            [a.fileno() for a in self.admin],
        )

    def bind(self, addr: object, accept: bool) -> list[socket.socket]:
        host, port = addr if isinstance(addr, list | tuple) and len(addr) == 2 else ("", 0)
        out: list[socket.socket] = []
        for fam, kind, proto, _, sa in socket.getaddrinfo(
            str(host) or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            s = socket.socket(fam, kind, proto)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if fam == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(sa)
            except OSError:
                s.close()
                for o in out:
                    o.close()
                raise
            s.listen(1024)
            s.setblocking(False)
            if accept:
                self.sel.register(s, selectors.EVENT_READ, ("listen", None))
            out.append(s)
        return out

    def forget_server(self) -> None:
        for fd in self.server_fds:
            os.close(fd)
        self.server, self.server_fds = {}, []

    def reap_server(self) -> None:
        """A spawned server whose worker died is the keeper's child (a subreaper's): reaped, its status passed on."""
        pid = self.server.get("pid")
        if not isinstance(pid, int):
            return
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # still the worker's child
        if done:
            code = os.waitstatus_to_exitcode(status)
            log("keeper.server_exited", pid=pid, code=code)
            if self.worker is not None:
                self.send(self.worker, {"op": "server_exited", "pid": pid, "status": code})
            self.forget_server()

    def reload(self, environment: dict[str, str] | None = None) -> None:
        if self.coming is not None or self.worker is None:
            log("keeper.reload_ignored", reason="a worker is starting already")
            return
        env = self.env
        if environment is not None:  # the settings' variables as the reload's caller has them (systemd's file)
            kept = {k: v for k, v in self.env.items() if not k.startswith("KVCTL_")}
            env = {**kept, **{k: str(v) for k, v in environment.items() if k.startswith("KVCTL_")}}
        log("keeper.reload", environment=sorted(environment) if environment is not None else None)
        self.coming = self.spawn(env)

    def worker_died(self, w: Worker, handed_over: bool = False) -> None:
        """``w`` exited: its requests go to the next worker (``handed_over``: a reload replaced it, which counts
        against none of them, see Connections.orphan)."""
        if w.state == "dead":
            return
        was = w.state
        w.state = "dead"
        self.sel.unregister(w.ctrl)
        w.ctrl.close()
        try:
            code = w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            w.proc.kill()
            code = w.proc.wait()
        log("keeper.worker_exited", pid=w.proc.pid, code=code, state=was, level="warning")
        for c in list(self.conns.values()):
            if c.worker is w:
                self.drain(c)
            if c.worker is w and c.id in self.conns:
                self.orphan(c, handed_over)
        self.abandoned += [k for worker, k, _ in self.left_on if worker is w]  # it died before it could end them
        if w is self.coming:
            self.coming = None
            if self.worker is not None and self.worker.state != "dead":
                log("keeper.reload_failed", level="error", code=code)
                error = f"the new worker exited with {code} before it took over (its log says why)"
                self.send(self.worker, {"op": "reload_failed", "error": error})
                return
        if w is not self.worker and self.worker is not None:
            return
        self.worker = None
        if self.coming is not None:
            return  # replaced by a reload, or a new worker is starting already
        if self.exit_code is not None or self.stopping:  # exiting on purpose (bye), or asked to stop (SIGTERM, SIGINT)
            self.exit_code = self.exit_code if self.exit_code is not None else 0
            return
        if was != "serving":
            self.failed_starts += 1
            if self.addr is None or self.failed_starts >= FAILED_STARTS:
                self.exit_code = code if code > 0 else 1
                return
        self.coming = self.spawn()

    # --- connections --------------------------------------------------------------------------------------------

    def tick(self) -> None:
        now = time.monotonic()
        for c in list(self.conns.values()):
            if c.eof_at is None or now - c.eof_at < EOF_GRACE_S:
                continue
            w = c.worker
            if w is not None and w.state != "dead" and w.proc.poll() is None:
                self.close(c)  # the worker ended this response on purpose (an abort)
            elif w is not None and w.state != "dead":
                self.worker_died(w)

    def on_signal(self) -> None:
        os.read(self.rfd, 64)
        while self.signals:
            sig = self.signals.pop(0)
            if sig == signal.SIGHUP:
                self.reload()
                continue
            self.stopping = True  # SIGTERM, SIGINT: the worker drains and says bye; no worker is started after it
            for w in (self.worker, self.coming):
                if w is not None and w.state != "dead":
                    w.proc.send_signal(sig)
            if self.worker is None and self.coming is None:
                self.exit_code = 0

    def run(self) -> int:
        def note(sig: int, _frame: object) -> None:
            self.signals.append(sig)
            try:
                os.write(self.wfd, b"!")
            except OSError:
                pass

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, note)
        self.sel.register(self.rfd, selectors.EVENT_READ, ("signal", None))
        subreaper()
        self.coming = self.spawn()
        while self.exit_code is None:
            for key, events in self.sel.select(0.1):
                kind, obj = key.data
                if kind == "listen":
                    self.accept(key.fileobj)  # type: ignore[arg-type]
                elif kind == "client":
                    if events & selectors.EVENT_WRITE:
                        self.flush(obj)
                    if events & selectors.EVENT_READ and obj.id in self.conns:
                        self.on_client(obj)
                elif kind == "pair" and obj.pair is key.fileobj:
                    if events & selectors.EVENT_WRITE:
                        self.flush_pair(obj)
                    if events & selectors.EVENT_READ and obj.pair is key.fileobj:
                        self.on_pair(obj)
                elif kind == "ctrl":
                    self.on_ctrl(obj)
                elif kind == "signal":
                    self.on_signal()
            self.tick()
            self.reap_server()
            if self.abandoned and self.worker is not None and self.worker.state == "serving":
                if self.send(self.worker, {"op": "abandoned", "requests": self.abandoned}):
                    self.abandoned = []
        for w in (self.worker, self.coming):
            if w is not None and w.proc.poll() is None:
                w.proc.terminate()
                w.proc.wait()
        log("keeper.exit", code=self.exit_code)
        return self.exit_code


def subreaper() -> None:
    """A server whose worker died becomes the keeper's child, not init's: the keeper reaps it and reports its exit
    (Linux; elsewhere the next worker sees it gone without its status)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python -m controller.keeper -- WORKER ARGV...", file=sys.stderr)
        return 2
    return Keeper(argv[argv.index("--") + 1 :]).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
