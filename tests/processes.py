"""The processes of one job a test starts together (its ranks or workers): run at once, waited
for, and never left behind."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import IO

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a job's coordinator."""
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
