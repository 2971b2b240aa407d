"""kvctl's own crash, upgrade and reload lose no chat: the keeper (controller/keeper.py) holds the clients'
connections while the worker is SIGKILLed or replaced, and the next worker continues every stream from the server's
own stream of it (no token evaluated again, parked snapshots kept, the server never restarted).

Real patched server, SmolLM2-135M-Instruct, real clients (the openai and anthropic SDKs, aiohttp for the native
route). Each stream's raw SSE is read through the SDK's streaming response, so that the token ids kvctl asks the
server to announce (``: tokens``) can be checked: every id exactly once (they detokenize to the text the client got),
``usage`` counting them all, no error event.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from testkit.llama import free_port, get_json, parse_metrics
from tests.harness import ServerFactory, require_module
from tests.integration.faults import ROOT, KvctlProcess, SplitForwarder

pytestmark = pytest.mark.server

openai = require_module("openai", "openai")
anthropic = require_module("anthropic", "anthropic")

N_PREDICT = 96
# 10 streams on 8 slots (two queued in kvctl) and two non-streaming requests. The first 8 are admitted together
# (their prompts, about 300 cells, leave room) and each generates N_PREDICT tokens (ignore_eos), so they need
# about 1070 cells against HIGH's 722: parks are certain whatever the schedule, not only when the streams
# happen to run in step (a 1024-cell pool left that to timing, and CI once saw no park)
POOL = ("-c", "768", "-np", "8", "-kvu", "--slots", "--metrics", "--no-cache-prompt", "--cache-ram", "0")
ENV = {"KVCTL_POLICY__PARK_TIER": "ram", "KVCTL_LOG__LEVEL": "info"}


@dataclass
class Seen:
    """One request as its client saw it."""

    kind: str
    text: str = ""
    ids: list[int] = field(default_factory=list)
    usage: int | None = None  # output tokens as the final event (or the answer) counts them
    prompt: int | None = None
    final: bool = False
    errors: list[str] = field(default_factory=list)


def _data(line: str) -> Any:
    return json.loads(line[5:]) if line.startswith("data:") and line[5:].strip() != "[DONE]" else None


def _take(seen: Seen, line: str) -> None:
    """One SSE line of any protocol: ids, text, usage, the end, errors."""
    if line.startswith(": tokens"):
        seen.ids += [int(t) for t in line.split()[2:]]
        return
    if line.startswith("data:") and line[5:].strip() == "[DONE]":
        seen.final = True
        return
    doc = _data(line)
    if not isinstance(doc, dict):
        return
    if "error" in doc or doc.get("type") == "error":
        seen.errors.append(json.dumps(doc)[:300])
        return
    kind = seen.kind
    if kind == "chat":
        for c in doc.get("choices", []):
            seen.text += c.get("delta", {}).get("content") or ""
        if doc.get("usage"):
            seen.usage, seen.prompt = doc["usage"]["completion_tokens"], doc["usage"]["prompt_tokens"]
    elif kind == "completions":
        for c in doc.get("choices", []):
            seen.text += c.get("text") or ""
        if doc.get("usage"):
            seen.usage, seen.prompt = doc["usage"]["completion_tokens"], doc["usage"]["prompt_tokens"]
    elif kind == "responses":
        if doc.get("type") == "response.output_text.delta":
            seen.text += doc["delta"]
        if doc.get("type") == "response.completed":
            u = doc["response"]["usage"]
            seen.usage, seen.prompt, seen.final = u["output_tokens"], u["input_tokens"], True
    elif kind == "messages":
        if doc.get("type") == "content_block_delta":
            seen.text += doc["delta"].get("text", "")
        if doc.get("type") == "message_start":
            seen.prompt = doc["message"]["usage"]["input_tokens"]
        if doc.get("type") == "message_delta":
            seen.usage = doc["usage"]["output_tokens"]
        if doc.get("type") == "message_stop":
            seen.final = True
    elif kind == "native":
        seen.text += doc.get("content", "")
        if doc.get("stop"):
            seen.usage, seen.prompt, seen.final = doc["tokens_predicted"], doc["tokens_evaluated"], True


def _prompt(i: int) -> str:
    return f"Story {i}: tell me a long story about a {['cat', 'dog', 'owl', 'fox', 'bee'][i % 5]} number {i}."


async def _one(
    kind: str, i: int, base: str, http: aiohttp.ClientSession, seen: Seen | None = None, n_predict: int = N_PREDICT
) -> Seen:
    """One request of ``kind`` as its client library makes it, into ``seen`` (read while it runs, where given)."""
    seen = Seen(kind) if seen is None else seen
    extra = {"ignore_eos": True}
    msgs = [{"role": "user", "content": _prompt(i)}]
    try:
        if kind in ("chat", "completions", "responses", "plain"):
            client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0, timeout=300)
            if kind == "plain":  # not streamed: the SDK parses the answer
                async with client:
                    r = await client.chat.completions.create(
                        model="m", messages=msgs, max_tokens=n_predict, temperature=0, extra_body=extra
                    )
                seen.text, seen.usage = r.choices[0].message.content or "", r.usage.completion_tokens
                seen.prompt, seen.final = r.usage.prompt_tokens, True
                return seen
            if kind == "chat":
                cm = client.chat.completions.with_streaming_response.create(
                    model="m", messages=msgs, max_tokens=n_predict, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body=extra,
                )  # fmt: skip
            elif kind == "completions":
                cm = client.completions.with_streaming_response.create(
                    model="m", prompt=_prompt(i), max_tokens=n_predict, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body=extra,
                )  # fmt: skip
            else:
                cm = client.responses.with_streaming_response.create(
                    model="m", input=_prompt(i), max_output_tokens=n_predict, temperature=0, stream=True,
                    extra_body=extra,
                )  # fmt: skip
            async with client, cm as resp:
                async for line in resp.iter_lines():
                    _take(seen, line)
        elif kind == "messages":
            ac = anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0, timeout=300)
            async with (
                ac,
                ac.messages.with_streaming_response.create(
                    model="m", messages=msgs, max_tokens=n_predict, stream=True, extra_body={**extra, "temperature": 0}
                ) as resp,
            ):
                async for line in resp.iter_lines():
                    _take(seen, line)
        else:
            body = {"prompt": _prompt(i), "n_predict": n_predict, "stream": True, **extra}
            async with http.post(base + "/completion", json=body) as resp:
                buf = b""
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    *done, buf = buf.split(b"\n")  # SSE split on \n only
                    for raw in done:
                        _take(seen, raw.decode().rstrip("\r"))
    except Exception as e:  # what the client saw end its request: the test reports it
        seen.errors.append(f"{type(e).__name__}: {e}")
    return seen


async def _check(seen: list[Seen], http: aiohttp.ClientSession, server: str, n_predict: int = N_PREDICT) -> None:
    for s in seen:
        assert not s.errors, f"{s.kind}: {s.errors}"
        assert s.final, f"{s.kind}: no final event"
        # ignore_eos keeps the EOS token from ending a stream, not the chat template's end-of-turn stop string
        assert s.usage is not None and 0 < s.usage <= n_predict, f"{s.kind}: usage counts {s.usage} tokens"
        assert s.text, f"{s.kind}: no text"
        if s.kind != "plain":
            # the server's count against the ids the client got: fewer is a token lost, more a token twice
            assert len(s.ids) == s.usage, f"{s.kind}: {len(s.ids)} ids announced, usage counts {s.usage}"
            async with http.post(server + "/detokenize", json={"tokens": s.ids}) as r:
                text = (await r.json())["content"]
            assert text == s.text, f"{s.kind}: the ids say {text[:120]!r}, the client got {s.text[:120]!r}"


async def _worker_pid(http: aiohttp.ClientSession, admin: str, other_than: int | None = None) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            async with http.get(admin + "/status") as r:
                pid = int((await r.json())["keeper"]["pid"])
            if pid != other_than:
                return pid
        except (aiohttp.ClientError, KeyError, TypeError, ValueError):
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("no worker answered /status")


async def _reload(admin: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``kvctl reload`` as an operator runs it (with ``env``: ``--environment``, those KVCTL_ variables): its exit
    code, stdout and stderr."""
    extra = ["--environment"] if env is not None else []
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "controller.cli", "reload", "--admin", admin.removeprefix("http://"), *args, *extra,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("KVCTL_")}, **(env or {})},
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 150)
    return proc.returncode or 0, out.decode(), err.decode()


