"""Generate deploy/grafana/kvctl-dashboard.json: edit the panels here, then re-run.

    python deploy/grafana/gen_dashboard.py            # rewrite the JSON
    python deploy/grafana/gen_dashboard.py --check    # exit 1 if the JSON is not what this file gives

tests/unit/test_deploy.py runs --check and fails when a panel queries a metric that neither kvctl
(controller/) nor the patched llama-server exports.

Conventions (vLLM's generated dashboards): a stable uid, the data source as a template variable
(`${datasource}`, a `datasource` variable, not an `__inputs` placeholder, so the file works
both with file provisioning and with the UI's import), counters through `rate()` over
`$__rate_interval`, ratios guarded against an empty denominator, every panel's description ending
with the metrics it reads. The `replica` label joins kvctl's and the server's series of one
machine or pod (deploy/prometheus/prometheus.yml sets it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from a source tree
    sys.path.insert(0, str(ROOT))

from controller.settings import PolicySettings  # noqa: E402

OUT = Path(__file__).with_name("kvctl-dashboard.json")
UID = "kvctl-overview"
DS = {"type": "prometheus", "uid": "${datasource}"}
R = 'replica=~"$replica"'  # every selector carries it
RI = "$__rate_interval"

Panel = dict[str, Any]


def _default(name: str) -> Any:
    return PolicySettings.model_fields[name].default


class Layout:
    """Places panels left to right on Grafana's 24-column grid, rows top to bottom."""

    def __init__(self) -> None:
        self.panels: list[Panel] = []
        self.x = 0
        self.y = 0
        self.row_h = 0
        self.next_id = 1

    def row(self, title: str) -> None:
        self._newline()
        self.panels.append(
            {
                "type": "row",
                "id": self._id(),
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1

    def add(self, panel: Panel, w: int = 8, h: int = 8) -> None:
        if self.x + w > 24:
            self._newline()
        panel["id"] = self._id()
        panel["gridPos"] = {"h": h, "w": w, "x": self.x, "y": self.y}
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def _newline(self) -> None:
        if self.x:
            self.y += self.row_h
        self.x = 0
        self.row_h = 0

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def target(expr: str, legend: str, ref: str) -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True, "instant": False}


def timeseries(
    title: str,
    description: str,
    metrics: list[str],
    targets: list[tuple[str, str]],
    unit: str = "short",
    *,
    minimum: float | None = 0,
    maximum: float | None = None,
    thresholds: list[tuple[str, float | None]] | None = None,
    overrides: list[dict[str, Any]] | None = None,
    stack: bool = False,
) -> Panel:
    steps = [{"color": c, "value": v} for c, v in (thresholds or [("green", None)])]
    defaults: dict[str, Any] = {
        "unit": unit,
        "color": {"mode": "palette-classic"},
        "custom": {
            "drawStyle": "line",
            "lineWidth": 1,
            "fillOpacity": 10 if stack else 0,
            "showPoints": "never",
            "spanNulls": False,
            "stacking": {"mode": "normal" if stack else "none", "group": "A"},
            "thresholdsStyle": {"mode": "off"},
        },
        "thresholds": {"mode": "absolute", "steps": steps},
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "timeseries",
        "title": title,
        "description": _describe(description, metrics),
        "datasource": DS,
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [target(e, lg, chr(ord("A") + i)) for i, (e, lg) in enumerate(targets)],
    }


def stat(
    title: str,
    description: str,
    metrics: list[str],
    expr: str,
    legend: str,
    unit: str = "short",
    *,
    mappings: list[dict[str, Any]] | None = None,
    thresholds: list[tuple[str, float | None]] | None = None,
    text_mode: str = "value",
) -> Panel:
    steps = [{"color": c, "value": v} for c, v in (thresholds or [("green", None)])]
    return {
        "type": "stat",
        "title": title,
        "description": _describe(description, metrics),
        "datasource": DS,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "mappings": mappings or [],
                "thresholds": {"mode": "absolute", "steps": steps},
                "color": {"mode": "thresholds"},
            },
            "overrides": [],
        },
        "options": {
            "colorMode": "background",
            "graphMode": "none",
            "justifyMode": "auto",
            "orientation": "auto",
            "textMode": text_mode,
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        },
        "targets": [target(expr, legend, "A")],
    }


