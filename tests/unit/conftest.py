"""Fixtures the unit tests share: the scripted fake llama-server and a client of it."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from controller.upstream.client import UpstreamClient
from tests.fakes.llama_server import FakeLlamaServer
from tests.harness import serving


@pytest.fixture
def fake() -> FakeLlamaServer:
    return FakeLlamaServer()


@pytest.fixture
async def fake_url(fake: FakeLlamaServer) -> AsyncIterator[str]:
    async with serving(fake) as server:
        yield str(server.make_url(""))


@pytest.fixture
async def client(fake_url: str) -> AsyncIterator[UpstreamClient]:
    async with UpstreamClient(fake_url, timeout_s=0.5) as c:
        yield c
