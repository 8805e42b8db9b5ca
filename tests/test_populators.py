"""The threads that fault a mapped file's stretch in ahead of its reader (``weightstore.io._local``)
at the edges of a process's life: its exit, a fork, and a file cut in place under them. Each case
runs in a fresh interpreter whose populators are made slow or hung (as on a slow or hung mount)
by replacing the one call that faults pages in; every wait has a timeout, so a hang fails the test."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_READ is Linux's")

#: populate whatever the device's read-ahead (the VMs' 8 MB makes the library populate; 128 KB advises)
SETUP = """
import os, sys, threading, time
import numpy as np
import weightstore as ws
from weightstore.io import _local
_local._advice_piece = lambda device: None
path = sys.argv[1]
"""


def run(script: str, path: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SETUP + script, str(path)], capture_output=True, text=True,
                          timeout=120)


def test_an_exiting_process_drops_the_pieces_no_populator_has_started(tmp_path):
    """On a slow mount the stretch announced (here 16 pieces, each 2 s) was faulted in to its end
    before the interpreter could exit: a process that had finished waited for pieces nobody
    would read. The two pieces running finish; the rest are dropped."""
    script = """
import atexit
with open(path, "wb") as f:
    f.truncate(16 * _local._POPULATE_PIECE)
ran, started = [], threading.Semaphore(0)

def slow(address, length):
    ran.append(length)
    started.release()
    time.sleep(2)
    return True

_local.populate_read = slow
atexit.register(lambda: print("pieces run:", len(ran)))  # called once the pools' threads are joined
opened = _local.MappedFile(path)
opened.read_at(0, 1)  # mapped
opened.prefetch(0, opened.size)
for _ in range(2):
    assert started.acquire(timeout=60)  # both populators are in a piece; the main thread returns
"""
    done = run(script, tmp_path / "big.bin")
    assert done.returncode == 0, done.stderr
    run_count = int(done.stdout.split("pieces run:")[1])
    assert 2 <= run_count <= 4, done.stdout  # 16 where the queued pieces ran at exit


def test_a_forked_child_reads_a_store_whose_pieces_its_parents_populators_hold(tmp_path):
    """A data-loader worker forked (multiprocessing's 'fork') while its parent's populators are
    stuck in a piece of a store both hold: the child reads that store and a file of its own, with
    its own threads, never waiting for pieces only its parent's threads would fault in."""
    script = """
import multiprocessing
weights = {"a": np.arange(4 << 20, dtype=np.float32), "b": np.arange(3 << 20, dtype=np.float32)}
ws.save(path, weights)
ws.save(path + ".2.safetensors", weights)
parent, gate, real = os.getpid(), threading.Event(), _local.populate_read

def hung(address, length):
    if os.getpid() == parent:  # the parent's mount hangs until its child is done
        gate.wait(120)
    return real(address, length)

_local.populate_read = hung
store = ws.open(path)
reader = threading.Thread(target=lambda: store["a"])  # waits for the parent's populators
reader.start()
time.sleep(0.2)

def child():
    for key, value in weights.items():
        assert np.array_equal(store[key], value), key
    assert np.array_equal(ws.load(path + ".2.safetensors")["a"], weights["a"])

worker = multiprocessing.get_context("fork").Process(target=child)
worker.start()
worker.join(90)
code = worker.exitcode
gate.set()
reader.join(60)
if code is None:
    worker.kill()
print("child:", code)
"""
    done = run(script, tmp_path / "w.safetensors")
    assert done.returncode == 0, done.stderr
    assert "child: 0" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_a_file_cut_in_place_while_its_pieces_are_populated_is_refused_not_fatal(tmp_path, suffix):
    """The read checked the file's size, then waited for the pieces that hold its bytes; another
    tool cut the file meanwhile (``truncate``, ``cp`` over it), and the read touched the map past
    the new end: SIGBUS killed the process. It is refused, naming the file and the bytes."""
    script = """
ws.save(path, {"w": np.ones(16 << 20, np.uint8)})
real = _local.populate_read

def cut_meanwhile(address, length):
    os.truncate(path, 4096)  # in place, as no weightstore writer ever does
    return real(address, length)

_local.populate_read = cut_meanwhile
try:
    with ws.open(path) as store:
        print("read", int(store["w"].sum()))
except ws.WeightStoreError as error:
    print("refused:", type(error).__name__, error.path == path, error)
"""
    path = tmp_path / f"w{suffix}"
    done = run(script, path)
    assert done.returncode == 0, (done.returncode, done.stderr)
    assert "refused: FormatError True " in done.stdout and "changed size since it was opened" in done.stdout, \
        done.stdout


def test_a_thread_that_first_reads_a_store_as_the_interpreter_exits_reads_it(tmp_path):
    """A program's thread (a server, a loader; no daemon, so the interpreter waits for it) may
    first read a store after the main thread has returned: the readers' module, imported then,
    made its pools, whose exit hook could no longer be registered (RuntimeError, "can't register
    atexit after shutdown"), and the read failed. The exit is past that hook: the pools' jobs
    run in their callers."""
    script = """
import sys, threading, time
import numpy as np
import weightstore as ws
np.savez(sys.argv[1], w=np.arange(10, dtype=np.float32))
assert "weightstore.io._local" not in sys.modules  # imported only by the thread, as the process exits

def serve():
    while threading.main_thread().is_alive():  # until the main thread has returned
        time.sleep(0.01)
    with ws.open(sys.argv[1]) as store:
        print("read", store["w"].sum())

threading.Thread(target=serve).start()
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "w.npz")], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "read 45.0\n", "")
