"""What the proxy does with each route of the pinned llama-server: the one place that classifies them.

The table mirrors the registrations in llama.cpp ``tools/server/server.cpp`` at the pinned commit
(``ctx_http.get/post/del(...)``, router-mode and conditional routes included);
``tests/unit/test_routes.py`` fails when the pinned server has a route this table does not name.

- ``GENERATION``: creates completion tasks, so it takes cells: admission, request-id tagging, heartbeats
  while queued or parked, errors in the route's own framing.
- ``PRIVATE``: the controller's own routes (slot actions, occupancy); refused (403, naming kvctl's admin
  API) on the public listener unless ``proxy.expose_private_routes``.
- ``PUBLIC``: the server answers it without credentials (``/health``, ``/v1/health``).
- ``CONVERSATION``: the WebUI's resumable streams; relayed byte for byte, scoped to the key that
  started the conversation when kvctl holds several keys.
- ``CONTROL``: acts on a running completion by its id; scoped like a conversation.
- ``SLOTS``: ``GET /slots``, relayed under the server's authentication, each key seeing its own requests' slots
  (``controller.proxy.slots``).
- ``RELAY``: everything else, relayed as it is (status, headers and bytes, streamed).

Anything the table does not name (the WebUI's static assets, a route a newer server adds) is relayed too:
the proxy is a deny-list, not an allow-list.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["ROUTES", "Kind", "Route", "RouteTable", "predict_route_from_env"]


class Kind(StrEnum):
    GENERATION = "generation"
    PRIVATE = "private"
    PUBLIC = "public"
    CONVERSATION = "conversation"
    CONTROL = "control"
    SLOTS = "slots"
    RELAY = "relay"


@dataclass(frozen=True, slots=True)
class Route:
    method: str  # GET | POST | DELETE
    path: str  # as registered, before the server's --api-prefix; ":name" is a path parameter
    kind: Kind
    stream_framing: str = "openai"  # how the server frames an error inside its SSE stream: openai | anthropic


G, P, R = Kind.GENERATION, Kind.PRIVATE, Kind.RELAY

ROUTES: tuple[Route, ...] = (
    # health: public on the server (no API key checked)
    Route("GET", "/health", Kind.PUBLIC),
    Route("GET", "/v1/health", Kind.PUBLIC),
    # kvctl answers GET /metrics itself (the server's llamacpp:* series never leave through the proxy)
    Route("GET", "/metrics", P),
    Route("GET", "/props", R),
    Route("POST", "/props", R),
    Route("GET", "/models", R),
    Route("GET", "/v1/models", R),
    # completions: every route that creates a completion task
    Route("POST", "/completion", G),
    Route("POST", "/completions", G),
    Route("POST", "/v1/completions", G),
    Route("POST", "/chat/completions", G),
    Route("POST", "/v1/chat/completions", G),
    Route("POST", "/v1/responses", G),
    Route("POST", "/responses", G),
    Route("POST", "/v1/audio/transcriptions", G),
    Route("POST", "/audio/transcriptions", G),
    Route("POST", "/v1/messages", G, stream_framing="anthropic"),
    Route("POST", "/infill", G),
    Route("POST", "/v1/chat/completions/control", Kind.CONTROL),
    # no completion task: embeddings and reranking run as their own tasks without generating
    Route("POST", "/embedding", R),
    Route("POST", "/embeddings", R),
    Route("POST", "/v1/embeddings", R),
    Route("POST", "/rerank", R),
    Route("POST", "/reranking", R),
    Route("POST", "/v1/rerank", R),
    Route("POST", "/v1/reranking", R),
    Route("POST", "/tokenize", R),
    Route("POST", "/detokenize", R),
    Route("POST", "/apply-template", R),
    Route("POST", "/chat/completions/input_tokens", R),
    Route("POST", "/v1/chat/completions/input_tokens", R),
    Route("POST", "/responses/input_tokens", R),
    Route("POST", "/v1/responses/input_tokens", R),
    Route("POST", "/v1/messages/count_tokens", R),
    Route("GET", "/lora-adapters", R),
    Route("POST", "/lora-adapters", R),
    # the controller's routes
    Route("GET", "/slots", Kind.SLOTS),
    Route("GET", "/kv", P),
    Route("POST", "/slots/:id_slot", P),
    # the WebUI's resumable streams
    Route("GET", "/v1/stream", Kind.CONVERSATION),
    Route("POST", "/v1/streams/lookup", Kind.CONVERSATION),
    Route("DELETE", "/v1/stream", Kind.CONVERSATION),
    # registered only in some configurations (403 "feature disabled" otherwise)
    Route("GET", "/cors-proxy", R),
    Route("POST", "/cors-proxy", R),
    Route("GET", "/tools", R),
    Route("POST", "/tools", R),
    # router mode only (kvctl refuses a router at start-up: /kv and parking are per child)
    Route("POST", "/models", R),
    Route("POST", "/models/load", R),
    Route("POST", "/models/unload", R),
    Route("GET", "/models/sse", R),
    Route("DELETE", "/models", R),
)


def predict_route_from_env(environ: dict[str, str] | None = None) -> str | None:
    """The Vertex AI predict route the server registers (``AIP_MODE=PREDICTION``), as server-http.cpp reads it."""
    env = os.environ if environ is None else environ
    if env.get("AIP_MODE", "") != "PREDICTION":
        return None
    path = env.get("AIP_PREDICT_ROUTE", "") or "/predict"
    return path if path.startswith("/") else "/" + path


class RouteTable:
    """Classify (method, path) for a server with ``api_prefix`` (its ``--api-prefix``) and an optional predict
    route (a generation route: it dispatches its instances to the completion handlers)."""

    def __init__(self, api_prefix: str = "", predict_route: str | None = None) -> None:
        self.api_prefix = api_prefix.rstrip("/")
        self.predict_route = predict_route
        self._exact: dict[tuple[str, str], Route] = {}
        self._param: list[tuple[str, str, Route]] = []  # (method, prefix before the parameter, route)
        for r in ROUTES:
            if ":" in r.path:
                self._param.append((r.method, r.path.split(":", 1)[0], r))
            else:
                self._exact[(r.method, r.path)] = r
        if predict_route:
            # the server's own GCP registration goes through post(), so it carries the prefix too
            self._exact[("POST", predict_route)] = Route("POST", predict_route, G)

    def lookup(self, method: str, path: str) -> Route | None:
        """The route the server would dispatch to, or None (an asset, or no such route). HEAD is answered by the
        GET handlers (cpp-httplib). A path below a parameter route (``/slots/0/``, ``/slots/0/x``) counts as that
        route: cpp-httplib's matcher takes a trailing separator, and erring towards the route keeps every path
        the server might dispatch to a private handler private."""
        if method == "HEAD":
            method = "GET"
        if self.api_prefix:
            if not path.startswith(self.api_prefix + "/"):
                return None
            path = path[len(self.api_prefix) :]
        route = self._exact.get((method, path))
        if route is not None:
            return route
        for m, prefix, r in self._param:
            if m == method and path.startswith(prefix) and len(path) > len(prefix):
                return r
        return None

    def is_api_path(self, path: str) -> bool:
        """Whether any method of the server's API answers at this path (so it is not a static asset)."""
        return any(self.lookup(m, path) is not None for m in ("GET", "POST", "DELETE"))

    def predict_targets(self, request_format: str) -> list[Route]:
        """The routes a Vertex AI predict instance's ``@requestFormat`` may dispatch to (server-http.cpp: any
        registered path, whatever its method, or its camelCase alias such as ``chatCompletions``)."""
        return [r for r in ROUTES if request_format in (r.path, gcp_alias(r.path))]


def gcp_alias(path: str) -> str:
    """server-http.cpp path_to_gcp_format: "/v1/chat/completions" -> "chatCompletions", "/apply-template" ->
    "applyTemplate"; stops at a path parameter."""
    s = path[3:] if len(path) > 3 and path.startswith("/v1") else path
    s = s.removeprefix("/")
    out, cap = [], False
    for c in s:
        if c == ":":
            break
        if c in "/-_":
            cap = True
        else:
            out.append(c.upper() if cap else c)
            cap = False
    return "".join(out)
