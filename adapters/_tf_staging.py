"""A value's copy for a TensorFlow variable (eager, or fed to a TF1 session), made in memory TensorFlow's own allocator handed out.

``AssignVariableOp`` makes the variable share the tensor it is given and frees the variable's
old buffer. On x86 that buffer came from TensorFlow's CPU allocator (oneDNN's pool), which
keeps freed memory for its next allocations and never returns it to the system. A value
copied into numpy's memory (:func:`~weightstore.adapters.skeleton.private_copy`) is taken over
as it is, so the old buffers all stay in the pool, unused: the first assign in a process left
it holding the model twice, for good (``Checkpoint.read`` does the same).

:func:`staged_copy` copies the value into an uninitialized tensor of TensorFlow's ``Empty`` op
instead, filled through a numpy view before anything else sees it. The variable takes over
that tensor, and the buffer it frees is what the next value's ``Empty`` reuses: the pool grows
by about one batch of values, on the first assign and every later one, and it is still one
copy per value (into memory already faulted in, after the first).

A TF1 session feed (:func:`staged_feeds`) gets the same from a graph and CPU-only session of
weightstore's own, one per dtype, whose ``Empty`` ops run once per batch: every session in a
process allocates from the one CPU allocator, so the buffers the user's variables free are
what the next batch's ``Empty`` reuses. The fetched tensor comes back as a writable numpy view
of TensorFlow's memory (its only owner), and fed back, aligned, it is what the variable takes
over. A session, not eager ops, because TF1 programs usually turn eager execution off.
The ``Empty`` ops run one after another, largest first, so each takes the freed buffer that
fits it best: run side by side, a small one could split the buffer a large one needed, and the
pool grew on every later assign (a second ``tf1.assign`` of 1 GB: 0.08x side by side, 0.01x in
order).

:func:`shares_mapped` names the values TensorFlow can take over for nothing: views of a mapped
file that it wraps rather than copies (:mod:`weightstore.adapters.tf1` feeds them first, so the
variables' old buffers are free before the ``Empty`` ops ask for new ones).

A buffer TensorFlow frees goes back to the system when it is large (glibc unmaps it), so each
``Empty`` buffer was fresh memory: 64,000 page faults per 256 MB, half the CPU of a repeated cold
``tf1.assign``. A session therefore remembers, weakly, the staged array it fed each variable
(:func:`lend`); when the variable lets it go for the file's pages, :func:`reclaim` takes it back,
once TensorFlow holds no reference to it, and the next value is copied into it: memory already
faulted in, and the same memory the variable held, so the model is still held once. Between
assigns only weak references are kept, so an array the variables drop (re-initialized, restored
by other means, the session closed) is freed as before.
"""

from __future__ import annotations

import math
import mmap
import sys
import sysconfig
import threading
import weakref
from typing import Any

import numpy as np

from weightstore.core._extras import needs

with needs("tf", __name__):
    import tensorflow as tf
    from tensorflow.core.framework import graph_pb2, types_pb2

from weightstore.adapters.skeleton import copy_all, copy_into, is_handed_over, private_copy
from weightstore.io._buffer import ALIGNMENT, memory_owner

__all__ = ["held_back", "lend", "reclaim", "shares_mapped", "staged_copy", "staged_feeds", "warm"]

#: smaller values keep a :func:`private_copy`: the ``Empty`` op's fixed cost (about 35 us) is more
#: than a copy of them into heap memory numpy reuses (docs/benchmarks.md's git history), and their share of a
#: model's memory is small
STAGED_FROM = 1 << 20
_unstageable: set[np.dtype] = set()  # dtypes TensorFlow has no CPU ``Empty`` kernel (or no type) for
_DIMENSION_LIMIT = 1 << 31  # ``Empty`` takes its shape as int32
#: whether ``sys.getrefcount`` counts every reference, which reusing a let-go array relies on:
#: true of CPython with the GIL up to 3.13; 3.14 may count fewer (borrowed stack references)
#: and free-threaded builds split the count, so there no array is reused
_EXACT_REFCOUNTS = (sys.implementation.name == "cpython" and sys.version_info < (3, 14)
                    and not sysconfig.get_config_var("Py_GIL_DISABLED"))


