"""scripts/build_llama.sh: the cache makes a second run cheap, and a bad patch is named."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "build_llama.sh"


def run_script(env: dict[str, str] | None = None, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=3600
    )


def test_cache_hit_returns_the_same_binary_without_building(llama_server_bin: Path) -> None:
    t0 = time.monotonic()
    res = run_script()
    elapsed = time.monotonic() - t0

    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip().splitlines()[-1]) == llama_server_bin
    assert "cache hit" in res.stderr
    assert "configuring" not in res.stderr and "building" not in res.stderr
    # a sanity bound, not a benchmark: a rebuild takes minutes
    assert elapsed < 60, f"cache hit took {elapsed:.1f} s"


def test_a_patch_that_does_not_apply_fails_with_its_name(tmp_path: Path, llama_server_bin: Path) -> None:
    patches = tmp_path / "patches"
    shutil.copytree(ROOT / "patches", patches)
    bogus = patches / "0099-bogus-change.patch"
    bogus.write_text(
        "--- a/include/llama.h\n+++ b/include/llama.h\n@@ -1,3 +1,3 @@\n"
        "-this line is not in llama.h\n+neither is this one\n context\n"
    )
    cache_before = sorted(p.name for p in llama_server_bin.parents[2].iterdir())

    res = run_script({"KVCTL_PATCHES_DIR": str(patches)})

    assert res.returncode != 0
    assert "0099-bogus-change.patch does not apply" in res.stderr
    assert not res.stdout.strip(), "no binary path may be printed on failure"
    # the failed build left no cache entry behind
    assert sorted(p.name for p in llama_server_bin.parents[2].iterdir()) == cache_before


def test_unknown_argument_is_refused() -> None:
    res = run_script(None, "--no-such-flag")
    assert res.returncode != 0
    assert "unknown argument: --no-such-flag" in res.stderr


@pytest.mark.parametrize("flag", ["--jobs", "--cuda-arch"])
def test_flag_without_value_is_refused(flag: str) -> None:
    res = run_script(None, flag)
    assert res.returncode != 0
    assert "needs a value" in res.stderr
