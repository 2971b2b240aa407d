"""The control loop's error paths and bookkeeping, against a scripted fake server.

The loop's real behaviour under load is tested on the real server (tests/integration/test_controller.py).
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from controller.admin.models import ManualAction
from controller.errors import Code, KvctlError
from controller.loop.control import ControlLoop
from controller.metrics import Metrics
from controller.settings import Settings, load_settings
from controller.upstream.client import UpstreamClient
from tests.fakes.clock import FakeClock
from tests.fakes.llama_server import FakeLlamaServer, Reply, error, kv_body
from tests.harness import LOOP_NOW as NOW
from tests.harness import loop_sample as sample
from tests.harness import loop_settings as settings
from tests.harness import park_answer, plenty, pressured


def make_loop(client: UpstreamClient, s: Settings | None = None) -> ControlLoop:
    return ControlLoop(client, s or settings(), Metrics(CollectorRegistry()), host=plenty, clock_ms=lambda: NOW)


async def wait_polls(loop: ControlLoop, n: int, timeout_s: float = 5.0) -> None:
    target = loop.state.polls + n
    for _ in range(int(timeout_s / 0.01)):
        if loop.state.polls >= target:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the loop polled {loop.state.polls} times, expected {target}")


async def test_a_poll_under_pressure_parks_the_newest_and_records_it(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    fake.kv = pressured()
    loop = make_loop(client)
    with capture_logs() as logs:
        assert await loop.step()
    parks = [s for s in fake.seen if s.query.get("action") == "park"]
    assert [(p.path, p.body) for p in parks] == [("/slots/2", b'{"id_task": 3}')]
    assert loop.state.history[3].parks == 1 and not loop.state.history[3].pinned
    assert (
        sample(loop, "kvctl_parks_total", reason="pressure", mode="swap", tier="ram", priority_class="normal") == 1
    ), "an older server: by swap"
    assert sample(loop, "kvctl_upstream_up") == 1
    assert loop.state.max_pressure == pytest.approx(953 / 1000)
    events = [e for e in logs if e["event"] == "park.done"]
    assert events and events[0]["reason"] == "pressure" and events[0]["slot"] == 2


async def test_the_policy_s_mode_is_asked_for_and_counted_as_the_server_answers(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    fake.kv = {**pressured(), "park_modes": ["swap", "recompute"]}
    loop = make_loop(client, settings(policy={"snapshot_budget_mib": 0}))  # 0: recompute only
    fake.queue("POST park", park_answer(2, 3, mode="recompute", mode_reason="requested"))
    with capture_logs() as logs:
        assert await loop.step()
    parks = [s for s in fake.seen if s.query.get("action") == "park"]
    assert [p.body for p in parks] == [b'{"id_task": 3, "mode": "recompute"}']
    assert (
        sample(loop, "kvctl_parks_total", reason="pressure", mode="recompute", tier="none", priority_class="normal")
        == 1
    )
    assert sample(loop, "kvctl_parks_total", reason="pressure", mode="swap", tier="ram", priority_class="normal") == 0
    done = [e for e in logs if e["event"] == "park.done"]
    assert len(done) == 1
    assert (done[0]["mode"], done[0]["mode_reason"], done[0]["server_mode_reason"]) == (
        "recompute",
        "recompute_only",
        "requested",
    )
    # an answer that does not name its mode is counted by the mode asked for
    assert await loop.step()
    assert (
        sample(loop, "kvctl_parks_total", reason="pressure", mode="recompute", tier="none", priority_class="normal")
        == 2
    )


async def test_a_swap_the_server_cannot_hold_now_becomes_a_park_by_recompute(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    fake.kv = {**pressured(), "park_modes": ["swap", "recompute"]}
    loop = make_loop(client)
    fake.queue(
        "POST park",
        error(503, "unavailable_error", "failed to allocate 67108864 bytes of host memory for snapshots", 1),
        park_answer(2, 3, mode="recompute", mode_reason="requested", timings={"park_ms": 0.3, "copy_ms": 0.0}),
    )
    with capture_logs() as logs:
        assert await loop.step()
    parks = [s.body for s in fake.seen if s.query.get("action") == "park"]
    assert parks == [b'{"id_task": 3, "mode": "swap"}', b'{"id_task": 3, "mode": "recompute"}']
    assert (
        sample(loop, "kvctl_parks_total", reason="pressure", mode="recompute", tier="none", priority_class="normal")
        == 1
    )
    assert [e["event"] for e in logs if e["event"].startswith("park.")] == ["park.swap_refused", "park.done"]
    assert [e["copy_ms"] for e in logs if e["event"] == "park.done"] == [0.0]


async def test_a_refused_recompute_is_not_retried(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    fake.kv = {**pressured(), "park_modes": ["swap", "recompute"]}
    loop = make_loop(client, settings(policy={"snapshot_budget_mib": 0}))  # recompute only
    fake.queue("POST park", error(409, "conflict_error", "slot is not parkable in state 'prompt'"))
    assert await loop.step()
    assert len([s for s in fake.seen if s.query.get("action") == "park"]) == 1


async def test_a_refused_action_stops_the_rest_of_the_decision(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    fake.kv = kv_body(
        1000,
        [
            {"state": "generating", "n_cells": 500, "id_task": 1, "t_arrival_ms": 1},
            {"state": "generating", "n_cells": 230, "id_task": 2, "t_arrival_ms": 2},
            {"state": "generating", "n_cells": 230, "id_task": 3, "t_arrival_ms": 3},
        ],
        next_step={"n_gen": 3, "n_draft_max": 0, "n_prompt_max": 200, "n_total_max": 203},
    )
    fake.queue("POST park", error(409, "conflict_error", "slot 2 does not serve task 3"))
    loop = make_loop(client)
    with capture_logs() as logs:
        assert await loop.step()
    assert len([s for s in fake.seen if s.query.get("action") == "park"]) == 1  # two were planned
    assert sample(loop, "kvctl_action_failures_total", action="park", status="409") == 1
    assert any(e["event"] == "park.failed" for e in logs)
    assert 3 not in loop.state.history


async def test_a_server_that_goes_away_is_reported_and_forgotten(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    fake.kv = pressured()
    loop = make_loop(client)
    assert await loop.step()
    assert 3 in loop.state.history
    # aiohttp retries an idempotent request once on a dropped connection
    fake.queue("GET /kv", Reply(drop=True), Reply(drop=True))
    assert not await loop.step()
    assert not loop.state.upstream_up and loop.state.last_error
    assert sample(loop, "kvctl_upstream_up") == 0
    assert sample(loop, "kvctl_poll_errors_total", kind="UpstreamUnavailable") == 1
    fake.kv = kv_body(
        1000,
        [
            {
                "state": "parked",
                "n_cells": 150,
                "id_task": 3,
                "park": {"count": 1, "bytes": 0, "t_parked_total_ms": 0, "parked_since_ms": NOW - 5},
            }
        ],
    )
    fake.queue("POST resume", error(503, "unavailable_error", "no room"))
    assert await loop.step()
    assert loop.state.upstream_up
    assert loop.state.history == {}, "after the server comes back, what the loop knew of its tasks is gone"


async def test_back_off_doubles_up_to_its_cap_on_a_fake_clock() -> None:
    # nobody listens on the port: every poll fails at once, and each wait after it is the back-off, exactly
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = load_settings(overrides={"loop": {"backoff_initial_s": 1, "backoff_max_s": 8}, "upstream": {"lease_s": 30}})
    clock = FakeClock(limit=7)
    async with UpstreamClient(f"http://127.0.0.1:{port}", timeout_s=0.2) as dead:
        loop = ControlLoop(dead, s, Metrics(CollectorRegistry()), host=plenty, clock_ms=lambda: NOW, clock=clock)
        task = asyncio.create_task(loop.run())
        await asyncio.wait_for(clock.done.wait(), 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert clock.waits == [1, 2, 4, 8, 8, 8, 8], "doubling from the initial one, capped"
    assert loop.state.backoff_s == 8 and loop.state.loop_restarts == 0 and loop.state.polls == 0


async def test_polls_keep_their_interval_and_a_wake_up_cuts_the_wait_short(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    s = load_settings(overrides={"loop": {"poll_interval_s": 2.0}})
    clock = FakeClock(limit=4)
    loop = ControlLoop(client, s, Metrics(CollectorRegistry()), host=plenty, clock_ms=lambda: NOW, clock=clock)
    loop.add_poll_listener(lambda: loop.poll_soon() if loop.state.polls == 2 else None)
    task = asyncio.create_task(loop.run())
    await asyncio.wait_for(clock.done.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert clock.waits == [2.0, 2.0, 2.0, 2.0] and loop.state.polls == 5
    assert clock.now == 3 * 2.0, "the wait after the second poll was woken at once: no time passed"


def test_a_short_server_lease_caps_the_back_off(fake: FakeLlamaServer) -> None:
    loop = make_loop(UpstreamClient("http://127.0.0.1:1"), load_settings())
    from controller.upstream.models import KvSnapshot

    loop.state.snapshot = KvSnapshot.model_validate(kv_body(100, lease={"held": True, "ttl_s": 2, "age_ms": 0}))
    with capture_logs() as logs:
        assert loop.poller.max_backoff() < 1.0
    assert [e["event"] for e in logs] == ["loop.lease_shorter"]


async def test_an_exception_inside_the_loop_is_logged_and_the_loop_restarted(
    fake: FakeLlamaServer, client: UpstreamClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    loop = make_loop(client, settings(restart_delay_s=0.01))
    calls = 0
    real = loop.step

    async def flaky() -> bool:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("a bug")
        return await real()

    monkeypatch.setattr(loop, "step", flaky)
    with capture_logs() as logs:
        task = asyncio.create_task(loop.run())
        await wait_polls(loop, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert loop.state.loop_restarts == 1 and loop.state.polls >= 5
    assert sample(loop, "kvctl_loop_restarts_total") == 1
    crashed = [e for e in logs if e["event"] == "loop.crashed"]
    assert len(crashed) == 1 and crashed[0]["log_level"] == "error" and crashed[0].get("exc_info")


async def test_manual_park_pins_and_manual_resume_unpins(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    loop = make_loop(client)
    task = asyncio.create_task(loop.run())
    try:
        fake.kv = kv_body(1000, [{"state": "generating", "n_cells": 100, "id_task": 8, "t_arrival_ms": 1}])
        res = await loop.manual(ManualAction.PARK, 0)
        assert res.pinned and res.id_task == 8 and loop.state.history[8].pinned
        # parked, with all the room in the pool: the policy leaves it alone
        fake.kv = kv_body(
            1000,
            [
                {
                    "state": "parked",
                    "n_cells": 100,
                    "id_task": 8,
                    "park": {"count": 1, "bytes": 51200, "t_parked_total_ms": 0, "parked_since_ms": NOW - 60_000},
                }
            ],
        )
        await wait_polls(loop, 5)
        assert not [s for s in fake.seen if s.query.get("action") == "resume"]
        assert sample(loop, "kvctl_pinned_requests") == 1
        res = await loop.manual(ManualAction.RESUME, 0)
        assert not res.pinned and not loop.state.history[8].pinned
        with pytest.raises(KvctlError) as info:
            await loop.manual(ManualAction.PARK, 7)
        assert info.value.status == 404 and info.value.code == Code.NO_SUCH_SLOT
        fake.queue("POST park", error(503, "unavailable_error", "park budget exceeded", retry_after=1))
        fake.kv = kv_body(1000, [{"state": "generating", "n_cells": 100, "id_task": 9, "t_arrival_ms": 1}])
        with pytest.raises(KvctlError) as info:
            await loop.manual(ManualAction.PARK, 0)
        assert info.value.status == 503 and info.value.retry_after_s == 1
        assert info.value.code == Code.SERVER_REFUSED
        assert 9 not in loop.state.history
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_pin_goes_with_its_task(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    loop = make_loop(client)
    fake.kv = kv_body(1000, [{"state": "parked", "n_cells": 100, "id_task": 8}])
    task = asyncio.create_task(loop.run())
    try:
        await loop.manual(ManualAction.PARK, 0)
        assert loop.state.history[8].pinned
        fake.kv = kv_body(1000, [{"state": "idle", "n_cells": 0}])  # its client went away
        await wait_polls(loop, 2)
        assert loop.state.history == {}
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_host_memory_that_can_outgrow_the_host_is_warned_of_once_per_server_start(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    gib = 1 << 30
    hm = {"model_bytes": gib, "context_bytes": gib, "park_ram_bytes": 8 * gib, "cache_ram_bytes": 8 * gib}
    fake.kv = kv_body(
        slots=[{}], host_memory=hm, host_ram_available_bytes=12 * gib, server={"boot_id": "a", "t_start_ms": 1}
    )
    loop = make_loop(client)
    with capture_logs() as logs:
        for _ in range(3):
            assert await loop.step()
    short = [e for e in logs if e["event"] == "host_memory.short"]
    assert len(short) == 1, logs
    assert short[0]["growth_bytes"] == 16 * gib and short[0]["available_bytes"] == 12 * gib
    assert sample(loop, "kvctl_host_memory_committed_bytes") == 18 * gib
    assert sample(loop, "kvctl_host_memory_bytes", part="cache_ram") == 8 * gib
    # a restarted server is checked again; one whose budgets fit is not warned of
    fake.kv = kv_body(
        slots=[{}], host_memory=hm, host_ram_available_bytes=12 * gib, server={"boot_id": "b", "t_start_ms": 2}
    )
    with capture_logs() as logs:
        assert await loop.step()
    assert [e["event"] for e in logs].count("host_memory.short") == 1
    fake.kv = kv_body(
        slots=[{}], host_memory=hm, host_ram_available_bytes=64 * gib, server={"boot_id": "c", "t_start_ms": 3}
    )
    with capture_logs() as logs:
        assert await loop.step()
    assert "host_memory.short" not in [e["event"] for e in logs]
