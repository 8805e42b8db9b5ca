"""tf2.assign and tf1.assign copy each large value into a tensor of TensorFlow's own allocator:
exact values for every dtype, variables that stay independent of the file, of the caller's
arrays and of earlier reads, and a first assign in a process that does not leave it holding the
model twice."""

import ctypes
import json
import os
import textwrap

import ml_dtypes
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import weightstore as ws  # noqa: E402
from weightstore.adapters import _tf_staging, tf1, tf2  # noqa: E402
from weightstore.adapters.skeleton import handed_over  # noqa: E402
from weightstore.io._buffer import aligned_array  # noqa: E402

DTYPES = ["float16", "float32", "float64", "bfloat16", "int8", "int32", "int64", "uint8", "uint16", "complex64", "bool"]
ROWS = _tf_staging.STAGED_FROM // 8 + 3  # every dtype's value is at least STAGED_FROM bytes


def values(dtype: np.dtype, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype.kind == "b":
        return rng.integers(0, 2, (ROWS, 8)).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0, 100, (ROWS, 8)).astype(dtype)
    if dtype.kind == "c":
        return (rng.standard_normal((ROWS, 8)) + 1j * rng.standard_normal((ROWS, 8))).astype(dtype)
    out = rng.standard_normal((ROWS, 8)).astype(dtype)
    out.reshape(-1)[:3] = np.array([np.nan, -0.0, np.inf]).astype(dtype)  # kept bit for bit
    return out


@pytest.mark.parametrize("name", DTYPES)
def test_every_dtype_is_assigned_bit_for_bit_from_a_file(tmp_path, name):
    dtype = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    variable = tf.Variable(tf.zeros((ROWS, 8), dtype=tf.as_dtype(dtype)))
    expected = values(dtype, 1)
    ws.save(tmp_path / "w.safetensors", {"w": expected})
    tf2.assign({"w": variable}, tmp_path / "w.safetensors")
    got = variable.numpy()
    assert got.dtype == dtype
    assert got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("name", DTYPES)
def test_every_dtype_is_fed_bit_for_bit_into_tf1_resource_and_ref_variables(tmp_path, name):
    dtype = np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)
    expected = {"resource": values(dtype, 5), "ref": values(dtype, 6)}
    ws.save(tmp_path / "w.npz", expected)
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        made = [tf.compat.v1.get_variable(key, (ROWS, 8), tf.as_dtype(dtype), tf.compat.v1.zeros_initializer(),
                                          use_resource=key == "resource") for key in expected]
        sess.run(tf.compat.v1.global_variables_initializer())
        tf1.assign(sess, tmp_path / "w.npz")
        for variable, got in zip(made, sess.run(made), strict=True):
            assert got.dtype == dtype
            assert got.tobytes() == expected[variable.op.name].tobytes()


def test_tf1_variables_share_nothing_with_the_caller_or_each_other_and_train_in_place():
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        a = tf.compat.v1.get_variable("a", (ROWS, 8), tf.float32, tf.compat.v1.zeros_initializer())
        b = tf.compat.v1.get_variable("b", (ROWS, 8), tf.float32, tf.compat.v1.zeros_initializer())
        step = a.assign_add(tf.ones_like(a))
        sess.run(tf.compat.v1.global_variables_initializer())
        source = values(np.dtype("float32"), 7)
        tf1.assign(sess, {"a": source, "b": source})
        source[:] = 7
        sess.run(step)
        np.testing.assert_array_equal(sess.run(a), values(np.dtype("float32"), 7) + 1)
        np.testing.assert_array_equal(sess.run(b), values(np.dtype("float32"), 7))


