"""kvctl's own Prometheus collectors (``kvctl_`` names, base units), on an injected registry.

The server's ``llamacpp:*`` metrics stay on the server's ``/metrics``; these describe the controller.
"""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.priorities import PRIORITY_CLASSES

__all__ = ["Metrics", "kvctl_version"]


def kvctl_version() -> str:
    try:
        return version("kvctl")
    except PackageNotFoundError:  # running from a source tree that was not installed
        return "0+unknown"


# park and resume copy a slot's cells to or from host RAM at the next quiescent point of the server's
# loop: milliseconds on a CPU for small pools, up to a few hundred on a GPU (see the prior art)
_ACTION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_WAIT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025)


POLL_ERROR_KINDS = ("UpstreamUnavailable", "UpstreamApiError", "UpstreamProtocolError")
"""The kinds of kvctl_poll_errors_total: the client's error classes."""
ACTION_FAILURE_STATUSES = ("none", "409", "500", "503")
"""The statuses kvctl_action_failures_total starts with (none: no answer); others appear as they happen."""
PARK_REASONS = ("pressure", "make_room", "displace", "manual")
"""The reasons of kvctl_parks_total (controller.policy.types.Reason's park reasons); with every mode and priority class
they start at 0, so that dashboards show 0, not "no data", before the first park (tests/unit/test_metrics.py)."""
RESUME_REASONS = ("below_low", "nothing_resident", "starvation", "manual")
"""The reasons of kvctl_resumes_total (controller.policy.types.Reason's resume reasons)."""
PARK_MODES = ("swap", "recompute")
"""controller.upstream.models.ParkMode's values."""
PARK_TIERS = ("ram", "disk", "none")
"""ParkTier's values: where a park put the cells (a swap's RAM or disk, a recompute's none)."""


