"""The processes of the kill test (``test_shards_kills.py``): writers, a coordinator and
a follower of one versioned folder, forked by a launcher that imported all this once (run as a
script: ``launch`` reads what to start from its standard input). A fork starts in milliseconds;
an interpreter importing weightstore takes a second and more on a loaded machine.

What every step holds is derived from the step number, so the follower can check any version
it sees, bit for bit, knowing only its step. Each step is written in a member format of its
own (safetensors, npz, HDF5 in turn).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import traceback

import ml_dtypes
import numpy as np

import weightstore as ws
from weightstore.formats import format_named
from weightstore.sharded import _shards as shards
from weightstore.sync import _stages as stages

WORLD = 4
ROWS, COLS = 256, 256  # a piece per writer of one block or more; the size asserts nothing
FORMATS = ("safetensors", "npz", "hdf5")
#: where a writer or the coordinator may be told to SIGKILL itself, in the order they pass them
WRITER_STAGES = ("member-temporary", "member-written", "done-written")
COORDINATOR_STAGES = ("locked", "cleaned", "index-written", "version-written", "latest-temporary",
                      "latest-written", "pruning", "pruned")
#: exit codes of a coordinator that failed cleanly
TIMED_OUT, REFUSED = 3, 4


def expected(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal((ROWS, COLS)).astype(np.float32),
            "e": rng.standard_normal((32, 64)).astype(ml_dtypes.bfloat16),
            "n": np.array(step, np.int64)}


def pieces(step: int, rank: int) -> dict[str, object]:
    model, rows = expected(step), ROWS // WORLD
    held: dict[str, object] = {
        "w": ws.Piece(model["w"][rank * rows:(rank + 1) * rows], (rank * rows, 0), (ROWS, COLS)),
        "e": ws.Piece(model["e"][:, rank * 16:(rank + 1) * 16], (0, rank * 16), (32, 64)),
    }
    if rank == 0:
        held["n"] = model["n"]
    return held


def _kill_at(role: str, stage: str) -> None:
    """SIGKILL this process at ``stage``, first saying so on stderr (:func:`said_killed` reads it):
    an exit by SIGKILL alone could be the test's own kill, at another moment."""
    def hook(name: str) -> None:
        if name == stage:
            os.write(2, f"{role} killed at {stage}\n".encode())  # one write: whole among the other children's
            os.kill(os.getpid(), 9)

    stages.hook = hook


def said_killed(stderr: str) -> dict[str, str]:
    """The stage each child that :func:`_kill_at` killed said it died at, by role, in ``stderr``."""
    return dict(line.split(" killed at ") for line in stderr.splitlines() if " killed at " in line)


def writer(folder: str, step: int, rank: int, attempt: int, stage: str) -> None:
    _kill_at(f"writer-{rank}", stage)
    ws.publish_shard(folder, pieces(step, rank), step=step, rank=rank, world=WORLD, attempt=attempt,
                     format=FORMATS[step % len(FORMATS)])


def coordinator(folder: str, step: int, attempt: int, stage: str) -> None:
    _kill_at("coordinator", stage)
    try:
        shards.commit_shards(folder, step=step, world=WORLD, attempt=attempt, timeout=60, keep=3,
                             metadata={"step": step})
    except ws.ShardTimeoutError:
        os._exit(TIMED_OUT)
    except ws.PublishError as exc:
        print(f"coordinator of step {step} attempt {attempt}: {exc}", file=sys.stderr, flush=True)
        os._exit(REFUSED)


def follower(folder: str, log: str, stop: str) -> None:
    """Follows the folder until the file ``stop`` exists, checking every version it sees; writes
    each step seen to ``log``, or the first thing wrong."""
    last = None
    with open(log, "a") as out:
        try:
            while not os.path.exists(stop):
                for version in ws.follow(folder, poll=0.05, max_poll=0.1, timeout=0.3, after=last):
                    if last is not None and version.step <= last:
                        raise AssertionError(f"step {version.step} after step {last}")
                    check(folder, version)
                    last = version.step
                    out.write(json.dumps(["seen", version.step]) + "\n")
                    out.flush()
        except BaseException:
            out.write(json.dumps(["error", traceback.format_exc()]) + "\n")
            raise


def check(folder: str, version: ws.Version) -> None:
    """The version whole and by thirds of rows (a reader partitioned unlike the four writers) is
    exactly what its step holds; a version pruned while read (only ever an older one) is let go."""
    model = expected(version.step)
    try:
        if version.metadata != {"step": version.step}:
            raise AssertionError(f"step {version.step}: LATEST's metadata is {version.metadata}")
        with ws.open(version) as store:
            if sorted(store) != sorted(model):
                raise AssertionError(f"step {version.step} holds {sorted(store)}")
            for key, value in model.items():
                got = store[key]
                if got.dtype != value.dtype or got.tobytes() != value.tobytes():
                    raise AssertionError(f"step {version.step}: {key} is not what was written")
            for part in range(3):
                rows = slice(part * ROWS // 3, (part + 1) * ROWS // 3)
                if store.read_region("w", (rows,)).tobytes() != model["w"][rows].tobytes():
                    raise AssertionError(f"step {version.step}: rows {rows} of w are not what was written")
    except ws.VersionGoneError:
        newest = ws.latest(folder)
        if newest is None or newest.step <= version.step:
            raise


def threads() -> int:
    """The threads this process runs, native ones (a BLAS pool) included."""
    try:
        return len(os.listdir("/proc/self/task"))
    except FileNotFoundError:  # no procfs: the threads Python knows of
        return threading.active_count()


def launch() -> None:
    """Start what each line of standard input names (``["writer", args…]``, printing the child's
    pid) or wait for a child (``["wait", pid]``, printing its exit code, ``-9`` for SIGKILL).

    Forking is safe here because this process runs one thread: a child forked while another
    thread held a lock (the allocator's, the import lock, a logging handler's) would wait for
    it forever. weightstore starts no thread on import (its readahead, write-back and worker
    pools start on first use, which this process never makes: only the children read and
    write), and numpy's OpenBLAS, which starts a pool on import, is told to run none
    (``OPENBLAS_NUM_THREADS=1``, set by ``test_shards_kills.py``). Each fork checks it still is so."""
    roles = {"writer": writer, "coordinator": coordinator, "follower": follower}
    # what every child would import for itself (a second and more of each one's CPU): the member
    # formats' modules, h5py's among them, and the S3 folders' file system
    for name in FORMATS:
        format_named(name)
    with contextlib.suppress(ImportError):  # no s3fs: the local test alone runs
        import s3fs  # noqa: F401
    for line in sys.stdin:
        command, *args = json.loads(line)
        if command == "wait":
            _, status = os.waitpid(args[0], 0)
            print(os.waitstatus_to_exitcode(status), flush=True)
            continue
        if threads() != 1:
            raise RuntimeError(f"the launcher runs {threads()} threads: a forked child could hang on a lock one of "
                               "them held (set OPENBLAS_NUM_THREADS=1; start no thread before forking)")
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                roles[command](*args)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stderr.flush()
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    launch()
