"""Fixtures the unit tests share: the scripted fake llama-server and a client of it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestServer

from controller.upstream.client import UpstreamClient
from tests.fakes.llama_server import FakeLlamaServer


@pytest.fixture
def fake() -> FakeLlamaServer:
    return FakeLlamaServer()


@pytest.fixture
async def fake_url(fake: FakeLlamaServer) -> AsyncIterator[str]:
    server = TestServer(fake.app())
    await server.start_server()
    yield str(server.make_url(""))
    await server.close()


@pytest.fixture
async def client(fake_url: str) -> AsyncIterator[UpstreamClient]:
    async with UpstreamClient(fake_url, timeout_s=0.5) as c:
        yield c