@pytest.mark.parametrize("use_resource", [True, False], ids=["resource", "ref"])
def test_tf1_variables_fed_from_a_mapped_file_keep_nothing_of_it(tmp_path, use_resource):
    """A resource variable first takes over the file's pages, then a copy of them in TF's memory;
    a ref variable copies into its own buffer. Either way, once the assign is done, a file
    rewritten in place (as no weightstore writer does) changes no variable, and training updates
    the variable's own buffer."""
    expected = {"a": values(np.dtype("float32"), 8), "b": values(np.dtype("float32"), 9)}
    path = tmp_path / "w.npz"
    ws.save(path, expected)
    with ws.open(path) as store:
        assert all(_tf_staging.shares_mapped(store[key], np.dtype("float32")) for key in expected)
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        made = {key: tf.compat.v1.get_variable(key, (ROWS, 8), tf.float32, tf.compat.v1.zeros_initializer(),
                                               use_resource=use_resource) for key in expected}
        step = made["a"].assign_add(tf.ones_like(made["a"]))
        sess.run(tf.compat.v1.global_variables_initializer())
        assert tf1.assign(sess, path).assigned == ["a", "b"]
        with open(path, "r+b") as handle:  # every byte of both values, in place
            data = bytearray(handle.read())
            for value in expected.values():
                at = data.find(value.tobytes())
                data[at:at + value.nbytes] = b"\x00" * value.nbytes
            handle.seek(0)
            handle.write(data)
        np.testing.assert_array_equal(sess.run(made["b"]), expected["b"])
        sess.run(step)
        np.testing.assert_array_equal(sess.run(made["a"]), expected["a"] + 1)


def test_staged_buffers_of_growing_batches_are_distinct_and_shaped_as_asked():
    """The ``Empty`` ops run one after another; a batch larger than any before makes a longer chain."""
    for count in (1, 3, 2, 7):
        shapes = [(ROWS + i, 8) for i in range(count)]
        arrays = [values(np.dtype("float32"), i)[:1].repeat(ROWS + i, axis=0) for i in range(count)]
        feeds = _tf_staging.staged_feeds([(array, np.dtype("float32")) for array in arrays])
        assert [feed.shape for feed in feeds] == shapes
        assert len({feed.ctypes.data for feed in feeds}) == count
        for feed, array in zip(feeds, arrays, strict=True):
            np.testing.assert_array_equal(feed, array)


def test_a_warmed_staging_run_is_the_one_the_batch_then_makes():
    """``warm`` builds the ``Empty`` ops a batch of those shapes will run (on the helper, during the
    first assign's verify pass), so the batch makes no chain of its own; values too small to stage
    are left out of the count, and the staged copies hold the values exactly."""
    dtype = np.dtype("float16")
    count = max(9, 2 * len(getattr(_tf_staging._stagers.get(dtype), "_ops", ())) + 1)  # longer than any chain before
    shapes = [(ROWS + i, 8) for i in range(count)]
    _tf_staging.warm([(shape, dtype) for shape in shapes] + [((4,), dtype)])
    stager = _tf_staging._stagers[dtype]
    chains = stager._chains
    arrays = [values(dtype, i)[:1].repeat(ROWS + i, axis=0) for i in range(count)]
    feeds = _tf_staging.staged_feeds([(array, dtype) for array in arrays])
    assert stager._chains == chains and len(stager._ops) == count
    for feed, array in zip(feeds, arrays, strict=True):
        np.testing.assert_array_equal(feed, array)


def test_assigned_variables_update_in_place_and_earlier_reads_keep_their_values(tmp_path):
    variable = tf.Variable(tf.zeros((ROWS, 8), tf.float32))
    before = variable.read_value()  # shares the variable's buffer, as a background snapshot does
    first, second = values(np.dtype("float32"), 2), values(np.dtype("float32"), 3)
    ws.save(tmp_path / "a.npz", {"w": first})
    ws.save(tmp_path / "b.npz", {"w": second})
    tf2.assign({"w": variable}, tmp_path / "a.npz")
    after_first = variable.read_value()
    variable.assign_add(tf.ones_like(variable))  # an optimizer step on the assigned buffer
    np.testing.assert_array_equal(variable.numpy(), first + 1)
    tf2.assign({"w": variable}, tmp_path / "b.npz")
    np.testing.assert_array_equal(before.numpy(), np.zeros((ROWS, 8), np.float32))
    np.testing.assert_array_equal(after_first.numpy(), first)
    np.testing.assert_array_equal(variable.numpy(), second)


