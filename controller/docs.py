"""The generated tables: ``python -m controller.docs`` prints the settings and metrics tables of docs/operations.md,
``python -m controller.docs routes`` the route table of docs/proxy.md; unit tests check that the documents hold the
current ones."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from controller.metrics import Metrics
from controller.proxy.routes import ROUTES, Kind
from controller.settings import markdown_table

__all__ = ["metrics_table", "routes_table", "settings_table"]

WHAT_KIND_MEANS = {
    Kind.GENERATION: (
        "admission by priority, kvctl's `X-Request-Id` and the effective `X-Priority`, heartbeats while queued or "
        "parked, errors in the route's framing"
    ),
    Kind.PRIVATE: "refused (403, naming kvctl's admin port) unless `proxy.expose_private_routes`; `GET /metrics` is "
    "kvctl's own endpoint gauges (docs/scaling.md), never the server's",
    Kind.PUBLIC: "no credentials needed (as on the server)",
    Kind.CONVERSATION: "relayed byte for byte; with several kvctl keys, only the key that started the conversation",
    Kind.CONTROL: "relayed; with several kvctl keys, only the key that started the completion",
    Kind.SLOTS: "relayed under the server's own authentication, each slot's `request_id` the client's own; with "
    "several kvctl keys, only the slots serving that key's requests (all of them for an `operator` key)",
    Kind.RELAY: "relayed as it is, streamed, encodings untouched",
}


def settings_table() -> str:
    return markdown_table()


def routes_table() -> str:
    """docs/proxy.md's route table, from the proxy's own classification (controller/proxy/routes.py)."""
    rows = ["| kind | routes | what kvctl does |", "|---|---|---|"]
    for kind in Kind:
        routes = ", ".join(f"`{r.method} {r.path}`" for r in ROUTES if r.kind is kind)
        rows.append(f"| {kind.value} | {routes} | {WHAT_KIND_MEANS[kind]} |")
    return "\n".join(rows)


def metrics_table() -> str:
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    metrics = Metrics(CollectorRegistry())
    for collector in vars(metrics).values():
        if not isinstance(collector, MetricWrapperBase):
            continue
        for family in collector.describe():
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = ", ".join(f"`{label}`" for label in getattr(collector, "_labelnames", ())) or ""
            rows.append(f"| `{name}` | {family.type} | {labels} | {family.documentation} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controller.docs", description=__doc__)
    parser.add_argument("table", choices=["settings", "metrics", "routes"], nargs="?", help="one table only")
    args = parser.parse_args(argv)
    if args.table in (None, "settings"):
        print(settings_table())
    if args.table is None:
        print()
    if args.table in (None, "metrics"):
        print(metrics_table())
    if args.table == "routes":
        print(routes_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
