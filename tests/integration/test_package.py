"""kvctl as it is installed: the wheel is the runtime alone and runs without extras, on the lowest dependencies allowed.

Both build clean virtual environments under the test's temp dir (pip's download cache is reused, so a warm run
installs from local wheels) and install only what each check needs:

- the lowest allowed version of every runtime dependency (``name>=X`` in pyproject's ``dependencies`` installed as
  ``name==X``) with the unit tests' own tools, and the unit tests run there on the checkout's ``controller``;
- the wheel without extras: its file list is ``controller/`` and its metadata (no testkit, tests or bench), ``kvctl
  --help`` answers, and ``kvctl run --spawn`` starts the real server, proxies a completion and stops it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from testkit.llama import free_port, server_argv
from testkit.stack import stack_admin, start_stack

pytestmark = pytest.mark.server

ROOT = Path(__file__).resolve().parents[2]

# What tests/unit needs beyond the runtime: the test runner and its plugins, and the packages the tests themselves
# import (testkit.models' gguf and numpy, yaml for deploy/). The deploy validators, import-linter and the linters are
# left out: without CI set those tests skip, and the main run checks them.
UNIT_TEST_TOOLS = {
    "pytest",
    "pytest-asyncio",
    "pytest-aiohttp",
    "pytest-timeout",
    "hypothesis",
    "gguf",
    "numpy",
    "pyyaml",
    "packaging",
}

# the distributions a kvctl installed without extras must not pull in (the extras' and testkit's)
DEV_ONLY = ("gguf", "numpy", "openai", "testkit", "tests", "bench")


def project() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        doc: dict[str, Any] = tomllib.load(f)["project"]
    return doc


def lowest_runtime() -> list[Requirement]:
    """``name==X`` for every runtime dependency ``name>=X``: each must have exactly one lower bound."""
    pins = []
    for text in project()["dependencies"]:
        req = Requirement(text)
        lower = [s.version for s in req.specifier if s.operator == ">="]
        assert len(lower) == 1, f"{text}: a runtime dependency needs one lower bound (>=)"
        pins.append(Requirement(f"{req.name}=={lower[0]}"))
    return pins


def extra(name: str, seen: frozenset[str] = frozenset()) -> list[Requirement]:
    """An extra's requirements, with the extras it names (``kvctl[models]``) expanded."""
    out: list[Requirement] = []
    for text in project()["optional-dependencies"][name]:
        req = Requirement(text)
        if canonicalize_name(req.name) == "kvctl":
            for sub in sorted(req.extras - seen):
                out += extra(sub, seen | {name, sub})
        else:
            out.append(req)
    return out


def venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    return path / "bin" / "python"


def pip_install(python: Path, *args: str) -> None:
    argv = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-input", *args]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, f"{' '.join(argv)}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def installed(python: Path) -> dict[str, Version]:
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))"
    )
    # not from the checkout: its kvctl.egg-info (an editable install's) would be found on the current directory
    argv = [str(python), "-c", code]
    out = subprocess.run(argv, cwd=python.parent, capture_output=True, text=True, check=True, timeout=60).stdout
    return {canonicalize_name(k): Version(v) for k, v in json.loads(out).items()}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what would leak the outer one in: no PYTHONPATH, no outer test's name."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS", "VIRTUAL_ENV"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, **extra}


