"""The in-server safety net: a full pool parks requests instead of failing them, a lapsed lease
strands nobody, and --park-test-interval exercises the whole path."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from testkit.llama import (
    StreamResult,
    get_json,
    parse_metrics,
    post_action,
    stream_completion,
)
from tests.harness import ServerFactory, request

LEASE = {"X-Park-Lease": "1"}


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        return parse_metrics(await resp.text())


async def run_streams(http: aiohttp.ClientSession, url: str, n: int, n_predict: int) -> list[StreamResult]:
    return await asyncio.gather(
        *[stream_completion(http, url, request(f"Story number {i}:", n_predict)) for i in range(n)]
    )


def assert_all_complete(results: list[StreamResult], n_predict: int) -> None:
    for res in results:
        assert res.status == 200 and res.error is None, res.error
        assert res.final is not None and res.final["tokens_predicted"] == n_predict
        assert res.n_decoded == list(range(1, n_predict + 1))


@pytest.mark.parametrize(
    ("n_ctx", "n_slots", "n_streams", "n_predict"),
    [(8192, 4, 4, 3000), (16384, 4, 4, 6000), (8192, 8, 8, 1500)],
    ids=["8k-4x3000", "16k-4x6000", "8k-8x1500"],
)
async def test_full_pool_completes_every_request(
    start_server: ServerFactory, http: aiohttp.ClientSession, n_ctx: int, n_slots: int, n_streams: int, n_predict: int
) -> None:
    srv = start_server("-c", str(n_ctx), "-np", str(n_slots), "-kvu", "--slots", "--metrics")
    results = await run_streams(http, srv.url, n_streams, n_predict)
    assert_all_complete(results, n_predict)
    m = await metrics(http, srv.url)
    assert m["llamacpp:slot_auto_parks_total"] > 0
    assert m["llamacpp:slots_parked"] == 0 and m["llamacpp:parked_bytes"] == 0
    assert "Context size has been exceeded" not in srv.log_text()


async def test_a_budget_smaller_than_a_snapshot_parks_by_recompute(
    start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    # the band: with swaps alone, 0 of 4 completed (every snapshot of ~2000 cells is over 1 MiB)
    srv = start_server("-c", "8192", "-np", "4", "-kvu", "--slots", "--metrics", "--park-ram", "1")
    results = await run_streams(http, srv.url, 4, 3000)
    assert_all_complete(results, 3000)
    m = await metrics(http, srv.url)
    assert m["llamacpp:slot_recompute_parks_total"] > 0
    assert m["llamacpp:recomputed_tokens_total"] > 0
    assert m["llamacpp:slots_parked"] == 0 and m["llamacpp:parked_bytes"] == 0
    assert "Context size has been exceeded" not in srv.log_text()
    for res in results:
        # usage is the uninterrupted request's: re-evaluated tokens are only in the timings
        assert res.final is not None
        assert res.final["timings"]["prompt_n"] <= res.final["tokens_evaluated"] < 32
    assert (
        sum(r.final["timings"].get("recompute_n", 0) for r in results if r.final)
        == m["llamacpp:recomputed_tokens_total"]
    )


@pytest.mark.parametrize("flag", [("--no-park",), ("--no-auto-park",)], ids=["no-park", "no-auto-park"])
async def test_without_the_safety_net_the_upstream_failure_returns(
    start_server: ServerFactory, http: aiohttp.ClientSession, flag: tuple[str, ...]
) -> None:
    srv = start_server("-c", "8192", "-np", "4", "-kvu", "--slots", "--metrics", *flag)
    results = await run_streams(http, srv.url, 4, 3000)
    errors = [r.error for r in results if r.error is not None]
    assert errors, "the pool overflows: without the safety net upstream fails the running requests"
    assert all("Context size has been exceeded" in e["message"] for e in errors)


async def test_long_prompt_arriving_near_a_full_pool(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server("-c", "8192", "-np", "4", "-kvu", "--slots", "--metrics", "-b", "512")
    gens = [asyncio.create_task(stream_completion(http, srv.url, request(f"Chat {i}:", 2400))) for i in range(3)]
    while True:  # wait until the pool is well filled
        if (await get_json(http, srv.url + "/kv"))["used_ratio"] >= 0.6:
            break
        await asyncio.sleep(0.05)
    long = await stream_completion(http, srv.url, request([1000 + i for i in range(3000)], 200))
    assert_all_complete([long], 200)
    assert_all_complete(list(await asyncio.gather(*gens)), 2400)


async def test_prefills_that_exceed_the_pool_together(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server("-c", "4096", "-np", "2", "-kvu", "--slots", "--metrics", "-b", "256", "-ub", "256")
    assert srv.proc is not None
    proc = psutil.Process(srv.proc.pid)
    prompts = [[1000 + i for i in range(3000)], [9000 + i for i in range(3000)]]
    results = await asyncio.gather(*[stream_completion(http, srv.url, request(p, 100)) for p in prompts])
    assert_all_complete(list(results), 100)
    # nothing left to do: the loop waits instead of spinning
    t0 = proc.cpu_times()
    await asyncio.sleep(2.0)
    t1 = proc.cpu_times()
    assert (t1.user + t1.system) - (t0.user + t0.system) < 0.5


async def test_park_test_interval_is_exact(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    args = ("-c", "4096", "-np", "2", "-kvu", "--slots", "--metrics")
    ref_srv = start_server(*args)
    srv = start_server(*args, "--park-test-interval", "50")
    req = request("Forced parking", 1000)
    ref = await stream_completion(http, ref_srv.url, req)
    res = await stream_completion(http, srv.url, req)
    assert_all_complete([ref, res], 1000)
    assert res.tokens == ref.tokens and res.content == ref.content
    assert res.comments.count("parked") >= 19 and res.comments.count("resumed") == res.comments.count("parked")
    assert ref.comments.count("parked") == 0


async def test_park_test_interval_with_a_draft_model(
    start_server: ServerFactory, tiny_model: Path, http: aiohttp.ClientSession
) -> None:
    args = (
        "-c",
        "4096",
        "-np",
        "2",
        "-kvu",
        "--slots",
        "--metrics",
        "--model-draft",
        str(tiny_model),
        "--spec-type",
        "draft-simple",
        "--spec-draft-n-max",
        "4",
    )
    ref_srv = start_server(*args)
    srv = start_server(*args, "--park-test-interval", "50")
    req = request("Forced parking with drafts", 1000)
    ref = await stream_completion(http, ref_srv.url, req)
    res = await stream_completion(http, srv.url, req)
    assert_all_complete([ref, res], 1000)
    assert res.tokens == ref.tokens and res.content == ref.content
    assert res.comments.count("parked") >= 10
    m_ref, m = await metrics(http, ref_srv.url), await metrics(http, srv.url)
    key = "llamacpp:spec_decode_num_accepted_tokens_total"
    assert m[key] == m_ref[key] > 0


async def test_lapsed_lease_resumes_an_api_parked_request(
    start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server("-c", "4096", "-np", "2", "-kvu", "--slots", "--metrics", "--park-lease", "3")
    t_parked: list[float] = []
    watchers: list[asyncio.Task[None]] = []

    async def park_once(res: StreamResult) -> None:
        if len(res.tokens) != 50:
            return
        st, body, _ = await post_action(http, srv.url, 0, "park", None, headers=LEASE)
        assert st == 200, body
        t_parked.append(time.monotonic())
        kv = await get_json(http, srv.url + "/kv", headers=LEASE)
        assert kv["lease"]["held"] is True and kv["slots"][0]["park"]["auto"] is False
        # a dashboard reading /kv and /slots without the header does not keep the request parked

        async def watch() -> None:
            for _ in range(20):
                await get_json(http, srv.url + "/kv")
                await get_json(http, srv.url + "/slots")
                await asyncio.sleep(0.2)

        watchers.append(asyncio.create_task(watch()))

    res = await stream_completion(http, srv.url, request("Lease", 150, id_slot=0), on_chunk=park_once)
    await asyncio.gather(*watchers)
    assert_all_complete([res], 150)
    waited = time.monotonic() - t_parked[0]
    assert 3.0 <= waited < 10.0, f"resumed after {waited:.1f} s, lease is 3 s"
    assert res.comments.count("parked") == 1 and res.comments.count("resumed") == 1


async def test_auto_parked_slots_wait_for_the_lease_holder(
    start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server("-c", "2048", "-np", "2", "-kvu", "--slots", "--metrics", "--park-lease", "30")
    holding = True
    seen: dict[str, Any] = {}

    async def controller() -> None:
        # renews the lease like kvctl does, and notes an auto-parked slot
        while holding:
            kv = await get_json(http, srv.url + "/kv", headers=LEASE)
            for s in kv["slots"]:
                if s["state"] == "parked" and s["park"]["auto"]:
                    seen.setdefault("parked", s)
            await asyncio.sleep(0.1)

    ctl = asyncio.create_task(controller())
    streams = [
        asyncio.create_task(stream_completion(http, srv.url, request(f"Lease holder {i}", 1500, id_slot=i)))
        for i in range(2)
    ]
    done, pending = await asyncio.wait(streams, return_when=asyncio.FIRST_COMPLETED)
    first = done.pop().result()
    assert_all_complete([first], 1500)
    assert "parked" in seen, "the pool must have overflowed into an auto-park"
    # the pool is empty now, but the lease holder decides: the auto-parked one stays parked
    await asyncio.sleep(1.5)
    kv = await get_json(http, srv.url + "/kv", headers=LEASE)
    parked = [s for s in kv["slots"] if s["state"] == "parked"]
    assert len(parked) == 1 and parked[0]["park"]["auto"] is True
    st, body, _ = await post_action(http, srv.url, parked[0]["id"], "resume", None, headers=LEASE)
    assert st == 200, body
    holding = False
    await ctl
    assert_all_complete([await pending.pop()], 1500)
