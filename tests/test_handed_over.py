"""Arrays a follower hands to TensorFlow to keep as variables' buffers (``skeleton.handed_over``):
given once, and nothing outside the block or the set is ever kept."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from weightstore.adapters import tf2  # noqa: E402
from weightstore.adapters.skeleton import handed_over  # noqa: E402
from weightstore.io._buffer import aligned_array  # noqa: E402

FLOATS = 1 << 16  # 256 KB: large enough to be kept rather than copied


def staged(value: float) -> np.ndarray:
    """What a follower stages: a tensor in aligned memory of its own."""
    array = aligned_array(FLOATS * 4).view(np.float32)
    array[:] = value
    return array


def test_one_array_fed_to_two_variables_becomes_the_buffer_of_one_at_most():
    """Two variables sharing one buffer would both follow whatever is written there."""
    a, b = tf.Variable(np.zeros(FLOATS, np.float32)), tf.Variable(np.zeros(FLOATS, np.float32))
    shared = staged(1.0)
    with handed_over([shared]):
        tf2.assign({"a": a, "b": b}, {"a": shared, "b": shared})
    assert np.all(a.numpy() == 1.0) and np.all(b.numpy() == 1.0)
    shared[:] = 9.0  # shows which variable kept the array as its buffer
    assert [bool(np.all(var.numpy() == 9.0)) for var in (a, b)].count(True) <= 1


def test_arrays_outside_the_block_or_the_set_are_copied():
    variable, other = tf.Variable(np.zeros(FLOATS, np.float32)), tf.Variable(np.zeros(FLOATS, np.float32))
    mine, given = staged(1.0), staged(5.0)
    tf2.assign({"v": variable}, {"v": mine})
    with handed_over([given]):
        tf2.assign({"v": other}, {"v": mine})  # the caller's array, not the handed-over one
    mine[:] = 7.0
    assert np.all(variable.numpy() == 1.0) and np.all(other.numpy() == 1.0)
