"""The test suite's own checks (tests/conftest.py) catch what they are there for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LEAKY = """
import asyncio


async def test_leaks_a_task() -> None:
    asyncio.get_running_loop().create_task(asyncio.sleep(60), name="forgotten relay")


async def test_cancels_its_task() -> None:
    task = asyncio.get_running_loop().create_task(asyncio.sleep(60))
    await asyncio.sleep(0)
    task.cancel()


def test_sync() -> None:
    pass
"""


def test_a_test_that_leaves_a_task_running_fails_and_names_it(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    args = [
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "asyncio_mode=auto",
        "-o",
        "asyncio_default_fixture_loop_scope=function",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", *args, str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    # the check runs at the test's teardown: pytest reports its failure there, as an error of that test
    assert r.returncode == 1, r.stdout + r.stderr
    assert "3 passed, 1 error" in r.stdout and "forgotten relay" in r.stdout, r.stdout
    assert "ERROR test_leaky.py::test_leaks_a_task" in r.stdout.split("short test summary")[-1]