KINDS = ("chat", "completions", "responses", "messages", "native") * 2 + ("plain",) * 2


async def _evaluated(http: aiohttp.ClientSession, server: str) -> float:
    async with http.get(server + "/metrics") as r:
        return parse_metrics(await r.text())["llamacpp:prompt_tokens_total"]


@pytest.mark.parametrize("seed", [7, 1913])
async def test_sigkill_of_the_worker_at_random_points_loses_no_chat(
    seed: int, smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Three SIGKILLs of the worker at random moments (mid-event included) while 10 streams of every protocol run
    (some parked, two queued) and two answers are not streamed: every request completes exactly, the server is
    neither restarted nor asked to evaluate a generated token again."""
    srv = start_server(*POOL, model=smollm2)
    kv = KvctlProcess(srv.url, tmp_path / "kvctl.log", env=ENV)
    rng = random.Random(seed)
    try:
        await kv.start(http)
        boot = (await get_json(http, srv.url + "/kv"))["server"]["boot_id"]
        before = await _evaluated(http, srv.url)
        tasks = [asyncio.create_task(_one(k, i, kv.proxy, http)) for i, k in enumerate(KINDS)]
        pid = await _worker_pid(http, kv.admin)
        for _ in range(3):
            await asyncio.sleep(rng.uniform(0.3, 2.5))
            os.kill(pid, signal.SIGKILL)
            pid = await _worker_pid(http, kv.admin, other_than=pid)
        seen = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        await _check(seen, http, srv.url)
        assert (await get_json(http, srv.url + "/kv"))["server"]["boot_id"] == boot, "the server was restarted"
        prompts = sum(s.prompt or 0 for s in seen)
        evaluated = await _evaluated(http, srv.url) - before
        # the plain answers too: the next worker waits for the answer the server keeps (patch 0047)
        assert evaluated == prompts, f"{evaluated} tokens evaluated for {prompts} of prompts"
        events = kv.events()
        assert not [e for e in events if e["event"] in ("replay.waiting", "replay.sent")], "continued by replay"
        m = parse_metrics(await (await http.get(srv.url + "/metrics")).text())
        assert m["llamacpp:slot_parks_total"] > 0, "nothing was parked: the pool is too large for the test"
        assert m["llamacpp:slot_resumes_total"] == m["llamacpp:slot_parks_total"]
        assert [e for e in events if e["event"] == "takeover.attached"], "no stream was taken over"
    finally:
        await kv.stop()


async def test_reload_and_sighup_take_new_settings_and_keep_every_stream(
    smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """kvctl reload (with a changed setting) and SIGHUP while streams run: nothing lost, the new HIGH in force; a
    reload whose settings are invalid leaves the old worker serving and says so; the listen address cannot change
    live and says that too."""
    srv = start_server(*POOL, model=smollm2)
    config = tmp_path / "kvctl.toml"
    kv = KvctlProcess(srv.url, tmp_path / "kvctl.log", env=ENV, pre=["--config", str(config)], listen_flags=False)
    listen = f'[proxy]\nlisten = "127.0.0.1:{kv.proxy_port}"\n[admin]\nlisten = "127.0.0.1:{kv.admin_port}"\n'
    config.write_text(listen + "[policy]\nhigh = 0.94\n")
    try:
        await kv.start(http)
        tasks = [asyncio.create_task(_one(k, i, kv.proxy, http)) for i, k in enumerate(KINDS[:6])]
        pid = await _worker_pid(http, kv.admin)
        await asyncio.sleep(1.0)
        config.write_text(listen + "[policy]\nhigh = 0.9\n")
        code, out, err = await _reload(kv.admin, "--json")
        assert code == 0, (out, err)
        answer = json.loads(out)
        assert answer["old_pid"] == pid and answer["listen_unchanged"] is None, answer
        pid = await _worker_pid(http, kv.admin, other_than=pid)
        status = await get_json(http, kv.admin + "/status")
        assert status["pool"]["high"] == 0.9, status["pool"]
        assert kv.proc is not None
        os.kill(kv.proc.pid, signal.SIGHUP)
        pid = await _worker_pid(http, kv.admin, other_than=pid)
        # the listen address cannot change live: the keeper keeps its listeners, and the reload says so
        other = free_port()
        config.write_text(listen.replace(str(kv.proxy_port), str(other)) + "[policy]\nhigh = 0.9\n")
        code, out, err = await _reload(kv.admin)
        assert code == 0 and f"proxy.listen 127.0.0.1:{other}" in err and "until kvctl restarts" in err, (out, err)
        assert json.loads(out)["listen_unchanged"] in err
        pid = await _worker_pid(http, kv.admin, other_than=pid)
        keeper = (await get_json(http, kv.admin + "/status"))["keeper"]
        assert f"still listening on 127.0.0.1:{kv.proxy_port}" in keeper["listen_unchanged"], keeper
        assert [e for e in kv.events() if e["event"] == "keeper.listen_unchanged"]
        with pytest.raises(aiohttp.ClientConnectorError):
            await http.get(f"http://127.0.0.1:{other}/health")
        config.write_text(listen + "[policy]\nhigh = 0.9\n")
        seen = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        await _check(seen, http, srv.url)
        events = kv.events()
        assert sum(e["event"] == "keeper.replacing" for e in events) == 3, "each reload a hand-over"
        assert [e for e in events if e["event"] == "takeover.resume"], "no stream was taken over"

        config.write_text(listen + "[policy]\nhigh = 2\n")  # invalid: the new worker exits 2, the old one serves on
        code, out, err = await _reload(kv.admin)
        assert code == 1 and "serves on" in err, (code, out, err)
        assert await _worker_pid(http, kv.admin) == pid
        assert (await get_json(http, kv.admin + "/status"))["keeper"]["reloads_failed"] == 1

        # systemd's ExecReload: the new worker takes the caller's KVCTL_ variables (the EnvironmentFile read again)
        config.write_text(listen + "[policy]\nhigh = 0.9\n")
        code, out, err = await _reload(kv.admin, env={"KVCTL_POLICY__LOW": "0.7"})
        assert code == 0, (out, err)
        await _worker_pid(http, kv.admin, other_than=pid)
        pool = (await get_json(http, kv.admin + "/status"))["pool"]
        assert (pool["low"], pool["high"]) == (0.7, 0.9), pool
    finally:
        await kv.stop()


async def test_spawned_server_survives_worker_crash_and_reload_with_its_parked_snapshots(
    smollm2: Path, llama_server_bin: Path, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """kvctl run --spawn: the worker SIGKILLed while a request is parked (pinned) and another streams; the server
    keeps running (same pid), the parked request resumes by swap from its snapshot, both complete exactly."""
    port = free_port()
    argv = [str(llama_server_bin), "-m", str(smollm2), "--port", str(port), "-t", "1", "--temp", "0", *POOL]
    kv = KvctlProcess(f"http://127.0.0.1:{port}", tmp_path / "kvctl.log", env=ENV, extra=["--spawn", "--", *argv])
    try:
        await kv.start(http, timeout_s=120)
        server = f"http://127.0.0.1:{port}"
        spid = (await get_json(http, kv.admin + "/status"))["supervisor"]["pid"]
        tasks = [asyncio.create_task(_one(k, i, kv.proxy, http)) for i, k in enumerate(("chat", "native"))]
        slots: list[dict[str, Any]] = []

        async def two_generating() -> bool:
            nonlocal slots
            slots = [s for s in await get_json(http, server + "/slots") if s["state"] == "generating"]
            return len(slots) == 2 and all(s["n_decoded"] >= 8 for s in slots)

        deadline = time.monotonic() + 60
        while not await two_generating():
            assert time.monotonic() < deadline, "two generating slots"
            await asyncio.sleep(0.05)
        async with http.post(kv.admin + f"/slots/{slots[0]['id']}/park") as r:
            assert r.status == 200, await r.text()
        pid = await _worker_pid(http, kv.admin)
        os.kill(pid, signal.SIGKILL)
        pid = await _worker_pid(http, kv.admin, other_than=pid)
        status = await get_json(http, kv.admin + "/status")
        assert status["supervisor"]["pid"] == spid, "the spawned server was restarted"
        # the pin lived in the dead worker: the new one restores the parked request from its snapshot
        seen = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        await _check(seen, http, server)
        m = parse_metrics(await (await http.get(server + "/metrics")).text())
        assert m["llamacpp:slot_parks_total"] >= 1 and m["llamacpp:slot_resumes_total"] >= 1
        assert m.get("llamacpp:slot_resume_failures_total", 0) == 0
        assert not [e for e in kv.events() if e["event"] in ("replay.waiting", "replay.sent")]
        os.kill(pid, signal.SIGKILL)  # and once more, idle: the next worker adopts it again
        await _worker_pid(http, kv.admin, other_than=pid)
        assert (await get_json(http, kv.admin + "/status"))["supervisor"]["pid"] == spid
    finally:
        await kv.stop()


def test_keeper_imports_nothing_but_the_standard_library(tmp_path: Path) -> None:
    """What holds the connections depends on no third-party package: it runs with them all hidden."""
    code = "import sys; sys.path = [p for p in sys.path if 'site-packages' not in p]; import controller.keeper"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([shutil.which("python3") or sys.executable, "-S", "-c", code], env=env, cwd=tmp_path)
    assert done.returncode == 0


async def test_an_upgrade_from_the_previous_commit_loses_no_chat(
    smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """kvctl started from the previous commit's code (its keeper too), the code replaced on disk by this commit's
    (as pip install does), then kvctl reload while streams run: the new worker speaks the old keeper's protocol and
    takes every stream over."""
    old = tmp_path / "old"
    old.mkdir()
    git = await asyncio.create_subprocess_shell(
        f"git -C {ROOT} archive HEAD~1 controller | tar -x -C {old}", stderr=asyncio.subprocess.PIPE
    )
    _, err = await git.communicate()
    assert git.returncode == 0, err
    assert (old / "controller" / "keeper.py").exists(), "the previous commit has no keeper to upgrade from"
    site = tmp_path / "site"  # what an installed package is: a name on the path, its code replaceable
    site.mkdir()
    (site / "controller").symlink_to(old / "controller")
    env = {**ENV, "PYTHONPATH": str(site)}
    srv = start_server(*POOL, model=smollm2)
    kv = KvctlProcess(srv.url, tmp_path / "kvctl.log", env=env, cwd=site)
    try:
        await kv.start(http)
        tasks = [asyncio.create_task(_one(k, i, kv.proxy, http)) for i, k in enumerate(KINDS[:5])]
        pid = await _worker_pid(http, kv.admin)
        await asyncio.sleep(1.0)
        (site / "controller").unlink()
        (site / "controller").symlink_to(ROOT / "controller")
        code, out, err = await _reload(kv.admin)
        assert code == 0, (out, err, kv.log_tail())
        await _worker_pid(http, kv.admin, other_than=pid)
        seen = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        await _check(seen, http, srv.url)
        sources = [e.get("source") for e in kv.events() if e["event"] == "keeper.took_over"]
        assert sources[-1] == str(ROOT / "controller"), sources
    finally:
        await kv.stop()


async def _idle_soon(http: aiohttp.ClientSession, server: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not [s for s in await get_json(http, server + "/slots") if s["state"] != "idle"]:
            return True
        await asyncio.sleep(0.1)
    return False


async def test_a_client_that_leaves_ends_its_stream_on_the_server(
    smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """The server no longer stops a stream whose connection closes (it outlives the worker): kvctl ends it when its
    client leaves, and the next worker ends those whose clients left while no worker ran."""
    srv = start_server(*POOL, model=smollm2)
    kv = KvctlProcess(srv.url, tmp_path / "kvctl.log", env=ENV)
    body = {"prompt": _prompt(1), "n_predict": 3000, "ignore_eos": True, "stream": True}
    try:
        await kv.start(http)
        for worker_dies in (False, True):
            async with http.post(kv.proxy + "/completion", json=body) as resp:
                await resp.content.readline()  # the stream has begun
                if worker_dies:
                    os.kill(await _worker_pid(http, kv.admin), signal.SIGKILL)
            # the client has left (the response closed)
            assert await _idle_soon(http, srv.url, 15), f"still generating (worker died: {worker_dies})"
        assert [e for e in kv.events() if e["event"] == "takeover.abandoned"], "no stream ended as abandoned"
    finally:
        await kv.stop()


async def test_a_chat_survives_any_number_of_reloads_and_worker_kills(
    smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Five streams of five protocols (some parked) through 10 reloads (SIGHUP, five of them `kvctl reload`) and 5
    worker SIGKILLs, each placed once the clients have received new tokens from the worker before it (so the kills
    land mid-stream, and some while a request is parked): every stream completes exactly, no request is dropped, no
    reload counts against one, the server evaluates the prompts alone (nothing again, nothing recomputed)."""
    n = 256
    srv = start_server(*POOL, model=smollm2)
    kv = KvctlProcess(srv.url, tmp_path / "kvctl.log", env=ENV)
    try:
        await kv.start(http)
        m0 = parse_metrics(await (await http.get(srv.url + "/metrics")).text())
        seen = [Seen(k) for k in (*KINDS[:5], "plain")]
        tasks = [asyncio.create_task(_one(s.kind, i, kv.proxy, http, s, n)) for i, s in enumerate(seen)]
        pid = await _worker_pid(http, kv.admin)
        plan = ["hup", "kill", "reload"] * 5  # 10 reloads (SIGHUP, `kvctl reload`), 5 kills
        assert kv.proc is not None
        done = 0
        for step in plan:
            had = sum(len(s.ids) for s in seen)
            deadline = time.monotonic() + 60
            while sum(len(s.ids) for s in seen) <= had:  # the worker before has streamed something new
                assert time.monotonic() < deadline, "no stream made progress"
                await asyncio.sleep(0.02)
            if all(s.final for s in seen):
                break
            if step == "kill":
                os.kill(pid, signal.SIGKILL)
            elif step == "hup":
                os.kill(kv.proc.pid, signal.SIGHUP)
            else:
                code, out, err = await _reload(kv.admin)
                assert code == 0, (out, err)
            pid = await _worker_pid(http, kv.admin, other_than=pid)
            done += 1
        got = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        assert done >= 12, f"the streams ended after {done} of {len(plan)} steps: make them longer"
        await _check(got, http, srv.url, n)
        m = parse_metrics(await (await http.get(srv.url + "/metrics")).text())
        evaluated = m["llamacpp:prompt_tokens_total"] - m0["llamacpp:prompt_tokens_total"]
        assert evaluated == sum(s.prompt or 0 for s in got), "a prompt or a generated token was evaluated again"
        assert m["llamacpp:recomputed_tokens_total"] == m0["llamacpp:recomputed_tokens_total"]
        assert m["llamacpp:slot_resumes_total"] == m["llamacpp:slot_parks_total"]
        events = kv.events()
        assert not [e for e in events if e["event"] == "keeper.request_dropped"]
        reloads = sum(1 for step in plan[:done] if step != "kill")
        assert sum(e["event"] == "keeper.replacing" for e in events) == reloads, "each reload was a hand-over"
        held = [e for e in events if e["event"] == "keeper.held"]
        assert held and not [e for e in held if e["handed_over"] and e["counted"]], "a reload counted as a death"
        assert [e for e in events if e["event"] == "takeover.attached"], "no stream was taken over"
    finally:
        await kv.stop()


async def test_exact_answers_through_placed_kills_and_reloads_equal_their_solo_runs(
    smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """The server in `--exact`: six requests of five kinds (one not streamed) through faults placed by what the
    streams are doing: the worker killed holding half an event from the server, while a request is parked, while
    the next worker is resuming the streams, while a reload's new worker is still starting, and just after a
    reload. Every answer equals its solo run token for token, and the server evaluates each prompt once."""
    n = 192
    srv = start_server(*POOL, "--exact", model=smollm2)
    fwd = await SplitForwarder(srv.url).start()
    kv = KvctlProcess(fwd.url, tmp_path / "kvctl.log", env=ENV)
    kinds = (*KINDS[:5], "plain")
    try:
        await kv.start(http)
        solo = [await _one(k, i, kv.proxy, http, n_predict=n) for i, k in enumerate(kinds)]
        m0 = parse_metrics(await (await http.get(srv.url + "/metrics")).text())
        seen = [Seen(k) for k in kinds]
        tasks = [asyncio.create_task(_one(s.kind, i, kv.proxy, http, s, n)) for i, s in enumerate(seen)]
        pid = await _worker_pid(http, kv.admin)

        async def progress() -> None:  # the worker now serving has streamed something new
            had = sum(len(s.ids) for s in seen)
            deadline = time.monotonic() + 60
            while sum(len(s.ids) for s in seen) <= had:
                assert time.monotonic() < deadline, "no stream made progress"
                await asyncio.sleep(0.01)

        def count(event: str) -> int:
            return sum(e["event"] == event for e in kv.events())

        at_kill = {"resumes": 0}

        async def die(victim: int) -> int:
            """SIGKILL ``victim`` while it holds requests; the worker serving next."""
            held = count("keeper.held")
            os.kill(victim, signal.SIGKILL)
            at_kill["resumes"] = count("takeover.resume")
            nxt = await _worker_pid(http, kv.admin, other_than=victim)
            assert count("keeper.held") > held, "the worker held no request when it died: make the streams longer"
            return nxt

        async def kill(when: Any, progressed: bool = True) -> None:
            nonlocal pid
            if progressed:
                await progress()
            await when()
            pid = await die(pid)

        async def mid_event() -> None:
            fwd.arm()
            await asyncio.wait_for(fwd.split.wait(), 30)

        async def parked() -> None:
            deadline = time.monotonic() + 60
            while not [s for s in await get_json(http, srv.url + "/slots") if s["state"] == "parked"]:
                assert time.monotonic() < deadline, "nothing was parked"
                await asyncio.sleep(0.01)

        async def resuming() -> None:  # the worker after the last death has begun resuming the streams
            deadline = time.monotonic() + 60
            while count("takeover.resume") <= at_kill["resumes"]:
                assert time.monotonic() < deadline, "no stream was resumed"
                await asyncio.sleep(0.002)

        await kill(mid_event)
        fwd.release.set()
        await kill(parked)
        await kill(resuming, progressed=False)  # in the middle of its resumes, before it streams anything

        # a reload's new worker still starting: the old one killed, its requests wait for the new one
        await progress()
        assert kv.proc is not None
        keeper = psutil.Process(kv.proc.pid)
        os.kill(kv.proc.pid, signal.SIGHUP)
        deadline = time.monotonic() + 30
        while len(keeper.children()) < 2:
            assert time.monotonic() < deadline, "the reload started no worker"
            await asyncio.sleep(0.002)
        pid = await die(pid)
        assert count("keeper.replacing") == 0, "the new worker was ready before the old one died"

        # just after a reload: the new worker killed as soon as it serves
        await progress()
        code, out, err = await _reload(kv.admin)
        assert code == 0, (out, err)
        pid = await die(await _worker_pid(http, kv.admin, other_than=pid))

        got = await asyncio.wait_for(asyncio.gather(*tasks), 240)
        assert not any(s.final for s in got[:5] if len(s.ids) < n // 2), "a stream ended early"
        await _check(got, http, srv.url, n)
        for s, ref in zip(got, solo, strict=True):
            assert s.text == ref.text and s.usage == ref.usage, f"{s.kind}: differs from its solo run"
            assert s.ids == ref.ids, f"{s.kind}: its ids differ from its solo run's"
        m = parse_metrics(await (await http.get(srv.url + "/metrics")).text())
        evaluated = m["llamacpp:prompt_tokens_total"] - m0["llamacpp:prompt_tokens_total"]
        assert evaluated == sum(s.prompt or 0 for s in got), "a prompt or a generated token was evaluated again"
        assert m["llamacpp:recomputed_tokens_total"] == m0["llamacpp:recomputed_tokens_total"]
        assert m["llamacpp:slot_parks_total"] > m0["llamacpp:slot_parks_total"]
        assert m["llamacpp:slot_resumes_total"] == m["llamacpp:slot_parks_total"]
        assert fwd.splits == 1
        events = kv.events()
        assert not [e for e in events if e["event"] == "keeper.request_dropped"]
        assert count("takeover.attached") > 0
    finally:
        await kv.stop()
        await fwd.stop()
