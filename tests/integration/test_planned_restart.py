"""A planned restart under kvctl loses no chat: `kvctl restart-server -- NEW ARGV` on the real server and model.

Streams of three protocols and a parked request are running when the server is replaced by a new command line
(here the same model with another flag, as an upgrade would be); each is continued on the new server from the ids
its client has: every token once, usage counting the whole answer. A new command line with another model is
refused before anything stops, and with --force ends the running requests with their protocol's error.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from testkit.llama import StreamResult, free_port, server_argv, sse_events, stream_completion
from testkit.stack import restart_server, stack_admin, start_stack

pytestmark = pytest.mark.server

POOL = ("-c", "4096", "-np", "4", "-kvu", "--slots", "--metrics")
N = 160


async def chat_stream(http: aiohttp.ClientSession, url: str) -> tuple[str, Any, Any]:
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
        "max_tokens": N,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, usage, error = "", None, None
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for ev in sse_events(resp):
            if ev.data is None or ev.data == "[DONE]":
                continue
            chunk = json.loads(ev.data)
            if "error" in chunk:
                error = chunk["error"]
                break
            for c in chunk.get("choices", []):
                text += c.get("delta", {}).get("content") or ""
            usage = chunk.get("usage") or usage
    return text, usage, error


async def plain(http: aiohttp.ClientSession, url: str) -> Any:
    body = {"prompt": "The lighthouse keeper wrote", "max_tokens": N, "ignore_eos": True}
    async with http.post(url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


async def generating(http: aiohttp.ClientSession, url: str, n: int, headers: dict[str, str]) -> list[Any]:
    async with asyncio.timeout(60):
        while True:
            async with http.get(url + "/slots", headers=headers) as resp:
                slots = await resp.json()
            busy = [s for s in slots if s.get("is_processing") and s.get("next_token", [{}])[0].get("n_decoded", 0) > 8]
            if len(busy) >= n:
                return busy
            await asyncio.sleep(0.1)


async def whole(http: aiohttp.ClientSession, url: str, res: StreamResult) -> None:
    """Every token once: the streamed ids are N, and their text is the streamed text."""
    assert res.error is None and res.final is not None, res.error
    # every id, from the `: tokens` comments kvctl passes on (a chunk's own `tokens` leave out those of a token
    # whose text the server held back, an incomplete UTF-8 character)
    ids = res.announced_ids
    assert len(ids) == N, len(ids)
    async with http.post(url + "/detokenize", json={"tokens": ids}) as resp:
        assert (await resp.json())["content"] == res.content, "a token lost or repeated"


async def test_an_upgrade_under_load_moves_every_request_and_loses_no_token(
    smollm2: Path, llama_server_bin: Path, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sport = free_port()
    argv = server_argv(llama_server_bin, smollm2, sport, *POOL)
    with start_stack(f"http://127.0.0.1:{sport}", "--spawn", "--", *argv, log_path=tmp_path / "k.log") as url:
        native = {"prompt": "Once upon a time", "n_predict": N, "ignore_eos": True, "return_tokens": True}
        tasks = [
            asyncio.ensure_future(stream_completion(http, url, native)),
            asyncio.ensure_future(stream_completion(http, url, {**native, "prompt": "In a quiet harbour"})),
            asyncio.ensure_future(chat_stream(http, url)),
            asyncio.ensure_future(plain(http, url)),
        ]
        busy = await generating(http, url, 3, {})
        async with http.post(stack_admin(url) + f"/slots/{busy[0]['id']}/park") as resp:
            assert resp.status == 200, await resp.text()  # one of them parked (pinned) when the restart comes
        async with http.get(stack_admin(url) + "/status") as resp:
            pid = (await resp.json())["supervisor"]["pid"]
        code, answer = await asyncio.to_thread(restart_server, url, *argv, "--seed", "7")
        assert code == 0 and answer["moved"] == 4 and answer["failed"] == 0, answer
        first, second, (text, usage, error), (status, body) = await asyncio.wait_for(asyncio.gather(*tasks), 300)
        await whole(http, url, first)
        await whole(http, url, second)
        assert error is None and usage["completion_tokens"] == N and text, (error, usage)
        assert status == 200 and body["usage"]["completion_tokens"] == N, body
        async with http.get(stack_admin(url) + "/status") as resp:
            st = await resp.json()
        assert "--seed" in st["supervisor"]["argv"] and st["supervisor"]["restarts"] == 1
        assert st["supervisor"]["pid"] != pid and st["supervisor"]["early_exits"] == 0


async def test_another_model_is_refused_unless_forced_and_then_ends_requests_with_an_error(
    smollm2: Path, tiny_model: Path, llama_server_bin: Path, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    sport = free_port()
    argv = server_argv(llama_server_bin, smollm2, sport, *POOL)
    other = server_argv(llama_server_bin, tiny_model, sport, *POOL)
    with start_stack(f"http://127.0.0.1:{sport}", "--spawn", "--", *argv, log_path=tmp_path / "k.log") as url:
        async with http.get(url + "/v1/models") as resp:
            before = [m["id"] for m in (await resp.json())["data"]]
        code, answer = await asyncio.to_thread(restart_server, url, *other)
        assert code == 1 and "another model" in str(answer), answer
        async with http.get(stack_admin(url) + "/status") as resp:
            assert (await resp.json())["supervisor"]["restarts"] == 0, "nothing was stopped"
        running = asyncio.ensure_future(
            stream_completion(http, url, {"prompt": "Once upon a time", "n_predict": 2000, "ignore_eos": True})
        )
        await generating(http, url, 1, {})
        code, answer = await asyncio.to_thread(restart_server, url, *other, force=True)
        assert code == 1 and answer["moved"] == 0 and answer["failed"] == 1, answer
        res = await asyncio.wait_for(running, 60)
        assert res.error is not None and res.error["kvctl_code"] == "server_replaced", res.error
        async with http.get(url + "/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] != before, "the other model serves now"
