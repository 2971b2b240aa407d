"""The keeper's connections (controller.keeper): HTTP/1.1 framing, and each client connection's request in flight
relayed to a worker over a socket pair, with what the keeper keeps of it to hand it to the next worker.

A request's bytes are kept until its response is whole; a response is delivered in whole pieces only (its head, each
chunk whole, a body of known length up to HOLD_BYTES whole), so that the client never holds half of something the
next worker would have to finish. Standard library only, like the keeper.
"""

from __future__ import annotations

import array
import json
import re
import selectors
import socket
import sys
import time
from typing import Any

HOLD_BYTES = 1 << 20  # a response of known length up to this is delivered whole, or not at all
RECORD_BYTES = 16 << 20  # the body of a chunked response kept for a resume (past it: not resumable)
RECORD_ALL = 1 << 30  # what all of them may hold together
HEAD_MAX = 64 << 10
BACKLOG = 1 << 20  # bytes waiting for one side before the keeper stops reading the other
READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
POISON_TRIES = 3  # counted worker deaths in a row after which the keeper drops a request (closes its connection)
POISON_WINDOW_S = 10.0  # a worker's death counts against a request only within this long of taking it (see orphan())
LEFT_ON_S = 5.0  # how long a client's leaving waits for its worker's death to be noticed
EOF_GRACE_S = 0.3  # a pair that ends mid-response: the worker's abort, unless the worker turns out dead


def log(event: str, **kw: object) -> None:
    kw = {"event": event, "logger": "kvctl.keeper", "level": "info", **kw}
    print(json.dumps(kw, default=str), file=sys.stderr, flush=True)


def parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    """The start line and the headers (lower-case names; repeated ones joined with ', ')."""
    start, *rest = head.decode("latin-1").split("\r\n")
    fields: dict[str, str] = {}
    for line in rest:
        if ":" in line:
            name, _, value = line.partition(":")
            key = name.strip().lower()
            fields[key] = f"{fields[key]}, {value.strip()}" if key in fields else value.strip()
    return start, fields


_METHOD = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+ ")


def _request_line(data: bytearray) -> bool:
    """Whether ``data`` may begin a request (a method, then a space); what has not come yet may."""
    head = bytes(data[:64])
    return _METHOD.match(head) is not None or (len(head) < 16 and not head.startswith((b"\r", b"\n", b" ")))


def send_message(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> bool:
    """One JSON message on a keeper's control socket, with descriptors; False when the other end is gone."""
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    try:
        sock.sendmsg([json.dumps(msg).encode()], anc)
        return True
    except OSError:
        return False


def recv_message(sock: socket.socket, max_fds: int = 8) -> tuple[bytes, list[int]]:
    """One message of a keeper's control socket and the descriptors it carries (b"": the other end is gone).
    Raises BlockingIOError on a non-blocking socket with nothing to read."""
    try:
        data, anc, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(max_fds * 4))
    except (BlockingIOError, InterruptedError):
        raise
    except OSError:
        return b"", []
    fds: list[int] = []
    for level, kind, payload in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds += array.array("i", payload[: len(payload) - len(payload) % 4])
    return data, fds


def _recv(sock: socket.socket) -> bytes | None:
    """What a non-blocking socket has: None for nothing yet, b"" for its end (or an error)."""
    try:
        return sock.recv(1 << 16)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


