"""Settings: sources and their precedence, and every invalid setting named in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.settings import RestoreOrder, Settings, SettingsError, load_settings, main, markdown_table
from controller.upstream.supervisor import spawn_argv


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("KVCTL_"):
            monkeypatch.delenv(key)


def test_defaults_are_the_issue_s() -> None:
    s = load_settings()
    assert (s.policy.high, s.policy.low, s.policy.snapshot_budget_mib) == (0.94, 0.80, 8192)
    assert str(s.upstream.url) == "http://127.0.0.1:8081/"
    assert (s.proxy.listen, s.admin.listen) == ("127.0.0.1:8080", "127.0.0.1:8091")
    assert s.loop.poll_interval_s == 0.05
    assert s.policy.restore_order is RestoreOrder.AGING
    assert s.upstream.api_key is None


def test_precedence_flags_then_environment_then_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "kvctl.toml"
    cfg.write_text(
        '[policy]\nhigh = 0.9\nlow = 0.7\nrestore_order = "seed"\n[upstream]\nurl = "http://10.0.0.1:9000"\n'
    )
    s = load_settings(cfg)
    assert (s.policy.high, s.policy.low, s.policy.restore_order) == (0.9, 0.7, RestoreOrder.SEED)
    monkeypatch.setenv("KVCTL_POLICY__LOW", "0.6")
    monkeypatch.setenv("KVCTL_UPSTREAM__URL", "http://10.0.0.2:9000")
    s = load_settings(cfg)
    assert (s.policy.high, s.policy.low) == (0.9, 0.6)
    assert str(s.upstream.url).startswith("http://10.0.0.2:9000")
    s = load_settings(cfg, {"upstream": {"url": "http://10.0.0.3:9000"}})
    assert str(s.upstream.url).startswith("http://10.0.0.3:9000")
    assert s.policy.low == 0.6


def test_the_supervisor_s_give_up_settings_from_each_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = load_settings()
    assert (s.supervisor.failed_after, s.supervisor.exit_on_failed) == (5, False)
    cfg = tmp_path / "kvctl.toml"
    cfg.write_text("[supervisor]\nfailed_after = 3\nexit_on_failed = true\n")
    s = load_settings(cfg)
    assert (s.supervisor.failed_after, s.supervisor.exit_on_failed) == (3, True)
    monkeypatch.setenv("KVCTL_SUPERVISOR__FAILED_AFTER", "0")
    monkeypatch.setenv("KVCTL_SUPERVISOR__EXIT_ON_FAILED", "false")
    s = load_settings(cfg)
    assert (s.supervisor.failed_after, s.supervisor.exit_on_failed) == (0, False), "0: never give up"


def test_the_api_key_is_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCTL_UPSTREAM__API_KEY", "s3cret-key")
    s = load_settings()
    assert s.upstream.api_key is not None and s.upstream.api_key.get_secret_value() == "s3cret-key"
    assert "s3cret-key" not in repr(s) and "s3cret-key" not in s.model_dump_json()


INVALID = [
    ({"policy": {"low": 0.95}}, "policy.low", "must be below policy.high"),
    ({"policy": {"low": 0.94}}, "policy.low", "must be below policy.high"),
    ({"policy": {"high": 1.0}}, "policy.high", "less than 1"),
    ({"policy": {"high": 0}}, "policy.high", "greater than 0"),
    ({"policy": {"low": -0.1}}, "policy.low", "greater than 0"),
    ({"policy": {"snapshot_budget_mib": -1}}, "policy.snapshot_budget_mib", "greater than or equal to 0"),
    ({"policy": {"host_ram_reserve_mib": -5}}, "policy.host_ram_reserve_mib", "greater than or equal to 0"),
    ({"policy": {"gpu_headroom_mib": -5}}, "policy.gpu_headroom_mib", "greater than or equal to 0"),
    ({"policy": {"restore_margin_cells": -1}}, "policy.restore_margin_cells", "greater than or equal to 0"),
    ({"policy": {"max_wait_s": 0}}, "policy.max_wait_s", "greater than 0"),
    ({"policy": {"restore_order": "lifo"}}, "policy.restore_order", "'aging', 'fifo' or 'seed'"),
    ({"upstream": {"url": "ftp://host:1"}}, "upstream.url", "scheme"),
    ({"upstream": {"url": "not a url"}}, "upstream.url", "URL"),
    ({"upstream": {"timeout_s": 0}}, "upstream.timeout_s", "greater than 0"),
    ({"upstream": {"timeout_s": 6}}, "upstream.timeout_s", "under half the lease"),
    ({"proxy": {"listen": "8080"}}, "proxy.listen", "HOST:PORT"),
    ({"admin": {"listen": "127.0.0.1:99999"}}, "admin.listen", "port"),
    ({"admin": {"listen": "0.0.0.0:8091"}}, "admin.token", "required"),
    ({"loop": {"poll_interval_s": 0}}, "loop.poll_interval_s", "greater than 0"),
    ({"loop": {"backoff_max_s": 5}}, "loop.backoff_max_s", "under half the lease"),
    ({"loop": {"backoff_initial_s": 4.5, "backoff_max_s": 4}}, "loop.backoff_initial_s", "must not exceed"),
    ({"upstream": {"lease_s": 2}}, "loop.backoff_max_s", "under half the lease"),
    ({"supervisor": {"spawn": []}}, "supervisor.spawn", "empty"),
    ({"supervisor": {"stop_timeout_s": -1}}, "supervisor.stop_timeout_s", "greater than 0"),
    ({"supervisor": {"failed_after": -1}}, "supervisor.failed_after", "greater than or equal to 0"),
    ({"supervisor": {"failed_after": "often"}}, "supervisor.failed_after", "valid integer"),
    (
        {"supervisor": {"exit_on_failed": True, "failed_after": 0}},
        "supervisor.exit_on_failed",
        "needs supervisor.failed_after of 1 or more",
    ),
    ({"log": {"level": "loud"}}, "log.level", "'debug'"),
    ({"supervisor": {"exact": True}}, "supervisor.exact", "needs supervisor.spawn"),
    (
        {"supervisor": {"exact": True, "spawn": ["llama-server", "-m", "m.gguf", "-no-kvu"]}},
        "supervisor.exact",
        "remove -no-kvu",
    ),
]


@pytest.mark.parametrize(("overrides", "name", "words"), INVALID, ids=[c[1] + ":" + c[2] for c in INVALID])
def test_every_invalid_setting_fails_with_its_name(
    overrides: dict[str, dict[str, object]], name: str, words: str
) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(overrides=overrides)
    msg = str(info.value)
    assert "\n" not in msg
    assert f"invalid setting {name} " in msg and words in msg
    assert "KVCTL_" + name.replace(".", "__").upper() in msg


def test_an_invalid_environment_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCTL_POLICY__HIGH", "1.5")
    with pytest.raises(SettingsError, match=r"invalid setting policy\.high \(KVCTL_POLICY__HIGH\).*got '1\.5'"):
        load_settings()


def test_a_secret_value_is_not_echoed_in_an_error() -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(overrides={"admin": {"token": 987654321}})
    assert "invalid setting admin.token" in str(info.value)
    assert "987654321" not in str(info.value)


def test_unknown_keys_in_the_file_are_named(tmp_path: Path) -> None:
    cfg = tmp_path / "kvctl.toml"
    cfg.write_text("[policy]\nhihg = 0.9\n")
    with pytest.raises(SettingsError, match=r"unknown setting policy\.hihg"):
        load_settings(cfg)


def test_a_missing_or_broken_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="cannot read config file"):
        load_settings(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[policy\n")
    with pytest.raises(SettingsError, match=f"invalid config file {bad}"):
        load_settings(bad)


def test_a_non_loopback_admin_listener_with_a_token_is_fine() -> None:
    s = load_settings(overrides={"admin": {"listen": "0.0.0.0:8091", "token": "t"}})
    assert s.admin.listen == "0.0.0.0:8091"
    s = load_settings(overrides={"admin": {"listen": "[::1]:8091"}})
    assert s.admin.listen == "[::1]:8091"


def test_the_markdown_table_lists_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    table = markdown_table()
    for group, field in Settings.model_fields.items():
        assert field.annotation is not None
        for name, sub in field.annotation.model_fields.items():
            assert f"| `{group}.{name}` | `KVCTL_{group.upper()}__{name.upper()}` |" in table
            assert sub.description, f"{group}.{name} has no docstring"
    assert main(["--markdown"]) == 0
    assert capsys.readouterr().out.strip() == table


def test_the_check_command_exits_2_on_an_invalid_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVCTL_POLICY__LOW", "0.99")
    assert main([]) == 2
    assert capsys.readouterr().err.startswith("kvctl: invalid setting policy.low")


def test_the_exact_setting_adds_the_server_flag_once() -> None:
    argv = ["llama-server", "-m", "m.gguf", "-kvu"]
    s = load_settings(overrides={"supervisor": {"spawn": argv, "exact": True}})
    out = spawn_argv(s)
    assert out.count("--exact") == 1 and out[:4] == argv, out
    assert spawn_argv(s, [*argv, "--exact"]).count("--exact") == 1, "a command line that has it keeps one"
    plain = load_settings(overrides={"supervisor": {"spawn": argv}})
    assert "--exact" not in spawn_argv(plain), "off by default"
