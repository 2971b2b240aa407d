"""GET /kv, the new /slots fields and the pool metrics on the real patched server."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from testkit.llama import get_json, parse_metrics, stream_completion
from tests.harness import ServerFactory

POOL = ("-c", "2048", "-np", "3", "-kvu", "--slots", "--metrics", "--no-cache-idle-slots")
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def assert_consistent(kv: dict[str, Any]) -> None:
    """Invariants of one snapshot: exact counts add up, and next_step is the sum of its parts."""
    assert kv["source"] == "exact"
    assert kv["n_cells_used"] + kv["n_cells_free"] == kv["n_cells"]
    assert abs(kv["used_ratio"] - kv["n_cells_used"] / kv["n_cells"]) < 1e-9
    # every cell belongs to exactly one slot (no n_cmpl sharing here)
    assert kv["n_cells_used"] == sum(s["n_cells"] for s in kv["slots"])
    nxt = kv["next_step"]
    assert nxt["n_total_max"] == nxt["n_gen"] + nxt["n_draft_max"] + nxt["n_prompt_max"]
    assert nxt["n_gen"] == sum(s["state"] == "generating" for s in kv["slots"])
    assert kv["n_slots"] == len(kv["slots"])
    assert kv["n_slots_idle"] == sum(s["state"] == "idle" for s in kv["slots"])


async def test_kv_counts_prompt_plus_generated_tokens(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server(*POOL)
    kv = await get_json(http, srv.url + "/kv")
    assert_consistent(kv)
    assert kv["n_cells"] == 2048 and kv["n_cells_used"] == 0
    assert kv["draft"] is None
    assert kv["bytes_per_cell"] == 2 * 2 * 64 * 2  # 2 layers x (K + V) x 64 dims x f16

    n_predict = 40
    async with http.post(
        srv.url + "/completion",
        json={
            "prompt": PROMPT,
            "n_predict": n_predict,
            "ignore_eos": True,
            "id_slot": 1,
        },
    ) as resp:
        assert resp.status == 200
        done = await resp.json()
    n_prompt = done["tokens_evaluated"]

    kv = await get_json(http, srv.url + "/kv")
    assert_consistent(kv)
    # the idle slot keeps its cells; the last sampled token was never decoded
    assert kv["n_cells_used"] == n_prompt + n_predict - 1
    slot = kv["slots"][1]
    assert slot["state"] == "idle" and slot["n_cells"] == n_prompt + n_predict - 1
    assert kv["next_step"] == {"n_gen": 0, "n_draft_max": 0, "n_prompt_max": 0, "n_total_max": 0}


async def test_slots_fields_while_generating(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server(*POOL)
    seen: list[dict[str, Any]] = []
    t_before = int(time.time() * 1000)

    async def probe(res: Any) -> None:
        if len(res.tokens) == 30:
            slots = await get_json(http, srv.url + "/slots")
            kv = await get_json(http, srv.url + "/kv")
            seen.append({"slots": slots, "kv": kv})

    res = await stream_completion(
        http,
        srv.url,
        {"prompt": PROMPT, "n_predict": 1500, "ignore_eos": True, "id_slot": 2},
        headers={"X-Request-Id": "req-abc-123"},
        on_chunk=probe,
    )
    assert res.status == 200 and res.final is not None and res.final["tokens_predicted"] == 1500
    slots, kv = seen[0]["slots"], seen[0]["kv"]
    assert_consistent(kv)

    s = slots[2]
    # upstream fields keep their meaning
    for key in ("id", "n_ctx", "speculative", "is_processing", "id_task", "n_prompt_tokens", "params", "next_token"):
        assert key in s, key
    assert s["is_processing"] is True
    assert s["state"] == "generating"
    assert s["request_id"] == "req-abc-123"
    assert t_before <= s["t_arrival_ms"] <= int(time.time() * 1000)
    assert s["n_prompt"] == res.final["tokens_evaluated"]  # type: ignore[index]
    assert s["n_decoded"] >= 30 and s["n_draft_max"] == 0
    assert s["n_cells"] == s["n_prompt"] + s["n_decoded"] - 1 or s["n_cells"] == s["n_prompt"] + s["n_decoded"]
    assert s["n_prefill_left"] == 0
    assert s["park"] == {
        "mode": None,
        "n_cells": None,
        "recomputing": False,
        "count": 0,
        "bytes": 0,
        "t_parked_total_ms": 0,
        "parked_since_ms": None,
        "auto": False,
        "test": False,
        "copy": None,  # "save" or "load" while a sliced park or resume copies
        "tier": None,  # "ram", "disk" or "none" (a recompute) while parked
    }
    assert slots[0]["state"] == "idle" and slots[0]["request_id"] is None

    k = kv["slots"][2]
    assert k["id"] == 2 and k["id_task"] == s["id_task"] and k["state"] == "generating"
    # at a quiescent point the last sampled token is pending, not yet in the pool
    assert k["n_cells"] == k["n_prompt"] + k["n_decoded"] - 1
    assert kv["next_step"]["n_gen"] == 1 and kv["next_step"]["n_prompt_max"] == 0


async def test_next_step_counts_the_prefill_batch(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    # a small batch makes the prefill take many steps, so a poll lands inside it
    srv = start_server(*POOL, "-b", "32", "-ub", "32")
    gen = asyncio.create_task(
        stream_completion(
            http, srv.url, {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, "id_slot": 0}
        )
    )
    long_prompt = [1000 + i for i in range(1200)]  # token ids: an exact length
    snapshots: list[dict[str, Any]] = []

    async def poll() -> None:
        while True:
            snapshots.append(await get_json(http, srv.url + "/kv"))
            await asyncio.sleep(0.005)

    while True:  # the generating stream is running before the long prompt arrives
        kv = await get_json(http, srv.url + "/kv")
        if kv["slots"][0]["state"] == "generating":
            break
        await asyncio.sleep(0.01)
    poller = asyncio.create_task(poll())
    async with http.post(srv.url + "/completion", json={"prompt": long_prompt, "n_predict": 4, "id_slot": 1}) as resp:
        assert resp.status == 200
    poller.cancel()
    await gen

    during = [kv for kv in snapshots if kv["slots"][1]["state"] == "prompt" and kv["slots"][1]["n_cells"] > 0]
    assert during, "no snapshot caught the prefill"
    for kv in during:
        assert_consistent(kv)
        s = kv["slots"][1]
        left = s["n_prompt"] - s["n_cells"]
        n_gen = kv["next_step"]["n_gen"]
        assert kv["next_step"]["n_prompt_max"] == min(32 - n_gen, left)


async def test_metrics_agree_with_kv(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server(*POOL)
    async with http.post(srv.url + "/completion", json={"prompt": PROMPT, "n_predict": 25, "ignore_eos": True}) as resp:
        assert resp.status == 200
    kv = await get_json(http, srv.url + "/kv")
    async with http.get(srv.url + "/metrics") as resp:
        assert resp.status == 200
        m = parse_metrics(await resp.text())
    assert m["llamacpp:kv_cells"] == kv["n_cells"] == 2048
    assert m["llamacpp:kv_cells_used"] == kv["n_cells_used"] > 0
    assert abs(m["llamacpp:kv_cache_usage_ratio"] - kv["used_ratio"]) < 1e-6
    assert m["llamacpp:slots_parked"] == 0 and m["llamacpp:parked_bytes"] == 0
    for name in ("slot_parks_total", "slot_resumes_total", "slot_park_failures_total", "slot_resume_failures_total"):
        assert m[f"llamacpp:{name}"] == 0


async def test_kv_is_refused_without_slots_endpoint(start_server: ServerFactory, http: aiohttp.ClientSession) -> None:
    srv = start_server("-c", "1024", "-np", "2", "--no-slots")
    async with http.get(srv.url + "/kv") as resp:
        assert resp.status == 501
        assert "--slots" in (await resp.json())["error"]["message"]
