"""Publish from a training loop without waiting for the write, and without ever failing it.

:class:`BackgroundPublisher` hands each publish to one thread of its own and returns at once,
so the training thread is held only for as long as it takes to give it the weights (numpy
arrays, or framework tensors converted on the publishing thread as each is written:
``weightstore.adapters.serving.snapshot`` takes such tensors from a TF model without copying).

**At most one publish pending.** One publish is written at a time; a publish asked for while
one is being written waits as the *pending* one, and a newer publish replaces a pending one
(its future is cancelled): what a follower wants is the newest weights, and the memory held is
bounded by two snapshots however slow the folder is. ``publish`` never waits for the write.

**Below the trainer's priority.** The publishing thread runs :data:`NICENESS` steps below the
process (Linux, where a thread has a priority of its own), and its checksums and hashes stay on
it rather than on the shared helper thread: the trainer's threads get the cores first, and a
publish in ``fit`` costs training less than the CPU it spends. A thread a publish starts (the
process's first writeback or S3 thread, when a background publish is the first to need one)
inherits that priority. A full version (no ``delta``) whose every tensor's CRC-32 differs from
the last one's (a trainer's, each weight moved) is written without content digests, which no
follower could match (:class:`~weightstore.store._save.DigestsSince`): hashing was a third of
a publish's CPU.

**A copy of the weights never costs the run it copies.** A publish that fails is never raised
into the caller. A storage failure (:class:`StorageError`, an ``OSError``: an outage, a full
disk) is retried with exponential backoff (``retry_backoff`` seconds, doubling up to
``max_backoff``) for up to ``retry_for`` seconds; a newer snapshot arriving meanwhile is
written instead. A refusal that stays until someone acts (``StorageError.transient`` False:
credentials refused, a bucket that does not exist, a host name that names no host) is retried
only once this publisher has reached the folder (a version written: then, as ``follow``
reasons, it is more often one that passes, an expired token renewed); before that, the
snapshot is given up at once and the next one tries again, after the storage's pause (the
credentials may have been fixed). Any other failure (a step that does not go forward, weights
no format takes) is not retried. Every failure is logged (the ``weightstore`` logger) and counted
(:attr:`~BackgroundPublisher.failures`, :attr:`~BackgroundPublisher.last_error`), and so is the
first version written after storage failures (the storage answers again); its future
raises it for a caller who asks (``future.result()``). The snapshot being retried is held
until it is written or given up, so a retry writes the same weights.

**The end.** :meth:`~BackgroundPublisher.wait` and :meth:`~BackgroundPublisher.close` wait (at
most ``timeout`` seconds) for everything asked for, then return the last version published and
log what is still pending. The publishing thread is not a daemon: a process that exits while a
publish is being written or still retrying (a trainer that finished during an outage, or never
called ``close``) lets it finish first, ``retry_for`` at most, so the final weights still arrive
once storage is back; it is waited for before the interpreter's thread pools stop taking work
(:mod:`weightstore.core._exiting`), which the write still needs. Ctrl-C during that wait gives
up: what is still unpublished is logged and no longer retried, and the exit waits on for a write
under way to end as it would (the publishing thread is no daemon: the interpreter joins it
anyway; a third Ctrl-C ends the process). A process killed mid-write leaves the folder as a
killed :func:`weightstore.publish` does.

**A forked child** (a data loader's worker) has none of its parent's threads, and the locks
they held may stay held: there, each publisher starts afresh as a new one of the same folder
and options would (no pending snapshot, no last version, its own thread on its first publish;
a delta publisher's memory of the last version dropped, so the child's first version is read
against the folder). What the parent had pending is the parent's to write; the futures it
handed out before the fork never complete in the child.

Example::

    with ws.BackgroundPublisher("runs/a", keep=3) as publisher:
        for step in range(1, 1001):
            train_step()
            if step % 100 == 0:
                publisher.publish(weights(), step=step)
    print(publisher.last, publisher.failures)  # the last version published, and how many failed
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import logging
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightstore.core import _parallel as parallel
from weightstore.core._exiting import finish_before_exit
from weightstore.core._forks import in_child
from weightstore.core.limits import MAX_POINTER_BYTES
from weightstore.errors import PublishError, StorageError, WeightStoreError, WriteError
from weightstore.formats._pointer import LATEST
from weightstore.io.location import connection_failure, location_of, service_answer
from weightstore.store._save import DigestsSince, checked_metadata
from weightstore.sync._checks import checked_format, checked_keep, checked_seconds, checked_step
from weightstore.sync._defaults import DEFAULT_FORMAT, DEFAULT_KEEP
from weightstore.sync._delta import Delta, as_delta
from weightstore.sync._folder import versions_folder
from weightstore.sync._pinning import Version, pointer_version
from weightstore.sync._publish import PublishOptions, publish_digested
from weightstore.sync._writers import published_here, written_here

__all__ = ["BackgroundPublisher", "PublishFuture"]

#: how long a failing snapshot is retried, and the first and longest pause between attempts
DEFAULT_RETRY_FOR = 600.0
DEFAULT_RETRY_BACKOFF = 0.5
DEFAULT_MAX_BACKOFF = 30.0
#: how far below the process the publishing thread runs (nice steps, where threads have their own:
#: Linux): the trainer's threads get a core first and the publish takes what they leave, so a
#: background publish costs training less than the CPU it spends
NICENESS = 10
_log = logging.getLogger("weightstore")
#: the errors of a write that may pass: space or quota freed, a device or service back; an OSError
#: with none (``None``) is a storage library's, as every one was taken to be
_PASSING_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EAGAIN, errno.EBUSY, errno.EINTR,
                             errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, None})


class PublishFuture(concurrent.futures.Future):
    """One background publish: ``result()`` waits for it and returns its :class:`Version`, or
    raises its error; cancelled where a newer publish replaced it before it was written."""


@dataclass
class _Job:
    """A snapshot to publish: what the caller handed over, and the future it was given."""

    weights: Mapping[str, Any]
    step: int
    metadata: dict[str, Any]
    future: PublishFuture


class BackgroundPublisher:
    """Publish versions of ``folder`` on a background thread: one written, one pending at most.

    The options are those of :func:`weightstore.publish`; ``metadata`` is merged under each
    publish's own. ``retry_for``, ``retry_backoff`` and ``max_backoff`` bound the retries of a
    storage failure (see the module). ``delta=True`` writes delta versions through one
    :class:`~weightstore.Delta` kept for the publisher's life, which holds a copy of the last
    version published (1x the model's memory, on the publishing thread). A context manager: leaving the block waits like
    :meth:`close`. Call it from one thread (the training loop).
    """

    def __init__(
        self,
        folder: Any,
        *,
        keep: int | None = DEFAULT_KEEP,
        metadata: Mapping[str, Any] | None = None,
        format: str = DEFAULT_FORMAT,  # noqa: A002
        storage_options: Mapping[str, Any] | None = None,
        retry_for: float = DEFAULT_RETRY_FOR,
        retry_backoff: float = DEFAULT_RETRY_BACKOFF,
        max_backoff: float = DEFAULT_MAX_BACKOFF,
        delta: bool | Delta = False,
    ):
        keep = checked_keep(keep)
        checked_format(format)  # an unknown format fails here, not on the first background publish
        #: the folder as its errors name it (a folder that is no path, None or a file object, fails here too)
        self._where = location_of(folder, reading=False).text.rstrip("/")
        self.folder = folder
        self.metadata = checked_metadata(metadata, str(folder))
        self.retry_for = checked_seconds("retry_for", retry_for)
        self.retry_backoff = max(checked_seconds("retry_backoff", retry_backoff), 0.001)
        self.max_backoff = max(checked_seconds("max_backoff", max_backoff), self.retry_backoff)
        self._options = PublishOptions(keep=keep, format=format, storage_options=storage_options)
        #: one for the publisher's life: it keeps the last version published, the next delta's base
        self._delta: Delta | None = Delta() if delta is True else as_delta(delta)
        self._closed = False
        self._start_afresh()
        _publishers.add(self)

    def _start_afresh(self) -> None:
        """The state of a publisher that has published nothing: at its making, and in a forked
        child (whose copy of the parent's may name a thread and hold a lock that are not there)."""
        self._changed = threading.Condition()
        self._pending: _Job | None = None
        self._writing: _Job | None = None
        self._thread: threading.Thread | None = None
        self._given_up = False  # interrupted at exit: no retry, nothing pending written
        #: a trainer's versions, each tensor changed since the last, are written without digests
        self._digests = DigestsSince()
        self._exit_said: bool | None = None  # at exit: whether its wait for the retries was said; None: not exiting
        self._failing = False  # whether the snapshot being written has failed an attempt (is retrying)
        #: when the storage began failing this publisher (whichever snapshot), until a version is written again
        self._storage_failing_since: float | None = None
        #: while the storage fails: the pause before the next attempt, whichever snapshot it writes
        self._pause = self.retry_backoff
        self._resume_at = 0.0
        #: whether the folder ever answered this publisher (a version written): until it has, a
        #: refusal that stays (``StorageError.transient`` False) gives a snapshot up at once
        self._answered = False
        self.last: Version | None = None
        """The last version this publisher completed."""
        self.failures = 0
        """How many publish attempts failed (each retry counts)."""
        self.last_error: BaseException | None = None
        """The error of the last failed attempt, or ``None``."""

    def _forked(self) -> None:
        """In a forked child: start afresh; a delta publisher's memory (which the parent's thread
        may have been changing at the fork) is dropped for a new one of the same options."""
        if self._delta is not None:
            self._delta = Delta(anchor_every=self._delta.anchor_every, remember=self._delta.remember)
        self._start_afresh()

    def publish(self, weights: Mapping[str, Any], *, step: int,
                metadata: Mapping[str, Any] | None = None) -> PublishFuture:
        """Hand ``weights`` over as version ``step`` and return at once; never raises a publish's failure.

        ``weights`` must not change until the returned future is done: the caller hands over
        arrays it will not write to, or tensors whose framework copies on write (a TF snapshot).
        Raises only for the call itself: a closed publisher, a step that is no int.
        """
        if self._closed:
            raise PublishError("this BackgroundPublisher is closed", path=str(self.folder))
        step = checked_step(step)  # here, not on the thread: a bad step must not cost the next publish
        future = PublishFuture()
        job = _Job(weights, step, {**self.metadata, **dict(metadata or {})}, future)
        with self._changed:
            replaced, self._pending = self._pending, job
            if self._thread is None or not self._thread.is_alive():
                # never a daemon, whichever thread asked: a process exiting mid-retry lets it finish
                done: concurrent.futures.Future[None] = concurrent.futures.Future()
                self._thread = threading.Thread(target=self._run, args=(done,), daemon=False,
                                                name=f"weightstore-publish-{self.folder}")
                self._thread.start()
                finish_before_exit(done, self._give_up, self._exit_begins)
            self._changed.notify_all()
        if replaced is not None:
            replaced.future.cancel()
        return future

    @property
    def busy(self) -> bool:
        """Whether a publish is being written or waits to be."""
        with self._changed:
            return self._writing is not None or self._pending is not None

    def wait(self, timeout: float | None = None) -> Version | None:
        """Wait up to ``timeout`` seconds (``None``: until done) for every publish asked for;
        return the last version published. Logs what is still pending when time runs out."""
        deadline = None if timeout is None else time.monotonic() + checked_seconds("timeout", timeout)
        with self._changed:
            while self._writing is not None or self._pending is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._log_unfinished()
                    break
                self._changed.wait(left)
            return self.last

    def close(self, timeout: float | None = None) -> Version | None:
        """Refuse further publishes, then :meth:`wait`."""
        self._closed = True
        return self.wait(timeout)

    def __enter__(self) -> BackgroundPublisher:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, traceback: object) -> None:
        self.close()

    def _run(self, done: concurrent.futures.Future[None]) -> None:
        """The publishing thread: write the pending job, retrying storage failures; exit when idle,
        completing ``done``, which the interpreter's exit waits on (:mod:`weightstore.core._exiting`).

        A job's future is resolved once the job is no longer the one being written, so a
        callback on it (run on this thread) may call :meth:`wait` without waiting for itself.
        The thread runs below the process's priority (:func:`_below_training`), and its hashing
        and checksums stay on it (:func:`weightstore.core._parallel.alone`)."""
        try:
            _below_training()
            with parallel.alone():
                self._serve()
        finally:
            done.set_result(None)

    def _serve(self) -> None:
        while True:
            with self._changed:
                job, self._pending = self._pending, None
                self._writing = job
                if job is None:
                    self._thread = None
                    self._changed.notify_all()
                    return
            outcome: Version | BaseException | None = None
            try:
                if job.future.set_running_or_notify_cancel():
                    outcome = self._write(job)
            except BaseException as error:  # never a thread that dies holding _writing
                outcome = error
            finally:
                with self._changed:
                    self._writing = None
                    self._changed.notify_all()
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            elif outcome is not None:
                job.future.set_result(outcome)
            # the snapshot let go: a failed attempt's traceback (last_error, the future's error)
            # reaches _write's frame, and so this job, until the next failure replaces it
            job.weights = {}

    def _write(self, job: _Job) -> Version | BaseException:
        """Publish ``job``, retrying while storage fails, until done, given up or replaced: the
        version published, or the error that ended it. A retry first asks whether the attempt
        that failed published all the same (its error came after ``LATEST`` moved, or a timed-out
        swap that the storage had applied: ``LATEST`` names this process's version of its step):
        then that version is the outcome. The backoff is the
        storage's, not the snapshot's: a newer snapshot replacing one that failed waits out the
        rest of the pause, which doubles on, so a trainer handing over a snapshot every second
        does not try the failing storage every second."""
        failing_since: float | None = None
        self._failing = False
        while True:
            paused = self._resume_at - time.monotonic()
            newer = self._replaced_within(paused) if paused > 0 else None
            if self._given_up:
                return StorageError(f"step {job.step} was not published: the process was interrupted at exit "
                                    f"({self._said(self.last_error)})", path=str(self.folder))
            if newer is not None:  # the storage still failing: the newer snapshot is written instead
                return StorageError(f"step {job.step} was not published: the newer snapshot of step {newer.step} "
                                    f"replaced it while the storage was failing ({self._said(self.last_error)})",
                                    path=str(self.folder))
            attempted = time.monotonic()
            try:
                version = publish_digested(self.folder, job.weights, step=job.step, metadata=job.metadata,
                                           delta=self._delta or False, digests=self._digests, **self._options)
            except BaseException as error:  # counted and handed to the future, never to the trainer
                failing_since = time.monotonic() if failing_since is None else failing_since
                self._failing = True
                published = self._published_anyway(job)
                if published is not None:
                    return self._written(published)
                if _retryable(error):  # the storage's pause: a newer snapshot waits it out as well
                    self._resume_at = time.monotonic() + self._pause
                    self._pause = min(self._pause * 2, self.max_backoff)
                    if self._storage_failing_since is None:  # the attempt's start: a client's own retries
                        self._storage_failing_since = attempted  # (botocore's) may hide the first 20 s
                if not self._failed(job, error, time.monotonic() - failing_since):
                    return error
                continue
            self._pause, self._resume_at = self.retry_backoff, 0.0
            return self._written(version)

    def _written(self, version: Version) -> Version:
        """Record ``version`` as the last published; after storage failures, log that it answers
        again, once, as the first failure was logged: without it a log ends on "retrying"."""
        self.last, self._answered = version, True
        if self._storage_failing_since is not None:
            _log.warning("published step %d to %s: the storage answers again, after %.0f s of failures",
                         version.step, self.folder, time.monotonic() - self._storage_failing_since)
            self._storage_failing_since = None
        return version

    def _published_anyway(self, job: _Job) -> Version | None:
        """The version ``LATEST`` names, where this process wrote it at ``job``'s step (a failure
        after the swap); never another process's of that step (one that took the folder over, or
        won the race), whose weights are not this snapshot's."""
        try:
            folder = versions_folder(self.folder, self._options["storage_options"])
            pointer = folder.read_small(LATEST, MAX_POINTER_BYTES + 1)
            current = pointer_version(folder, pointer)
        except (WeightStoreError, OSError):
            return None
        if current is None or pointer is None or current.step != job.step or not written_here(pointer):
            return None
        published_here(folder, current.step)  # as the publish would have: a later take-over is one
        return current

    def _failed(self, job: _Job, error: BaseException, spent: float) -> bool:
        """Count and log a failed attempt; whether to try again."""
        self.failures += 1
        self.last_error = _without_locals(error)
        refused = isinstance(error, StorageError) and not error.transient and not self._answered
        retry = _retryable(error) and not refused and spent < self.retry_for and not self._given_up
        if retry:
            _log.warning("publishing step %d to %s failed (%s); retrying", job.step, self.folder, self._said(error))
            self._say_exit_waits()
        elif refused:
            _log.error("publishing step %d to %s was refused before the folder ever answered: %s; given up, the next "
                       "snapshot tries again", job.step, self.folder, self._said(error))
        else:
            _log.error("publishing step %d to %s failed%s: %s; the last version published is %s", job.step,
                       self.folder, " for good" if not _retryable(error) else f" for {spent:.0f} s, given up",
                       self._said(error), self.last.step if self.last else "none")
        return retry

    def _said(self, error: BaseException | None) -> object:
        """``error`` as a line that names this folder already says it: without the folder again
        ("publishing step 2 to s3://b/run failed (storage failed (...))", not "(s3://b/run: ...)");
        the error itself where it names another file, for the log record to carry."""
        if isinstance(error, WeightStoreError) and error.key is None and (error.path or "").rstrip("/") == self._where:
            return error.message
        return "" if error is None else error

    def _replaced_within(self, seconds: float) -> _Job | None:
        """Sleep ``seconds``, or less where a newer snapshot arrives: the one that did, if one did."""
        with self._changed:
            self._changed.wait_for(lambda: self._pending is not None or self._given_up, seconds)
            return self._pending

    def _give_up(self) -> None:
        """At exit, when the wait for this publisher was interrupted: log what stays unpublished,
        drop the pending snapshot and end the retries (the exit still waits for a write under way)."""
        with self._changed:
            newest = self._pending or self._writing
            if newest is not None and newest is self._writing and not self._failing:
                _log.warning("interrupted at exit: step %d is still being written to %s; the process ends once it "
                             "is written%s", newest.step, self.folder,
                             f" (the newer step {self._pending.step} is not published)" if self._pending else "")
            elif newest is not None:
                _log.warning("interrupted at exit: step %d is not published to %s (%s); the last version published "
                             "is %s", newest.step, self.folder, self._said(self.last_error) or "not written yet",
                             self.last.step if self.last else "none")
            self._given_up = True
            dropped, self._pending = self._pending, None
            self._changed.notify_all()
        if dropped is not None:
            dropped.future.cancel()

    def _exit_begins(self) -> None:
        """The process's exit begins to wait for this publisher (:func:`finish_before_exit`)."""
        self._exit_said = False
        self._say_exit_waits()

    def _say_exit_waits(self) -> None:
        """Once the exit waits for this publisher and the storage fails (then, or at a retry
        after): say that the process waits for the retries and how to end it. A script that
        returned, or a ``fit`` that Ctrl-C stopped, otherwise looks hung, its log on "retrying"."""
        with self._changed:
            newest = self._pending or self._writing
            if self._exit_said is not False or newest is None or self._storage_failing_since is None:
                return
            self._exit_said = True
            _log.warning("the process waits at exit while publishing step %d to %s is retried (the storage failing "
                         "for %.0f s; given up after retry_for=%.0f s of failures); Ctrl-C gives it up now",
                         newest.step, self.folder, time.monotonic() - self._storage_failing_since, self.retry_for)

    def _log_unfinished(self) -> None:
        """Say what is still unpublished and why: the storage's error only while it still fails
        (``last_error`` stays after an outage ends), else which step is being written."""
        newest, writing = self._pending or self._writing, self._writing
        if newest is None:
            return
        if self._storage_failing_since is not None and self.last_error is not None:
            why = str(self._said(self.last_error))
        elif writing is None or writing is newest:
            why = "still being written"
        else:
            why = f"waiting for step {writing.step}, still being written"
        _log.warning("step %d is not published to %s yet (%s); the last version published is %s; it goes on "
                     "in the background for up to %.0f s", newest.step, self.folder, why,
                     self.last.step if self.last else "none", self.retry_for)


#: every publisher of this process, to start afresh in a forked child
_publishers: weakref.WeakSet[BackgroundPublisher] = weakref.WeakSet()


def _forked_child() -> None:
    for publisher in list(_publishers):
        publisher._forked()


in_child(_forked_child)


def _below_training() -> None:
    """Lower the calling thread's priority by :data:`NICENESS`, where a thread has its own (Linux:
    ``setpriority`` of a thread id); elsewhere, or where it is refused, leave it."""
    if sys.platform != "linux":
        return
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + NICENESS))


