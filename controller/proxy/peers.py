"""Peers: the other kvctl listeners a draining replica moves its requests to (``proxy.drain_peers``).

A peer is another kvctl's public listener. Before a drain sends it anything, it is asked whether it can take
requests: ``/health`` answers 200, and ``/v1/models`` lists the same models as this replica's server, with the same
metadata (the server's ``meta``: parameters, size, vocabulary, training context), since a continuation's token ids
mean something only to the same model. Then each request goes to it as a client would send it, with the peer key
in ``X-Kvctl-Peer`` in place of the client's credentials (which this replica checked): a request nothing was
answered for yet is sent whole, a stream is continued from the ids its client has (``continuation_tokens``). A
peer that does not answer 200 (down, full, draining itself, another model) is skipped for the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import structlog
from yarl import URL

from controller.proxy.config import ProxyConfig
from controller.proxy.context import RequestContext
from controller.proxy.forward import CREDENTIALS, Opened, Upstream, close_response, upstream_body
from controller.proxy.handover import HANDOVER_HEADER

__all__ = ["PEER_HEADER", "PeerRefused", "Peers", "model_list"]

log = structlog.get_logger("kvctl.proxy")

PEER_HEADER = "X-Kvctl-Peer"
_CHECK_TIMEOUT_S = 5.0


class PeerRefused(Exception):
    """The peer did not take the request: its status and the start of its answer."""


def model_list(body: bytes | None) -> list[tuple[str, str]] | None:
    """What a ``/v1/models`` answer says a server serves: (id, its metadata as JSON) for each; None when unreadable."""
    try:
        doc = json.loads(body or b"")
        return sorted((str(m["id"]), json.dumps(m.get("meta"), sort_keys=True)) for m in doc["data"])
    except (ValueError, KeyError, TypeError):
        return None


class Peers:
    def __init__(self, config: ProxyConfig, upstream: Upstream) -> None:
        self.config = config
        self.upstream = upstream  # its session, and this replica's server for the model list

    def _headers(self, base: dict[str, str]) -> dict[str, str]:
        drop = {*CREDENTIALS, PEER_HEADER.lower(), HANDOVER_HEADER.lower()}
        headers = {k: v for k, v in base.items() if k.lower() not in drop}
        if self.config.peer_api_key:
            headers[PEER_HEADER] = self.config.peer_api_key
        return headers

    async def _models(self, url: str, headers: dict[str, str]) -> list[tuple[str, str]] | None:
        assert self.upstream.session is not None
        async with asyncio.timeout(_CHECK_TIMEOUT_S), self.upstream.session.get(url, headers=headers) as r:
            return model_list(await r.read()) if r.status == 200 else None

    async def check(self, peer: str) -> str | None:
        """Why ``peer`` cannot take this replica's requests now, or None when it can."""
        assert self.upstream.session is not None
        try:
            async with asyncio.timeout(_CHECK_TIMEOUT_S), self.upstream.session.get(peer + "/health") as r:
                if r.status != 200:
                    return f"/health answered {r.status}"
            ours = await self._models(self.upstream.own_url("/v1/models"), self.upstream.own_headers())
            theirs = await self._models(peer + "/v1/models", self._headers({}))
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            return f"unreachable: {e or type(e).__name__}"
        if theirs is None:
            return "its /v1/models did not answer a model list (is proxy.peer_api_key the same on both?)"
        if ours is None:
            return "this replica's server did not answer its model list"
        if theirs != ours:
            return f"it serves another model: {[m for m, _ in theirs]} (here: {[m for m, _ in ours]})"
        return None

    async def send(self, ctx: RequestContext, peer: str, body: bytes, handover: str | None = None) -> Opened:
        """Send the request to ``peer`` (with the name of a file of its cells: ``handover``); its started 200
        response, or PeerRefused (closed here), or what the connection raises. kvctl ending the request meanwhile
        withdraws it."""
        assert self.upstream.session is not None and ctx.entry is not None
        url = peer + ctx.request.raw_path
        headers = self._headers(ctx.headers)
        if handover is not None:
            headers[HANDOVER_HEADER] = handover
        cm = self.upstream.session.request(
            ctx.request.method, URL(url, encoded=True), data=upstream_body(body), headers=headers
        )
        opening: asyncio.Future[aiohttp.ClientResponse] = asyncio.ensure_future(cm.__aenter__())
        either: set[asyncio.Future[Any]] = {opening, ctx.entry.ended}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            opening.cancel()  # the client left: withdrawn, and a response that started meanwhile is closed
            opening.add_done_callback(close_response)
            raise
        if ctx.entry.ended.done():
            opening.cancel()
            opening.add_done_callback(close_response)
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, OSError):
                await opening
            raise PeerRefused("kvctl ended the request")
        response = opening.result()
        if response.status == 200:
            return cm, response
        try:
            data = await self.upstream.read_all(response)
        finally:
            await cm.__aexit__(None, None, None)
        raise PeerRefused(f"HTTP {response.status}: {(data or b'')[:200]!r}")
