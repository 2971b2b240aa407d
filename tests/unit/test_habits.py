"""Commit subjects of at most 72 characters, the detail in the body (docs/architecture.md, Habits): checked for
every commit since the habit began (f5fee5c), or for HEAD alone in a clone whose history stops short of it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SINCE = "f5fee5c"
MAX_SUBJECT = 72


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30, check=False)


def test_commit_subjects_are_short() -> None:
    if shutil.which("git") is None or git("rev-parse", "HEAD").returncode != 0:
        pytest.fail("the checks need git and a git checkout (CI runs on a clone)")
    since = git("rev-parse", "--verify", "--quiet", f"{SINCE}^{{commit}}").returncode == 0
    r = git("log", "--format=%h %s", f"{SINCE}..HEAD" if since else "-1")
    assert r.returncode == 0, r.stderr
    long = [line for line in r.stdout.splitlines() if len(line.split(" ", 1)[1]) > MAX_SUBJECT]
    assert not long, f"subjects over {MAX_SUBJECT} characters (put the detail in the body):\n" + "\n".join(long)
