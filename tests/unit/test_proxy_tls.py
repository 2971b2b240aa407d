"""TLS on the public listener from a certificate and key file."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from controller.proxy.app import make_proxy_app
from controller.proxy.config import ProxyConfig
from controller.proxy.site import run_site, tls_context
from testkit.llama import free_port


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_the_proxy_serves_https(certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    port = free_port()
    app = make_proxy_app(ProxyConfig(upstream=f"http://127.0.0.1:{free_port()}"), None, CollectorRegistry())
    cleanup = await run_site(app, "127.0.0.1", port, tls_context(str(cert), str(key)))
    try:
        trust = ssl.create_default_context(cafile=str(cert))
        async with aiohttp.ClientSession() as http:
            # the server behind is down: kvctl's own 503 comes back over TLS
            async with http.get(f"https://127.0.0.1:{port}/v1/models", ssl=trust) as resp:
                assert resp.status == 503 and (await resp.json())["error"]["kvctl_code"] == "upstream_unavailable"
            with pytest.raises(aiohttp.ClientError):  # plain HTTP on the TLS port gets no answer
                async with http.get(f"http://127.0.0.1:{port}/v1/models") as resp:
                    await resp.read()
    finally:
        await cleanup()
