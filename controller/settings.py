"""kvctl's settings: nested groups, each field documented with its unit and why its default.

Sources, highest first: command-line flags, ``KVCTL_*`` environment variables (nested with ``__``,
e.g. ``KVCTL_POLICY__HIGH=0.9``), an optional TOML file (``--config``; tables named after the
groups), then the defaults below. An invalid value stops start-up with one line naming the setting.

``python -m controller.settings --markdown`` prints the settings table of docs/operations.md.
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
import tomllib
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    HttpUrl,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource

from controller.keeper_conns import POISON_WINDOW_S
from controller.keys import ApiKey, KeyFileError, KeyRing, parse_key_entry, read_key_file
from controller.priorities import INT32_MAX, INT32_MIN

__all__ = [
    "AdminSettings",
    "HostPort",
    "LogSettings",
    "LoopSettings",
    "PolicySettings",
    "ProxySettings",
    "RestoreOrder",
    "Settings",
    "SettingsError",
    "SupervisorSettings",
    "UpstreamSettings",
    "load_settings",
    "markdown_table",
    "split_host_port",
]

ENV_PREFIX = "KVCTL_"
MiB = 1024 * 1024


class SettingsError(Exception):
    """An invalid setting; ``str()`` is one line that names it."""


def split_host_port(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) into its parts; ValueError when malformed."""
    host, sep, port_s = value.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_s)
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0..65535, got {port}")
    return host, port


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_host_port(value: str) -> str:
    split_host_port(value)
    return value


HostPort = Annotated[str, AfterValidator(_check_host_port)]
"""``HOST:PORT``; port 0 picks a free port (tests)."""


class _Group(BaseModel):
    # attribute docstrings become field descriptions: the settings table (docs/operations.md) is generated from them
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class UpstreamSettings(_Group):
    """The patched llama-server kvctl drives."""

    url: HttpUrl = HttpUrl("http://127.0.0.1:8081")
    """Base URL of the patched llama-server. Port 8081 leaves 8080, llama-server's own default, to kvctl's proxy."""

    api_key: SecretStr | None = None
    """Bearer token for a server started with `--api-key`; sent on every request and never logged."""

    timeout_s: float = Field(default=2.0, gt=0)
    """Seconds a request to the server may take when nothing says it needs longer: connecting, `/health`, `/props`, and
    a poll until the server has measured its prompt rate. Polls then wait for the longest batch the server may run
    (`poll_timeout_max_s`), and parks and resumes for their copy (`action_timeout_min_s`)."""

    poll_timeout_max_s: float = Field(default=30.0, gt=0)
    """The longest a poll of `GET /kv` may take. The server answers between two batches, so kvctl waits `timeout_s` plus
    twice the longest batch it may run (the next step's cells at its measured prompt rate), up to this; only polls
    that get no answer in that time count the server as down."""

    action_timeout_min_s: float = Field(default=10.0, gt=0)
    """The shortest time a park or resume may take. A park is answered once its snapshot is copied, so kvctl waits
    `timeout_s` plus four times the snapshot's copy at the server's measured rate (1 GB/s until measured), within
    this floor and `action_timeout_max_s`. A park or resume that times out does not count the server as down: the
    next poll shows whether it completed."""

    action_timeout_max_s: float = Field(default=300.0, gt=0)
    """The longest time a park or resume may take (see `action_timeout_min_s`)."""

    lease_s: float = Field(default=10.0, gt=0)
    """The server's `--park-lease` in seconds (its default: 10). Every request renews the lease; the back-off and the
    request timeout are checked against it, so that a struggling controller does not let the lease lapse."""


class ApiKeyEntry(_Group):
    """One of kvctl's API keys in table form."""

    key: SecretStr
    """The key clients send (`Authorization: Bearer KEY` or `X-Api-Key: KEY`)."""

    name: str | None = None
    """What logs and metrics show for requests with this key."""

    priority: int | None = None
    """The priority of this key's requests when they ask for none (higher = more important); at most `max_priority`."""

    max_priority: int | None = None
    """The highest priority this key's requests may have: what they ask for (the body's `priority`, `X-Priority`, the
    objective header) is capped to it."""

    operator: bool = False
    """With several keys: this key sees every slot in the client port's `GET /slots`; a tenant's key (the default)
    sees only the slots serving its own requests."""


