"""scripts/quickstart.sh --demo: the first five minutes of an operator, end to end."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from testkit.llama import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_demo_completes_every_chat(llama_server_bin: Path) -> None:
    env = {
        **os.environ,
        "PORT": str(free_port()),
        "ADMIN_PORT": str(free_port()),
        "SERVER_PORT": str(free_port()),
        "CHATS": "4",
        "TOKENS": "3000",
    }
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "quickstart.sh"), "--demo"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "4/4 chats completed" in res.stdout
    parks = res.stdout.split("parks: ", 1)[1]
    assert not parks.startswith("0 by kvctl, 0 by"), "the burst must overflow the pool, or the demo shows nothing"
    # it shut down cleanly: no server or kvctl left behind on its ports
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert f"--port {env['SERVER_PORT']}" not in ps and f"127.0.0.1:{env['ADMIN_PORT']}" not in ps


def test_quickstart_refuses_unknown_arguments() -> None:
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "quickstart.sh"), "--bogus"], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 2 and "unknown argument" in res.stderr
