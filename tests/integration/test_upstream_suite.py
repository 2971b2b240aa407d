"""llama.cpp's own server tests, from the patched tree, offline on a generated model.

The series' tests (tools/server/tests/unit/, added patch by patch) must pass; upstream's files that
exercise what the series touches must pass wherever they passed on the unpatched build
(tests/upstream/baseline.json). See docs/patches.md.
"""

from __future__ import annotations

from pathlib import Path

from tests.upstream import runner


def test_the_series_own_tests_pass(llama_server_bin: Path) -> None:
    paths = runner.locate(str(llama_server_bin))
    files = runner.series_files(paths.tests)
    assert len(files) >= 10, files
    results, bad = runner.check(paths, files, retry=False)
    assert len(results) >= 20
    assert not bad, "\n".join(bad)


def test_upstream_tests_that_pass_unpatched_pass_patched(llama_server_bin: Path) -> None:
    paths = runner.locate(str(llama_server_bin))
    files = list(runner.CI_UPSTREAM_FILES)
    baseline = runner.load_baseline()
    for f in files:
        passing = [t for t, o in baseline.items() if t.startswith(f + "::") and o == "passed"]
        assert passing, f"the baseline has no passing test in {f}: it would check nothing"
    _, bad = runner.check(paths, files, retry=True)
    assert not bad, "\n".join(bad)
