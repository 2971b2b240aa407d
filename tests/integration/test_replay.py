"""A server crash loses no chat: `kvctl run --spawn`, the server SIGKILLed mid-generation, every stream goes on.

The supervisor restarts the server; the proxy waits for it (heartbeats meanwhile), sends each interrupted stream
again with the token ids its client has (``continuation_tokens``, patch 0025), and splices the new stream in.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from testkit.llama import NO_BYTE_TOKENS, StreamResult, free_port, server_argv, sse_events, stream_completion
from testkit.stack import start_stack

pytestmark = pytest.mark.server

N = 600  # tokens each stream generates
KILL_AT = 150  # the native stream's tokens when the server is killed
SERVER = ("-c", "8192", "-np", "3", "-kvu", "--slots", "--metrics")


def kill_server(port: int) -> None:
    """SIGKILL the llama-server listening on ``port`` (the one kvctl spawned)."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "--port" in cmd and cmd[cmd.index("--port") + 1] == str(port) and "llama-server" in cmd[0]:
            os.kill(proc.pid, signal.SIGKILL)
            return
    raise AssertionError(f"no llama-server on port {port}")


async def events(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[Any]:
    """A stream's data events as JSON (OpenAI's [DONE] left out); an error event is returned like the others."""
    out = []
    async with http.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for ev in sse_events(resp):
            if ev.data is not None and ev.data != "[DONE]":
                out.append(json.loads(ev.data))
    return out


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
        res, oai, anthropic = await asyncio.wait_for(asyncio.gather(native, chat, messages), 180)
        log = (tmp_path / "kvctl.log").read_text()

    assert killed.is_set()
    assert "replay.sent" in log, log[-3000:]
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
