"""Every bad park/resume request gets a clear error with the status table's code, and nothing is lost."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from testkit.llama import (
    StreamResult,
    get_json,
    parse_metrics,
    post_action,
    stream_completion,
)
from tests.harness import ServerFactory, request

POOL = ("-c", "2048", "-np", "3", "-kvu", "--slots", "--metrics", "--no-cache-idle-slots")


def assert_error(status: int, body: dict[str, Any], code: int, etype: str, words: str) -> None:
    assert status == code, body
    err = body["error"]
    assert err["code"] == code and err["type"] == etype, err
    assert words in err["message"], err["message"]


async def test_bad_requests_on_an_idle_server(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server(*POOL)
    for slot in ("abc", "-1", "1x", "", "99999999999"):
        st, body, _ = await post_action(http, srv.url, slot, "park")
        if slot == "":
            assert st in (400, 404)  # /slots/ does not match the route at all
            continue
        assert_error(st, body, 400, "invalid_request_error", "Invalid slot ID")
    st, body, _ = await post_action(http, srv.url, 3, "park")
    assert_error(st, body, 404, "not_found_error", "slot 3 not found")
    st, body, _ = await post_action(http, srv.url, 0, "explode")
    assert_error(st, body, 400, "invalid_request_error", "Invalid action")
    for bad in ("{not json", "[1, 2]", '"text"', '{"id_task": "7"}', '{"id_task": -3}', '{"id_task": 1.5}'):
        st, body, _ = await post_action(http, srv.url, 0, "park", bad)
        assert_error(st, body, 400, "invalid_request_error", "Invalid")
    st, body, _ = await post_action(http, srv.url, 0, "park")
    assert_error(st, body, 409, "conflict_error", "not parkable in state 'idle'")
    st, body, _ = await post_action(http, srv.url, 0, "resume")
    assert_error(st, body, 409, "conflict_error", "is not parked")
    # and the server keeps serving
    async with http.post(srv.url + "/completion", json=request("still fine", 8, 0)) as resp:
        assert resp.status == 200
    async with http.get(srv.url + "/metrics") as resp:
        m = parse_metrics(await resp.text())
    # 400s are refused before they reach a slot; the unknown slot and the idle slot count as failures
    assert m["llamacpp:slot_park_failures_total"] == 2 and m["llamacpp:slot_resume_failures_total"] == 1


async def test_conflicts_on_a_running_request(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server(*POOL)
    checks: list[str] = []

    async def probe(res: StreamResult) -> None:
        if len(res.tokens) != 30:
            return
        id_task = (await get_json(http, srv.url + "/slots"))[1]["id_task"]
        st, body, _ = await post_action(http, srv.url, 1, "park", {"id_task": id_task + 1000})
        assert_error(st, body, 409, "conflict_error", f"does not serve task {id_task + 1000}")
        st, body, _ = await post_action(http, srv.url, 1, "resume")
        assert_error(st, body, 409, "conflict_error", "is not parked (state 'generating')")
        st, body, _ = await post_action(http, srv.url, 1, "park", {"id_task": id_task})
        assert st == 200 and body["id_task"] == id_task
        st, body, _ = await post_action(http, srv.url, 1, "park")
        assert_error(st, body, 409, "conflict_error", "already parked")
        st, body, _ = await post_action(http, srv.url, 1, "resume", {"id_task": id_task + 1})
        assert_error(st, body, 409, "conflict_error", "does not serve task")
        kv = await get_json(http, srv.url + "/kv")
        assert kv["slots"][1]["state"] == "parked", "a refused resume must leave the slot parked"
        st, body, _ = await post_action(http, srv.url, 1, "resume", {"id_task": id_task})
        assert st == 200, body
        checks.append("done")

    res = await stream_completion(http, srv.url, request("conflicts", 120, 1), on_chunk=probe)
    assert checks == ["done"]
    assert res.status == 200 and res.n_decoded == list(range(1, 121))


async def test_resume_without_room_keeps_the_snapshot(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    args = ("-c", "1024", "-np", "2", "-kvu", "--slots", "--metrics", "--no-cache-idle-slots")
    srv = start_server(*args)
    ref_srv = start_server(*args)
    req = request("Waiting for room", 400, 0)
    ref = await stream_completion(http, ref_srv.url, req)
    events: list[str] = []

    async def squeeze(res: StreamResult) -> None:
        if len(res.tokens) != 200:
            return
        st, parked, _ = await post_action(http, srv.url, 0, "park")
        assert st == 200
        # another request fills the pool while slot 0 is parked, and is still running
        filler_started = asyncio.Event()

        async def on_filler(r: StreamResult) -> None:
            if len(r.tokens) == 5:
                filler_started.set()

        filler = asyncio.create_task(
            stream_completion(http, srv.url, request([1000 + i for i in range(880)], 60, 1), on_chunk=on_filler)
        )
        await filler_started.wait()
        st, body, headers = await post_action(http, srv.url, 0, "resume")
        assert_error(st, body, 503, "unavailable_error", "not enough free KV cells")
        assert headers.get("Retry-After") == "1"
        kv = await get_json(http, srv.url + "/kv")
        assert kv["slots"][0]["state"] == "parked" and kv["parked_bytes"] == parked["n_bytes"]
        # once the filler is done, its cells are only a cached prompt: they give way to the resume
        assert (await filler).status == 200
        kv = await get_json(http, srv.url + "/kv")
        assert kv["slots"][1]["state"] == "idle" and kv["n_cells_free"] < parked["n_cells"]
        st, body, _ = await post_action(http, srv.url, 0, "resume")
        assert st == 200, body
        kv = await get_json(http, srv.url + "/kv")
        assert kv["slots"][1]["n_cells"] == 0
        events.append("resumed")

    res = await stream_completion(http, srv.url, req, on_chunk=squeeze)
    assert events == ["resumed"]
    assert res.n_decoded == list(range(1, 401))
    assert res.tokens == ref.tokens


async def test_park_budget_exceeded_frees_nothing(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    # 1 MiB budget at 512 B per cell: a 2100-cell sequence does not fit, and an explicit swap frees nothing
    # (without a mode the server parks it by recompute: test_safety_net.py, tests/upstream)
    srv = start_server(
        "-c", "4096", "-np", "2", "-kvu", "--slots", "--metrics", "--no-cache-idle-slots", "--park-ram", "1"
    )
    kv = await get_json(http, srv.url + "/kv")
    assert kv["park_ram_budget_bytes"] == 1024 * 1024
    prompt = [1000 + i for i in range(2100)]  # token ids: an exact length
    seen: list[int] = []

    async def try_park(res: StreamResult) -> None:
        if len(res.tokens) != 20:
            return
        before = await get_json(http, srv.url + "/kv")
        assert before["slots"][0]["n_cells"] * before["bytes_per_cell"] > 1024 * 1024
        st, body, headers = await post_action(http, srv.url, 0, "park", {"mode": "swap"})
        assert_error(st, body, 503, "unavailable_error", "park budget exceeded")
        assert headers.get("Retry-After") == "1"
        after = await get_json(http, srv.url + "/kv")
        assert after["slots"][0]["state"] == "generating" and after["n_parked"] == 0
        seen.append(st)

    res = await stream_completion(http, srv.url, request(prompt, 60, 0), on_chunk=try_park)
    assert seen == [503]
    assert res.n_decoded == list(range(1, 61))


async def test_parking_disabled_is_501(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server(*POOL, "--no-park")
    for action in ("park", "resume"):
        st, body, _ = await post_action(http, srv.url, 0, action)
        assert_error(st, body, 501, "not_supported_error", "--no-park")
    assert (await get_json(http, srv.url + "/kv"))["park_modes"] == []


async def test_park_ram_0_refuses_a_swap_with_501(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server(*POOL, "--park-ram", "0")
    assert (await get_json(http, srv.url + "/kv"))["park_modes"] == ["recompute"]
    st, body, _ = await post_action(http, srv.url, 0, "park", {"mode": "swap"})
    assert_error(st, body, 501, "not_supported_error", "recompute only")


@pytest.mark.parametrize("n_cmpl", [2])
async def test_shared_prompt_slots_are_not_parkable(
    start_server: ServerFactory, http: aiohttp.ClientSession, n_cmpl: int
) -> None:
    srv = start_server(*POOL)
    errors: list[dict[str, Any]] = []

    async def client() -> int:
        async with http.post(
            srv.url + "/completion", json={"prompt": "siblings", "n_predict": 300, "ignore_eos": True, "n_cmpl": n_cmpl}
        ) as r:
            return r.status

    task = asyncio.create_task(client())
    while True:
        slots = await get_json(http, srv.url + "/slots")
        busy = [s for s in slots if s["state"] == "generating"]
        if len(busy) == n_cmpl:
            break
        await asyncio.sleep(0.01)
    st, body, _ = await post_action(http, srv.url, busy[0]["id"], "park")
    errors.append(body)
    assert_error(st, body, 409, "conflict_error", "shares its cells")
    assert await task == 200
