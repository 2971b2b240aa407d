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
import hmac
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "PUBLIC_PATHS",
    "UNAUTHORIZED_BODY",
    "ApiKey",
    "Identity",
    "KeyFileError",
    "KeyRing",
    "ServerCheck",
    "credential",
    "parse_key_entry",
    "read_key_file",
]

# server-http.cpp: get_public_endpoints, compared with the raw request path (no --api-prefix)
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})

# the server's own 401 body, byte for byte (safe_json_to_str of the error object, keys in insertion order)
UNAUTHORIZED_BODY = json.dumps(
    {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}, separators=(",", ":")
).encode()

_BEARER = "Bearer "


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One of kvctl's keys. ``name`` is what logs and metrics show; ``priority`` is the default priority of its
    requests, ``max_priority`` the most they may have (controller/proxy/priority.py)."""

    key: str
    name: str
    priority: int | None = None
    max_priority: int | None = None

    def __repr__(self) -> str:  # never the key
        return f"ApiKey(name={self.name!r})"


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a verified request is: a key's name (kvctl's keys) or None (the server vouched for the client)."""

    name: str | None
    key: ApiKey | None = None


class KeyFileError(ValueError):
    """A malformed entry in proxy.api_keys or proxy.api_keys_file; the message names it, never the key."""


def parse_key_entry(entry: Any, where: str) -> ApiKey:
    """A key string, or a table ``{key, name, priority, max_priority}``."""
    if isinstance(entry, str):
        if not entry:
            raise KeyFileError(f"{where}: empty key")
        return ApiKey(entry, name=where)
    if not isinstance(entry, Mapping):
        raise KeyFileError(f"{where}: expected a key string or a table {{key, name, priority, max_priority}}")
    unknown = set(entry) - {"key", "name", "priority", "max_priority"}
    if unknown:
        raise KeyFileError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    key = entry.get("key")
    if not isinstance(key, str) or not key:
        raise KeyFileError(f"{where}: 'key' must be a non-empty string")
    name = entry.get("name", where)
    if not isinstance(name, str) or not name:
        raise KeyFileError(f"{where}: 'name' must be a non-empty string")
    # imported here: settings imports this module, and policy imports settings
    from controller.policy import INT32_MAX, INT32_MIN

    prio: dict[str, int | None] = {}
    for f in ("priority", "max_priority"):
        v = entry.get(f)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not INT32_MIN <= v <= INT32_MAX):
            raise KeyFileError(f"{where}: {f!r} must be an integer in [{INT32_MIN}, {INT32_MAX}]")
        prio[f] = v
    default, cap = prio["priority"], prio["max_priority"]
    if default is not None and cap is not None and default > cap:
        # the key's own requests would be capped below the default it names: a contradiction, not a choice
        raise KeyFileError(f"{where}: 'priority' ({default}) is above 'max_priority' ({cap})")
    return ApiKey(key, name, default, cap)


def read_key_file(path: Path) -> list[ApiKey]:
    """One entry a line: ``key [name]`` (like llama-server's ``--api-key-file``, whose lines are one key each) or
    the table form as inline JSON; blank lines and lines starting with ``#`` are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"cannot read {path}: {e}") from None
    keys = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path.name}:{n}"
        if line.startswith("{"):
            try:
                entry = json.loads(line)
            except ValueError:
                raise KeyFileError(f"{where}: not valid JSON") from None
            keys.append(parse_key_entry(entry, where))
        else:
            key, _, name = line.partition(" ")
            keys.append(parse_key_entry({"key": key, "name": name.strip() or where}, where))
    return keys


def credential(headers: Mapping[str, str]) -> str:
    """The credential as llama-server reads it: Authorization if present and non-empty (even when wrong), else
    X-Api-Key, without an optional "Bearer " prefix."""
    value = headers.get("Authorization", "")
    if not value:
        value = headers.get("X-Api-Key", "")
    if value.startswith(_BEARER):
        value = value[len(_BEARER) :]
    return value


class KeyRing:
    """kvctl's own keys, checked in constant time."""

    def __init__(self, keys: Iterable[ApiKey]) -> None:
        self.keys = tuple(keys)
        names = [k.name for k in self.keys]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise KeyFileError(f"key names must be unique, repeated: {', '.join(sorted(dup))}")
        self._digests = [(hashlib.sha256(k.key.encode()).digest(), k) for k in self.keys]

    def __len__(self) -> int:
        return len(self.keys)

    def check(self, headers: Mapping[str, str]) -> Identity | None:
        # compare digests (fixed length) with every key, so the time taken tells nothing of which or how much matched
        given = hashlib.sha256(credential(headers).encode("utf-8", "surrogateescape")).digest()
        found: ApiKey | None = None
        for digest, key in self._digests:
            if hmac.compare_digest(digest, given):
                found = key
        return Identity(found.name, found) if found is not None else None


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
