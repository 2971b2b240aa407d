"""A planned restart's checks before anything stops (controller.planned): which model a command line serves; the admin
routes' body checks for a restart and a reload of kvctl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from controller.errors import Code, KvctlError
from controller.planned import model_identity
from tests.harness import AdminCase, admin_app, admin_posts


def test_a_command_lines_model_is_its_file_name_size_alias_and_kv_types(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 10)
    base = ["llama-server", "-m", str(model), "-c", "4096"]
    a = model_identity(base)
    assert (a.model, a.size, a.alias, a.cache_type_k, a.cache_type_v) == ("m.gguf", 10, None, "f16", "f16")
    assert model_identity([*base, "--seed", "7", "-np", "8"]) == a, "other flags change nothing a request needs"
    b = model_identity(["llama-server", f"--model={model}", "-ctk", "q8_0", "-ctv", "q8_0", "-a", "chat"])
    assert a.differences(b) == [
        "alias: None -> 'chat'",
        "cache_type_k: 'f16' -> 'q8_0'",
        "cache_type_v: 'f16' -> 'q8_0'",
    ]
    model.write_bytes(b"x" * 11)  # a new quantization under the same name
    assert model_identity(base).differences(a) == ["size: 11 -> 10"]


@pytest.mark.parametrize("argv", [["llama-server", "-c", "8"], ["llama-server", "-m"], ["llama-server", "-m", "/nope"]])
def test_a_command_line_without_a_readable_model_is_refused(argv: Any) -> None:
    with pytest.raises(KvctlError) as e:
        model_identity(argv)
    assert e.value.status == 400 and e.value.code == "invalid_argv"


async def test_the_admin_route_checks_its_body_and_answers_what_the_restart_says() -> None:
    calls: list[tuple[Any, bool]] = []

    async def restart(argv: list[str] | None, force: bool) -> dict[str, Any]:
        calls.append((argv, force))
        if argv == ["other"]:
            raise KvctlError(409, Code.MODEL_CHANGED, "the new command line serves another model")
        return {"moved": 2, "failed": 0, "seconds": 1.5}

    cases: list[AdminCase] = [
        (b"", 200, None),
        (b'{"argv": ["llama-server", "-m", "x"], "force": true}', 200, None),
        (b'{"argv": ["other"]}', 409, "model_changed"),
        (b"[1]", 400, "invalid_argv"),
        (b'{"argv": []}', 400, "invalid_argv"),
        (b'{"argv": "llama-server -m x"}', 400, "invalid_argv"),
        (b'{"force": "yes"}', 400, "invalid_argv"),
        (b'{"args": []}', 400, "invalid_argv"),
        (b"{not json", 400, "invalid_argv"),
    ]
    answers = await admin_posts(admin_app(restart_server=restart), "/server/restart", cases)
    assert answers == [{"moved": 2, "failed": 0, "seconds": 1.5}] * 2
    await admin_posts(admin_app(), "/server/restart", [(b"", 409, "not_spawned")])
    assert calls == [(None, False), (["llama-server", "-m", "x"], True), (["other"], False)]


async def test_the_reload_route_checks_its_body_and_passes_the_environment_on() -> None:
    class Keeper:
        reloads_failed = 0
        reload_error: str | None = None
        listen_unchanged: str | None = None

        def __init__(self) -> None:
            self.asked: list[dict[str, str] | None] = []

        def reload(self, environment: dict[str, str] | None = None) -> None:
            self.asked.append(environment)

    keeper = Keeper()
    cases: list[AdminCase] = [
        (b"", 202, None),
        (b'{"environment": {"KVCTL_POLICY__HIGH": "0.9"}}', 202, None),
        (b'{"environment": {"POLICY__HIGH": "0.9"}}', 400, "invalid_environment"),
        (b'{"environment": {"KVCTL_POLICY__HIGH": 0.9}}', 400, "invalid_environment"),
        (b'{"environment": ["KVCTL_POLICY__HIGH"]}', 400, "invalid_environment"),
        (b'{"env": {}}', 400, "invalid_environment"),
        (b"[1]", 400, "invalid_environment"),
        (b"{not json", 400, "invalid_environment"),
    ]
    answers = await admin_posts(admin_app(keeper=keeper), "/reload", cases)
    assert [a["reloading"] for a in answers] == [True, True]
    await admin_posts(admin_app(), "/reload", [(b"", 409, "no_keeper")])
    assert keeper.asked == [None, {"KVCTL_POLICY__HIGH": "0.9"}]


async def test_kvctl_restart_server_sends_the_new_command_line_and_says_what_moved(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from controller.cli.main import main
    from controller.errors import admin_error_response

    seen: list[Any] = []

    async def restart(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if body.get("argv") == ["other"]:
            return admin_error_response(409, "the new command line serves another model", "model_changed")
        return web.json_response({"moved": 3, "failed": 1 if body["force"] else 0, "seconds": 2.5})

    app = web.Application()
    app.router.add_post("/server/restart", restart)
    server = TestServer(app)
    await server.start_server()
    try:
        admin = f"127.0.0.1:{server.port}"

        def run(*args: str) -> int:
            return main(["restart-server", "--admin", admin, *args])

        assert await asyncio.to_thread(run, "--text", "--", "llama-server", "-m", "x.gguf") == 0
        assert "3 requests moved, 0 not" in capsys.readouterr().out
        assert await asyncio.to_thread(run, "--json", "--force") == 1, "a request not moved: degraded"
        assert json.loads(capsys.readouterr().out)["failed"] == 1
        assert await asyncio.to_thread(run, "--", "other") == 1
        assert "refused: the new command line serves another model (409)" in capsys.readouterr().err
        assert await asyncio.to_thread(run, "--") == 2, "'--' with nothing after it"
        assert seen == [
            {"force": False, "argv": ["llama-server", "-m", "x.gguf"]},
            {"force": True},
            {"force": False, "argv": ["other"]},
        ]
    finally:
        await server.close()
