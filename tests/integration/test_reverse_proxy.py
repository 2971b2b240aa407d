"""The nginx and Caddy configurations of docs/operations.md, run for real in front of kvctl.

Each configuration is taken from the document's code block (TLS and the host name swapped for a loopback
port), so the document cannot drift from what works:

- a stream parked by hand after its first tokens: while the request is parked, for longer than a heartbeat
  interval, the client holds every token generated before the park (none is held back on the way), keeps its
  connection, and gets every token once the request is resumed;
- a 2 MiB request body passes (nginx refuses bodies over 1 MiB by default).

nginx and Caddy are Debian's (scripts/test.sh installs nginx-light and caddy).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from testkit.llama import StreamResult, free_port, get_json, stream_completion
from tests.harness import ServerFactory, request, running_app

pytestmark = pytest.mark.server

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
N_PREDICT = 400
HELD_S = 7.0  # parked longer than a heartbeat interval (proxy.heartbeat_s, 5 s)


def doc_block(lang: str) -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, f"docs/operations.md should hold one {lang} block"
    return blocks[0]


def nginx_conf(tmp: Path, port: int, kvctl_port: int) -> Path:
    site = doc_block("nginx").replace("server 127.0.0.1:8080;", f"server 127.0.0.1:{kvctl_port};")
    kept = [ln for ln in site.splitlines() if not re.match(r"\s*(listen|http2|ssl_\w+|server_name)\b", ln)]
    site = "\n".join(kept).replace("server {", f"server {{\n    listen 127.0.0.1:{port};", 1)
    conf = tmp / "nginx.conf"
    conf.write_text(
        f"daemon off;\nmaster_process off;\npid {tmp}/nginx.pid;\nerror_log {tmp}/error.log;\nevents {{}}\n"
        f"http {{\n    access_log off;\n    client_body_temp_path {tmp}/body;\n    proxy_temp_path {tmp}/proxy;\n"
        f"{site}\n}}\n"
    )
    return conf


def caddyfile(tmp: Path, port: int, kvctl_port: int) -> Path:
    site = doc_block("caddy").replace("llm.example.com", f"http://127.0.0.1:{port}", 1)
    site = site.replace("reverse_proxy 127.0.0.1:8080", f"reverse_proxy 127.0.0.1:{kvctl_port}")
    conf = tmp / "Caddyfile"
    conf.write_text("{\n    admin off\n    auto_https off\n}\n\n" + site)
    return conf


@contextlib.contextmanager
def running(argv: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(100):
            if proc.poll() is not None:
                pytest.fail(f"{argv[0]} exited {proc.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
                break
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def check_through(front: str, http: aiohttp.ClientSession, server: str, admin: str) -> None:
    live: list[StreamResult] = []

    async def keep(res: StreamResult) -> None:
        if not live:
            live.append(res)

    async def park_hold_resume() -> tuple[int, int]:
        """Park the request by hand once the server has generated a few tokens; after HELD_S, how many the
        server had generated when it parked and how many the client holds; then resume it."""
        while True:
            kv = await get_json(http, server + "/kv")
            busy = [s for s in kv["slots"] if s["state"] == "generating" and s["n_decoded"] >= 3]
            if busy:
                break
            await asyncio.sleep(0.01)
        slot = busy[0]["id"]
        async with http.post(f"{admin}/slots/{slot}/park") as resp:
            assert resp.status == 200, await resp.text()
        await asyncio.sleep(HELD_S)
        kv = await get_json(http, server + "/kv")
        assert kv["slots"][slot]["state"] == "parked"
        generated, received = kv["slots"][slot]["n_decoded"], len(live[0].n_decoded) if live else 0
        async with http.post(f"{admin}/slots/{slot}/resume") as resp:
            assert resp.status == 200, await resp.text()
        return generated, received

    stream = asyncio.ensure_future(
        stream_completion(http, front, request("Once upon a time", N_PREDICT), on_chunk=keep)
    )
    generated, received = await asyncio.wait_for(park_hold_resume(), 60)
    res = await asyncio.wait_for(stream, 120)
    assert res.status == 200 and res.error is None, res.error
    assert res.n_decoded == list(range(1, N_PREDICT + 1)), "a token was lost or repeated on the way through"
    assert any("parked" in c for c in res.comments), "the park was not announced to the client"
    # what the server streamed before the park must not wait on the way (in a buffer) while the request is parked
    assert 0 < generated < N_PREDICT and received == generated, (
        f"while parked the client held {received} of the {generated} tokens generated: something buffers"
    )

    big = json.dumps({"prompt": "Hi", "n_predict": 1, "padding": "x" * (2 << 20)}).encode()
    headers = {"Content-Type": "application/json"}
    async with http.post(front + "/completion", data=io.BytesIO(big), headers=headers) as resp:
        assert resp.status == 200, f"a 2 MiB body was refused ({resp.status})"


def front_command(kind: str, tmp: Path, port: int, kvctl_port: int) -> tuple[list[str], dict[str, str] | None]:
    """The reverse proxy's command line and environment (None: this one's)."""
    if kind == "nginx":
        conf = nginx_conf(tmp, port, kvctl_port)
        return [shutil.which("nginx") or "/usr/sbin/nginx", "-c", str(conf), "-p", str(tmp)], None
    conf = caddyfile(tmp, port, kvctl_port)
    home = str(tmp)  # Caddy keeps its state under the home folder
    env = {"HOME": home, "XDG_DATA_HOME": home, "XDG_CONFIG_HOME": home, "PATH": "/usr/bin"}
    return [shutil.which("caddy") or "/usr/bin/caddy", "run", "--config", str(conf), "--adapter", "caddyfile"], env


@pytest.mark.parametrize("kind", ["nginx", "caddy"])
async def test_the_documented_configuration(
    kind: str, start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    srv = start_server("-c", "4096", "-np", "2", "-kvu", "--slots", "--metrics")
    async with running_app(srv.url) as (_app, url, admin):
        port = free_port()
        argv, env = front_command(kind, tmp_path, port, int(url.rsplit(":", 1)[1]))
        with running(argv, port, tmp_path / f"{kind}.log", env) as front:
            await check_through(front, http, srv.url, admin)
