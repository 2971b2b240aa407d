"""A replica drained to its peers loses no chat: `kvctl drain` on the real server and model, two replicas or more.

Replica A runs streams of four protocols (native, the openai SDK's chat, the anthropic SDK's messages, the openai
SDK's Responses) and a parked one when `kvctl drain` moves them. Its peers, in the order given: one that is down,
one serving another model (both skipped at the check), one that is full (it answers 503: the next is tried), and
B, which takes them: every stream goes on there from the ids its client has, without an error event, every token
once, usage counting the whole answer, and A's server is stopped once nothing runs on it. With only a dead peer,
the requests finish on A.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.llama import StreamResult, free_port, parse_metrics, server_argv, stream_completion
from testkit.stack import drain, stack_admin, stack_pid, start_stack

pytestmark = pytest.mark.server

POOL = ("-c", "4096", "-np", "6", "-kvu", "--slots", "--metrics")
N = 160
PEER_KEY = "peer-secret-1"
EXTRA = {"ignore_eos": True, "temperature": 0}


class Replicas:
    """kvctl stacks, each spawning its own server, on this machine."""

    def __init__(self, stack: ExitStack, binary: Path, tmp: Path) -> None:
        self.stack, self.binary, self.tmp = stack, binary, tmp
        self.server: dict[str, str] = {}  # a replica's server, by its proxy's URL

    def start(
        self, name: str, model: Path, env: dict[str, str] | None = None, *extra: str, server: tuple[str, ...] = ()
    ) -> str:
        sport = free_port()
        argv = server_argv(self.binary, model, sport, *POOL, *server)
        url = self.stack.enter_context(
            start_stack(
                f"http://127.0.0.1:{sport}",
                *extra,
                "--spawn",
                "--",
                *argv,
                env={"KVCTL_PROXY__PEER_API_KEY": PEER_KEY, **(env or {})},
                log_path=self.tmp / f"{name}.log",
            )
        )
        self.server[url] = f"http://127.0.0.1:{sport}"
        return url


@pytest.fixture
def replicas(llama_server_bin: Path, tmp_path: Path) -> Iterator[Replicas]:
    with ExitStack() as stack:
        yield Replicas(stack, llama_server_bin, tmp_path)


async def chat(url: str) -> tuple[str, Any]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    try:
        text, usage = "", None
        stream = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Tell me a long story about a lighthouse."}],
            max_tokens=N,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
        )
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
            usage = chunk.usage or usage
        return text, usage
    finally:
        await client.close()


async def messages(url: str) -> tuple[str, Any]:
    client = anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0)
    try:
        async with client.messages.stream(
            model="m",
            max_tokens=N,
            messages=[{"role": "user", "content": "Tell me a story about a harbour."}],
            extra_body=EXTRA,
        ) as stream:
            text = "".join([t async for t in stream.text_stream])
            final = await stream.get_final_message()
        return text, final.usage
    finally:
        await client.close()


async def responses(url: str) -> tuple[str, Any]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    try:
        text, usage = "", None
        stream = await client.responses.create(
            model="m", input="Tell me a story about a ship.", max_output_tokens=N, stream=True, extra_body=EXTRA
        )
        async for event in stream:
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type == "response.completed":
                usage = event.response.usage
        return text, usage
    finally:
        await client.close()


async def busy(http: aiohttp.ClientSession, url: str, n: int) -> list[Any]:
    """The slots of ``url``'s server with more than 8 tokens decoded, once there are ``n``."""
    async with asyncio.timeout(120):
        while True:
            async with http.get(url + "/slots") as resp:
                slots = await resp.json()
            running = [
                s for s in slots if s.get("is_processing") and s.get("next_token", [{}])[0].get("n_decoded", 0) > 8
            ]
            if len(running) >= n:
                return running
            await asyncio.sleep(0.1)


