"""The batch-invariant server mode (`--exact`, patches 44-46): a request's tokens equal the same request's run
alone on an idle server, whatever runs beside it, and through parks by swap, by recompute and by the safety net.

Without `--exact` these comparisons fail on this CPU (bench/exact_causes.py: 1 target in 6 equal to its solo
run); the first test checks that the default still differs, so the others cannot pass by accident.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from testkit import realmodels
from testkit.llama import StreamResult, free_port, get_json, parse_metrics, server_argv, stream_completion
from testkit.stack import stack_admin, start_stack
from tests.harness import ServerFactory, kill_server


async def metrics(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as r:
        return parse_metrics(await r.text())


POOL = ("-c", "4096", "-np", "8", "-kvu", "--slots", "--no-cache-idle-slots")
TARGETS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle works.",
    "List ten facts about the moon.",
]
OTHERS = [f"Summarise this text: {'The river ran past the old mill and the village. ' * n}" for n in (6, 14, 24)]
TOKENS = 64


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return realmodels.model_path("smollm2")


@pytest.fixture(scope="module")
def gemma3() -> Path:
    return realmodels.model_path("gemma3")


def prompt(model: Path, text: str) -> str:
    if model.name.startswith("gemma"):
        return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


async def one(
    http: aiohttp.ClientSession, url: str, model: Path, text: str, tokens: int = TOKENS, delay: float = 0
) -> StreamResult:
    await asyncio.sleep(delay)
    payload: dict[str, Any] = {"prompt": prompt(model, text), "n_predict": tokens, "ignore_eos": True}
    payload["cache_prompt"] = False
    res = await stream_completion(http, url, payload)
    assert res.status == 200 and res.error is None and len(res.tokens) == tokens, (res.status, res.error)
    return res


async def solo(http: aiohttp.ClientSession, url: str, model: Path) -> list[StreamResult]:
    return [await one(http, url, model, t) for t in TARGETS]


async def mixed(http: aiohttp.ClientSession, url: str, model: Path) -> list[StreamResult]:
    """The targets at once, and three longer prompts that arrive while they decode."""
    res = await asyncio.gather(
        *[one(http, url, model, t) for t in TARGETS],
        *[one(http, url, model, o, delay=0.3 + 0.3 * i) for i, o in enumerate(OTHERS)],
    )
    return list(res[: len(TARGETS)])


def departures(ref: list[StreamResult], res: list[StreamResult]) -> list[int | None]:
    """Per target, None when its ids equal the reference's, else the index of the first different token."""
    out: list[int | None] = []
    for a, b in zip(ref, res, strict=True):
        out.append(next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=True)) if x != y), None))
    return out


def assert_same(ref: list[StreamResult], res: list[StreamResult]) -> None:
    assert departures(ref, res) == [None] * len(ref)
    assert [r.content for r in res] == [r.content for r in ref], "equal ids, equal text"


async def test_the_default_mode_differs_and_says_it_is_not_exact(
    smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL, "-fa", "on", model=smollm2)
    assert (await get_json(http, f"{srv.url}/kv"))["server"]["exact"] is False
    ref = await solo(http, srv.url, smollm2)
    tries = [departures(ref, await mixed(http, srv.url, smollm2)) for _ in range(2)]
    assert any(d is not None for t in tries for d in t), f"the default mode matched solo runs: {tries}"


