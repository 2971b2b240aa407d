"""A timed streaming client for the benchmarks: when each token and each park notice arrived."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from testkit.llama import sse_events


@dataclass
class Timed:
    ok: bool = False
    error: str | None = None
    n_tokens: int = 0
    t_start: float = 0.0
    t_first: float | None = None
    t_end: float = 0.0
    events: list[tuple[float, str]] = field(default_factory=list)
    """(monotonic time, "parked" or "resumed") as the stream reported them."""
    content: str = ""
    tokens: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return (self.t_first or self.t_end) - self.t_start

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start

    @property
    def parked_waits(self) -> list[float]:
        """Seconds from each ``parked`` to the ``resumed`` that follows it."""
        waits: list[float] = []
        t_parked: float | None = None
        for t, kind in self.events:
            if kind == "parked":
                t_parked = t
            elif t_parked is not None:
                waits.append(t - t_parked)
                t_parked = None
        return waits


async def timed_stream(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    path: str = "/completion",
    on_chunk: Callable[[int], object] | None = None,
) -> Timed:
    """Stream one request; ``on_chunk(n)`` is called with the number of content chunks so far."""
    res = Timed(t_start=time.monotonic())
    n_chunks = 0
    try:
        async with session.post(url + path, json={"stream": True, **payload}) as resp:
            if resp.status != 200:
                res.error = f"{resp.status}: {(await resp.text())[:200]}"
                return res
            async for ev in sse_events(resp):
                now = time.monotonic()
                for c in ev.comments:
                    if c in ("parked", "resumed"):
                        res.events.append((now, c))
                if ev.data is None or ev.data == "[DONE]":
                    continue
                chunk = json.loads(ev.data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message", str(chunk["error"]))
                    break
                if res.t_first is None:
                    res.t_first = now
                n_chunks += 1
                if on_chunk is not None:
                    on_chunk(n_chunks)
                if path == "/completion":
                    res.tokens.extend(chunk.get("tokens", []))
                    res.content += chunk.get("content", "")
                    if chunk.get("stop"):
                        res.n_tokens = int(chunk.get("tokens_predicted", 0))
                        res.ok = True
                else:  # OpenAI shape
                    for choice in chunk.get("choices", []):
                        res.content += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                        if choice.get("finish_reason"):
                            res.ok = True
                    if chunk.get("usage"):
                        res.n_tokens = int(chunk["usage"].get("completion_tokens", 0))
    except (aiohttp.ClientError, TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        res.t_end = time.monotonic()
    return res
