"""The proxy's route table against the pinned server's own registrations."""

from __future__ import annotations

from controller.proxy.routes import ROUTES, Kind, RouteTable, predict_route_from_env
from tests.harness import pinned_routes


def test_every_route_of_the_pinned_server_is_classified() -> None:
    table = RouteTable()
    named = {(r.method, r.path) for r in ROUTES}
    missing = pinned_routes() - named
    assert not missing, f"routes of the pinned server the proxy does not classify: {sorted(missing)}"
    stale = named - pinned_routes()
    assert not stale, f"routes in the proxy's table the pinned server does not have: {sorted(stale)}"
    for method, path in pinned_routes():
        assert table.lookup(method, path.replace(":id_slot", "3")) is not None


def test_generation_routes_are_every_completion_route() -> None:
    gen = {(r.method, r.path) for r in ROUTES if r.kind is Kind.GENERATION}
    assert gen == {
        ("POST", p)
        for p in (
            "/completion",
            "/completions",
            "/v1/completions",
            "/chat/completions",
            "/v1/chat/completions",
            "/v1/responses",
            "/responses",
            "/v1/messages",
            "/infill",
            "/v1/audio/transcriptions",
            "/audio/transcriptions",
        )
    }
    private = {(r.method, r.path) for r in ROUTES if r.kind is Kind.PRIVATE}
    assert private == {("GET", "/kv"), ("POST", "/slots/:id_slot"), ("GET", "/metrics")}
    assert {(r.method, r.path) for r in ROUTES if r.kind is Kind.SLOTS} == {("GET", "/slots")}


def test_lookup_with_prefix_parameters_and_predict_route() -> None:
    t = RouteTable("/api/", predict_route="/predict")
    assert t.lookup("POST", "/api/v1/messages").kind is Kind.GENERATION  # type: ignore[union-attr]
    assert t.lookup("POST", "/v1/messages") is None, "without the prefix the server has no such route"
    assert t.lookup("POST", "/api/slots/12").kind is Kind.PRIVATE  # type: ignore[union-attr]
    assert t.lookup("POST", "/api/slots/") is None
    assert t.lookup("POST", "/api/slots/1/x").kind is Kind.PRIVATE  # type: ignore[union-attr]
    assert t.lookup("POST", "/api/predict").kind is Kind.GENERATION  # type: ignore[union-attr]
    assert t.lookup("GET", "/api/index.html") is None and not t.is_api_path("/api/index.html")
    assert t.is_api_path("/api/v1/stream")


def test_predict_route_as_the_server_reads_it() -> None:
    assert predict_route_from_env({}) is None
    assert predict_route_from_env({"AIP_MODE": "PREDICTION"}) == "/predict"
    assert predict_route_from_env({"AIP_MODE": "PREDICTION", "AIP_PREDICT_ROUTE": "v1/p"}) == "/v1/p"
    assert predict_route_from_env({"AIP_MODE": "other", "AIP_PREDICT_ROUTE": "/p"}) is None


def test_head_is_get_and_every_path_below_slots_is_the_slot_route() -> None:
    t = RouteTable()
    assert t.lookup("HEAD", "/kv").kind is Kind.PRIVATE  # type: ignore[union-attr]
    assert t.lookup("HEAD", "/metrics").kind is Kind.PRIVATE  # type: ignore[union-attr]
    for path in ("/slots/0", "/slots/0/", "/slots/0/x", "/slots/%30"):
        assert t.lookup("POST", path).kind is Kind.PRIVATE, path  # type: ignore[union-attr]


def test_predict_targets_by_path_or_alias_whatever_the_method() -> None:
    t = RouteTable()
    assert {r.kind for r in t.predict_targets("chatCompletions")} == {Kind.GENERATION}
    assert {r.kind for r in t.predict_targets("/v1/messages")} == {Kind.GENERATION}
    assert {r.kind for r in t.predict_targets("kv")} == {Kind.PRIVATE}
    assert {r.kind for r in t.predict_targets("/slots/:id_slot")} == {Kind.PRIVATE}
    assert Kind.CONVERSATION in {r.kind for r in t.predict_targets("stream")}
    assert Kind.CONTROL in {r.kind for r in t.predict_targets("chatCompletionsControl")}
    assert t.predict_targets("nothing") == []
