"""The README is a front door: small, and every Python program in it runs as pasted.

Each ```python block is a whole program, run as ``__main__`` in a process of its own, in an empty
folder and with an environment of its own; the one that names ``s3://`` runs against the loopback
S3 server (``conftest.server``), found through the environment as any S3 client finds its
endpoint. The process is forked from one that imported TensorFlow and Keras (``conftest.tf_fork``):
a program's own imports find them loaded, but it builds the first model of its process, and a
name it never imported is still undefined.
"""

from __future__ import annotations

import os
import re
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
def test_readme_program_runs_as_pasted(program, tmp_path, request, tf_fork):
    env = {**os.environ, "TMPDIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    if "s3://" in program:
        server = request.getfixturevalue("server")
        env.update(server.environment(), WS_BUCKET=BUCKET)
    done = tf_fork.run(program, cwd=tmp_path, env=env, timeout=240, name="program.py")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "followed" in done.stdout, done.stdout
