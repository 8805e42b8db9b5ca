"""The type checker sees the package as installed: a wrong call into the adapters is reported.

``adapters/`` and ``cli/`` are ``weightstore.adapters`` and ``weightstore.cli``; were mypy to see
them as untyped (``Any``), ``run_assign(1, 2, 3, 4, 5, 6)`` would pass CI while the same mistake
on ``ws.save`` is caught. Each case is a snippet mypy must refuse, checked against the project's
own configuration, so the lint step (``./tasks lint``) would catch it in the code.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("mypy")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WRONG = textwrap.dedent("""
    from typing import Any

    import numpy as np

    from weightstore.adapters import layout, plan, skeleton

    options = plan.AssignOptions()
    skeleton.run_assign(1, 2, 3, 4, 5, 6)  # wrong: too many arguments
    plan.plan_assign({"w": np.zeros(2)}, {}, options)  # wrong: a dict is no ValueSource


    class HalfValues:  # a values view lacking shape, checksum, read, prefetch
        where = "x"
        exact_keys = False

        def keys(self) -> list[str]:
            return []

        def dtype(self, key: str) -> np.dtype[Any]:
            return np.dtype("f4")


    plan.plan_assign(HalfValues(), {}, options)  # wrong: not every member of ValueSource
    layout.LaidOutValues(HalfValues(), {})  # wrong: the same, one module further
""")


def test_mypy_reports_wrong_calls_into_the_assign_skeleton(tmp_path):
    snippet = tmp_path / "wrong_calls.py"
    snippet.write_text(WRONG)
    # the lint step's cache (CI runs ./tasks lint first): the package is checked again only where
    # it changed, some 2 s, not the 20 s of CPU a cold check of it and numpy's stubs takes
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", os.path.join(ROOT, "pyproject.toml"),
         "--cache-dir", os.path.join(ROOT, ".mypy_cache"), str(snippet)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    lines = sorted({int(line.split(":")[1]) for line in errors})
    wrong = [number for number, text in enumerate(WRONG.splitlines(), 1) if "# wrong" in text]
    assert lines == wrong, result.stdout
    # none in the package itself; mypy's cache may word a fresh snippet's errors under the path an
    # earlier run gave the same text, so the file's name is what is compared, not its folder
    assert all(os.path.basename(line.split(":")[0]) == snippet.name for line in errors), result.stdout