class MetricsCompat(StrEnum):
    NONE = "none"
    VLLM = "vllm"


class ProxySettings(_Group):
    """The client-facing reverse proxy: streams that survive parking, admission that protects running chats."""

    listen: HostPort = "127.0.0.1:8080"
    """Where clients connect. 8080 is llama-server's own default, so clients need no change when kvctl fronts it."""

    heartbeat_s: float = Field(default=5.0, gt=0)
    """Longest silence on a stream before the proxy sends an SSE comment. Node's HTTP client gives up after 300 s
    and some frontends after 120 s; 5 s also keeps idle-killing reverse proxies in between quiet."""

    queue_depth: int = Field(default=256, ge=0)
    """Requests that may wait for admission at once; the next one gets 503 with Retry-After."""

    queue_timeout_s: float = Field(default=300.0, gt=0)
    """Seconds a request may wait for admission before it gets 503 (or an error event if it already streams)."""

    queue_grace_s: float = Field(default=2.0, ge=0)
    """A streaming request queued longer than this gets its SSE headers and heartbeats, so its client waits."""

    write_timeout_s: float = Field(default=60.0, gt=0)
    """A client that accepts no bytes for this long is cut off, so a stalled reader cannot hold a slot."""

    max_body_bytes: int = Field(default=100 * MiB, gt=0)
    """Largest request body; a larger one gets 413. The default is the server's own limit (cpp-httplib's 100 MiB),
    so kvctl refuses nothing the server would take."""

    api_keys: list[SecretStr | ApiKeyEntry] = Field(default_factory=list)
    """kvctl's own API keys: each a key string or a table `{key, name, priority, max_priority}` (`name` is what logs
    and metrics show, by default `api_keys[N]`; `priority` is the default priority of its requests, `max_priority`
    caps what they ask for: docs/proxy.md, Priorities). Set: every request but `/health`, `/v1/health` and `OPTIONS`
    needs one, checked as llama-server checks its `--api-key`, and the server's own key (`upstream.api_key`) goes in
    its place on the relayed request. Unset: a server with `upstream.api_key` checks the client's own credentials
    before the request can queue."""

    api_keys_file: Path | None = None
    """More keys, one a line: `key [name]` (like llama-server's `--api-key-file`) or the table form as inline JSON;
    blank lines and `#` comments are skipped. Read once at start."""

    upstream_read_timeout_s: float = Field(default=60.0, gt=0)
    """Once the server's response has started, a stream that receives no byte for this long ends with its
    protocol's error event. Must exceed the server's `--sse-ping-interval` (a spawned server gets a third of this).
    A spawned server whose main loop has not answered kvctl's poll of `/kv` for this long is killed and restarted,
    and the requests it had not answered are sent again to the new one (where replay is on for them); an attached
    server's unanswered requests wait `replay_timeout_s` longer for it, then end with 503 `upstream_timeout`."""

    drain_s: float = Field(default=15.0, ge=0)
    """On SIGTERM: seconds open requests get to finish (new ones get 503) before the rest end with an error event and
    a spawned server is stopped. systemd's `TimeoutStopSec` and Kubernetes' `terminationGracePeriodSeconds` must
    cover this plus `supervisor.stop_timeout_s`."""

    drain_peers: list[HttpUrl] = Field(default_factory=list)
    """Other kvctl listeners serving the same model (`http://host:port`, or a Service's URL): `POST /drain`,
    `kvctl drain` and, when set, SIGTERM move this replica's queued, running and parked requests there before its
    server stops (docs/operations.md, Draining a replica to its peers). `kvctl run --drain-peer URL` adds one."""

    peer_api_key: SecretStr | None = None
    """The key replicas send each other in `X-Kvctl-Peer` when a drain moves a request: it stands for the client's
    credentials, which the draining replica checked. Set the same on every replica; a request with a wrong one gets
    403, and a replica without one takes no moved requests. A peer's request gets the priority the draining replica
    gave it."""

    handover_dir: Path | None = None
    """Replicas on one machine: the directory their servers write slot files to (each server's
    `--slot-save-path`). Set, a drain hands a running or parked stream's KV cells to the peer through a file there,
    so the peer evaluates only the tokens past them instead of the whole context again (docs/operations.md,
    Draining a replica to its peers); unset, or where that fails, the peer evaluates them again."""

    keeper: bool = True
    """Run the proxy under the keeper (`controller/keeper.py`): a small process of the standard library alone that holds
    the listener and every client connection while the rest of kvctl crashes, is upgraded or reloads its settings
    (`kvctl reload`, SIGHUP), so that no client sees kvctl restart. Off without it: kvctl's own restart ends its
    clients' connections. Never with `tls_cert_file` (a TLS session cannot move between processes): terminate TLS
    in nginx or Caddy in front instead."""

    tls_cert_file: Path | None = None
    """PEM certificate chain for TLS on the public listener; plain HTTP when unset. The keeper is off with it: kvctl's
    own restart then ends its clients' connections."""

    tls_key_file: Path | None = None
    """PEM private key for `tls_cert_file` (unset: the key is in the certificate file)."""

    admission_reserve_cells: int = Field(default=512, ge=0)
    """The least a new request is assumed to need when admission checks the pool against HIGH: its prompt's
    estimate (exact for token ids, one token per 3 bytes of text) when larger, since it is not tokenized yet."""

    expose_private_routes: bool = False
    """Pass `GET /kv` and the slot actions (`POST /slots/N?action=...`) through the public listener. Off (the
    default): they are refused with 403 naming the admin port, since a park or an erase behind the controller's back
    would corrupt its picture of the pool. `GET /slots` is relayed either way, under the server's own authentication
    (with several keys, each sees only its own requests' slots). The server's `/metrics` is never relayed."""

    client_priority: bool = True
    """Without `api_keys`: whether clients may set their requests' priority (the body's `priority`, `X-Priority`,
    llm-d's objective header). Off: every request gets 0. With keys, each key's `max_priority` caps what its clients
    may ask for, and its `priority` is their default."""

    objective_priorities: dict[str, Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]] = Field(default_factory=dict)
    """llm-d's objective header (`x-llm-d-inference-objective`, the InferenceObjective's name) to a priority, e.g.
    `{"interactive": 10, "batch": -10}`; an objective not listed sets none."""

    metrics_compat: MetricsCompat = MetricsCompat.NONE
    """`GET /metrics` on the public listener serves the endpoint gauges (queued and running requests, KV usage, the
    pool's block layout) under kvctl's names (`kvctl_endpoint_*`); `vllm` also under vLLM's names
    (`vllm:num_requests_waiting`, ...), so that an inference gateway's endpoint picker in its stock configuration
    routes by them (docs/scaling.md)."""

    def api_key_list(self) -> list[ApiKey]:
        """`api_keys` and the entries of `api_keys_file`, parsed; KeyFileError names a bad entry (never its key)."""
        out = []
        for i, entry in enumerate(self.api_keys):
            where = f"api_keys[{i}]"
            if isinstance(entry, SecretStr):
                out.append(parse_key_entry(entry.get_secret_value(), where))
            else:
                table = {"key": entry.key.get_secret_value(), "name": entry.name or where}
                extra = {"priority": entry.priority, "max_priority": entry.max_priority, "operator": entry.operator}
                out.append(parse_key_entry({**table, **extra}, where))
        if self.api_keys_file is not None:
            out.extend(read_key_file(self.api_keys_file))
        KeyRing(out)  # names unique
        return out

    retry_after_s: int = Field(default=2, ge=1)
    """The Retry-After value of the proxy's 503 answers."""

    replay_limit: int = Field(default=3, ge=0)
    """When the server dies mid-stream (a crash, an OOM kill), how many times a streaming generation is continued
    in the restarted server from the tokens its client has (the server's `continuation_tokens`); 0 turns replay
    off. A client can opt out with `X-Kvctl-Replay: off`. Not replayed: conversation streams (the WebUI's), which
    end with the error event as before. Requests the server had not answered are sent again from the start."""

    replay_timeout_s: float = Field(default=120.0, gt=0)
    """How long a request waits for a server that is coming back (kvctl restarting the server it spawned, the server
    loading its model, an attached server that answered before and stopped answering): an interrupted stream before
    its continuation is sent, a new request in the admission queue (with heartbeats once streaming), any other
    request before it is relayed. Past it the client gets 503 `server_restarting` (an error event once streaming);
    an interrupted stream also ends past `replay_limit`. `queue_timeout_s` still bounds the whole wait."""

    replay_memory_mib: int = Field(default=64, ge=0)
    """Memory for what replay keeps, all streams together: each request's body and the ids of the tokens its
    client has received (4 bytes each). A stream that does not fit is not replayable (logged
    `replay.not_replayable`)."""


