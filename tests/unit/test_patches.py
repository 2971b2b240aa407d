"""The patch series' shape, checked without building (scripts/check_series.sh builds every prefix)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = sorted((ROOT / "patches").glob("*.patch"))
MAX_LINES = 350


def changed_lines(text: str) -> dict[str, int]:
    """Changed lines per file of a git patch."""
    counts: dict[str, int] = {}
    current = None
    for line in text.split("\n"):
        if line.startswith("diff --git "):
            current = line.split(" b/", 1)[1]
            counts[current] = 0
        elif current and line.startswith(("+", "-")) and not line.startswith(("+++ ", "--- ")):
            counts[current] += 1
    return counts


def message_body(text: str) -> list[str]:
    head = text.split("\n---\n", 1)[0]
    body = head.split("\n\n", 1)[1] if "\n\n" in head else ""
    return [line for line in body.split("\n") if line.strip()]


def test_the_series_is_numbered_in_order() -> None:
    assert len(PATCHES) >= 10
    assert [p.name[:5] for p in PATCHES] == [f"{i:04d}-" for i in range(1, len(PATCHES) + 1)]


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name[:4])
def test_each_patch_is_small_and_says_why(patch: Path) -> None:
    text = patch.read_text()
    counts = changed_lines(text)
    assert counts, "no diff"
    outside_tests = sum(n for path, n in counts.items() if not path.startswith("tools/server/tests/"))
    assert outside_tests <= MAX_LINES, f"{outside_tests} changed lines outside tools/server/tests/"
    assert len(message_body(text)) >= 2, "the message must say why"


def test_the_result_wait_fix_comes_first_and_alone() -> None:
    files = set(changed_lines(PATCHES[0].read_text()))
    assert files and all(f.startswith(("tools/server/server-queue.", "tools/server/tests/")) for f in files), files


def enum_values(patch: Path, sign: str) -> set[str]:
    return set(re.findall(rf"^\{sign}\s*(SLOT_STATE_\w+),", patch.read_text(), re.MULTILINE))


def test_parked_is_not_a_slot_state() -> None:
    for patch in PATCHES:
        added = enum_values(patch, "+") - enum_values(patch, "-")
        assert not added, f"{patch.name} adds a slot state: {added}"


def test_gauges_have_no_total_suffix() -> None:
    for patch in PATCHES:
        server_lines = patch.read_text().split("\ndiff --git a/tools/server/tests/")[0]
        assert "kv_cells_total" not in server_lines, patch.name


def test_the_docs_table_matches_the_series() -> None:
    doc = (ROOT / "docs" / "patches.md").read_text()
    listed = re.findall(r"^\| \d+ \| `(\d{4}-[^`]+\.patch)` \|", doc, re.MULTILINE)
    assert listed == [p.name for p in PATCHES]
    assert "docs/patches.md" in (ROOT / "README.md").read_text()
