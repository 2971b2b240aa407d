"""The import layering of pyproject's [tool.importlinter] holds: the runtime imports no development code, and so on.

``lint-imports`` (package import-linter, in the test extra) reads the contracts from pyproject.toml in the repository
root and follows every import, those inside functions too.
"""

from __future__ import annotations

import json
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


def test_importing_the_policy_loads_no_http_and_no_proxy() -> None:
    """What import-linter does not see: a package's ``__init__`` runs on any import of its modules. The policy, in a
    fresh interpreter, leaves aiohttp and every controller.proxy module out of sys.modules (the old cycle through
    settings and proxy.auth loaded aiohttp and nine proxy modules)."""
    program = (
        "import sys, controller.policy, controller.settings\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'aiohttp' or m.startswith('controller.proxy')]\n"
        "print('\\n'.join(sorted(bad)))"
    )
    r = subprocess.run(
        [sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    assert r.stdout.strip() == "", f"loaded with controller.policy:\n{r.stdout}"


def test_the_cycle_that_was_fails_the_contracts(tmp_path: Path) -> None:
    """The contracts would have caught the old cycle: settings importing the proxy's auth module breaks one."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "controller", project / "controller")
    shutil.copy(ROOT / "pyproject.toml", project / "pyproject.toml")
    settings = project / "controller" / "settings.py"
    settings.write_text(settings.read_text() + "\nfrom controller.proxy.auth import ServerCheck  # noqa: E402\n")
    text = (project / "pyproject.toml").read_text()
    # only the runtime's contracts: the copy has no testkit, tests or bench
    text = text.replace('root_packages = ["controller", "testkit", "tests", "bench"]', 'root_packages = ["controller"]')
    head, *contracts = text.split("[[tool.importlinter.contracts]]")
    kept = [
        c for c in contracts if '"testkit"' not in c and '"tests"' not in c and 'source_modules = ["bench"]' not in c
    ]
    (project / "pyproject.toml").write_text("[[tool.importlinter.contracts]]".join([head, *kept]))
    env = {**os.environ, "PYTHONPATH": str(project)}
    r = subprocess.run(
        [lint_imports(), "--no-cache"], cwd=project, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "controller.settings -> controller.proxy.auth" in r.stdout, r.stdout


def import_cycles(package: str, root: Path) -> list[list[str]]:
    """The import cycles among ``package``'s modules, lazy imports (inside functions) included and imports under
    ``if TYPE_CHECKING:`` left out. Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``, so an
    import is an edge to each of its module's packages too, except those the importer is inside (they are being
    initialised already)."""
    pytest.importorskip("grimp")  # import-linter's graph builder
    # in a fresh interpreter, so that ``package`` is the one under ``root``, not the one this process imported
    program = (
        "import json, sys, grimp\n"
        f"g = grimp.build_graph({package!r}, exclude_type_checking_imports=True, cache_dir=None)\n"
        "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run(
        [sys.executable, "-c", program], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    imports: dict[str, list[str]] = json.loads(r.stdout)
    edges: dict[str, set[str]] = {m: set() for m in imports}
    for module, targets in imports.items():
        for target in targets:
            parts = target.split(".")
            for n in range(1, len(parts) + 1):
                dest = ".".join(parts[:n])
                if dest in edges and dest != module and not module.startswith(dest + "."):
                    edges[module].add(dest)
    # Tarjan's strongly connected components; a component of two or more modules is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return cycles


def test_the_runtime_has_no_import_cycle_lazy_or_not() -> None:
    assert import_cycles("controller", ROOT) == []


def test_a_lazy_import_that_closes_a_cycle_is_found(tmp_path: Path) -> None:
    """The old cycle, closed through a function-level import: settings -> proxy.auth, proxy.app -> settings."""
    shutil.copytree(ROOT / "controller", tmp_path / "controller")
    settings = tmp_path / "controller" / "settings.py"
    settings.write_text(
        settings.read_text() + "\n\ndef _late() -> None:\n    from controller.proxy import auth  # noqa\n"
    )
    auth = tmp_path / "controller" / "proxy" / "auth.py"
    auth.write_text(auth.read_text() + "\n\ndef _late2() -> None:\n    import controller.settings  # noqa\n")
    cycles = import_cycles("controller", tmp_path)
    assert any({"controller.settings", "controller.proxy.auth"} <= set(c) for c in cycles), cycles


def imports_of_test_modules(root: Path) -> list[str]:
    """``importer -> imported`` for every import (lazy ones too) of a test module (``test_*``) or a conftest by
    another module of tests, testkit or bench. What test modules share belongs in tests/harness.py (or testkit);
    pytest loads the conftest files itself, and a module that imports one runs it a second time."""
    pytest.importorskip("grimp")
    program = (
        "import json, grimp\n"
        "g = grimp.build_graph('tests', 'testkit', 'bench', cache_dir=None)\n"
        "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    r = subprocess.run(
        [sys.executable, "-c", program], cwd=root, env=env, capture_output=True, text=True, timeout=120, check=True
    )
    imports: dict[str, list[str]] = json.loads(r.stdout)

    def is_test_module(name: str) -> bool:
        last = name.rsplit(".", 1)[-1]
        return name.startswith("tests.") and (last.startswith("test_") or last == "conftest")

    return sorted(f"{m} -> {t}" for m, targets in imports.items() for t in targets if is_test_module(t))


def test_no_module_imports_a_test_module_or_a_conftest() -> None:
    assert imports_of_test_modules(ROOT) == []


def test_an_import_of_a_test_module_or_a_conftest_is_found(tmp_path: Path) -> None:
    """The check is not vacuous: a test module importing another one's helper, and a helper module importing a
    conftest's type inside a function, are both found; importing the harness is not."""
    for package in ("tests", "tests/unit", "testkit", "bench"):
        (tmp_path / package).mkdir(parents=True, exist_ok=True)
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "tests" / "harness.py").write_text("HELPER = 1\n")
    (tmp_path / "tests" / "unit" / "conftest.py").write_text("Factory = int\n")
    (tmp_path / "tests" / "unit" / "test_a.py").write_text("from tests.harness import HELPER\n\nOWN = HELPER\n")
    (tmp_path / "tests" / "unit" / "test_b.py").write_text("from tests.unit.test_a import OWN\n")
    (tmp_path / "tests" / "unit" / "helpers.py").write_text(
        "def late() -> None:\n    from tests.unit.conftest import Factory  # noqa\n"
    )
    assert imports_of_test_modules(tmp_path) == [
        "tests.unit.helpers -> tests.unit.conftest",
        "tests.unit.test_b -> tests.unit.test_a",
    ]
