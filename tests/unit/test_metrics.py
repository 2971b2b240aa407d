"""Labelled metrics whose label values are known start at 0 (Prometheus's instrumentation guide: "avoid missing
metrics"), so a dashboard shows 0 rather than "no data" and increase() sees the first event."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from controller.metrics import PARK_MODES, PARK_REASONS, PARK_TIERS, RESUME_REASONS, Metrics
from controller.policy.types import Reason
from controller.priorities import PRIORITY_CLASSES, priority_class
from controller.upstream.models import ParkMode, ParkTier


def series(registry: CollectorRegistry) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_the_label_values_are_the_enums() -> None:
    resume_only = {Reason.BELOW_LOW, Reason.NOTHING_RESIDENT, Reason.STARVATION}
    assert set(PARK_REASONS) == {str(r) for r in Reason} - {str(r) for r in resume_only} - {"cannot_fit"}
    assert set(RESUME_REASONS) == {str(r) for r in resume_only} | {"manual"}
    assert set(PARK_MODES) == {str(m) for m in ParkMode}
    assert set(PARK_TIERS) == {str(t) for t in ParkTier}
    assert {priority_class(p, 1, -1) for p in (5, 0, -5)} == set(PRIORITY_CLASSES)


def test_parks_resumes_and_waits_by_class_start_at_zero_before_any_park() -> None:
    registry = CollectorRegistry()
    Metrics(registry)
    got = series(registry)
    parks = {(lb["reason"], lb["mode"], lb["tier"], lb["priority_class"]): v for lb, v in got["kvctl_parks_total"]}
    # a swap goes to RAM or disk, a recompute to no tier
    assert len(parks) == len(PARK_REASONS) * len(PARK_TIERS) * len(PRIORITY_CLASSES)
    assert {(m, t) for _, m, t, _ in parks} == {("swap", "ram"), ("swap", "disk"), ("recompute", "none")}
    assert {m for _, m, _, _ in parks} == set(PARK_MODES)
    assert set(parks.values()) == {0.0}
    assert {lb["reason"] for lb, _ in got["kvctl_resumes_total"]} == set(RESUME_REASONS)
    waits = {lb["priority_class"] for lb, v in got["kvctl_restore_wait_seconds_count"] if v == 0}
    assert waits == set(PRIORITY_CLASSES)
