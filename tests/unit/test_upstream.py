"""The upstream client's framing and error paths, against a scripted fake server."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestServer
from pydantic import SecretStr

from controller.upstream.client import UpstreamApiError, UpstreamClient, UpstreamProtocolError, UpstreamUnavailable
from controller.upstream.models import ParkMode, SlotState
from tests.fakes.llama_server import FakeLlamaServer, Reply, error, kv_body


@pytest.fixture
async def client(fake_url: str) -> AsyncIterator[UpstreamClient]:
    """A client with an API key (the shared fake and its URL come from conftest.py)."""
    async with UpstreamClient(fake_url, api_key=SecretStr("k3y"), timeout_s=0.5) as c:
        yield c


async def test_kv_is_parsed_and_every_request_holds_the_lease(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    fake.kv = kv_body(2000, [{"state": "generating", "n_cells": 300, "id_task": 7, "t_arrival_ms": 5}])
    kv = await client.get_kv()
    assert kv.n_cells == 2000 and kv.slots[0].state is SlotState.GENERATING and kv.slots[0].id_task == 7
    await client.get_slots()
    await client.park(0, 7)
    await client.resume(0, 7)
    await client.health()
    assert [s.path for s in fake.seen] == ["/kv", "/slots", "/slots/0", "/slots/0", "/health"]
    for seen in fake.seen:
        assert seen.headers["X-Park-Lease"] == "1"
        assert seen.headers["Authorization"] == "Bearer k3y"


async def test_park_and_resume_send_the_task_guard(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    park = await client.park(2, 41)
    assert (park.id_slot, park.id_task, park.timings.park_ms) == (2, 41, 1.5)
    resume = await client.resume(2, 41)
    assert resume.timings.resume_ms == 1.0
    assert [(s.query["action"], s.body) for s in fake.seen] == [
        ("park", b'{"id_task": 41}'),
        ("resume", b'{"id_task": 41}'),
    ]


async def test_park_sends_the_mode_asked_for(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    await client.park(2, 41, ParkMode.RECOMPUTE)
    await client.park(2, None, ParkMode.SWAP)
    await client.park(2, 41)  # the server's choice
    assert [s.body for s in fake.seen] == [
        b'{"id_task": 41, "mode": "recompute"}',
        b'{"mode": "swap"}',
        b'{"id_task": 41}',
    ]
    fake.queue(
        "POST park",
        Reply(
            body={
                "id_slot": 2,
                "id_task": 41,
                "action": "park",
                "mode": "recompute",
                "mode_reason": "requested",
                "n_cells": 300,
                "n_bytes": 0,
                "park_count": 1,
                "timings": {"park_ms": 0.1},
            }
        ),
    )
    park = await client.park(2, 41, ParkMode.RECOMPUTE)
    assert (park.mode, park.mode_reason, park.n_bytes) == (ParkMode.RECOMPUTE, "requested", 0)
    assert (await client.resume(2, 41)).mode is None, "an older server does not say"


async def test_kv_reads_park_modes_and_costs_and_an_older_server_still_parses(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    old = await client.get_kv()
    assert old.park_modes is None and old.host_ram_available_bytes is None
    assert old.park_rates.copy_bytes_per_s is None and old.slots == ()
    fake.kv = kv_body(
        1000,
        [
            {
                "state": "generating",
                "n_cells": 300,
                "id_task": 7,
                "n_prefill_left": 0,
                "park": {"count": 0, "bytes": 0, "t_parked_total_ms": 0, "mode": None, "snapshot_bytes": 160_000},
            },
            {
                "state": "prompt",
                "n_cells": 40,
                "id_task": 8,
                "n_prefill_left": 260,
                "park": {"count": 1, "bytes": 0, "t_parked_total_ms": 5, "mode": "recompute", "recomputing": True},
            },
            {
                "state": "parked",
                "id_task": 9,
                "park": {"count": 1, "bytes": 0, "t_parked_total_ms": 5, "mode": "offload", "n_cells": 120},
            },
        ],
        park_modes=["swap", "recompute", "offload"],  # a mode of a newer server is left out
        host_ram_available_bytes=2**34,
        park_rates={"copy_bytes_per_s": 4.5e9, "prompt_tokens_per_s": None},
    )
    kv = await client.get_kv()
    assert kv.park_modes == (ParkMode.SWAP, ParkMode.RECOMPUTE)
    assert kv.host_ram_available_bytes == 2**34
    assert (kv.park_rates.copy_bytes_per_s, kv.park_rates.prompt_tokens_per_s) == (4.5e9, None)
    gen, prompt, parked = kv.slots
    assert gen.park.snapshot_bytes == 160_000 and gen.park.mode is None
    assert prompt.n_prefill_left == 260 and prompt.park.recomputing and prompt.park.mode is ParkMode.RECOMPUTE
    assert parked.park.mode is None and parked.cells == 120


def test_the_api_key_stays_out_of_repr() -> None:
    c = UpstreamClient("http://127.0.0.1:1", api_key=SecretStr("hunter2"))
    assert "hunter2" not in repr(c) and "hunter2" not in str(vars(c))


@pytest.mark.parametrize(
    ("reply", "status", "type_", "retry"),
    [
        (error(409, "conflict_error", "slot 0 does not serve task 7"), 409, "conflict_error", None),
        (error(503, "unavailable_error", "not enough free KV cells", retry_after=2), 503, "unavailable_error", 2.0),
        (error(404, "not_found_error", "slot 9 not found"), 404, "not_found_error", None),
        (error(501, "not_supported_error", "parking is disabled"), 501, "not_supported_error", None),
        (Reply(500, b"<html>boom</html>"), 500, None, None),
    ],
    ids=["409", "503", "404", "501", "not-json"],
)
async def test_error_answers_become_typed_errors(
    fake: FakeLlamaServer, client: UpstreamClient, reply: Reply, status: int, type_: str | None, retry: float | None
) -> None:
    fake.queue("POST park", reply)
    with pytest.raises(UpstreamApiError) as info:
        await client.park(0, 7)
    e = info.value
    assert (e.status, e.type, e.retry_after_s) == (status, type_, retry)
    assert e.conflict == (status == 409) and e.unavailable == (status == 503)
    assert e.message and "k3y" not in str(e)


async def test_an_unpatched_or_malformed_answer_is_a_protocol_error(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    fake.queue("GET /kv", Reply(200, {"n_cells": 10}), Reply(200, b"not json"))
    with pytest.raises(UpstreamProtocolError, match="patched llama-server"):
        await client.get_kv()
    with pytest.raises(UpstreamProtocolError):
        await client.get_kv()
    fake.queue("GET /kv", error(404, "not_found_error", "File Not Found"))
    with pytest.raises(UpstreamApiError) as info:
        await client.get_kv()
    assert info.value.status == 404


async def test_a_hung_server_times_out_as_unavailable(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    fake.queue("GET /kv", Reply(delay_s=2.0, body=fake.kv))
    with pytest.raises(UpstreamUnavailable):
        await client.get_kv()


async def test_a_park_waits_for_its_copy_longer_than_a_poll(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    # a park is answered once its snapshot is copied, slice by slice: longer than the 0.5 s a poll may take
    body = {"id_slot": 1, "id_task": 3, "action": "park", "n_cells": 10, "n_bytes": 1, "park_count": 1}
    fake.queue("POST park", Reply(delay_s=1.0, body={**body, "timings": {"park_ms": 1000.0, "copy_ms": 2.5}}))
    park = await client.park(1, 3)
    assert park.timings.copy_ms == 2.5
    fake.queue("GET /kv", Reply(delay_s=1.0, body=fake.kv))
    with pytest.raises(UpstreamUnavailable):  # the poll keeps its own timeout
        await client.get_kv()


async def test_a_dropped_connection_is_unavailable(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    fake.queue("POST resume", Reply(drop=True))
    with pytest.raises(UpstreamUnavailable):
        await client.resume(1, 3)
    assert (await client.get_kv()).n_cells == 1000  # and the next request works


async def test_nobody_listening_is_unavailable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with UpstreamClient(f"http://127.0.0.1:{port}", timeout_s=0.5) as c:
        with pytest.raises(UpstreamUnavailable):
            await c.get_kv()
        with pytest.raises(UpstreamUnavailable):
            await c.health()


async def test_health_is_false_while_the_model_loads(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    fake.queue("GET /health", error(503, "unavailable_error", "Loading model"))
    assert await client.health() is False
    assert await client.health() is True
    fake.queue("GET /health", error(500, "server_error", "broken"))
    with pytest.raises(UpstreamApiError):
        await client.health()


async def test_a_base_path_prefix_is_kept(fake: FakeLlamaServer) -> None:
    server = TestServer(fake.app())
    await server.start_server()
    try:
        async with UpstreamClient(str(server.make_url("")) + "/") as c:
            await c.park(3, 1)
        assert fake.seen[-1].path == "/slots/3" and fake.seen[-1].query == {"action": "park"}
    finally:
        await server.close()


async def test_polls_reuse_one_connection(fake: FakeLlamaServer, client: UpstreamClient) -> None:
    for _ in range(5):
        await client.get_kv()
    peers = {s.peer for s in fake.seen}
    assert len(peers) == 1, "a poll every 50 ms must not cost the server a new connection each"


async def test_a_read_on_a_connection_the_server_just_closed_is_sent_again_once(
    fake: FakeLlamaServer, client: UpstreamClient
) -> None:
    fake.queue("GET /kv", Reply(drop=True))
    assert (await client.get_kv()).n_cells == 1000
    fake.queue("GET /kv", Reply(drop=True), Reply(drop=True))
    with pytest.raises(UpstreamUnavailable):
        await client.get_kv()
    fake.queue("POST park", Reply(drop=True))
    with pytest.raises(UpstreamUnavailable):
        await client.park(0, 7)  # not a read: never sent twice
    assert sum(1 for s in fake.seen if s.method == "POST") == 1