class Metrics:
    """Every collector kvctl exports; one instance per registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        self.build_info = Gauge("kvctl_build_info", "kvctl's version (always 1)", ["version", "python"], registry=r)
        self.build_info.labels(version=kvctl_version(), python=platform.python_version()).set(1)
        self.upstream_up = Gauge("kvctl_upstream_up", "1 when the last poll of the server succeeded", registry=r)
        self.upstream_restarts = Counter(
            "kvctl_upstream_restarts_total", "Restarts of the supervised server", registry=r
        )
        self.upstream_failed = Gauge(
            "kvctl_upstream_failed",
            "1 once the supervised server died before it was ready supervisor.failed_after times in a row: kvctl "
            "starts it no more and answers 503 at once",
            registry=r,
        )
        self.polls = Counter("kvctl_polls_total", "Polls of the server's GET /kv", registry=r)
        self.poll_errors = Counter("kvctl_poll_errors_total", "Polls that failed, by kind", ["kind"], registry=r)
        self.loop_restarts = Counter(
            "kvctl_loop_restarts_total", "Restarts of the control loop after an unexpected exception", registry=r
        )
        self.kv_used_ratio = Gauge(
            "kvctl_kv_used_ratio", "Used cells over pool cells, as the server reports it", ["pool"], registry=r
        )
        self.kv_projected_ratio = Gauge(
            "kvctl_kv_projected_ratio",
            "Projected occupancy: active cells plus the next step's cells, over pool cells",
            ["pool"],
            registry=r,
        )
        self.kv_pressure_ratio = Gauge(
            "kvctl_kv_pressure_ratio", "The larger projected occupancy of the target and draft pools", registry=r
        )
        self.parks = Counter(
            "kvctl_parks_total",
            "Requests parked by kvctl, by reason, mode (swap: a snapshot copied out; recompute: cells freed, "
            "evaluated again on resume), tier (where the cells went: ram, disk, none for a recompute) and priority "
            "class (high, normal, low: policy.priority_high_at/low_at)",
            ["reason", "mode", "tier", "priority_class"],
            registry=r,
        )
        self.resumes = Counter("kvctl_resumes_total", "Requests resumed by kvctl, by reason", ["reason"], registry=r)
        self.ends = Counter(
            "kvctl_ends_total", "Parked requests given up because they cannot fit the pool alone", registry=r
        )
        self.skipped = Gauge(
            "kvctl_skipped_candidates",
            "Park or resume candidates the latest decision passed over, by action and reason "
            "(host_ram: the host's available RAM less policy.host_ram_reserve_mib cannot hold the snapshot, "
            "on a server that cannot park by recompute)",
            ["action", "reason"],
            registry=r,
        )
        self.action_failures = Counter(
            "kvctl_action_failures_total",
            "Park or resume requests the server refused or failed, by action and HTTP status",
            ["action", "status"],
            registry=r,
        )
        self._start_at_zero()
        self.park_seconds = Histogram(
            "kvctl_park_duration_seconds", "Round trip of a park request", buckets=_ACTION_BUCKETS, registry=r
        )
        self.restore_wait_seconds = Histogram(
            "kvctl_restore_wait_seconds",
            "How long each request kvctl restored had waited parked, by priority class",
            ["priority_class"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        for cls in PRIORITY_CLASSES:
            self.restore_wait_seconds.labels(priority_class=cls)
        self.resume_seconds = Histogram(
            "kvctl_resume_duration_seconds", "Round trip of a resume request", buckets=_ACTION_BUCKETS, registry=r
        )
        self.parked_requests = Gauge("kvctl_parked_requests", "Requests parked on the server", registry=r)
        self.pinned_requests = Gauge(
            "kvctl_pinned_requests", "Requests parked by hand, left parked by the policy", registry=r
        )
        self.parked_bytes = Gauge("kvctl_parked_bytes", "Host RAM held by parked snapshots", registry=r)
        self._disk_tier(r)
        self._host_memory(r)
        self.longest_wait_seconds = Gauge(
            "kvctl_parked_longest_wait_seconds", "How long the longest-parked request has waited", registry=r
        )
        self.decision_seconds = Histogram(
            "kvctl_policy_decision_seconds", "Time the policy takes to decide", buckets=_DECISION_BUCKETS, registry=r
        )
        self.host_available_bytes = Gauge(
            "kvctl_host_available_bytes", "Host memory available without swapping (psutil)", registry=r
        )
        self.gpu_memory_used_bytes = Gauge(
            "kvctl_gpu_memory_used_bytes",
            "Memory in use on each device the server runs on (NVML where kvctl sees it, else the server's backend); "
            "absent on a CPU build",
            ["gpu"],
            registry=r,
        )
        self.gpu_memory_free_bytes = Gauge(
            "kvctl_gpu_memory_free_bytes", "Memory free on each device the server runs on", ["gpu"], registry=r
        )
        self.gpu_memory_server_bytes = Gauge(
            "kvctl_gpu_memory_server_bytes",
            "What the server's own buffers (weights, KV pool, compute) take on each device it runs on",
            ["gpu"],
            registry=r,
        )
        self.gpu_memory_others_bytes = Gauge(
            "kvctl_gpu_memory_others_bytes",
            "What everything else (other processes, the driver) takes on each device the server runs on",
            ["gpu"],
            registry=r,
        )

    def _host_memory(self, r: CollectorRegistry) -> None:
        """What the server takes and may take of host memory (controller.loop.host_budget)."""
        self.host_memory_bytes = Gauge(
            "kvctl_host_memory_bytes",
            "The server's host memory by part: its fixed buffers (model, context) and each growing budget at its "
            "limit (park_ram: --park-ram, cache_ram: --cache-ram, checkpoints: --ctx-checkpoints a slot at the "
            "largest checkpoint seen); an unbounded budget at what it holds",
            ["part"],
            registry=r,
        )
        self.host_memory_committed_bytes = Gauge(
            "kvctl_host_memory_committed_bytes",
            "The sum of kvctl_host_memory_bytes: what the server may take of host memory at most",
            registry=r,
        )

    def _disk_tier(self, r: CollectorRegistry) -> None:
        """The server's disk tier for parked snapshots (--park-disk), from its /kv."""
        self.park_disk_used_bytes = Gauge(
            "kvctl_park_disk_used_bytes", "Disk held by snapshot files under the server's --park-disk", registry=r
        )
        self.park_disk_budget_bytes = Gauge(
            "kvctl_park_disk_budget_bytes", "The server's --park-disk-mib in bytes (0: no disk tier)", registry=r
        )
        self.park_disk_rate = Gauge(
            "kvctl_park_disk_bytes_per_second",
            "The disk tier's rates as the server measured them: write (a park until its file is written back), read "
            "(a resume until its copy back is done); 0 until measured",
            ["direction"],
            registry=r,
        )
        self.park_disk_fallbacks = Gauge(
            "kvctl_park_disk_fallbacks",
            "Snapshot files the server could not write or read back whole since it started (their requests were "
            "recomputed): a disk that fails or fills up",
            registry=r,
        )
        self.park_disk_spills = Gauge(
            "kvctl_park_disk_spills",
            "Parked snapshots the server moved from RAM to disk since it started, to give their RAM to a newer park of "
            "a higher priority",
            registry=r,
        )

    def _start_at_zero(self) -> None:
        # the known label values start at 0, so that rate(), increase() and the alerts see the first failure
        for kind in POLL_ERROR_KINDS:
            self.poll_errors.labels(kind=kind)
        for action in ("park", "resume"):
            for status in ACTION_FAILURE_STATUSES:
                self.action_failures.labels(action=action, status=status)
        for reason in PARK_REASONS:
            for mode, tier in (("swap", "ram"), ("swap", "disk"), ("recompute", "none")):
                for cls in PRIORITY_CLASSES:
                    self.parks.labels(reason=reason, mode=mode, tier=tier, priority_class=cls)
        for reason in RESUME_REASONS:
            self.resumes.labels(reason=reason)