def _errno_passes(error: OSError) -> bool:
    return isinstance(error.errno, (int, type(None))) and error.errno in _PASSING_ERRNOS


def _retryable(error: BaseException) -> bool:
    """A failure of the storage, which may pass (an outage, a full disk): not one of the publish
    itself (a step not forward, a folder that is a file, weights no format takes), nor a write
    the file system will refuse again (a file over its size limit, a read-only file system)."""
    if isinstance(error, WriteError):  # errno 0: none; an object store's answer (a bucket gone) or a lost
        # connection may pass, its ``transient`` deciding the rest; a local writer's failure without one stays
        return _errno_passes(error) if error.errno else \
            service_answer(error) is not None or connection_failure(error) is True
    if isinstance(error, StorageError):
        return True
    return isinstance(error, OSError) and not isinstance(error, WeightStoreError) and _errno_passes(error)


def _without_locals(error: BaseException) -> BaseException:
    """``error`` with the variables of the finished frames it passed through let go (its
    traceback's lines kept): it outlives the attempt as :attr:`BackgroundPublisher.last_error`,
    and a failed publish's frames hold its tensors and a delta's encoded payload (up to 1x the
    model each), which a publisher kept through an outage and after it."""
    pending, seen = [error], set()
    while pending:
        each = pending.pop()
        if id(each) in seen:
            continue
        seen.add(id(each))
        traceback.clear_frames(each.__traceback__)  # a frame still running (the caller's) is skipped
        pending.extend(chained for chained in (each.__cause__, each.__context__) if chained is not None)
    return error