class AdminSettings(_Group):
    """The admin listener: status, metrics, probes and manual park/resume."""

    listen: HostPort = "127.0.0.1:8091"
    """Where the admin API listens. Loopback by default: it can park and resume requests."""

    token: SecretStr | None = None
    """Bearer token required by every admin route but `/healthz` and `/readyz`; mandatory when `listen` is not a
    loopback address."""

    unready_after_s: float = Field(default=2.0, ge=0)
    """Seconds the pool must stay saturated (parked requests waiting to be restored while the pressure is above LOW)
    before `/readyz` turns 503. A brief overflow is parked and restored within a poll or two; a load balancer should
    not see it."""

    ready_after_s: float = Field(default=5.0, ge=0)
    """Seconds the pool must stay relieved (at or below LOW, or nobody waiting) before `/readyz` turns 200 again;
    longer than `unready_after_s` so readiness does not flap."""

    degraded_after_s: float = Field(default=30.0, ge=0)
    """Seconds the projected occupancy must stay at or above HIGH before `/status` reports degraded and `kvctl
    status` exits 1. Crossing HIGH is normal: the next poll parks and the pool is back under HIGH within a second or
    two. Staying above it for 30 s means parks fail or are not allowed (budget, host RAM, one request alone), well
    before the 5-minute pressure alert pages."""


