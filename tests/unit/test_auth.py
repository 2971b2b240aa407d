"""kvctl's key check mirrors llama-server's middleware; the server check caches and coalesces."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from multidict import CIMultiDict

from controller.keys import ApiKey, KeyFileError, KeyRing, credential, parse_key_entry, read_key_file
from controller.proxy.auth import UNAUTHORIZED_BODY, Answer, ServerCheck
from controller.settings import SettingsError, load_settings


def h(**kw: str) -> CIMultiDict[str]:
    return CIMultiDict({k.replace("_", "-"): v for k, v in kw.items()})


def test_credential_follows_the_servers_rules() -> None:
    assert credential(h(Authorization="Bearer k")) == "k"
    assert credential(h(Authorization="k")) == "k", "the Bearer prefix is optional"
    assert credential(h(x_api_key="k")) == "k"
    assert credential(h(x_api_key="Bearer k")) == "k"
    assert credential(h(Authorization="wrong", x_api_key="k")) == "wrong", "Authorization wins even when wrong"
    assert credential(h(Authorization="", x_api_key="k")) == "k", "an empty Authorization is absent"
    assert credential(h(Authorization="bearer k")) == "bearer k", "the prefix is case-sensitive"
    assert credential(h()) == ""


def test_keyring_matches_names_and_never_shows_keys() -> None:
    ring = KeyRing([ApiKey("alpha-secret", "a"), ApiKey("beta-secret", "b", priority=2, max_priority=5)])
    ident = ring.check(h(Authorization="Bearer beta-secret"))
    assert ident is not None and ident.name == "b" and ident.key is not None and ident.key.max_priority == 5
    assert ring.check(h(Authorization="Bearer alpha-secre")) is None
    assert ring.check(h(Authorization="x", x_api_key="alpha-secret")) is None
    assert ring.check(h()) is None
    assert ring.check(h(Authorization="Bearer caf\udce9")) is None  # not UTF-8: fails, does not raise
    assert "secret" not in repr(ring.keys) and "secret" not in repr(ident)
    with pytest.raises(KeyFileError, match="unique"):
        KeyRing([ApiKey("1", "x"), ApiKey("2", "x")])


def test_key_entries_and_files(tmp_path: Path) -> None:
    assert parse_key_entry("k", "api_keys[0]") == ApiKey("k", "api_keys[0]")
    assert parse_key_entry({"key": "k", "name": "n", "priority": 1}, "w") == ApiKey("k", "n", 1, None)
    for bad, msg in (
        ({"name": "n"}, "'key'"),
        ({"key": "k", "prio": 1}, "unknown"),
        ({"key": "k", "priority": "1"}, "integer"),
        ({"key": "k", "priority": True}, "integer"),
        ({"key": "k", "max_priority": 2**31}, r"integer in \[-2147483648, 2147483647\]"),
        ({"key": "k", "priority": 3, "max_priority": 2}, r"'priority' \(3\) is above 'max_priority' \(2\)"),
        (3, "expected"),
    ):
        with pytest.raises(KeyFileError, match=msg):
            parse_key_entry(bad, "w")
    f = tmp_path / "keys"
    f.write_text('# comment\n\nsk-one alice\nsk-two\n{"key": "sk-three", "name": "carol", "max_priority": 3}\n')
    assert read_key_file(f) == [
        ApiKey("sk-one", "alice"),
        ApiKey("sk-two", "keys:4"),
        ApiKey("sk-three", "carol", None, 3),
    ]
    f.write_text("{not json\n")
    with pytest.raises(KeyFileError, match="keys:1: not valid JSON"):
        read_key_file(f)


def test_settings_take_keys_from_the_list_and_the_file(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("sk-file filed\n")
    s = load_settings(
        overrides={"proxy": {"api_keys": ["sk-a", {"key": "sk-b", "name": "bob"}], "api_keys_file": str(f)}}
    )
    assert [k.name for k in s.proxy.api_key_list()] == ["api_keys[0]", "bob", "filed"]
    f.write_text("sk-x bob\n")
    with pytest.raises(SettingsError, match=r"proxy\.api_keys.*repeated: bob") as e:
        load_settings(overrides={"proxy": {"api_keys": [{"key": "sk-b", "name": "bob"}], "api_keys_file": str(f)}})
    assert "sk-" not in str(e.value)
    with pytest.raises(SettingsError, match=r"supervisor\.spawn.*sse-ping-interval"):
        load_settings(overrides={"supervisor": {"spawn": ["llama-server", "--sse-ping-interval", "30"]}})
    load_settings(overrides={"supervisor": {"spawn": ["llama-server", "--sse-ping-interval=20"]}})


async def test_server_check_caches_per_credential_and_coalesces() -> None:
    calls: list[dict[str, str]] = []

    async def probe(creds: dict[str, str]) -> Answer:
        calls.append(creds)
        await asyncio.sleep(0.05)
        ok = creds.get("Authorization") == "Bearer good"
        return Answer(200) if ok else Answer(401, [("Content-Type", "application/json")], UNAUTHORIZED_BODY)

    check = ServerCheck(probe, ttl_s=60, ttl_refused_s=60)
    answers = await asyncio.gather(*[check.check(h(Authorization="Bearer good")) for _ in range(10)])
    assert all(a.status == 200 for a in answers) and len(calls) == 1, "one probe for ten concurrent checks"
    assert (await check.check(h(Authorization="Bearer good"))).status == 200 and len(calls) == 1
    bad = await check.check(h(Authorization="Bearer bad", Cookie="c"))
    assert bad.status == 401 and json.loads(bad.body)["error"]["type"] == "authentication_error"
    assert calls[-1] == {"Authorization": "Bearer bad"}, "only the credentials go to the server"
    assert (await check.check(h(x_api_key="good"))).status == 401 and len(calls) == 3


async def test_server_check_keeps_no_answer_that_is_not_about_the_credential() -> None:
    n = 0

    async def probe(creds: dict[str, str]) -> Answer:
        nonlocal n
        n += 1
        if n == 1:
            return Answer(503, [], b'{"error": {"message": "Loading model"}}')
        if n == 2:
            raise OSError("refused")
        return Answer(200)

    check = ServerCheck(probe)
    assert (await check.check(h(Authorization="k"))).status == 503
    with pytest.raises(OSError):
        await check.check(h(Authorization="k"))
    assert (await check.check(h(Authorization="k"))).status == 200


async def test_a_cancelled_first_check_does_not_fail_the_others() -> None:
    release = asyncio.Event()

    async def probe(creds: dict[str, str]) -> Answer:
        await release.wait()
        return Answer(200)

    check = ServerCheck(probe)
    first = asyncio.create_task(check.check(h(Authorization="k")))
    second = asyncio.create_task(check.check(h(Authorization="k")))
    await asyncio.sleep(0.01)
    first.cancel()  # its client hung up
    await asyncio.sleep(0.01)
    release.set()
    assert (await second).status == 200
    assert first.cancelled()


def test_a_malformed_key_entry_is_named_never_shown() -> None:
    for entries in ([["sk-secret-1", "team"]], [{"key": "sk-secret-1", "nmae": "x"}], [12345678]):
        with pytest.raises(SettingsError) as e:
            load_settings(overrides={"proxy": {"api_keys": entries}})
        assert "proxy.api_keys" in str(e.value)
        assert "sk-secret" not in str(e.value) and "12345678" not in str(e.value)