def test_a_caller_array_is_copied_not_shared():
    variable = tf.Variable(tf.zeros((ROWS, 8), tf.float32))
    source = values(np.dtype("float32"), 4)
    tf2.assign({"w": variable}, {"w": source})
    source[:] = 7
    np.testing.assert_array_equal(variable.numpy(), values(np.dtype("float32"), 4))


def test_a_large_array_handed_over_becomes_the_buffer_without_a_copy():
    """A follower's staged version is given to TF as it is, staged or not by size."""
    variable = tf.Variable(tf.zeros((ROWS, 8), tf.float32))
    given = aligned_array(ROWS * 8 * 4).view(np.float32).reshape(ROWS, 8)
    given[:] = 1.0
    with handed_over([given]):
        tf2.assign({"w": variable}, {"w": given})
    given[:] = 9.0  # seen through the variable only if it kept this memory as its buffer
    np.testing.assert_array_equal(variable.numpy(), np.full((ROWS, 8), 9.0, np.float32))


FIRST_ASSIGN = textwrap.dedent("""
    import gc, json, sys
    import numpy as np, tensorflow as tf
    import weightstore as ws
    from weightstore.adapters import tf2
    from weightstore.core._heap import give_back

    def anon():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon"))

    model = {f"w{i}": tf.Variable(tf.random.normal([1 << 20])) for i in range(16)}  # 64 MB, TF's memory
    ws.save(sys.argv[1], {key: np.full(1 << 20, i, np.float32) for i, key in enumerate(model)})
    gc.collect()
    give_back()  # what the setup freed is not the assign's to give back: else it hides a keep
    before = anon()
    tf2.assign(model, sys.argv[1])
    gc.collect()
    kept = anon() - before  # before the check: its reads leave freed copies of their own in the heap
    right = all((model[f"w{i}"].numpy() == i).all() for i in range(16))
    print(json.dumps({"kept": kept, "model": 64 << 20, "right": right}))
""")


FIRST_ASSIGN_TF1 = textwrap.dedent("""
    import ctypes, gc, json, sys
    fed = sys.argv[2] == "fed"
    if fed:  # M_MMAP_THRESHOLD, for the allocations after it (numpy is imported already when forked):
        ctypes.CDLL(None).mallopt(-3, 256 << 20)  # the fed arrays come from the C heap, not mmap (checked)
    import numpy as np, tensorflow as tf
    import weightstore as ws
    from weightstore.adapters import skeleton, tf1
    from weightstore.core._heap import give_back
    from weightstore.io._buffer import aligned_array

    tf.compat.v1.disable_eager_execution()  # as TF1 programs run
    skeleton.BATCH_MIN_BYTES = 16 << 20  # batches of an eighth: what is kept is about one batch

    def anon():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon"))

    def on_heap(array):  # else glibc returns it on free: nothing left to trim, the case asserts nothing
        with open("/proc/self/maps") as maps:
            spans = [line.split() for line in maps if line.rstrip().endswith("[heap]")]
        return any(int(lo, 16) <= array.ctypes.data < int(hi, 16) for lo, hi in (span[0].split("-") for span in spans))

    graph = tf.Graph()
    with graph.as_default():  # 128 MB
        model = [tf.compat.v1.get_variable(f"w{i}", [1 << 20]) for i in range(32)]
        init = tf.compat.v1.global_variables_initializer()
    sess = tf.compat.v1.Session(graph=graph)
    if fed:  # aligned: each variable keeps the fed array, heap memory, as its buffer
        for variable in model:
            value = aligned_array(4 << 20).view(np.float32)
            value[:] = -1
            assert on_heap(value), "a fed array was mapped, not on the heap"
            sess.run(variable.initializer, {variable.initializer.inputs[1]: value})
        del value
    else:  # set by the graph's own initializers: TF's memory
        sess.run(init)
    graph.finalize()
    ws.save(sys.argv[1], {f"w{i}": np.full(1 << 20, i, np.float32) for i in range(32)})
    gc.collect()
    give_back()  # the saved arrays' heap pages, left by the setup: else the assign's trim hides a keep
    before = anon()
    tf1.assign(sess, sys.argv[1])
    gc.collect()
    kept = anon() - before  # before the check, whose fetched copies (fed: on the heap) stay when freed
    right = all((value == i).all() for i, value in enumerate(sess.run(model)))
    print(json.dumps({"kept": kept, "model": 128 << 20, "right": right}))
""")


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "malloc_trim") and hasattr(ctypes.CDLL(None), "mallopt")
    except OSError:
        return False