class RestoreOrder(StrEnum):
    """Which parked request is restored first."""

    AGING = "aging"
    """The seed's order with aging: requests parked for half of `max_wait_s` or longer go first; within each group,
    most-parked first, then longest-waiting; a request that does not fit is passed over."""
    FIFO = "fifo"
    """Head-of-line by park time: a later request never overtakes the one parked longest, so every wait is bounded."""
    SEED = "seed"
    """The seed PR's order: most-parked first, then longest-waiting; a request that does not fit is passed over."""


class ParkTierChoice(StrEnum):
    """Where kvctl parks a victim's cells (`policy.park_tier`)."""

    AUTO = "auto"
    """Per victim, what resumes soonest at the rates the server measured: a snapshot in host RAM while the budget and
    the headroom hold it, else a file on the server's disk tier (`--park-disk`), else a recompute; a recompute also
    where evaluating the tokens again is faster (a short request)."""
    RAM = "ram"
    """Host RAM, else recompute: never the disk tier."""
    DISK = "disk"
    """The disk tier, else recompute: never host RAM (for an operator who keeps RAM for the prompt cache)."""
    RECOMPUTE = "recompute"
    """Always recompute: no snapshots anywhere."""


class PolicySettings(_Group):
    """The watermark policy (docs/controller.md)."""

    high: float = Field(default=0.94, gt=0, lt=1)
    """Park at or above this projected occupancy (ratio of the pool). The 6 % above it (491 cells of 8192) must hold
    one poll's worst-case growth: every generating slot's next token and drafts per decode step times the steps in
    one poll, plus a prefill chunk; the server's safety net covers what a poll misses."""

    low: float = Field(default=0.80, gt=0, lt=1)
    """Restore while the projected occupancy after restoring stays at or below this ratio. The gap to HIGH is the
    hysteresis that keeps a restored request from being parked again at once."""

    snapshot_budget_mib: int = Field(default=8192, ge=0)
    """Host RAM in MiB that parked snapshots may hold (the smaller of this and the server's `--park-ram` applies);
    the seed's 8192 MiB. A victim whose snapshot does not fit what is left is parked by recompute instead (its cells
    freed and evaluated again on resume). 0: park by recompute only, no snapshots in host RAM (with an older server
    that cannot recompute, 0 stops kvctl from parking)."""

    host_ram_reserve_mib: int = Field(default=1024, ge=0)
    """Host RAM in MiB never used for snapshots: a swap park needs the host's available memory (the smaller of what
    kvctl and the server see) minus this reserve, so a park cannot push the host into swapping or the OOM killer; a
    victim whose snapshot does not fit is parked by recompute instead (with an older server, not at all)."""

    park_tier: ParkTierChoice = ParkTierChoice.AUTO
    """Where a victim's cells go: `auto` (default) chooses per victim between host RAM, the server's disk tier
    (`--park-disk`) and recompute by which resumes soonest at the rates the server measured (copy, disk and prefill),
    so a short request recomputes and a long one goes to RAM or disk, and RAM short for a victim goes to it if the
    server can move parked snapshots of a lower priority to disk first; `ram`, `disk` or `recompute` pin it, each
    falling back to recompute when it cannot hold the snapshot. Without a disk tier on the server, `disk` parks by
    recompute."""

    restore_margin_cells: int = Field(default=16, ge=0)
    """Cells added to a restored request's own cells and next-step cells when checking LOW: a few decode steps of
    growth before the next poll sees it."""

    restore_order: RestoreOrder = RestoreOrder.AGING
    """`aging` (default): the seed's order (most-parked, then longest-waiting), except that a request parked for half
    of `max_wait_s` goes ahead of those parked more recently. `seed`: the seed's order alone. `fifo`: head-of-line by
    park time; a later request never overtakes the one parked longest."""

    max_wait_s: float = Field(default=30.0, gt=0)
    """Seconds the head of the restore order may wait before it is restored above LOW (up to HIGH, parking newer
    requests to make room if needed). Long enough that rotation costs little, short enough that no chat stalls
    noticeably longer than a slow tool call."""

    gpu_headroom_mib: int = Field(default=256, ge=0)
    """On a GPU the server runs on: when other processes have taken memory since the server started and left less
    than this free (MiB), restores and admissions wait. The free memory of a GPU the server itself filled never holds
    anything back. 256 MiB leaves room for a compute buffer the server reallocates. Replaces `gpu_free_floor_mib`."""

    priority_max_wait_s: float = Field(default=120.0, gt=0)
    """Seconds a request may wait (parked, or in kvctl's admission queue) before it counts as the highest priority
    present: every wait is bounded by this setting, whatever the priorities. Priorities: higher = more important
    (as SGLang, TensorRT-LLM and llm-d; vLLM is the reverse)."""

    displacement: bool = True
    """A new request of strictly higher priority than a running one may displace it (park it) when the pool has no
    room for the new one. Equal priorities never displace each other."""

    priority_high_at: int = 1
    """Priorities at or above this are the `high` class in metrics (`priority_class` label); the raw number is never
    a label."""

    priority_low_at: int = -1
    """Priorities at or below this are the `low` class in metrics; between the two, `normal`."""

    @field_validator("priority_low_at")
    @classmethod
    def _low_class_below_high(cls, low: int, info: ValidationInfo) -> int:
        high = info.data.get("priority_high_at")
        if high is not None and low >= high:
            raise ValueError(f"must be below policy.priority_high_at ({high})")
        return low

    @field_validator("low")
    @classmethod
    def _low_below_high(cls, low: float, info: ValidationInfo) -> float:
        high = info.data.get("high")
        if high is not None and low >= high:
            raise ValueError(f"must be below policy.high ({high})")
        return low


