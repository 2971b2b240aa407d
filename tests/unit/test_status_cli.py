"""``kvctl status``, ``park`` and ``resume``: the text view of the status model, the exit codes
against a fake admin listener, ``--json`` and ``--watch``; the degraded verdict against kvctl itself."""

from __future__ import annotations

import asyncio
import io
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestServer

from controller.admin.models import (
    DiskView,
    ExitView,
    GpuDeviceView,
    LoopView,
    PoolView,
    SlotView,
    Status,
    SupervisorView,
    UpstreamView,
)
from controller.app import App, configure_logging
from controller.cli.client import admin_url
from controller.cli.main import main
from controller.cli.render import pool_bar, render_status
from controller.settings import LogFormat, LogSettings
from tests.fakes.llama_server import FakeLlamaServer, kv_body
from tests.harness import FAST_LOOP, running_app

GiB = 1024**3

# --- fixture models ----------------------------------------------------------------------------------


def slot(id: int, state: str = "idle", **kw: Any) -> SlotView:
    busy = state != "idle"
    fields: dict[str, Any] = {
        "id": id,
        "id_task": 100 + id if busy else None,
        "state": state,
        "n_cells": 0,
        "age_s": 65.0 if busy else None,
        "n_decoded": 0,
        "park_count": 0,
        "parked_since_ms": None,
        "waited_s": None,
        "pinned": False,
        "auto_parked": False,
    }
    fields.update(kw)
    return SlotView(**fields)


def pool(**kw: Any) -> PoolView:
    fields: dict[str, Any] = {
        "n_cells": 8192,
        "n_cells_used": 5816,
        "used_ratio": 0.71,
        "projected_target": 0.73,
        "projected_draft": None,
        "pressure": 0.73,
        "high": 0.94,
        "low": 0.80,
        "max_pressure": 0.955,
        "max_growth": 0.01,
        "above_high_s": None,
        "n_parked": 0,
        "parked_bytes": 0,
        "parked_budget_bytes": 8 * GiB,
    }
    fields.update(kw)
    return PoolView(**fields)


def healthy(**kw: Any) -> Status:
    fields: dict[str, Any] = {
        "version": "0.1.0",
        "uptime_s": 2 * 3600 + 3 * 60 + 4,
        "ready": True,
        "degraded": False,
        "problems": [],
        "upstream": UpstreamView(
            url="http://127.0.0.1:8081/",
            state="up",
            up=True,
            last_error=None,
            polls=1234,
            last_poll_age_s=0.02,
            backoff_s=None,
            lease_held=True,
        ),
        "supervisor": None,
        "pool": pool(),
        "slots": [
            slot(0, "generating", n_cells=3000, n_decoded=1520, age_s=64.0),
            slot(1, "prompt", n_cells=2816, age_s=0.5),
            slot(2),
        ],
        "loop": LoopView(alive=True, heartbeat_age_s=0.01, restarts=0, parks=0, resumes=0, ends=0, action_failures=0),
        "host_available_bytes": 54 * GiB,
        "host_total_bytes": 128 * GiB,
        "gpu": "absent",
        "gpu_devices": [],
    }
    fields.update(kw)
    return Status(**fields)


def degraded() -> Status:
    return healthy(
        ready=False,
        degraded=True,
        problems=["upstream down: connection refused", "supervised server backoff"],
        upstream=UpstreamView(
            url="http://127.0.0.1:8081/",
            state="restarting",
            up=False,
            last_error="connection refused",
            polls=1234,
            last_poll_age_s=12.0,
            backoff_s=0.4,
            lease_held=None,
        ),
        supervisor=SupervisorView(
            state="backoff",
            pid=None,
            starts=2,
            restarts=1,
            ready_since_unix=None,
            next_start_in_s=1.5,
            last_exit=None,
        ),
        pool=None,
        slots=[],
    )


