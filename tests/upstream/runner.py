"""Run llama.cpp's own server test suite offline against a built llama-server.

The suite is the one in the patched tree (``tools/server/tests``, kept beside the binary by
scripts/build_llama.sh as ``server-tests/``): upstream's files plus the series' own tests.
Upstream's tests need downloaded models; here every server loads one generated
random-weight model (see kvctl_offline.py), so tests that check what a trained model says
fail, patched or not. ``baseline.json`` records each upstream test's result on the
unpatched build; a test that passes there must pass on the patched build. Tests that the
series adds are not in the baseline and must pass.

    python -m tests.upstream.runner [--binary PATH] [--all | FILE...]
    python -m tests.upstream.runner --record --binary UNPATCHED [--all | FILE...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from testkit.llama import free_port

HERE = Path(__file__).resolve().parent
BASELINE = HERE / "baseline.json"

# What CI runs: the upstream files that exercise what the series touches (slots and their
# selection, completions streamed and not, chat streaming, /props and the 404 handler, /metrics,
# API keys and CORS, idle sleep, the unified pool, context limits), then every test the series
# adds. unit/test_slot_save.py would belong here, but none of its tests passes offline (each one
# checks what a trained model says), so it would check nothing.
CI_UPSTREAM_FILES = (
    "unit/test_basic.py",
    "unit/test_completion.py",
    "unit/test_chat_completion.py",
    "unit/test_ignore_eos.py",
    "unit/test_security.py",
    "unit/test_sleep.py",
    "unit/test_kv_keep_only_active.py",
    "unit/test_ctx_shift.py",
    "unit/test_metrics.py",
)

OUTCOMES = ("passed", "failed", "skipped")


@dataclass(frozen=True)
class Paths:
    binary: Path
    tests: Path
    vocab: Path


def locate(binary: str | None = None) -> Paths:
    path = Path(binary or os.environ.get("LLAMA_SERVER_BIN_PATH", "")).expanduser()
    if not path.is_file():
        raise SystemExit("runner: no llama-server (set LLAMA_SERVER_BIN_PATH or pass --binary)")
    entry = path.parent.parent
    tests = entry / "server-tests"
    if not (tests / "utils.py").is_file():
        raise SystemExit(f"runner: {tests} has no upstream test suite; rebuild with scripts/build_llama.sh")
    return Paths(path, tests, entry / "vocab")


def series_files(tests: Path) -> list[str]:
    """The series' own test files: those of the patched tree that upstream's suite (the baseline) lacks."""
    upstream = {test.split("::")[0] for test in load_baseline()}
    if not upstream:
        raise SystemExit(f"runner: {BASELINE} is missing or empty")
    return [f for f in all_files(tests) if f not in upstream]


def all_files(tests: Path) -> list[str]:
    return sorted(str(p.relative_to(tests)) for p in (tests / "unit").glob("test_*.py"))


def model(paths: Paths) -> Path:
    from testkit import models

    out = Path(tempfile.gettempdir()) / "kvctl-upstream-tests" / "tiny.gguf"
    out.parent.mkdir(parents=True, exist_ok=True)
    return models.write_llama(out, paths.vocab / "ggml-vocab-llama-spm.gguf", models.SIZES["tiny"])


def run(paths: Paths, files: list[str], *, timeout_s: float = 3600, quiet: bool = True) -> dict[str, str]:
    """Run pytest over ``files`` of the suite; return {test id: passed|failed|skipped}."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        env = {
            **os.environ,
            "LLAMA_SERVER_BIN_PATH": str(paths.binary),
            "KVCTL_UPSTREAM_MODEL": str(model(paths)),
            "PYTHONPATH": os.pathsep.join([str(HERE), str(paths.tests)]),
            "PORT": str(free_port()),
            "LLAMA_CACHE": str(Path(tmp) / "cache"),
        }
        env.pop("PYTEST_ADDOPTS", None)
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "kvctl_offline",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(paths.tests),
            "-c",
            str(paths.tests / "pytest.ini"),
            "-o",
            "junit_family=xunit1",
            f"--junitxml={junit}",
            "-q",
            "-rN",
            *files,
        ]
        subprocess.run(
            cmd,
            cwd=paths.tests,
            env=env,
            timeout=timeout_s,
            stdout=subprocess.DEVNULL if quiet else None,
            stderr=subprocess.STDOUT if quiet else None,
        )
        if not junit.is_file():
            raise RuntimeError("pytest wrote no report: " + " ".join(cmd))
        return parse_junit(junit)


