"""The proxy's admission gate and queue: FIFO, as many per poll as the pool has room for."""

from __future__ import annotations

import asyncio
import time

import pytest

from controller.proxy.admission import AdmissionGate, AdmissionQueue, QueueFull, QueueTimeout, Refused, RestartTimeout
from controller.proxy.inspection import estimate_prompt_cells


def test_a_gate_never_updated_admits_everything() -> None:
    gate = AdmissionGate()  # no controller: the proxy is a plain relay
    assert all(gate.take() for _ in range(100))
    assert gate.hold_reason is None and gate.allowance is None


def test_the_allowance_is_spent_one_request_at_a_time() -> None:
    gate = AdmissionGate()
    gate.update(None, 2)
    assert gate.take() and gate.take()
    assert not gate.take()
    assert gate.hold_reason == "as many requests started as the last poll had room for"
    gate.update("the pool would reach HIGH", 0)
    assert not gate.take() and gate.hold_reason == "the pool would reach HIGH"


def test_requests_admitted_after_the_snapshot_was_asked_for_are_taken_off_its_allowance() -> None:
    gate = AdmissionGate()
    asked = time.monotonic()
    assert gate.take() and gate.take()  # admitted while the poll was in flight: not in its snapshot
    gate.update(None, 3, as_of=asked)
    assert gate.allowance == 1
    gate.update(None, 3, as_of=time.monotonic())  # a later snapshot sees them
    assert gate.allowance == 3


async def test_waiters_go_in_order_as_many_as_each_poll_allows_and_ask_for_a_poll() -> None:
    gate = AdmissionGate()
    polls: list[int] = []
    gate.on_wait = lambda: polls.append(1)
    gate.update("no idle slot", 0)
    queue = AdmissionQueue(gate, depth=10, timeout_s=10)
    order: list[int] = []

    async def client(i: int) -> None:
        await queue.admit()
        order.append(i)

    tasks = [asyncio.create_task(client(i)) for i in range(3)]
    await asyncio.sleep(0.01)
    assert order == [] and queue.queued == 3
    assert polls, "a waiting request asks the control loop for a fresh poll"
    gate.update(None, 2)
    await asyncio.sleep(0.01)
    assert order == [0, 1], "two admitted at once, in arrival order; the third waits for the next poll"
    gate.update(None, 4)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    await queue.close()


async def test_a_waiter_that_timed_out_does_not_use_up_an_admission() -> None:
    gate = AdmissionGate()
    gate.update("held", 0)
    queue = AdmissionQueue(gate, depth=1, timeout_s=0.05)
    with pytest.raises(QueueTimeout):
        await queue.admit()
    first = asyncio.create_task(queue.admit())
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await queue.admit()
    gate.update(None, 1)
    await asyncio.wait_for(first, 1)
    assert gate.allowance == 0
    await queue.close()


def test_a_prompt_larger_than_the_room_below_high_waits_unless_the_pool_is_empty() -> None:
    gate = AdmissionGate()
    gate.update(None, 8, room_cells=1000)
    assert not gate.take(1000), "1000 cells and its first step would reach HIGH"
    assert gate.take(600) and gate.room_cells == 399
    assert not gate.take(400) and gate.take(398)
    gate.update(None, 8, room_cells=100, empty=True)
    assert gate.take(5000), "nothing resident: the pool is all its own"
    assert not gate.take(10), "the next one sees the first one's cells"


def test_cells_admitted_after_the_snapshot_come_off_its_room() -> None:
    gate = AdmissionGate()
    asked = time.monotonic()
    gate.update(None, 8, room_cells=2000)
    assert gate.take(700)
    gate.update(None, 8, as_of=asked, room_cells=2000, empty=True)
    assert gate.room_cells == 2000 - 701 and gate.allowance == 7
    assert not gate.take(1500), "not empty any more: the request admitted since is on its way"


async def test_a_large_prompt_at_the_head_holds_back_smaller_ones_behind_it() -> None:
    gate = AdmissionGate()
    gate.update(None, 8, room_cells=100)
    queue = AdmissionQueue(gate, depth=10, timeout_s=10)
    big = asyncio.create_task(queue.admit(500))
    await asyncio.sleep(0)
    small = asyncio.create_task(queue.admit(10))
    await asyncio.sleep(0.01)
    assert not big.done() and not small.done(), "first come, first served: the big one is not starved"
    gate.update(None, 8, room_cells=600)
    await asyncio.wait_for(asyncio.gather(big, small), 1)
    await queue.close()


