"""Key ownership: with several kvctl keys, a conversation stream or a running completion is acted on only by the
key that started it.

Which key started each conversation and completion (completion ids are recorded from the first event of the
streams they name), and the id a replayed completion has on the server. An id another key owns is replaced by one
nobody has, so the server answers as for an id it does not know.
"""

from __future__ import annotations

import collections
import contextlib
import json
import uuid
from urllib.parse import parse_qsl, urlencode

from controller.errors import Code
from controller.proxy.inspection import BadRequest
from controller.proxy.sse import first_data

__all__ = ["Owners", "Ownership", "unowned_id"]


class Owners:
    """Ids to names, bounded (the oldest are forgotten first): which key started a conversation stream or a
    completion; the id a replayed completion has on the server."""

    def __init__(self, limit: int = 65536) -> None:
        self._owner: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._limit = limit

    def set(self, ident: str, owner: str) -> None:
        self._owner[ident] = owner
        self._owner.move_to_end(ident)
        while len(self._owner) > self._limit:
            self._owner.popitem(last=False)

    def owns(self, ident: str, owner: str | None) -> bool:
        return self._owner.get(ident) == owner

    def get(self, ident: str) -> str | None:
        return self._owner.get(ident)


def unowned_id() -> str:
    """An id no stream or completion has: the server answers for it as for one it does not know."""
    return f"kvctl-not-yours-{uuid.uuid4().hex}"


class Ownership:
    def __init__(self, several_keys: bool) -> None:
        self.several_keys = several_keys
        self.owners = Owners()  # conversation ids and completion ids, by key name (several keys only)
        self.completion_ids = Owners()  # a replayed stream's id, as its client knows it -> the continuation's

    def claim(self, conversation: str, owner: str) -> bool:
        """Record ``owner`` as the conversation's; False when another key's it is (the server would replace that
        conversation's stream: another key's chat is not this key's to end)."""
        current = self.owners.get(conversation)
        if current is not None and current != owner:
            return False
        self.owners.set(conversation, owner)
        return True

    def record(self, event: bytes, owner: str) -> None:
        """The completion id of a stream's first data event, as ``owner``'s."""
        data = first_data(event)
        if data is None:
            return
        with contextlib.suppress(ValueError, RecursionError):
            doc = json.loads(data)
            if isinstance(doc, dict) and isinstance(doc.get("id"), str):
                self.owners.set("cmpl:" + doc["id"], owner)

    def scope_query(self, query_string: str, owner: str | None) -> str:
        """``GET /v1/stream``'s query with a conversation id ``owner`` did not start replaced."""
        query = parse_qsl(query_string, keep_blank_values=True)
        fixed = [(k, unowned_id() if k == "conv_id" and v and not self.owners.owns(v, owner) else v) for k, v in query]
        return urlencode(fixed)

    def scope_control(self, body: bytes, owner: str | None) -> bytes:
        """A completion control request's body, naming the completion as the server knows it: a replayed stream's
        id is the continuation's; with several keys, one ``owner`` did not start is replaced. BadRequest for a body
        nested deeper than Python's parser goes."""
        with contextlib.suppress(ValueError):
            try:
                payload = json.loads(body)
            except RecursionError:
                raise BadRequest(400, "request body nested too deeply", Code.BODY_TOO_DEEP) from None
            cid = payload.get("id") if isinstance(payload, dict) else None
            if isinstance(cid, str) and cid:
                if self.several_keys and not self.owners.owns("cmpl:" + cid, owner):
                    payload["id"] = unowned_id()
                else:
                    payload["id"] = self.completion_ids.get(cid) or cid
                if payload["id"] != cid:
                    body = json.dumps(payload).encode()
        return body

    def filter_streams(self, data: bytes, owner: str | None) -> bytes:
        """``POST /v1/streams/lookup``'s answer with only the conversations ``owner`` started."""
        with contextlib.suppress(ValueError, RecursionError):
            doc = json.loads(data)
            if isinstance(doc, list):
                mine = [
                    s for s in doc if isinstance(s, dict) and self.owners.owns(str(s.get("conversation_id")), owner)
                ]
                data = json.dumps(mine, ensure_ascii=False).encode()
        return data
