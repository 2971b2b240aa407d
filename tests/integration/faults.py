"""Helpers for the fault and fuzz tests: kvctl as a subprocess, raw HTTP, waits (kvctl in this process, the request
bodies: tests/harness.py)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from testkit.llama import free_port, sse_events

ROOT = Path(__file__).resolve().parents[2]


async def wait_until(cond: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)


async def poll_json(
    http: aiohttp.ClientSession, url: str, cond: Callable[[Any], bool], timeout_s: float, what: str
) -> Any:
    """GET url (without the lease header: a test must not hold the controller's lease) until cond(answer)."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with http.get(url) as resp:
            body = await resp.json(content_type=None)
        if cond(body):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}; last: {str(body)[:600]}")
        await asyncio.sleep(0.05)


def samples(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of one metric in Prometheus text, over the series whose labels include ``labels``."""
    return sum(
        float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def metrics_text(http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> str:
    async with http.get(url + "/metrics", headers=headers) as resp:
        assert resp.status == 200
        return await resp.text()


def log_events(path: Path) -> list[dict[str, Any]]:
    """kvctl's JSON log lines (anything else, such as aiohttp's own log records, is skipped)."""
    events = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


# --- kvctl as a process ----------------------------------------------------------------------------


@dataclass
class KvctlProcess:
    """``python -m controller.cli run`` in its own process group, logging JSON lines to a file."""

    upstream: str
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proxy_port: int = field(default_factory=free_port)
    admin_port: int = field(default_factory=free_port)
    proc: asyncio.subprocess.Process | None = None
    pre: list[str] = field(default_factory=list)  # arguments before ``run`` (--config FILE)
    extra: list[str] = field(default_factory=list)  # more ``run`` arguments (--spawn -- ARGV last)
    cwd: Path = ROOT
    listen_flags: bool = True  # False: the listen addresses come from the settings (the config file the test writes)

    @property
    def proxy(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    async def start(self, http: aiohttp.ClientSession, timeout_s: float = 30.0) -> KvctlProcess:
        """Start it and wait until its control loop has polled the server."""
        env = {**os.environ, "KVCTL_LOG__FORMAT": "json", **self.env}
        listen = ["--listen", f"127.0.0.1:{self.proxy_port}", "--admin", f"127.0.0.1:{self.admin_port}"]
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "controller.cli",
                *self.pre,
                "run",
                "--upstream",
                self.upstream,
                *(listen if self.listen_flags else []),
                *self.extra,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                cwd=self.cwd,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.returncode is None, f"kvctl exited with {self.proc.returncode}:\n{self.log_tail()}"
            with contextlib.suppress(aiohttp.ClientError):
                status = await self.status(http)
                if status["upstream"]["up"] and status["upstream"]["polls"] > 0:
                    return self
            if time.monotonic() > deadline:
                raise AssertionError(f"kvctl did not come up in {timeout_s} s:\n{self.log_tail()}")
            await asyncio.sleep(0.1)

    async def status(self, http: aiohttp.ClientSession) -> Any:
        async with http.get(self.admin + "/status") as resp:
            resp.raise_for_status()
            return await resp.json()

    def kill(self) -> None:
        """SIGKILL: no clean-up of any kind, as the OOM killer or a power cut would do it."""
        assert self.proc is not None and self.proc.returncode is None
        os.kill(self.proc.pid, signal.SIGKILL)

    async def stop(self) -> int | None:
        """SIGTERM, then SIGKILL of the whole group; the exit code, or None if it was never started."""
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # anything it left behind in its group
        return proc.returncode

    def events(self) -> list[dict[str, Any]]:
        return log_events(self.log_path)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


class SplitForwarder:
    """A TCP forwarder in front of the server. Armed, it passes on the first part of the next SSE event the server
    sends (into its ``data:`` line) and holds the rest until released: a kvctl worker killed meanwhile dies holding
    half an event, a place no sleep finds. Then that connection closes; every other byte passes as it came."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        self.target = (host, int(port))
        self.port = 0
        self.splits = 0
        self._armed = False
        self.split = asyncio.Event()  # half an event passed on
        self.release = asyncio.Event()
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> SplitForwarder:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def arm(self) -> None:
        self._armed = True
        self.split.clear()
        self.release.clear()

    async def stop(self) -> None:
        self.release.set()
        if self._server is not None:
            self._server.close()

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, down: bool) -> None:
            try:
                while data := await src.read(65536):
                    at = data.find(b"data:") if down and self._armed else -1
                    if at >= 0 and data.find(b"\n\n", at) > at + 12:
                        self._armed = False
                        dst.write(data[: at + 12])  # "data: {" and a little: the event's end never comes
                        await dst.drain()
                        self.splits += 1
                        self.split.set()
                        await self.release.wait()
                        return
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                for w in (dst, writer, up_w):
                    w.close()

        await asyncio.gather(pipe(reader, up_w, False), pipe(up_r, writer, True))


