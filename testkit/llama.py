"""Run the real patched llama-server in tests, and talk to it.

Modelled on llama.cpp's own tools/server/tests/utils.py: the binary comes from
LLAMA_SERVER_BIN_PATH, each server gets a free port, start-up polls /health while
watching for an early exit, and stop() terminates, then kills.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

# SPM byte-fallback tokens <0x00>..<0xFF>. A token that ends in an incomplete UTF-8 sequence gets no
# stream chunk of its own (the server sends its bytes with the next one), so its id never reaches the
# client. Banning these tokens gives every token its own chunk, and the client sees every id.
NO_BYTE_TOKENS: list[list[int | bool]] = [[i, False] for i in range(3, 259)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_argv(binary: Path, model: Path, port: int, *args: str) -> list[str]:
    """The command line of a test server on loopback: greedy, seeded, one thread.

    -t 1: ggml's spinning thread pool collapses when it shares 2 cores with anything else.
    """
    return [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        "1",
        "-tb",
        "1",
        "--temp",
        "0",
        "--seed",
        "42",
        "--no-warmup",
        *args,
    ]


class ServerProcess:
    """One llama-server child process on a loopback port."""

    def __init__(
        self, binary: Path, model: Path, args: Sequence[str], log_path: Path, cpus: set[int] | None = None
    ) -> None:
        self.binary = binary
        self.cpus = cpus  # pin every thread of the server to these CPUs (benchmarks)
        self.model = model
        self.args = list(args)
        self.log_path = log_path
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120.0) -> ServerProcess:
        cmd = server_argv(self.binary, self.model, self.port, *self.args)
        log = self.log_path.open("ab")
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        cpus = self.cpus
        self.proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError, urllib.error.URLError):
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"llama-server did not become healthy in {timeout} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


# --- SSE ------------------------------------------------------------------------------------


@dataclass
class SSEEvent:
    data: str | None = None
    comments: list[str] = field(default_factory=list)


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[SSEEvent]:
    """Frame an SSE body on blank lines.

    Lines end only at \\n, \\r\\n or \\r: random-weight models emit U+2028 and friends inside
    JSON strings, which str.splitlines() would wrongly treat as line breaks.
    """
    event = SSEEvent()
    data_lines: list[str] = []
    while True:
        raw = await resp.content.readline()
        if not raw:
            break
        line = raw.decode("utf-8").rstrip("\r\n")
        if line == "":
            if data_lines or event.comments:
                event.data = "\n".join(data_lines) if data_lines else None
                yield event
            event, data_lines = SSEEvent(), []
        elif line.startswith(":"):
            event.comments.append(line[1:].strip())
        elif line.startswith("data:"):
            data_lines.append(line[5:].lstrip(" "))
    if data_lines or event.comments:
        event.data = "\n".join(data_lines) if data_lines else None
        yield event


@dataclass
class StreamResult:
    status: int
    tokens: list[int] = field(default_factory=list)
    content: str = ""
    n_decoded: list[int] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)
    final: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    id_slot: int | None = None

    @property
    def announced_ids(self) -> list[int]:
        """The token ids of the ``: tokens`` comments (asked for with ``X-Token-Ids: 1``): every id, where a chunk's
        own ``tokens`` leave out those of tokens whose text the server held back (incomplete UTF-8)."""
        return [int(t) for c in self.comments if c.startswith("tokens") for t in c.split()[1:]]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Where two runs' token ids part: the index of the first id that differs (or where the shorter run ends), None
    when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    *,
    headers: dict[str, str] | None = None,
    on_chunk: Any = None,
) -> StreamResult:
    """POST /completion with stream=true; collect token ids, text, n_decoded and SSE comments."""
    body = {"stream": True, **payload}
    async with session.post(url + "/completion", json=body, headers=headers) as resp:
        res = StreamResult(status=resp.status)
        if resp.status != 200:
            res.error = (await resp.json()).get("error")
            return res
        try:
            async for ev in sse_events(resp):
                res.comments.extend(ev.comments)
                if ev.data is None:
                    continue
                chunk = json.loads(ev.data)
                if "error" in chunk:
                    res.error = chunk["error"]
                    break
                res.id_slot = chunk.get("id_slot", res.id_slot)
                if chunk.get("stop"):
                    res.final = chunk
                    res.content += chunk.get("content", "")
                    continue
                res.tokens.extend(chunk.get("tokens", []))
                res.content += chunk.get("content", "")
                res.n_decoded.append(int(chunk["tokens_predicted"]))
                if on_chunk is not None:
                    await on_chunk(res)
        except BaseException:
            resp.close()  # hang up now: the server must see the client go away
            raise
        return res


async def get_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> Any:
    async with session.get(url, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def post_action(
    session: aiohttp.ClientSession,
    url: str,
    slot: int | str,
    action: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any], dict[str, str]]:
    kwargs: dict[str, Any] = {"headers": headers}
    if body is not None:
        kwargs["data"] = body if isinstance(body, (str, bytes)) else json.dumps(body)
    async with session.post(f"{url}/slots/{slot}?action={action}", **kwargs) as resp:
        return resp.status, await resp.json(content_type=None), dict(resp.headers)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: unlabelled samples by name; every sample must have a # TYPE line.

    Parsed by prometheus_client's own parser: a sample of a family with no ``# TYPE`` line comes back in a family
    of type ``unknown``.
    """
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert family.type != "unknown", f"{sample.name} has no # TYPE line"
            if not sample.labels:
                values[sample.name] = float(sample.value)
    return values
