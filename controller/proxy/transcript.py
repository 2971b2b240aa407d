"""What replay keeps of a stream, so that it goes on in the restarted server from the tokens already produced (the
stage that drives it: ``controller.proxy.replay``).

The patched server announces each streamed token's id after its event (``: tokens ID ...``, asked for with
``X-Token-Ids: 1``) and continues a request from such ids (``continuation_tokens``, patch 0027): it evaluates the
prompt and those tokens, takes them as generated (sampler history, length limits, usage, the text with its stop
strings, the chat parser's state) and streams only what follows, opening no message, block or role again.

What the proxy keeps of a streaming generation is a :class:`Transcript`: the request and the ids its client has
received, within one memory budget for all of them (``proxy.replay_memory_mib``); a stream over the budget is not
replayable. After a replay the continuation's events are spliced into the client's stream: an OpenAI stream keeps
its first ``id`` and ``created``, a Responses stream its response and item ids.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from controller.proxy.sse import first_data, lines, replace_first_data

__all__ = ["ANNOUNCE_HEADER", "OPT_OUT_HEADER", "ReplayMemory", "Transcript"]

log = structlog.get_logger("kvctl.proxy")

ANNOUNCE_HEADER = "X-Token-Ids"  # "1": the server follows each event with the ids of its tokens
OPT_OUT_HEADER = "X-Kvctl-Replay"  # "off": a client that prefers the error event to a continuation
ID_BYTES = 4  # an id held in array('i')

# the ids a Responses stream names its response, items and calls by (resp_..., msg_..., rs_..., fc_..., call_...):
# a continuation gets new ones, which the splice maps back to the first stream's, the n-th of a kind to the n-th
_RESPONSES_ID = re.compile(r"^(resp|msg|rs|fc|call)_")
_ID_KEYS = ("id", "item_id", "call_id")  # where ids stand (never in generated text)


def _walk_ids(doc: Any, seen: Callable[[str, str], str]) -> Any:
    """``doc`` with each id (a Responses kind, under an id key) replaced by ``seen(kind, id)``."""
    if isinstance(doc, dict):
        out = {}
        for key, value in doc.items():
            m = _RESPONSES_ID.match(value) if key in _ID_KEYS and isinstance(value, str) else None
            out[key] = seen(m.group(1), value) if m else _walk_ids(value, seen)
        return out
    if isinstance(doc, list):
        return [_walk_ids(v, seen) for v in doc]
    return doc


class ReplayMemory:
    """The bytes all transcripts may hold together: request bodies and token ids."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.used = 0

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        return True

    def give(self, n: int) -> None:
        self.used -= n


def _data_json(event: bytes) -> Any:
    """The JSON of an event's data line, or None (a comment, [DONE], not JSON)."""
    data = first_data(event)
    payload = data.strip() if data is not None else b"[DONE]"
    if payload == b"[DONE]":
        return None
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):
        return None


def _is_final(event: bytes, doc: Any) -> bool:
    """The event that ends a stream in its protocol: OpenAI's [DONE], the native final chunk ("stop": true),
    Anthropic's message_stop, Responses' response.completed; or the server's error event, which ends it too (a
    continuation would meet the same error). ``doc``: the event's data as JSON (``_data_json``)."""
    for line in lines(event):
        if line.startswith(b"data:") and line[5:].strip() == b"[DONE]":
            return True
        if line.startswith(b"event:") and line[6:].strip() == b"error":
            return True
    if not isinstance(doc, dict):
        return False
    return (
        doc.get("stop") is True or doc.get("type") in ("message_stop", "response.completed", "error") or "error" in doc
    )