def staged_copy(array: np.ndarray, dtype: np.dtype) -> Any:
    """``array`` as ``dtype`` in a new CPU tensor from TensorFlow's allocator, for an eager
    ``AssignVariableOp`` to take over; a :func:`private_copy` where that cannot be made (a small
    value, eager execution off, a dtype without an ``Empty`` kernel, an array handed over)."""
    dtype = np.dtype(dtype)
    if not _stages(array, dtype):
        return private_copy(array, dtype)  # which gives a handed-over array itself: no copy at all
    if not tf.executing_eagerly():  # in a graph (a tf.function): the op would join it (init_scope costs 50 us)
        return private_copy(array, dtype)
    try:
        with tf.device("/CPU:0"):
            tensor = tf.raw_ops.Empty(shape=array.shape, dtype=tf.as_dtype(dtype), init=False)
    except (TypeError, tf.errors.NotFoundError, tf.errors.InvalidArgumentError):
        _unstageable.add(dtype)
        return private_copy(array, dtype)
    copy_into(np.asarray(_Writable(tensor)).view(dtype).reshape(array.shape), array)
    return tensor


def _stages(array: np.ndarray, dtype: np.dtype) -> bool:
    """Whether ``array``, as ``dtype``, is worth an ``Empty`` tensor and can have one
    (:func:`_fits`), and is not an array handed over (which :func:`private_copy` gives as it is)."""
    return _fits(array.shape, dtype) and not is_handed_over(array)


