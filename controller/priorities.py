"""A request's priority as every layer sees it: its range and its metrics class. A leaf: it imports nothing of
kvctl, so settings, the policy and the proxy can all use it without importing each other."""

from __future__ import annotations

from typing import TypeGuard

__all__ = ["INT32_MAX", "INT32_MIN", "PRIORITY_CLASSES", "in_int32", "priority_class"]

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
"""The range of a request's priority (the server keeps it as an int32)."""


PRIORITY_CLASSES = ("high", "normal", "low")
"""The values of the ``priority_class`` metrics label."""


def in_int32(value: object) -> TypeGuard[int]:
    """An int (not a bool, which Python counts as one) within the int32 range."""
    return type(value) is int and INT32_MIN <= value <= INT32_MAX


def priority_class(priority: int, high_at: int, low_at: int) -> str:
    """The metrics label of a priority: ``high`` at or above high_at, ``low`` at or below low_at, else ``normal``
    (a bounded label: the raw number never is one)."""
    if priority >= high_at:
        return "high"
    if priority <= low_at:
        return "low"
    return "normal"
