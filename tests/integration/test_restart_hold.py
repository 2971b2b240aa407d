"""Nothing refused that could have been served, on the real patched server and a real model (SmolLM2-135M-Instruct).

Requests sent while the spawned server restarts (after SIGKILL, after SIGSEGV) and while it loads at kvctl's own
start wait for it and complete with the same text as without the restart. The server has one slot
(``-np 1``) and frees a finished request's cells (``--no-cache-idle-slots``), so every answer is computed alone in
an empty pool, the schedule the reference ran on. Meanwhile routers and frontends see the server's own "Loading
model" on ``/health`` and the model list as the server last gave it. An attached server that answered before is
waited for too, within ``proxy.replay_timeout_s``, and the queue's depth still holds.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from controller.proxy.restart import LOADING_BODY
from testkit.llama import ServerProcess, free_port, server_argv, stream_completion
from testkit.stack import stack_admin, start_stack
from tests.harness import ProxyFactory, ServerFactory, kill_server

pytestmark = pytest.mark.server

ONE_SLOT = ("-c", "2048", "-np", "1", "-kvu", "--slots", "--metrics", "--no-cache-idle-slots")
N = 24
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
NATIVE = {"prompt": "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n", "n_predict": N}
PLAIN = {"prompt": "The sky is blue because", "max_tokens": N, "temperature": 0}
LEAKS = re.compile(r"127\.0\.0\.1:|\b[A-Z][A-Za-z]*(Error|Exception)\b")


async def three_requests(http: aiohttp.ClientSession, url: str) -> tuple[str, str, str]:
    """An OpenAI chat streamed by the openai SDK, a native /completion stream and a non-streaming OpenAI completion,
    all greedy; their texts."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=180)

    async def chat() -> str:
        stream = await client.chat.completions.create(
            model="m",
            messages=CHAT,
            max_tokens=N,
            temperature=0,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def native() -> str:
        res = await stream_completion(http, url, NATIVE)
        assert res.error is None and res.final is not None, res.error
        return res.content

    async def plain() -> str:
        async with http.post(url + "/v1/completions", json=PLAIN) as resp:
            assert resp.status == 200, await resp.text()
            return str((await resp.json())["choices"][0]["text"])

    try:
        a, b, c = await asyncio.wait_for(asyncio.gather(chat(), native(), plain()), 180)
    finally:
        await client.close()
    return a, b, c


async def until_ready(http: aiohttp.ClientSession, url: str, timeout_s: float = 60) -> None:
    """Until the server behind ``url`` (kvctl's proxy) answers /health with 200 and kvctl's gate is open again."""
    admin = stack_admin(url)
    async with asyncio.timeout(timeout_s):
        while True:
            async with http.get(url + "/health") as h, http.get(admin + "/readyz") as r:
                if h.status == 200 and r.status == 200:
                    return
            await asyncio.sleep(0.2)


async def test_requests_sent_while_the_spawned_server_restarts_complete_as_without_it(
    smollm2: Path, llama_server_bin: Path, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sport = free_port()
    argv = server_argv(llama_server_bin, smollm2, sport, *ONE_SLOT)
    log_path = tmp_path / "kvctl.log"
    with start_stack(f"http://127.0.0.1:{sport}", "--spawn", "--", *argv, log_path=log_path, timeout_s=60) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        models = (await client.models.list()).data
        reference = await three_requests(http, url)
        assert all(len(t) > 10 for t in reference), reference
        for sig in (signal.SIGKILL, signal.SIGSEGV):
            kill_server(sport, sig)
            await asyncio.sleep(0.5)
            sent = asyncio.ensure_future(three_requests(http, url))
            await asyncio.sleep(0.3)
            # while it comes back: a router sees the server's own "loading", a frontend keeps its model list
            async with http.get(url + "/health") as resp:
                assert resp.status == 503 and await resp.read() == LOADING_BODY
            async with http.get(stack_admin(url) + "/readyz") as resp:
                assert resp.status == 503
            assert [m.id for m in (await client.models.list()).data] == [m.id for m in models]
            assert not sent.done(), "held, not refused"
            assert await sent == reference, f"after {signal.Signals(sig).name}"
            await until_ready(http, url)
        await client.close()
    log = log_path.read_text()
    assert log.count('"supervisor.restart_scheduled"') == 2, "both kills restarted the server"
    assert '"admission.refused"' not in log and "upstream_unavailable" not in log


async def test_requests_sent_while_the_server_loads_at_kvctls_start_complete(
    smollm2: Path, llama_server_bin: Path, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """kvctl and the server start together; the server takes 3 s before it even loads (a large model's load,
    simulated by a shell that sleeps, then becomes llama-server)."""
    sport = free_port()
    argv = server_argv(llama_server_bin, smollm2, sport, *ONE_SLOT)
    slow = ["sh", "-c", 'sleep 3; exec "$@"', "sh", *argv]
    with start_stack(f"http://127.0.0.1:{sport}", "--spawn", "--", *argv, timeout_s=60) as url:
        reference = await three_requests(http, url)
    with start_stack(f"http://127.0.0.1:{sport}", "--spawn", "--", *slow, timeout_s=60, ready=False) as url:
        async with http.get(url + "/health") as resp:
            assert resp.status == 503 and await resp.read() == LOADING_BODY, "sent while the server loads"
        assert await three_requests(http, url) == reference


async def test_an_attached_server_is_waited_for_within_the_bound_and_the_queue_holds(
    smollm2: Path, llama_server_bin: Path, start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    srv = start_server(*ONE_SLOT, model=smollm2)
    env = {"KVCTL_PROXY__REPLAY_TIMEOUT_S": "3.0", "KVCTL_PROXY__QUEUE_DEPTH": "2", "KVCTL_PROXY__QUEUE_GRACE_S": "0.5"}
    with start_stack(srv.url, env=env, timeout_s=60) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        await client.models.list()  # the server's answer, kept
        kill_server(srv.port)
        await asyncio.sleep(0.5)
        t0 = asyncio.get_running_loop().time()
        chat = asyncio.ensure_future(client.chat.completions.create(model="m", messages=CHAT, max_tokens=N))
        stream = asyncio.ensure_future(stream_completion(http, url, NATIVE))
        await asyncio.sleep(0.3)
        # depth + 1: at once
        async with http.post(url + "/v1/completions", json=PLAIN) as resp:
            assert (
                resp.status == 503 and resp.headers["X-Kvctl-Error"] == "queue_full" and "Retry-After" in resp.headers
            )
            assert asyncio.get_running_loop().time() - t0 < 1.5
        async with http.get(url + "/health") as resp:
            assert resp.status == 503 and await resp.read() == LOADING_BODY
        assert len((await client.models.list()).data) == 1
        # past replay_timeout_s: each protocol's error, naming nothing internal
        with pytest.raises(openai.APIStatusError) as err:
            await chat
        assert err.value.status_code == 503 and err.value.response.headers["X-Kvctl-Error"] == "server_restarting"
        assert not LEAKS.search(err.value.response.text), err.value.response.text
        res = await stream
        assert res.error is not None and res.error["kvctl_code"] == "server_restarting"
        assert not LEAKS.search(json.dumps(res.error)) and "server restarting" in " ".join(res.comments)
        assert 2.5 <= asyncio.get_running_loop().time() - t0 < 8
        # back on its port within the bound: a held request goes through
        held = asyncio.ensure_future(stream_completion(http, url, NATIVE))
        await asyncio.sleep(0.5)
        again = ServerProcess(llama_server_bin, smollm2, ONE_SLOT, tmp_path / "again.log")
        again.port = srv.port
        try:
            again.start()
            res = await asyncio.wait_for(held, 60)
            assert res.error is None and res.final is not None and len(res.content) > 10
        finally:
            again.stop()
        await client.close()


async def test_slots_through_kvctl_each_tenant_its_own_actions_refused(
    smollm2: Path, start_server: ServerFactory, start_proxy: ProxyFactory, http: aiohttp.ClientSession
) -> None:
    from controller.keys import ApiKey

    srv = start_server("-c", "2048", "-np", "3", "-kvu", "--slots", "--metrics", "--api-key", "sk-srv", model=smollm2)
    keys = (ApiKey("sk-a", "alice"), ApiKey("sk-b", "bob"), ApiKey("sk-o", "ops", operator=True))
    url = await start_proxy(srv.url, upstream_api_key="sk-srv", api_keys=keys)

    def auth(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    long = {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True}
    alice = asyncio.ensure_future(stream_completion(http, url, long, headers={**auth("sk-a"), "X-Request-Id": "a-1"}))
    try:
        for _ in range(200):
            async with http.get(srv.url + "/slots", headers=auth("sk-srv")) as resp:
                if any(s.get("is_processing") for s in await resp.json()):
                    break
            await asyncio.sleep(0.05)

        async def slots(key: str) -> Any:
            async with http.get(url + "/slots", headers=auth(key)) as resp:
                assert resp.status == 200
                return await resp.json()

        mine = await slots("sk-a")
        assert [s["request_id"] for s in mine] == ["a-1"], "alice sees her request by her own X-Request-Id"
        assert await slots("sk-b") == []
        assert len(await slots("sk-o")) == 3, "the operator key sees every slot"
        async with http.get(url + "/slots") as resp:
            assert resp.status == 401
        for action in ("park", "erase", "save"):
            async with http.post(url + f"/slots/0?action={action}", headers=auth("sk-o")) as resp:
                body = await resp.json()
                assert resp.status == 403 and "admin API" in body["error"]["message"], action
                assert not LEAKS.search(json.dumps(body))
    finally:
        alice.cancel()
