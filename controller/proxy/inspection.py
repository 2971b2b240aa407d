"""What kvctl reads of a request before routing it on: the checks on its header and path, and a generation's
body (its JSON, the conversation it names, whether the server would refuse it at once, the prompt's size).

These sit next to the route table (``controller.proxy.routes``): the route says what a request is, these say
whether its body lets it through admission and how many cells it is assumed to need. Pure functions, no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDictProxy

from controller.errors import Code
from controller.proxy.routes import Kind, Route, RouteTable

__all__ = [
    "BadRequest",
    "GenerationBody",
    "brackets_balanced",
    "estimate_prompt_cells",
    "has_dot_segments",
    "is_utf8",
    "one_completion",
    "read_generation",
    "refused_by_server",
]


def is_utf8(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def has_dot_segments(path: str) -> bool:
    """``.`` or ``..`` as a segment of the (percent-decoded) path."""
    return any(segment in (".", "..") for segment in path.split("/"))


CHAT_ROUTES = frozenset({"/chat/completions", "/v1/chat/completions", "/v1/messages"})
PROMPT_ROUTES = frozenset({"/completion", "/completions", "/v1/completions"})


def refused_by_server(route: str, payload: dict[str, Any]) -> bool:
    """A generation request the server refuses before it takes a slot: no prompt, no message list, or a stream
    flag that is not a boolean. Conservative: anything else goes through admission."""
    if "stream" in payload and not isinstance(payload["stream"], bool):
        return True
    if route in CHAT_ROUTES:
        return not isinstance(payload.get("messages"), list)
    if route in PROMPT_ROUTES:
        return payload.get("prompt") is None
    return False


def estimate_prompt_cells(route: str, payload: dict[str, Any]) -> int:
    """Cells a request's prompt will take, before the server tokenizes it: exact for token ids, and for
    text one token per 3 bytes of UTF-8 (most tokenizers average 3.5 to 4.5 on prose, so this errs
    towards holding a large prompt back rather than letting it overflow the pool)."""

    def text(n_bytes: int) -> int:
        return -(-n_bytes // 3)

    def one(p: Any) -> int:
        if isinstance(p, str):
            return text(len(p.encode("utf-8", "replace")))
        if isinstance(p, list):
            if p and all(isinstance(t, int) for t in p):
                return len(p)
            return sum(one(x) for x in p)  # several prompts or parts: each takes cells
        if isinstance(p, dict):  # a multimodal, templated or Responses/Anthropic part: its text
            return sum(one(v) for k, v in p.items() if k in ("text", "content", "prompt_string", "input", "output"))
        return 0

    if route in CHAT_ROUTES:
        messages = payload.get("messages")
        # roles and the chat template add a few tokens per message
        cells = (
            sum(one(m.get("content")) + 8 for m in messages if isinstance(m, dict)) if isinstance(messages, list) else 0
        )
        return cells + one(payload.get("system"))
    if route in ("/v1/responses", "/responses"):
        inp = payload.get("input")
        n_items = len(inp) if isinstance(inp, list) else 1
        return one(inp) + 8 * n_items + one(payload.get("instructions"))
    if route == "/infill":
        extra = payload.get("input_extra")
        return (
            one(payload.get("input_prefix"))
            + one(payload.get("input_suffix"))
            + one(payload.get("prompt"))
            + (sum(one(c.get("text")) for c in extra if isinstance(c, dict)) if isinstance(extra, list) else 0)
        )
    if isinstance(payload.get("instances"), list):  # the Vertex AI predict route: several requests in one
        return sum(estimate_prompt_cells(_predict_route(i), i) for i in payload["instances"] if isinstance(i, dict))
    return one(payload.get("prompt"))


def _predict_route(instance: dict[str, Any]) -> str:
    fmt = instance.get("@requestFormat")
    return {"chatCompletions": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}.get(
        fmt if isinstance(fmt, str) else "", "/completion"
    )


def brackets_balanced(body: bytes) -> bool:
    """Whether every ``[`` and ``{`` outside strings is closed, in order, and nothing but whitespace follows: what
    a JSON document too deep for Python's parser needs to be valid (iterative, so any depth)."""
    closing = {ord("["): ord("]"), ord("{"): ord("}")}
    stack: list[int] = []
    in_string = escaped = False
    ended = False
    for c in body:
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # quote
                in_string = False
            continue
        if ended:
            if c not in b" \t\r\n":
                return False
            continue
        if c == 0x22:
            in_string = True
        elif c in closing:
            stack.append(closing[c])
        elif c in (0x5D, 0x7D):
            if not stack or stack.pop() != c:
                return False
            ended = not stack
    return ended


def one_completion(payload: Any) -> bool:
    """A request for one completion of one prompt: what a continuation (continuation_tokens) can continue."""
    if not isinstance(payload, dict):
        return False
    prompt = payload.get("prompt")
    many = isinstance(prompt, list) and len(prompt) > 1 and not all(isinstance(t, int) for t in prompt)
    return not many and all(payload.get(k) in (None, 1) for k in ("n_cmpl", "n"))


class BadRequest(Exception):
    """A request kvctl answers itself with ``status``: it cannot tell what the server would do with it."""

    def __init__(self, status: int, message: str, code: Code) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


@dataclass(frozen=True, slots=True)
class GenerationBody:
    """A generation request's body as admission sees it."""

    route: Route
    payload: Any  # the JSON document; None when the body is not JSON (or multipart, or too deep to parse)
    multipart: bool
    too_deep: bool  # nested deeper than Python's parser goes, its brackets balanced: it may be valid
    conversation: str  # X-Conversation-Id: a resumable stream
    predict: bool  # the Vertex AI predict route

    @property
    def fields(self) -> dict[str, Any] | None:
        return self.payload if isinstance(self.payload, dict) else None

    @property
    def malformed(self) -> bool:
        """The server answers it at once, exactly as it would without kvctl: it takes no cells."""
        if self.multipart or self.too_deep:
            return False
        return self.fields is None or refused_by_server(self.route.path, self.payload)

    @property
    def stream(self) -> bool:
        return self.fields is not None and self.payload.get("stream", False) is True

    def cells(self, reserve: int) -> int:
        """The cells admission assumes it needs: its prompt's estimate, at least ``reserve``."""
        fields = self.fields
        return max(reserve, estimate_prompt_cells(self.route.path, fields)) if fields is not None else reserve


def read_generation(
    route: Route, routes: RouteTable, headers: CIMultiDictProxy[str], content_type: str, body: bytes
) -> GenerationBody:
    """Parse a generation request's body; BadRequest where kvctl must answer it itself."""
    conversations = headers.getall("X-Conversation-Id", [])
    if len(conversations) > 1:
        # which one the server takes depends on its header map's order: refuse rather than guess
        raise BadRequest(400, "more than one X-Conversation-Id header", Code.INVALID_HEADER)
    multipart = content_type.startswith("multipart/")
    payload: Any = None
    too_deep = False
    if not multipart:
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None
        except RecursionError:
            # nested deeper than Python's parser goes, while the server's parser has no limit: when its brackets
            # close, it may be a valid request, which must not slip past admission; when they do not, it is
            # garbage the server refuses at once
            too_deep = brackets_balanced(body)
    predict = route.path == routes.predict_route
    if predict and (too_deep or (isinstance(payload, dict) and predict_refused(routes, payload))):
        raise BadRequest(
            400, "a predict instance may only target a completion or a relayed route", Code.INVALID_PREDICT
        )
    return GenerationBody(route, payload, multipart, too_deep, conversations[0] if conversations else "", predict)


def predict_refused(routes: RouteTable, payload: dict[str, Any]) -> bool:
    """A predict request with an instance aimed at a private, slot-view, conversation or control route (the server
    dispatches each instance to any registered handler named by its @requestFormat, past kvctl's per-key view)."""
    instances = payload.get("instances")
    if not isinstance(instances, list):
        return False
    for instance in instances:
        fmt = instance.get("@requestFormat") if isinstance(instance, dict) else None
        if isinstance(fmt, str) and any(
            r.kind in (Kind.PRIVATE, Kind.SLOTS, Kind.CONVERSATION, Kind.CONTROL) for r in routes.predict_targets(fmt)
        ):
            return True
    return False