def _describe(text: str, metrics: list[str]) -> str:
    names = ", ".join(f"`{m}`" for m in metrics)
    return f"{text} Metric{'s' if len(metrics) > 1 else ''}: {names}"


def dashed(legend_regex: str, color: str) -> dict[str, Any]:
    """An override that draws the matching series as a dashed reference line."""
    return {
        "matcher": {"id": "byRegexp", "options": legend_regex},
        "properties": [
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
            {"id": "color", "value": {"mode": "fixed", "fixedColor": color}},
        ],
    }


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    group = f"le, replica{', ' + by if by else ''}"
    legend_by = f" {{{{{by}}}}}" if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{R}}}[{RI}])))",
            f"{{{{replica}}}}{legend_by} p{int(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    ]


def panels() -> list[Panel]:
    L = Layout()

    L.row("KV pool")
    L.add(
        timeseries(
            "KV pool occupancy vs HIGH and LOW",
            "Used cells over the pool as the server reports it, and kvctl's projected occupancy (used "
            "cells plus the next step's) per pool; kvctl parks at or above HIGH and restores while the "
            "projection stays at or below LOW. Crossing HIGH now and then is normal operation; staying "
            "above it is not. The HIGH and LOW lines come from the dashboard variables of the same name: "
            "set them to KVCTL_POLICY__HIGH and KVCTL_POLICY__LOW.",
            ["llamacpp:kv_cache_usage_ratio", "kvctl_kv_projected_ratio", "kvctl_kv_pressure_ratio"],
            [
                (f"llamacpp:kv_cache_usage_ratio{{{R}}}", "{{replica}} used (server)"),
                (f"kvctl_kv_projected_ratio{{{R}}}", "{{replica}} projected {{pool}}"),
                (f"kvctl_kv_pressure_ratio{{{R}}}", "{{replica}} pressure"),
                ("vector($high)", "HIGH"),
                ("vector($low)", "LOW"),
            ],
            "percentunit",
            maximum=1,
            thresholds=[("green", None), ("orange", 0.9), ("red", 0.98)],
            overrides=[dashed("^HIGH$", "red"), dashed("^LOW$", "green")],
        ),
        w=16,
        h=9,
    )
    L.add(
        timeseries(
            "KV cells",
            "Cells in use against the pool's size (absent when the server cannot count them).",
            ["llamacpp:kv_cells_used", "llamacpp:kv_cells"],
            [
                (f"llamacpp:kv_cells_used{{{R}}}", "{{replica}} used"),
                (f"llamacpp:kv_cells{{{R}}}", "{{replica}} total"),
            ],
            overrides=[dashed("total$", "blue")],
        ),
        w=8,
        h=9,
    )

    L.row("Parking")
    L.add(
        timeseries(
            "Parked requests",
            "Requests whose KV cells wait in host RAM: as kvctl counts them, those parked by hand "
            "(pinned, left alone by the policy), and as the server counts them (including its own "
            "safety-net parks).",
            ["kvctl_parked_requests", "kvctl_pinned_requests", "llamacpp:slots_parked"],
            [
                (f"kvctl_parked_requests{{{R}}}", "{{replica}} parked (kvctl)"),
                (f"kvctl_pinned_requests{{{R}}}", "{{replica}} pinned"),
                (f"llamacpp:slots_parked{{{R}}}", "{{replica}} parked (server)"),
            ],
        )
    )
    L.add(
        timeseries(
            "Parked bytes vs budget",
            "Host RAM held by parked snapshots against the park budget (the dashboard variable "
            "budget_mib: the smaller of KVCTL_POLICY__SNAPSHOT_BUDGET_MIB and the server's --park-ram).",
            ["kvctl_parked_bytes", "llamacpp:parked_bytes"],
            [
                (f"kvctl_parked_bytes{{{R}}}", "{{replica}} parked (kvctl)"),
                (f"llamacpp:parked_bytes{{{R}}}", "{{replica}} parked (server)"),
                ("vector($budget_mib * 1048576)", "budget"),
            ],
            "bytes",
            overrides=[dashed("^budget$", "red")],
        )
    )
    L.add(
        timeseries(
            "Parked on disk",
            "Snapshot files on the server's disk tier (--park-disk) against its budget (--park-disk-mib), and "
            "snapshots the server could not write or read back whole since it started (their requests were "
            "recomputed: a disk that fails or fills up), and those it moved from RAM to disk to give their RAM to "
            "a newer park of a higher priority (spills).",
            [
                "kvctl_park_disk_used_bytes",
                "kvctl_park_disk_budget_bytes",
                "kvctl_park_disk_fallbacks",
                "kvctl_park_disk_spills",
            ],
            [
                (f"kvctl_park_disk_used_bytes{{{R}}}", "{{replica}} on disk"),
                (f"kvctl_park_disk_budget_bytes{{{R}}}", "{{replica}} budget"),
                (f"kvctl_park_disk_fallbacks{{{R}}} * 1048576", "{{replica}} fallbacks (x 1 MiB)"),
                (f"kvctl_park_disk_spills{{{R}}} * 1048576", "{{replica}} spills (x 1 MiB)"),
            ],
            "bytes",
            overrides=[dashed("budget$", "red")],
        )
    )
    L.add(
        timeseries(
            "Disk tier rates",
            "The disk tier's rates as the server measured them (moving averages): write, a park until its file "
            "is written back; read, a resume until its copy back is done. kvctl's policy.park_tier auto weighs "
            "them against the copy and prefill rates.",
            ["kvctl_park_disk_bytes_per_second"],
            [(f"kvctl_park_disk_bytes_per_second{{{R}}}", "{{replica}} {{direction}}")],
            "Bps",
        )
    )
    L.add(
        timeseries(
            "Longest parked wait",
            "How long the longest-parked request has waited. The policy restores the head of the "
            "line above LOW once it has waited policy.max_wait_s; a wait far beyond that means the "
            "pool cannot take it back.",
            ["kvctl_parked_longest_wait_seconds"],
            [(f"kvctl_parked_longest_wait_seconds{{{R}}}", "{{replica}}")],
            "s",
            thresholds=[("green", None), ("orange", float(_default("max_wait_s"))), ("red", 120.0)],
        )
    )
    L.add(
        timeseries(
            "Parks and resumes",
            "Parks and resumes per second: kvctl's by reason, and the server's safety-net parks (a "
            "burst that filled the pool between two polls, or no controller holding the lease).",
            ["kvctl_parks_total", "kvctl_resumes_total", "llamacpp:slot_auto_parks_total"],
            [
                (f"sum by (replica, reason) (rate(kvctl_parks_total{{{R}}}[{RI}]))", "{{replica}} park {{reason}}"),
                (
                    f"sum by (replica, reason) (rate(kvctl_resumes_total{{{R}}}[{RI}]))",
                    "{{replica}} resume {{reason}}",
                ),
                (
                    f"sum by (replica) (rate(llamacpp:slot_auto_parks_total{{{R}}}[{RI}]))",
                    "{{replica}} auto-park (server)",
                ),
            ],
            "ops",
        )
    )
    L.add(
        timeseries(
            "By priority class",
            "Parks per second by priority class (high: at or above policy.priority_high_at, low: at or below "
            "policy.priority_low_at), and the p90 of how long restored requests had waited parked and of the "
            "admission wait, by class: the low class waits, the high class should not.",
            ["kvctl_parks_total", "kvctl_restore_wait_seconds_bucket", "kvctl_proxy_admission_wait_seconds_bucket"],
            [
                (
                    f"sum by (replica, priority_class) (rate(kvctl_parks_total{{{R}}}[{RI}]))",
                    "{{replica}} parks {{priority_class}}",
                ),
                (
                    "histogram_quantile(0.9, sum by (replica, priority_class, le) "
                    f"(rate(kvctl_restore_wait_seconds_bucket{{{R}}}[{RI}])))",
                    "{{replica}} p90 parked wait {{priority_class}} (s)",
                ),
                (
                    "histogram_quantile(0.9, sum by (replica, priority_class, le) "
                    f"(rate(kvctl_proxy_admission_wait_seconds_bucket{{{R}}}[{RI}])))",
                    "{{replica}} p90 admission wait {{priority_class}} (s)",
                ),
            ],
            "short",
        )
    )
    L.add(
        timeseries(
            "Parks by mode",
            "Parks per second by swap (a copy of the cells in host RAM) and by recompute (the cells freed, "
            "evaluated again on resume: chosen when a snapshot does not fit the budget or host RAM, or costs more "
            "than re-evaluating), kvctl's and all of the server's; and the tokens evaluated again per second.",
            ["kvctl_parks_total", "llamacpp:slot_parks_total", "llamacpp:slot_recompute_parks_total"],
            [
                (f"sum by (replica, mode) (rate(kvctl_parks_total{{{R}}}[{RI}]))", "{{replica}} kvctl {{mode}}"),
                (
                    f"sum by (replica) (rate(llamacpp:slot_recompute_parks_total{{{R}}}[{RI}]))",
                    "{{replica}} server recompute",
                ),
                (
                    f"sum by (replica) (rate(llamacpp:slot_parks_total{{{R}}}[{RI}]))"
                    f" - sum by (replica) (rate(llamacpp:slot_recompute_parks_total{{{R}}}[{RI}]))",
                    "{{replica}} server swap",
                ),
                (
                    f"sum by (replica) (rate(llamacpp:recomputed_tokens_total{{{R}}}[{RI}]))",
                    "{{replica}} tokens re-evaluated",
                ),
            ],
            "ops",
        )
    )
    L.add(
        timeseries(
            "Park and resume failures",
            "Park or resume requests the server refused or failed (kvctl's view by action and HTTP "
            "status, and the server's counters), and parked requests ended because they cannot fit "
            "the pool even alone. A resume refused with 503 for lack of cells is retried; parks "
            "failing means the pool can overflow.",
            [
                "kvctl_action_failures_total",
                "kvctl_ends_total",
                "llamacpp:slot_park_failures_total",
                "llamacpp:slot_resume_failures_total",
            ],
            [
                (
                    f"sum by (replica, action, status) (rate(kvctl_action_failures_total{{{R}}}[{RI}]))",
                    "{{replica}} {{action}} {{status}}",
                ),
                (f"sum by (replica) (rate(kvctl_ends_total{{{R}}}[{RI}]))", "{{replica}} ended"),
                (
                    f"sum by (replica) (rate(llamacpp:slot_park_failures_total{{{R}}}[{RI}]))",
                    "{{replica}} park failures (server)",
                ),
                (
                    f"sum by (replica) (rate(llamacpp:slot_resume_failures_total{{{R}}}[{RI}]))",
                    "{{replica}} resume failures (server)",
                ),
            ],
            "ops",
        )
    )
    L.add(
        timeseries(
            "Park and resume latency",
            "Round trip of kvctl's park and resume requests (p50, p90, p99): the server copies the "
            "slot's cells at its next quiescent point.",
            ["kvctl_park_duration_seconds", "kvctl_resume_duration_seconds"],
            [(e, "park " + lg) for e, lg in quantiles("kvctl_park_duration_seconds")]
            + [(e, "resume " + lg) for e, lg in quantiles("kvctl_resume_duration_seconds")],
            "s",
        )
    )

    L.row("Clients and admission")
    L.add(
        timeseries(
            "Admission queue",
            "Generation requests waiting for admission while the policy holds new work back, and "
            "requests in flight through the proxy.",
            ["kvctl_proxy_queued_requests", "kvctl_proxy_inflight_requests"],
            [
                (f"kvctl_proxy_queued_requests{{{R}}}", "{{replica}} queued"),
                (f"kvctl_proxy_inflight_requests{{{R}}}", "{{replica}} in flight"),
            ],
        )
    )
    L.add(
        timeseries(
            "Admission wait",
            "Time a generation request waited for admission (p50, p90, p99).",
            ["kvctl_proxy_admission_wait_seconds"],
            quantiles("kvctl_proxy_admission_wait_seconds"),
            "s",
        )
    )
    L.add(
        timeseries(
            "Time to first token",
            "From the proxy receiving a request to its first token, as the client sees it: admission "
            "queueing and prompt processing included (p50, p90, p99).",
            ["kvctl_proxy_time_to_first_token_seconds"],
            quantiles("kvctl_proxy_time_to_first_token_seconds"),
            "s",
        )
    )
    L.add(
        timeseries(
            "Requests by status",
            "Requests through the proxy per second by HTTP status; kvctl's own 503s carry Retry-After "
            "(admission queue full or timed out, server unreachable).",
            ["kvctl_proxy_requests_total"],
            [(f"sum by (replica, status) (rate(kvctl_proxy_requests_total{{{R}}}[{RI}]))", "{{replica}} {{status}}")],
            "reqps",
        )
    )
    L.add(
        timeseries(
            "Tokens per second",
            "Generated and prompt tokens per second over all slots, and the generation speed of one "
            "request while it decodes (tokens over decoding time; parked time does not count). From "
            "the server's counters, never its averaged gauges.",
            [
                "llamacpp:tokens_predicted_total",
                "llamacpp:tokens_predicted_seconds_total",
                "llamacpp:prompt_tokens_total",
            ],
            [
                (f"sum by (replica) (rate(llamacpp:tokens_predicted_total{{{R}}}[{RI}]))", "{{replica}} generated"),
                (f"sum by (replica) (rate(llamacpp:prompt_tokens_total{{{R}}}[{RI}]))", "{{replica}} prompt"),
                (
                    f"sum by (replica) (rate(llamacpp:tokens_predicted_total{{{R}}}[{RI}])) / "
                    f"(sum by (replica) (rate(llamacpp:tokens_predicted_seconds_total{{{R}}}[{RI}])) > 0)",
                    "{{replica}} per request",
                ),
            ],
        )
    )
    L.add(
        timeseries(
            "Stream errors and disconnects",
            "Streams that failed, by stage (connect, upstream, client_stalled), and clients that hung "
            "up mid-request (their slot is freed at once).",
            ["kvctl_proxy_stream_errors_total", "kvctl_proxy_client_disconnects_total"],
            [
                (
                    f"sum by (replica, stage) (rate(kvctl_proxy_stream_errors_total{{{R}}}[{RI}]))",
                    "{{replica}} {{stage}}",
                ),
                (
                    f"sum by (replica) (rate(kvctl_proxy_client_disconnects_total{{{R}}}[{RI}]))",
                    "{{replica}} disconnects",
                ),
            ],
            "ops",
        )
    )

    L.row("Health and host")
    L.add(
        stat(
            "Upstream",
            "Whether kvctl's last poll of llama-server succeeded. While it is down kvctl answers 503 with Retry-After.",
            ["kvctl_upstream_up"],
            f"kvctl_upstream_up{{{R}}}",
            "{{replica}}",
            mappings=[
                {
                    "type": "value",
                    "options": {
                        "0": {"text": "down", "color": "red", "index": 0},
                        "1": {"text": "up", "color": "green", "index": 1},
                    },
                }
            ],
            thresholds=[("red", None), ("green", 1.0)],
            text_mode="value_and_name",
        ),
        w=6,
    )
    L.add(
        timeseries(
            "Restarts and poll errors",
            "Server restarts (supervised mode), failed polls by kind, and control-loop restarts after "
            "an unexpected exception.",
            ["kvctl_upstream_restarts_total", "kvctl_poll_errors_total", "kvctl_loop_restarts_total"],
            [
                (
                    f"sum by (replica) (increase(kvctl_upstream_restarts_total{{{R}}}[{RI}]))",
                    "{{replica}} server restarts",
                ),
                (
                    f"sum by (replica, kind) (increase(kvctl_poll_errors_total{{{R}}}[{RI}]))",
                    "{{replica}} poll errors {{kind}}",
                ),
                (
                    f"sum by (replica) (increase(kvctl_loop_restarts_total{{{R}}}[{RI}]))",
                    "{{replica}} loop restarts",
                ),
            ],
        ),
        w=6,
    )
    L.add(
        timeseries(
            "Host memory available",
            "Memory the host can hand out without swapping (MemAvailable), against what parked "
            "snapshots hold. A park needs available memory above policy.host_ram_reserve_mib.",
            ["kvctl_host_available_bytes", "kvctl_parked_bytes"],
            [
                (f"kvctl_host_available_bytes{{{R}}}", "{{replica}} available"),
                (f"kvctl_parked_bytes{{{R}}}", "{{replica}} parked"),
            ],
            "bytes",
        ),
        w=6,
    )
    L.add(
        timeseries(
            "GPU memory",
            "Memory of each device the server runs on: used, free, the server's own buffers and everything "
            "else's; empty on a CPU build. Others taking memory since the server started, with less than "
            "policy.gpu_headroom_mib free, holds restores and admissions back (docs/gpu.md).",
            [
                "kvctl_gpu_memory_used_bytes",
                "kvctl_gpu_memory_free_bytes",
                "kvctl_gpu_memory_server_bytes",
                "kvctl_gpu_memory_others_bytes",
            ],
            [
                (f"kvctl_gpu_memory_used_bytes{{{R}}}", "{{replica}} {{gpu}} used"),
                (f"kvctl_gpu_memory_free_bytes{{{R}}}", "{{replica}} {{gpu}} free"),
                (f"kvctl_gpu_memory_server_bytes{{{R}}}", "{{replica}} {{gpu}} server"),
                (f"kvctl_gpu_memory_others_bytes{{{R}}}", "{{replica}} {{gpu}} others"),
            ],
            "bytes",
        ),
        w=6,
    )
    L.add(
        stat(
            "kvctl version",
            "kvctl's version on each replica.",
            ["kvctl_build_info"],
            f"kvctl_build_info{{{R}}}",
            "{{replica}} {{version}}",
            text_mode="name",
            thresholds=[("blue", None)],
        ),
        w=6,
    )
    L.add(
        timeseries(
            "Policy decision time",
            "Time the policy takes to decide on one snapshot (p50, p90, p99); it runs on every poll.",
            ["kvctl_policy_decision_seconds"],
            quantiles("kvctl_policy_decision_seconds"),
            "s",
        ),
        w=18,
        h=8,
    )
    return L.panels