def parked() -> Status:
    return healthy(
        pool=pool(n_parked=2, parked_bytes=GiB, above_high_s=3.0, projected_draft=0.65),
        slots=[
            slot(0, "generating", n_cells=5000, n_decoded=900, priority=5, effective_priority=5),
            slot(1, "parked", n_cells=1200, n_decoded=800, park_count=2, waited_s=12.3, pinned=True, park_mode="swap"),
            slot(
                2,
                "parked",
                n_cells=700,
                n_decoded=40,
                park_count=1,
                waited_s=190.0,
                auto_parked=True,
                park_mode="recompute",
                priority=-3,
                effective_priority=5,
            ),
            slot(3),
            slot(4, "prompt", n_cells=300, n_decoded=12, park_count=1, park_mode="recompute", recomputing=True),
        ],
    )


def with_gpu() -> Status:
    return healthy(
        gpu="ok",
        gpu_devices=[
            GpuDeviceView(index=0, name="NVIDIA H200", used_bytes=80 * GiB, free_bytes=60 * GiB, total_bytes=140 * GiB),
            GpuDeviceView(index=1, name=None, used_bytes=None, free_bytes=None, total_bytes=None),
        ],
    )


def line(text: str, label: str) -> str:
    """The header line with this label."""
    found = [ln for ln in text.splitlines() if ln.split("  ")[0].strip() == label]
    assert found, f"no {label!r} line in:\n{text}"
    return found[0]


def row(text: str, slot_id: int) -> list[str]:
    """A slot's table row, split into columns (a column never holds two spaces)."""
    for ln in text.splitlines():
        cols = re.split(r"\s{2,}", ln.strip())
        if cols and cols[0] == str(slot_id) and len(cols) > 2:
            return cols
    raise AssertionError(f"no row for slot {slot_id} in:\n{text}")


# --- the text view -----------------------------------------------------------------------------------


def test_the_pool_bar_marks_high_and_low_between_cells() -> None:
    assert pool_bar(0.5, 0.9, 0.7, unicode=True, width=10) == "[█████░░|░░|░]"
    assert pool_bar(0.5, 0.9, 0.7, unicode=False, width=10) == "[#####..|..|.]"
    # full and empty pools, out-of-range values clamp
    assert pool_bar(1.2, 0.94, 0.8, unicode=False, width=10) == "[########|#|#]"
    assert pool_bar(-1, 0.94, 0.8, unicode=False, width=10) == "[........|.|.]"
    bar = pool_bar(0.71, 0.94, 0.80, unicode=True)
    assert bar.count("|") == 2 and bar.count("█") == 28 and len(bar) == 40 + 4


def test_healthy_view() -> None:
    text = render_status(healthy())
    title = text.splitlines()[0]
    assert title == "kvctl 0.1.0 · ok · up 2h 03m"
    upstream = line(text, "upstream")
    assert "up  http://127.0.0.1:8081/" in upstream and "polled 20 ms ago" in upstream
    pool_line = line(text, "pool")
    assert pool_bar(0.71, 0.94, 0.80, unicode=True) in pool_line
    assert "71 %  HIGH 94 %  LOW 80 %" in pool_line and "(5816 of 8192 cells)" in pool_line
    assert line(text, "projected").split(None, 1)[1] == "target 73 %  no draft pool  peak 95.5 %"
    assert line(text, "parked").endswith("0 requests, 0 B of 8.0 GiB budget (0 %)")
    assert line(text, "host RAM").endswith("54.0 GiB available of 128.0 GiB")
    assert line(text, "GPU").endswith("absent")
    assert "problem" not in text
    assert re.split(r"\s{2,}", text.splitlines()[8].strip()) == [
        "slot",
        "state",
        "cells",
        "age",
        "decoded",
        "parks",
        "parked for",
        "prio",
    ]
    assert row(text, 0) == ["0", "generating", "3000", "1m 04s", "1520", "0", "-", "0"]
    assert row(text, 1) == ["1", "prompt", "2816", "500 ms", "0", "0", "-", "0"]
    assert row(text, 2) == ["2", "idle", "-", "-", "-", "-", "-", "-"]
    assert "pinned:" not in text, "the flags legend only when a slot has a flag"
    assert "exact mode" not in upstream


def test_an_exact_server_says_so_on_the_upstream_line() -> None:
    plain = healthy()
    st = healthy(upstream=plain.upstream.model_copy(update={"exact": True}))
    assert line(render_status(st), "upstream").endswith("polled 20 ms ago  exact mode")
    assert Status.model_validate_json(st.model_dump_json()).upstream.exact is True


