"""Speculative decoding with a draft model: park/resume keeps the output and the draft state."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from testkit.llama import (
    NO_BYTE_TOKENS,
    StreamResult,
    get_json,
    parse_metrics,
    post_action,
    stream_completion,
)
from tests.harness import ServerFactory


def spec_args(model: Path) -> tuple[str, ...]:
    # the same weights as draft: under greedy sampling every draft would be accepted
    return (
        "-c",
        "4096",
        "-np",
        "2",
        "-kvu",
        "--slots",
        "--metrics",
        "--no-cache-idle-slots",
        "--model-draft",
        str(model),
        "--spec-type",
        "draft-simple",
        "--spec-draft-n-max",
        "4",
    )


REQ: dict[str, Any] = {
    "prompt": "Draft and verify",
    "n_predict": 400,
    "ignore_eos": True,
    "id_slot": 0,
    "cache_prompt": False,
    "logit_bias": NO_BYTE_TOKENS,
}


async def accepted(http: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    async with http.get(url + "/metrics") as resp:
        m = parse_metrics(await resp.text())
    return m["llamacpp:spec_decode_num_accepted_tokens_total"], m["llamacpp:spec_decode_num_draft_tokens_total"]


async def test_park_resume_keeps_output_and_acceptance(
    start_server: ServerFactory, tiny_model: Path, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*spec_args(tiny_model))
    ref = await stream_completion(http, srv.url, REQ)
    assert ref.status == 200 and len(ref.tokens) == 400
    acc_ref, drafted_ref = await accepted(http, srv.url)
    assert acc_ref > 200, "the draft model must be accepted, or acceptance cannot show a lost draft state"

    kv_seen: list[dict[str, Any]] = []
    parks: list[dict[str, Any]] = []

    async def park_resume(res: StreamResult) -> None:
        # with drafts, several tokens arrive per step: act on the first chunk past each mark
        mark = (len(parks) + 1) * 90
        if len(parks) >= 3 or len(res.tokens) < mark:
            return
        kv = await get_json(http, srv.url + "/kv")
        kv_seen.append(kv)
        st, body, _ = await post_action(http, srv.url, 0, "park")
        assert st == 200, body
        assert body["n_bytes_draft"] > 0 and body["n_cells_draft"] > 0
        kv_parked = await get_json(http, srv.url + "/kv")
        # only this slot holds cells: parking empties both pools
        assert kv_parked["n_cells_used"] == 0 and kv_parked["draft"]["n_cells_used"] == 0
        assert body["n_cells_draft"] >= kv["draft"]["n_cells_used"] > 0
        await asyncio.sleep(0.2)
        st, rbody, _ = await post_action(http, srv.url, 0, "resume")
        assert st == 200, rbody
        parks.append(body)

    res = await stream_completion(http, srv.url, REQ, on_chunk=park_resume)
    acc, drafted = await accepted(http, srv.url)

    assert len(parks) == 3
    assert res.status == 200 and res.tokens == ref.tokens and res.content == ref.content
    assert res.n_decoded == list(range(1, 401))
    # a draft context that lost its state on resume would still give the same output, but fewer accepted drafts
    assert acc - acc_ref == acc_ref
    assert drafted - drafted_ref == drafted_ref

    kv = kv_seen[0]
    assert kv["draft"] is not None and kv["draft"]["source"] == "exact"
    assert kv["bytes_per_cell"] == 2 * 2 * 2 * 64 * 2  # target + draft, each 2 layers x (K + V) x 64 x f16
    assert kv["next_step"]["n_gen"] == 1
    assert kv["next_step"]["n_draft_max"] == 4
    assert kv["slots"][0]["n_draft_max"] == 4
    assert kv["next_step"]["n_total_max"] == 5
