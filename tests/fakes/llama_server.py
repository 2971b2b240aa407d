"""A fake patched llama-server for framing and error paths: it answers what a test scripts.

Real behaviour is tested against the real server (tests/integration); this fake exists for what
the real one cannot be made to do on demand: malformed answers, hangs, dropped connections.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Reply:
    status: int = 200
    body: Any = None  # JSON-able, or bytes sent as they are
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    drop: bool = False  # close the connection without an answer


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    peer: Any = None  # the client's (host, port): which connection it came on


def kv_body(n_cells: int = 1000, slots: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    """A valid /kv answer; slots are given as dicts of the fields that differ from an idle slot."""
    out = []
    used = 0
    for i, s in enumerate(slots or []):
        slot = {
            "id": i,
            "id_task": None,
            "state": "idle",
            "n_cells": 0,
            "n_prompt": 0,
            "t_arrival_ms": None,
            "n_decoded": 0,
            "n_draft_max": 0,
            "request_id": None,
            "park": {"count": 0, "bytes": 0, "t_parked_total_ms": 0, "parked_since_ms": None, "auto": False},
        }
        slot.update(s)
        if slot["state"] != "parked":
            used += int(slot["n_cells"])
        out.append(slot)
    n_gen = sum(1 for s in out if s["state"] == "generating")
    body: dict[str, Any] = {
        "n_cells": n_cells,
        "n_cells_used": used,
        "n_cells_free": n_cells - used,
        "used_ratio": used / n_cells,
        "source": "exact",
        "draft": None,
        "bytes_per_cell": 512,
        "next_step": {"n_gen": n_gen, "n_draft_max": 0, "n_prompt_max": 0, "n_total_max": n_gen},
        "n_slots": len(out),
        "n_slots_idle": sum(1 for s in out if s["state"] == "idle"),
        "n_parked": sum(1 for s in out if s["state"] == "parked"),
        "parked_bytes": 0,
        "park_ram_budget_bytes": None,
        "auto_park": False,
        "auto_resume_ratio": 0.8,
        "lease": {"held": True, "ttl_s": 10, "age_ms": 0},
        "slots": out,
    }
    body.update(extra)
    return body


class FakeLlamaServer:
    """Scripted answers by route; ``/kv`` answers ``kv`` unless a reply is queued for it."""

    def __init__(self) -> None:
        self.kv: dict[str, Any] = kv_body()
        self.queued: dict[str, list[Reply]] = {}
        self.seen: list[Seen] = []
        self.health_status = 200
        self.props: dict[str, Any] = {}  # a router answers {"role": "router", ...}

    def queue(self, route: str, *replies: Reply) -> None:
        """route: "GET /kv", "POST park", "POST resume", "GET /slots", "GET /health"."""
        self.queued.setdefault(route, []).extend(replies)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/kv", self._kv)
        app.router.add_get("/slots", self._slots)
        app.router.add_post("/slots/{id}", self._action)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/props", self._props)
        return app

    async def _record(self, request: web.Request) -> None:
        self.seen.append(
            Seen(
                request.method,
                request.path,
                dict(request.query),
                dict(request.headers),
                await request.read(),
                request.transport.get_extra_info("peername") if request.transport else None,
            )
        )

    async def _answer(self, request: web.Request, route: str, default: Reply) -> web.StreamResponse:
        await self._record(request)
        queue = self.queued.get(route)
        reply = queue.pop(0) if queue else default
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        if reply.drop:
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if isinstance(reply.body, bytes):
            return web.Response(status=reply.status, body=reply.body, headers=reply.headers)
        return web.Response(
            status=reply.status, text=json.dumps(reply.body), content_type="application/json", headers=reply.headers
        )

    async def _kv(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "GET /kv", Reply(body=self.kv))

    async def _props(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "GET /props", Reply(body=self.props))

    async def _slots(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "GET /slots", Reply(body=self.kv["slots"]))

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "GET /health", Reply(status=self.health_status, body={"status": "ok"}))

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, "GET /metrics", Reply(body=b"# TYPE llamacpp:x counter\nllamacpp:x 1\n"))

    async def _action(self, request: web.Request) -> web.StreamResponse:
        action = request.query.get("action", "")
        slot = int(request.match_info["id"])
        body = json.loads(await request.read() or b"{}")
        task = body.get("id_task", 0)
        if action == "park":
            ok = {
                "id_slot": slot,
                "id_task": task,
                "action": "park",
                "n_cells": 10,
                "n_cells_draft": 0,
                "n_bytes": 5120,
                "n_bytes_draft": 0,
                "park_count": 1,
                "timings": {"park_ms": 1.5},
            }
        else:
            ok = {
                "id_slot": slot,
                "id_task": task,
                "action": "resume",
                "n_cells": 10,
                "n_bytes": 5120,
                "t_parked_ms": 100.0,
                "timings": {"resume_ms": 1.0},
            }
        return await self._answer(request, f"POST {action}", Reply(body=ok))


def error(status: int, type_: str, message: str, retry_after: int | None = None) -> Reply:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
    return Reply(status, {"error": {"code": status, "message": message, "type": type_}}, headers)
