"""A TF1 assign's batches run as session callables, compiled on the helper thread while the values are verified.

A TF1 session compiles every new set of feeds and fetches into an executor the first time it
runs it (in the benchmark's graph of 2,000 ops, 8 ms and half a millisecond a variable: 38 ms
for a batch of 64), and an assign of a 256 MB model in four batches spent 0.16 s of its first
call's 0.32 s so, more than reading the file. The C API's callables (``MakeCallable``) compile a
set without running it, with the GIL released, so :func:`compile_ahead` has every batch compiled
while the verify pass reads and checks the file, and each batch runs as soon as its turn comes.

The first assign into a session starts sooner still (:func:`guess`): before its file is opened
and planned (a cold npz's directory read and the plan took 0.15-0.2 s of a 256 MB assign's
first call, while the compile of its one batch ran past the verify pass on a loaded machine),
the helper finds the batch it most likely runs and compiles it, the assign waiting only while
it finds the writers (:class:`Guess`): the compile goes on while the file is read and verified.
A set is known by its names whatever their order, so the plan may list the keys in the file's order.

A session keeps its callables for the last :data:`KEPT` sets it ran. ``session.run`` keeps an
executor for every set it ever saw, and a follower's hot reloads write another subset of the
variables each time, so that cache only grows.

The handles are the session's own (the C API's integers), held in a table on the session, so
nothing here keeps a session alive: TF's Python wrapper for callables holds its session, and a
table of those on the session would make a cycle that frees a dropped session, and all its
variables, only at the next garbage collection. A session whose graph cannot be compiled this
way, or a session of another kind (a wrapper of one, whose run may do more), gets
``session.run``, which also reports any error. A ``MonitoredSession`` comes unwrapped
(``tf1._open_session``): its own run would run the hooks too.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from weightstore.core._extras import needs
from weightstore.core._parallel import beside

with needs("tf", __name__):
    import tensorflow as tf
    from tensorflow.core.protobuf import config_pb2
    from tensorflow.python.client import pywrap_tf_session as c_api
    from tensorflow.python.client.session import BaseSession

__all__ = ["KEPT", "Guess", "compile_ahead", "guess", "run"]

#: sets of feeds and fetches a session keeps compiled: a whole assign is at most a few dozen batches
KEPT = 64

Writers = list[tuple[tf.Operation, tf.Tensor]]  # (the op to run, the tensor it is fed through)
_Signature = tuple[tuple[str, ...], tuple[str, ...]]  # (fed tensor names, op names), in the order of the names fed


def compile_ahead(sess: Any, batches: list[Writers]) -> None:
    """Start compiling each batch not yet compiled, one after the other on the shared helper."""
    table = _table(sess)
    if table is not None:
        for writers in batches:
            table.start(sess, _signature(writers)[0])


def guess(sess: Any, likely: Callable[[], Writers | None],
          then: Callable[[Writers], object] | None = None) -> Guess | None:
    """Have the helper compile the batch the first assign into ``sess`` most likely runs
    (``likely()``, asked on the helper; ``None``: no guess), where the session has compiled no set
    before (a later assign knows its batches, and a hot reload writes a subset), then call
    ``then(writers)`` there, for other work the batch will need (:func:`tf1._guess` has the
    staging session compile its run). Finding the writers took 0.03-0.08 s of a 256 MB assign's
    first call, before its file was opened; on the helper it overlaps the open, the plan and the
    verify pass. A wrong guess costs the helper's CPU, not the assign's wait: a batch whose
    compile the helper has not started compiles on the thread that needs it. Returns the
    :class:`Guess` (``None`` where none is made), for the assign to settle before it looks up a
    writer itself and to end before it returns."""
    table = _table(sess)
    if table is None or not table.empty():
        return None
    session = weakref.ref(sess)

    def found() -> Writers | None:
        sess = session()
        return likely() if sess is not None and table.empty() else None

    def compiled(writers: Writers) -> None:
        sess = session()
        if sess is not None:
            table.compile(sess, _signature(writers)[0])
            if then is not None:
                then(writers)

    return Guess(found, compiled)


class Guess:
    """The helper's guess at a first assign's batch, in two stages: finding its writers, which
    reads the graph, then compiling them, which reads only what the session holds.

    The assign waits for the first stage alone (:meth:`settle`) before it looks up a writer
    itself: no helper reads the graph while the assign might add an op to it. The compile then
    runs beside the verify pass, which reads the file meanwhile: a cold 256 MB file's read and
    the batch's compile (0.15-0.2 CPU-s, 0.3-0.7 s on a loaded machine) took turns before, and
    the first assign's wall was about their sum. The batch's run waits for its compile where it
    needs it (:class:`_Compiled`), and :meth:`end` for the rest, so no helper work outlives the
    assign. A guess no helper has started when the assign settles is dropped, not run there,
    and a failed one is ignored: it only gets ahead of work the assign does anyway.
    """

    def __init__(self, found: Callable[[], Writers | None], compiled: Callable[[Writers], None]):
        self._lock = threading.Lock()
        self._state = "waiting"  # then "finding" (on the helper), or "dropped"
        self._found = threading.Event()
        self._stages = found, compiled
        self._job = beside(self._run)

    def _run(self) -> None:
        with self._lock:
            if self._state == "dropped":
                return
            self._state = "finding"
        found, compiled = self._stages
        try:
            writers = found()
        finally:
            self._found.set()
        if writers:
            compiled(writers)

    def settle(self) -> None:
        """Return once the helper reads the graph no more: at once where it has not begun the
        guess (which it then never begins), else once it has found the writers."""
        if self._found.is_set():  # settled: each writer the assign looks up asks again
            return
        with self._lock:
            if self._state == "waiting":
                self._state = "dropped"
        if self._state == "finding":
            self._found.wait()

    def end(self) -> None:
        """Give up what is left of the guess: waited for where a helper runs it, its outcome ignored."""
        self.settle()
        self._job.drop()


def run(sess: Any, writers: Writers, feeds: list[np.ndarray]) -> None:
    """Run one batch: each op with its tensor fed the value at the same place in ``feeds``."""
    table = _table(sess)
    signature, order = _signature(writers)
    handle = table.handle(sess, signature) if table is not None else None
    if handle is None or sess._closed:  # session.run raises what is wrong
        sess.run([op for op, _ in writers], feed_dict={tensor: feed for (_, tensor), feed in zip(writers, feeds, strict=True)})
    else:
        c_api.TF_SessionRunCallable(sess._session, handle, [feeds[i] for i in order], None)


def _signature(writers: Writers) -> tuple[_Signature, list[int]]:
    """The set's signature, its writers in the order of the names fed, and that order."""
    order = sorted(range(len(writers)), key=lambda i: writers[i][1].name)
    return (tuple(writers[i][1].name for i in order), tuple(writers[i][0].name for i in order)), order


