"""What the test modules share: kvctl started in this process, request bodies, and the inputs several files build.

A test module imports from here (and from ``tests.fakes``, ``testkit``), never from another test module or a
conftest (tests/unit/test_layers.py checks it). Fixtures stay in the conftest files; their types are here. What the
benchmarks need too lives in ``testkit`` instead (``free_port``, ``testkit.policy_sim``).

- ``running_app``: ``kvctl run`` in this process (control loop, admin listener, proxy) against the fake server or a
  real one; ``serving``: the fake llama-server on a loopback port; ``admin_app``, ``admin_posts``: bodies POSTed to
  an admin route
- ``request``, ``assert_complete``, ``POOL``: a real server's generations, and the pool most tests give it
- ``ServerFactory``, ``ProxyFactory``: the types of the integration fixtures ``start_server`` and ``start_proxy``
- ``kill_server``, ``pinned_routes``: a spawned server by its port; the pinned server's registered routes
- the control loop's inputs (``LOOP_NOW``, ``loop_settings``, ``plenty``, ``pressured``, ``park_answer``,
  ``loop_sample``), the policy's hypothesis strategy (``POLICY_NOW``, ``PROPS``, ``snapshots``)
- ``require_module``, ``K8S_MIN_VERSION``: the deploy checks' optional validator and the oldest Kubernetes
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import re
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import aiohttp
import psutil
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from controller.admin.app import make_admin_app
from controller.app import App
from controller.loop.control import ControlLoop
from controller.metrics import Metrics
from controller.policy.types import PolicyConfig
from controller.probes.host import HostMemory
from controller.settings import RestoreOrder, Settings, load_settings
from controller.upstream.client import UpstreamClient
from controller.upstream.models import KvSnapshot, ParkMode, ParkRates
from testkit.llama import NO_BYTE_TOKENS, ServerProcess, StreamResult, free_port
from testkit.snapshots import S, kv
from tests.fakes.llama_server import FakeLlamaServer, Reply, kv_body

# --- kvctl in this process -------------------------------------------------------------------------

FAST_LOOP = {"poll_interval_s": 0.01, "backoff_initial_s": 0.01, "backoff_max_s": 0.05}
"""The ``loop`` group of a test against the fake server: a poll every 10 ms, retries as quick."""


class RunningApp(NamedTuple):
    """kvctl started by ``running_app``: the App, its proxy's URL and its admin listener's URL."""

    app: App
    proxy: str
    admin: str


@contextlib.asynccontextmanager
async def serving(fake: FakeLlamaServer) -> AsyncIterator[TestServer]:
    """The fake llama-server on a loopback port for the block; its URL is ``server.make_url("")``."""
    server = TestServer(fake.app())
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


AdminCase = tuple[bytes, int, str | None]
"""A body to POST to an admin route, the status it must get, and its error code (None: a success)."""


def admin_app(**actions: Any) -> web.Application:
    """make_admin_app over a control loop whose server does not answer, with the actions given (``restart_server``,
    ``drain``, ``keeper``): the admin routes' own checks, apart from a server."""
    settings = load_settings(overrides={"upstream": {"url": "http://127.0.0.1:9"}})
    loop = ControlLoop(UpstreamClient("http://127.0.0.1:9"), settings, Metrics(CollectorRegistry()))
    return make_admin_app(settings, loop, **actions)


async def admin_posts(app: web.Application, path: str, cases: Sequence[AdminCase]) -> list[Any]:
    """POST each case's body to ``path`` of the admin ``app`` (make_admin_app) on a loopback port, in order: each
    status, and each error's code in the envelope and in ``X-Kvctl-Error``, as the case says; the successes' JSON."""
    server = TestServer(app)
    await server.start_server()
    answers = []
    try:
        async with aiohttp.ClientSession() as http:
            for body, status, code in cases:
                async with http.post(server.make_url(path), data=body) as r:
                    assert r.status == status, body
                    answer = await r.json()
                    if code is None:
                        answers.append(answer)
                    else:
                        assert answer["error"]["code"] == code and r.headers["X-Kvctl-Error"] == code, body
    finally:
        await server.close()
    return answers