def _fits(shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether a value of ``shape`` and ``dtype`` is large enough for an ``Empty`` tensor, of a
    dtype with a kernel, and each dimension within ``Empty``'s int32 shape."""
    return (math.prod(shape) * dtype.itemsize >= STAGED_FROM and dtype not in _unstageable
            and all(size < _DIMENSION_LIMIT for size in shape))


def staged_feeds(values: list[tuple[np.ndarray, np.dtype]]) -> list[np.ndarray]:
    """Each ``(array, dtype)`` as a feed for a TF1 session's variable to take over: the large ones
    copied into ``Empty`` tensors of one ``session.run`` per dtype, the rest (and any whose dtype
    has no ``Empty`` kernel) :func:`private_copy` made (a handed-over array: itself)."""
    feeds: dict[int, np.ndarray] = {}
    staged: dict[np.dtype, list[int]] = {}
    copies: list[tuple[np.ndarray, np.ndarray]] = []  # made together, on several threads
    for i, (array, dtype) in enumerate(values):
        dtype = np.dtype(dtype)
        if not _stages(array, dtype):
            feeds[i] = private_copy(array, dtype)
        else:
            staged.setdefault(dtype, []).append(i)
    for dtype, chosen in staged.items():
        chosen.sort(key=lambda i: -math.prod(values[i][0].shape))  # largest first: see the module's docstring
        buffers = _empty(dtype, [values[i][0].shape for i in chosen])
        for n, i in enumerate(chosen):
            if buffers is None:
                feeds[i] = private_copy(values[i][0], dtype)
            else:
                copies.append((buffers[n], values[i][0]))
                feeds[i] = buffers[n]
    copy_all(copies, fresh=True)  # TensorFlow's allocator maps a large buffer anew
    return [feeds[i] for i in range(len(values))]


def warm(values: list[tuple[tuple[int, ...], np.dtype]]) -> None:
    """Have the staging session build and compile the run that :func:`staged_feeds` of values of
    these shapes and dtypes will make (run once, on no bytes), so the first assign in a process,
    which stages on its caller's thread after its verify pass, waits for neither: 0.03-0.04
    CPU-s, 0.07-0.15 s on a loaded machine, of a 256 MB ``tf1.assign``'s first call."""
    counts: dict[np.dtype, int] = {}
    for shape, dtype in values:
        dtype = np.dtype(dtype)
        if _fits(shape, dtype):
            counts[dtype] = counts.get(dtype, 0) + 1
    for dtype, count in counts.items():
        _empty(dtype, [(0,)] * count)


def shares_mapped(array: np.ndarray, dtype: np.dtype) -> bool:
    """Whether ``array`` is a large view of a mapped file that a TF1 feed of ``dtype`` wraps as
    it is: TensorFlow shares fed memory that is C-contiguous, of the fed dtype and aligned to
    Eigen's 64 bytes (and copies anything else). Such a tensor does not own its memory, so
    TensorFlow copies it before any in-place write, and its pages are the file's: taking it over
    costs a variable no memory of the process's own."""
    return (isinstance(memory_owner(array), mmap.mmap) and array.dtype == np.dtype(dtype)
            and array.nbytes >= STAGED_FROM and array.flags.c_contiguous and array.ctypes.data % ALIGNMENT == 0)


def lend(sess: Any, names: list[str], feeds: list[np.ndarray]) -> None:
    """Remember, weakly, that the variables ``names`` of ``sess`` were fed these staged arrays."""
    lent = _lent(sess)
    if lent is not None:
        with _lent_lock:
            for name, feed in zip(names, feeds, strict=True):
                lent[name] = weakref.ref(feed)


def held_back(sess: Any, names: list[str]) -> list[np.ndarray | None]:
    """The arrays :func:`lend` last recorded for ``names``, where they are still alive (held by
    their variables, most likely), each taken out of the record so one assign alone may reclaim it.
    The caller holds them across the run that makes the variables let go, then :func:`reclaim`."""
    lent = _lent(sess)
    if not lent:
        return [None] * len(names)
    with _lent_lock:
        refs = [lent.pop(name, None) for name in names]
    return [None if ref is None else ref() for ref in refs]


def reclaim(held: list[np.ndarray | None], values: list[tuple[np.ndarray, np.dtype]]) -> list[np.ndarray | None]:
    """Each value copied into its held array, where TensorFlow no longer refers to that array and
    it fits the value (same bytes); ``None`` where not (the array, if any, is left to be freed).

    An array TensorFlow still refers to (a run in another thread reading the old value, or a
    variable that copied rather than took over) is never written: the only references left are
    ``held``'s and this function's, which ``sys.getrefcount`` counts exactly."""
    out: list[np.ndarray | None] = []
    copies: list[tuple[np.ndarray, np.ndarray]] = []  # made together, on several threads
    for i, (array, dtype) in enumerate(values):
        buffer = held[i]
        held[i] = None
        dtype = np.dtype(dtype)
        size = math.prod(array.shape) * dtype.itemsize
        # references: ``buffer`` here and getrefcount's argument, nothing else
        if (buffer is None or not _EXACT_REFCOUNTS or sys.getrefcount(buffer) > 2 or buffer.nbytes != size
                or not buffer.flags.c_contiguous or not buffer.flags.writeable or buffer.ctypes.data % ALIGNMENT):
            out.append(None)
            continue
        target = buffer.reshape(-1).view(np.uint8).view(dtype).reshape(array.shape)
        copies.append((target, array))
        out.append(target)
    copy_all(copies)
    return out


def _lent(sess: Any) -> dict[str, weakref.ref] | None:
    """The session's record of what :func:`lend` fed its variables (``None``: a session that
    takes no attributes). On the session, so it goes with it."""
    lent = getattr(sess, "_weightstore_lent", None)
    if lent is None:
        try:
            lent = sess._weightstore_lent = {}
        except AttributeError:
            return None
    return lent


_lent_lock = threading.Lock()


def _empty(dtype: np.dtype, shapes: list[tuple[int, ...]]) -> list[np.ndarray] | None:
    """Writable uninitialized arrays in TensorFlow's memory, or ``None`` (the dtype remembered as
    unstageable) where TensorFlow has no such dtype or no CPU ``Empty`` kernel for it."""
    try:
        with _stagers_lock:
            stager = _stagers.get(dtype) or _stagers.setdefault(dtype, _Stager(dtype))
        buffers = stager.empty(shapes)
    except (TypeError, ValueError, tf.errors.OpError):  # ValueError: a GraphDef TF will not import
        _unstageable.add(dtype)
        return None
    if not all(buffer.flags.writeable and buffer.dtype == dtype for buffer in buffers):
        return None  # TensorFlow copied instead of handing its tensor over: nothing gained
    return buffers


class _Stager:
    """``Empty`` ops of one dtype in a graph and CPU-only session of their own: one op per value
    of a batch, each run after the one before, made as batches need them (a graph of a few dozen
    ops at most). A dtype of its own graph, since one op without a kernel fails every run of its
    graph."""

    def __init__(self, dtype: np.dtype):
        self._dtype = tf.as_dtype(dtype)
        self._graph = tf.Graph()
        config = tf.compat.v1.ConfigProto(device_count={"GPU": 0})
        # nothing to optimize in a chain of Empty ops: Grappler took most of its first run's compile
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        self._session = tf.compat.v1.Session(graph=self._graph, config=config)
        self._ops: list[tuple[Any, Any]] = []  # (shape placeholder, Empty's output)
        self._chains = 0
        self._lock = threading.Lock()

    def empty(self, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
        """Uninitialized arrays of these shapes in TensorFlow's memory, allocated in this order."""
        with self._lock:
            if len(self._ops) < len(shapes):
                self._ops = self._chain(max(len(shapes), 2 * len(self._ops)))
            ops = self._ops[:len(shapes)]
            return self._session.run([output for _, output in ops],
                                     {placeholder: shape for (placeholder, _), shape in zip(ops, shapes, strict=True)})

    def _chain(self, count: int) -> list[tuple[Any, Any]]:
        """A new chain of ``count`` ops: an op that has run may not become a control input (TF
        marks the op, which a session that ran it refuses), so a longer chain is all new. Written
        as a ``GraphDef`` and imported in one call: made op by op in Python, the 2 x 256 ops of
        one batch took 0.1-0.3 s of the first assign in a process. No node names a device: the
        session has only its CPU, and a device on each node cost the import twice the time
        (0.09 s of a 256 MB assign's first call, 73 values)."""
        definition = graph_pb2.GraphDef()
        for i in range(count):
            shape = definition.node.add(name=f"shape{i}", op="Placeholder")
            shape.attr["dtype"].type = types_pb2.DT_INT32
            shape.attr["shape"].shape.dim.add(size=-1)
            empty = definition.node.add(name=f"empty{i}", op="Empty", input=[f"shape{i}", *([f"^empty{i - 1}"] if i else [])])
            empty.attr["dtype"].type = self._dtype.as_datatype_enum
            empty.attr["init"].b = False
        self._chains += 1
        scope = f"chain{self._chains}"
        with self._graph.as_default():
            tf.compat.v1.import_graph_def(definition, name=scope)
        return [(self._graph.get_tensor_by_name(f"{scope}/shape{i}:0"), self._graph.get_tensor_by_name(f"{scope}/empty{i}:0"))
                for i in range(count)]


_stagers: dict[np.dtype, _Stager] = {}
_stagers_lock = threading.Lock()


class _Writable:
    """The bytes of a tensor no one else holds yet, writable (TensorFlow's own numpy view is
    read-only, as it must be once a tensor is shared, and its bfloat16 is not ml_dtypes'); the
    arrays made from it keep the tensor alive."""

    def __init__(self, tensor: Any):
        self._tensor = tensor
        view = np.asarray(tensor)
        self.__array_interface__ = {"shape": (view.nbytes,), "typestr": "|u1", "data": (view.ctypes.data, False),
                                    "version": 3}
