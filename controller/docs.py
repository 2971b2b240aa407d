"""The README's generated tables: ``python -m controller.docs`` prints the settings and metrics
tables of "The controller (kvctl)"; a unit test checks that the README holds the current ones."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from controller.metrics import Metrics
from controller.settings import markdown_table

__all__ = ["metrics_table", "settings_table"]


def settings_table() -> str:
    return markdown_table()


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
    parser.add_argument("table", choices=["settings", "metrics"], nargs="?", help="one table only")
    args = parser.parse_args(argv)
    if args.table in (None, "settings"):
        print(settings_table())
    if args.table is None:
        print()
    if args.table in (None, "metrics"):
        print(metrics_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