def test_degraded_view() -> None:
    text = render_status(degraded())
    assert text.splitlines()[0] == "kvctl 0.1.0 · degraded · up 2h 03m"
    upstream = line(text, "upstream")
    assert upstream.split()[1] == "restarting"
    assert "last error: connection refused" in upstream
    assert "(supervised: backoff, 1 restart, next start in 1.5 s)" in upstream
    assert line(text, "pool").endswith("unknown (upstream down)")
    problems = [ln for ln in text.splitlines() if ln.startswith("problem")]
    assert [p.split(None, 1)[1] for p in problems] == [
        "upstream down: connection refused",
        "supervised server backoff",
    ]
    assert text.splitlines()[-1] == "no slots (upstream down)"


def failed() -> Status:
    down = degraded()
    assert down.supervisor is not None
    return down.model_copy(
        update={
            "problems": ["supervised server failed: llama-server failed to start 5 times in a row (...)"],
            "upstream": down.upstream.model_copy(update={"state": "failed"}),
            "supervisor": down.supervisor.model_copy(
                update={
                    "state": "failed",
                    "starts": 5,
                    "restarts": 4,
                    "next_start_in_s": None,
                    "early_exits": 5,
                    "failed_after": 5,
                    "failure": "llama-server failed to start 5 times in a row (...)",
                    "last_exit": ExitView(
                        returncode=-11,
                        at_unix=1.0,
                        early=True,
                        uptime_s=2.5,
                        signal="SIGSEGV",
                        log_tail=["llama_model_load: loading model", "ggml_cuda_init: failed"],
                    ),
                }
            ),
        }
    )


def test_failed_view_shows_the_last_exit_and_the_server_s_last_lines() -> None:
    text = render_status(failed())
    assert text.splitlines()[0] == "kvctl 0.1.0 · degraded · up 2h 03m"
    upstream = line(text, "upstream")
    assert upstream.split()[1] == "failed"
    assert "(supervised: failed, 4 restarts, 5 of 5 early exits)" in upstream
    assert line(text, "last exit").endswith("killed by SIGSEGV after 2.5 s, before it was ready")
    lines = text.splitlines()
    at = lines.index(line(text, "server log"))
    assert lines[at].endswith("  llama_model_load: loading model")
    assert lines[at + 1].strip() == "ggml_cuda_init: failed" and lines[at + 1].index("ggml") == lines[at].index("llama")
    assert line(text, "problem").endswith("failed to start 5 times in a row (...)")


def test_any_last_exit_is_shown_with_its_signal_or_code_but_the_log_only_once_failed() -> None:
    down = degraded()
    assert down.supervisor is not None
    sup = down.supervisor

    def after(last: ExitView) -> str:
        return render_status(down.model_copy(update={"supervisor": sup.model_copy(update={"last_exit": last})}))

    killed = ExitView(returncode=-9, at_unix=1.0, early=False, uptime_s=3700.0, signal="SIGKILL", log_tail=["bye"])
    text = after(killed)
    assert line(text, "last exit").endswith("killed by SIGKILL after 1h 01m")
    assert "server log" not in text and "bye" not in text
    exited = ExitView(returncode=1, at_unix=1.0, early=True, uptime_s=0.5)
    text = after(exited)
    assert line(text, "last exit").endswith("exit code 1 after 500 ms, before it was ready")
    assert "last exit" not in render_status(degraded()), "no exit yet"


def test_a_status_of_schema_5_still_reads() -> None:
    doc = failed().model_dump(mode="json")
    for key in ("early_exits", "failed_after", "failure"):
        del doc["supervisor"][key]
    for key in ("signal", "log_tail"):
        del doc["supervisor"]["last_exit"][key]
    old = Status.model_validate(doc)
    assert old.supervisor is not None and old.supervisor.last_exit is not None
    assert old.supervisor.last_exit.signal is None and old.supervisor.last_exit.log_tail == []
    assert "last exit" in render_status(old)


