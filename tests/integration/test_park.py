"""Park and resume running requests on the real patched server: nothing lost, nothing repeated."""

from __future__ import annotations

import asyncio
import time
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

POOL = ("-c", "4096", "-np", "3", "-kvu", "--slots", "--metrics", "--no-cache-idle-slots")


def assert_continuous(res: StreamResult, n_predict: int) -> None:
    """Client-side view of one stream: every token once, in order, up to n_predict."""
    assert res.status == 200 and res.error is None, res.error
    assert res.n_decoded == list(range(1, n_predict + 1))
    assert len(res.tokens) == n_predict
    assert res.final is not None and res.final["tokens_predicted"] == n_predict


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        return parse_metrics(await resp.text())


async def test_solo_stream_parked_four_times_is_exact(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server(*POOL)
    req = request("In a hole in the ground there lived", 1000, 0, temperature=0)
    ref = await stream_completion(http, srv.url, req)
    assert_continuous(ref, 1000)
    assert len(set(ref.tokens)) > 500, "the model must not loop, or exactness proves nothing"

    parks: list[dict[str, Any]] = []

    async def park_and_resume(res: StreamResult) -> None:
        if len(res.tokens) not in (100, 300, 550, 800):
            return
        kv_before = await get_json(http, srv.url + "/kv")
        status, body, _ = await post_action(http, srv.url, 0, "park", {"id_task": kv_before["slots"][0]["id_task"]})
        assert status == 200, body
        kv = await get_json(http, srv.url + "/kv")
        slot = kv["slots"][0]
        assert slot["state"] == "parked" and slot["n_cells"] == 0
        assert slot["park"]["bytes"] == body["n_bytes"] > 0 and slot["park"]["parked_since_ms"] is not None
        assert kv["n_parked"] == 1 and kv["parked_bytes"] == body["n_bytes"]
        # the stream goes on between the two reads; only the parked slot held cells
        assert kv["n_cells_used"] == 0
        assert body["n_cells"] >= kv_before["slots"][0]["n_cells"] > 0
        m = await metrics(http, srv.url)
        assert m["llamacpp:slots_parked"] == 1 and m["llamacpp:parked_bytes"] == body["n_bytes"]
        await asyncio.sleep(0.3)
        status, rbody, _ = await post_action(http, srv.url, 0, "resume")
        assert status == 200, rbody
        assert rbody["n_cells"] == body["n_cells"] and rbody["t_parked_ms"] >= 300
        kv = await get_json(http, srv.url + "/kv")
        assert kv["slots"][0]["state"] == "generating" and kv["n_cells_used"] >= body["n_cells"]
        parks.append(body)

    res = await stream_completion(http, srv.url, req, on_chunk=park_and_resume)

    assert len(parks) == 4
    assert_continuous(res, 1000)
    assert res.tokens == ref.tokens
    assert res.content == ref.content
    assert res.comments.count("parked") == 4 and res.comments.count("resumed") == 4
    assert [p["park_count"] for p in parks] == [1, 2, 3, 4]
    m = await metrics(http, srv.url)
    assert m["llamacpp:slot_parks_total"] == 4 and m["llamacpp:slot_resumes_total"] == 4
    assert m["llamacpp:slots_parked"] == 0 and m["llamacpp:parked_bytes"] == 0


async def test_parked_stream_gets_keepalives_and_parked_time_is_not_generation_time(
    start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL)
    req = request("A long time ago", 200, 1, temperature=0)
    parked_s = 6.0

    async def park_once(res: StreamResult) -> None:
        if len(res.tokens) == 50:
            assert (await post_action(http, srv.url, 1, "park"))[0] == 200
            await asyncio.sleep(parked_s)
            assert (await post_action(http, srv.url, 1, "resume"))[0] == 200

    t0 = time.monotonic()
    res = await stream_completion(http, srv.url, req, on_chunk=park_once)
    wall_ms = (time.monotonic() - t0) * 1000
    assert_continuous(res, 200)
    i_parked, i_resumed = res.comments.index("parked"), res.comments.index("resumed")
    assert "keep-alive" in res.comments[i_parked:i_resumed]
    assert res.final is not None
    # the 6 s parked are in the wall time, not in the generation timings
    assert res.final["timings"]["predicted_ms"] < wall_ms - parked_s * 1000 * 0.8


async def test_three_streams_one_parked_repeatedly(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server(*POOL)
    kv_idle = await get_json(http, srv.url + "/kv")
    n_predict = 400
    prompts = ["Alpha beta gamma", "One two three four", "Red green blue"]
    parks = 0

    async def park_resume(res: StreamResult) -> None:
        nonlocal parks
        if len(res.tokens) % 60 == 0 and len(res.tokens) < n_predict - 20:
            status, body, _ = await post_action(http, srv.url, 1, "park")
            assert status == 200, body
            await asyncio.sleep(0.2)
            status, body, _ = await post_action(http, srv.url, 1, "resume")
            assert status == 200, body
            parks += 1

    results = await asyncio.gather(
        stream_completion(http, srv.url, request(prompts[0], n_predict, 0, temperature=0)),
        stream_completion(http, srv.url, request(prompts[1], n_predict, 1, temperature=0), on_chunk=park_resume),
        stream_completion(http, srv.url, request(prompts[2], n_predict, 2, temperature=0)),
    )
    assert parks >= 5
    for res in results:
        assert_continuous(res, n_predict)
    assert results[1].comments.count("parked") == parks

    kv = await get_json(http, srv.url + "/kv")
    assert kv["n_parked"] == 0 and kv["parked_bytes"] == 0
    # back to idle: each slot holds its finished sequence, no cell leaked by the parks
    for s, res in zip(kv["slots"], results, strict=True):
        assert s["state"] == "idle"
        assert s["n_cells"] == res.final["tokens_evaluated"] + n_predict - 1  # type: ignore[index]
    assert kv["n_cells_used"] == sum(s["n_cells"] for s in kv["slots"])
    assert kv_idle["n_cells_used"] == 0


async def test_cancel_while_parked_frees_the_slot(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server(*POOL)
    req = request("The cancelled request", 300, 2, temperature=0)

    class HangUp(Exception):
        pass

    async def park_then_hang_up(res: StreamResult) -> None:
        if len(res.tokens) == 40:
            assert (await post_action(http, srv.url, 2, "park"))[0] == 200
            raise HangUp  # the client goes away while parked: its connection closes

    # the client's own session: leaving it closes its connection, as a client process that exits
    with pytest.raises(HangUp):
        async with aiohttp.ClientSession() as client:
            await stream_completion(client, srv.url, req, on_chunk=park_then_hang_up)

    deadline = time.monotonic() + 10
    while True:
        kv = await get_json(http, srv.url + "/kv")
        if kv["slots"][2]["state"] == "idle":
            break
        assert time.monotonic() < deadline, f"slot still {kv['slots'][2]['state']}"
        await asyncio.sleep(0.1)
    assert kv["slots"][2]["n_cells"] == 0 and kv["n_parked"] == 0 and kv["parked_bytes"] == 0
    assert kv["n_cells_used"] == 0

    # the slot is reusable: a new request on it runs in full and matches a fresh server's output
    res = await stream_completion(http, srv.url, request("After the cancel", 120, 2, temperature=0))
    assert_continuous(res, 120)
    other = start_server(*POOL)
    ref = await stream_completion(http, other.url, request("After the cancel", 120, 2, temperature=0))
    assert res.tokens == ref.tokens


async def test_only_parked_slots_do_not_spin_the_loop(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server(*POOL)
    cpu: list[float] = []

    async def park_and_measure(res: StreamResult) -> None:
        if len(res.tokens) == 30:
            assert (await post_action(http, srv.url, 0, "park"))[0] == 200
            assert srv.proc is not None
            proc = psutil.Process(srv.proc.pid)
            t0 = proc.cpu_times()
            await asyncio.sleep(2.0)
            t1 = proc.cpu_times()
            cpu.append((t1.user + t1.system) - (t0.user + t0.system))
            assert (await post_action(http, srv.url, 0, "resume"))[0] == 200

    res = await stream_completion(
        http, srv.url, request("Idle while parked", 80, 0, temperature=0), on_chunk=park_and_measure
    )
    assert_continuous(res, 80)
    # a busy loop would burn ~2 s of CPU in 2 s; parked, the server only polls
    assert cpu[0] < 0.5, f"server used {cpu[0]:.2f} s of CPU in 2 s with only a parked slot"


async def test_non_streaming_request_survives_a_park(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server(*POOL)
    body = {**request("Plain JSON please", 300, 0, temperature=0), "return_tokens": True}
    async with http.post(srv.url + "/completion", json=body) as resp:
        ref = await resp.json()

    async def client() -> dict[str, Any]:
        async with http.post(srv.url + "/completion", json=body) as resp:
            assert resp.status == 200
            return dict(await resp.json())

    task = asyncio.create_task(client())
    while True:
        kv = await get_json(http, srv.url + "/kv")
        if kv["slots"][0]["state"] == "generating" and kv["slots"][0]["n_decoded"] >= 50:
            break
        await asyncio.sleep(0.005)
    assert (await post_action(http, srv.url, 0, "park"))[0] == 200
    await asyncio.sleep(0.5)
    assert (await post_action(http, srv.url, 0, "resume"))[0] == 200
    out = await task
    assert out["tokens"] == ref["tokens"] and out["content"] == ref["content"]
    assert out["tokens_predicted"] == 300