@pytest.mark.parametrize("fa", ["on", "off"])
async def test_concurrent_runs_equal_solo_runs(
    fa: str, smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    srv = start_server(*POOL, "--exact", "-fa", fa, model=smollm2)
    assert (await get_json(http, f"{srv.url}/kv"))["server"]["exact"] is True
    assert (await get_json(http, f"{srv.url}/props"))["exact"] is True
    ref = await solo(http, srv.url, smollm2)
    for _ in range(2):
        assert_same(ref, await mixed(http, srv.url, smollm2))


async def test_an_iswa_model_with_a_q8_0_cache_equals_its_solo_runs(
    gemma3: Path, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    """Gemma 3: a sliding-window cache whose cells are reused as the window moves, so they lie out of position
    order; q8_0 K and V."""
    srv = start_server(*POOL, "--exact", "-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0", model=gemma3)
    ref = await solo(http, srv.url, gemma3)
    assert_same(ref, await mixed(http, srv.url, gemma3))


@pytest.mark.parametrize(("fa", "park"), [("on", ("--park-ram", "-1")), ("off", ("--park-ram", "0"))])
async def test_forced_parks_by_swap_and_by_recompute_equal_solo_runs(
    fa: str, park: tuple[str, ...], smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    """Every generating request parked and resumed every 16 tokens while others run: by swap (its cells come back
    wherever the pool has room) or by recompute (its tokens evaluated again as one prompt)."""
    ref_srv = start_server(*POOL, "--exact", "-fa", fa, model=smollm2)
    srv = start_server(*POOL, "--metrics", "--exact", "-fa", fa, "--park-test-interval", "16", *park, model=smollm2)
    ref = await solo(http, ref_srv.url, smollm2)
    res = await mixed(http, srv.url, smollm2)
    assert all(r.comments.count("parked") >= 3 for r in res), [r.comments for r in res]
    assert_same(ref, res)
    m = await metrics(http, srv.url)
    recomputed = m["llamacpp:slot_recompute_parks_total"]
    assert m["llamacpp:slot_parks_total"] >= 9
    assert recomputed == (0 if park[1] == "-1" else m["llamacpp:slot_parks_total"]), m


async def test_the_safety_net_s_parks_equal_solo_runs(
    smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    """A pool of 512 cells that three chats of 200 tokens overflow: the server parks one of them itself."""
    ref_srv = start_server(*POOL, "--exact", model=smollm2)
    srv = start_server("-c", "512", "-np", "3", "-kvu", "--slots", "--no-cache-idle-slots", "--exact", model=smollm2)
    ref = [await one(http, ref_srv.url, smollm2, t, 200) for t in TARGETS]
    res = await asyncio.gather(*[one(http, srv.url, smollm2, t, 200) for t in TARGETS])
    assert sum(r.comments.count("parked") for r in res) >= 1, "the pool overflowed and the net parked"
    assert_same(ref, list(res))


async def test_a_crash_replay_through_kvctl_equals_the_solo_run(
    llama_server_bin: Path,
    smollm2: Path,
    start_server: ServerFactory,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    """kvctl's `supervisor.exact` spawns the server with `--exact` and `/status` says so; the server is killed while
    a target streams beside two others, and kvctl's replay (the client's tokens evaluated again as a prompt, on the
    restarted server) continues it into exactly its solo run."""
    ref_srv = start_server(*POOL, "--exact", model=smollm2)
    ref = await one(http, ref_srv.url, smollm2, TARGETS[0], 160)
    sport = free_port()
    argv = server_argv(llama_server_bin, smollm2, sport, *POOL)
    env = {"KVCTL_SUPERVISOR__EXACT": "true"}
    log = tmp_path / "kvctl.log"
    with start_stack(f"http://127.0.0.1:{sport}", "--spawn", "--", *argv, env=env, log_path=log) as url:
        status = await get_json(http, f"{stack_admin(url)}/status")
        assert status["upstream"]["exact"] is True
        kills: list[int] = []

        async def kill_once(res: StreamResult) -> None:
            if len(res.tokens) >= 60 and not kills:
                kills.append(len(res.tokens))
                kill_server(sport)

        payload: dict[str, Any] = {"prompt": prompt(smollm2, TARGETS[0]), "n_predict": 160, "ignore_eos": True}
        target = stream_completion(http, url, {**payload, "cache_prompt": False}, on_chunk=kill_once)
        others = [one(http, url, smollm2, t, 40) for t in TARGETS[1:]]
        res, *_ = await asyncio.wait_for(asyncio.gather(target, *others, return_exceptions=True), 240)
    assert kills and "replay.sent" in log.read_text()
    assert isinstance(res, StreamResult) and res.error is None, res
    assert res.tokens == ref.tokens and res.content == ref.content


def test_exact_without_the_unified_pool_is_a_start_error(llama_server_bin: Path, smollm2: Path) -> None:
    argv = server_argv(llama_server_bin, smollm2, free_port(), "-np", "2", "-no-kvu", "--exact")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "--exact needs a unified KV pool (-kvu)" in out.stderr