class Chunks:
    """A chunked body as it arrives: ``feed`` gives back each whole chunk (size line to its CRLF) and the payload."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.done = False

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        self.buf += data
        out = []
        while not self.done:
            eol = self.buf.find(b"\r\n")
            if eol < 0:
                break
            size = int(bytes(self.buf[:eol]).split(b";")[0].strip() or b"0", 16)
            if size == 0:  # the last chunk, then trailers up to an empty line
                end = self.buf.find(b"\r\n\r\n", eol)
                if end < 0:
                    break
                out.append((bytes(self.buf[: end + 4]), b""))
                del self.buf[: end + 4]
                self.done = True
                break
            total = eol + 2 + size + 2
            if len(self.buf) < total:
                break
            whole = bytes(self.buf[:total])
            del self.buf[:total]
            out.append((whole, whole[eol + 2 : eol + 2 + size]))
        return out


class Message:
    """One HTTP/1.1 message's framing: its head, then its body by Content-Length, chunks, or none."""

    def __init__(self) -> None:
        self.head: bytes | None = None
        self.start = ""
        self.fields: dict[str, str] = {}
        self.chunks: Chunks | None = None
        self.left = 0  # bytes of a Content-Length body still to come
        self.held = bytearray()  # a body of known length, held until whole
        self.until_close = False  # a response whose body ends when the connection does

    def take_head(self, buf: bytearray) -> bool:
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > HEAD_MAX:
                raise ValueError("head too large")
            return False
        self.head = bytes(buf[: end + 4])
        del buf[: end + 4]
        self.start, self.fields = parse_head(self.head)
        te, cl = self.fields.get("transfer-encoding"), self.fields.get("content-length")
        if te is not None:
            if te.lower().split(",")[-1].strip() != "chunked":
                raise ValueError("a transfer coding other than chunked last")
            self.chunks = Chunks()
        elif cl is not None:
            lengths = {v.strip() for v in cl.split(",")}
            if len(lengths) != 1 or not next(iter(lengths)).isdigit():
                raise ValueError("a Content-Length that is not one number")
            self.left = int(next(iter(lengths)))
        return True


class Conn:
    """A client connection and the request in flight on it."""

    def __init__(self, ident: int, sock: socket.socket) -> None:
        self.id, self.sock = ident, sock
        self.inbuf = bytearray()  # bytes read from the client not yet part of a request
        self.req = bytearray()  # the request in flight, whole as far as read
        self.rmsg: Message | None = None  # its framing
        self.req_end = False
        self.seq = -1  # requests started on this connection
        self.pair: socket.socket | None = None
        self.worker: Any = None  # the keeper's Worker serving this request
        self.sent = 0  # bytes of req written to the pair
        self.resp = bytearray()  # the response's bytes from the pair, not yet parsed
        self.smsg: Message | None = None
        self.head_out: bytes | None = None  # the response head the client has
        self.record: bytearray | None = bytearray()  # the chunked body the client has (None: too large)
        self.cut = False  # a response of unknown continuation under way: cannot be handed over
        self.out = bytearray()  # to write to the client
        self.resume = False  # the pair carries a resume, not the request
        self.eof_at: float | None = None
        self.close_after = False
        self.closing = False  # close once what is left to write is written
        self.continued = False  # a 100 Continue went to the client for this request
        self.method = ""
        self.tunnel = False
        self.again = False  # the request went to a worker that died before answering it
        self.pair_out = bytearray()  # to write to the pair
        self.tries = 0  # counted worker deaths in a row while they had this request (the poison rule, orphan())
        self.taken_at = 0.0  # when the worker that has it took it
        self.progress = False  # the client got something new since that worker took it
        self.taken = False  # that worker said it read and inspected it (op "taken"): the request did not kill it
        self.raw_in = False  # the client's bytes cannot be framed: relayed as they come (unframed())


