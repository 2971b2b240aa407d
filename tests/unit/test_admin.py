"""The admin API and the CLI that drives it, with kvctl's App running in-process against a fake server."""

from __future__ import annotations

import ast
import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import structlog

from controller.admin.app import Readiness
from controller.admin.models import Status
from controller.app import App, configure_logging
from controller.cli.main import main
from controller.settings import LogFormat, LogSettings
from tests.fakes.llama_server import FakeLlamaServer, error, kv_body
from tests.harness import FAST_LOOP, running_app


@pytest.fixture(autouse=True)
def logs_to_stderr() -> Iterator[None]:
    # the CLI's stdout is what these tests read: kvctl's own log lines go to stderr, as in production
    configure_logging(LogSettings(format=LogFormat.CONSOLE))
    yield
    structlog.reset_defaults()


@pytest.fixture
def fake() -> FakeLlamaServer:
    f = FakeLlamaServer()
    f.kv = kv_body(1000, [{"state": "generating", "n_cells": 100, "id_task": 8, "t_arrival_ms": 1}, {}])
    return f


async def start_app(fake: FakeLlamaServer, **admin: Any) -> AsyncIterator[tuple[App, str]]:
    async with running_app(fake, admin=admin, loop=FAST_LOOP) as (app, _proxy, url):
        yield app, url


@pytest.fixture
async def running(fake: FakeLlamaServer) -> AsyncIterator[tuple[App, str]]:
    async for pair in start_app(fake):
        yield pair


async def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    async with aiohttp.ClientSession() as s, s.get(url, headers=headers) as r:
        return r.status, await r.text()


async def wait_polled(app: App, n: int = 2) -> None:
    target = app.loop.state.polls + n
    for _ in range(500):
        if app.loop.state.polls >= target:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the loop did not poll")


async def test_status_metrics_and_probes(running: tuple[App, str]) -> None:
    app, url = running
    await wait_polled(app)
    code, body = await get(url + "/status")
    assert code == 200
    status = Status.model_validate_json(body)
    assert status.ready and status.upstream.up and status.problems == []
    assert status.pool is not None and status.pool.n_cells == 1000 and status.pool.high == 0.94
    assert [s.state for s in status.slots] == ["generating", "idle"]
    assert status.loop.alive and status.supervisor is None and status.gpu == "absent"
    code, text = await get(url + "/metrics")
    assert code == 200
    assert "kvctl_upstream_up 1.0" in text and "kvctl_build_info{" in text and "kvctl_polls_total" in text
    assert (await get(url + "/healthz"))[0] == 200
    assert (await get(url + "/readyz"))[0] == 200


async def test_a_lost_upstream_makes_it_unready_but_alive(fake: FakeLlamaServer, running: tuple[App, str]) -> None:
    app, url = running
    await wait_polled(app)
    fake.queue("GET /kv", *[error(500, "server_error", "gone")] * 1000)
    for _ in range(200):
        if not app.loop.state.upstream_up:
            break
        await asyncio.sleep(0.01)
    code, body = await get(url + "/readyz")
    assert code == 503 and "upstream down" in body
    assert (await get(url + "/healthz"))[0] == 200
    status = Status.model_validate_json((await get(url + "/status"))[1])
    assert not status.ready and status.pool is None and status.upstream.last_error


