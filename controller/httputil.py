"""HTTP details shared by kvctl's two listeners (the admin API and the proxy)."""

from __future__ import annotations

from aiohttp import HttpVersion11, web


async def unsupported_expect(request: web.Request) -> str | None:
    """Handle ``Expect: 100-continue`` as aiohttp does; return any other ``Expect`` value, which the
    caller answers with a 417 in its own error envelope (aiohttp's own answer is plain text, and a
    500 when the value is not UTF-8). Used as an aiohttp ``expect_handler``, so it runs on every route."""
    value = request.headers.get("Expect", "")
    if request.version != HttpVersion11:
        return None
    if value.lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0
        return None
    return value