class LoopSettings(_Group):
    """The control loop: poll, decide, act, record."""

    poll_interval_s: float = Field(default=0.05, gt=0)
    """Seconds between two polls of `GET /kv`. The headroom above HIGH must cover the growth of one interval (at
    ~20 steps/s and 4 slots, 50 ms is ~4 cells plus a prefill chunk); polling every decode step would cost the server
    more than it saves, and the server's safety net covers the rest."""

    backoff_initial_s: float = Field(default=0.1, gt=0)
    """First back-off in seconds after the server failed to answer; doubled on each further failure."""

    backoff_max_s: float = Field(default=4.0, gt=0)
    """Longest back-off in seconds. Must stay under half the lease (`upstream.lease_s`), so a server that comes back
    finds the controller polling before the lease lapses."""

    restart_delay_s: float = Field(default=1.0, gt=0)
    """Seconds before the loop restarts after an unexpected exception (logged with its traceback)."""


class KeeperSettings(_Group):
    """The keeper (`proxy.keeper`): the process that holds the clients' connections while workers die or reload."""

    poison_window_s: float = Field(default=POISON_WINDOW_S, ge=0)
    """The poison rule: a worker's death counts against a request it held only if the request had delivered nothing
    new to its client since that worker took it, the worker had not yet read and inspected it whole (a request queued,
    parked or generating a non-streamed answer did not kill it) and had held it for less than this many seconds; after 3
    counted deaths in a row the request is dropped (its connection closed), so one request that kills every worker
    it reaches cannot keep kvctl down. A reload never counts. 10 s: a request that kills a worker does so while it is
    read, inspected, admitted or sent (milliseconds, seconds on a busy machine), while unrelated deaths of a worker
    (an OOM kill, a crash elsewhere) that held a request longer than this say nothing of the request, whatever its
    client has yet. 0 turns the rule off: no request is ever dropped."""


