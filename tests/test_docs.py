"""The repository documents itself: the API reference is current and every link resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_api_reference_is_what_the_docstrings_say():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_api.py"), "--check", "api"], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, "docs/api.md is out of date: run ./tasks docs\n" + result.stderr


def test_the_table_of_bounds_in_security_md_is_what_limits_py_says():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_api.py"), "--check", "security"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, "docs/security.md's bounds are out of date: run ./tasks docs\n" + result.stderr


def test_every_relative_link_resolves_inside_the_repository():
    for document in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", document.read_text()):
            if "://" in target:
                continue
            resolved = (document.parent / target).resolve()
            assert resolved.exists(), f"{document.name} links to missing {target}"
            assert ROOT in resolved.parents or resolved == ROOT, f"{document.name} links outside the repository"


def _anchors(document: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as ``-``."""
    text = re.sub(r"^```.*?^```", "", document.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#+ +(.+?) *$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_anchor_names_a_heading():
    for document in DOCS:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", document.read_text()):
            page = (document.parent / target).resolve() if target else document
            if "://" in target or page.suffix != ".md":
                continue
            assert anchor in _anchors(page), f"{document.name} links to {target}#{anchor}, which no heading makes"


def test_the_readme_links_every_docs_page():
    """The README is the front door: every page in docs/ is one link away from it."""
    linked = {Path(target).name for target in re.findall(r"\]\(docs/([^)#\s]+)", (ROOT / "README.md").read_text())}
    pages = {path.name for path in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_nothing_points_outside_the_repository():
    for path in [*DOCS, *ROOT.glob("weightstore/**/*.py"), *ROOT.glob("adapters/*.py"), *ROOT.glob("cli/*.py")]:
        text = path.read_text()
        assert "../shared" not in text and "DESIGN.md" not in text, path


def test_readme_lines_fit_100_columns():
    long = [(number, len(line)) for number, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1)
            if len(line) > 100]
    assert long == [], f"README.md lines over 100 columns (line, width): {long}"


def test_user_facing_text_has_no_internal_wording():
    """Issue numbers and development rounds mean nothing to a user reading the docs, a message or a
    benchmark's output."""
    internal = re.compile(r"\bissue \d+|\bissue #\d+|\b(this|last|previous) round\b|\ba seed needs\b", re.IGNORECASE)
    for path in [*DOCS, *ROOT.glob("weightstore/**/*.py"), *ROOT.glob("adapters/*.py"), *ROOT.glob("cli/*.py"),
                 *ROOT.glob("benchmarks/*.py"), *ROOT.glob("examples/*.py")]:
        found = internal.search(path.read_text())
        assert found is None, f"{path.relative_to(ROOT)}: {found.group(0)!r}"


def test_every_benchmark_the_docs_give_imports():
    """A benchmark that no longer imports is a figure in the docs nobody can reproduce."""
    commands = set()
    for path in [*DOCS, *ROOT.glob("benchmarks/*.py")]:
        commands.update(re.findall(r"python -m (benchmarks\.\w+)", path.read_text()))
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    result = subprocess.run([sys.executable, "-c", code, *sorted(commands)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(commands) >= 10, sorted(commands)
