"""The documents: generated tables current, the README short, every relative link and anchor resolving."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from controller.docs import main, metrics_table, routes_table, settings_table

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PROXY_DOC = DOCS / "proxy.md"
OPERATIONS_DOC = DOCS / "operations.md"
README_MAX_BYTES = 20_000


def test_the_operations_doc_holds_the_current_settings_and_metrics_tables() -> None:
    text = OPERATIONS_DOC.read_text()
    assert "\n## Settings\n" in text and "\n## Metrics\n" in text
    assert settings_table() in text, "regenerate with: python -m controller.docs settings"
    assert metrics_table() in text, "regenerate with: python -m controller.docs metrics"
    assert "docs/operations.md" in README.read_text()


def test_every_metric_is_in_the_table() -> None:
    table = metrics_table()
    for name in (
        "kvctl_upstream_up",
        "kvctl_parks_total",
        "kvctl_park_duration_seconds",
        "kvctl_build_info",
        "kvctl_policy_decision_seconds",
        "kvctl_gpu_memory_used_bytes",
        "kvctl_host_available_bytes",
    ):
        assert f"| `{name}` |" in table


def test_the_command_prints_both(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert settings_table() in out and metrics_table() in out


def test_the_proxy_doc_holds_the_current_route_table() -> None:
    assert routes_table() in PROXY_DOC.read_text(), "regenerate with: python -m controller.docs routes"
    assert "docs/proxy.md" in README.read_text()


def test_the_readme_is_short() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, at most {README_MAX_BYTES}: move detail to docs/"


def test_every_benchmark_is_in_the_benchmarks_table() -> None:
    """Each runnable `bench/*.py` (a `python -m bench.X` entry point) has its row in docs/benchmarks.md."""
    rows = {m.group(1) for m in re.finditer(r"^\| `bench\.(\w+)` \|", (DOCS / "benchmarks.md").read_text(), re.M)}
    runnable = {p.stem for p in (ROOT / "bench").glob("*.py") if 'if __name__ == "__main__"' in p.read_text()}
    assert runnable, "no benchmark found"
    assert runnable - {"report"} <= rows, f"missing rows in docs/benchmarks.md: {sorted(runnable - {'report'} - rows)}"


# --- links -----------------------------------------------------------------------------------

_FENCE = re.compile(r"^\s*(```|~~~)")
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<(?:a|span)\s[^>]*(?:id|name)=\"([^\"]+)\"")
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(_CODE_SPAN.sub("", line))
    return lines


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
    text = re.sub(r"<[^>]+>", "", text)
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        out.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if m is None:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(path: Path) -> list[str]:
    return [
        target
        for line in _prose_lines(path.read_text())
        for target in _LINK.findall(line)
        if not _SCHEME.match(target) and not target.startswith("//")
    ]


DOCUMENTS = [README, *sorted(DOCS.glob("*.md")), ROOT / "deploy" / "README.md"]


def test_the_slug_follows_github() -> None:
    assert github_slug("Metrics (`--metrics`)") == "metrics---metrics"
    assert github_slug("Rebasing the series onto a newer llama.cpp") == "rebasing-the-series-onto-a-newer-llamacpp"
    assert github_slug("Behind nginx or Caddy") == "behind-nginx-or-caddy"
    assert github_slug("Parked is a flag, not a state") == "parked-is-a-flag-not-a-state"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path) -> None:
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_link_check_finds_links() -> None:
    # the README links into docs/ and to its own sections: a parser that found nothing would pass vacuously
    links = relative_links(README)
    assert "docs/operations.md" in links and "#sizing" in links
