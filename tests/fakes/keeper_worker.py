"""A stand-in for kvctl's worker under the keeper, for tests of the keeper's framing and hand-over alone.

It speaks the keeper's protocol (hello, ready, serving; a socket pair per request) and answers by path:

- ``/whole``: a 200 with a body of known length; ``/until-close``: a body that ends when the connection does;
- a request it cannot read (a Content-Length that is no number, a transfer coding): 400, and it closes;
- ``/poison``: it dies before answering (whichever worker gets it);
- ``/die-mid-chunk``: a chunked 200, one whole chunk ``one``, then half of the next, then it dies (SIGKILL-like);
- ``POST /resume`` (the keeper's hand-over): a chunked 200 whose one chunk names what it was given
  (``resumed:<request line>:<body the client has>``), then the end.

Run as ``python -m tests.fakes.keeper_worker``; the keeper starts it with its control socket's fd in the environment.
"""

from __future__ import annotations

import json
import os
import socket

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


def main() -> None:
    ctrl = socket.socket(fileno=int(os.environ[FD_ENV]))
    port, admin = int(os.environ["FAKE_LISTEN_PORT"]), int(os.environ["FAKE_ADMIN_PORT"])
    _send(ctrl, {"op": "hello", "protocols": [PROTOCOL], "listen": ["127.0.0.1", port], "admin": ["127.0.0.1", admin]})
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
            out = b"resumed:" + request_line + b":" + had
            pair.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + _chunk(out) + b"0\r\n\r\n")
        pair.close()


if __name__ == "__main__":
    main()