class SupervisorSettings(_Group):
    """Starting and supervising llama-server (`kvctl run --spawn -- ARGV`)."""

    spawn: list[str] | None = None
    """The llama-server command line to start and supervise; unset: attach to a server started elsewhere."""

    ready_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds a spawned server may take to answer `/health` with 200: loading a large model from disk takes minutes."""

    health_interval_s: float = Field(default=0.25, gt=0)
    """Seconds between two `/health` probes while the server starts."""

    stop_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds between SIGTERM and SIGKILL of the server's process group: llama-server stops in well under a second
    unless a decode step is stuck."""

    restart_backoff_initial_s: float = Field(default=1.0, gt=0)
    """First delay in seconds before restarting a server that exited; doubled on each further exit."""

    restart_backoff_max_s: float = Field(default=30.0, gt=0)
    """Longest restart delay in seconds, so a crash loop costs little yet recovers soon after its cause is fixed."""

    stable_after_s: float = Field(default=60.0, gt=0)
    """Seconds a server must stay ready before its restart delay resets to the initial one."""

    failed_after: int = Field(default=5, ge=0)
    """Starts in a row that die before the server is ready (before `/health` answers 200; a run past
    `ready_timeout_s` counts) after which the supervisor gives up: state `failed`, no more starts, requests answered
    503 at once, and `/status` shows the last exit and the server's last log lines. A server that was ready resets
    the count. 5: with the doubling delay, a broken model path or flag is reported within 15 s plus its loads, and a
    passing fault (a GPU not yet freed by the server before) has had its chances. 0: never give up."""

    exit_on_failed: bool = False
    """When the supervisor gives up (`failed_after`), `kvctl run` exits with status 3 instead of staying up to report
    it: for a service manager (systemd, Kubernetes) that should restart or alert. Needs `failed_after` of 1 or more."""

    log_file: Path | None = None
    """Append the server's stdout and stderr to this file; unset: inherit kvctl's."""

    exact: bool = False
    """Start the spawned server in its batch-invariant mode (adds `--exact`): every request's tokens equal the same
    request's run alone on an idle server, whatever else runs and through every park, resume, replay and drain, for
    a cost in speed (docs/parking.md, "The exact mode"). Needs `spawn`; a server started elsewhere takes `--exact`
    on its own command line, and `/status` says which mode the server runs in (`upstream.exact`)."""

    @field_validator("spawn")
    @classmethod
    def _argv_not_empty(cls, spawn: list[str] | None) -> list[str] | None:
        if spawn is not None and not spawn:
            raise ValueError("the server command line is empty")
        return spawn


