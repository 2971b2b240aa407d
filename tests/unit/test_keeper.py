"""The keeper's framing and hand-over (controller/keeper.py, keeper_conns.py), with a stand-in worker
(tests/fakes/keeper_worker.py): a chunk the worker wrote in part never reaches the client, and the next worker is
handed exactly what the client has. The real worker's hand-overs: tests/integration/test_keeper.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.keeper_conns import HEAD_MAX, Chunks, Message
from testkit.llama import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_chunks_come_whole_however_the_bytes_are_cut() -> None:
    wire = b"3\r\none\r\n5;ext=1\r\nthree\r\n0\r\nTrailer: x\r\n\r\nNEXT"
    for step in (1, 2, 7, len(wire)):
        c, got = Chunks(), []
        for i in range(0, len(wire), step):
            got += c.feed(wire[i : i + step])
        assert [w for w, _ in got] == [b"3\r\none\r\n", b"5;ext=1\r\nthree\r\n", b"0\r\nTrailer: x\r\n\r\n"]
        assert [p for _, p in got] == [b"one", b"three", b""]
        assert c.done and bytes(c.buf) == b"NEXT", "what follows the body is the next message's"


def test_message_heads_and_their_bodies() -> None:
    buf = bytearray(b"POST /x HTTP/1.1\r\nContent-Length: 4\r\nX-A: 1\r\nx-a: 2\r\n\r\nbody")
    m = Message()
    assert m.take_head(buf) and m.left == 4 and m.chunks is None and bytes(buf) == b"body"
    assert m.start == "POST /x HTTP/1.1" and m.fields["x-a"] == "1, 2"
    m = Message()
    assert m.take_head(bytearray(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")) and m.chunks is not None
    assert not Message().take_head(bytearray(b"GET / HTTP/1.1\r\n"))
    with pytest.raises(ValueError):
        Message().take_head(bytearray(b"GET / HTTP/1.1\r\nX: " + b"y" * HEAD_MAX))


@contextlib.contextmanager
def keeper(state: Path | None = None, window: float | None = None, log: Path | None = None) -> Iterator[int]:
    """A keeper with the stand-in worker on a free port; ``state``: the stand-in's counters, ``window``: its
    keeper.poison_window_s, ``log``: where the keeper's stderr goes."""
    port = free_port()
    env = {**os.environ, "FAKE_LISTEN_PORT": str(port), "FAKE_ADMIN_PORT": str(free_port())}
    if state is not None:
        env["FAKE_STATE_DIR"] = str(state)
    if window is not None:
        env["FAKE_POISON_WINDOW"] = str(window)
    worker = [sys.executable, "-m", "tests.fakes.keeper_worker"]
    err = open(log, "wb") if log is not None else None
    proc = subprocess.Popen([sys.executable, "-m", "controller.keeper", "--", *worker], cwd=ROOT, env=env, stderr=err)
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() < deadline and proc.poll() is None, "the keeper did not listen"
            time.sleep(0.05)
        yield port
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        if err is not None:
            err.close()


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_a_worker_that_dies_mid_chunk_is_replaced_and_handed_what_the_client_has() -> None:
    with keeper() as port, socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"GET /whole HTTP/1.1\r\nHost: x\r\n\r\n")
        first = b""
        while not first.endswith(b"whole"):
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 OK\r\n")
        s.sendall(b"GET /die-mid-chunk HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got = _read_all(s)
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"X-Head: 1" in head and head.count(b"HTTP/1.1") == 1, "one response head, the first worker's"
    # the whole chunk the first worker wrote, never its half chunk, then the next worker's chunks, then the end
    resumed = b"resumed:GET /die-mid-chunk HTTP/1.1:one"
    assert body == b"3\r\none\r\n" + b"%x\r\n%s\r\n" % (len(resumed), resumed) + b"0\r\n\r\n", body


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET /whole HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        b"GET /whole HTTP/1.1\r\nContent-Length: 1, 2\r\n\r\nxy",
        b"POST /whole HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n",
        b"POST /whole HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: " + b"y" * (HEAD_MAX + 10),
    ],
)
def test_what_the_keeper_cannot_frame_goes_to_the_worker_and_the_keeper_serves_on(garbage: bytes) -> None:
    with keeper() as port:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(garbage)
            assert _read_all(s).startswith(b"HTTP/1.1 400"), "the worker's answer, then the connection closes"
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(b"GET /whole HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert _read_all(s).endswith(b"whole")


def test_a_body_that_ends_with_the_connection_reaches_the_client_whole() -> None:
    with keeper() as port, socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.sendall(b"GET /until-close HTTP/1.0\r\n\r\n")
        assert _read_all(s) == b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nabcdef"


def test_a_request_that_kills_every_worker_is_dropped_and_the_rest_served(tmp_path: Path) -> None:
    log = tmp_path / "keeper.log"
    with keeper(log=log) as port:
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(b"GET /poison HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_all(s) == b"", "closed after POISON_TRIES workers died of it"
        with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
            s.sendall(b"GET /whole HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert _read_all(s).endswith(b"whole")
    events = _events(log)
    assert [e["workers"] for e in events if e["event"] == "keeper.request_dropped"] == [3]
    assert [e["counted"] for e in events if e["event"] == "keeper.held"] == [True, True], "three deaths in a row"


def _events(log: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]


def _get(port: int, path: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        return _read_all(s)


def test_a_stream_that_progresses_with_each_worker_survives_any_number_of_deaths(tmp_path: Path) -> None:
    log = tmp_path / "keeper.log"
    with keeper(log=log) as port:
        got = _get(port, "/stream-die/8")  # eight workers each deliver one chunk and die at once
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b"1\r\nx\r\n" * 8 + b"4\r\ndone\r\n0\r\n\r\n", got
    held = [e for e in _events(log) if e["event"] == "keeper.held"]
    assert len(held) == 8 and not any(e["counted"] for e in held), "each death came after something new"


def test_deaths_after_the_window_do_not_count_and_within_it_they_do(tmp_path: Path) -> None:
    (tmp_path / "short").mkdir()
    with keeper(tmp_path / "short", window=0.2) as port:
        assert _get(port, "/slow-die/5").endswith(b"whole"), "five workers held it 0.5 s each, past the window"
    assert (tmp_path / "short" / "_slow-die_5").read_text() == "5"
    (tmp_path / "long").mkdir()  # the control: the same deaths within the default window drop it after three
    with keeper(tmp_path / "long") as port:
        assert _get(port, "/slow-die/5") == b""
    assert (tmp_path / "long" / "_slow-die_5").read_text() == "3"


def test_a_death_after_the_worker_read_the_request_whole_does_not_count(tmp_path: Path) -> None:
    with keeper(tmp_path) as port:  # the default window: only "taken" keeps these five deaths from counting
        assert _get(port, "/taken-die/5").endswith(b"whole")
    assert (tmp_path / "_taken-die_5").read_text() == "5"


def test_a_reload_is_a_hand_over_that_counts_against_no_request(tmp_path: Path) -> None:
    log = tmp_path / "keeper.log"
    with keeper(tmp_path, log=log) as port:
        assert _get(port, "/reload-me/6").endswith(b"whole"), "six reloads replaced the worker holding it"
    assert (tmp_path / "_reload-me_6").read_text() == "6"
    events = _events(log)
    held = [e for e in events if e["event"] == "keeper.held"]
    assert len(held) == 6 and all(e["handed_over"] and not e["counted"] for e in held)
    assert sum(e["event"] == "keeper.replacing" for e in events) == 6
