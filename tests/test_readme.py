"""The README is a front door: small, and every Python program in it runs as pasted.

Each ```python block is a whole program, run in a fresh interpreter in an empty folder; the one
that names ``s3://`` runs against the loopback S3 server (``conftest.server``), found through the
environment as any S3 client finds its endpoint.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BUCKET = "weightstore-readme"  # made by the ``server`` fixture
PROGRAMS = re.findall(r"^```python\n(.*?)^```$", README.read_text(), re.MULTILINE | re.DOTALL)


def test_readme_is_at_most_12_kb_and_holds_programs():
    assert README.stat().st_size <= 12 * 1024, f"README.md is {README.stat().st_size} bytes"
    assert len(PROGRAMS) >= 2 and any("s3://" in program for program in PROGRAMS)


def test_benchmarks_page_is_at_most_15_kb():
    size = (ROOT / "docs" / "benchmarks.md").stat().st_size
    assert size <= 15 * 1024, f"docs/benchmarks.md is {size} bytes: current figures only, history lives in git"


def test_readme_keeps_the_test_command_ci_reads():
    assert "./tasks test    # the whole test suite" in README.read_text()


@pytest.mark.parametrize("program", PROGRAMS, ids=[f"program_{n}" for n in range(1, len(PROGRAMS) + 1)])
def test_readme_program_runs_as_pasted(program, tmp_path, request):
    pytest.importorskip("tensorflow")
    env = {**os.environ, "TMPDIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    if "s3://" in program:
        server = request.getfixturevalue("server")
        env.update(server.environment(), WS_BUCKET=BUCKET)
    (tmp_path / "program.py").write_text(program)
    done = subprocess.run([sys.executable, "program.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "followed" in done.stdout, done.stdout
