"""The proxy's configuration: what it reads of kvctl's settings, with the settings' own defaults.

Every default is taken from the pydantic models in ``controller.settings`` (the one place that documents it), so a
``ProxyConfig`` built by keyword in a test and one built from the settings agree on whatever neither names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from controller.keys import ApiKey
from controller.settings import PolicySettings, ProxySettings, Settings, UpstreamSettings, split_host_port

__all__ = ["ProxyConfig"]


def _default(model: type[BaseModel], name: str) -> Any:
    return model.model_fields[name].default


@dataclass(frozen=True)
class ProxyConfig:
    upstream: str = str(_default(UpstreamSettings, "url")).rstrip("/")
    upstream_api_key: str | None = None
    api_keys: tuple[ApiKey, ...] = ()  # kvctl's own keys (proxy.api_keys and proxy.api_keys_file)
    heartbeat_s: float = _default(ProxySettings, "heartbeat_s")  # longest silence on a stream before a heartbeat
    queue_grace_s: float = _default(ProxySettings, "queue_grace_s")  # queued longer: SSE headers and heartbeats
    queue_depth: int = _default(ProxySettings, "queue_depth")
    queue_timeout_s: float = _default(ProxySettings, "queue_timeout_s")
    write_timeout_s: float = _default(ProxySettings, "write_timeout_s")  # a client taking no bytes this long: cut
    max_body_bytes: int = _default(ProxySettings, "max_body_bytes")
    connect_timeout_s: float = _default(UpstreamSettings, "timeout_s")
    upstream_read_timeout_s: float = _default(ProxySettings, "upstream_read_timeout_s")  # a started response's silence
    drain_s: float = _default(ProxySettings, "drain_s")
    expose_private_routes: bool = _default(ProxySettings, "expose_private_routes")
    retry_after_s: int = _default(ProxySettings, "retry_after_s")
    reserve_cells: int = _default(ProxySettings, "admission_reserve_cells")  # the least a new request may need
    predict_route: str | None = None  # the Vertex AI predict route, when the server registers one
    auth_cache_s: float = 5.0  # how long the server's acceptance of a credential is kept (no setting)
    client_priority: bool = _default(ProxySettings, "client_priority")  # without kvctl keys: may clients set one
    objective_priorities: Mapping[str, int] = field(default_factory=dict)  # llm-d objective -> priority
    priority_max_wait_s: float = _default(PolicySettings, "priority_max_wait_s")  # queued longer: counts as highest
    priority_high_at: int = _default(PolicySettings, "priority_high_at")  # the priority_class label's thresholds
    priority_low_at: int = _default(PolicySettings, "priority_low_at")
    replay_limit: int = _default(ProxySettings, "replay_limit")  # continuations of a stream whose server died; 0: off
    replay_timeout_s: float = _default(ProxySettings, "replay_timeout_s")
    replay_memory_bytes: int = _default(ProxySettings, "replay_memory_mib") << 20
    drain_peers: tuple[str, ...] = ()  # other kvctl listeners a drain moves requests to
    peer_api_key: str | None = None  # X-Kvctl-Peer, sent to peers and checked on what they send
    handover_dir: str | None = None  # the servers' shared --slot-save-path: a drain hands cells over there
    admin_port: int | None = None  # kvctl's admin API, named where a client asks the proxy for a controller route

    @classmethod
    def from_settings(cls, settings: Settings, predict_route: str | None = None) -> ProxyConfig:
        """The proxy's part of ``settings``; reads ``proxy.api_keys_file`` (KeyFileError names a bad entry)."""
        p, upstream, policy = settings.proxy, settings.upstream, settings.policy
        return cls(
            upstream=str(upstream.url).rstrip("/"),
            upstream_api_key=upstream.api_key.get_secret_value() if upstream.api_key else None,
            api_keys=tuple(p.api_key_list()),
            heartbeat_s=p.heartbeat_s,
            queue_grace_s=p.queue_grace_s,
            queue_depth=p.queue_depth,
            queue_timeout_s=p.queue_timeout_s,
            write_timeout_s=p.write_timeout_s,
            max_body_bytes=p.max_body_bytes,
            connect_timeout_s=upstream.timeout_s,
            upstream_read_timeout_s=p.upstream_read_timeout_s,
            drain_s=p.drain_s,
            expose_private_routes=p.expose_private_routes,
            retry_after_s=p.retry_after_s,
            reserve_cells=p.admission_reserve_cells,
            predict_route=predict_route,
            client_priority=p.client_priority,
            objective_priorities=dict(p.objective_priorities),
            priority_max_wait_s=policy.priority_max_wait_s,
            priority_high_at=policy.priority_high_at,
            priority_low_at=policy.priority_low_at,
            replay_limit=p.replay_limit,
            replay_timeout_s=p.replay_timeout_s,
            replay_memory_bytes=p.replay_memory_mib << 20,
            drain_peers=tuple(str(u).rstrip("/") for u in p.drain_peers),
            peer_api_key=p.peer_api_key.get_secret_value() if p.peer_api_key else None,
            handover_dir=str(p.handover_dir) if p.handover_dir else None,
            admin_port=split_host_port(settings.admin.listen)[1],
        )
