"""A server crash loses no chat: `kvctl run --spawn`, the server SIGKILLed mid-generation, every stream goes on
(native, OpenAI chat, Anthropic Messages, OpenAI Responses).

The supervisor restarts the server; the proxy waits for it (heartbeats meanwhile), sends each interrupted stream
again with the token ids its client has (``continuation_tokens``, patch 0027), and splices the new stream in.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from testkit.llama import NO_BYTE_TOKENS, StreamResult, free_port, server_argv, sse_events, stream_completion
from testkit.stack import stack_admin, start_stack
from tests.harness import kill_server

pytestmark = pytest.mark.server

N = 600  # tokens each stream generates
KILL_AT = 150  # the native stream's tokens when the server is killed
SERVER = ("-c", "8192", "-np", "5", "-kvu", "--slots", "--metrics")


async def events(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """A stream's data events as JSON (OpenAI's [DONE] left out); an error event is returned like the others."""
    out = []
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for ev in sse_events(resp):
            if ev.data is not None and ev.data != "[DONE]":
                out.append(json.loads(ev.data))
    return out


async def answer(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_streams_of_every_protocol_survive_the_server_being_killed(
    llama_server_bin: Path, tiny_model: Path, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sport = free_port()
    argv = server_argv(llama_server_bin, tiny_model, sport, *SERVER)
    with start_stack(f"http://127.0.0.1:{sport}", "--spawn", "--", *argv, log_path=tmp_path / "kvctl.log") as url:
        killed = asyncio.Event()

        async def kill_once(res: StreamResult) -> None:
            if len(res.n_decoded) >= KILL_AT and not killed.is_set():
                killed.set()
                kill_server(sport)

        native = stream_completion(
            http,
            url,
            {"prompt": "Once upon a time", "n_predict": N, "ignore_eos": True, "logit_bias": NO_BYTE_TOKENS},
            on_chunk=kill_once,
        )
        chat = events(
            http,
            url + "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Tell me a story"}],
                "max_tokens": N,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        messages = events(
            http,
            url + "/v1/messages",
            {
                "model": "tiny",
                "max_tokens": N,
                "ignore_eos": True,
                "stream": True,
                "messages": [{"role": "user", "content": "Tell me another"}],
            },
        )
        responses = events(
            http,
            url + "/v1/responses",
            {"model": "tiny", "input": "And one more", "max_output_tokens": N, "ignore_eos": True, "stream": True},
        )
        plain = answer(
            http,
            url + "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "No stream"}], "max_tokens": N, "ignore_eos": True},
        )
        res, oai, anthropic, resp, whole = await asyncio.wait_for(
            asyncio.gather(native, chat, messages, responses, plain), 180
        )
        log = (tmp_path / "kvctl.log").read_text()

    assert killed.is_set()
    assert log.count("replay.sent") == 4, log[-3000:]  # all four streams were generating when the server died
    # not streaming: sent again from the start, its client none the wiser
    assert "replay.resend" in log
    assert whole["usage"]["completion_tokens"] == N
    # native: every token exactly once, counted as the uninterrupted request
    assert res.error is None, res.error
    assert res.n_decoded == list(range(1, N + 1)), "a token lost or repeated across the crash"
    assert len(res.tokens) == N and res.final is not None and res.final["tokens_predicted"] == N
    # OpenAI chat: one id, the whole usage
    assert not any("error" in e for e in oai), oai[-1]
    assert len({e["id"] for e in oai}) == 1
    assert oai[-1]["usage"]["completion_tokens"] == N
    # Anthropic: one message, one text block, the whole usage
    kinds = [e["type"] for e in anthropic]
    assert "error" not in kinds, anthropic[-1]
    assert kinds.count("message_start") == 1 and kinds.count("content_block_start") == 1
    assert kinds[-1] == "message_stop"
    (usage,) = [e["usage"] for e in anthropic if e["type"] == "message_delta"]
    assert usage["output_tokens"] == N
    # Responses: one response, one item, its ids throughout, the whole text at the end
    kinds = [e["type"] for e in resp]
    assert "error" not in kinds, resp[-1]
    for once in ("response.created", "response.output_item.added", "response.content_part.added"):
        assert kinds.count(once) == 1, (once, kinds[:5])
    assert len({e["item_id"] for e in resp if "item_id" in e}) == 1
    (done,) = [e["response"] for e in resp if e["type"] == "response.completed"]
    assert done["id"] == resp[0]["response"]["id"]
    text = "".join(e["delta"] for e in resp if e["type"] == "response.output_text.delta")
    assert [c["text"] for item in done["output"] for c in item.get("content", [])] == [text]
    assert done["usage"]["output_tokens"] == N


def native(n: int, prompt: str = "Once upon a time") -> dict[str, Any]:
    return {"prompt": prompt, "n_predict": n, "ignore_eos": True, "logit_bias": NO_BYTE_TOKENS}


async def wait_generating(http: aiohttp.ClientSession, server: str, state: str = "generating") -> int:
    """The id of the first slot in ``state`` (polls the server's /kv)."""
    for _ in range(600):
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(server + "/kv") as resp:
                if resp.status == 200:
                    for slot in (await resp.json())["slots"]:
                        if slot["state"] == state:
                            return int(slot["id"])
        await asyncio.sleep(0.02)
    raise AssertionError(f"no slot {state}")


async def wait_ready(http: aiohttp.ClientSession, admin: str) -> None:
    for _ in range(300):
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(admin + "/readyz") as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise AssertionError("kvctl not ready")


async def test_killed_twice_in_one_stream_and_while_it_is_parked(
    llama_server_bin: Path, tiny_model: Path, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sport = free_port()
    argv = server_argv(llama_server_bin, tiny_model, sport, *SERVER)
    with start_stack(f"http://127.0.0.1:{sport}", "--spawn", "--", *argv, log_path=tmp_path / "kvctl.log") as url:
        admin = stack_admin(url)
        kills: list[int] = []

        async def kill_twice(res: StreamResult) -> None:
            n = len(res.n_decoded)
            if (n >= 100 and not kills) or (n >= 300 and len(kills) == 1):
                kills.append(n)
                kill_server(sport)

        async def park_then_kill() -> None:
            # the second stream is parked by hand, then the server dies under it
            slot = await wait_generating(http, f"http://127.0.0.1:{sport}")
            async with http.post(f"{admin}/slots/{slot}/park") as resp:
                assert resp.status == 200, await resp.text()
            await wait_generating(http, f"http://127.0.0.1:{sport}", "parked")

        twice = stream_completion(http, url, native(N), on_chunk=kill_twice)
        first = await asyncio.wait_for(twice, 120)
        await wait_ready(http, admin)  # new requests get 503 until kvctl has seen the restarted server
        parked = asyncio.ensure_future(stream_completion(http, url, native(N, "Parked")))
        await asyncio.wait_for(park_then_kill(), 60)
        kill_server(sport)
        second = await asyncio.wait_for(parked, 120)
        log = (tmp_path / "kvctl.log").read_text()

    assert len(kills) == 2
    for res in (first, second):
        assert res.error is None, res.error
        assert res.n_decoded == list(range(1, N + 1)), "a token lost or repeated across the crashes"
    assert any(c.startswith("parked") for c in second.comments)
    assert log.count("replay.sent") == 3, log[-3000:]


async def test_killed_during_prefill_the_request_is_sent_again(
    llama_server_bin: Path, tiny_model: Path, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sport = free_port()
    argv = server_argv(llama_server_bin, tiny_model, sport, *SERVER, "-b", "64", "-ub", "64")
    with start_stack(f"http://127.0.0.1:{sport}", "--spawn", "--", *argv, log_path=tmp_path / "kvctl.log") as url:
        long_prompt = "Once upon a time " * 700  # many 64-token batches: long enough to be caught in prefill
        streaming = asyncio.ensure_future(stream_completion(http, url, native(50, long_prompt)))
        await wait_generating(http, f"http://127.0.0.1:{sport}", "prompt")
        kill_server(sport)
        res = await asyncio.wait_for(streaming, 120)
        log = (tmp_path / "kvctl.log").read_text()
    assert res.error is None, res.error
    assert res.n_decoded == list(range(1, 51))
    assert "replay.resend" in log or "replay.sent" in log, log[-3000:]


async def test_a_server_that_crashes_at_every_start_ends_the_stream_with_an_error_in_time(
    llama_server_bin: Path, tiny_model: Path, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sport = free_port()
    started = tmp_path / "started"
    # the first start runs the server; every later one crashes at once
    wrapper = tmp_path / "server.sh"
    argv = server_argv(llama_server_bin, tiny_model, sport, *SERVER)
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ -e "{started}" ]; then echo "crash at start" >&2; exit 134; fi\n'
        f'touch "{started}"\nexec {" ".join(argv)}\n'
    )
    wrapper.chmod(0o755)
    env = {"KVCTL_PROXY__REPLAY_TIMEOUT_S": "6"}
    with start_stack(
        f"http://127.0.0.1:{sport}", "--spawn", "--", str(wrapper), env=env, log_path=tmp_path / "kvctl.log"
    ) as url:
        killed = asyncio.Event()

        async def kill_once(res: StreamResult) -> None:
            if len(res.n_decoded) >= 50 and not killed.is_set():
                killed.set()
                kill_server(sport)

        t0 = asyncio.get_running_loop().time()
        res = await asyncio.wait_for(stream_completion(http, url, native(N), on_chunk=kill_once), 60)
        waited = asyncio.get_running_loop().time() - t0
        log = (tmp_path / "kvctl.log").read_text()
    assert res.error is not None and res.error.get("kvctl_code") == "upstream_disconnected", res.error
    assert waited < 6 + 10, "the stream ends once replay_timeout_s is past, not later"
    assert "replay.gave_up" in log
    assert any("server restarting" in c for c in res.comments), "heartbeats while waiting"


async def test_a_hung_server_is_restarted_and_its_streams_go_on(
    llama_server_bin: Path, tiny_model: Path, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sport = free_port()
    argv = server_argv(llama_server_bin, tiny_model, sport, *SERVER)
    env = {"KVCTL_PROXY__UPSTREAM_READ_TIMEOUT_S": "3"}
    stopped: list[int] = []
    with start_stack(
        f"http://127.0.0.1:{sport}", "--spawn", "--", *argv, env=env, log_path=tmp_path / "kvctl.log"
    ) as url:

        async def hang_once(res: StreamResult) -> None:
            if len(res.n_decoded) >= KILL_AT and not stopped:
                stopped.append(kill_server(sport, signal.SIGSTOP))  # hung: it neither answers nor dies

        res = await asyncio.wait_for(stream_completion(http, url, native(N), on_chunk=hang_once), 90)
        log = (tmp_path / "kvctl.log").read_text()
    assert stopped
    assert res.error is None, res.error
    assert res.n_decoded == list(range(1, N + 1))
    assert "supervisor.kill" in log and "replay.sent" in log, log[-3000:]
