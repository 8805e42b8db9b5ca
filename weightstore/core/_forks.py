"""What a forked child (a data-loader worker) must not inherit from its parent: pools whose threads it lacks.

A child has none of its parent's threads. A ``ThreadPoolExecutor`` made in the parent takes
work in the child and never runs it, so whoever waits for that work (a copy, a publish, the
interpreter at exit) waits forever; and a lock a parent thread held at the fork stays held.
Every pool of the library is a :class:`Pool`, made on first use and forgotten in a child, which
makes its own when it needs one; other state is reset through :func:`in_child`.

A pool whose jobs are only advice (fetching pages ahead of a reader) drops those not started
when the interpreter exits: it would otherwise run every one before exiting, on a slow or hung
mount for minutes or forever, for a reader that is gone.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["Pool", "in_child"]

R = TypeVar("R")

#: registers a call made at exit before the interpreter joins the pools' threads (the hook
#: ``concurrent.futures`` itself exits by; the public ``atexit`` runs only after the join)
_before_join: Callable[[Callable[[], object]], object] | None = getattr(threading, "_register_atexit", None)


def in_child(reset: Callable[[], object]) -> None:
    """Call ``reset()`` in every child forked from now on (nothing where processes do not fork)."""
    if hasattr(os, "register_at_fork"):  # not on Windows
        os.register_at_fork(after_in_child=reset)


class Pool:
    """A ``ThreadPoolExecutor`` of ``threads`` threads named ``name``, made on the first
    :meth:`submit` in this process: a child forked after its parent used it makes its own.
    ``advice``: its jobs only save a later wait, and those not started are dropped at exit."""

    def __init__(self, threads: int, name: str, *, advice: bool = False):
        self._threads, self._name = threads, name
        self._forget()
        in_child(self._forget)
        if advice and _before_join is not None:
            # made as the interpreter exits (its module first imported by a thread it waits for), the hook
            # is refused: that exit is past it, and the pools take no more work (jobs run in their callers)
            with contextlib.suppress(RuntimeError):
                _before_join(self._drop_queued)

    def _drop_queued(self) -> None:
        """Cancel the jobs no thread has started (those running finish): called as the
        interpreter exits, before it joins the threads. A job handed in later runs in its caller."""
        pool = self._pool
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, job: Callable[..., R], *args: Any) -> Future[R]:
        """Hand ``job(*args)`` to the pool; jobs submitted from one thread start in that order.

        Once the main thread has returned, the interpreter's pools take no more work (a
        ``RuntimeError``) while other threads still run: a thread reading a file then runs the
        job itself, where the read raised that error."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, thread_name_prefix=self._name)
            try:
                return self._pool.submit(job, *args)
            except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
                pass
        ran: Future[R] = Future()
        try:
            ran.set_result(job(*args))
        except BaseException as exc:  # the job's own error, for whoever asks for its result
            ran.set_exception(exc)
        return ran
