"""A generation request's priority: what the client asks for, and what kvctl lets it have.

Higher is more important (as SGLang, TensorRT-LLM, llm-d's InferenceObjective and the unsloth priority PR; vLLM
is the reverse). The sources, first present wins: the body's top-level ``priority``, the ``X-Priority`` header,
llm-d's objective header mapped through ``proxy.objective_priorities``, the key's ``priority``, else 0. A key's
``max_priority`` caps whatever its request ends up with; without kvctl keys, ``proxy.client_priority`` off
ignores what clients ask for. Every value a client supplies must be an int32, whether or not it is used.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from multidict import MultiMapping

from controller.keys import ApiKey
from controller.priorities import INT32_MAX, INT32_MIN, in_int32

__all__ = [
    "OBJECTIVE_HEADER",
    "PRIORITY_HEADER",
    "InvalidPriority",
    "Priority",
    "PriorityRules",
    "resolve_priority",
]

PRIORITY_HEADER = "X-Priority"
OBJECTIVE_HEADER = "x-llm-d-inference-objective"

BODY = "body field"
HEADER = f"{PRIORITY_HEADER} header"
OBJECTIVE = "objective header"
KEY = "key"
DEFAULT = "default"

_INTEGER = re.compile(r"[+-]?[0-9]{1,20}")  # ASCII digits only (int() takes "1_000" and other scripts' digits)


class InvalidPriority(ValueError):
    """A priority that is not an int32 (a string, a float, a boolean, out of range); the message names its source."""


@dataclass(frozen=True, slots=True)
class Priority:
    """The effective priority of one request and where it came from (``body field``, ``X-Priority header``,
    ``objective header``, ``key`` or ``default``; a value capped by its key keeps the source that asked)."""

    value: int
    source: str


@dataclass(frozen=True, slots=True)
class PriorityRules:
    client_priority: bool = True
    """Without kvctl keys: whether clients may set priorities at all (off: every request gets 0)."""
    objectives: Mapping[str, int] | None = None
    """llm-d's objective names to priorities (``proxy.objective_priorities``)."""


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _invalid(value: Any, source: str) -> InvalidPriority:
    return InvalidPriority(f"priority must be an integer in [{INT32_MIN}, {INT32_MAX}], got {_shown(value)} ({source})")


def body_priority(payload: Mapping[str, Any] | None) -> int | None:
    """The body's top-level ``priority``: None when absent or null; InvalidPriority when it is not an int32 (a
    boolean is not an integer here, though Python's bool is one)."""
    if payload is None:
        return None
    value = payload.get("priority")
    if value is None:
        return None
    if not in_int32(value):
        raise _invalid(value, BODY)
    return value


def header_priority(values: list[str]) -> int | None:
    """``X-Priority``: None when absent; InvalidPriority when it is not an int32 or comes more than once (which one
    the server would read depends on its header map's order)."""
    if not values:
        return None
    if len(values) > 1:
        raise InvalidPriority(f"more than one {PRIORITY_HEADER} header")
    text = values[0].strip()
    if not _INTEGER.fullmatch(text) or not in_int32(int(text)):
        raise _invalid(values[0], HEADER)
    return int(text)


def resolve_priority(
    payload: Mapping[str, Any] | None,
    headers: MultiMapping[str],
    key: ApiKey | None,
    rules: PriorityRules,
) -> Priority:
    """The effective priority of a generation request (``payload``: its parsed JSON body, None when it has none;
    ``key``: the kvctl key it came with, None without kvctl keys). Raises InvalidPriority before anything else is
    decided, so a malformed value is refused whatever the trust settings."""
    from_body = body_priority(payload)
    from_header = header_priority(headers.getall(PRIORITY_HEADER, []))
    asked: Priority | None = None
    if from_body is not None:
        asked = Priority(from_body, BODY)
    elif from_header is not None:
        asked = Priority(from_header, HEADER)
    else:
        objective = headers.get(OBJECTIVE_HEADER)
        mapped = (rules.objectives or {}).get(objective) if objective else None
        if mapped is not None:
            asked = Priority(mapped, OBJECTIVE)
    if key is None:
        # no kvctl keys (or the server checks the credentials): trust is all or nothing
        return asked if asked is not None and rules.client_priority else Priority(0, DEFAULT)
    chosen = asked or (Priority(key.priority, KEY) if key.priority is not None else Priority(0, DEFAULT))
    if key.max_priority is not None and chosen.value > key.max_priority:
        # the cap bounds what the request ends up with, the implicit 0 included (a key capped below 0)
        return Priority(key.max_priority, chosen.source)
    return chosen