def templating() -> list[dict[str, Any]]:
    def textbox(name: str, label: str, value: str, description: str) -> dict[str, Any]:
        return {
            "type": "textbox",
            "name": name,
            "label": label,
            "description": description,
            "query": value,
            "current": {"selected": False, "text": value, "value": value},
            "options": [{"selected": True, "text": value, "value": value}],
            "hide": 0,
        }

    return [
        {
            "type": "datasource",
            "name": "datasource",
            "label": "Data source",
            "query": "prometheus",
            "regex": "",
            "current": {},
            "options": [],
            "hide": 0,
            "refresh": 1,
        },
        {
            "type": "query",
            "name": "replica",
            "label": "Replica",
            "description": "The host part of the scrape address (deploy/prometheus/prometheus.yml) or the pod.",
            "datasource": DS,
            "query": {"query": "label_values(kvctl_build_info, replica)", "refId": "replica"},
            "definition": "label_values(kvctl_build_info, replica)",
            "refresh": 2,
            "sort": 1,
            "multi": True,
            "includeAll": True,
            "allValue": ".*",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "options": [],
            "hide": 0,
        },
        textbox("high", "HIGH", f"{_default('high')}", "KVCTL_POLICY__HIGH: kvctl parks at or above it"),
        textbox("low", "LOW", f"{_default('low')}", "KVCTL_POLICY__LOW: kvctl restores while at or below it"),
        textbox(
            "budget_mib",
            "Park budget (MiB)",
            f"{_default('snapshot_budget_mib')}",
            "The smaller of KVCTL_POLICY__SNAPSHOT_BUDGET_MIB and the server's --park-ram",
        ),
    ]


def dashboard() -> dict[str, Any]:
    return {
        "id": None,
        "uid": UID,
        "title": "kvctl / Overview",
        "description": "kvctl and the patched llama-server: KV pool occupancy, parking, admission, clients, health.",
        "tags": ["kvctl", "llama.cpp"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [
            {
                "type": "dashboards",
                "tags": ["kvctl"],
                "title": "kvctl dashboards",
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            }
        ],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": templating()},
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the JSON differs from what this file gives")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python deploy/grafana/gen_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
