"""The README's controller tables are the ones the code generates."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.docs import main, metrics_table, routes_table, settings_table

README = Path(__file__).resolve().parents[2] / "README.md"
PROXY_DOC = README.parent / "docs" / "proxy.md"


def test_the_readme_holds_the_current_settings_and_metrics_tables() -> None:
    text = README.read_text()
    assert "## The controller (kvctl)" in text
    assert settings_table() in text, "regenerate with: python -m controller.docs settings"
    assert metrics_table() in text, "regenerate with: python -m controller.docs metrics"


def test_every_metric_is_in_the_table() -> None:
    table = metrics_table()
    for name in (
        "kvctl_upstream_up",
        "kvctl_parks_total",
        "kvctl_park_duration_seconds",
        "kvctl_build_info",
        "kvctl_policy_decision_seconds",
        "kvctl_gpu_memory_used_bytes",
        "kvctl_host_available_bytes",
    ):
        assert f"| `{name}` |" in table


def test_the_command_prints_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert settings_table() in out and metrics_table() in out


def test_the_proxy_doc_holds_the_current_route_table() -> None:
    assert routes_table() in PROXY_DOC.read_text(), "regenerate with: python -m controller.docs routes"
    assert "docs/proxy.md" in README.read_text()
