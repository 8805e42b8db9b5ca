"""The processes of one job a test starts together (its ranks or workers): run at once, waited
for, and never left behind."""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a job's coordinator, taken below
    the kernel's ephemeral range: a port the kernel hands out (``bind`` to 0) is what it gives
    the next outgoing connection too (an S3 client of another test), which took a coordinator's
    port between this choice and its listen (EADDRINUSE, a launch that failed)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for port in random.sample(range(10_000, low), min(50, max(low - 10_000, 0))):
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind(("127.0.0.1", port))
            return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_together(commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], *,
                 timeout: float) -> list[subprocess.CompletedProcess[str]]:
    """Start every command at once, each with its environment, and wait for all of them.

    Output goes to files, not pipes: a rank blocked writing into a full pipe that no one reads
    yet (its peer's is read first) would stall the whole job. The test fails, with each one's
    last output, if they do not all finish within ``timeout`` seconds; whatever is still
    running then, or when anything goes wrong here, is killed (a rank waiting in a collective
    for a peer that died would otherwise wait forever)."""
    with contextlib.ExitStack() as stack:
        started: list[tuple[subprocess.Popen[str], IO[str], IO[str]]] = []
        finished = False
        try:
            for command, env in zip(commands, envs, strict=True):
                out, err = (stack.enter_context(tempfile.NamedTemporaryFile("w+")) for _ in range(2))
                started.append((subprocess.Popen(list(command), env=dict(env), stdout=out, stderr=err, text=True),
                                out, err))
            deadline = time.monotonic() + timeout
            for proc, _, _ in started:
                proc.wait(max(0.0, deadline - time.monotonic()))
            finished = True
        except subprocess.TimeoutExpired:
            pass
        finally:
            for proc, _, _ in started:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        results = []
        for proc, out, err in started:
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read()))
    if not finished:
        pytest.fail(f"the job did not finish within {timeout} s:\n" +
                    "\n".join(f"[{at}] {result.stdout[-1500:]}{result.stderr[-1500:]}" for at, result in enumerate(results)))
    return results


#: how a forked child runs and ends, shared by :data:`_LAUNCHER` and :data:`_FORK_SERVER`: as a real
#: interpreter does (its exit code from ``SystemExit``, whose message goes to stderr; non-daemon
#: threads joined and threading's exit hooks run, then ``atexit``'s), then ``os._exit``, so that
#: nothing of the parent's (its pytest, its buffers) runs again in the child
_ENDING = """
import atexit, threading, traceback

def exit_code(exc):
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1

def run_as_main(prepare, script, name):
    # prepare() the child's descriptors and environment, then the script as __main__: whatever
    # either raises ends the child as an interpreter ends, never runs on in the parent's loop
    code = 1
    try:
        prepare()
        exec(compile(script, name, "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException:
        traceback.print_exc()
    finally:
        end(code)

def end(code):
    try:
        shutdown = getattr(threading, "_shutdown", None)  # CPython's: private, hence looked up
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    except SystemExit as exc:
        code = exit_code(exc)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
"""


#: the parent of :func:`fork_together`'s ranks: runs the prelude once, forks a rank per entry of
#: the spec (its argv, environment and output files), prints their exit codes (-9: SIGKILL)
_LAUNCHER = """
import json, os, sys, traceback
""" + _ENDING + """
spec = json.loads(sys.stdin.read())
exec(compile(spec["prelude"], "<prelude>", "exec"), {"__name__": "__prelude__"})
threads = len(os.listdir("/proc/self/task"))
if threads != 1:
    raise RuntimeError(f"the prelude left {threads} threads running: a forked rank could wait forever on a lock "
                       "one of them held")
children = []
for rank in spec["ranks"]:
    pid = os.fork()
    if pid == 0:
        def prepare():
            for fd, path in ((1, rank["out"]), (2, rank["err"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
            sys.stdout.reconfigure(line_buffering=True)  # what a rank killed for hanging printed is shown
            sys.argv = ["-c", *rank["argv"]]
            os.environ.clear()
            os.environ.update(rank["env"])
        run_as_main(prepare, spec["body"], "<rank>")
    children.append(pid)
print(json.dumps([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]), flush=True)
"""


