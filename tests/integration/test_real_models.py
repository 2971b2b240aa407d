"""The real-model tier: trained weights from registry packages, greedy, on the real patched server.

SmolLM2-135M-Instruct (Q4_1, llama, ChatML) and Gemma 3 270M (Q4_K_M, a base model with interleaved
sliding-window attention, window 512) as testkit.realmodels fetches them. Exactness is defined against the
same schedule: on this CPU the server's greedy output for a real model changes with the batch's composition,
so every comparison here is between runs of one request alone, parked and unparked, on one server.

A swap park is byte-exact: the parked run's token ids, text and stop equal the unparked run's. A recompute park
re-evaluates the prompt and the generated tokens as one batched prefill, which on trained weights is not
bit-identical to the one-token decode steps that made them; where the greedy choice is a near-tie the
continuation after a park can differ (as with a change of the batch's composition). A recompute park is held to
what it guarantees: every token before the first park equal, no token dropped or repeated (the streamed text is
the detokenized ids), a valid stop, and any grammar or schema still holding.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import pytest

from testkit import models
from testkit.llama import StreamResult, free_port, get_json, post_action, server_argv, stream_completion
from testkit.realmodels import user_turn
from testkit.stack import stack_admin, start_stack
from tests.harness import ProxyFactory, ServerFactory, kill_server

pytestmark = pytest.mark.server

# a pool that holds what these requests need; --no-cache-idle-slots: a finished request's cells are freed, so each
# run starts from the same empty pool
POOL = ("-c", "4096", "-np", "2", "-kvu", "--slots", "--metrics", "--no-cache-idle-slots")

KV_LAYOUTS = {
    "f16-fa-on": ("-fa", "on"),
    "f16-fa-off": ("-fa", "off"),
    "q8_0-fa-on": ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"),  # a quantized V cache needs flash attention
}

# a prompt longer than Gemma 3's 512-token window, so a park holds cells the window has left and cells it has not
LONG_TEXT = " ".join(
    f"Chapter {i}. The lighthouse keeper wrote in the log that the ships came in at dawn, that the fog lifted by"
    " noon, and that the gulls followed the fishing boats back into the harbour before the evening bell."
    for i in range(1, 15)
)
SHORT_TEXT = "The lighthouse keeper wrote in the log that the ships came in at dawn, and that the fog"


@pytest.fixture
def real_model(request: pytest.FixtureRequest) -> Path:
    path: Path = request.getfixturevalue(request.param)
    return path


def parking(
    http: aiohttp.ClientSession, url: str, every: int, mode: str | None, parks: list[dict[str, Any]]
) -> Callable[[StreamResult], Awaitable[None]]:
    """An on_chunk hook that parks the request every ``every`` tokens and resumes it at once; each park's answer
    is appended to ``parks`` with ``at``, the number of tokens streamed before it."""

    async def hook(res: StreamResult) -> None:
        if len(res.n_decoded) % every:
            return
        slot = 0  # every request here is pinned to slot 0
        status, body, _ = await post_action(http, url, slot, "park", {"mode": mode} if mode else None)
        if status == 409:
            return  # it finished (or is finishing) between the chunk and the park
        assert status == 200, body
        parks.append({**body, "at": len(res.announced_ids)})
        status, body, _ = await post_action(http, url, slot, "resume")
        assert status == 200, body

    return hook


def native(prompt: str, n_predict: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": False, "id_slot": 0, **extra}


Outcome = tuple[list[int], str, str | None, str | None]


async def run(
    http: aiohttp.ClientSession,
    url: str,
    req: dict[str, Any],
    hook: Callable[[StreamResult], Awaitable[None]] | None = None,
) -> StreamResult:
    """Stream ``req`` with X-Token-Ids: 1. A chunk's own ``tokens`` leave out the ids of tokens whose text the server
    held back (an incomplete UTF-8 sequence: upstream's behaviour); the ``: tokens`` comments carry every id."""
    return await stream_completion(http, url, req, headers={"X-Token-Ids": "1"}, on_chunk=hook)


def outcome(res: StreamResult) -> Outcome:
    assert res.status == 200 and res.error is None, res.error
    assert res.final is not None
    ids = res.announced_ids
    assert ids or not res.tokens, "no ': tokens' comments: the server does not announce ids"
    return ids, res.content, res.final.get("stop_type"), res.final.get("stopping_word")


async def assert_parked_run(
    http: aiohttp.ClientSession,
    url: str,
    res: StreamResult,
    ref: Outcome,
    mode: str,
    parks: list[dict[str, Any]],
    *,
    stream_equals_ids: bool = True,
) -> Outcome:
    """Hold a parked run to its mode's guarantee against the unparked run ``ref`` (see the module's docstring)."""
    got = outcome(res)
    assert parks, f"{mode}: the request was never parked"
    assert all(p["mode"] == mode for p in parks), parks
    assert res.comments.count("parked") == len(parks)
    if mode == "swap":
        assert got == ref, f"swap parks at {[p['at'] for p in parks]} changed the answer"
        return got
    first = parks[0]["at"]
    assert got[0][:first] == ref[0][:first], f"recompute: a token before the first park (at {first}) changed"
    assert got[2] in ("eos", "limit", "word"), got
    if stream_equals_ids:
        # nothing dropped or repeated: the text streamed is exactly the ids streamed
        ids = got[0][:-1] if got[2] == "eos" else got[0]  # the end-of-generation token is streamed, not shown
        async with http.post(url + "/detokenize", json={"tokens": ids}) as resp:
            assert (await resp.json())["content"] == got[1], "recompute: the streamed text is not the streamed ids"
    return got


@pytest.mark.parametrize("layout", sorted(KV_LAYOUTS))
@pytest.mark.parametrize("real_model", ["smollm2", "gemma3"], indirect=True)
async def test_parked_runs_equal_the_unparked_run(
    real_model: Path, layout: str, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    """Swap and recompute parks every 24 tokens give the unparked run's token ids, text and stop type, with a
    prompt longer than Gemma's window; the window pool is reported and counts only cells inside a window."""
    srv = start_server(*POOL, *KV_LAYOUTS[layout], model=real_model)
    gemma = real_model.name.startswith("gemma")
    # Gemma: a prompt past its window; SmolLM2 (no window) a short one, which keeps the tier's time down
    req = native(LONG_TEXT + "\nChapter 15." if gemma else SHORT_TEXT, 64)
    kv_seen: list[dict[str, Any]] = []

    async def look(res: StreamResult) -> None:  # a GET /kv mid-run: it does not touch the batch
        if len(res.n_decoded) == 8:
            kv_seen.append(await get_json(http, srv.url + "/kv"))

    ref = outcome(await run(http, srv.url, req, look))
    assert len(ref[0]) >= 40, "the model ended early: too short to park"
    kv = kv_seen[0]
    slot = next(s for s in kv["slots"] if s["state"] == "generating")
    if gemma:
        swa = kv["swa"]
        assert swa is not None and swa["n_swa"] == 512 and swa["source"] == "exact"
        # one sequence longer than the window: only the window's cells are live (the rest is reusable); the window
        # of the next position (n_cells) holds the 511 before it
        assert slot["n_cells"] > 512 and swa["n_cells_used"] == 511, (slot, swa)
        assert swa["n_cells_free"] == swa["n_cells"] - 511
    else:
        assert kv["swa"] is None
    assert kv["n_cells_used"] == slot["n_cells"]

    for mode in ("swap", "recompute"):
        parks: list[dict[str, Any]] = []
        res = await run(http, srv.url, req, parking(http, srv.url, 24, mode, parks))
        await assert_parked_run(http, srv.url, res, ref, mode, parks)
        assert len(parks) >= 2


async def test_a_chat_that_ends_at_eos_while_parked_ends_the_same(
    smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    """SmolLM2 answers a question and stops at its end-of-turn token; parks every 2 tokens keep the answer and
    the stop type (eos), for swap and recompute."""
    srv = start_server(*POOL, model=smollm2)
    chat = await get_json(http, srv.url + "/props")
    assert "im_start" in chat["chat_template"], "SmolLM2's ChatML template"
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    async with http.post(srv.url + "/apply-template", json={"messages": messages}) as resp:
        prompt = (await resp.json())["prompt"]
    req = native(prompt, 200)
    ref = outcome(await run(http, srv.url, req))
    assert ref[2] == "eos" and "Paris" in ref[1], ref
    for mode in ("swap", "recompute"):
        parks: list[dict[str, Any]] = []
        res = await run(http, srv.url, req, parking(http, srv.url, 2, mode, parks))
        got = await assert_parked_run(http, srv.url, res, ref, mode, parks)
        assert got[2] == "eos", f"{mode}: {got}"


async def test_a_stop_string_reached_while_parked_ends_the_same(
    gemma3: Path, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL, model=gemma3)
    req = native(SHORT_TEXT, 60)
    free = outcome(await run(http, srv.url, req))
    text = free[1]
    assert len(text) > 120, text
    # a piece from two thirds in, across token boundaries; the answer ends where it first occurs, after several parks
    stop = text[len(text) * 2 // 3 :][:9]
    cut = text.index(stop)
    req["stop"] = [stop]
    ref = outcome(await run(http, srv.url, req))
    assert ref[2] == "word" and ref[3] == stop and ref[1] == text[:cut], ref
    assert len(ref[0]) >= 12, "the stop string comes too early to park twice before it"
    for mode in ("swap", "recompute"):
        parks: list[dict[str, Any]] = []
        res = await run(http, srv.url, req, parking(http, srv.url, 5, mode, parks))
        # the text is cut where the stop string begins, which need not be a token boundary
        got = await assert_parked_run(http, srv.url, res, ref, mode, parks, stream_equals_ids=False)
        assert stop not in got[1], got
        if got[2] == "word":
            assert got[3] == stop


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "population": {"type": "integer"},
        "landmarks": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4},
    },
    "required": ["city", "country", "population", "landmarks"],
}


@pytest.mark.parametrize("constraint", ["json_schema", "grammar"])
async def test_constrained_answers_stay_valid_and_identical_across_parks(
    constraint: str, smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL, model=smollm2)
    async with http.post(
        srv.url + "/apply-template",
        json={"messages": [{"role": "user", "content": "Describe Paris as JSON with its landmarks."}]},
    ) as resp:
        prompt = (await resp.json())["prompt"]
    extra: dict[str, Any]
    if constraint == "json_schema":
        extra = {"json_schema": SCHEMA}
    else:
        extra = {"grammar": 'root ::= "The answer is " ("yes" | "no") ", because " [a-z ]{10,80} "."'}
    req = native(prompt, 160, **extra)
    ref = outcome(await run(http, srv.url, req))
    if constraint == "json_schema":
        assert set(json.loads(ref[1])) == {"city", "country", "population", "landmarks"}
    else:
        assert ref[1].startswith("The answer is ") and ref[1].endswith("."), ref[1]
    for mode in ("swap", "recompute"):
        parks: list[dict[str, Any]] = []
        res = await run(http, srv.url, req, parking(http, srv.url, 6, mode, parks))
        got = await assert_parked_run(http, srv.url, res, ref, mode, parks)
        if constraint == "json_schema" and got[2] == "eos":
            answer = json.loads(got[1])
            assert set(answer) == set(SCHEMA["required"]) and isinstance(answer["population"], int), got[1]
        elif constraint == "grammar":
            assert re.fullmatch(r"The answer is (yes|no), because [a-z ]{10,80}\.", got[1]) or got[2] == "limit", got


@pytest.mark.parametrize(
    ("model", "prompt"),
    [
        ("gemma3", "東京は日本の首都です。北京は中国の首都です。ソウルは"),
        ("gemma3", "Weather today: ☀️ sunny, tomorrow: 🌧️ rain, the day after: "),
        ("smollm2", "<|im_start|>user\nTranslate to Chinese: I love tea.<|im_end|>\n<|im_start|>assistant\n"),
    ],
    ids=["gemma3-cjk", "gemma3-emoji", "smollm2-byte-tokens"],
)
async def test_multibyte_text_streams_whole_across_parks(
    model: str, prompt: str, request: pytest.FixtureRequest, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    """No U+FFFD in any chunk, and the parked run's text equals the unparked one's (byte tokens allowed: the
    server holds an incomplete UTF-8 sequence back until its bytes complete)."""
    srv = start_server(*POOL, model=request.getfixturevalue(model))
    req = native(prompt, 30)
    chunks: list[str] = []

    async def collect(res: StreamResult) -> None:
        chunks.append(res.content)

    ref = outcome(await run(http, srv.url, req, collect))
    assert any(ord(c) > 0x2FF for c in ref[1]), f"no multibyte text to check: {ref[1]!r}"
    assert "\ufffd" not in ref[1] and not any("\ufffd" in c for c in chunks)
    for mode in ("swap", "recompute"):
        parks: list[dict[str, Any]] = []
        res = await run(http, srv.url, req, parking(http, srv.url, 3, mode, parks))
        got = await assert_parked_run(http, srv.url, res, ref, mode, parks)
        assert "\ufffd" not in got[1]


async def test_smollm2_chat_template_renders_the_same_through_kvctl(
    smollm2: Path, start_server: ServerFactory, start_proxy: ProxyFactory
) -> None:
    """The openai and anthropic SDKs get the same answer through kvctl's proxy as from the server directly."""
    srv = start_server(*POOL, model=smollm2)
    proxy = await start_proxy(srv.url)
    messages: list[Any] = [
        {"role": "system", "content": "You are a concise geography assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
    ]
    answers = []
    for base in (srv.url, proxy):
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as client:
            done = await client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=48, temperature=0
            )
            stream = await client.chat.completions.create(
                model="smollm2", messages=messages, max_tokens=48, temperature=0, stream=True
            )
            streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        answers.append((done.choices[0].message.content, streamed, done.choices[0].finish_reason))
    assert answers[0] == answers[1]
    assert answers[0][0] == answers[0][1] and "Paris" in (answers[0][0] or "")

    replies = []
    for base in (srv.url, proxy):
        async with anthropic.AsyncAnthropic(base_url=base, api_key="none", max_retries=0) as claude:
            msg = await claude.messages.create(
                model="smollm2",
                system="You are a concise geography assistant.",
                messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                max_tokens=48,
                extra_body={"temperature": 0},  # the SDK no longer takes it as an argument; the server does
            )
        replies.append(([b.text for b in msg.content if b.type == "text"], msg.stop_reason))
    assert replies[0] == replies[1]
    assert replies[0][0] == [answers[0][0]], "the same template renders for both protocols"


@pytest.mark.parametrize("weights", ["q4_0", "q8_0"])
async def test_a_quantized_random_model_loads_answers_and_parks(
    weights: str, models_dir: Path, vocab_dir: Path, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    """testkit's tiny model with Q4_0 / Q8_0 matrices (gguf-py) loads with the default flags (the weights'
    repacking for the CPU's extra buffer types included) and answers; a swap park keeps its answer."""
    spec = dataclasses.replace(models.SIZES["tiny"], weights=weights)
    path = models.write_llama(models_dir / f"tiny-{weights}.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf", spec)
    srv = start_server(*POOL, model=path)
    req = native("Once upon a time", 32)
    ref = outcome(await run(http, srv.url, req))
    assert ref[2] == "limit" and len(ref[0]) == 32, ref
    parks: list[dict[str, Any]] = []
    res = await run(http, srv.url, req, parking(http, srv.url, 8, "swap", parks))
    await assert_parked_run(http, srv.url, res, ref, "swap", parks)


REPLAYS = {
    # name: model, prompt (CHAT: a user turn in the model's template, testkit.realmodels.user_turn), n_predict, the
    # token count at which the server is killed, extra fields
    # an answer of ~70 tokens that ends at EOS, killed at 8: a client behind the server on a busy machine still
    # reads token 8 long before the answer's end (an 8-token answer could end before the kill lands)
    "smollm2-eos": ("smollm2", "CHAT:Explain in three sentences why the sky is blue.", 160, 8, {}),
    "smollm2-json-schema": (
        "smollm2",
        "CHAT:Describe Paris as JSON with its landmarks.",
        160,
        20,
        {"json_schema": SCHEMA},
    ),
    "gemma3-cjk": ("gemma3", "東京は日本の首都です。北京は中国の首都です。ソウルは", 30, 9, {}),
    "gemma3-past-the-window": ("gemma3", LONG_TEXT + "\nChapter 15.", 48, 24, {}),
}


async def until_ready(http: aiohttp.ClientSession, url: str, timeout_s: float = 60.0) -> None:
    """Wait until kvctl is ready again (its admin /readyz: its own poll found the restarted server up), not just the
    server's /health: until kvctl's poll, which backs off while the server is down, sees it, the proxy still
    answers 503 (what issue 34 changes)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        async with http.get(stack_admin(url) + "/readyz") as resp:
            if resp.status == 200:
                return
        assert loop.time() < deadline, f"the server behind {url} did not become ready in {timeout_s} s"
        await asyncio.sleep(0.2)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
async def test_streams_replayed_after_a_crash_end_the_same_way(
    model: str,
    request: pytest.FixtureRequest,
    llama_server_bin: Path,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    """kvctl --spawn, the server SIGKILLed mid-answer: the stream goes on from the restarted server. A replay
    evaluates the prompt and the tokens the client has again (like a recompute park), so it is held to the same
    guarantee: the tokens before the crash are the uncrashed run's, none dropped or repeated, the same kind of
    stop (EOS, the schema's JSON), no U+FFFD."""
    path: Path = request.getfixturevalue(model)
    sport = free_port()
    argv = server_argv(llama_server_bin, path, sport, *POOL)
    cases = {k: v for k, v in REPLAYS.items() if v[0] == model}
    log_path = tmp_path / "kvctl.log"
    with start_stack(f"http://127.0.0.1:{sport}", "--spawn", "--", *argv, log_path=log_path, timeout_s=60) as url:
        for name, (_, prompt, n_predict, kill_at, extra) in cases.items():
            if prompt.startswith("CHAT:"):
                prompt = user_turn(model, prompt[5:])
            req = native(prompt, n_predict, **extra)
            del req["id_slot"]
            ref = outcome(await run(http, url, req))
            before: list[int] = []

            async def kill(res: StreamResult, kill_at: int = kill_at, before: list[int] = before) -> None:
                if len(res.n_decoded) == kill_at and not before:
                    before.extend(res.announced_ids)
                    kill_server(sport)

            res = await asyncio.wait_for(run(http, url, req, kill), 120)
            assert before, f"{name}: the server was not killed (the answer ended before token {kill_at})"
            got = outcome(res)
            assert got[0][: len(before)] == ref[0][: len(before)] == before, f"{name}: a token before the crash changed"
            assert got[2] == ref[2], f"{name}: {got} ended unlike {ref}"
            assert "\ufffd" not in got[1]
            ids = got[0][:-1] if got[2] == "eos" else got[0]
            async with http.post(url + "/detokenize", json={"tokens": ids}) as resp:
                assert (await resp.json())["content"] == got[1], f"{name}: the streamed text is not the streamed ids"
            if "json_schema" in extra:
                assert set(json.loads(got[1])) == set(SCHEMA["required"]), got[1]
            if name == "smollm2-eos":
                assert "blue" in got[1], got
            await until_ready(http, url)  # the next case's reference run must not meet the restarted server loading
        log = log_path.read_text()
    assert log.count("replay.sent") == len(cases), log[-3000:]


async def test_the_safety_net_carries_gemma_past_a_full_pool(
    gemma3: Path, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    """Two Gemma continuations of a prompt past the window overflow a 1536-cell pool mid-generation: the server's
    safety net parks one (no controller here) and resumes it when the other ends; both reach n_predict with
    every token once, and no request fails."""
    srv = start_server("-c", "1536", "-np", "2", "-kvu", "--slots", "--metrics", "--no-cache-idle-slots", model=gemma3)
    reqs = [
        {"prompt": LONG_TEXT + f"\nChapter {15 + i}.", "n_predict": 160, "temperature": 0, "ignore_eos": True}
        for i in range(2)
    ]
    results = await asyncio.gather(*[run(http, srv.url, r) for r in reqs])
    for res in results:
        got = outcome(res)
        assert got[2] == "limit" and len(got[0]) == 160, got[2:]
        async with http.post(srv.url + "/detokenize", json={"tokens": got[0]}) as resp:
            assert (await resp.json())["content"] == got[1], "a token lost or repeated"
        assert "\ufffd" not in got[1]
    text = await (await http.get(srv.url + "/metrics")).text()
    parks = [float(line.split()[-1]) for line in text.split("\n") if line.startswith("llamacpp:slot_auto_parks_total")]
    assert parks and parks[0] > 0, "the pool never overflowed: the test shows nothing"
    assert sum(r.comments.count("parked") for r in results) >= 1
    assert "Context size has been exceeded" not in srv.log_text()
