"""The import layering of pyproject's [tool.importlinter] holds: the runtime imports no development code, and so on.

``lint-imports`` (package import-linter, in the test extra) reads the contracts from pyproject.toml in the repository
root and follows every import, those inside functions too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def lint_imports() -> str:
    """The lint-imports beside this interpreter (or on PATH); a skip without it, a failure under CI."""
    found = Path(sys.executable).with_name("lint-imports")
    path = str(found) if found.is_file() else shutil.which("lint-imports")
    if path is None:
        reason = "lint-imports is not installed (pip install import-linter, or the test extra)"
        if os.environ.get("CI"):
            pytest.fail(f"{reason}; under CI a missing checker is a failure, not a skip")
        pytest.skip(reason)
    return path


def run(cwd: Path) -> subprocess.CompletedProcess[str]:
    # the root packages are imported from the checkout; no cache directory is left behind
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [lint_imports(), "--no-cache"]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False)


def test_every_import_contract_is_kept() -> None:
    r = run(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert " broken" in r.stdout and "0 broken" in r.stdout, r.stdout


def test_a_broken_contract_fails_the_check(tmp_path: Path) -> None:
    """The check is not vacuous: a contract the code breaks (the proxy uses aiohttp) fails it, naming the import."""
    (tmp_path / "pyproject.toml").write_text(
        """
[tool.importlinter]
root_packages = ["controller"]
include_external_packages = true

[[tool.importlinter.contracts]]
name = "a contract the code breaks"
type = "forbidden"
source_modules = ["controller.proxy.app"]
forbidden_modules = ["aiohttp"]
"""
    )
    r = run(tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "BROKEN" in r.stdout and "controller.proxy.app -> aiohttp" in r.stdout, r.stdout
