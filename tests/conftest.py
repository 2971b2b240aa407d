"""Checks every test gets: no asyncio task outlives the test that started it.

A task left running by a test (a loop never cancelled, a relay never awaited) would be cancelled silently when
pytest-asyncio closes the test's event loop: the test passes while the code under it leaks. The check runs in the
test's own loop after every other fixture of the test was torn down (it is set up first), lets tasks that are being
cancelled finish, and fails the test naming what is still running.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator

import pytest

# the shared helpers' asserts report their values as a test's own do (a conftest's are rewritten already)
pytest.register_assert_rewrite("tests.harness")

SETTLE_ROUNDS = 20  # event-loop turns given to tasks that are finishing (cancelled, closing their sockets)


@pytest.fixture
async def no_leaked_tasks() -> AsyncIterator[None]:
    yield
    me = asyncio.current_task()
    for _ in range(SETTLE_ROUNDS):
        left = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
        if not left:
            return
        await asyncio.sleep(0)
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)
    names = sorted(f"{t.get_name()} ({t.get_coro()!r})" for t in left)
    pytest.fail(f"the test left {len(left)} asyncio task(s) running: {names}", pytrace=False)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every coroutine test gets no_leaked_tasks first, so that it is torn down after the test's other fixtures."""
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            if "no_leaked_tasks" not in item.fixturenames:
                item.fixturenames.insert(0, "no_leaked_tasks")
