"""``GET /slots`` on the client port: the view a client could read from the server directly.

The server's answer is relayed under the server's own authentication (kvctl's keys, or the server's ``--api-key``
asked about the client's credential). Two things differ from the server's bytes, both so that the view means to
the client what it would mean without kvctl:

- each slot's ``request_id`` is the client's own ``X-Request-Id`` again (the server saw kvctl's), or kvctl's id
  where the client sent none (kvctl gave that one back in the response's ``X-Request-Id``);
- with several of kvctl's keys (tenants), a key sees only the slots that serve its own requests, unless it is an
  operator key (``operator: true``); a slot that serves nobody of its, idle or another tenant's, is left out.

Slot actions (``POST /slots/N?action=...``) and ``GET /kv`` stay on kvctl's admin API: a park or an erase behind
the controller's back would corrupt its picture of the pool.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from controller.keys import Identity
from controller.proxy.context import Inflight

__all__ = ["slots_view"]


def slots_view(data: bytes, ident: Identity | None, several_keys: bool, inflight: Mapping[str, Inflight]) -> bytes:
    """The server's ``GET /slots`` array (a 200's body) as this client may see it; a body that is not a JSON array of
    objects (a newer server's shape) is returned as it is, or as an empty array to a tenant's key."""
    scoped = several_keys and not (ident is not None and ident.key is not None and ident.key.operator)
    try:
        slots = json.loads(data)
    except ValueError:
        slots = None
    if not isinstance(slots, list) or not all(isinstance(s, dict) for s in slots):
        return b"[]" if scoped else data
    name = ident.name if ident is not None else None
    out: list[dict[str, Any]] = []
    for slot in slots:
        rid = slot.get("request_id")
        entry = inflight.get(rid) if isinstance(rid, str) else None
        if scoped and (entry is None or entry.key != name):
            continue
        if entry is not None:
            slot["request_id"] = entry.client_request_id or entry.request_id
        out.append(slot)
    return json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode()