class LogFormat(StrEnum):
    AUTO = "auto"
    JSON = "json"
    CONSOLE = "console"


class LogLevel(StrEnum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class LogSettings(_Group):
    """Logging (structlog)."""

    level: LogLevel = LogLevel.INFO
    """Lowest level logged. `info` logs every decision with its reason, which is what an operator reads."""

    format: LogFormat = LogFormat.AUTO
    """`json` lines, a readable `console`, or `auto`: console on a terminal, JSON otherwise (journald, files)."""


RENAMED: dict[tuple[str, str], str] = {
    ("policy", "gpu_free_floor_mib"): "gpu_headroom_mib",
}
"""Settings renamed in this release, (group, old name) -> new name: the old name is still accepted, with a warning
naming the new one, for one release (in flags, the environment and the TOML file alike)."""

_deprecations: list[str] = []


def deprecations() -> tuple[str, ...]:
    """The renamed settings the last load_settings() met, as warnings to log."""
    return tuple(_deprecations)


class Settings(BaseSettings):
    """Everything kvctl can be told."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
    )

    upstream: UpstreamSettings = UpstreamSettings()
    proxy: ProxySettings = ProxySettings()
    admin: AdminSettings = AdminSettings()
    policy: PolicySettings = PolicySettings()
    loop: LoopSettings = LoopSettings()
    keeper: KeeperSettings = KeeperSettings()
    supervisor: SupervisorSettings = SupervisorSettings()
    log: LogSettings = LogSettings()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # flags > environment > TOML file > defaults; no .env files: systemd and shells own the environment
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for (group, old), new in RENAMED.items():
            values = data.get(group)
            if isinstance(values, dict) and old in values:
                values = dict(values)
                value = values.pop(old)
                if new in values:
                    _deprecations.append(f"{group}.{old} is renamed {group}.{new}; both are set, {group}.{new} wins")
                else:
                    values[new] = value
                    _deprecations.append(
                        f"{group}.{old} ({env_name(f'{group}.{old}')}) is renamed {group}.{new} "
                        f"({env_name(f'{group}.{new}')}) and will stop working in the next release"
                    )
                data = {**data, group: values}
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> Settings:
        lease = self.upstream.lease_s
        if self.loop.backoff_max_s >= lease / 2:
            raise _named("loop.backoff_max_s", f"must be under half the lease, upstream.lease_s / 2 = {lease / 2:g}")
        if self.loop.backoff_initial_s > self.loop.backoff_max_s:
            raise _named("loop.backoff_initial_s", f"must not exceed loop.backoff_max_s ({self.loop.backoff_max_s})")
        if self.loop.poll_interval_s >= lease / 2:
            raise _named("loop.poll_interval_s", f"must be under half the lease ({lease / 2:g})")
        if self.upstream.timeout_s >= lease / 2:
            raise _named("upstream.timeout_s", f"must be under half the lease ({lease / 2:g})")
        sup = self.supervisor
        if sup.restart_backoff_initial_s > sup.restart_backoff_max_s:
            raise _named("supervisor.restart_backoff_initial_s", "must not exceed supervisor.restart_backoff_max_s")
        if sup.exit_on_failed and sup.failed_after == 0:
            raise _named(
                "supervisor.exit_on_failed", "needs supervisor.failed_after of 1 or more (0: the server never fails)"
            )
        if sup.exact and sup.spawn is None:
            raise _named("supervisor.exact", "needs supervisor.spawn: start a server of your own with --exact instead")
        if sup.exact and any(a in ("-no-kvu", "--no-kv-unified") for a in sup.spawn or []):
            raise _named("supervisor.exact", "needs the unified KV pool: remove -no-kvu from supervisor.spawn")
        try:
            self.proxy.api_key_list()
        except KeyFileError as e:
            raise _named("proxy.api_keys", str(e)) from None
        p = self.proxy
        if (p.tls_key_file is not None) and p.tls_cert_file is None:
            raise _named("proxy.tls_key_file", "needs proxy.tls_cert_file")
        ping = sse_ping_interval(sup.spawn or [])
        if ping is not None and not 0 < ping <= p.upstream_read_timeout_s / 3:
            raise _named(
                "supervisor.spawn",
                f"--sse-ping-interval {ping:g} must be above 0 and at most a third of proxy.upstream_read_timeout_s "
                f"({p.upstream_read_timeout_s / 3:g}), or a quiet stream is ended before the server's ping",
            )
        host, _ = split_host_port(self.admin.listen)
        if not is_loopback(host) and self.admin.token is None:
            raise _named("admin.token", f"is required when admin.listen ({self.admin.listen}) is not loopback")
        return self


def sse_ping_interval(argv: Sequence[str]) -> float | None:
    """The `--sse-ping-interval` a server command line sets, or None."""
    for i, arg in enumerate(argv):
        value = None
        if arg == "--sse-ping-interval" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--sse-ping-interval="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                return float(value)
            except ValueError:
                return -1.0
    return None


class _NamedError(ValueError):
    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def _named(name: str, message: str) -> _NamedError:
    return _NamedError(name, message)


def env_name(dotted: str) -> str:
    return ENV_PREFIX + dotted.replace(".", "__").upper()


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        ctx_err = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_err, _NamedError):
            parts.append(f"invalid setting {ctx_err.name} ({env_name(ctx_err.name)}): {ctx_err}")
            continue
        name = ".".join(str(p) for p in err["loc"]) or "settings"
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown setting {name}")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        secret = name.endswith(("token", "api_key")) or "api_keys" in name
        shown = repr(err.get("input"))
        got = "" if secret or isinstance(err.get("input"), dict) or shown in msg else f", got {shown}"
        parts.append(f"invalid setting {name} ({env_name(name)}): {msg}{got}")
    return "; ".join(parts)


def load_settings(config_file: Path | None = None, overrides: Mapping[str, Any] | None = None) -> Settings:
    """Settings from flags (``overrides``, nested dicts), the environment and an optional TOML file.

    Raises SettingsError with one line naming each invalid setting.
    """
    cls: type[Settings] = Settings
    if config_file is not None:
        try:
            with config_file.open("rb") as f:
                tomllib.load(f)  # a parse error should name the file, not surface as a missing setting
        except OSError as e:
            raise SettingsError(f"cannot read config file {config_file}: {e.strerror}") from e
        except tomllib.TOMLDecodeError as e:
            raise SettingsError(f"invalid config file {config_file}: {e}") from e

        class FromFile(Settings):
            model_config = SettingsConfigDict(toml_file=config_file)

        cls = FromFile
    _deprecations.clear()
    try:
        return cls(**dict(overrides or {}))
    except ValidationError as e:
        raise SettingsError(_describe(e)) from None


# --- documentation ---------------------------------------------------------------------------


def _default_text(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, StrEnum):
        return f"`{value.value}`"
    if isinstance(value, list | dict) and not value:
        return "none"
    return f"`{value}`"


def markdown_table() -> str:
    """The settings table of docs/operations.md, from the model itself."""
    rows = ["| setting | environment | default | meaning |", "|---|---|---|---|"]
    for group_name, group_field in Settings.model_fields.items():
        group = group_field.annotation
        assert isinstance(group, type) and issubclass(group, BaseModel)
        for name, field in group.model_fields.items():
            dotted = f"{group_name}.{name}"
            desc = " ".join((field.description or "").split())
            default = field.get_default(call_default_factory=True)
            rows.append(f"| `{dotted}` | `{env_name(dotted)}` | {_default_text(default)} | {desc} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m controller.settings", description=__doc__)
    parser.add_argument("--markdown", action="store_true", help="print the settings table (docs/operations.md)")
    parser.add_argument("--config", type=Path, help="check a TOML file (and the environment) and print the result")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table())
        return 0
    try:
        settings = load_settings(args.config)
    except SettingsError as e:
        print(f"kvctl: {e}", file=sys.stderr)
        return 2
    print(settings.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
