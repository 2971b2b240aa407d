"""A stand-in for kvctl's worker under the keeper, for tests of the keeper's framing and hand-over alone.

It speaks the keeper's protocol (hello, ready, serving; a socket pair per request) and answers by path:

- ``/whole``: a 200 with a body of known length; ``/until-close``: a body that ends when the connection does;
- a request it cannot read (a Content-Length that is no number, a transfer coding): 400, and it closes;
- ``/poison``: it dies before answering (whichever worker gets it);
- ``/die-mid-chunk``: a chunked 200, one whole chunk ``one``, then half of the next, then it dies (SIGKILL-like);
- ``POST /resume`` (the keeper's hand-over): a chunked 200 whose one chunk names what it was given
  (``resumed:<request line>:<body the client has>``), then the end;
- ``/stream-die/N``: a chunked 200 with one chunk ``x``, then it dies; resumed, one more ``x`` and it dies again, until
  the client has N of them, then a chunk ``done`` and the end (a long stream through N worker deaths);
- ``/slow-die/N``, ``/reload-me/N``: the first N workers that get it wait 0.5 s and die, or ask the keeper for a reload
  and hold it unanswered (counted in a file of ``FAKE_STATE_DIR``); the next one answers ``whole``;
- ``/taken-die/N``: likewise, but each of the first N tells the keeper it read the request whole, then dies.

Its hello carries ``FAKE_POISON_WINDOW`` as its keeper.poison_window_s, when set.

Run as ``python -m tests.fakes.keeper_worker``; the keeper starts it with its control socket's fd in the environment.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from controller.keeper import FD_ENV, PROTOCOL
from controller.keeper_conns import recv_message, send_message


def _send(ctrl: socket.socket, msg: dict[str, object]) -> None:
    send_message(ctrl, msg)


def _recv(ctrl: socket.socket) -> tuple[dict[str, object], list[int]]:
    data, fds = recv_message(ctrl)
    if not data:
        raise SystemExit(0)
    return json.loads(data), fds


def _read_request(pair: socket.socket) -> tuple[str, dict[str, str], bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        buf += pair.recv(65536)
        if len(buf) > 65536:
            return "BAD", {}, b""  # a head too large: aiohttp answers 400 too
    head, _, body = buf.partition(b"\r\n\r\n")
    start, *lines = head.decode("latin-1").split("\r\n")
    fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines)}
    cl = fields.get("content-length", "0")
    if not cl.isdigit() or "transfer-encoding" in fields:
        return "BAD", fields, body  # what it cannot read: a 400, as aiohttp answers
    n = int(cl)
    while len(body) < n:
        body += pair.recv(65536)
    return start, fields, body


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _count(name: str, limit: int) -> bool:
    """Whether this is one of the first ``limit`` workers to get ``name`` (each call counts one)."""
    path = Path(os.environ["FAKE_STATE_DIR"]) / name.replace("/", "_")
    n = int(path.read_text()) if path.exists() else 0
    if n >= limit:
        return False
    path.write_text(str(n + 1))
    return True


def main() -> None:
    ctrl = socket.socket(fileno=int(os.environ[FD_ENV]))
    port, admin = int(os.environ["FAKE_LISTEN_PORT"]), int(os.environ["FAKE_ADMIN_PORT"])
    hello: dict[str, object] = {"op": "hello", "protocols": [PROTOCOL], "listen": ["127.0.0.1", port]}
    hello["admin"] = ["127.0.0.1", admin]
    if os.environ.get("FAKE_POISON_WINDOW"):
        hello["poison_window_s"] = float(os.environ["FAKE_POISON_WINDOW"])
    _send(ctrl, hello)
    held = []
    _recv(ctrl)
    _send(ctrl, {"op": "ready"})
    _recv(ctrl)
    _send(ctrl, {"op": "serving"})
    while True:
        msg, fds = _recv(ctrl)
        if msg.get("op") != "conn":
            continue
        pair = socket.socket(fileno=fds[0])
        start, fields, body = _read_request(pair)
        path = start.split(" ")[1] if start != "BAD" else ""
        if not path:
            pair.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 3\r\nConnection: close\r\n\r\nbad")
        elif path == "/until-close":  # aiohttp's stream to an HTTP/1.0 client: no length, no chunks
            pair.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nabc")
            pair.sendall(b"def")
        elif path == "/poison":  # every worker that reads it dies
            os._exit(9)
        elif path.startswith("/stream-die/"):
            pair.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(b"x"))
            os._exit(9)
        elif path.startswith("/taken-die/") and _count(path, int(path.rsplit("/", 1)[1])):
            _send(
                ctrl, {"op": "taken", "id": msg["id"], "seq": msg["seq"]}
            )  # read whole: then it dies of something else
            time.sleep(0.2)
            os._exit(9)
        elif path.startswith("/slow-die/") and _count(path, int(path.rsplit("/", 1)[1])):
            time.sleep(0.5)
            os._exit(9)
        elif path.startswith("/reload-me/") and _count(path, int(path.rsplit("/", 1)[1])):
            _send(ctrl, {"op": "reload"})
            held.append(pair)  # never answered: the keeper hands it to the new worker
            continue
        elif path.startswith(("/slow-die/", "/reload-me/", "/taken-die/")):
            pair.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nwhole")
        elif path == "/whole":
            pair.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nwhole")
        elif path == "/die-mid-chunk":
            pair.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Head: 1\r\n\r\n" + _chunk(b"one"))
            pair.sendall(b"5\r\ntw")  # half a chunk: the client must never see it
            os._exit(9)
        elif path == "/resume":
            n_req, n_head = int(fields["x-request-bytes"]), int(fields["x-head-bytes"])
            request_line = body[:n_req].split(b"\r\n")[0]
            had = body[n_req + n_head :]
            if request_line.startswith(b"GET /stream-die/"):
                wanted = int(request_line.split(b" ")[1].rsplit(b"/", 1)[1])
                if len(had) < wanted:
                    pair.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(b"x"))
                    os._exit(9)
                pair.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(b"done") + b"0\r\n\r\n")
                pair.close()
                continue
            out = b"resumed:" + request_line + b":" + had
            pair.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(out) + b"0\r\n\r\n")
        pair.close()


if __name__ == "__main__":
    main()
