"""The disk tier (patches 35-38) through kvctl, on SmolLM2-135M-Instruct: parks go to the server's --park-disk when
host RAM holds nothing, every chat completes, and a forced park through a file gives the unparked run's ids."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.llama import get_json, parse_metrics, stream_completion
from tests.harness import ServerFactory, assert_complete, request, running_app

pytestmark = pytest.mark.server


def snapshot_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.suffix == ".snap")


async def test_a_burst_with_no_ram_for_snapshots_completes_every_chat_on_disk(
    start_server: ServerFactory, smollm2: Path, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    disk = tmp_path / "park"
    disk.mkdir()
    # 3 chats of ~20 + 400 cells against a pool of 1024: one must give way; --park-ram 1 (MiB) holds no snapshot of
    # SmolLM2 (~23 KiB a cell) past 45 cells, so kvctl parks to the disk tier
    srv = start_server(
        *("-c", "1024", "-np", "3", "-kvu", "--slots", "--metrics", "--no-auto-park"),
        *("--park-ram", "1", "--park-disk", str(disk), "--park-disk-mib", "64"),
        model=smollm2,
    )
    async with running_app(srv.url) as (app, url, admin):
        prompts = [f"Write a long story about lighthouse number {i}." for i in range(3)]
        results = await asyncio.gather(
            *[stream_completion(http, url, request(p, 400, byte_tokens=True)) for p in prompts]
        )
        assert_complete(list(results), 400)
        async with http.get(admin + "/metrics") as resp:
            text = await resp.text()
        parse_metrics(text)  # every sample typed
        parks = {"ram": 0.0, "disk": 0.0, "none": 0.0}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "kvctl_parks_total":
                    parks[s.labels["tier"]] += s.value
        assert parks["disk"] >= 1 and parks["ram"] == 0, parks
        assert app.loop.state.parks == parks["disk"] + parks["none"]
        status = await get_json(http, admin + "/status")
        assert status["pool"]["disk"]["dir"] == str(disk)
    kv = await get_json(http, srv.url + "/kv")
    d = kv["park_disk"]
    assert d["writes"] >= 1 and d["reads"] == d["writes"] and d["fallbacks"] == 0
    assert d["files"] == 0 and d["used_bytes"] == 0
    assert snapshot_files(disk) == []
    assert "Context size has been exceeded" not in srv.log_text()


async def test_forced_parks_through_files_give_the_unparked_ids(
    start_server: ServerFactory, smollm2: Path, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    disk = tmp_path / "park"
    disk.mkdir()
    body = request("The lighthouse keeper wrote in the log that", 160, slot=0, byte_tokens=True)
    pool = ("-c", "2048", "-np", "1", "--slots", "--no-cache-idle-slots")
    ref_srv = start_server(*pool, model=smollm2)
    ref = await stream_completion(http, ref_srv.url, body, headers={"X-Token-Ids": "1"})
    ref_srv.stop()
    srv = start_server(
        *pool, *("--park-ram", "1", "--park-disk", str(disk), "--park-test-interval", "32"), model=smollm2
    )
    got = await stream_completion(http, srv.url, body, headers={"X-Token-Ids": "1"})
    assert_complete([ref, got], 160)
    assert got.announced_ids == ref.announced_ids and got.content == ref.content
    d = (await get_json(http, srv.url + "/kv"))["park_disk"]
    # parks every 32 tokens; the first (~40 cells, 0.9 MiB) fits --park-ram 1, the later ones go to disk
    assert got.comments.count("parked") >= 4
    assert d["writes"] >= 3 and d["reads"] == d["writes"] and d["fallbacks"] == 0
    assert snapshot_files(disk) == []
