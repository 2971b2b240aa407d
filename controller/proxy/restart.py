"""While the server comes back: what routers and frontends see, and how long a request waits for it.

kvctl knows the server will be back when it restarts the server it spawned, when that server loads its model
(kvctl's own start included), and when an attached server that answered before stops answering (the gate's
``down_since``). Meanwhile generations wait in the admission queue (``controller.proxy.admission``) and everything
else waits here, each for at most ``proxy.replay_timeout_s``; ``GET /health`` answers 503 "Loading model" as
llama-server itself does while it loads, so a router sends elsewhere; ``GET /models`` and ``GET /v1/models``
answer as the server last answered them, so a frontend keeps its model list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict

__all__ = ["LOADING_BODY", "MODELS_PATHS", "ModelsCache", "loading_response"]

# server-http.cpp's middleware_server_state, byte for byte: what the server answers every route while it loads
LOADING_BODY = json.dumps(
    {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}, separators=(",", ":")
).encode()

MODELS_PATHS = frozenset({"/models", "/v1/models"})
"""The model list's routes (one handler in the server, ``get_models``), as registered (before ``--api-prefix``)."""

_KEEP = frozenset({"content-type", "vary"})  # only unencoded answers are kept (proxy/relay.py)


def loading_response(cors: dict[str, str]) -> web.Response:
    """The server's own 503 while it loads."""
    return web.Response(
        status=503, body=LOADING_BODY, headers={"Content-Type": "application/json; charset=utf-8", **cors}
    )


@dataclass(frozen=True, slots=True)
class _Answer:
    body: bytes
    headers: tuple[tuple[str, str], ...]


class ModelsCache:
    """The server's last 200 answer to ``GET /models`` or ``GET /v1/models`` (no query), per route; served while the
    server is coming back. The list names the model the server loads, which a restart does not change."""

    MAX_BYTES = 1 << 20

    def __init__(self) -> None:
        self._answers: dict[str, _Answer] = {}

    def store(self, route_path: str, body: bytes, headers: CIMultiDict[str]) -> None:
        if len(body) <= self.MAX_BYTES:
            kept = tuple((k, v) for k, v in headers.items() if k.lower() in _KEEP)
            self._answers[route_path] = _Answer(body, kept)

    def response(self, route_path: str, cors: dict[str, str]) -> web.Response | None:
        hit = self._answers.get(route_path)
        if hit is None:
            return None
        headers = CIMultiDict(hit.headers)
        headers.update(cors)
        headers["X-Kvctl-Cached"] = "1"  # a client or an operator can tell the answer did not come from the server now
        return web.Response(status=200, body=hit.body, headers=headers)