def test_the_unit_tests_pass_on_the_lowest_allowed_runtime_dependencies(tmp_path: Path) -> None:
    pins = lowest_runtime()
    names = {canonicalize_name(p.name) for p in pins}
    tools = [r for r in extra("test") if canonicalize_name(r.name) in UNIT_TEST_TOOLS and r.name not in names]
    assert {canonicalize_name(r.name) for r in tools} == UNIT_TEST_TOOLS, "a unit-test tool is not in the test extra"
    python = venv(tmp_path / "lowest")
    pip_install(python, *map(str, pins), *map(str, tools))
    have = installed(python)
    for pin in pins:
        (want,) = [s.version for s in pin.specifier]
        assert have[canonicalize_name(pin.name)] == Version(want), f"{pin.name}: {have.get(pin.name)} installed"
    assert "kvctl" not in have, "the unit tests run on the checkout's controller"
    # without CI set a missing deploy validator or lint-imports skips: those are checked by this run itself
    env = clean_env()
    env.pop("CI", None)
    argv = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit"]
    r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    pinned = ", ".join(map(str, pins))
    assert r.returncode == 0, f"the unit tests fail on {pinned}:\n{r.stdout[-6000:]}\n{r.stderr[-2000:]}"
    assert re.search(r"\d+ passed", r.stdout), r.stdout[-2000:]


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of a clean copy of what it is built from (no build/ left over from an earlier build in the tree)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "controller", src / "controller", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    argv = [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps"]
    r = subprocess.run([*argv, "-w", str(dist), str(src)], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (wheel,) = dist.glob("kvctl-*.whl")
    return wheel


def test_the_wheel_is_the_runtime_and_runs_the_real_server_without_extras(
    tmp_path: Path, llama_server_bin: Path, tiny_model: Path
) -> None:
    wheel = build_wheel(tmp_path)
    files = zipfile.ZipFile(wheel).namelist()
    dist_info = next(f.split("/")[0] for f in files if f.endswith(".dist-info/METADATA"))
    assert {f.split("/")[0] for f in files} == {"controller", dist_info}, sorted(files)
    assert "controller/cli/main.py" in files and "controller/proxy/app.py" in files
    assert not [f for f in files if re.search(r"testmodels|demo\.py|/tests?/|conftest", f)], sorted(files)
    metadata = zipfile.ZipFile(wheel).read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: MIT" in metadata

    python = venv(tmp_path / "wheel")
    pip_install(python, str(wheel))
    bin_dir = python.parent
    have = installed(python)
    assert "kvctl" in have and not [d for d in DEV_ONLY if d in have], sorted(have)
    # away from the checkout: the installed controller, and none of the development packages importable
    code = (
        "import importlib.util as u, controller; print(controller.__file__); "
        f"print([m for m in {DEV_ONLY!r} if u.find_spec(m)])"
    )
    r = subprocess.run([str(python), "-c", code], cwd=tmp_path, env=clean_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    where, found = r.stdout.splitlines()
    assert where.startswith(str(tmp_path / "wheel")) and found == "[]", r.stdout

    kvctl = bin_dir / "kvctl"
    r = subprocess.run([str(kvctl), "--help"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True)
    assert r.returncode == 0 and "run" in r.stdout, r.stdout + r.stderr
    for module in ("controller", "controller.cli"):  # python -m, the documented other way in
        r = subprocess.run(
            [str(python), "-m", module, "--help"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True
        )
        assert r.returncode == 0 and "run" in r.stdout, r.stdout + r.stderr

    port = free_port()
    server = server_argv(llama_server_bin, tiny_model, port, "-c", "512", "-np", "1", "-kvu", "--slots")
    log = tmp_path / "kvctl.log"
    upstream = f"http://127.0.0.1:{port}"
    env = clean_env(KVCTL_SUPERVISOR__LOG_FILE=str(tmp_path / "server.log"))
    with start_stack(
        upstream, "--spawn", "--", *server, kvctl=[str(kvctl)], env=env, log_path=log, timeout_s=120
    ) as url:
        body = {"prompt": "Hello", "n_predict": 8, "ignore_eos": True}
        req = urllib.request.Request(url + "/completion", json.dumps(body).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=60) as resp:
            answer = json.load(resp)
        assert answer["tokens_predicted"] == 8, answer
        admin = stack_admin(url).removeprefix("http://")
        r = subprocess.run([str(kvctl), "status", "--admin", admin], env=clean_env(), capture_output=True, text=True)
        assert r.returncode == 0, r.stdout + r.stderr
        status = json.loads(r.stdout)
        assert status["supervisor"]["state"] == "ready", status
        server_pid = status["supervisor"]["pid"]
    # kvctl stopped (SIGTERM), and the server it spawned with it
    assert not pid_alive(server_pid), "kvctl stops the server it started"
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    assert "Traceback" not in log.read_text(errors="replace"), log.read_text()[-3000:]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes: only its exit status is left
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False
