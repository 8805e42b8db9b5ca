"""Letting a background publish finish at interpreter exit, while the thread pools still take work.

A trainer that returns (or calls ``sys.exit``) while a background publish is being written
expects that publish to finish: its thread is no daemon, and the interpreter joins such threads
before it exits. But it first runs the hooks registered with ``threading._register_atexit``,
and ``concurrent.futures`` registers one that makes every ``ThreadPoolExecutor`` refuse new
work ("cannot schedule new futures after interpreter shutdown"). A publish reaching a pool
after that (weightstore's writeback thread, asyncio's resolver under s3fs) failed, and the
final version was lost with the process. So :func:`finish_before_exit` registers the futures
whose work must end before that hook runs (a pool's job, or the future a publishing thread
completes as its loop ends): this module's own hook, registered after ``concurrent.futures``'s,
runs before it (the hooks run in reverse order) and waits for them. It waits on the futures,
never joins a thread: on CPython 3.11 an interrupted ``Thread.join`` marks the thread, still
running, as stopped, and the interpreter then no longer joins it and stops it mid-write. Where
Python has no such hook (not CPython 3.9+), the interpreter joins the threads as before.

**Ctrl-C ends the wait.** A user who interrupts that wait (a publish retrying through an outage
waits ``retry_for`` at most) means to stop: each piece of work's ``give_up`` is called (a
background publisher logs what it leaves unpublished and retries no more), and the exit waits
again, for a write already under way to end as it would, so the folder keeps it whole. A
second Ctrl-C ends this wait too, but the interpreter still joins the publishing thread (no
daemon), whose write then gets only as far as the stopped thread pools let it. No traceback of
this module's either way.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # registers its exit hook now, so that this module's runs first
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeAlias

from weightstore.core._forks import in_child

__all__ = ["finish_before_exit"]

_Work: TypeAlias = concurrent.futures.Future[Any]
_Say: TypeAlias = Callable[[], None] | None
#: each piece of work waited for at exit, with what stops it early when the wait is interrupted
#: and what says why the process does not end yet
_waited: dict[_Work, tuple[_Say, _Say]] = {}
_waited_lock = threading.Lock()


def finish_before_exit(work: _Work, give_up: _Say = None, waiting: _Say = None) -> None:
    """Have the interpreter, at exit, wait for ``work`` (a pool's job, or a future that a thread
    completes when done) before the thread pools stop taking work, so what ``work`` still submits
    to one runs. ``give_up`` is called, on the exiting thread, if that wait is interrupted (Ctrl-C);
    ``waiting`` once as the wait begins, where ``work`` is not done: a process that does not end
    when its script does (a publish retrying through an outage) says why, and how to end it."""
    with _waited_lock:
        _waited[work] = (give_up, waiting)
    work.add_done_callback(_forget)


def _forget(work: _Work) -> None:
    with _waited_lock:
        _waited.pop(work, None)


def _wait() -> None:
    """Wait until every piece of work registered, including any registered meanwhile, is done."""
    while True:
        with _waited_lock:
            if not _waited:
                return
            waited = list(_waited)
        done, _ = concurrent.futures.wait(waited)
        with _waited_lock:  # its _forget may not have run yet
            for work in done:
                _waited.pop(work, None)


def _wait_for_all() -> None:
    try:
        with _waited_lock:
            said = [waiting for work, (_, waiting) in _waited.items() if waiting is not None and not work.done()]
        for waiting in said:
            waiting()
        _wait()
    except KeyboardInterrupt:
        with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C, even while giving up: wait no more
            with _waited_lock:
                left = [give_up for give_up, _ in _waited.values()]
            for give_up in left:
                if give_up is not None:
                    give_up()
            _wait()


def _forget_all_in_child() -> None:
    """A forked child has none of its parent's threads, and none of their work will finish in
    it: waiting for it at exit would hang the child forever. Its lock may have been held by a
    parent thread at the fork, so it is made anew."""
    global _waited_lock
    _waited.clear()
    _waited_lock = threading.Lock()


in_child(_forget_all_in_child)

_register = getattr(threading, "_register_atexit", None)  # CPython 3.9+; private, hence looked up
if _register is not None:
    _register(_wait_for_all)
