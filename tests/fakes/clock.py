"""A fake clock for the control loop's cadence (controller.loop.poller.Clock): time moves only when the loop waits."""

from __future__ import annotations

import asyncio


class FakeClock:
    """Each wait() jumps the clock ahead by its whole timeout at once, unless the loop is woken first (then it returns
    at once and the clock stands still); ``waits`` lists every timeout asked for. After ``limit`` waits the next one
    blocks until the test cancels the loop, so a test reads an exact, finite sequence."""

    def __init__(self, limit: int = 1000) -> None:
        self.now = 0.0
        self.waits: list[float] = []
        self.limit = limit
        self.done = asyncio.Event()
        """Set once ``limit`` waits were asked for."""

    def monotonic(self) -> float:
        return self.now

    async def wait(self, wake: asyncio.Event, timeout_s: float) -> None:
        if len(self.waits) >= self.limit:
            self.done.set()
            await asyncio.Event().wait()  # until cancelled
        self.waits.append(timeout_s)
        await asyncio.sleep(0)  # whatever else is ready runs first, as in a real wait
        if not wake.is_set():
            self.now += timeout_s
