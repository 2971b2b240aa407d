"""The controller stays readable: no module over 600 lines (settings, which is declarations, up to 800), no class
over 400 lines and no function over 120 (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

CONTROLLER = Path(__file__).resolve().parents[2] / "controller"
MODULE_LINES, SETTINGS_LINES, CLASS_LINES, FUNCTION_LINES = 600, 800, 400, 120


def oversized(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(root.parent))
        limit = SETTINGS_LINES if path.name == "settings.py" and path.parent == root else MODULE_LINES
        if (n := len(text.splitlines())) > limit:
            found.append(f"{name}: {n} lines (module, at most {limit})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.end_lineno:
                n = node.end_lineno - node.lineno + 1
                kind, most = ("class", CLASS_LINES) if isinstance(node, ast.ClassDef) else ("function", FUNCTION_LINES)
                if n > most:
                    found.append(f"{name}:{node.lineno} {node.name}: {n} lines ({kind}, at most {most})")
    return found


def test_no_module_class_or_function_is_over_its_limit() -> None:
    assert oversized(CONTROLLER) == []


def test_the_check_finds_what_is_too_long(tmp_path: Path) -> None:
    pkg = tmp_path / "controller"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LINES))
    (pkg / "long.py").write_text("def f() -> None:\n" + body + "\n" * MODULE_LINES)
    (pkg / "settings.py").write_text("\n" * (MODULE_LINES + 1))
    found = oversized(pkg)
    assert found == [
        f"controller/long.py: {FUNCTION_LINES + MODULE_LINES + 1} lines (module, at most {MODULE_LINES})",
        f"controller/long.py:1 f: {FUNCTION_LINES + 1} lines (function, at most {FUNCTION_LINES})",
    ], found


def test_every_package_init_imports_nothing() -> None:
    """Importing one module runs its packages' ``__init__``: that costs nothing and closes no cycle when they are
    empty (docs/architecture.md); import the module that defines the name."""
    loud = [
        str(init.relative_to(CONTROLLER.parent))
        for init in sorted(CONTROLLER.rglob("__init__.py"))
        if any(isinstance(n, ast.Import | ast.ImportFrom) for n in ast.walk(ast.parse(init.read_text())))
    ]
    assert loud == [], loud