def fork_together(prelude: str, body: str, argvs: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], *,
                  timeout: float) -> list[subprocess.CompletedProcess[str]]:
    """Like :func:`run_together` for ranks that all run the Python ``body`` (each with its
    ``sys.argv[1:]`` and environment), forked from one interpreter that ran ``prelude`` (the
    imports they share) once: a fork starts in milliseconds, an interpreter importing
    weightstore, torch or jax takes seconds of CPU on a loaded machine.

    Forking is safe only from a process of one thread (a child forked while another held a lock
    would wait for it forever): the prelude must start none (importing numpy, weightstore, torch
    or jax starts none once OpenBLAS is told to run no pool, which the launcher's environment
    does), and the launcher checks it. What every rank's environment holds alike is the
    launcher's, so the prelude's imports see it. The launcher and its ranks are one process
    group, killed whole if they do not all finish within ``timeout`` seconds; the test then
    fails with each rank's last output."""
    with contextlib.ExitStack() as stack:
        files = [[stack.enter_context(tempfile.NamedTemporaryFile("w+")) for _ in range(2)] for _ in argvs]
        shared = {key: value for key, value in envs[0].items() if all(env.get(key) == value for env in envs)}
        spec = {"prelude": prelude, "body": body,
                "ranks": [{"argv": list(argv), "env": dict(env), "out": out.name, "err": err.name}
                          for argv, env, (out, err) in zip(argvs, envs, files, strict=True)]}
        launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, start_new_session=True,
                                    env={**shared, "OPENBLAS_NUM_THREADS": "1"})
        try:
            codes, errors = launcher.communicate(json.dumps(spec), timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            codes, errors = launcher.communicate()
        finally:  # pytest's own timeout, Ctrl-C, or a launcher that died with ranks forked: none outlives the test
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
        results = []
        for argv, (out, err) in zip(argvs, files, strict=True):
            out.seek(0)
            err.seek(0)
            results.append(subprocess.CompletedProcess(list(argv), None, out.read(), err.read()))
    if launcher.returncode != 0:
        pytest.fail(f"the ranks did not finish within {timeout} s or their launcher failed:\n{errors[-3000:]}\n" +
                    "\n".join(f"[{at}] {result.stdout[-1500:]}{result.stderr[-1500:]}" for at, result in enumerate(results)))
    for result, code in zip(results, json.loads(codes), strict=True):
        result.returncode = code
    return results


#: the parent of :class:`ForkServer`'s children: runs its imports once (TensorFlow and Keras:
#: 5-6 CPU-s on a loaded machine, most of what a fresh interpreter of such a test spends), then
#: runs each request (a line: the script, its argv, folder, environment, output files and time
#: limit) in a child forked from it, printing which child ended (its stderr file) and its exit
#: code (-9: SIGKILL, -14: past its time limit). Forking is safe only while this process runs one thread (a child forked while
#: another thread held a lock, the allocator's or the import lock, would wait for it forever):
#: numpy's OpenBLAS pool is told to start none (``OPENBLAS_NUM_THREADS=1``), TensorFlow starts its
#: pools on the first op and Keras its own on the first model, which only the children run, and
#: each fork checks it is so. A child reads its environment as a fresh interpreter would:
#: ``os.environ`` is the request's, and ``tempfile`` looks at ``TMPDIR`` again (TensorFlow's
#: import cached ``/tmp``).
_FORK_SERVER = """
import json, os, signal, sys, tempfile, traceback
""" + _ENDING + """
exec(compile(sys.argv[1], "<imports>", "exec"), {"__name__": "__imports__"})
for line in iter(sys.stdin.buffer.raw.readline, b""):  # unbuffered: a child inherits no read-ahead request
    request = json.loads(line)
    if len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError(f"{len(os.listdir('/proc/self/task'))} threads: a forked child could hang on a lock")
    child = os.fork()
    if not child:
        def prepare():
            signal.alarm(request["timeout"])
            for fd, path, flags in ((1, request["out"], os.O_WRONLY), (2, request["err"], os.O_WRONLY),
                                    (0, request["in"], os.O_RDONLY)):  # in this order: the FIFOs' other ends
                os.dup2(os.open(path, flags), fd)
            sys.stdin = open(0, closefd=False)  # the request's input, not the server's stdin object
            os.chdir(request["cwd"])
            if request["env"] is not None:
                os.environ.clear()
                os.environ.update(request["env"])
            tempfile.tempdir = None
            sys.argv = ["-c", *request["argv"]]
        run_as_main(prepare, request["script"], request["name"])
    print(json.dumps([request["err"], os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])]), flush=True)
"""


class ForkServer:
    """Runs Python scripts each in a process of its own, forked from one that ran ``imports``
    (:data:`_FORK_SERVER`): a test whose subject is a process (its first model, its first assign,
    its memory, a program run as pasted, a crash) without an interpreter's start and imports per
    process. ``env`` is added to the caller's environment for the server (and so for a child given
    none of its own). The server runs in a session of its own: :meth:`close` stops it and any child."""

    def __init__(self, folder: str | os.PathLike[str], imports: str, env: Mapping[str, str] | None = None) -> None:
        self._folder = folder
        self._root = root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        self._env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}
        self._log = open(os.path.join(folder, "server.stderr"), "w+")  # noqa: SIM115 - closed by close()
        self._ended: dict[str, int] = {}  # exit codes of the children that ended, by their stderr file
        self._server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER, imports], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, text=True, env=self._env,
                                        cwd=root, start_new_session=True)

    def run(self, script: str, *argv: str, cwd: str | os.PathLike[str] | None = None,
            env: Mapping[str, str] | None = None, timeout: int = 170,
            name: str = "<forked>") -> subprocess.CompletedProcess[str]:
        """``script`` run as ``__main__`` with ``sys.argv[1:] == argv`` in ``cwd`` (the server's,
        the repository root, if None) and ``env`` (the server's if None), its standard input
        empty, ended by SIGALRM after ``timeout`` seconds (before pytest's own timeout): its exit
        code and output, as ``subprocess.run`` gives them."""
        return self.start(script, *argv, cwd=cwd, env=env, timeout=timeout, name=name)()

    def start(self, script: str, *argv: str, cwd: str | os.PathLike[str] | None = None,
              env: Mapping[str, str] | None = None, timeout: int = 170, name: str = "<forked>",
              stdin: str | os.PathLike[str] | None = None,
              stdout: str | os.PathLike[str] | None = None) -> Callable[[], subprocess.CompletedProcess[str]]:
        """:meth:`run` without waiting: the call that waits for it. To talk with the child while it
        runs, ``stdin`` and ``stdout`` name FIFOs it opens in that order (open their other ends
        in the same order); its ``stdout`` is then not returned."""
        out, err = stdout or self._new_file(), self._new_file()
        request = {"script": script, "argv": list(argv), "cwd": os.fspath(cwd or self._root),
                   "env": None if env is None else dict(env), "in": os.fspath(stdin or os.devnull),
                   "out": os.fspath(out), "err": err, "timeout": timeout, "name": name}
        assert self._server.stdin and self._server.stdout
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()

        def wait() -> subprocess.CompletedProcess[str]:
            assert self._server.stdout
            while err not in self._ended:  # a child's end read while waiting for another's is kept for it
                line = self._server.stdout.readline()
                if not line:
                    self._log.seek(0)
                    pytest.fail(f"the forking process ended: {self._log.read()[-3000:]}")
                ended, code = json.loads(line)
                self._ended[ended] = code
            code = self._ended.pop(err)
            printed = "" if stdout else Path(out).read_text()
            return subprocess.CompletedProcess([name, *argv], code, printed, Path(err).read_text())

        return wait

    def _new_file(self) -> str:
        made, path = tempfile.mkstemp(dir=self._folder)
        os.close(made)
        return path

    def close(self) -> None:
        try:
            if self._server.stdin:
                self._server.stdin.close()
            self._server.wait(60)
        finally:
            with contextlib.suppress(ProcessLookupError):  # both already gone: nothing to stop
                os.killpg(self._server.pid, signal.SIGKILL)
            self._log.close()


#: the worker's :func:`run_forked` server, started on first use
_plain: list[ForkServer] = []


def run_forked(script: str, *argv: str, env: Mapping[str, str] | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``script`` in a process of its own (:meth:`ForkServer.run`), forked from one this worker
    started once that imported numpy, h5py, s3fs and weightstore: a test of what one process does
    (a SIGKILL at a stage, a crash, a resource limit) without an interpreter's start and imports
    (0.5-1.5 CPU-s) each. ``env`` None: the worker's environment when the server started."""
    if not _plain:
        folder = tempfile.mkdtemp(prefix="forked-")
        _plain.append(ForkServer(folder, "import importlib.util, numpy, h5py, weightstore, weightstore.formats.hdf5\n"
                                         "if importlib.util.find_spec('s3fs'):\n    import s3fs"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        atexit.register(_plain[0].close)  # first: run last to first
    return _plain[0].run(script, *argv, env=env, timeout=max(1, math.ceil(timeout)))