async def whole(http: aiohttp.ClientSession, url: str, res: StreamResult) -> None:
    """Every token once: the streamed ids are N, and their text is the streamed text."""
    assert res.error is None and res.final is not None, res.error
    assert not any("error" in c for c in res.comments), res.comments
    # every id, from the `: tokens` comments kvctl passes on (a chunk's own `tokens` leave out those of a token
    # whose text the server held back, an incomplete UTF-8 character)
    ids = res.announced_ids
    assert len(ids) == N, len(ids)
    async with http.post(url + "/detokenize", json={"tokens": ids}) as resp:
        assert (await resp.json())["content"] == res.content, "a token lost or repeated"


async def drain_moves(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """kvctl_proxy_drain_moves_total by outcome, from kvctl's admin /metrics."""
    async with http.get(stack_admin(url) + "/metrics") as resp:
        text = await resp.text()
    return {
        s.labels["outcome"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvctl_proxy_drain_moves_total"
    }


def load(http: aiohttp.ClientSession, url: str) -> list[asyncio.Future[Any]]:
    """Five requests on ``url``: two native streams, and the three SDKs'."""
    native = {"prompt": "Once upon a time", "n_predict": N, "ignore_eos": True, "return_tokens": True}
    return [
        asyncio.ensure_future(stream_completion(http, url, native)),
        asyncio.ensure_future(stream_completion(http, url, {**native, "prompt": "In a quiet harbour"})),
        asyncio.ensure_future(chat(url)),
        asyncio.ensure_future(messages(url)),
        asyncio.ensure_future(responses(url)),
    ]


async def test_a_drain_moves_every_stream_to_the_first_peer_that_takes_it(
    smollm2: Path, tiny_model: Path, replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    a = replicas.start("a", smollm2)
    b = replicas.start("b", smollm2)
    other = replicas.start("other", tiny_model)
    # full: one request runs, none may queue, and every new one needs more than the pool has
    full = replicas.start(
        "full", smollm2, {"KVCTL_PROXY__QUEUE_DEPTH": "0", "KVCTL_PROXY__ADMISSION_RESERVE_CELLS": "100000"}
    )
    blocker = asyncio.ensure_future(
        stream_completion(http, full, {"prompt": "Once", "n_predict": 3000, "ignore_eos": True})
    )
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        await busy(http, full, 1)
        tasks = load(http, a)
        running = await busy(http, a, 5)
        async with http.post(stack_admin(a) + f"/slots/{running[0]['id']}/park") as resp:
            assert resp.status == 200, await resp.text()  # one of them is parked when the drain comes
        pid = (await (await http.get(stack_admin(a) + "/status")).json())["supervisor"]["pid"]
        code, answer = await asyncio.to_thread(drain, a, dead, other, full, b)
        assert code == 0 and answer["moved"] == 5 and answer["failed"] == 0, answer
        assert answer["finished_here"] == 0, answer
        first, second, (chat_text, chat_usage), (msg_text, msg_usage), (resp_text, resp_usage) = await asyncio.wait_for(
            asyncio.gather(*tasks), 300
        )
    finally:
        blocker.cancel()
    await whole(http, b, first)
    await whole(http, b, second)
    assert chat_text and chat_usage.completion_tokens == N, chat_usage
    assert msg_text and msg_usage.output_tokens == N, msg_usage
    assert resp_text and resp_usage.output_tokens == N, resp_usage
    async with http.get(stack_admin(a) + "/status") as resp:
        st = await resp.json()
    assert st["supervisor"]["state"] == "stopped", st["supervisor"]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # A's server is gone: no slot is busy there
    moves = await drain_moves(http, a)
    assert moves["moved"] == 5 and moves["refused"] >= 1, moves  # the full peer was tried, and refused
    hello = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    async with http.post(a + "/v1/chat/completions", json=hello) as r:
        assert r.status == 200, "a new request on a drained replica goes to a peer"
    async with http.post(b + "/completion", headers={"X-Kvctl-Peer": "wrong"}, json={"prompt": "a"}) as r:
        assert r.status == 403 and r.headers["X-Kvctl-Error"] == "peer_forbidden", await r.text()


async def test_with_no_peer_able_to_take_them_the_requests_finish_here(
    smollm2: Path, replicas: Replicas, http: aiohttp.ClientSession
) -> None:
    a = replicas.start("a", smollm2)
    native = {"prompt": "Once upon a time", "n_predict": N, "ignore_eos": True, "return_tokens": True}
    running = asyncio.ensure_future(stream_completion(http, a, native))
    await busy(http, a, 1)
    code, answer = await asyncio.to_thread(drain, a, f"http://127.0.0.1:{free_port()}")
    assert code == 0 and answer["finished_here"] == 1 and answer["moved"] == 0, answer
    res = await asyncio.wait_for(running, 120)
    assert res.error is None and len(res.tokens) == N, res.error
    async with http.get(stack_admin(a) + "/status") as resp:
        assert (await resp.json())["supervisor"]["state"] == "stopped"
    async with http.post(a + "/completion", json={"prompt": "a", "n_predict": 4}) as r:
        assert r.status == 503 and r.headers["X-Kvctl-Error"] == "shutting_down", await r.text()


async def test_sigterm_with_peers_configured_moves_the_streams_before_kvctl_stops(
    smollm2: Path, replicas: Replicas, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    b = replicas.start("b", smollm2)
    a = replicas.start("a", smollm2, None, "--drain-peer", b)
    native = {"prompt": "Once upon a time", "n_predict": N, "ignore_eos": True, "return_tokens": True}
    undisturbed = await stream_completion(http, b, {**native, "cache_prompt": False})  # alone, as the moved one
    running = asyncio.ensure_future(stream_completion(http, a, {**native, "cache_prompt": False}))
    await busy(http, a, 1)
    os.kill(stack_pid(a), signal.SIGTERM)  # kvctl only: its server stays until the drain stops it
    res = await asyncio.wait_for(running, 120)
    await whole(http, b, res)
    # up to the switch the ids are the undisturbed run's (both alone on the same build); past it the peer's
    # batch evaluated them, which may change a greedy choice on this CPU
    moved = [json.loads(line) for line in (tmp_path / "a.log").read_text().splitlines() if "drain.moved" in line]
    switch = moved[0]["tokens"]
    assert switch >= 8 and res.announced_ids[:switch] == undisturbed.announced_ids[:switch]
    async with asyncio.timeout(30):
        while True:  # kvctl stops once the moved stream has ended: its admin listener closes
            try:
                async with http.get(stack_admin(a) + "/healthz"):
                    pass
            except aiohttp.ClientConnectionError:
                break
            await asyncio.sleep(0.2)


async def test_on_one_machine_the_cells_go_over_in_a_file_and_the_peer_evaluates_no_context_again(
    smollm2: Path, replicas: Replicas, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    shared = tmp_path / "handover"
    shared.mkdir()
    env = {"KVCTL_PROXY__HANDOVER_DIR": str(shared)}
    save = ("--slot-save-path", str(shared) + os.sep)
    a = replicas.start("a", smollm2, env, server=save)
    b = replicas.start("b", smollm2, env, server=save)
    native = {"prompt": "Once upon a time", "n_predict": N, "ignore_eos": True, "return_tokens": True}
    tasks = [
        asyncio.ensure_future(stream_completion(http, a, native)),
        asyncio.ensure_future(stream_completion(http, a, {**native, "prompt": "In a quiet harbour"})),
    ]
    running = await busy(http, a, 2)
    async with http.post(stack_admin(a) + f"/slots/{running[0]['id']}/park?mode=swap") as resp:
        assert resp.status == 200, await resp.text()  # one parked: its file is written from its snapshot
    code, answer = await asyncio.to_thread(drain, a, b)
    assert code == 0 and answer["moved"] == 2, answer
    for res in await asyncio.wait_for(asyncio.gather(*tasks), 120):
        await whole(http, b, res)
    async with http.get(replicas.server[b] + "/metrics") as resp:
        evaluated = parse_metrics(await resp.text())["llamacpp:prompt_tokens_total"]
    assert evaluated <= 2 * 4, f"B evaluated {evaluated} prompt tokens: the contexts were evaluated again"
    assert not list(shared.iterdir()), "a handover file was left behind"
