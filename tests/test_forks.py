"""A child forked after its parent used one of weightstore's thread pools uses it again and
finishes: a pool made in the parent has no thread in the child, and would take its work and never
run it (``weightstore.core._forks``). Each case forks in a fresh interpreter holding only
weightstore's own threads: the test process may run TensorFlow's and JAX's, which a fork must not
copy mid-work. Every wait has a timeout, so a child that hangs fails the test instead."""

from __future__ import annotations

import subprocess
import sys

import pytest

#: the parent uses the pool (USE), forks, and the child uses it again; the parent waits for the child
FORK = """
import os, sys, tempfile, time
import numpy as np
folder = tempfile.mkdtemp()
{setup}
def use(round):
{use}
use(0)
pid = os.fork()
if pid == 0:
    use(1)
    sys.exit(0)  # an ordinary exit: it waits for the work handed to threads, as a child's would
for _ in range(600):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        raise SystemExit(os.waitstatus_to_exitcode(status))
    time.sleep(0.05)
os.kill(pid, 9)
os.waitpid(pid, 0)
raise SystemExit("the child hung")
"""

CASES = {
    # a tf1/keras assign's staged batch of 32 MB or more is copied on the copy pool
    "copies": ("from weightstore.adapters.skeleton import copy_into",
               "    a = np.full((64, 1 << 18), round, np.float32); out = np.empty_like(a)\n"
               "    copy_into(out, a)\n"
               "    assert (out == round).all()"),
    # a save of over WRITEBACK_BYTES hands the written bytes to the writeback thread and waits at close
    "writeback": ("import weightstore as ws\nfrom weightstore.io._writeback import WRITEBACK_BYTES",
                  "    path = os.path.join(folder, f'{round}.safetensors')\n"
                  "    ws.save(path, {'w': np.full(WRITEBACK_BYTES // 2 + 1024, round, np.float32)})\n"
                  "    assert (ws.load(path)['w'] == round).all()"),
    # a background publish of sharded members runs on the publishing thread
    "publishing": ("from weightstore.sharded._shards import in_background",
                   "    assert in_background(lambda: round).result(timeout=20) == round"),
    # a read of a local file advises the kernel on the read-ahead thread
    "read-ahead": ("import threading\nfrom weightstore.io import _local\nadvised = threading.Event()\n"
                   "_local._fadvise = lambda *args: advised.set()",
                   "    advised.clear()\n"
                   "    with open(os.path.join(folder, 'f'), 'wb+') as f:\n"
                   "        f.truncate(1 << 20)\n"
                   "        _local._advise(f.fileno(), 0, 1 << 20, None)\n"
                   "        assert advised.wait(timeout=20)"),
}


@pytest.mark.parametrize("pool", list(CASES))
def test_a_forked_child_uses_the_pool_its_parent_used(pool):
    setup, use = CASES[pool]
    done = subprocess.run([sys.executable, "-c", FORK.format(setup=setup, use=use)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_thread_that_outlives_the_main_thread_still_loads_a_file(tmp_path):
    """Once the main thread returns, the interpreter's thread pools refuse new work; a thread
    still running (a server's, a follower's) loads a file all the same, its read-ahead run by itself."""
    script = f"""
import threading, time, numpy as np, weightstore as ws
path = {str(tmp_path / "w.npz")!r}
ws.save(path, {{"w": np.ones(1 << 20, np.float32)}})
def late():
    time.sleep(0.3)  # the main thread has returned by now
    print("read", float(ws.load(path)["w"].sum()))
threading.Thread(target=late).start()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"read {float(1 << 20)}", done.stderr