def test_a_saturated_pool_is_not_ready_but_not_degraded() -> None:
    status = healthy(ready=False, problems=["saturated: parked requests wait and the pool is above LOW"])
    text = render_status(status)
    assert text.splitlines()[0] == "kvctl 0.1.0 · ok, not ready · up 2h 03m"
    assert line(text, "problem").endswith("saturated: parked requests wait and the pool is above LOW")


def test_parked_slots_view() -> None:
    text = render_status(parked())
    assert line(text, "parked").endswith("2 requests, 1.0 GiB of 8.0 GiB budget (12.5 %)")
    projected = line(text, "projected")
    assert "target 73 %  draft 65 %" in projected and "at or above HIGH for 3.0 s" in projected
    assert row(text, 0) == ["0", "generating", "5000", "1m 05s", "900", "0", "-", "5"]
    assert row(text, 1) == ["1", "parked", "1200", "1m 05s", "800", "2", "12.3 s", "0", "pinned swap"]
    assert row(text, 2) == ["2", "parked", "700", "1m 05s", "40", "1", "3m 10s", "-3\u21925", "auto recompute"]
    assert row(text, 3) == ["3", "idle", "-", "-", "-", "-", "-", "-"]
    assert row(text, 4) == ["4", "prompt", "300", "1m 05s", "12", "1", "-", "0", "re-evaluating"]
    assert "-3->5" in render_status(parked(), unicode=False), "aged past priority_max_wait_s: counts as the top"
    assert text.splitlines()[-2].startswith("pinned: parked by hand")
    assert text.splitlines()[-1].startswith("swap: its cells wait in host RAM (on disk:")


def test_the_disk_tier_shows_under_parked() -> None:
    disk = DiskView(
        dir="/var/lib/llama-server-park",
        used_bytes=3 * GiB,
        budget_bytes=8 * GiB,
        files=2,
        write_bytes_per_s=2 * GiB,
        read_bytes_per_s=None,
        fallbacks=1,
        spills=3,
    )
    s = healthy(
        pool=pool(n_parked=2, disk=disk),
        slots=[slot(0, "parked", n_cells=1200, park_count=1, waited_s=2.0, park_mode="swap", park_tier="disk")],
    )
    text = render_status(s)
    assert line(text, "on disk") == (
        "on disk    3.0 GiB of 8.0 GiB in 2 files under /var/lib/llama-server-park  (write 2.0 GiB/s)"
        "  3 moved from RAM  1 recomputed after a disk error"
    )
    assert row(text, 0)[-1] == "swap on disk"
    assert "on disk" not in render_status(healthy())


def test_gpu_views() -> None:
    text = render_status(with_gpu())
    gpus = [ln.split(None, 1)[1] for ln in text.splitlines() if ln.startswith("GPU")]
    assert gpus == ["#0 NVIDIA H200  80.0 GiB used of 140.0 GiB (60.0 GiB free)", "#1  memory not reported"]
    assert line(render_status(healthy(gpu="error")), "GPU").endswith("error")
    assert line(render_status(healthy()), "GPU").endswith("absent")


@pytest.mark.parametrize("make", [healthy, degraded, parked, with_gpu])
def test_plain_ascii_when_the_terminal_is_not_utf8(make: Any) -> None:
    text = render_status(make(), unicode=False)
    assert text.isascii()
    assert text.splitlines()[0].startswith("kvctl 0.1.0 - ")
    if make is not degraded:
        assert "[" + "#" * 28 + "....|" in line(text, "pool")


# --- a fake admin listener ---------------------------------------------------------------------------