class _Table:
    """One session's callables by signature, most recently used last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: OrderedDict[_Signature, _Compiled] = OrderedDict()

    def start(self, sess: BaseSession, signature: _Signature) -> None:
        self._entry(sess, signature, ahead=True)

    def empty(self) -> bool:
        with self._lock:
            return not self._entries

    def handle(self, sess: BaseSession, signature: _Signature) -> int | None:
        return self._entry(sess, signature, ahead=False).handle()

    def compile(self, sess: BaseSession, signature: _Signature) -> None:
        """Compile the set on this thread, unless another thread compiles, or has compiled, it."""
        self.handle(sess, signature)

    def _entry(self, sess: BaseSession, signature: _Signature, *, ahead: bool) -> _Compiled:
        with self._lock:
            entry = self._entries.get(signature)
            if entry is None:
                session = weakref.ref(sess)  # a job never keeps the session alive
                entry = self._entries[signature] = _Compiled(lambda: _compile(session(), signature), ahead=ahead)
            self._entries.move_to_end(signature)
            forgotten = [self._entries.popitem(last=False)[1] for _ in range(len(self._entries) - KEPT)]
        for old in forgotten:
            old.release(sess)
        return entry


class _Compiled:
    """One set's callable: compiled on the helper (``ahead``) or by the first thread asking for it."""

    def __init__(self, make: Callable[[], int | None], *, ahead: bool):
        self._lock = threading.Lock()
        self._make: Callable[[], int | None] | None = make
        self._job = beside(make) if ahead else None
        self._handle: int | None = None

    def handle(self) -> int | None:
        """The handle (``None``: run the set with ``session.run``); compiled here if no helper has started it."""
        with self._lock:
            if self._make is not None:
                self._handle = self._job.result() if self._job is not None else self._make()
                self._make = self._job = None
            return self._handle

    def release(self, sess: BaseSession) -> None:
        handle = self.handle()
        if handle is not None and not sess._closed:
            c_api.TF_SessionReleaseCallable(sess._session, handle)


def _table(sess: Any) -> _Table | None:
    if not isinstance(sess, BaseSession):
        return None
    with _tables_lock:
        table = getattr(sess, "_weightstore_callables", None)
        if table is None:
            table = sess._weightstore_callables = _Table()
    return table


_tables_lock = threading.Lock()


def _compile(sess: BaseSession | None, signature: _Signature) -> int | None:
    """A callable handle for the set, or ``None`` where the session cannot make one (or is gone)."""
    if sess is None or sess._closed:
        return None
    fed, ops = signature
    options = c_api.TF_NewBufferFromString(config_pb2.CallableOptions(feed=fed, target=ops).SerializeToString())
    try:
        sess._extend_graph()
        return c_api.TF_SessionMakeCallable(sess._session, options)
    except (tf.errors.OpError, ValueError, TypeError):
        return None
    finally:
        c_api.TF_DeleteBuffer(options)
