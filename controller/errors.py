"""kvctl's own errors, on both listeners: their reason codes, their bodies and the header that marks them.

Every error kvctl answers itself (not one it relays from the server) carries ``X-Kvctl-Error: <code>``, the
reason code below, so an operator, a load balancer's log or a client can tell kvctl's answers from the server's
without reading the body. The bodies differ by listener, each following what its clients expect:

* the proxy answers in the server's own error object (``{"error": {"code", "message", "type"}}``, the shape
  llama-server's clients already parse), its message starting ``kvctl:`` and with ``kvctl_code``; inside an SSE
  stream the same object is framed as the server frames an error on that route;
* the admin API answers in the OpenAI envelope (``{"error": {"message", "type", "param", "code"}}``), ``code``
  being the reason code; it also sends ``X-Kvctl-Origin: kvctl``, its marker before ``X-Kvctl-Error``, kept for
  one release (deprecated).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from aiohttp import web

__all__ = [
    "ERROR_HEADER",
    "ORIGIN_HEADER",
    "Code",
    "KvctlError",
    "admin_error_response",
    "error_headers",
    "openai_envelope",
    "proxy_error_object",
    "proxy_error_response",
]

ERROR_HEADER = "X-Kvctl-Error"
ORIGIN_HEADER = "X-Kvctl-Origin"
"""Deprecated: the admin API's marker before ERROR_HEADER; sent for one more release."""


class Code(StrEnum):
    """kvctl's reason codes (the value of ``X-Kvctl-Error``)."""

    # the proxy: the request itself
    BODY_TOO_LARGE = "body_too_large"
    BODY_TOO_DEEP = "body_too_deep"
    INVALID_HEADER = "invalid_header"
    INVALID_PATH = "invalid_path"
    INVALID_PREDICT = "invalid_predict"
    INVALID_PRIORITY = "invalid_priority"
    """A priority (the body's `priority`, `X-Priority`) that is not an int32."""
    CONVERSATION_TAKEN = "conversation_taken"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    EXPECTATION_FAILED = "expectation_failed"
    # the proxy: admission and the server
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    SHUTTING_DOWN = "shutting_down"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    """The server is not answering and kvctl has no reason to expect it back (an attached server that never
    answered)."""
    SERVER_RESTARTING = "server_restarting"
    """The server is coming back (restarting, loading its model, an attached server that answered before) and did
    not within `proxy.replay_timeout_s` of the request's wait: 503 with Retry-After."""
    UPSTREAM_DISCONNECTED = "upstream_disconnected"
    UPSTREAM_TIMEOUT = "upstream_timeout"
    UPSTREAM_ERROR = "upstream_error"
    """The server answered an error whose body kvctl could not read."""
    PRIVATE_ROUTE = "private_route"
    """A controller route (a slot action, `GET /kv`) on the client port: 403, it is on kvctl's admin API."""
    SERVER_REPLACED = "server_replaced"
    """The server was restarted with another model (a forced planned restart): the request cannot be continued."""
    PEER_FORBIDDEN = "peer_forbidden"
    """A request with `X-Kvctl-Peer` whose key is not this kvctl's `proxy.peer_api_key` (or it has none): 403."""
    SERVER_FAILED = "server_failed"
    """The supervised server died before it was ready supervisor.failed_after times in a row and is not started
    again: a 503 without Retry-After, since waiting does not help."""
    # the admin API
    UNAUTHORIZED = "unauthorized"
    INVALID_SLOT = "invalid_slot"
    INVALID_MODE = "invalid_mode"
    NO_SUCH_SLOT = "no_such_slot"
    SLOT_IDLE = "slot_idle"
    NOT_PARKED = "not_parked"
    SERVER_REFUSED = "server_refused"
    """The server refused a park or resume; the answer keeps its status and message."""
    INVALID_ARGV = "invalid_argv"
    """A planned restart's command line names no model file kvctl can read, or is not a list of strings."""
    MODEL_CHANGED = "model_changed"
    """A planned restart's new command line serves another model; `force` ends the running requests instead."""
    RESTART_IN_PROGRESS = "restart_in_progress"
    SERVER_NOT_READY = "server_not_ready"
    """A planned restart needs a running server kvctl spawned."""
    NOT_SPAWNED = "not_spawned"
    """kvctl attaches to this server: it cannot restart it."""
    DRAIN_IN_PROGRESS = "drain_in_progress"
    INVALID_PEERS = "invalid_peers"
    """`POST /drain`: no peer to drain to (none given, `proxy.drain_peers` empty), or one that is not an http(s) URL."""
    NO_KEEPER = "no_keeper"
    """`POST /reload`: kvctl runs without its keeper (proxy.keeper off, or TLS on its listener)."""
    INVALID_ENVIRONMENT = "invalid_environment"
    """`POST /reload`: an environment that is not an object of KVCTL_* names to strings."""
    ACTION_TIMEOUT = "action_timeout"
    """A park or resume was not answered in time; it may still complete (``GET /status`` tells)."""


class KvctlError(Exception):
    """An error kvctl answers itself: HTTP status, reason code, message, and how long to wait before retrying."""

    def __init__(self, status: int, code: Code | str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = str(code)
        self.message = message
        self.retry_after_s = retry_after_s


# the server's error types by status (tools/server/server-common.cpp's error_type names)
_SERVER_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    417: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
    504: "unavailable_error",
}
_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 409: "conflict_error"}


def error_headers(code: Code | str, retry_after_s: float | None = None) -> dict[str, str]:
    headers = {ERROR_HEADER: str(code)}
    if retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(retry_after_s)))
    return headers


def proxy_error_object(status: int, message: str, code: Code | str) -> dict[str, Any]:
    """The server's error object ({code, message, type}), marked as kvctl's: the message starts with ``kvctl:``
    and ``kvctl_code`` names the reason."""
    return {
        "code": status,
        "message": f"kvctl: {message}",
        "type": _SERVER_TYPES.get(status, "server_error"),
        "kvctl_code": str(code),
    }


def proxy_error_response(
    status: int,
    message: str,
    code: Code | str,
    retry_after_s: float | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    h = {**error_headers(code, retry_after_s), **(headers or {})}
    return web.json_response({"error": proxy_error_object(status, message, code)}, status=status, headers=h)


def openai_envelope(status: int, message: str, code: Code | str) -> dict[str, Any]:
    etype = _OPENAI_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
    return {"error": {"message": message, "type": etype, "param": None, "code": str(code)}}


def admin_error_response(
    status: int, message: str, code: Code | str, retry_after_s: float | None = None
) -> web.Response:
    headers = {**error_headers(code, retry_after_s), ORIGIN_HEADER: "kvctl"}
    return web.json_response(openai_envelope(status, message, code), status=status, headers=headers)