@contextlib.asynccontextmanager
async def running_app(
    upstream: FakeLlamaServer | str,
    /,
    *,
    stop: asyncio.Event | None = None,
    start_timeout_s: float = 30.0,
    stop_timeout_s: float = 30.0,
    **groups: dict[str, Any],
) -> AsyncIterator[RunningApp]:
    """``kvctl run`` in this process in front of ``upstream`` (the fake, served for the block, or a server's URL).

    ``groups``: settings groups overridden (``proxy={"queue_depth": 1}``, ``loop=FAST_LOOP``), merged over the
    harness's own: the proxy and the admin listener each on a free loopback port. ``stop``: an event the test sets
    itself to stop kvctl inside the block (a drain); either way kvctl must stop cleanly (exit code 0) by the end.
    """
    async with contextlib.AsyncExitStack() as stack:
        if isinstance(upstream, FakeLlamaServer):
            server = await stack.enter_async_context(serving(upstream))
            upstream = str(server.make_url(""))
        pport, aport = free_port(), free_port()
        overrides: dict[str, dict[str, Any]] = {
            "upstream": {"url": upstream},
            "proxy": {"listen": f"127.0.0.1:{pport}"},
            "admin": {"listen": f"127.0.0.1:{aport}"},
        }
        for group, values in groups.items():
            overrides[group] = {**overrides.get(group, {}), **values}
        app = App(load_settings(overrides=overrides))
        stop = stop or asyncio.Event()
        task = asyncio.create_task(app.run(stop), name="kvctl")
        started = asyncio.create_task(app.started.wait())
        await asyncio.wait({task, started}, timeout=start_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        try:
            assert app.started.is_set(), f"kvctl did not start in {start_timeout_s} s"
            yield RunningApp(app, f"http://127.0.0.1:{pport}", f"http://127.0.0.1:{aport}")
        finally:
            stop.set()
            assert await asyncio.wait_for(task, stop_timeout_s) == 0, "kvctl must stop cleanly"


# --- a real server's generations -------------------------------------------------------------------

POOL = ("-c", "4096", "-np", "4", "-kvu", "--slots", "--metrics")
"""A server of 4 slots sharing a 4096-cell pool, with the slot and metrics routes kvctl reads."""


def request(
    prompt: str | list[int], n_predict: int, slot: int | None = None, *, byte_tokens: bool = False, **extra: Any
) -> dict[str, Any]:
    """A ``/completion`` body that generates exactly ``n_predict`` tokens (``ignore_eos``); ``extra`` is merged in.

    ``slot``: pinned to that slot, without the prompt cache (a parked slot is not reused for another prompt).
    Byte-fallback tokens are banned (``NO_BYTE_TOKENS``: each token then gets its own stream chunk) unless
    ``byte_tokens``: those ids are the llama SPM vocab's, another vocab (Qwen's) keeps its tokens.
    """
    body: dict[str, Any] = {"prompt": prompt, "n_predict": n_predict, "ignore_eos": True}
    if slot is not None:
        body |= {"id_slot": slot, "cache_prompt": False}
    if not byte_tokens:
        body["logit_bias"] = NO_BYTE_TOKENS
    return {**body, **extra}


def assert_complete(results: Sequence[StreamResult], n_predict: int) -> None:
    """Every stream ended well with all ``n_predict`` tokens, each seen once and in order."""
    for res in results:
        assert res.status == 200 and res.error is None, res.error
        assert res.final is not None and res.final["tokens_predicted"] == n_predict
        assert res.n_decoded == list(range(1, n_predict + 1))


# --- the integration fixtures' types (tests/integration/conftest.py) -------------------------------

ServerFactory = Callable[..., ServerProcess]
"""``start_server(*args, model=None)``: a real server started for one test, stopped at its end."""

ProxyFactory = Callable[..., Awaitable[str]]
"""``await start_proxy(upstream, gate=None, **ProxyConfig fields)``: the proxy alone in this process; its URL."""


# --- a server kvctl spawned, and the pinned server's source ----------------------------------------


def kill_server(port: int, sig: int = signal.SIGKILL) -> int:
    """Signal the llama-server listening on ``port`` (the one kvctl spawned); its pid."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if "--port" in cmd and cmd[cmd.index("--port") + 1] == str(port) and "llama-server" in cmd[0]:
            os.kill(proc.pid, sig)
            return int(proc.pid)
    raise AssertionError(f"no llama-server on port {port}")


REGISTRATION = re.compile(r'ctx_http\.(get|post|del)\s*\(\s*"([^"]+)"')
METHODS = {"get": "GET", "post": "POST", "del": "DELETE"}


def pinned_server_source() -> Path:
    """tools/server/server.cpp of the pinned, patched tree: build_llama.sh keeps it beside the binary."""
    binary = os.environ.get("LLAMA_SERVER_BIN_PATH")
    if not binary:
        pytest.fail("LLAMA_SERVER_BIN_PATH is not set: run the suite with scripts/test.sh")
    path = Path(binary).parent.parent / "src" / "server.cpp"
    assert path.is_file(), f"{path} is missing: rebuild with scripts/build_llama.sh --force"
    return path


def pinned_routes() -> set[tuple[str, str]]:
    """Every (method, path) the pinned server registers."""
    found = {(METHODS[m], p) for m, p in REGISTRATION.findall(pinned_server_source().read_text())}
    assert len(found) > 40, "the registration pattern no longer matches server.cpp"
    return found


# --- the control loop's inputs (against the fake server) -------------------------------------------

LOOP_NOW = 10_000_000
"""The control loop's clock (``clock_ms``) in the loop's tests, in ms."""


def loop_settings(policy: dict[str, Any] | None = None, **loop: Any) -> Settings:
    """Settings for a control loop against the fake server: FAST_LOOP with ``loop`` over it, ``policy``'s group."""
    return load_settings(overrides={"loop": {**FAST_LOOP, **loop}, "policy": policy or {}})


def plenty() -> HostMemory:
    """A host with 64 GiB free: the host never limits a park."""
    return HostMemory(available_bytes=64 * 2**30, total_bytes=64 * 2**30)


def pressured() -> dict[str, Any]:
    """A ``/kv`` body of 950 of 1000 cells in use: the newest request (slot 2, task 3) must be parked."""
    return kv_body(
        1000,
        [
            {"state": "generating", "n_cells": 600, "id_task": 1, "t_arrival_ms": 1},
            {"state": "generating", "n_cells": 200, "id_task": 2, "t_arrival_ms": 2},
            {"state": "generating", "n_cells": 150, "id_task": 3, "t_arrival_ms": 3},
        ],
    )


def park_answer(slot: int, task: int, **extra: Any) -> Reply:
    """The server's answer to a park of ``task`` on ``slot`` (150 cells), ``extra`` fields merged in."""
    body = {
        "id_slot": slot,
        "id_task": task,
        "action": "park",
        "n_cells": 150,
        "n_bytes": 0,
        "park_count": 1,
        "timings": {"park_ms": 0.2},
    }
    return Reply(body={**body, **extra})


def loop_sample(loop: ControlLoop, name: str, **labels: str) -> float:
    """One sample of the loop's registry; 0 when the series does not exist (yet)."""
    value = loop.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# --- the policy's hypothesis strategy ---------------------------------------------------------------

POLICY_NOW = 1_000_000
"""``now_ms`` of the policy's tests, in ms."""

BOTH = (ParkMode.SWAP, ParkMode.RECOMPUTE)
"""A server that parks by swap and by recompute."""

POOL_CELLS = st.integers(min_value=64, max_value=4096)

PROPS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""The hypothesis settings of the policy's properties."""


@st.composite
def snapshots(draw: st.DrawFn) -> tuple[KvSnapshot, PolicyConfig, int | None]:
    """An arbitrary consistent ``/kv`` snapshot at POLICY_NOW, a policy configuration, and the host's free bytes."""
    n = draw(POOL_CELLS)
    n_slots = draw(st.integers(1, 8))
    bpc = draw(st.sampled_from([1, 512, 1000]))
    # None: an older server (swap only, no costs published)
    modes = draw(st.sampled_from([None, None, (), (ParkMode.RECOMPUTE,), BOTH, BOTH]))
    slots: list[S] = []
    free = n
    for i in range(n_slots):
        state = draw(st.sampled_from(["idle", "prompt", "generating", "generating", "parked"]))
        cap = n if state == "parked" else free
        cells = draw(st.integers(0, max(0, cap)))
        if state != "parked":
            free -= cells
        slots.append(
            S(
                state,
                cells,
                id_task=None if state == "idle" else draw(st.integers(0, 50)) * 10 + i,
                t_arrival_ms=draw(st.integers(0, 20)),
                park_count=draw(st.integers(0, 3)),
                parked_since_ms=POLICY_NOW - draw(st.integers(0, 60_000)),
                n_draft_max=draw(st.sampled_from([0, 0, 2, 5])),
                n_prompt_left=draw(st.integers(0, 600)),
                snapshot_bytes=cells * bpc + draw(st.sampled_from([0, 0, 1, bpc * 100])),
                mode=draw(st.sampled_from([None, ParkMode.RECOMPUTE])) if modes and state == "parked" else None,
                recomputing=modes is not None and state == "prompt" and draw(st.booleans()),
            )
        )
    budget = draw(st.none() | st.integers(0, 2 * n * bpc))
    draft = draw(st.none() | st.integers(max(1, n - free), 2 * n))
    cfg = PolicyConfig(
        high=draw(st.floats(0.5, 0.99)),
        low=0.0,
        budget_bytes=draw(st.integers(0, 2 * n * bpc)),
        host_reserve_bytes=draw(st.integers(0, n * bpc)),
        margin_cells=draw(st.integers(0, 32)),
        order=draw(st.sampled_from(list(RestoreOrder))),
        max_wait_ms=draw(st.integers(1, 60_000)),
        gpu_floor_bytes=100,
    )
    cfg = replace(cfg, low=draw(st.floats(0.05, cfg.high - 0.01)))
    host = draw(st.none() | st.integers(0, 2 * n * bpc))
    server_host = draw(st.none() | st.integers(0, 2 * n * bpc)) if modes is not None else None
    rate = st.none() | st.floats(1.0, 1e9)
    rates = ParkRates(copy_bytes_per_s=draw(rate), prompt_tokens_per_s=draw(rate))
    snap = kv(
        n,
        slots,
        draft_cells=draft,
        bytes_per_cell=bpc,
        budget=budget,
        park_modes=modes,
        host_ram=server_host,
        rates=rates if modes is not None else None,
    )
    return snap, cfg, host


# --- the deploy checks' optional validators ---------------------------------------------------------

K8S_MIN_VERSION = "1.30"  # the oldest Kubernetes the manifests support: the preStop sleep action is 1.30's


def require_module(name: str, package: str) -> ModuleType:
    """The module, or a skip naming the package (a failure under CI, as tests/unit/test_deploy.py's require_tool)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        reason = f"{name} is not installed (pip install -e '.[test]' installs {package})"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; under CI a missing validator is a failure, not a skip")
        pytest.skip(reason)