# --- a client that reads whatever comes back -------------------------------------------------------


@dataclass
class Outcome:
    """What a client saw: a status and body, SSE data events, or the exception that ended the read."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: Any = None
    events: list[str] = field(default_factory=list)
    exception: BaseException | None = None

    @property
    def error_event(self) -> dict[str, Any] | None:
        for data in reversed(self.events):
            with contextlib.suppress(ValueError):
                chunk = json.loads(data)
                if isinstance(chunk, dict) and "error" in chunk:
                    return dict(chunk["error"])
        return None


async def post_and_read(http: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> Outcome:
    """POST and read the answer to its end: SSE events for a stream, the JSON body otherwise."""
    out = Outcome()
    try:
        async with http.post(url, json=payload) as resp:
            out.status, out.headers = resp.status, dict(resp.headers)
            if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                async for ev in sse_events(resp):
                    if ev.data is not None:
                        out.events.append(ev.data)
            else:
                out.body = await resp.json(content_type=None)
    except (aiohttp.ClientError, ValueError) as e:
        out.exception = e
    return out


# --- raw HTTP, for bytes no well-behaved client sends ----------------------------------------------


@dataclass
class RawAnswer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def from_http_parser(self) -> bool:
        """aiohttp's own answer to a request it could not parse (it never reaches kvctl's handlers)."""
        return self.status == 400 and (self.header("Content-Type") or "").startswith("text/plain")


def raw_request(
    port: int,
    method: str,
    target: bytes | str,
    headers: Sequence[tuple[bytes, bytes]] = (),
    body: bytes = b"",
    timeout_s: float = 60.0,
) -> RawAnswer:
    """One HTTP/1.1 request written byte for byte (no validation of names, values or the target)."""
    if isinstance(target, str):
        target = target.encode()
    head = method.encode() + b" " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    for name, value in headers:
        head += name + b": " + value + b"\r\n"
    if body or method in ("POST", "PUT", "PATCH"):
        head += b"Content-Length: " + str(len(body)).encode() + b"\r\n"
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            # a server may answer and close before it read a large body
            sock.sendall(head + b"\r\n" + body)
        resp = http.client.HTTPResponse(sock, method=method)
        resp.begin()
        data = resp.read()
        return RawAnswer(resp.status, resp.getheaders(), data)
    finally:
        sock.close()


def assert_envelope(ans: RawAnswer, *, kvctl: bool | None = None, admin: bool = False) -> dict[str, Any]:
    """An error body. kvctl=True: kvctl's own, which on the admin API (admin=True) is the OpenAI envelope (code a
    string) and on the proxy the server's error body marked kvctl: with a kvctl_code; kvctl=False: the server's."""
    assert (ans.header("Content-Type") or "").startswith("application/json"), (ans.status, ans.body[:300])
    err = ans.json["error"]
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if kvctl is True and admin:
        assert isinstance(err["code"], str) and "param" in err, err
    elif kvctl is True:
        assert err["code"] == ans.status and isinstance(err["kvctl_code"], str), err
        assert err["message"].startswith("kvctl: ") and ans.header("X-Kvctl-Error") == err["kvctl_code"], err
    elif kvctl is False:
        assert err["code"] == ans.status, err
    return dict(err)
