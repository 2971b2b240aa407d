"""The batch-invariant server mode (`--exact`, patches 44-46): a request's tokens equal the same request's run
alone on an idle server, whatever runs beside it, and through every path kvctl continues a request by: parks by
swap, by recompute and to disk, the safety net, crash replay, a drain to a peer and a planned server restart.

Without `--exact` these comparisons fail on this CPU (bench/exact_causes.py: 1 target in 6 equal to its solo
run); the first test checks that the default still differs, so the others cannot pass by accident.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from testkit.llama import (
    StreamResult,
    first_difference,
    free_port,
    get_json,
    parse_metrics,
    server_argv,
    stream_completion,
)
from testkit.realmodels import user_turn
from testkit.stack import drain, restart_server, stack_admin, start_stack
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
LONG = 160  # the requests kvctl moves: long enough to be mid-stream when it does


async def one(
    http: aiohttp.ClientSession, url: str, model: Path, text: str, tokens: int = TOKENS, delay: float = 0
) -> StreamResult:
    await asyncio.sleep(delay)
    payload: dict[str, Any] = {"prompt": user_turn(model, text), "n_predict": tokens, "ignore_eos": True}
    payload["cache_prompt"] = False
    res = await stream_completion(http, url, payload)
    assert res.status == 200 and res.error is None and len(res.tokens) == tokens, (res.status, res.error)
    return res


async def solo(http: aiohttp.ClientSession, url: str, model: Path) -> list[StreamResult]:
    return [await one(http, url, model, t) for t in TARGETS]


_SOLO: dict[tuple[str, str, int, tuple[str, ...]], StreamResult] = {}


async def reference(
    start_server: ServerFactory, http: aiohttp.ClientSession, model: Path, texts: list[str], tokens: int, *flags: str
) -> list[StreamResult]:
    """Each text's run alone on an idle `--exact` server with ``flags``, kept for the module's later tests: the mode
    makes a solo run the same on any server of this build."""
    key = [(str(model), t, tokens, flags) for t in texts]
    if any(k not in _SOLO for k in key):
        srv = start_server(*POOL, "--exact", *flags, model=model)
        for k, t in zip(key, texts, strict=True):
            _SOLO[k] = _SOLO.get(k) or await one(http, srv.url, model, t, tokens)
    return [_SOLO[k] for k in key]


async def mixed(http: aiohttp.ClientSession, url: str, model: Path) -> list[StreamResult]:
    """The targets at once, and three longer prompts that arrive while they decode."""
    res = await asyncio.gather(
        *[one(http, url, model, t) for t in TARGETS],
        *[one(http, url, model, o, delay=0.3 + 0.3 * i) for i, o in enumerate(OTHERS)],
    )
    return list(res[: len(TARGETS)])


def departures(ref: list[StreamResult], res: list[StreamResult]) -> list[int | None]:
    """Per target, None when its ids equal the reference's, else the index of the first different token."""
    return [first_difference(a.tokens, b.tokens) for a, b in zip(ref, res, strict=True)]


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


