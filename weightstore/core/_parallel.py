"""Splitting one piece of CPU work (a checksum, a decode) across the caller and a shared helper.

The caller and :data:`THREADS` - 1 helper threads claim numbered jobs until none is left.
The caller never waits for a helper to start: a helper still queued (another load holds it)
or slow (another process holds its core) just claims fewer jobs, and the caller does the
rest. So the work never takes longer than on the caller alone, by more than a few
microseconds, and a job may itself call :func:`for_each` without deadlock (a helper that
is busy is simply not there to help).

One pool serves the whole process, so concurrent loads add no threads. Jobs must release
the GIL for most of their time (ISA-L through ctypes, zstd, numpy), or two threads run no
faster than one.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import Generic, TypeVar

from weightstore.core._forks import Pool

R = TypeVar("R")

#: threads working on one piece of work, the caller included: all the cores of the 2-core
#: machines this was measured on; more were never measured, so never used
THREADS = min(2, os.cpu_count() or 1)


_pool = Pool(max(1, THREADS - 1), "weightstore-worker")

_thread = threading.local()


@contextlib.contextmanager
def alone() -> Iterator[None]:
    """Within the block, :func:`for_each` and :func:`beside` called on this thread run on it alone.

    For a thread that runs below the process's priority (a background publish yielding the
    cores to training): handed to the shared helper, which runs at the process's priority,
    half its work would take a core from training as before.
    """
    before = getattr(_thread, "alone", False)
    _thread.alone = True
    try:
        yield
    finally:
        _thread.alone = before


def _alone() -> bool:
    return getattr(_thread, "alone", False)


def for_each(count: int, job: Callable[[int], object]) -> None:
    """Run ``job(0)`` ... ``job(count - 1)``, each exactly once, across the caller and helpers.

    Returns once every job has finished, and no helper touches the work afterwards, so the
    buffers the jobs read and write may be released at once. The first exception a job
    raises stops the claiming of new jobs and is raised here once running ones finish.
    """
    if count <= 1 or THREADS == 1 or _alone():
        for index in range(count):
            job(index)
        return
    claims = itertools.count()  # next() on it is atomic under the GIL: every job is claimed once
    failures: list[BaseException] = []

    def claim_and_run(started: threading.Event | None) -> None:
        if started is not None:
            started.set()
        for index in claims:
            if index >= count or failures:
                return
            try:
                job(index)
            except BaseException as exc:  # handed to the caller, which raises it
                failures.append(exc)
                return

    helpers = []
    for _ in range(THREADS - 1):
        started = threading.Event()
        helpers.append((started, _pool.submit(claim_and_run, started)))
    claim_and_run(None)
    # The caller stops once every job is claimed or one failed. A helper that had not
    # started by then finds nothing left to run whenever it starts, so only the ones that
    # started (and may be running a job now) are waited for.
    for started, future in helpers:
        if started.is_set():
            future.result()
    if failures:
        raise failures[0]


def beside(job: Callable[[], R]) -> Beside[R]:
    """Start ``job`` on the shared helper, for the caller to overlap with work of its own.

    While it runs, the caller's :func:`for_each` calls find the helper busy and do their jobs
    alone, so nothing waits for it but whoever asks for its result.
    """
    return Beside(job)


class Beside(Generic[R]):
    """A job handed to the helper; :meth:`result` runs it on the caller if no helper has started it.

    As in :func:`for_each`, the caller never waits for a helper to start: on a loaded machine the
    helper thread may not get a core for milliseconds, which a save waiting on every large
    tensor's hash paid each time (a durable 256 MB safetensors save: 0.90-0.94x the time of
    waiting, interleaved A/B on a loaded machine).
    """

    def __init__(self, job: Callable[[], R]):
        self._job: Callable[[], R] | None = job
        self._future: Future[R] | None = None if _alone() else _pool.submit(self._run)

    def _run(self) -> R:
        assert self._job is not None  # cleared only once the job ran or was cancelled
        return self._job()

    def result(self) -> R:
        """The job's result. Afterwards nothing here holds the job (or the tensor it hashed),
        not even a cancelled entry still queued for a busy helper."""
        try:
            if self._future is None or self._future.cancel():
                assert self._job is not None
                return self._job()
            return self._future.result()
        finally:
            self._job = None

    def drop(self) -> None:
        """Give the job up: cancelled where no helper has started it, else waited for, its
        outcome ignored (a guess ahead of the caller's own work, which the caller does anyway)."""
        try:
            if self._future is not None and not self._future.cancel():
                wait([self._future])
        finally:
            self._job = None
