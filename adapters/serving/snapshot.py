"""A snapshot of eager TF variables that copies nothing on the training thread.

How TensorFlow's own async checkpoint does it (``tensorflow/python/checkpoint/
async_checkpoint_helper.py``): after waiting for the previous save, ``_copy_to_cpu`` runs
``destination.assign(variable.read_value())`` for every variable, then a thread writes the
destinations. The copy it seems to make is not made: reading a resource variable returns a
tensor that shares the variable's buffer (unless the variable is in copy-on-read mode, which
sparse updates switch on), and every in-place update (``assign_add``, the optimizers'
``ResourceApply*`` kernels) first copies the buffer when anyone else still holds it
(``PrepareToUpdateVariable``: the buffer's reference count is not one). So a read tensor keeps
the value of the moment it was read however training goes on, and the copy is paid by the
next update of each variable, only while the snapshot is alive.

:func:`snapshot` keeps those read tensors themselves (no CPU variables to hold between
saves). ``np.asarray`` of a CPU tensor is a view of its buffer, so the publishing thread
converts each tensor as it writes it without a copy; a GPU tensor is copied to the host then,
one at a time, off the training thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from typing_extensions import Unpack

from weightstore.core._extras import needs

with needs("tf", __name__):
    import keras
    import tensorflow as tf

from weightstore.adapters import tf2
from weightstore.adapters.plan import Selection, SelectionWords

__all__ = ["snapshot"]

_SHARDED = tf.__internal__.distribute.ShardedVariable


def snapshot(obj: Any, **selection: Unpack[SelectionWords]) -> dict[str, Any]:
    """The values :func:`tf2.export` would return, as eager tensors read now, not numpy copies.

    Give the result to :func:`weightstore.publish`, :func:`weightstore.save` or a
    :class:`weightstore.BackgroundPublisher`; its values stay those of this moment while
    training continues. A sharded variable is joined when converted.
    """
    return {key: _read(var) for key, var in tf2.selected(obj, **Selection.of("snapshot", selection).words()).items()}


def _read(var: Any) -> Any:
    if isinstance(var, _SHARDED):
        return _Joined([_read(shard) for shard in var.variables])
    if isinstance(var, keras.Variable):
        var = var.value  # the backing tf.Variable
    return var.read_value()


class _Joined:
    """A sharded variable's shard tensors, concatenated only when converted to numpy."""

    def __init__(self, parts: list[tf.Tensor]):
        self.parts = parts
        self.dtype = np.dtype(parts[0].dtype.as_numpy_dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        joined = np.concatenate([np.asarray(part) for part in self.parts], axis=0)
        return joined if dtype is None else joined.astype(dtype, copy=False)
