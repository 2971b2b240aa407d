"""The endpoint picker's contract on the live stack (issue 19): the real patched server, kvctl in this process, an
overflow burst; then a tiny router, standing in for llm-d's endpoint picker, choosing between two replicas by the
gauges. The gauges' names, types and ranges are checked with prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from controller.app import App
from controller.proxy.endpoint_metrics import KVCTL_NAMES, POLL_AGE, VLLM_NAMES
from controller.upstream.models import SlotState
from testkit.llama import stream_completion
from tests.harness import ServerFactory, assert_complete, request, running_app


@dataclass
class Scrape:
    polls: int
    """The loop's poll count before and after the scrape: equal, the scrape read that one poll."""
    queued: float
    running: float
    usage: float
    parked: int
    resident: int
    projected: float
    stale: bool
    """The poll was older than the staleness bound when scraped (a slow answer from a busy server): usage reads 1."""


async def scrape(http: aiohttp.ClientSession, app: App, url: str) -> Scrape | None:
    before = app.loop.state.polls
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    state = app.loop.state
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for names in (KVCTL_NAMES, VLLM_NAMES):
        for name in names.values():
            assert families[name].type == "gauge", name
        assert families[names["queued"]].samples[0].value == families[KVCTL_NAMES["queued"]].samples[0].value
    value = {key: families[name].samples[0].value for key, name in VLLM_NAMES.items()}
    assert 0 <= value["kv_usage"] <= 1 and value["queued"] >= 0 and value["running"] >= 0
    assert value["queued"] == int(value["queued"]) and value["running"] == int(value["running"])
    kv, decision = state.snapshot, state.decision
    assert app.proxy is not None and app.proxy.endpoint is not None
    if state.polls != before or kv is None or decision is None:
        return None  # a poll came in between: nothing to compare it with
    return Scrape(
        polls=before,
        queued=value["queued"],
        running=value["running"],
        usage=value["kv_usage"],
        parked=kv.n_parked,
        resident=sum(1 for s in kv.slots if s.is_resident),
        projected=min(1.0, decision.pressure.value),
        stale=families[POLL_AGE].samples[0].value > app.proxy.endpoint.stale_after_s,
    )


async def test_the_gauges_follow_the_pool_through_an_overflow_burst_and_read_full_when_down(
    start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server("-c", "2048", "-np", "4", "-kvu", "--slots", "--metrics", "--no-auto-park")
    async with running_app(srv.url, proxy={"metrics_compat": "vllm", "api_keys": ["sk-test"]}) as (app, url, _admin):
        seen: list[Scrape] = []
        done = asyncio.Event()

        async def scraper() -> None:
            while not done.is_set():
                s = await scrape(http, app, url)
                if s is not None:
                    seen.append(s)
                await asyncio.sleep(0.02)

        # before the first poll the gauges read "down" (and cache_config_info is absent): not what this test reads
        while app.loop.state.snapshot is None:  # noqa: ASYNC110 - the loop is under test
            await asyncio.sleep(0.02)
        task = asyncio.create_task(scraper())
        try:
            # six requests of 700 tokens: more than the 4 slots (two wait in kvctl's queue) and, together, more than
            # the 2048 cells (some are parked)
            key = {"Authorization": "Bearer sk-test"}
            streams = [stream_completion(http, url, request(f"Burst {i}:", 700), headers=key) for i in range(6)]
            assert_complete(list(await asyncio.gather(*streams)), 700)
        finally:
            done.set()
            await task
        assert any(not s.stale for s in seen), "no scrape read a single fresh poll"
        for s in seen:
            assert s.running == s.resident, s
            assert abs(s.usage - (1.0 if s.stale else s.projected)) < 1e-9, s
            assert s.queued >= s.parked, s
        assert max(s.queued for s in seen) >= 2, "the requests beyond the slots waited, and the gauge said so"
        assert app.loop.state.parks > 0, "the burst overflowed the pool"
        assert any(s.parked > 0 for s in seen), "parked requests waiting were seen, and counted as queued"

        srv.stop()
        while app.loop.state.upstream_up:  # noqa: ASYNC110 - the loop is under test
            await asyncio.sleep(0.02)
        async with http.get(url + "/metrics") as resp:
            assert resp.status == 200
            down = {f.name: f.samples[0].value for f in text_string_to_metric_families(await resp.text())}
        assert down[VLLM_NAMES["kv_usage"]] == 1 and down[KVCTL_NAMES["kv_usage"]] == 1


async def pick(http: aiohttp.ClientSession, replicas: list[str]) -> str:
    """The tiny router: the replica with the lowest KV usage, then the shortest queue (llm-d's kv-cache-utilization
    and queue scorers, equally weighted, reduced to an order)."""
    scores = []
    for url in replicas:
        async with http.get(url + "/metrics") as resp:
            v = {f.name: f.samples[0].value for f in text_string_to_metric_families(await resp.text())}
        scores.append((v[VLLM_NAMES["kv_usage"]], v[VLLM_NAMES["queued"]], url))
    return min(scores)[2]


async def test_a_router_reading_the_gauges_sends_new_requests_to_the_replica_with_room(
    start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    args = ("-c", "2048", "-np", "2", "-kvu", "--slots", "--metrics", "--no-auto-park")
    srv_a, srv_b = start_server(*args), start_server(*args)
    async with contextlib.AsyncExitStack() as stack:
        app_a, url_a, _ = await stack.enter_async_context(running_app(srv_a.url, proxy={"metrics_compat": "vllm"}))
        app_b, url_b, _ = await stack.enter_async_context(running_app(srv_b.url, proxy={"metrics_compat": "vllm"}))
        replicas = [url_a, url_b]
        for busy_app, busy_url, other_url in ((app_a, url_a, url_b), (app_b, url_b, url_a)):
            # one replica generates a long answer (only one server computes at a time: two would share 2 cores)
            load = asyncio.create_task(stream_completion(http, busy_url, request("Load:", 4000)))
            while not (busy_app.loop.state.decision and busy_app.loop.state.decision.pressure.value > 0.1):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
            assert await pick(http, replicas) == other_url
            load.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await load
            while any(s.state is not SlotState.IDLE for s in _slots(busy_app)):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        # the choice is then served there, and completes
        target = await pick(http, replicas)
        assert_complete([await stream_completion(http, target, request("Routed:", 30))], 30)


def _slots(app: App) -> list[Any]:
    kv = app.loop.state.snapshot
    return list(kv.slots) if kv is not None else []
