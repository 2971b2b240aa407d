"""The control loop against a server that answers slowly, and the loop's own small defects (issue 18).

A scripted fake server (tests/fakes/llama_server.py) delays its answers; each test fails on the loop before
issue 18: a slow park or poll counted as a dead server, a manual command that timed out crashed the loop, a
poll_soon() during a step was lost, a cut-off answer escaped as an aiohttp exception. The delays are real (the
calls' timeouts are aiohttp's own); the loop's cadence and back-off are tested on a fake clock (test_loop.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from controller.admin.models import ManualAction
from controller.errors import Code, KvctlError
from controller.loop.control import ControlLoop
from controller.metrics import Metrics
from controller.proxy.metrics import STREAM_ERROR_STAGES, ProxyMetrics
from controller.settings import Settings, load_settings
from controller.upstream.client import UpstreamClient, UpstreamUnavailable
from tests.fakes.llama_server import FakeLlamaServer, Reply, kv_body
from tests.harness import LOOP_NOW as NOW
from tests.harness import loop_sample as sample
from tests.harness import park_answer, plenty, pressured


def settings(**upstream: Any) -> Settings:
    return load_settings(
        overrides={
            "loop": {"poll_interval_s": 0.01, "backoff_initial_s": 0.01, "backoff_max_s": 0.05},
            "upstream": {"timeout_s": 0.3, **upstream},
        }
    )


def make_loop(client: UpstreamClient, s: Settings) -> ControlLoop:
    return ControlLoop(client, s, Metrics(CollectorRegistry()), host=plenty, clock_ms=lambda: NOW)


@contextlib.asynccontextmanager
async def running(loop: ControlLoop) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(loop.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def parked_kv(task: int = 8) -> dict[str, Any]:
    park = {"count": 1, "bytes": 51200, "t_parked_total_ms": 0, "parked_since_ms": NOW - 1000}
    return kv_body(1000, [{"state": "parked", "n_cells": 100, "id_task": task, "park": park}])


async def test_a_park_answered_after_the_request_timeout_is_recorded_and_the_server_stays_up(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    # the park answers 3 s late, beyond timeout_s (0.3): its own timeout follows the snapshot (floor 10 s)
    fake.kv = pressured()
    fake.queue("POST park", Reply(body=park_answer(2, 3).body, delay_s=3.0))
    loop = make_loop(client, settings())
    assert await loop.step()
    assert loop.state.parks == 1 and loop.state.history[3].parks == 1
    assert loop.state.upstream_up and loop.state.action_failures == 0


async def test_a_park_that_times_out_does_not_mark_the_server_down_nor_forget_what_the_loop_knew(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    fake.kv = pressured()
    loop = make_loop(client, settings(action_timeout_min_s=0.2, action_timeout_max_s=0.2))
    fake.queue("POST park", Reply(body=park_answer(2, 3).body))
    assert await loop.step()
    assert loop.state.history[3].parks == 1
    fake.kv = pressured()
    fake.kv["slots"][0]["state"] = "generating"
    fake.queue("POST park", Reply(body=park_answer(2, 3).body, delay_s=1.0))
    with capture_logs() as logs:
        await loop.step()
    assert [e["event"] for e in logs if e["event"].startswith("park.")] == ["park.failed"]
    assert loop.state.upstream_up, "an action that timed out is no poll: the server is not down"
    assert sample(loop, "kvctl_action_failures_total", action="park", status="none") == 1
    assert sample(loop, "kvctl_poll_errors_total", kind="UpstreamUnavailable") == 0
    assert await loop.step()
    assert 3 in loop.state.history and loop.state.history[3].parks == 1, "history survives: no down/up transition"


async def test_a_poll_waits_behind_the_server_s_longest_batch(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    # the server measured 1000 prompt tokens/s and may run a 1024-cell batch: a poll may wait ~1 s for it
    fake.kv = kv_body(1000, park_rates={"prompt_tokens_per_s": 1000.0})
    fake.kv["next_step"]["n_total_max"] = 1024
    loop = make_loop(client, settings(timeout_s=2.0))  # the default, once every call's timeout
    assert await loop.step()
    assert loop.poll_timeout_s() == pytest.approx(2.0 + 2 * 1.024)
    fake.queue("GET /kv", Reply(body=fake.kv, delay_s=2.5))
    assert await loop.step(), "an answer 2.5 s late, past the old fixed timeout (2 s), is an answer"
    assert loop.state.upstream_up and sample(loop, "kvctl_poll_errors_total", kind="UpstreamUnavailable") == 0
    fake.kv["park_rates"] = {"prompt_tokens_per_s": 1.0}  # a batch of 1024 s: capped by poll_timeout_max_s
    assert await loop.step()
    assert loop.poll_timeout_s() == loop.settings.upstream.poll_timeout_max_s


async def test_a_poll_s_timeout_follows_the_server_s_published_step_time(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    # patch 24: the server's decaying peak of its main-loop iteration; the longer of it and the batch estimate counts
    fake.kv = kv_body(1000, park_rates={"prompt_tokens_per_s": 1000.0, "step_ms": 1500.0})
    fake.kv["next_step"]["n_total_max"] = 512
    loop = make_loop(client, settings())
    assert await loop.step()
    assert loop.poll_timeout_s() == pytest.approx(0.3 + 2 * 1.5)
    fake.kv["park_rates"]["step_ms"] = 1.0  # a stretch of copy-only iterations decays it: the batch estimate holds
    assert await loop.step()
    assert loop.poll_timeout_s() == pytest.approx(0.3 + 2 * 0.512)
    fake.queue("GET /kv", Reply(body=fake.kv, delay_s=1.2))
    assert await loop.step() and loop.state.upstream_up


async def test_an_action_s_timeout_follows_its_snapshot_within_floor_and_ceiling(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    loop = make_loop(client, settings(action_timeout_min_s=10, action_timeout_max_s=300))
    assert loop.action_timeout_s(0) == 10, "no measured rate, nothing to copy: the floor"
    assert loop.action_timeout_s(10 * 10**9) == pytest.approx(0.3 + 40), "10 GB at the assumed 1 GB/s, 4x"
    fake.kv = kv_body(1000, park_rates={"copy_bytes_per_s": 20e9})
    assert await loop.step()
    assert loop.action_timeout_s(10 * 10**9) == 10, "at the measured 20 GB/s: 2 s, under the floor"
    assert loop.action_timeout_s(10**13) == 300, "the ceiling"
    # patch 24: the measured rate of parks and resumes from request to answer (a sliced copy spans steps) wins
    fake.kv = kv_body(1000, park_rates={"copy_bytes_per_s": 20e9, "wall_bytes_per_s": 0.5e9})
    assert await loop.step()
    assert loop.action_timeout_s(10 * 10**9) == pytest.approx(0.3 + 2 * 20), "10 GB at 0.5 GB/s, twice over"


async def test_a_manual_park_answered_3_s_late_is_done_and_pinned(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    # before issue 18: 503 "upstream down" and the pin gone, although the server parked the request
    loop = make_loop(client, settings())
    fake.kv = kv_body(1000, [{"state": "generating", "n_cells": 100, "id_task": 8, "t_arrival_ms": 1}])
    fake.queue("POST park", Reply(body=park_answer(0, 8).body, delay_s=3.0))
    async with running(loop):
        result = await loop.manual(ManualAction.PARK, 0)
        fake.kv = parked_kv()
        polls = loop.state.polls
        while loop.state.polls < polls + 2:  # noqa: ASYNC110 - the loop is under test
            await asyncio.sleep(0.01)
    assert result.pinned and result.detail == "parked and pinned"
    assert loop.state.history[8].pinned and loop.state.history[8].parks == 1, "the pin and the history survive"
    assert loop.state.upstream_up and loop.state.loop_restarts == 0 and loop.state.action_failures == 0
    assert not [s for s in fake.seen if s.query.get("action") == "resume"], "a pinned request stays parked"


async def test_a_manual_park_whose_caller_gave_up_does_not_crash_the_loop(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    loop = make_loop(client, settings())
    fake.kv = kv_body(1000, [{"state": "generating", "n_cells": 100, "id_task": 8, "t_arrival_ms": 1}])
    fake.queue("POST park", Reply(body=park_answer(0, 8).body, delay_s=0.5))
    async with running(loop):
        with pytest.raises(KvctlError) as info:
            await loop.manual(ManualAction.PARK, 0, timeout_s=0.1)
        assert info.value.status == 504
        fake.kv = parked_kv()
        polls = loop.state.polls
        for _ in range(300):
            if loop.state.polls > polls + 3:
                break
            await asyncio.sleep(0.01)
    assert loop.state.loop_restarts == 0, "the park's answer arrived for a cancelled future"
    assert loop.state.history[8].pinned, "the park went through: it is recorded, and pinned"


async def test_a_manual_park_that_times_out_keeps_its_pin_only_if_the_park_happened(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    loop = make_loop(client, settings(action_timeout_min_s=0.2, action_timeout_max_s=0.2))
    async with running(loop):
        for happened in (True, False):
            fake.kv = kv_body(1000, [{"state": "generating", "n_cells": 100, "id_task": 8, "t_arrival_ms": 1}])
            fake.queue("POST park", Reply(body=park_answer(0, 8).body, delay_s=0.6))
            with pytest.raises(KvctlError) as info:
                await loop.manual(ManualAction.PARK, 0, timeout_s=5)
            assert info.value.status == 504 and "may still complete" in str(info.value)
            assert info.value.code == Code.ACTION_TIMEOUT
            if happened:
                fake.kv = parked_kv()
            polls = loop.state.polls
            for _ in range(300):
                if loop.state.polls > polls + 2:
                    break
                await asyncio.sleep(0.01)
            assert loop.state.upstream_up
            assert loop.state.history[8].pinned is happened
            if happened:
                assert (await loop.manual(ManualAction.RESUME, 0)).action is ManualAction.RESUME


async def test_a_poll_soon_during_a_step_is_not_lost(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    s = load_settings(overrides={"loop": {"poll_interval_s": 4.0}, "upstream": {"timeout_s": 0.5}})
    loop = make_loop(client, s)
    fake.queue("GET /kv", Reply(body=fake.kv, delay_s=0.2))
    async with running(loop):
        await asyncio.sleep(0.1)  # the first poll is in flight
        loop.poll_soon()
        t0 = time.monotonic()
        while loop.state.polls < 2 and time.monotonic() - t0 < 3:  # noqa: ASYNC110 - the loop is under test
            await asyncio.sleep(0.01)
    assert loop.state.polls >= 2, "the wake set during the step was cleared after it: the next poll waited 4 s"


async def test_an_answer_cut_off_mid_body_is_an_unavailable_server() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(cut, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with UpstreamClient(f"http://127.0.0.1:{port}", timeout_s=2) as c:
            with pytest.raises(UpstreamUnavailable, match="ClientPayloadError"):
                await c.park(0)
    finally:
        server.close()
        await server.wait_closed()


def test_the_failure_counters_have_their_series_from_the_start() -> None:
    m = Metrics(CollectorRegistry())
    for kind in ("UpstreamUnavailable", "UpstreamApiError", "UpstreamProtocolError"):
        assert m.registry.get_sample_value("kvctl_poll_errors_total", {"kind": kind}) == 0
    for action in ("park", "resume"):
        for status in ("none", "409", "503"):
            labels = {"action": action, "status": status}
            assert m.registry.get_sample_value("kvctl_action_failures_total", labels) == 0
    pm = ProxyMetrics(CollectorRegistry())
    for stage in STREAM_ERROR_STAGES:
        assert pm.registry.get_sample_value("kvctl_proxy_stream_errors_total", {"stage": stage}) == 0


async def test_a_park_longer_than_half_the_lease_keeps_the_lease_through_health(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    s = load_settings(
        overrides={
            "loop": {"poll_interval_s": 0.01, "backoff_initial_s": 0.01, "backoff_max_s": 0.05},
            "upstream": {"timeout_s": 0.2, "lease_s": 0.6},
        }
    )
    fake.kv = pressured()
    fake.queue("POST park", Reply(body=park_answer(2, 3).body, delay_s=1.0))
    loop = make_loop(client, s)
    assert await loop.step()
    assert loop.state.parks == 1
    renewals = [x for x in fake.seen if x.path == "/health" and x.headers.get("X-Park-Lease") == "1"]
    assert len(renewals) >= 3, "a 1 s park with a 0.6 s lease: /health every 0.2 s keeps it"
    n = len(fake.seen)
    assert await loop.step() and not [x for x in fake.seen[n:] if x.path == "/health"], "short calls need no keeper"


async def test_a_new_boot_id_forgets_what_the_loop_knew_and_a_failed_poll_does_not(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    loop = make_loop(client, settings())
    fake.kv = {**pressured(), "server": {"boot_id": "a" * 16, "t_start_ms": NOW}}
    assert await loop.step()
    assert 3 in loop.state.history
    fake.queue("GET /kv", Reply(drop=True), Reply(drop=True))
    assert not await loop.step()
    assert not loop.state.upstream_up
    fake.kv = {**pressured(), "server": {"boot_id": "a" * 16, "t_start_ms": NOW}}
    fake.kv["slots"][2]["state"] = "parked"
    assert await loop.step()
    assert 3 in loop.state.history, "the same process answered again: nothing to forget"
    fake.kv = {**pressured(), "server": {"boot_id": "b" * 16, "t_start_ms": NOW}}
    with capture_logs() as logs:
        assert await loop.step()
    assert any(e["event"] == "loop.forget" for e in logs), "a new process: its task ids start again"
    assert loop.state.history.get(3) is None or loop.state.history[3].parks <= 1


async def test_the_hang_check_counts_silence_from_the_end_of_a_long_action(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    fake.kv = pressured()
    fake.queue("POST park", Reply(body=park_answer(2, 3).body, delay_s=0.5))
    loop = make_loop(client, settings())
    assert await loop.step()
    end = loop.state.last_action_end_monotonic
    assert end is not None and loop.state.last_answer_monotonic is not None
    assert end > loop.state.last_answer_monotonic, "the park ended after the poll's answer"
    assert loop.state.busy_until_monotonic == 0.0 and not loop.stalled(30), "no call in flight, a fresh heartbeat"
