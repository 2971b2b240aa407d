"""The model-server metrics an inference gateway's endpoint picker reads, served on the proxy's ``GET /metrics``.

The Gateway API Inference Extension's model-server protocol (proposal 003), which llm-d's endpoint picker scrapes
from every pod every 50 ms, asks for three gauges and an optional info gauge; kvctl knows them better than the
server does (docs/scaling.md):

* queued requests: kvctl's admission queue, plus requests admitted since the latest poll was asked for (not in a
  slot yet), plus parked requests waiting to be restored;
* running requests: requests resident in the pool (generating or evaluating their prompt);
* KV usage, 0-1: the projected occupancy the policy acts on (cells of requests in progress plus the next step, over
  the pool; idle prompt caches left out, as vLLM leaves out free cached blocks), capped at 1;
* cache info: value 1, labels ``block_size`` and ``num_gpu_blocks`` (block_size x num_gpu_blocks = the pool's cells).

Served under kvctl's names, and with ``proxy.metrics_compat = "vllm"`` also under vLLM's, which a stock picker
reads. Rendered at each scrape from the latest poll (whose age is a gauge too): while the server is down, or the
poll is older than 4 poll intervals, usage reads 1 and the scrape still answers 200, so the picker routes away.
Nothing per user or per request is in it, and never the server's ``llamacpp:*`` series.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "BLOCK_SIZE",
    "CACHE_INFO_LABELS",
    "CONTENT_TYPE",
    "KVCTL_NAMES",
    "POLL_AGE",
    "STALE_POLLS",
    "VLLM_NAMES",
    "EndpointMetrics",
    "EndpointSample",
]

BLOCK_SIZE = 16
"""Cells per block in ``cache_config_info``. llama.cpp's pool is cell by cell and reuses any token prefix, so any size
describes it truthfully; llm-d's approximate prefix scorer hashes prompts by the block size of the first candidate
pod and sizes each pod's prefix index by its block count, so 16, vLLM's default, keeps a pool that mixes vLLM and
kvctl pods consistent (docs/scaling.md, "Why the block size is 16")."""

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The classic text format, which every scraper parses (and what vLLM serves); the names need nothing newer."""

STALE_POLLS = 4
"""A poll older than this many poll intervals is stale: usage reads 1."""

# the protocol's four metrics by kvctl's names and by vLLM's
KVCTL_NAMES = {
    "queued": "kvctl_endpoint_queued_requests",
    "running": "kvctl_endpoint_running_requests",
    "kv_usage": "kvctl_endpoint_kv_usage_ratio",
    "cache_info": "kvctl_endpoint_cache_config_info",
}
VLLM_NAMES = {
    "queued": "vllm:num_requests_waiting",
    "running": "vllm:num_requests_running",
    "kv_usage": "vllm:kv_cache_usage_perc",
    "cache_info": "vllm:cache_config_info",
}
CACHE_INFO_LABELS = ("block_size", "num_gpu_blocks")
POLL_AGE = "kvctl_endpoint_poll_age_seconds"

_HELP = {
    "queued": "Requests waiting: kvctl's admission queue, admitted ones not in a slot yet, and parked ones.",
    "running": "Requests resident in the KV pool (generating or evaluating their prompt).",
    "kv_usage": "Projected KV pool occupancy (0-1) the policy acts on; 1 while the server is down or polls are stale.",
    "cache_info": "The KV pool as blocks: block_size x num_gpu_blocks = its cells.",
}


@dataclass(frozen=True, slots=True)
class EndpointSample:
    """What the latest poll and the proxy say, read at a scrape."""

    up: bool
    """The server answered the latest poll."""
    poll_age_s: float | None
    """Seconds since the latest answered poll; None: none yet."""
    queued: int
    running: int
    usage: float
    """Projected occupancy of the pool at the latest poll."""
    n_cells: int
    """The pool's cells (0: unknown)."""


class EndpointMetrics(Collector):
    """The gauges above, on a registry of their own (the admin listener's kvctl_* metrics stay there)."""

    def __init__(self, sample: Callable[[], EndpointSample], *, vllm_names: bool, poll_interval_s: float) -> None:
        self._sample = sample
        self._names = [KVCTL_NAMES] + ([VLLM_NAMES] if vllm_names else [])
        self.stale_after_s = STALE_POLLS * poll_interval_s
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def usage(self, s: EndpointSample) -> float:
        if not s.up or s.poll_age_s is None or s.poll_age_s > self.stale_after_s or s.n_cells <= 0:
            return 1.0
        return min(1.0, max(0.0, s.usage))

    def collect(self) -> Iterator[Metric]:
        s = self._sample()
        usage = self.usage(s)
        for names in self._names:
            yield GaugeMetricFamily(names["queued"], _HELP["queued"], value=s.queued)
            yield GaugeMetricFamily(names["running"], _HELP["running"], value=s.running)
            yield GaugeMetricFamily(names["kv_usage"], _HELP["kv_usage"], value=usage)
            if s.n_cells > 0:
                info = GaugeMetricFamily(names["cache_info"], _HELP["cache_info"], labels=CACHE_INFO_LABELS)
                info.add_metric([str(BLOCK_SIZE), str(s.n_cells // BLOCK_SIZE)], 1)
                yield info
        age = s.poll_age_s if s.poll_age_s is not None else math.inf
        yield GaugeMetricFamily(POLL_AGE, "Seconds since the latest answered poll of the server.", value=age)

    def render(self) -> bytes:
        return generate_latest(self.registry)
