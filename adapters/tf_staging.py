"""A value's copy for an eager TensorFlow variable, made in memory TensorFlow's own allocator handed out.

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

Session feeds (``tf1``) keep numpy copies. A session's ops draw from an allocator of the
session's own, which the eager ``Empty`` does not share, so a variable set by an in-graph
initializer frees its first buffer where a staged copy cannot reuse it (the first assign still
grows the process by the model, as ``Saver.restore``'s does), and the staged feed cost about
12% more CPU time per repeated assign than the numpy copy (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from weightstore.extras import needs

with needs("tf", __name__):
    import tensorflow as tf

from weightstore.adapters.skeleton import copy_into, is_handed_over, private_copy

__all__ = ["staged_copy"]

#: smaller values keep a :func:`private_copy`: the ``Empty`` op's fixed cost (about 35 us) is more
#: than a copy of them into heap memory numpy reuses (docs/benchmarks.md), and their share of a
#: model's memory is small
STAGED_FROM = 1 << 20
_unstageable: set[np.dtype] = set()  # dtypes TensorFlow has no CPU ``Empty`` kernel (or no type) for


def staged_copy(array: np.ndarray, dtype: np.dtype) -> Any:
    """``array`` as ``dtype`` in a new CPU tensor from TensorFlow's allocator, for an eager
    ``AssignVariableOp`` to take over; a :func:`private_copy` where that cannot be made (a small
    value, eager execution off, a dtype without an ``Empty`` kernel, an array handed over)."""
    dtype = np.dtype(dtype)
    if array.nbytes < STAGED_FROM or dtype in _unstageable or is_handed_over(array):
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


class _Writable:
    """The bytes of a tensor no one else holds yet, writable (TensorFlow's own numpy view is
    read-only, as it must be once a tensor is shared, and its bfloat16 is not ml_dtypes'); the
    arrays made from it keep the tensor alive."""

    def __init__(self, tensor: Any):
        self._tensor = tensor
        view = np.asarray(tensor)
        self.__array_interface__ = {"shape": (view.nbytes,), "typestr": "|u1", "data": (view.ctypes.data, False),
                                    "version": 3}