@pytest.mark.parametrize(("fa", "how"), [("on", "swap"), ("off", "recompute"), ("on", "disk")])
async def test_forced_parks_by_swap_by_recompute_and_to_disk_equal_solo_runs(
    fa: str, how: str, smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Every generating request parked and resumed every 16 tokens while others run: by swap (its cells come back
    wherever the pool has room), by recompute (its tokens evaluated again as one prompt), or through a file (1 MiB
    of RAM for snapshots: all but the smallest go to disk)."""
    park = {
        "swap": ("--park-ram", "-1"),
        "recompute": ("--park-ram", "0"),
        "disk": ("--park-ram", "1", "--park-disk", str(tmp_path)),
    }[how]
    ref = await reference(start_server, http, smollm2, TARGETS, TOKENS, "-fa", fa)
    srv = start_server(*POOL, "--metrics", "--exact", "-fa", fa, "--park-test-interval", "16", *park, model=smollm2)
    res = await mixed(http, srv.url, smollm2)
    assert all(r.comments.count("parked") >= 3 for r in res), [r.comments for r in res]
    assert_same(ref, res)
    m = await metrics(http, srv.url)
    recomputed = m["llamacpp:slot_recompute_parks_total"]
    assert m["llamacpp:slot_parks_total"] >= 9
    assert recomputed == (m["llamacpp:slot_parks_total"] if how == "recompute" else 0), m
    disk = (await get_json(http, f"{srv.url}/kv"))["park_disk"]
    if how == "disk":  # all but the smallest snapshots went through files, and came back
        assert disk["writes"] >= 3 and disk["reads"] == disk["writes"] and disk["fallbacks"] == 0, disk
    else:
        assert disk is None, disk


async def test_the_safety_net_s_parks_equal_solo_runs(
    smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession
) -> None:
    """A pool of 512 cells that three chats of 200 tokens overflow: the server parks one of them itself."""
    ref = await reference(start_server, http, smollm2, TARGETS, 200)
    srv = start_server("-c", "512", "-np", "3", "-kvu", "--slots", "--no-cache-idle-slots", "--exact", model=smollm2)
    res = await asyncio.gather(*[one(http, srv.url, smollm2, t, 200) for t in TARGETS])
    assert sum(r.comments.count("parked") for r in res) >= 1, "the pool overflowed and the net parked"
    assert_same(ref, list(res))


def exact_stack(binary: Path, model: Path, log: Path) -> tuple[AbstractContextManager[str], list[str]]:
    """kvctl spawning a server of POOL in the exact mode (`supervisor.exact`); the proxy's URL, and the server's
    argv (its port after `--port`)."""
    argv = server_argv(binary, model, free_port(), *POOL, "--metrics")
    env = {"KVCTL_SUPERVISOR__EXACT": "true", "KVCTL_PROXY__PEER_API_KEY": "peer-secret-exact"}
    sport = argv[argv.index("--port") + 1]
    return start_stack(f"http://127.0.0.1:{sport}", "--spawn", "--", *argv, env=env, log_path=log), argv


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
    (ref,) = await reference(start_server, http, smollm2, TARGETS[:1], LONG)
    log = tmp_path / "kvctl.log"
    stack, argv = exact_stack(llama_server_bin, smollm2, log)
    sport = int(argv[argv.index("--port") + 1])
    with stack as url:
        status = await get_json(http, f"{stack_admin(url)}/status")
        assert status["upstream"]["exact"] is True
        kills: list[int] = []

        async def kill_once(res: StreamResult) -> None:
            if len(res.tokens) >= 60 and not kills:
                kills.append(len(res.tokens))
                kill_server(sport)

        payload: dict[str, Any] = {"prompt": user_turn(smollm2, TARGETS[0]), "n_predict": LONG, "ignore_eos": True}
        target = stream_completion(http, url, {**payload, "cache_prompt": False}, on_chunk=kill_once)
        others = [one(http, url, smollm2, t, 40) for t in TARGETS[1:]]
        res, *_ = await asyncio.wait_for(asyncio.gather(target, *others, return_exceptions=True), 240)
    assert kills and "replay.sent" in log.read_text()
    assert isinstance(res, StreamResult) and res.error is None, res
    assert res.tokens == ref.tokens and res.content == ref.content


async def moved_mid_stream(
    http: aiohttp.ClientSession, url: str, model: Path, move: Callable[[], Awaitable[None]]
) -> list[StreamResult]:
    """The three targets streamed through kvctl at ``url``; ``move`` runs once the first has 48 tokens."""
    started = asyncio.Event()

    async def watch(res: StreamResult) -> None:
        if len(res.tokens) >= 48:
            started.set()

    payload: dict[str, Any] = {"n_predict": LONG, "ignore_eos": True, "cache_prompt": False}
    runs = [
        asyncio.ensure_future(
            stream_completion(http, url, {**payload, "prompt": user_turn(model, t)}, on_chunk=watch if i == 0 else None)
        )
        for i, t in enumerate(TARGETS)
    ]
    await asyncio.wait_for(started.wait(), 120)
    await move()
    return list(await asyncio.wait_for(asyncio.gather(*runs), 240))


async def test_a_drain_to_a_peer_equals_solo_runs(
    llama_server_bin: Path, smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """`kvctl drain` moves three streams from replica A to B mid-stream (both spawned with `supervisor.exact`): B
    evaluates each one's prompt and tokens so far as a new prompt, and continues it into exactly its solo run."""
    ref = await reference(start_server, http, smollm2, TARGETS, LONG)
    with ExitStack() as stack:
        cm_a, _ = exact_stack(llama_server_bin, smollm2, tmp_path / "a.log")
        cm_b, _ = exact_stack(llama_server_bin, smollm2, tmp_path / "b.log")
        a, b = stack.enter_context(cm_a), stack.enter_context(cm_b)

        async def move() -> None:
            code, answer = await asyncio.to_thread(drain, a, b)
            assert code == 0 and answer["moved"] == 3, answer

        res = await moved_mid_stream(http, a, smollm2, move)
    for r in res:
        assert r.error is None and len(r.tokens) == LONG, r.error
    assert_same(ref, res)


async def test_a_planned_restart_equals_solo_runs(
    llama_server_bin: Path, smollm2: Path, start_server: ServerFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """`kvctl restart-server` replaces the server (spawned with `supervisor.exact`; the new command line gets
    `--exact` too) while three targets stream: each continues on the new server into exactly its solo run."""
    ref = await reference(start_server, http, smollm2, TARGETS, LONG)
    cm, argv = exact_stack(llama_server_bin, smollm2, tmp_path / "k.log")
    with cm as url:
        pid = (await get_json(http, f"{stack_admin(url)}/status"))["supervisor"]["pid"]

        async def move() -> None:
            code, answer = await asyncio.to_thread(restart_server, url, *argv)
            assert code == 0 and answer["moved"] == 3 and answer["failed"] == 0, answer

        res = await moved_mid_stream(http, url, smollm2, move)
        st = await get_json(http, f"{stack_admin(url)}/status")
    assert st["supervisor"]["pid"] != pid and st["supervisor"]["restarts"] == 1
    assert "--exact" in st["supervisor"]["argv"] and st["upstream"]["exact"] is True
    for r in res:
        assert r.error is None and len(r.tokens) == LONG, r.error
    assert_same(ref, res)


def test_exact_without_the_unified_pool_is_a_start_error(llama_server_bin: Path, smollm2: Path) -> None:
    argv = server_argv(llama_server_bin, smollm2, free_port(), "-np", "2", "-no-kvu", "--exact")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "--exact needs a unified KV pool (-kvu)" in out.stderr
