"""The endpoint picker's gauges on the proxy's GET /metrics (issue 19): names, types, ranges, what they count, and
usage 1 when the numbers cannot be trusted. The live contract on the real server: tests/integration/test_endpoint.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families

from controller.app import App
from controller.proxy.endpoint_metrics import (
    CACHE_INFO_LABELS,
    KVCTL_NAMES,
    POLL_AGE,
    VLLM_NAMES,
    EndpointMetrics,
    EndpointSample,
)
from tests.fakes.llama_server import FakeLlamaServer, kv_body
from tests.harness import FAST_LOOP, running_app, serving


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(text: str, name: str) -> float:
    (sample,) = families(text)[name].samples
    return float(sample.value)


SAMPLE = EndpointSample(up=True, poll_age_s=0.02, queued=3, running=2, usage=0.5, n_cells=8192)


def test_the_protocol_s_gauges_under_kvctl_s_names_and_optionally_vllm_s() -> None:
    text = EndpointMetrics(lambda: SAMPLE, vllm_names=False, poll_interval_s=0.05).render().decode()
    got = families(text)
    assert set(got) == {*KVCTL_NAMES.values(), POLL_AGE}, "nothing else: no per-user, no per-request series"
    assert all(f.type == "gauge" for f in got.values())
    assert value(text, KVCTL_NAMES["queued"]) == 3 and value(text, KVCTL_NAMES["running"]) == 2
    assert value(text, KVCTL_NAMES["kv_usage"]) == 0.5 and value(text, POLL_AGE) == 0.02
    (info,) = got[KVCTL_NAMES["cache_info"]].samples
    assert info.value == 1 and info.labels == dict(zip(CACHE_INFO_LABELS, ("16", "512"), strict=True))
    both = families(EndpointMetrics(lambda: SAMPLE, vllm_names=True, poll_interval_s=0.05).render().decode())
    assert set(both) == {*KVCTL_NAMES.values(), *VLLM_NAMES.values(), POLL_AGE}
    for key, name in VLLM_NAMES.items():
        assert both[name].type == "gauge" and both[name].samples[0].value == both[KVCTL_NAMES[key]].samples[0].value


@pytest.mark.parametrize(
    ("sample", "why"),
    [
        (EndpointSample(up=False, poll_age_s=0.01, queued=0, running=0, usage=0.1, n_cells=8192), "down"),
        (EndpointSample(up=True, poll_age_s=0.21, queued=0, running=0, usage=0.1, n_cells=8192), "4 intervals old"),
        (EndpointSample(up=True, poll_age_s=None, queued=0, running=0, usage=0.1, n_cells=8192), "never polled"),
        (EndpointSample(up=True, poll_age_s=0.01, queued=0, running=0, usage=1.7, n_cells=8192), "over the pool"),
    ],
)
def test_usage_reads_1_when_it_cannot_be_trusted_and_never_exceeds_it(sample: EndpointSample, why: str) -> None:
    text = EndpointMetrics(lambda: sample, vllm_names=True, poll_interval_s=0.05).render().decode()
    assert value(text, KVCTL_NAMES["kv_usage"]) == 1 and value(text, VLLM_NAMES["kv_usage"]) == 1, why


@pytest.fixture
async def stack(fake: FakeLlamaServer) -> AsyncIterator[tuple[App, str, TestServer]]:
    async with serving(fake) as server:
        proxy = {"api_keys": ["sk-test"], "metrics_compat": "vllm"}
        async with running_app(str(server.make_url("")), proxy=proxy, loop=FAST_LOOP) as (app, url, _):
            yield app, url, server


async def polled(app: App, n: int = 2) -> None:
    target = app.loop.state.polls + n
    while app.loop.state.polls < target:  # noqa: ASYNC110 - the loop is under test
        await asyncio.sleep(0.01)


async def test_the_proxy_serves_them_without_a_key_from_the_latest_poll(
    fake: FakeLlamaServer, stack: tuple[App, str, TestServer]
) -> None:
    app, url, server = stack
    parked = {"count": 1, "bytes": 512, "t_parked_total_ms": 0, "parked_since_ms": 1, "auto": False, "n_cells": 50}
    fake.kv = kv_body(
        1000,
        [
            {"state": "generating", "n_cells": 300, "id_task": 1, "t_arrival_ms": 1},
            {"state": "prompt", "n_cells": 100, "id_task": 2, "t_arrival_ms": 2, "n_prefill_left": 20},
            {"state": "parked", "n_cells": 50, "id_task": 3, "t_arrival_ms": 3, "park": parked},
            {},
        ],
    )
    await polled(app)
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = await r.text()
        async with http.get(url + "/v1/models") as r:
            assert r.status == 401, "every other route still needs a key"
        async with http.post(url + "/metrics") as r:
            assert (
                r.status == 405 and r.headers["X-Kvctl-Error"] == "method_not_allowed" and "GET" in r.headers["Allow"]
            )
        async with http.head(url + "/metrics") as r:
            assert r.status == 200
    assert value(text, VLLM_NAMES["running"]) == 2, "the generating and the prefilling request"
    assert value(text, VLLM_NAMES["queued"]) == 1, "the parked one waits"
    decision = app.loop.state.decision
    assert decision is not None and value(text, VLLM_NAMES["kv_usage"]) == pytest.approx(decision.pressure.value)
    assert 0 < value(text, VLLM_NAMES["kv_usage"]) < 1
    (info,) = families(text)[VLLM_NAMES["cache_info"]].samples
    assert info.labels == {"block_size": "16", "num_gpu_blocks": str(1000 // 16)}
    assert "llamacpp:" not in text

    # requests waiting in kvctl's queue count too
    app.gate.update("held for the test", 0)
    assert app.proxy is not None
    waiters = [asyncio.create_task(app.proxy.queue.admit(10)) for _ in range(3)]
    await asyncio.sleep(0.05)
    assert app.proxy.endpoint is not None
    assert value(app.proxy.endpoint.render().decode(), VLLM_NAMES["queued"]) == 1 + 3
    for w in waiters:
        w.cancel()
    await asyncio.gather(*waiters, return_exceptions=True)

    # the server goes away: still 200, usage 1, so the picker routes elsewhere
    await server.close()
    while app.loop.state.upstream_up:  # noqa: ASYNC110 - the loop is under test
        await asyncio.sleep(0.01)
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        assert r.status == 200
        down = await r.text()
    assert value(down, VLLM_NAMES["kv_usage"]) == 1 and value(down, KVCTL_NAMES["kv_usage"]) == 1