@dataclass(eq=False)
class Transcript:
    """One streaming generation as far as its client has received it."""

    route: str
    payload: dict[str, Any]
    memory: ReplayMemory
    request_id: str
    held: int = 0
    ids: array[int] = field(default_factory=lambda: array("i"))
    replayable: bool = True
    done: bool = False
    replays: int = 0
    first_id: str | None = None
    created: int | None = None
    upstream_id: str | None = None  # OpenAI: the id the server gave the latest continuation
    names: dict[str, list[str]] = field(default_factory=dict)  # Responses: each kind's ids the client knows
    _renames: dict[str, str] = field(default_factory=dict)  # the latest continuation's ids -> the client's
    _met: dict[str, int] = field(default_factory=dict)  # how many of each kind the latest continuation named
    refused: bytes | None = None  # the server's answer to a continuation it refused, for the client

    @classmethod
    def start(
        cls, route: str, payload: dict[str, Any], body_bytes: int, memory: ReplayMemory, request_id: str
    ) -> Transcript:
        t = cls(route, payload, memory, request_id)
        if memory.take(body_bytes):
            t.held = body_bytes
        else:
            t.drop("its request alone is over proxy.replay_memory_mib")
        return t

    def drop(self, why: str) -> None:
        """Not replayable from here on; its memory goes back."""
        if self.replayable:
            log.info("replay.not_replayable", request_id=self.request_id, reason=why)
        self.replayable = False
        self.ids = array("i")
        self.memory.give(self.held)
        self.held = 0

    def observe(self, event: bytes) -> None:
        """Every event relayed to the client, in order (a continuation's after ``splice``): announced ids, the
        end, the identity the client knows."""
        if event.startswith(b": tokens"):
            if self.replayable:
                fresh = [int(t) for t in event[len(b": tokens") :].split()]
                if self.memory.take(ID_BYTES * len(fresh)):
                    self.held += ID_BYTES * len(fresh)
                    self.ids.extend(fresh)
                else:
                    self.drop("over proxy.replay_memory_mib")
            return
        doc = _data_json(event)
        if _is_final(event, doc):
            self.done = True
            return
        if self.first_id is None and isinstance(doc, dict) and isinstance(doc.get("id"), str):
            self.first_id = doc["id"]
            created = doc.get("created")
            self.created = created if isinstance(created, int) else None
        _walk_ids(doc, self._know)

    def _know(self, kind: str, ident: str) -> str:
        known = self.names.setdefault(kind, [])
        if ident not in known:
            known.append(ident)
        return ident

    def continuation(self) -> bytes:
        """The request again, continued from the ids the client has (after any it sent itself)."""
        own = self.payload.get("continuation_tokens")
        before = own if isinstance(own, list) else []
        self._renames, self._met = {}, {}
        return json.dumps({**self.payload, "continuation_tokens": [*before, *self.ids.tolist()]}).encode()

    def _rename(self, kind: str, ident: str) -> str:
        """A continuation's id: the client's id of the same kind at the same position (its n-th response, item or
        call), or, past those the client knows, the continuation's own."""
        if ident not in self._renames:
            n = self._met.get(kind, 0)
            self._met[kind] = n + 1
            known = self.names.get(kind, [])
            self._renames[ident] = known[n] if n < len(known) else ident
        return self._renames[ident]

    def splice(self, event: bytes) -> bytes:
        """An event of a continuation as the client's stream carries it: OpenAI chunks keep the first id and
        created, Responses events the client's response, item and call ids (each request gets new ones);
        everything else is as the server sent it."""
        doc = _data_json(event)
        if not isinstance(doc, dict):
            return event
        renamed = _walk_ids(doc, self._rename)
        if self.first_id is not None and isinstance(renamed.get("id"), str) and not _RESPONSES_ID.match(doc["id"]):
            self.upstream_id = doc["id"]
            renamed["id"] = self.first_id
            if self.created is not None and "created" in renamed:
                renamed["created"] = self.created
        if renamed == doc:
            return event
        return replace_first_data(
            event, b"data: " + json.dumps(renamed, ensure_ascii=False, separators=(",", ":")).encode()
        )

    def release(self) -> None:
        self.memory.give(self.held)
        self.held = 0