@pytest.mark.parametrize(
    ("route", "payload", "cells"),
    [
        ("/completion", {"prompt": [1, 2, 3, 4]}, 4),
        ("/completion", {"prompt": "x" * 300}, 100),
        ("/completion", {"prompt": "é" * 30}, 20),  # 60 bytes of UTF-8
        ("/v1/completions", {"prompt": ["abc", [1, 2]]}, 3),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 30}]}, 18),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"}]}]}, 9),
        ("/v1/chat/completions", {"messages": "not a list"}, 0),
        ("/completion", {"prompt": None}, 0),
    ],
)
def test_prompt_cells_are_estimated_before_tokenizing(route: str, payload: dict[str, object], cells: int) -> None:
    assert estimate_prompt_cells(route, payload) == cells


# --- while the server comes back --------------------------------------------------------------------


async def test_while_the_server_comes_back_requests_wait_in_order_then_run() -> None:
    gate = AdmissionGate()
    gate.update(None)  # open
    gate.server_down()
    assert gate.hold_reason == "llama-server is restarting" and not gate.take()
    queue = AdmissionQueue(gate, depth=10, timeout_s=10, restart_timeout_s=5)
    order: list[int] = []

    async def client(i: int) -> None:
        await queue.admit()
        order.append(i)

    tasks = [asyncio.create_task(client(i)) for i in range(3)]
    await asyncio.sleep(0.05)
    assert order == [] and queue.queued == 3
    gate.server_up()
    gate.update(None, 3)
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2], "in their normal order"


async def test_a_request_held_past_the_restart_bound_ends_and_the_queue_bound_holds() -> None:
    gate = AdmissionGate()
    gate.server_down()
    queue = AdmissionQueue(gate, depth=2, timeout_s=10, restart_timeout_s=0.3)
    t0 = time.monotonic()
    held = [asyncio.ensure_future(queue.admit()) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(QueueFull):
        await queue.admit()  # depth + 1: at once
    assert time.monotonic() - t0 < 0.1
    for fut in held:
        with pytest.raises(RestartTimeout, match=r"did not come back within 0\.3 s"):
            await fut
    assert 0.25 <= time.monotonic() - t0 < 1.0


async def test_the_restart_bound_counts_from_the_outage_for_requests_queued_before_it() -> None:
    gate = AdmissionGate()
    gate.update("no idle slot", 0)  # queued for the pool, not for a restart
    queue = AdmissionQueue(gate, depth=2, timeout_s=10, restart_timeout_s=0.3)
    fut = asyncio.ensure_future(queue.admit())
    await asyncio.sleep(0.5)
    assert not fut.done(), "a pool hold is bounded by the queue timeout only"
    t0 = time.monotonic()
    gate.server_down()
    with pytest.raises(RestartTimeout):
        await fut
    assert 0.25 <= time.monotonic() - t0 < 1.0


async def test_a_server_that_is_not_coming_back_ends_every_waiting_request_at_once() -> None:
    gate = AdmissionGate()
    gate.server_down()
    queue = AdmissionQueue(gate, depth=10, timeout_s=10, restart_timeout_s=60)
    held = [asyncio.ensure_future(queue.admit()) for _ in range(3)]
    await asyncio.sleep(0.01)
    gate.refuse("llama-server is not answering", "upstream_unavailable")
    for fut in held:
        with pytest.raises(Refused) as e:
            await asyncio.wait_for(fut, 1)
        assert e.value.code == "upstream_unavailable"
    with pytest.raises(Refused):
        await queue.admit()  # and the next one at once
    gate.server_up()
    gate.update(None)
    await asyncio.wait_for(queue.admit(), 1)


async def test_wait_up_returns_when_the_server_answers_or_at_the_bound() -> None:
    gate = AdmissionGate()
    assert await gate.wait_up(0.01), "up: at once"
    gate.server_down()
    t0 = time.monotonic()
    assert not await gate.wait_up(0.1)
    assert time.monotonic() - t0 >= 0.09
    asyncio.get_running_loop().call_later(0.05, gate.server_up)
    assert await gate.wait_up(5)
    gate.server_down()
    asyncio.get_running_loop().call_later(0.05, gate.refuse, "gone", "server_failed")
    assert not await gate.wait_up(5)