def parse_junit(path: Path) -> dict[str, str]:
    res: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = (case.get("classname") or "").replace(".", "/")
        name = f"{module}.py::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            res[name] = "failed"
        elif case.find("skipped") is not None:
            res[name] = "skipped"
        else:
            res[name] = "passed"
    return res


def load_baseline() -> dict[str, str]:
    return dict(json.loads(BASELINE.read_text())["tests"]) if BASELINE.is_file() else {}


def regressions(baseline: dict[str, str], results: dict[str, str], files: list[str]) -> list[str]:
    """Tests that passed unpatched and do not pass now (or vanished), and new tests that do not pass."""
    ran = {f.removesuffix(".py") for f in files}
    bad = []
    for test, outcome in baseline.items():
        if outcome == "passed" and test.split(".py::")[0] in ran and results.get(test) != "passed":
            bad.append(f"{test}: passed unpatched, {results.get(test, 'missing')} now")
    for test, outcome in results.items():
        if test not in baseline and outcome != "passed":
            bad.append(f"{test}: a test of the series, {outcome}")
    return sorted(bad)


def check(paths: Paths, files: list[str], *, retry: bool, quiet: bool = True) -> tuple[dict[str, str], list[str]]:
    """Run ``files`` and compare with the baseline; return the results and the regressions.

    With ``retry``, the files of failing tests run once more on their own, so that one slow
    moment of the machine is not taken for a regression.
    """
    baseline = load_baseline()
    results = run(paths, files, quiet=quiet)
    bad = regressions(baseline, results, files)
    if bad and retry:
        again = run(paths, sorted({b.split("::")[0] for b in bad}))
        results.update({t: o for t, o in again.items() if o == "passed"})
        bad = regressions(baseline, results, files)
    return results, bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="test files relative to tools/server/tests (default: what CI runs)")
    ap.add_argument("--binary", help="llama-server (default: $LLAMA_SERVER_BIN_PATH)")
    ap.add_argument("--all", action="store_true", help="the whole suite")
    ap.add_argument(
        "--record",
        action="store_true",
        help="write the results into baseline.json (run this on an unpatched build: --no-patches)",
    )
    ap.add_argument("--repeat", type=int, default=2, help="with --record: runs; a test must pass in each (default 2)")
    args = ap.parse_args(argv)

    paths = locate(args.binary)
    files = all_files(paths.tests) if args.all else (args.files or [*CI_UPSTREAM_FILES, *series_files(paths.tests)])

    if args.record:
        merged = {} if args.all else load_baseline()  # the whole suite replaces, a few files update
        runs = [run(paths, files) for _ in range(max(1, args.repeat))]
        for test in sorted(set().union(*runs)):
            outcomes = {r.get(test, "failed") for r in runs}
            merged[test] = outcomes.pop() if len(outcomes) == 1 else "flaky"
        BASELINE.write_text(
            json.dumps(
                {
                    "about": "llama.cpp server tests on the unpatched build, offline on a random-weight model "
                    "(tests/upstream/runner.py --record); 'flaky' means the runs disagreed",
                    "tests": dict(sorted(merged.items())),
                },
                indent=1,
            )
            + "\n"
        )
        counts = {o: sum(1 for v in merged.values() if v == o) for o in (*OUTCOMES, "flaky")}
        print(f"runner: recorded {len(merged)} tests in {BASELINE}: {counts}")
        return 0

    results, bad = check(paths, files, retry=True, quiet=False)
    counts = {o: sum(1 for v in results.values() if v == o) for o in OUTCOMES}
    print(f"runner: {len(results)} tests {counts}; {len(bad)} regressions")
    for line in bad:
        print("  " + line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
