"""Letting a background publish finish at interpreter exit, while the thread pools still take work.

A trainer that returns (or calls ``sys.exit``) while a background publish is being written
expects that publish to finish: its thread is no daemon, and the interpreter joins such threads
before it exits. But it first runs the hooks registered with ``threading._register_atexit``,
and ``concurrent.futures`` registers one that makes every ``ThreadPoolExecutor`` refuse new
work ("cannot schedule new futures after interpreter shutdown"). A publish reaching a pool
after that (weightstore's writeback thread, asyncio's resolver under s3fs) failed, and the
final version was lost with the process. So :func:`finish_before_exit` registers the threads
and futures whose work must end before that hook runs: this module's own hook, registered after
``concurrent.futures``'s, runs before it (the hooks run in reverse order) and waits for them.
Where Python has no such hook (not CPython 3.9+), the threads are joined as before, pools or not.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # registers its exit hook now, so that this module's runs first
import os
import threading
from typing import Any

__all__ = ["finish_before_exit"]

_waited: set[threading.Thread | concurrent.futures.Future[Any]] = set()
_waited_lock = threading.Lock()


def finish_before_exit(work: threading.Thread | concurrent.futures.Future[Any]) -> None:
    """Have the interpreter, at exit, wait for ``work`` (a thread, or a future of a pool's job)
    before the thread pools stop taking work, so what ``work`` still submits to one runs."""
    with _waited_lock:
        _waited.difference_update([done for done in _waited if isinstance(done, threading.Thread)
                                   and not done.is_alive()])  # a publisher starts a thread per busy spell
        _waited.add(work)
    if isinstance(work, concurrent.futures.Future):
        work.add_done_callback(_forget)


def _forget(work: threading.Thread | concurrent.futures.Future[Any]) -> None:
    with _waited_lock:
        _waited.discard(work)


def _wait_for_all() -> None:
    while True:
        with _waited_lock:
            if not _waited:
                return
            work = _waited.pop()
        if isinstance(work, threading.Thread):
            if work.is_alive() and work is not threading.current_thread():
                work.join()
        else:
            concurrent.futures.wait([work])


def _forget_all_in_child() -> None:
    """A forked child has none of its parent's threads, and none of their work will finish in
    it: waiting for it at exit would hang the child forever. Its lock may have been held by a
    parent thread at the fork, so it is made anew."""
    global _waited_lock
    _waited.clear()
    _waited_lock = threading.Lock()


if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=_forget_all_in_child)

_register = getattr(threading, "_register_atexit", None)  # CPython 3.9+; private, hence looked up
if _register is not None:
    _register(_wait_for_all)