async def test_manual_park_and_resume_through_the_cli(
    fake: FakeLlamaServer, running: tuple[App, str], capsys: pytest.CaptureFixture[str]
) -> None:
    app, url = running
    await wait_polled(app)
    admin = url.removeprefix("http://")
    assert await asyncio.to_thread(main, ["park", "0", "--admin", admin]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pinned"] is True and out["id_task"] == 8 and out["action"] == "park"
    assert [s.body for s in fake.seen if s.query.get("action") == "park"] == [b'{"id_task": 8}']
    fake.kv = kv_body(
        1000,
        [
            {
                "state": "parked",
                "n_cells": 0,
                "n_prompt": 50,
                "n_decoded": 51,
                "id_task": 8,
                "park": {"count": 1, "bytes": 0, "t_parked_total_ms": 0, "parked_since_ms": 1},
            },
            {},
        ],
    )
    await wait_polled(app)
    status = Status.model_validate_json((await get(url + "/status"))[1])
    assert status.slots[0].pinned and status.slots[0].n_cells == 100
    assert not [s for s in fake.seen if s.query.get("action") == "resume"], "a pinned request stays parked"
    assert await asyncio.to_thread(main, ["resume", "0", "--admin", admin]) == 0
    assert json.loads(capsys.readouterr().out)["pinned"] is False
    # refusals carry the server's reason and exit 1
    fake.kv = kv_body(1000, [{"state": "generating", "n_cells": 101, "id_task": 8, "t_arrival_ms": 1}, {}])
    await wait_polled(app)
    fake.queue("POST park", error(503, "unavailable_error", "park budget exceeded", retry_after=1))
    assert await asyncio.to_thread(main, ["park", "0", "--admin", admin]) == 1
    assert "park budget exceeded" in capsys.readouterr().err
    async with aiohttp.ClientSession() as s, s.post(url + "/slots/x/park") as r:
        # kvctl's marker with its reason code, and the older marker for one more release
        assert r.status == 400 and r.headers["X-Kvctl-Error"] == "invalid_slot"
        assert r.headers["X-Kvctl-Origin"] == "kvctl"
        assert (await r.json())["error"] == {
            "message": "invalid slot id 'x': expected a non-negative integer",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_slot",
        }
    async with aiohttp.ClientSession() as s, s.post(url + "/slots/5/park") as r:
        assert r.status == 404 and r.headers["X-Kvctl-Error"] == (await r.json())["error"]["code"] == "no_such_slot"
    fake.queue("POST park", error(503, "unavailable_error", "park budget exceeded", retry_after=1))
    async with aiohttp.ClientSession() as s, s.post(url + "/slots/0/park") as r:
        assert r.status == 503 and r.headers["X-Kvctl-Error"] == "server_refused" and r.headers["Retry-After"] == "1"


def test_the_cli_reads_the_admin_api_s_models_without_importing_the_loop() -> None:
    code = "import sys, controller.cli.main; print(sorted(m for m in sys.modules if m.startswith('controller')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(ast.literal_eval(out))
    assert "controller.admin.models" in loaded
    assert not {m for m in loaded if m.startswith(("controller.loop.", "controller.proxy.", "controller.policy."))}, (
        loaded
    )
    assert not loaded & {"controller.admin.status", "controller.admin.app", "controller.app"}, loaded


async def test_a_manual_park_may_ask_for_a_mode(
    fake: FakeLlamaServer, running: tuple[App, str], capsys: pytest.CaptureFixture[str]
) -> None:
    app, url = running
    await wait_polled(app)
    for query in ("?mode=offload", "?mode="):
        async with aiohttp.ClientSession() as s, s.post(url + "/slots/0/park" + query) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_mode"
    async with aiohttp.ClientSession() as s, s.post(url + "/slots/0/resume?mode=swap") as r:
        assert r.status == 400, "a resume takes no mode"
    assert not [s for s in fake.seen if s.query.get("action") in ("park", "resume")]
    admin = url.removeprefix("http://")
    assert await asyncio.to_thread(main, ["park", "0", "--mode", "recompute", "--admin", admin]) == 0
    assert json.loads(capsys.readouterr().out)["pinned"] is True
    assert [s.body for s in fake.seen if s.query.get("action") == "park"] == [b'{"id_task": 8, "mode": "recompute"}']


async def test_status_exit_codes(
    fake: FakeLlamaServer, running: tuple[App, str], capsys: pytest.CaptureFixture[str]
) -> None:
    app, url = running
    await wait_polled(app)
    admin = url.removeprefix("http://")
    assert await asyncio.to_thread(main, ["status", "--admin", admin]) == 0
    assert Status.model_validate_json(capsys.readouterr().out).ready
    fake.queue("GET /kv", *[error(500, "server_error", "gone")] * 1000)
    for _ in range(200):
        if not app.loop.state.upstream_up:
            break
        await asyncio.sleep(0.01)
    assert await asyncio.to_thread(main, ["status", "--admin", admin]) == 1
    assert not Status.model_validate_json(capsys.readouterr().out).ready
    assert await asyncio.to_thread(main, ["status", "--admin", "127.0.0.1:1"]) == 3


async def test_a_token_guards_everything_but_the_probes(fake: FakeLlamaServer) -> None:
    async for app, url in start_app(fake, token="t0ken"):
        await wait_polled(app)
        assert (await get(url + "/status"))[0] == 401
        assert (await get(url + "/metrics"))[0] == 401
        assert (await get(url + "/status", {"Authorization": "Bearer t0ken"}))[0] == 200
        assert (await get(url + "/healthz"))[0] == 200 and (await get(url + "/readyz"))[0] == 200
        assert (
            await asyncio.to_thread(main, ["status", "--admin", url.removeprefix("http://"), "--token", "t0ken"]) == 0
        )


def test_readiness_has_hysteresis() -> None:
    r = Readiness(unready_after_s=2, ready_after_s=5)
    assert not r.update(False, False, 0)
    assert r.update(True, False, 0), "the first time the upstream is up, ready at once"
    assert r.update(True, True, 1) and r.update(True, True, 2.9), "a short saturation does not flap it"
    assert r.update(True, False, 3)
    assert r.update(True, True, 4)
    assert not r.update(True, True, 6), "saturated for 2 s: not ready"
    assert not r.update(True, False, 7) and not r.update(True, False, 11.9)
    assert not r.update(True, True, 12) and not r.update(True, False, 13)
    assert r.update(True, False, 18), "relieved for 5 s: ready again"
    assert not r.update(False, False, 19), "a lost upstream: not ready at once"


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--spawn"]) == 2
    assert main(["run", "--", "llama-server"]) == 2
    assert main(["status", "--", "x"]) == 2
    assert main(["nope"]) == 2
    assert main(["run", "--upstream", "ftp://x"]) == 2
    assert "invalid setting upstream.url" in capsys.readouterr().err


async def test_readyz_turns_unready_while_parked_requests_wait_above_low(fake: FakeLlamaServer) -> None:
    async for app, url in start_app(fake, unready_after_s=0.05, ready_after_s=0.2):
        await wait_polled(app)
        assert (await get(url + "/readyz"))[0] == 200
        # 850 of 1000 cells resident and a request waiting to be restored: saturated
        fake.kv = kv_body(
            1000,
            [
                {"state": "generating", "n_cells": 850, "id_task": 8, "t_arrival_ms": 1},
                {
                    "state": "parked",
                    "n_cells": 0,
                    "n_prompt": 50,
                    "n_decoded": 51,
                    "id_task": 9,
                    "park": {"count": 1, "bytes": 0, "t_parked_total_ms": 0, "parked_since_ms": 10**13},
                },
            ],
        )
        await wait_polled(app, 20)
        code, body = await get(url + "/readyz")
        assert code == 503 and "saturated" in body
        fake.kv = kv_body(1000, [{"state": "generating", "n_cells": 100, "id_task": 8, "t_arrival_ms": 1}, {}])
        await wait_polled(app, 2)
        assert (await get(url + "/readyz"))[0] == 503, "relief must last ready_after_s"
        await asyncio.sleep(0.3)
        await wait_polled(app, 2)
        assert (await get(url + "/readyz"))[0] == 200