@pytest.fixture(scope="module")
def tf_only(tmp_path_factory):
    """Processes forked from one that imported TensorFlow alone (``processes.ForkServer``), as
    these cases always were, not also Keras as ``conftest.tf_fork``'s are. The fed case once
    measured 1.04x the model (always, with byte-compiled sources): the scripts' own check after the
    assign, 128 MB of fetched copies freed to the heap, was counted; the assign kept 5 MB."""
    from processes import ForkServer

    server = ForkServer(tmp_path_factory.mktemp("forked"), "import numpy, tensorflow, weightstore",
                        env={"TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": "1"})  # x86 TF's default
    try:
        yield server
    finally:
        server.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RssAnon from /proc")
@pytest.mark.parametrize("script, start", [
    (FIRST_ASSIGN, ""), (FIRST_ASSIGN_TF1, "initializers"),
    pytest.param(FIRST_ASSIGN_TF1, "fed", marks=pytest.mark.skipif(not _glibc(), reason="glibc's heap")),
], ids=["tf2", "tf1", "tf1-fed-heap-arrays"])
@pytest.mark.slow  # a TensorFlow process each
def test_the_first_assign_in_a_process_does_not_keep_a_second_model(tf_only, tmp_path, script, start):
    """Run in a process forked from one that imported TensorFlow (:func:`tf_only`): a process
    whose first assign it is, without a TensorFlow import per case."""
    done = tf_only.run(script, str(tmp_path / "m.npz"), start)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["right"]
    assert out["kept"] < 0.25 * out["model"], out  # numpy copies, adopted, left 1.0x in TF's pool


def test_a_repeated_tf1_assign_copies_into_the_buffers_its_variables_let_go_of(tmp_path):
    """A second assign from a mapped file copies each value into the staged buffer the variable
    held, once the variable has let go of it (no new memory to fault in), never into one that
    anything else still refers to; and the session remembers them only weakly."""
    first = {"a": values(np.dtype("float32"), 10), "b": values(np.dtype("float32"), 11)}
    second = {"a": values(np.dtype("float32"), 12), "b": values(np.dtype("float32"), 13)}
    ws.save(tmp_path / "first.npz", first)
    ws.save(tmp_path / "second.npz", second)
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.Session(graph=graph) as sess:
        made = {key: tf.compat.v1.get_variable(key, (ROWS, 8), tf.float32, tf.compat.v1.random_normal_initializer())
                for key in first}
        initialize = tf.compat.v1.global_variables_initializer()
        sess.run(initialize)
        tf1.assign(sess, tmp_path / "first.npz")
        kept = sess._weightstore_lent["a"]()  # as if something still read a's old buffer
        b_address = sess._weightstore_lent["b"]().ctypes.data
        tf1.assign(sess, tmp_path / "second.npz")
        assert sess._weightstore_lent["b"]().ctypes.data == b_address
        assert sess._weightstore_lent["a"]() is not kept
        np.testing.assert_array_equal(kept, first["a"])
        for key, variable in made.items():
            np.testing.assert_array_equal(sess.run(variable), second[key])
        del kept
        sess.run(initialize)  # the variables drop the staged buffers, which nothing keeps alive
        assert all(ref() is None for ref in sess._weightstore_lent.values())
