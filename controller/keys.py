"""kvctl's own API keys: what one is (``proxy.api_keys``, ``proxy.api_keys_file``), how the file is read, and how a
request's credential is found and checked. A leaf beside controller.priorities: settings reads the keys, the
proxy checks them (controller.proxy.auth), and neither imports the other for it.

The credential is read as llama-server's middleware reads it (``tools/server/server-http.cpp`` at the pinned
commit): the ``Authorization`` header when it is present and not empty (even when it is wrong), else
``X-Api-Key``; a leading ``Bearer `` is optional. Keys are compared in constant time, all of them every time,
and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from controller.priorities import INT32_MAX, INT32_MIN, in_int32

__all__ = ["ApiKey", "Identity", "KeyFileError", "KeyRing", "credential", "parse_key_entry", "read_key_file"]

_BEARER = "Bearer "


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One of kvctl's keys. ``name`` is what logs and metrics show; ``priority`` is the default priority of its
    requests, ``max_priority`` the most they may have (controller/proxy/priority.py)."""

    key: str
    name: str
    priority: int | None = None
    max_priority: int | None = None
    operator: bool = False
    """Sees every slot in the client port's ``GET /slots`` (a tenant's key sees only its own requests')."""

    def __repr__(self) -> str:  # never the key
        return f"ApiKey(name={self.name!r})"


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a verified request is: a key's name (kvctl's keys) or None (the server vouched for the client)."""

    name: str | None
    key: ApiKey | None = None
    peer: bool = False
    """Another kvctl moving a request here (a drain), with ``proxy.peer_api_key``: it checked the client."""


class KeyFileError(ValueError):
    """A malformed entry in proxy.api_keys or proxy.api_keys_file; the message names it, never the key."""


def parse_key_entry(entry: Any, where: str) -> ApiKey:
    """A key string, or a table ``{key, name, priority, max_priority, operator}``."""
    if isinstance(entry, str):
        if not entry:
            raise KeyFileError(f"{where}: empty key")
        return ApiKey(entry, name=where)
    if not isinstance(entry, Mapping):
        raise KeyFileError(f"{where}: expected a key string or a table {{key, name, priority, max_priority, operator}}")
    unknown = set(entry) - {"key", "name", "priority", "max_priority", "operator"}
    if unknown:
        raise KeyFileError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    key = entry.get("key")
    if not isinstance(key, str) or not key:
        raise KeyFileError(f"{where}: 'key' must be a non-empty string")
    name = entry.get("name", where)
    if not isinstance(name, str) or not name:
        raise KeyFileError(f"{where}: 'name' must be a non-empty string")
    prio: dict[str, int | None] = {}
    for f in ("priority", "max_priority"):
        v = entry.get(f)
        if v is not None and not in_int32(v):
            raise KeyFileError(f"{where}: {f!r} must be an integer in [{INT32_MIN}, {INT32_MAX}]")
        prio[f] = v
    default, cap = prio["priority"], prio["max_priority"]
    if default is not None and cap is not None and default > cap:
        # the key's own requests would be capped below the default it names: a contradiction, not a choice
        raise KeyFileError(f"{where}: 'priority' ({default}) is above 'max_priority' ({cap})")
    operator = entry.get("operator", False)
    if not isinstance(operator, bool):
        raise KeyFileError(f"{where}: 'operator' must be true or false")
    return ApiKey(key, name, default, cap, operator)


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
