"""Who may use the proxy: kvctl's own keys (``proxy.api_keys``), or the server's, checked before admission.

kvctl's own check mirrors llama-server's middleware (``tools/server/server-http.cpp`` at the pinned commit)
exactly: the credential is the ``Authorization`` header when it is present and not empty (even when it
is wrong), else ``X-Api-Key``; a leading ``Bearer `` is optional; ``/health`` and ``/v1/health`` and every
``OPTIONS`` preflight need none; a failure is a 401 with the server's own body. Keys are compared in
constant time, all of them every time, and never logged.

Without keys of its own but with ``upstream.api_key`` set, kvctl asks the server about the client's own
credentials (``GET /v1/models`` carrying them) before the request can queue, and keeps the answer for a few
seconds per credential (by its SHA-256, never the credential itself).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

__all__ = ["PUBLIC_PATHS", "UNAUTHORIZED_BODY", "Answer", "ServerCheck"]

# server-http.cpp: get_public_endpoints, compared with the raw request path (no --api-prefix)
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})

# the server's own 401 body, byte for byte (safe_json_to_str of the error object, keys in insertion order)
UNAUTHORIZED_BODY = json.dumps(
    {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}, separators=(",", ":")
).encode()


@dataclass(frozen=True, slots=True)
class Answer:
    """The server's answer to a credential check: 200 (accepted), or the response to give the client as it is."""

    status: int
    headers: Sequence[tuple[str, str]] = ()
    body: bytes = b""


Probe = Callable[[dict[str, str]], Awaitable[Answer]]


class ServerCheck:
    """Ask the server about a client's credentials; answers are kept ``ttl_s`` seconds (refusals ``ttl_refused_s``)
    per credential, and concurrent checks of one credential share one request to the server."""

    def __init__(self, probe: Probe, ttl_s: float = 5.0, ttl_refused_s: float = 1.0, max_entries: int = 4096) -> None:
        self._probe = probe
        self.ttl_s = ttl_s
        self.ttl_refused_s = ttl_refused_s
        self._max = max_entries
        self._cache: OrderedDict[bytes, tuple[float, Answer]] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future[Answer]] = {}  # checks under way, by credential

    @staticmethod
    def _cache_key(headers: Mapping[str, str]) -> bytes:
        # both headers, as sent: the server's rule picks one of them, so the pair decides the answer
        raw = headers.get("Authorization", "") + "\0" + headers.get("X-Api-Key", "")
        return hashlib.sha256(raw.encode("utf-8", "surrogateescape")).digest()

    async def check(self, headers: Mapping[str, str]) -> Answer:
        key = self._cache_key(headers)
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1]
        task = self._pending.get(key)
        if task is None:
            # its own task: a caller that is cancelled (its client left) cancels neither the check nor the others
            creds = {h: headers[h] for h in ("Authorization", "X-Api-Key") if h in headers}
            task = asyncio.ensure_future(self._probe(creds))
            self._pending[key] = task
            task.add_done_callback(lambda t: self._done(key, t))
        return await asyncio.shield(task)

    def last(self, headers: Mapping[str, str], max_age_s: float) -> Answer | None:
        """The server's last answer (200 or 401) for this credential, if it is at most ``max_age_s`` old: what holds
        while the server is coming back and cannot be asked. Only a place in the queue rides on it: the request
        carries the client's own credential, which the server checks again when it is sent."""
        hit = self._cache.get(self._cache_key(headers))
        if hit is None:
            return None
        expiry, answer = hit
        ttl = self.ttl_s if answer.status == 200 else self.ttl_refused_s
        return answer if time.monotonic() - (expiry - ttl) <= max_age_s else None

    def _done(self, key: bytes, task: asyncio.Future[Answer]) -> None:
        self._pending.pop(key, None)
        if task.cancelled() or task.exception() is not None:
            return
        answer = task.result()
        if answer.status in (200, 401):  # a 503 while the model loads says nothing about the credential
            ttl = self.ttl_s if answer.status == 200 else self.ttl_refused_s
            self._cache[key] = (time.monotonic() + ttl, answer)
            self._cache.move_to_end(key)
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