class Connections:
    """Every client connection, and the request in flight on each; the keeper (a subclass) says which worker serves
    (``worker``) and sends it messages (``send``)."""

    sel: selectors.BaseSelector
    conns: dict[int, Conn]
    next_id: int
    abandoned: list[str]
    worker: Any
    recorded = 0  # bytes held in Conn.record, all connections together
    left_on: list[tuple[Any, str, float]]  # (worker, request, when): clients that left a request a worker had

    def send(self, w: Any, msg: dict[str, object], fds: list[int] | None = None) -> bool:
        raise NotImplementedError

    def accept(self, lsock: socket.socket) -> None:
        try:
            sock, _ = lsock.accept()
        except OSError:
            return
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.next_id += 1
        c = Conn(self.next_id, sock)
        self.conns[c.id] = c
        self.sel.register(sock, selectors.EVENT_READ, ("client", c))

    def on_client(self, c: Conn) -> None:
        data = _recv(c.sock)
        if data is None:
            return
        if not data:
            self.close(c)
            return
        if c.tunnel:
            self.to_pair(c, data)
            return
        if c.raw_in:  # unframed: on to the worker as it comes
            c.req += data
            self.dispatch(c)
            return
        c.inbuf += data
        self.take_request(c)

    def take_request(self, c: Conn) -> None:
        """Move the client's bytes into the request in flight (a new one when none is)."""
        if c.rmsg is None:
            if not c.inbuf or c.smsg is not None or c.pair is not None:
                return
            m = Message()
            try:
                if not m.take_head(c.inbuf):
                    return
            except ValueError:
                c.rmsg, c.seq, c.req, c.sent = m, c.seq + 1, bytearray(m.head or b""), 0
                self.unframed(c)
                return
            assert m.head is not None
            c.rmsg, c.req, c.req_end, c.seq, c.sent = m, bytearray(m.head), False, c.seq + 1, 0
            c.head_out, c.record, c.cut, c.resume, c.again, c.tries = None, bytearray(), False, False, False, 0
            method = m.start.split(" ")[0]
            c.close_after = m.fields.get("connection", "").lower() == "close" or m.start.endswith("HTTP/1.0")
            c.method = method
            if m.chunks is None and m.left == 0:
                c.req_end = True
        m = c.rmsg
        if not c.req_end and c.inbuf:
            if m.chunks is not None:
                try:
                    for whole, _ in m.chunks.feed(bytes(c.inbuf)):
                        c.req += whole
                except ValueError:  # a chunk size that is not one
                    c.req += m.chunks.buf
                    self.unframed(c)
                    return
                c.inbuf = bytearray(m.chunks.buf)
                m.chunks.buf.clear()
                c.req_end = m.chunks.done
            else:
                take = c.inbuf[: m.left]
                del c.inbuf[: m.left]
                c.req += take
                m.left -= len(take)
                c.req_end = m.left == 0
        if c.req_end and c.inbuf and not c.raw_in and not _request_line(c.inbuf):
            self.unframed(c)  # what follows is no request: the worker's parser sees all of it and answers as it does
            return
        self.dispatch(c)

    def unframed(self, c: Conn) -> None:
        """Bytes the keeper cannot frame (a malformed head or body): passed to the worker as they come, which answers
        them (400), then the connection closes. Nothing of such a request goes to another worker."""
        c.req += c.inbuf
        c.inbuf.clear()
        c.req_end = c.close_after = c.cut = c.raw_in = True
        self.dispatch(c)

    def dispatch(self, c: Conn) -> None:
        """Give the request in flight a pair to a serving worker, and write what it lacks of the request."""
        if c.rmsg is None or (self.worker is None or self.worker.state != "serving"):
            return
        if c.pair is None:
            a, b = socket.socketpair()
            msg = {"op": "conn", "id": c.id, "seq": c.seq, "resume": c.head_out is not None, "again": c.again}
            if not self.send(self.worker, msg, [b.fileno()]):
                a.close()
                b.close()
                return
            b.close()
            a.setblocking(False)
            c.pair, c.worker, c.sent, c.resp, c.smsg, c.eof_at = a, self.worker, 0, bytearray(), None, None
            c.taken_at, c.progress, c.taken = time.monotonic(), False, False
            self.watch(c)
            if c.head_out is not None:
                c.resume = True
                body = bytes(c.req) + c.head_out + bytes(c.record or b"")
                head = (
                    f"POST /resume HTTP/1.1\r\nHost: keeper\r\nContent-Length: {len(body)}\r\n"
                    f"X-Request-Bytes: {len(c.req)}\r\nX-Head-Bytes: {len(c.head_out)}\r\n\r\n"
                )
                self.to_pair(c, head.encode() + body)
                c.sent = len(c.req)
                return
        if c.resume:
            return
        if c.sent < len(c.req):
            self.to_pair(c, bytes(c.req[c.sent :]))
            c.sent = len(c.req)

    def to_pair(self, c: Conn, data: bytes) -> None:
        c.pair_out += data
        self.flush_pair(c)

    def flush_pair(self, c: Conn) -> None:
        if c.pair is not None and c.eof_at is None:
            try:
                while c.pair_out:
                    del c.pair_out[: c.pair.send(c.pair_out)]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                c.pair_out.clear()  # the worker closed it: its end is read in on_pair()
        self.watch(c)

    def watch(self, c: Conn) -> None:
        """What to wait for on the client and its pair: a side reads only while the other keeps up (at most
        BACKLOG bytes waiting for it), and writes while it has bytes waiting."""
        if c.id not in self.conns:
            return
        reading = len(c.pair_out) < BACKLOG and len(c.inbuf) < BACKLOG
        self._want(c.sock, (READ if reading else 0) | (WRITE if c.out else 0), ("client", c))
        if c.pair is not None and c.eof_at is None:
            self._want(c.pair, (READ if len(c.out) < BACKLOG else 0) | (WRITE if c.pair_out else 0), ("pair", c))

    def _want(self, sock: socket.socket, events: int, data: tuple[str, Conn]) -> None:
        key = self.sel.get_map().get(sock)
        if not events:
            if key is not None:
                self.sel.unregister(sock)
        elif key is None:
            self.sel.register(sock, events, data)
        elif key.events != events:
            self.sel.modify(sock, events, data)

    def on_pair(self, c: Conn) -> None:
        assert c.pair is not None
        data = _recv(c.pair)
        if data is None:
            return
        if not data:
            if c.tunnel:
                self.close(c)
            elif c.smsg is not None and c.smsg.until_close:
                self.finish(c, b"")
            elif c.eof_at is None:
                self._want(c.pair, 0, ("pair", c))
                c.eof_at = time.monotonic()  # decided in tick(): the worker's abort, or its death
            return
        if c.tunnel:
            self.write(c, data)
            return
        c.resp += data
        self.take_response(c)

    def take_response(self, c: Conn) -> None:
        while c.resp:
            if c.smsg is None:
                c.smsg = Message()
            m = c.smsg
            if m.head is None:
                if not m.take_head(c.resp):
                    return
                head = m.head or b""
                status = int(m.start.split(" ")[1])
                if c.resume:  # the resume's own head: the client has its response's head already
                    if status != 200 or m.chunks is None:
                        log("keeper.resume_refused", conn=c.id, status=status, level="warning")
                        self.close(c)
                        return
                    continue
                if 100 <= status < 200 and status != 101:
                    if c.head_out is None and not c.continued:
                        self.write(c, head)
                        c.continued = True
                    c.smsg = None
                    continue
                if status == 101:
                    c.tunnel = True
                    self.write(c, head + bytes(c.resp))
                    c.resp.clear()
                    return
                bodiless = c.method == "HEAD" or status in (204, 304)
                if bodiless:
                    m.chunks, m.left = None, 0
                elif m.chunks is None and "content-length" not in m.fields:
                    m.until_close = c.close_after = True  # an HTTP/1.0 client's stream: the body ends with the pair
                if m.chunks is not None or m.left > HOLD_BYTES or m.until_close:
                    c.head_out = head
                    c.cut = m.chunks is None
                    self.write(c, head)
                    if m.until_close:
                        continue
                if m.chunks is None and m.left == 0:
                    self.finish(c, head)
                    return
                continue
            if m.until_close:
                self.write(c, bytes(c.resp))
                c.resp.clear()
                return
            if m.chunks is not None:
                for whole, payload in m.chunks.feed(bytes(c.resp)):
                    self.write(c, whole)
                    if c.record is not None and payload:
                        if len(c.record) + len(payload) > RECORD_BYTES or self.recorded + len(payload) > RECORD_ALL:
                            self.unrecord(c)  # not resumable: what the keeper may hold is full
                        else:
                            c.record += payload
                            self.recorded += len(payload)
                c.resp = bytearray(m.chunks.buf)
                m.chunks.buf.clear()
                if m.chunks.done:
                    self.finish(c, b"")
                return
            take = bytes(c.resp[: m.left])
            del c.resp[: m.left]
            m.left -= len(take)
            if c.head_out is not None:  # a large body: streamed
                self.write(c, take)
                if not m.left:
                    self.finish(c, b"")
                return
            m.held += take
            if not m.left:
                self.finish(c, (m.head or b"") + bytes(m.held))
            return

    def finish(self, c: Conn, rest: bytes) -> None:
        """The response is whole: the pair is done with, the next request may start."""
        if rest:
            self.write(c, rest)
        if c.smsg is not None and c.smsg.fields.get("connection", "").lower() == "close":
            c.close_after = True
        if not c.req_end:  # answered before its body came (a refused Expect: 100-continue): what follows is not framed
            c.close_after = True
        self.drop_pair(c)
        self.unrecord(c)
        c.rmsg, c.smsg, c.req, c.head_out, c.record, c.resume = None, None, bytearray(), None, bytearray(), False
        c.continued = False
        if c.close_after:
            c.closing = True
            self.flush(c)
            return
        self.take_request(c)

    def unrecord(self, c: Conn) -> None:
        if c.record is not None:
            self.recorded -= len(c.record)
        c.record = None

    def drop_pair(self, c: Conn) -> None:
        if c.pair is not None:
            self._want(c.pair, 0, ("pair", c))
            c.pair.close()
        c.pair, c.worker, c.eof_at = None, None, None
        c.pair_out.clear()

    def taken(self, w: Any, ident: object, seq: object) -> None:
        """Worker ``w`` read and inspected request ``seq`` of connection ``ident``: the request did not kill it."""
        c = self.conns.get(ident) if isinstance(ident, int) else None
        if c is not None and c.worker is w and c.seq == seq:
            c.taken = True

    def drain(self, c: Conn) -> None:
        """What a dead worker wrote of a response before it died, still in the pair: taken as if read in time (its
        whole chunks reach the client, and count as the worker's progress)."""
        while c.pair is not None and c.eof_at is None and c.id in self.conns and not c.tunnel:
            data = _recv(c.pair)
            if not data:
                return
            c.resp += data
            self.take_response(c)

    def orphan(self, c: Conn, handed_over: bool = False) -> None:
        """Its worker died (or, ``handed_over``, a reload replaced it): the request goes to the next one, as a resume
        when the client has part of a response.

        The poison rule: a death counts against the request only when that worker delivered nothing new of it to the
        client, had not said it read it whole (``taken``: a request queued for admission, parked, or generating a
        non-streamed answer did not kill it) and had held it for less than ``poison_window_s`` (a request that kills
        the worker it reaches does so at once, before anything of its answer is out); a reload's replacement never
        counts. A death that does not count ends the run, and after POISON_TRIES counted deaths in a row the request
        is dropped. The window is the dead worker's own (its hello's keeper.poison_window_s)."""
        if c.rmsg is None:
            self.drop_pair(c)
            return
        if c.tunnel or c.cut or (c.head_out is not None and c.record is None):
            log("keeper.connection_lost", conn=c.id, reason="a response that cannot be continued", level="warning")
            self.close(c)
            return
        held_s = time.monotonic() - c.taken_at
        window = c.worker.poison_window_s  # the dead worker's (Worker, controller.keeper)
        counted = not handed_over and not c.progress and not c.taken and held_s < window
        self.drop_pair(c)
        c.again = True
        c.tries = c.tries + 1 if counted else 0
        if c.tries >= POISON_TRIES:  # each worker that had it died of it at once: the request itself kills them
            log("keeper.request_dropped", conn=c.id, seq=c.seq, workers=c.tries, level="error")
            self.close(c)
            return
        log(
            "keeper.held",
            conn=c.id,
            seq=c.seq,
            resume=c.head_out is not None,
            counted=counted,
            tries=c.tries,
            handed_over=handed_over,
        )
        self.dispatch(c)

    def write(self, c: Conn, data: bytes) -> None:
        c.out += data
        c.progress = c.progress or bool(data)
        self.flush(c)

    def flush(self, c: Conn) -> None:
        try:
            while c.out:
                n = c.sock.send(c.out)
                del c.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.close(c)
            return
        if c.id in self.conns:
            self.watch(c)
            if not c.out and c.closing:
                self.close(c)

    def close(self, c: Conn) -> None:
        if self.conns.pop(c.id, None) is None:
            return
        if c.rmsg is not None and c.seq >= 0:
            # a next worker ends what the server still runs for it: now if no worker has it, else if the worker that
            # has it turns out dead (it would have ended it itself)
            key = f"{c.id}-{c.seq}"
            if c.pair is None:
                self.abandoned.append(key)
            else:
                now = time.monotonic()
                self.left_on = [(w, k, t) for w, k, t in self.left_on if now - t < LEFT_ON_S]
                self.left_on.append((c.worker, key, now))
        self.drop_pair(c)
        self.unrecord(c)
        self._want(c.sock, 0, ("client", c))
        c.sock.close()

    # --- the loop -----------------------------------------------------------------------------------------------
