"""A server in router mode (several models) is refused at start-up: /kv and parking are per child."""

from __future__ import annotations

import asyncio

import structlog
from aiohttp.test_utils import TestServer

from controller.app import App
from controller.settings import load_settings
from tests.fakes.llama_server import FakeLlamaServer


async def run_against(props: dict[str, object]) -> tuple[int | None, list[dict[str, object]]]:
    fake = FakeLlamaServer()
    fake.props = props
    server = TestServer(fake.app())
    await server.start_server()
    settings = load_settings(
        overrides={
            "upstream": {"url": str(server.make_url(""))},
            "proxy": {"listen": "127.0.0.1:0"},
            "admin": {"listen": "127.0.0.1:0"},
        }
    )
    stop = asyncio.Event()
    try:
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(App(settings).run(stop))
            done, _ = await asyncio.wait({task}, timeout=3)
            if not done:
                stop.set()
                return None, logs
            return task.result(), logs
    finally:
        stop.set()
        await server.close()


async def test_a_router_is_refused_with_a_clear_message() -> None:
    code, logs = await run_against({"role": "router", "max_instances": 4})
    assert code == 2
    refused = [e for e in logs if e["event"] == "kvctl.refused"]
    assert refused and "router mode" in str(refused[0]["reason"])


async def test_a_single_model_server_is_served() -> None:
    code, _ = await run_against({"default_generation_settings": {}})
    assert code is None, "kvctl kept running"
