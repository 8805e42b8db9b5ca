"""The start of a process that imports weightstore: ``import weightstore``, ``ws --version``,
``ws ls small.npz`` (2 tensors), each a fresh interpreter, against the same commands run from a
baseline checkout (``--vs``, another tree's root: main's, an older release's).

Every ``ws`` command, follower and rank pays this start. Runs alternate tree and baseline, so a
machine whose speed drifts moves both; wall and CPU (user + system, the child's own accounting
from ``wait4``) are medians of ``repeat`` pairs, and the ratio is taken pair by pair.

    python -m benchmarks.startup_bench --vs /path/to/main --repeat 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

import weightstore as ws
from benchmarks.common import machine_line, table

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {"import weightstore": ["-c", "import weightstore"], "ws --version": ["-m", "weightstore", "--version"],
         "ws ls small.npz": ["-m", "weightstore", "ls", "small.npz"]}


def timed(root: str, args: list[str], folder: str) -> tuple[float, float]:
    """Wall and CPU seconds of one interpreter importing weightstore from ``root``."""
    env = {**os.environ, "PYTHONPATH": root}
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, *args], cwd=folder, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    assert child.returncode == 0, (root, args, child.returncode)
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vs", required=True, help="the baseline: the root of another checkout")
    parser.add_argument("--repeat", type=int, default=7, help="alternated pairs per case")
    options = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        ws.save(os.path.join(folder, "small.npz"), {"w": np.ones((4, 4), np.float32), "b": np.zeros(4, np.float32)})
        for name, args in CASES.items():
            timed(HERE, args, folder), timed(options.vs, args, folder)  # warm-up: the page cache, the .pyc files
            pairs = [(timed(HERE, args, folder), timed(options.vs, args, folder)) for _ in range(options.repeat)]
            ours, theirs = [pair[0] for pair in pairs], [pair[1] for pair in pairs]
            medians = [f"{statistics.median(run[k] for run in side):.3f}" for k in (0, 1) for side in (ours, theirs)]
            ratios = [f"{statistics.median(a[k] / b[k] for a, b in pairs):.2f}x" for k in (0, 1)]
            rows.append([name, *medians, *ratios])
    print(machine_line())
    print(table(["case", "wall s", "wall s (vs)", "CPU s", "CPU s (vs)", "wall x vs", "CPU x vs"], rows))


if __name__ == "__main__":
    main()
