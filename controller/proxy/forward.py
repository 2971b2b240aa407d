"""Forward: everything that talks to the server on a client's behalf.

The headers a request carries upstream (kvctl's keys never reach the server), sending it and waiting for its
response to start (or for kvctl to end it), the response headers the client gets back, reads with their
timeouts, and the small requests kvctl makes of its own: ``/health`` while a replay waits, a CORS preflight, a
credential probe. One connection per request (see :meth:`Upstream.start`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import structlog
from multidict import CIMultiDict
from yarl import URL

from controller.keys import KeyRing
from controller.proxy.auth import Answer
from controller.proxy.config import ProxyConfig
from controller.proxy.context import RequestContext, Stop
from controller.proxy.priority import PRIORITY_HEADER
from controller.proxy.transcript import OPT_OUT_HEADER

__all__ = [
    "ANSWER_HEADER",
    "CREDENTIALS",
    "HOP_BY_HOP",
    "Moving",
    "Opened",
    "Upstream",
    "UpstreamEnded",
    "close_response",
    "upstream_body",
]

log = structlog.get_logger("kvctl.proxy")

ANSWER_HEADER = "X-Conversation-Answer"  # the server's mark on a non-streamed answer a session kept (0047)
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Transfer-Encoding",
        "TE",
        "Trailer",
        "Upgrade",
        "Proxy-Authorization",
        "Proxy-Authenticate",
        "Proxy-Connection",
        "Host",
    )
)
CREDENTIALS = ("authorization", "x-api-key")

# a started response: its context (the caller's to leave) and the response
Opened = tuple[Any, aiohttp.ClientResponse]

# aiohttp warns (ResourceWarning) on a bytes body over 1 MiB: it is written in one piece from the event loop
_LARGE_BODY = 1 << 20


class UpstreamEnded(Exception):
    """kvctl ended the request before the server's response started."""

    def __init__(self, reason: Stop) -> None:
        super().__init__(reason)
        self.reason = reason


class Moving(Exception):
    """A drain moves the request to a peer before the server's response started: it was withdrawn here."""


