"""The proxy's admission gate and queue: FIFO, as many per poll as the pool has room for."""

from __future__ import annotations

import asyncio
import time

import pytest

from controller.proxy.admission import AdmissionGate, AdmissionQueue, QueueFull, QueueTimeout


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
