"""The whole stack, as `kvctl run` starts it: control loop, admin listener and proxy in front of the
real patched server with its own safety net switched off."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.llama import (
    StreamResult,
    parse_metrics,
    stream_completion,
)
from tests.harness import ServerFactory, assert_complete, request, running_app


async def test_requests_beyond_capacity_queue_and_complete(
    start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server("-c", "8192", "-np", "4", "-kvu", "--slots", "--metrics", "--no-auto-park")
    async with running_app(srv.url) as (app, url, admin):
        results = await asyncio.gather(*[stream_completion(http, url, request(f"Chat {i}:", 2500)) for i in range(8)])
        assert_complete(list(results), 2500)
        async with http.get(admin + "/metrics") as resp:
            text = await resp.text()
        parse_metrics(text)  # every sample typed
        # more requests than slots and pool: some waited in kvctl's queue, none failed (every priority class summed)
        waits = [
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "kvctl_proxy_admission_wait_seconds_count"
        ]
        assert sum(waits) == 8
        assert app.loop.state.parks > 0
    async with http.get(srv.url + "/metrics") as resp:
        sm = parse_metrics(await resp.text())
    assert sm["llamacpp:slot_auto_parks_total"] == 0
    assert "Context size has been exceeded" not in srv.log_text()


async def test_queue_overflow_is_503_with_retry_after(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server("-c", "8192", "-np", "2", "-kvu", "--slots", "--metrics", "--no-auto-park")
    async with running_app(srv.url, proxy={"queue_depth": 1}) as (app, url, _admin):
        assert app.proxy is not None
        running: list[asyncio.Task[StreamResult]] = []
        try:
            async with asyncio.timeout(120):
                # one slot busy, then both, as the control loop's last poll saw it (what admission reads): started
                # one at a time, each once the loop has seen the one before (a CI run saw the second of two sent at
                # once never reach the server). Polling the server instead raced the loop's poll on a loaded machine:
                # a stale snapshot admitted "Queued" into the server, and the queue was empty when "Overflow" came.
                for i in range(2):
                    running.append(asyncio.create_task(stream_completion(http, url, request(f"Busy {i}", 4000))))
                    while (kv := app.loop.state.snapshot) is None or kv.n_slots_idle != 1 - i:  # noqa: ASYNC110
                        await asyncio.sleep(0.02)
                queued = asyncio.create_task(stream_completion(http, url, request("Queued", 50)))
                while app.proxy.queue.queued < 1:  # noqa: ASYNC110 - it waits in kvctl's queue, which is now full
                    await asyncio.sleep(0.02)
        except TimeoutError as e:  # say where it stood, not just that time ran out
            done = [t.result() if t.done() else None for t in running]
            raise AssertionError(
                f"snapshot {app.loop.state.snapshot}, queued {app.proxy.queue.queued}, requests {done}"
            ) from e
        async with http.post(url + "/completion", json=request("Overflow", 50)) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"] == "2"
            assert (await resp.json())["error"]["kvctl_code"] == "queue_full"
        assert_complete(list(await asyncio.gather(*running)), 4000)
        assert_complete([await queued], 50)


async def test_an_upstream_that_went_down_is_waited_for_then_answered_503(
    start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server("-c", "2048", "-np", "2", "-kvu", "--slots")
    async with running_app(srv.url, proxy={"replay_timeout_s": 1.0}) as (app, url, _admin):
        assert_complete([await stream_completion(http, url, request("Up", 20))], 20)
        srv.stop()
        down = asyncio.Event()
        app.loop.add_poll_listener(lambda: None if app.loop.state.upstream_up else down.set())
        await asyncio.wait_for(down.wait(), 10)
        t0 = time.monotonic()
        async with http.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}) as r:
            assert r.status == 503 and "Retry-After" in r.headers
            body = await r.json()
            assert body["error"]["message"].startswith("kvctl:") and r.headers["X-Kvctl-Error"] == "server_restarting"
        assert 0.9 <= time.monotonic() - t0 < 5, "it answered before: held for proxy.replay_timeout_s, not refused"


@pytest.mark.parametrize("drafting", [False, True], ids=["plain", "draft-mtp"])
async def test_hybrid_mtp_pressure_through_the_controller(
    start_server: ServerFactory, qwen35_model: Path, http: aiohttp.ClientSession, drafting: bool
) -> None:
    extra = ("--spec-type", "draft-mtp") if drafting else ()
    srv = start_server(
        "-c", "4096", "-np", "4", "-kvu", "--slots", "--metrics", "--no-auto-park", *extra, model=qwen35_model
    )
    async with running_app(srv.url) as (app, url, _admin):
        results = await asyncio.gather(
            *[
                stream_completion(http, url, {"prompt": f"Story {i}:", "n_predict": 1500, "ignore_eos": True})
                for i in range(4)
            ]
        )
        for res in results:
            assert res.status == 200 and res.error is None, res.error
            assert res.final is not None and res.final["tokens_predicted"] == 1500
        assert app.loop.state.parks > 0
    log = srv.log_text()
    assert "Context size has been exceeded" not in log and "speculative batch index" not in log