@dataclass
class FakeAdmin:
    """Answers /status and the slot actions with what a test sets; records what it was sent."""

    status: int = 200
    body: str = field(default_factory=lambda: healthy().model_dump_json())
    action_status: int = 200
    action_body: str = ""
    token: str | None = None
    seen: list[web.Request] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/status", self._status)
        app.router.add_post("/slots/{id}/{action}", self._action)
        return app

    def _refused(self, request: web.Request) -> web.Response | None:
        self.seen.append(request)
        if self.token is not None and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"error": {"message": "a bearer token is required"}}, status=401)
        return None

    # `is None`, not `or`: a response is a mapping, and an empty one is falsy before aiohttp 3.11
    async def _status(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        return web.Response(status=self.status, text=self.body, content_type="application/json")

    async def _action(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        return web.Response(status=self.action_status, text=self.action_body, content_type="application/json")


@pytest.fixture
async def admin() -> AsyncIterator[tuple[FakeAdmin, str]]:
    fake = FakeAdmin()
    server = TestServer(fake.app())
    await server.start_server()
    try:
        yield fake, f"{server.host}:{server.port}"
    finally:
        await server.close()


@pytest.fixture(autouse=True)
def no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVCTL_ADMIN__LISTEN", "KVCTL_ADMIN__TOKEN"):
        monkeypatch.delenv(name, raising=False)


async def kvctl(*argv: str) -> int:
    return await asyncio.to_thread(main, list(argv))


# --- exit codes ----------------------------------------------------------------------------------------


async def test_exit_0_when_ok_with_the_text_view(
    admin: tuple[FakeAdmin, str], capsys: pytest.CaptureFixture[str]
) -> None:
    _, address = admin
    assert await kvctl("status", "--admin", address, "--text") == 0
    assert capsys.readouterr().out == render_status(healthy()) + "\n"


async def test_text_on_a_terminal_json_for_a_pipe(
    admin: tuple[FakeAdmin, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, address = admin
    assert await kvctl("status", "--admin", address) == 0
    assert capsys.readouterr().out == fake.body + "\n", "not a terminal: the JSON as served"
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    assert await kvctl("status", "--admin", address) == 0
    assert capsys.readouterr().out == render_status(healthy()) + "\n"
    fake.action_body = PARKED
    assert await kvctl("park", "0", "--admin", address) == 0
    assert capsys.readouterr().out == "slot 0: parked and pinned (task 8, 100 cells, 50.0 KiB)\n"


async def test_exit_0_when_saturated_and_1_when_degraded(
    admin: tuple[FakeAdmin, str], capsys: pytest.CaptureFixture[str]
) -> None:
    fake, address = admin
    fake.body = healthy(ready=False, problems=["saturated"]).model_dump_json()
    assert await kvctl("status", "--admin", address) == 0, "not ready is not degraded"
    fake.body = degraded().model_dump_json()
    assert await kvctl("status", "--admin", address, "--text") == 1
    assert "· degraded ·" in capsys.readouterr().out


async def test_exit_3_when_kvctl_is_not_reachable(unused_tcp_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert await kvctl("status", "--admin", f"127.0.0.1:{unused_tcp_port}") == 3
    assert await kvctl("park", "0", "--admin", f"127.0.0.1:{unused_tcp_port}") == 3
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("not reachable at http://127.0.0.1:") == 2


@pytest.mark.parametrize(
    ("status", "body", "says"),
    [
        (200, "{not json", "unreadable status"),
        (200, '{"version": "0.1.0"}', "unreadable status"),
        (200, healthy().model_dump_json().replace('"degraded":false', '"degraded":"maybe"'), "at degraded"),
        (500, "boom", "answered 500"),
    ],
)
async def test_exit_4_when_the_status_is_unreadable(
    admin: tuple[FakeAdmin, str], capsys: pytest.CaptureFixture[str], status: int, body: str, says: str
) -> None:
    fake, address = admin
    fake.status, fake.body = status, body
    assert await kvctl("status", "--admin", address, "--text") == 4
    assert await kvctl("status", "--admin", address, "--json") == 4
    captured = capsys.readouterr()
    assert captured.out == "" and says in captured.err


async def test_the_token_is_sent_and_a_refused_one_exits_4(
    admin: tuple[FakeAdmin, str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, address = admin
    fake.token = "t0ken"
    assert await kvctl("status", "--admin", address) == 4
    assert "pass --token or set KVCTL_ADMIN__TOKEN" in capsys.readouterr().err
    assert await kvctl("status", "--admin", address, "--token", "wrong") == 4
    assert "the token was refused" in capsys.readouterr().err
    assert await kvctl("status", "--admin", address, "--token", "t0ken") == 0
    monkeypatch.setenv("KVCTL_ADMIN__TOKEN", "t0ken")
    assert await kvctl("status", "--admin", address) == 0
    assert fake.seen[-1].headers["Authorization"] == "Bearer t0ken"


async def test_the_admin_address_comes_from_the_settings(
    admin: tuple[FakeAdmin, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    fake, address = admin
    monkeypatch.setenv("KVCTL_ADMIN__LISTEN", address)
    assert await kvctl("status") == 0
    monkeypatch.delenv("KVCTL_ADMIN__LISTEN")
    config = tmp_path / "kvctl.toml"
    config.write_text(f'[admin]\nlisten = "{address}"\n')
    assert await kvctl("--config", str(config), "status") == 0
    assert len(fake.seen) == 2


def test_admin_urls() -> None:
    assert admin_url("127.0.0.1:8091") == "http://127.0.0.1:8091"
    assert admin_url("0.0.0.0:8091") == "http://127.0.0.1:8091"
    assert admin_url("[::]:8091") == "http://[::1]:8091"
    assert admin_url("[::1]:8091") == "http://[::1]:8091"
    assert admin_url("localhost:8091") == "http://localhost:8091"
    with pytest.raises(ValueError, match="port 0"):
        admin_url("127.0.0.1:0")


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--watch", "0"],
        ["status", "--watch", "soon"],
        ["status", "--watch", "1", "--json"],
        ["status", "--json", "--text"],
        ["status", "--admin", "nowhere"],
        ["status", "--admin", "127.0.0.1:0"],
        ["status", "--bogus"],
        ["status", "--", "x"],
        ["park"],
        ["park", "x"],
        ["park", "-1"],
        ["park", "\u2460"],
        ["resume", "0", "1"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err


def test_an_invalid_admin_setting_exits_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVCTL_ADMIN__LISTEN", "127.0.0.1:0")
    assert main(["status"]) == 2
    assert "pass --admin HOST:PORT" in capsys.readouterr().err


def test_help_documents_the_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--watch SECONDS" in out and "admin.degraded_after_s" in out and "3  kvctl not running" in out


# --- --json and --watch --------------------------------------------------------------------------------


async def test_json_prints_the_served_status_exactly(
    admin: tuple[FakeAdmin, str], capsys: pytest.CaptureFixture[str]
) -> None:
    fake, address = admin
    for model, code in ((parked(), 0), (degraded(), 1)):
        fake.body = model.model_dump_json()
        assert await kvctl("status", "--admin", address, "--json") == code, "printed even when degraded"
        assert capsys.readouterr().out == fake.body + "\n"


class _Frames(io.StringIO):
    """A stdout that is interrupted (like Ctrl-C) when a third frame starts."""

    encoding = "utf-8"

    def __init__(self) -> None:
        super().__init__()
        self.frames = 0

    def isatty(self) -> bool:
        return False

    def write(self, s: str) -> int:
        if s.startswith("every "):
            self.frames += 1
            if self.frames == 3:
                raise KeyboardInterrupt
        return super().write(s)


async def test_watch_redraws_until_interrupted(admin: tuple[FakeAdmin, str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake, address = admin
    out = _Frames()
    monkeypatch.setattr("sys.stdout", out)
    assert await kvctl("status", "--admin", address, "--watch", "0.01") == 0, "Ctrl-C exits 0"
    text = out.getvalue()
    assert text.count("every 0.01 s, Ctrl-C to stop") == 2
    assert text.count("kvctl 0.1.0 · ok · up 2h 03m") == 2
    assert len(fake.seen) >= 2


async def test_watch_shows_an_unreachable_kvctl_and_keeps_going(
    unused_tcp_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = _Frames()
    monkeypatch.setattr("sys.stdout", out)
    assert await kvctl("status", "--admin", f"127.0.0.1:{unused_tcp_port}", "--watch", "0.01") == 0
    assert out.getvalue().count("kvctl: not reachable at") == 2


# --- park and resume -----------------------------------------------------------------------------------

PARKED = (
    '{"slot": 0, "id_task": 8, "action": "park", "pinned": true, "detail": "parked and pinned", "n_cells": 100,'
    ' "n_bytes": 51200}'
)
RESUMED = (
    '{"slot": 0, "id_task": 8, "action": "resume", "pinned": false, "detail": "resumed", "n_cells": 100,'
    ' "n_bytes": 51200}'
)


async def test_park_and_resume_print_one_line(admin: tuple[FakeAdmin, str], capsys: pytest.CaptureFixture[str]) -> None:
    fake, address = admin
    fake.action_body = PARKED
    assert await kvctl("park", "0", "--admin", address, "--text") == 0
    assert capsys.readouterr().out == "slot 0: parked and pinned (task 8, 100 cells, 50.0 KiB)\n"
    assert fake.seen[-1].path == "/slots/0/park"
    fake.action_body = RESUMED
    assert await kvctl("resume", "3", "--admin", address, "--text") == 0
    assert capsys.readouterr().out == "slot 0: resumed (task 8, 100 cells, 50.0 KiB)\n"
    assert fake.seen[-1].path == "/slots/3/resume"
    assert await kvctl("resume", "0", "--admin", address, "--json") == 0
    assert capsys.readouterr().out == RESUMED + "\n"


async def test_park_refused_exits_1_unreadable_4(
    admin: tuple[FakeAdmin, str], capsys: pytest.CaptureFixture[str]
) -> None:
    fake, address = admin
    fake.action_status = 409
    fake.action_body = '{"error": {"message": "slot 1 serves no request", "type": "conflict_error"}}'
    assert await kvctl("park", "1", "--admin", address) == 1
    assert capsys.readouterr().err == "kvctl park 1: refused: slot 1 serves no request (409)\n"
    fake.action_body = "<html>"
    assert await kvctl("resume", "1", "--admin", address) == 4
    fake.action_status, fake.action_body = 200, '{"slot": 0}'
    assert await kvctl("park", "1", "--admin", address) == 4
    assert capsys.readouterr().err.count("unreadable answer") == 2
    fake.token = "t0ken"
    assert await kvctl("park", "1", "--admin", address) == 4


# --- the degraded verdict, against kvctl itself ---------------------------------------------------------


@pytest.fixture
def logs_to_stderr() -> Iterator[None]:
    configure_logging(LogSettings(format=LogFormat.CONSOLE))
    yield
    structlog.reset_defaults()


async def running_kvctl(fake: FakeLlamaServer, degraded_after_s: float) -> AsyncIterator[tuple[App, str]]:
    async with running_app(fake, admin={"degraded_after_s": degraded_after_s}, loop=FAST_LOOP) as (app, _, _):
        yield app, app.admin_addresses[0]


async def wait_polled(app: App, n: int) -> None:
    target = app.loop.state.polls + n
    for _ in range(500):
        if app.loop.state.polls >= target:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the loop did not poll")


@pytest.mark.usefixtures("logs_to_stderr")
@pytest.mark.parametrize(("degraded_after_s", "code"), [(0.05, 1), (60.0, 0)])
async def test_pressure_above_high_is_degraded_only_when_sustained(
    degraded_after_s: float, code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeLlamaServer()
    # one request alone above HIGH: nothing to park it for, so the pressure stays
    fake.kv = kv_body(1000, [{"state": "generating", "n_cells": 960, "id_task": 8, "t_arrival_ms": 1}, {}])
    async for app, address in running_kvctl(fake, degraded_after_s):
        await wait_polled(app, 2)
        await asyncio.sleep(0.1)
        await wait_polled(app, 2)
        assert await kvctl("status", "--admin", address, "--json") == code
        status = Status.model_validate_json(capsys.readouterr().out)
        assert status.pool is not None and status.pool.above_high_s is not None and status.pool.above_high_s > 0.05
        assert status.degraded is (code == 1) and status.ready
        assert any("pressure at or above HIGH" in p for p in status.problems) is (code == 1)
        assert status.upstream.state == "up" and status.slots[0].n_decoded == 0
        assert await kvctl("status", "--admin", address, "--text") == code
        assert "at or above HIGH for" in line(capsys.readouterr().out, "projected")
        # back under HIGH: the clock starts again
        fake.kv = kv_body(1000, [{"state": "generating", "n_cells": 100, "id_task": 8, "t_arrival_ms": 1}, {}])
        await wait_polled(app, 2)
        assert await kvctl("status", "--admin", address, "--json") == 0
        status = Status.model_validate_json(capsys.readouterr().out)
        assert status.pool is not None and status.pool.above_high_s is None and not status.degraded