class Upstream:
    def __init__(self, config: ProxyConfig, keys: KeyRing, api_prefix: str) -> None:
        self.config = config
        self.keys = keys
        self.api_prefix = api_prefix
        parts = urlsplit(config.upstream)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        # one connection per request: llama-server closes idle keep-alive connections, and a pooled one
        # that it closed fails on write ("Can not write request body"); on loopback a connect costs ~0.1 ms
        self.session = aiohttp.ClientSession(
            timeout=timeout, auto_decompress=False, connector=aiohttp.TCPConnector(limit=0, force_close=True)
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def headers(self, ctx: RequestContext, *, generation: bool) -> dict[str, str]:
        """The client's headers for the server: kvctl's keys are kvctl's, they never reach the server; the server's
        key goes only on what kvctl verified."""
        own_keys = bool(self.keys)
        # X-Priority: kvctl sets the effective one on a generation request (the caller, once it is known), and the
        # server reads it over the body's; on anything else a client's has no business reaching the server
        ident = ctx.ident
        peer = ident is not None and ident.peer  # another kvctl's drain: the peer key stands for the credentials
        drop = (
            HOP_BY_HOP
            | {"x-request-id", "x-park-lease", "content-length", PRIORITY_HEADER.lower(), OPT_OUT_HEADER.lower()}
            | {"x-kvctl-peer", "x-kvctl-handover"}
            | (set(CREDENTIALS) if own_keys or peer else set())
        )
        headers = {k: v for k, v in ctx.request.headers.items() if k.lower() not in drop}
        if ctx.request_id is not None:
            headers["X-Request-Id"] = ctx.request_id
        if generation:
            headers["Accept-Encoding"] = "identity"  # the relay reads the SSE events
        if (peer or (own_keys and ident is not None and ident.key is not None)) and self.config.upstream_api_key:
            headers["Authorization"] = f"Bearer {self.config.upstream_api_key}"
        return headers

    @staticmethod
    def response_headers(
        upstream: aiohttp.ClientResponse, client_request_id: str | None, request_id: str | None, *, keep_length: bool
    ) -> CIMultiDict[str]:
        drop = HOP_BY_HOP if keep_length else HOP_BY_HOP | {"content-length"}
        headers = CIMultiDict((k, v) for k, v in upstream.headers.items() if k.lower() not in drop)
        if request_id is not None:
            headers["X-Request-Id"] = client_request_id or request_id
        return headers

    def url(self, ctx: RequestContext) -> str:
        """The server's URL for the request: its path and query as the client sent them (a decoded %23 or %26 would
        change what the server reads), or with ``ctx.query`` in place of the query."""
        raw = ctx.request.raw_path
        if ctx.query is None:
            return self.origin + raw
        return self.origin + raw.split("?", 1)[0] + ("?" + ctx.query if ctx.query else "")

    async def send(self, ctx: RequestContext, body: bytes) -> Opened:
        """Send the request; wait for the response to start, or for kvctl to end the request (a hung server)."""
        assert self.session is not None and ctx.entry is not None
        entry = ctx.entry
        headers = ctx.headers if ctx.conv is None else {**ctx.headers, "X-Conversation-Id": ctx.conv}
        cm = self.session.request(
            ctx.request.method, URL(self.url(ctx), encoded=True), data=upstream_body(body), headers=headers
        )
        opening: asyncio.Future[aiohttp.ClientResponse] = asyncio.ensure_future(cm.__aenter__())
        moving = asyncio.ensure_future(entry.move.wait())
        either: set[asyncio.Future[Any]] = {opening, entry.ended, moving}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # the client left: the request is withdrawn, and a response that started meanwhile is closed
            opening.cancel()
            opening.add_done_callback(close_response)
            raise
        finally:
            moving.cancel()
        if opening.done() and not entry.ended.done() and not entry.move.is_set():
            return cm, opening.result()
        # kvctl ended it, or a drain moves it: nothing of this response reached the client
        opening.cancel()
        opening.add_done_callback(close_response)
        with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, OSError):
            await opening
        if not entry.ended.done():
            raise Moving()  # withdrawn here (the server drops a request whose connection closed)
        raise UpstreamEnded(entry.ended.result())

    def own_url(self, path: str) -> str:
        """The server's URL for a call kvctl makes of its own (a model list, a slot action)."""
        return self.origin + self.api_prefix + path

    def own_headers(self) -> dict[str, str]:
        """The server's own key on a call kvctl makes of its own, where the server has one."""
        key = self.config.upstream_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def send_detached(self, method: str, url: str, body: bytes, headers: dict[str, str]) -> None:
        """Send a conversation request whose client has left: the response starting means the server took it; its
        stream buffer has the rest."""
        assert self.session is not None
        try:
            async with self.session.request(
                method, URL(url, encoded=True), data=upstream_body(body), headers=headers
            ) as r:
                log.info(
                    "conversation.sent_for_departed_client", status=r.status, request_id=headers.get("X-Request-Id")
                )
        except (aiohttp.ClientError, OSError) as e:
            log.warning("conversation.send_failed", error=str(e), request_id=headers.get("X-Request-Id"))

    async def read_all(self, upstream: aiohttp.ClientResponse) -> bytes | None:
        """A small answer kvctl reads whole (an error body, a stream lookup); None when it does not come."""
        try:
            async with asyncio.timeout(self.config.upstream_read_timeout_s):
                return await upstream.read()
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def read(self, upstream: aiohttp.ClientResponse) -> bytes | None:
        """The next chunk; None when heartbeat_s passed without one (the caller decides about the silence)."""
        try:
            async with asyncio.timeout(self.config.heartbeat_s):
                return await upstream.content.readany()
        except TimeoutError:
            return None

    async def healthy(self) -> bool:
        """Whether the server answers ``/health`` with 200 (up and loaded)."""
        assert self.session is not None
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            health = URL(self.origin + "/health", encoded=True)
            async with asyncio.timeout(2.0), self.session.get(health) as r:
                if r.status == 200:
                    return True
        return False

    async def preflight(self, origin: str) -> str | None:
        """The server's Access-Control-Allow-Origin for ``origin`` (a CORS preflight, answered before any check);
        raises what the connection raises."""
        assert self.session is not None
        async with asyncio.timeout(self.config.connect_timeout_s):
            h = {"Origin": origin} if origin else {}
            async with self.session.options(self.origin + "/health", headers=h) as r:
                return r.headers.get("Access-Control-Allow-Origin")

    async def probe_credentials(self, creds: dict[str, str]) -> Answer:
        """The server's answer to GET /v1/models with the client's own credentials."""
        assert self.session is not None
        url = self.own_url("/v1/models")
        async with asyncio.timeout(self.config.connect_timeout_s + self.config.upstream_read_timeout_s):
            async with self.session.get(url, headers=creds) as r:
                if r.status == 200:
                    return Answer(200)
                body = await r.read()
                keep = [(k, v) for k, v in r.headers.items() if k.lower() not in HOP_BY_HOP | {"content-length"}]
                return Answer(r.status, keep, body)


def upstream_body(body: bytes) -> bytes | io.BytesIO | None:
    """A request body for aiohttp: large prompts (up to proxy.max_body_bytes) as a file object, which aiohttp
    writes in chunks with its length known, instead of one write that holds the event loop."""
    if not body:
        return None
    return io.BytesIO(body) if len(body) > _LARGE_BODY else body


def close_response(fut: asyncio.Future[aiohttp.ClientResponse]) -> None:
    if not fut.cancelled() and fut.exception() is None:
        fut.result().close()
