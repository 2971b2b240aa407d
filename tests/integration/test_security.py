"""Security: secrets never reach the logs, the admin listener needs a token off loopback, and the
public listener never forwards slot control."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aiohttp

from testkit.llama import NO_BYTE_TOKENS, free_port, stream_completion
from tests.harness import ServerFactory
from tests.integration.faults import KvctlProcess

UPSTREAM_KEY = "sk-upstream-secret-7d1e"
ADMIN_TOKEN = "admin-secret-91c4"
CLIENT_KEY = "sk-client-secret-4b2a"


async def test_tokens_and_authorization_never_appear_in_logs(
    start_server: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    srv = start_server("-c", "2048", "-np", "2", "-kvu", "--slots", "--metrics", "--api-key", UPSTREAM_KEY)
    kv = KvctlProcess(
        srv.url,
        tmp_path / "kvctl.log",
        env={"KVCTL_UPSTREAM__API_KEY": UPSTREAM_KEY, "KVCTL_ADMIN__TOKEN": ADMIN_TOKEN, "KVCTL_LOG__LEVEL": "debug"},
    )
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        async with http_with(auth) as admin_http:
            await kv.start(admin_http)
        # a client with the server's key through the proxy, a client with a wrong key, a wrong admin token
        ok = await stream_completion(
            http,
            kv.proxy,
            {"prompt": "secret", "n_predict": 16, "ignore_eos": True, "logit_bias": NO_BYTE_TOKENS},
            headers={"Authorization": f"Bearer {UPSTREAM_KEY}"},
        )
        assert ok.status == 200
        bad = await stream_completion(
            http, kv.proxy, {"prompt": "x", "n_predict": 4}, headers={"Authorization": f"Bearer {CLIENT_KEY}"}
        )
        assert bad.status == 401
        async with http.get(kv.admin + "/status", headers={"Authorization": f"Bearer {CLIENT_KEY}"}) as r:
            assert r.status == 401
        async with http.get(kv.admin + "/status", headers=auth) as r:
            assert r.status == 200
    finally:
        await kv.stop()
    log = (tmp_path / "kvctl.log").read_text()
    assert "request.start" in log, "the log must have captured the requests, or the check shows nothing"
    for secret in (UPSTREAM_KEY, ADMIN_TOKEN, CLIENT_KEY):
        assert secret not in log


def http_with(headers: dict[str, str]) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(force_close=True))


def test_admin_off_loopback_needs_a_token() -> None:
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "controller.cli",
            "run",
            "--upstream",
            "http://127.0.0.1:1",
            "--admin",
            f"0.0.0.0:{free_port()}",
            "--listen",
            f"127.0.0.1:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2
    assert "admin.token" in res.stderr
