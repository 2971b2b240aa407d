"""The public listener without the keeper: aiohttp's own TCP site, plain or with TLS."""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable

from aiohttp import web

__all__ = ["run_site", "tls_context"]


def tls_context(cert_file: str | None, key_file: str | None) -> ssl.SSLContext | None:
    """The public listener's TLS from a certificate chain and its key (PEM), or None for plain HTTP."""
    if not cert_file:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file or None)
    return ctx


async def run_site(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> Callable[[], Awaitable[None]]:
    """Serve app; a client that hangs up cancels its handler, so the upstream request ends at once."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    return runner.cleanup
