"""The seed's configuration in miniature: hybrid memory (Qwen3.5: attention KV + recurrent state)
with MTP drafting, parked and resumed exactly."""

from __future__ import annotations

import asyncio
from pathlib import Path
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

ACCEPTED = "llamacpp:spec_decode_num_accepted_tokens_total"
# every request here: the Qwen vocab keeps its byte tokens (NO_BYTE_TOKENS are the llama SPM vocab's ids), no
# prompt cache
QWEN: dict[str, Any] = {"byte_tokens": True, "cache_prompt": False}


def args(*extra: str, n_ctx: int = 4096) -> tuple[str, ...]:
    return ("-c", str(n_ctx), "-np", "4", "-kvu", "--slots", "--metrics", *extra)


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        return parse_metrics(await resp.text())


def assert_complete(res: StreamResult, n_predict: int) -> None:
    assert res.status == 200 and res.error is None, res.error
    assert res.final is not None and res.final["tokens_predicted"] == n_predict
    # byte-level BPE: a token ending inside a UTF-8 sequence shares the next token's chunk
    assert res.n_decoded == sorted(set(res.n_decoded)) and res.n_decoded[-1] == n_predict


async def test_mtp_park_resume_is_exact_with_the_same_acceptance(
    start_server: ServerFactory, qwen35_model: Path, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*args("--spec-type", "draft-mtp"), model=qwen35_model)
    req = request("Once upon a time", 600, id_slot=0, **QWEN)
    ref = await stream_completion(http, srv.url, req)
    assert_complete(ref, 600)
    acc_ref = (await metrics(http, srv.url))[ACCEPTED]
    assert acc_ref > 100, "MTP drafts must be accepted, or acceptance cannot show a lost draft state"
    assert len(set(ref.tokens)) > 300

    parks: list[dict[str, Any]] = []

    async def park_resume(res: StreamResult) -> None:
        mark = (len(parks) + 1) * 120
        if len(parks) >= 4 or res.n_decoded[-1] < mark:
            return
        kv_before = await get_json(http, srv.url + "/kv")
        st, body, _ = await post_action(http, srv.url, 0, "park")
        assert st == 200, body
        kv = await get_json(http, srv.url + "/kv")
        # hybrid memory: the attention cells of both pools go; the snapshot carries the recurrent state too
        assert kv["source"] == "exact" and kv["n_cells_used"] == 0
        assert kv["draft"] is not None and kv["draft"]["n_cells_used"] == 0
        assert body["n_cells"] >= kv_before["slots"][0]["n_cells"] > 0
        assert body["n_cells_draft"] > 0 and body["n_bytes_draft"] > 0
        assert body["n_bytes"] - body["n_bytes_draft"] > body["n_cells"] * kv_before["bytes_per_cell"] // 2
        assert kv["slots"][0]["state"] == "parked" and kv["slots"][0]["park"]["bytes"] == body["n_bytes"]
        await asyncio.sleep(0.2)
        st, rbody, _ = await post_action(http, srv.url, 0, "resume")
        assert st == 200, rbody
        parks.append(body)

    res = await stream_completion(http, srv.url, req, on_chunk=park_resume)
    acc = (await metrics(http, srv.url))[ACCEPTED] - acc_ref
    assert len(parks) == 4
    assert_complete(res, 600)
    assert res.tokens == ref.tokens and res.content == ref.content
    # the target verifies every token, so a lost MTP state only shows as fewer accepted drafts
    assert acc == acc_ref


@pytest.mark.parametrize("drafting", [False, True], ids=["plain", "draft-mtp"])
async def test_pressure_completes_through_the_safety_net(
    start_server: ServerFactory, qwen35_model: Path, http: aiohttp.ClientSession, drafting: bool
) -> None:
    extra = ("--spec-type", "draft-mtp") if drafting else ()
    srv = start_server(*args(*extra), model=qwen35_model)
    results = await asyncio.gather(
        *[stream_completion(http, srv.url, request(f"Story {i}:", 1500, **QWEN)) for i in range(4)]
    )
    for res in results:
        assert_complete(res, 1500)
    m = await metrics(http, srv.url)
    assert m["llamacpp:slot_auto_parks_total"] > 0
    log = srv.log_text()
    assert "Context size has been exceeded" not in log and "speculative batch index" not in log


async def test_pressure_with_mtp_parks_by_recompute(
    start_server: ServerFactory, qwen35_model: Path, http: aiohttp.ClientSession
) -> None:
    # --park-ram 0: no snapshot at all; the attention cells, the recurrent state and the MTP context are
    # all rebuilt by evaluating the tokens again
    srv = start_server(*args("--spec-type", "draft-mtp", "--park-ram", "0"), model=qwen35_model)
    results = await asyncio.gather(
        *[stream_completion(http, srv.url, request(f"Story {i}:", 1500, **QWEN)) for i in range(4)]
    )
    for res in results:
        assert_complete(res, 1500)
    m = await metrics(http, srv.url)
    assert m["llamacpp:slot_auto_parks_total"] > 0
    assert m["llamacpp:slot_recompute_parks_total"] == m["llamacpp:slot_parks_total"]
    assert m[ACCEPTED] > 0
    log = srv.log_text()
    assert "Context size has been exceeded" not in log and "speculative batch index" not in log


async def test_recompute_parks_with_mtp_keep_the_stream(
    start_server: ServerFactory, qwen35_model: Path, http: aiohttp.ClientSession
) -> None:
    ref_srv = start_server(*args("--spec-type", "draft-mtp"), model=qwen35_model)
    srv = start_server(
        *args("--spec-type", "draft-mtp", "--park-ram", "0", "--park-test-interval", "100"), model=qwen35_model
    )
    req = request("Forced parking by recompute with MTP", 1000, **QWEN)
    ref = await stream_completion(http, ref_srv.url, req)
    res = await stream_completion(http, srv.url, req)
    assert_complete(ref, 1000)
    assert_complete(res, 1000)
    assert res.comments.count("parked") >= 8 and res.comments.count("resumed") == res.comments.count("parked")
    assert res.final is not None and res.final["timings"]["recompute_n"] > 0
    # re-evaluated cells come from batched prefills, the originals from single steps: report, do not hide
    same = next((i for i, (a, b) in enumerate(zip(res.tokens, ref.tokens, strict=False)) if a != b), None)
    m_ref, m = await metrics(http, ref_srv.url), await metrics(http, srv.url)
    print(
        f"MTP, recompute every 100 tokens: first divergence at {same}, "
        f"accepted drafts {m[ACCEPTED]:.0f} (unparked: {m_ref[ACCEPTED]:.0f})"
    )
    assert m[ACCEPTED] > 0


async def test_park_test_interval_with_mtp_is_exact(
    start_server: ServerFactory, qwen35_model: Path, http: aiohttp.ClientSession
) -> None:
    ref_srv = start_server(*args("--spec-type", "draft-mtp"), model=qwen35_model)
    srv = start_server(*args("--spec-type", "draft-mtp", "--park-test-interval", "50"), model=qwen35_model)
    req = request("Forced parking with MTP", 1000, **QWEN)
    ref = await stream_completion(http, ref_srv.url, req)
    res = await stream_completion(http, srv.url, req)
    assert_complete(ref, 1000)
    assert_complete(res, 1000)
    assert res.tokens == ref.tokens and res.content == ref.content
    assert res.comments.count("parked") >= 10
    m_ref, m = await metrics(http, ref_srv.url), await metrics(http, srv.url)
    assert m[ACCEPTED] == m_ref[ACCEPTED] > 0
