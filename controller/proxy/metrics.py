"""The proxy's own collectors (``kvctl_proxy_*``), injected with their registry."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from controller.priorities import PRIORITY_CLASSES

__all__ = ["STREAM_ERROR_STAGES", "ProxyMetrics"]

# the stages kvctl_proxy_stream_errors counts (kvctl's reason codes of streams it ended)
STREAM_ERROR_STAGES = (
    "connect",
    "upstream",
    "upstream_timeout",
    "upstream_disconnected",
    "client_stalled",
    "shutting_down",
    "server_failed",
)


@dataclass
class ProxyMetrics:
    registry: CollectorRegistry
    requests: Counter = field(init=False)
    inflight: Gauge = field(init=False)
    queued: Gauge = field(init=False)
    admission_wait: Histogram = field(init=False)
    ttft: Histogram = field(init=False)
    disconnects: Counter = field(init=False)
    stream_errors: Counter = field(init=False)
    heartbeats: Counter = field(init=False)
    auth_failures: Counter = field(init=False)
    replays: Counter = field(init=False)
    moves: Counter = field(init=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("kvctl_proxy_requests", "Requests by route and status", ["route", "status"], registry=r)
        self.inflight = Gauge("kvctl_proxy_inflight_requests", "Requests in flight", registry=r)
        self.queued = Gauge("kvctl_proxy_queued_requests", "Requests waiting for admission", registry=r)
        self.admission_wait = Histogram(
            "kvctl_proxy_admission_wait_seconds",
            "Time waiting for admission, by priority class (high, normal, low: policy.priority_high_at, low_at)",
            ["priority_class"],
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
        )
        for cls in PRIORITY_CLASSES:
            self.admission_wait.labels(priority_class=cls)
        self.ttft = Histogram(
            "kvctl_proxy_time_to_first_token_seconds",
            "Time to first token as the client sees it",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
        )
        self.disconnects = Counter("kvctl_proxy_client_disconnects", "Clients that hung up mid-request", registry=r)
        self.stream_errors = Counter("kvctl_proxy_stream_errors", "Stream errors by stage", ["stage"], registry=r)
        # every stage a series from the start: rate() and increase() miss the first error of a series born at 1
        for stage in STREAM_ERROR_STAGES:
            self.stream_errors.labels(stage=stage)
        self.heartbeats = Counter("kvctl_proxy_heartbeats", "Heartbeat comments sent", registry=r)
        self.auth_failures = Counter(
            "kvctl_proxy_auth_failures", "Requests refused for their credentials (401)", registry=r
        )
        self.replays = Counter(
            "kvctl_proxy_replays",
            "Streams whose server died, by outcome: continued in the restarted server (sent), or ended with an error "
            "event (gave_up: past proxy.replay_limit or replay_timeout_s; refused: the server refused the "
            "continuation)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("sent", "gave_up", "refused"):
            self.replays.labels(outcome=outcome)
        self.moves = Counter(
            "kvctl_proxy_drain_moves",
            "Requests a drain handled, by outcome: sent to a peer (moved), refused by one peer (refused: the next is "
            "tried), or left to finish here (stayed: not movable, or no peer took it)",
            ["outcome"],
            registry=r,
        )
        for outcome in ("moved", "refused", "stayed"):
            self.moves.labels(outcome=outcome)

    def count(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()
