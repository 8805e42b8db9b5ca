"""The TF2/Keras adapter on real Keras models, tf.Modules and variables, through real files."""

import gc
import json
import textwrap

import ml_dtypes
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import weightstore as ws  # noqa: E402
from weightstore.adapters import skeleton, tf2  # noqa: E402
from weightstore.errors import AssignmentError, ChecksumError, InvalidKeyError, SelectionError  # noqa: E402

DTYPES = ["float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "bool"]
FORMATS = ["npz", "h5"]


def np_dtype(name):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -100), min(info.max, 100), shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def values_of(obj):
    return {k: np.array(v) for k, v in tf2.export(obj).items()}


class Holder(tf.Module):
    """Variables of one dtype at several depths and shapes, including 0-d and zero-size."""

    def __init__(self, dtype):
        super().__init__()
        self.w = tf.Variable(tf.zeros((3, 4), dtype))
        self.scalar = tf.Variable(tf.zeros((), dtype))
        self.empty = tf.Variable(tf.zeros((0, 2), dtype))
        self.blocks = [tf.Module()]
        self.blocks[0].b = tf.Variable(tf.zeros((5,), dtype))


def mlp(hidden=4, named=False):
    return keras.Sequential([
        keras.Input((3,)),
        keras.layers.Dense(hidden, name="hidden" if named else None),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(2),
    ])


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.conv = keras.layers.Conv2D(2, 3, padding="same", name="conv")
        self.bn = keras.layers.BatchNormalization(name="bn")

    def call(self, x, training=False):
        return self.bn(self.conv(x), training=training)


def blocks_model():
    return keras.Sequential([keras.Input((6, 6, 1)), Block(name="conv_1"), Block(name="conv_2"),
                             keras.layers.Flatten(), keras.layers.Dense(2)])


# --- round trips -------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_round_trip_every_dtype_through_files(tmp_path, dtype_name, fmt):
    dtype = np_dtype(dtype_name)
    source, target = Holder(tf.as_dtype(dtype)), Holder(tf.as_dtype(dtype))
    for i, var in enumerate(tf2.variables(source).values()):
        var.assign(sample(dtype, tuple(var.shape), seed=i))
    path = tmp_path / f"w.{fmt}"
    ws.save(path, tf2.export(source))
    assert ws.load(path)["w"].dtype == dtype
    report = tf2.assign(target, path)
    assert sorted(report.assigned) == ["blocks/0/b", "empty", "scalar", "w"]
    expected, got = values_of(source), values_of(target)
    for key in expected:
        assert got[key].dtype == dtype and got[key].shape == expected[key].shape
        np.testing.assert_array_equal(got[key], expected[key])


def test_keras_model_built_twice_exchanges_weights_by_default(tmp_path):
    first, second = mlp(), mlp()  # Keras names the second one's layers dense_2, dense_3, …
    assert [w.path for w in first.weights] != [w.path for w in second.weights]
    assert list(tf2.variables(first)) == list(tf2.variables(second)) == [
        "dense/kernel", "dense/bias", "batch_normalization/gamma", "batch_normalization/beta",
        "batch_normalization/moving_mean", "batch_normalization/moving_variance", "dense_1/kernel", "dense_1/bias",
    ]
    first.compile("sgd", "mse")
    first.fit(np.ones((8, 3)), np.ones((8, 2)), epochs=1, verbose=0)
    ws.save(tmp_path / "m.npz", tf2.export(first))
    assert len(tf2.assign(second, tmp_path / "m.npz").assigned) == 8
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_array_equal(first.predict(x, verbose=0), second.predict(x, verbose=0))


def test_keys_keep_user_names_and_nest_by_layer():
    keys = list(tf2.variables(blocks_model()))
    assert "conv_1/bn/moving_mean" in keys and "conv_2/conv/kernel" in keys and "dense/kernel" in keys
    # a chosen name is kept; names of Keras's automatic form are renumbered in Keras's own order
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="head"), keras.layers.Dense(2, name="dense_12"),
                              keras.layers.Dense(2, name="dense_9")])
    assert [k for k in tf2.variables(model) if k.endswith("kernel")] == ["head/kernel", "dense_1/kernel", "dense/kernel"]


def test_trainable_only_says_a_value_has_a_variable_that_is_not_trainable():
    variables = {"model_10/w": tf.Variable(np.zeros(2, np.float32)),
                 "model_10/b": tf.Variable(np.zeros(2, np.float32), trainable=False)}
    weights = {"model_10/w": np.ones(2, np.float32), "model_10/b": np.ones(2, np.float32)}
    with pytest.raises(AssignmentError) as raised:
        tf2.assign(variables, weights, trainable_only=True)
    message = str(raised.value)
    assert "'model_10/b' is a variable but not trainable (trainable_only=True)" in message
    assert "did you mean" not in message
    assert raised.value.unexpected == ["model_10/b"]
    report = tf2.assign(variables, weights, trainable_only=True, strict=False)
    assert report.assigned == ["model_10/w"] and report.unexpected == ["model_10/b"]
    np.testing.assert_array_equal(variables["model_10/b"].numpy(), [0, 0])


def test_module_keys_are_attribute_paths_and_lists_use_variable_names():
    holder = Holder(tf.float32)
    holder.head = keras.layers.Dense(2)
    holder.head.build((5,))
    holder.alias = holder.w  # a second path to the same variable is not a second key
    keys = set(tf2.variables(holder))
    assert keys == {"alias", "scalar", "empty", "blocks/0/b", "head/kernel", "head/bias"}
    listed = [tf.Variable(1.0, name="enc/w"), tf.Variable(2.0, name="dec/w")]
    assert tf2.export(listed) == {"enc/w": 1.0, "dec/w": 2.0}
    with pytest.raises(InvalidKeyError, match="pass a dict"):
        tf2.export([tf.Variable(1.0, name="w"), tf.Variable(2.0, name="w")])
    assert list(tf2.export({"a/b": listed[0]})) == ["a/b"]


def test_export_refuses_unbuilt_models_and_other_objects():
    with pytest.raises(SelectionError, match="build"):
        tf2.export(keras.Sequential([keras.layers.Dense(2)]))
    with pytest.raises(TypeError, match="Keras model"):
        tf2.export(object())


# --- scope, mapping, selection -----------------------------------------------------------

class Ensemble(tf.Module):
    def __init__(self, names):
        super().__init__()
        for name in names:
            member = tf.Module()
            member.w = tf.Variable(tf.zeros((2,)))
            member.b = tf.Variable(tf.zeros(()))
            setattr(self, name, member)


def test_scope_matches_whole_segments_model_1_vs_model_10():
    ensemble = Ensemble(["model_1", "model_10"])
    report = tf2.assign(ensemble, {"w": np.ones(2, np.float32), "b": np.float32(5)}, scope="model_1")
    assert sorted(report.assigned) == ["model_1/b", "model_1/w"]
    values = values_of(ensemble)
    assert values["model_10/w"].tolist() == [0, 0] and values["model_1/w"].tolist() == [1, 1]
    scoped = tf2.export(ensemble, scope="model_1")
    assert sorted(scoped) == ["b", "w"] and scoped["w"].tolist() == [1, 1] and scoped["b"] == 5
    with pytest.raises(SelectionError, match="model_1"):
        tf2.export(ensemble, scope="model_2")


def test_mapping_include_and_exclude():
    ensemble = Ensemble(["model_1", "model_10"])
    weights = {"old/w": np.full(2, 3, np.float32), "old/b": np.float32(4)}
    report = tf2.assign(ensemble, weights, mapping=["old=model_10"], include="model_10/w", strict=False)
    assert report.assigned == ["model_10/w"] and "model_10/b" not in report.missing
    assert values_of(ensemble)["model_10/w"].tolist() == [3, 3]
    assert list(tf2.export(ensemble, exclude="model_1")) == ["model_10/b", "model_10/w"]
    assert list(tf2.export(ensemble, include="*/b")) == ["model_1/b", "model_10/b"]


# --- strict and non-strict plans, casts --------------------------------------------------

def test_strict_failure_lists_everything_and_changes_nothing():
    ensemble = Ensemble(["model_001"])
    before = values_of(ensemble)
    weights = {"model_01/w": np.ones(2, np.float32), "model_001/b": np.ones(3, np.float32)}
    with pytest.raises(AssignmentError) as caught:
        tf2.assign(ensemble, weights)
    message = str(caught.value)
    assert "nothing was changed" in message
    assert "no variable 'model_01/w'; did you mean 'model_001/w'?" in message
    assert caught.value.missing == ["model_001/w"] and caught.value.unexpected == ["model_01/w"]
    assert [m.key for m in caught.value.mismatched] == ["model_001/b"]
    assert all(np.array_equal(before[k], v) for k, v in values_of(ensemble).items())


def test_suggestions_prefer_a_key_of_the_variables_shape(tmp_path):
    """``layer_10/kernel`` is spelt nearer ``layer_1/kernel``, but only ``layer_2/kernel`` could be its value."""
    holder = {"layer_1/kernel": tf.Variable(tf.zeros((4, 4))), "layer_9/kernel": tf.Variable(tf.zeros((8, 8)))}
    ws.save(tmp_path / "w.npz", {"layer_10/kernel": np.ones((8, 8), np.float32),
                                 "layer_2/kernel": np.ones((4, 4), np.float32)})
    with pytest.raises(AssignmentError) as caught:
        tf2.assign(holder, tmp_path / "w.npz")
    message = str(caught.value)
    assert "no value for variable 'layer_1/kernel'; did you mean 'layer_2/kernel'?" in message
    assert "no value for variable 'layer_9/kernel'; did you mean 'layer_10/kernel'?" in message
    assert "no variable 'layer_10/kernel'; did you mean 'layer_9/kernel'?" in message
    assert "no variable 'layer_2/kernel'; did you mean 'layer_1/kernel'?" in message


def test_non_strict_assigns_what_fits_and_reports_the_rest():
    ensemble = Ensemble(["m"])
    weights = {"m/w": np.ones(2, np.float32), "m/b": np.ones(3, np.float32), "extra": np.ones(1)}
    report = tf2.assign(ensemble, weights, strict=False)
    assert report.assigned == ["m/w"] and report.unexpected == ["extra"] and not report.ok
    assert [m.key for m in report.mismatched] == ["m/b"]
    assert values_of(ensemble)["m/w"].tolist() == [1, 1] and values_of(ensemble)["m/b"] == 0


def test_cast_rules():
    holder = {"f32": tf.Variable(tf.zeros(2)), "i32": tf.Variable(tf.zeros(2, tf.int32))}
    assert tf2.assign(holder, {"f32": np.array([1.5, 2], np.float16), "i32": np.array([1, 2], np.int8)}).ok
    narrowing = {"f32": np.array([1.25, 2], np.float64), "i32": np.array([3, 4], np.int64)}
    with pytest.raises(AssignmentError, match="cast=True"):
        tf2.assign(holder, narrowing)
    assert holder["f32"].numpy().tolist() == [1.5, 2]
    tf2.assign(holder, narrowing, cast=True)
    assert holder["f32"].numpy().tolist() == [1.25, 2] and holder["i32"].numpy().tolist() == [3, 4]
    bf16 = {"f32": np.array([1, 2], ml_dtypes.bfloat16)}
    assert tf2.assign(holder, bf16, include="f32").assigned == ["f32"]  # bfloat16 widens into float32


@pytest.mark.parametrize("target, value, match", [
    ("kernel", np.array([1.0, 1e39]), r"1e\+39, beyond float32's range"),
    ("counter", np.array([1.0, np.nan]), "NaN, which int32 cannot hold"),
    ("counter", np.array([1, 2**40]), "1099511627776, beyond int32's range"),
    ("kernel", np.array([1 + 2j, 0]), "imaginary part"),
    ("flag", np.array([0.3, 1.0]), r"holds 0.3, which bool cannot hold \(only 0 and 1\)"),
    ("flag", np.array([np.nan, 1.0]), "holds nan, which bool cannot hold"),
    ("flag", np.array([0, 256]), "holds 256, which bool cannot hold"),
], ids=["overflow", "nan-to-int", "wraparound", "complex", "fraction-to-bool", "nan-to-bool", "int-to-bool"])
def test_cast_refuses_values_out_of_range(tmp_path, target, value, match):
    """A Keras model keeps its weights when cast=True would have turned a value into another."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    before = [w.copy() for w in model.get_weights()]
    counter = tf.Variable(tf.zeros(2, tf.int32))
    flag = tf.Variable(tf.zeros(2, tf.bool))
    holder = {"kernel": model.layers[0].kernel, "counter": counter, "flag": flag}
    weights = {"kernel": np.ones((2, 2)), "counter": np.array([1, 2]), "flag": np.array([1.0, 0.0])}
    weights[target] = np.resize(value, holder[target].shape)
    ws.save(tmp_path / "w.npz", weights)
    with pytest.raises(AssignmentError, match=match):
        tf2.assign(holder, tmp_path / "w.npz", cast=True)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before, strict=True))
    assert counter.numpy().tolist() == [0, 0] and flag.numpy().tolist() == [False, False]
    tf2.assign(holder, {"flag": np.array([1.0, 0.0])}, include="flag", cast=True)  # 0 and 1: truth values
    assert flag.numpy().tolist() == [True, False]


# --- trainable_only, optimizer -----------------------------------------------------------

def test_trainable_only_leaves_batch_norm_statistics_and_frozen_layers_alone():
    model = mlp(named=True)
    keys = list(tf2.export(model, trainable_only=True))
    assert "batch_normalization/moving_mean" not in keys and "batch_normalization/gamma" in keys
    ones = {k: np.ones_like(v) for k, v in tf2.export(model).items()}
    report = tf2.assign(model, ones, trainable_only=True, strict=False)
    assert sorted(report.unexpected) == ["batch_normalization/moving_mean", "batch_normalization/moving_variance"]
    assert values_of(model)["batch_normalization/moving_mean"].tolist() == [0, 0, 0, 0]
    model.get_layer("hidden").trainable = False
    assert "hidden/kernel" not in tf2.export(model, trainable_only=True)


def test_a_strict_assign_of_part_of_a_model_says_how_to_assign_it():
    """A selective save assigned strictly lists the variables it lacks; with every value paired
    the message says what to do about them (batch statistics: the also= that exports them), and
    the model keeps its weights."""
    model = mlp(named=True)
    before = values_of(model)
    part = {key: np.ones_like(value) for key, value in tf2.export(model, trainable_only=True).items()}
    with pytest.raises(AssignmentError, match="the file holds none of the model's non-trainable variables") as caught:
        tf2.assign(model, part)
    assert "include them on export with trainable_only=True, also='batch_normalization/*'" in str(caught.value)
    assert "moving_mean" in str(caught.value) and values_of(model).keys() == before.keys()
    assert all(np.array_equal(values_of(model)[key], value) for key, value in before.items())
    assert tf2.assign(model, part, strict=False).missing == ["batch_normalization/moving_mean",
                                                              "batch_normalization/moving_variance"]


def test_a_scope_no_variable_is_under_is_named_with_the_nearest_one():
    inputs = keras.Input((3,))
    members = [keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name=f"model_00{i}")
               for i in (1, 2)]
    ensemble = keras.Model(inputs, [member(inputs) for member in members])
    weights = tf2.export(members[0])  # unscoped: d/kernel, d/bias
    with pytest.raises(AssignmentError, match="no variable is under scope 'model_02'; did you mean 'model_002'"):
        tf2.assign(ensemble, weights, scope="model_02")
    with pytest.raises(AssignmentError, match=r"under scope 'zzz' \(the model's: 'model_001', 'model_002'\)"):
        tf2.assign(ensemble, weights, scope="zzz")
    assert tf2.assign(ensemble, weights, scope="model_002").ok


def test_export_holds_model_weights_not_optimizer_state():
    model = mlp()
    model.compile(keras.optimizers.Adagrad(0.1), "mse")
    model.fit(np.ones((8, 3)), np.ones((8, 2)), epochs=1, verbose=0)
    assert model.optimizer.variables
    assert len(tf2.export(model)) == len(model.weights)
    optimizer = tf2.export(model.optimizer.variables)
    assert any("accumulator" in key for key in optimizer)


# --- laziness, safety, hot reload --------------------------------------------------------

def corrupt(path, array):
    data = path.read_bytes()
    at = data.index(array.tobytes())
    path.write_bytes(data[:at] + b"\xff" * 8 + data[at + 8:])


def test_reads_only_what_is_assigned_and_verifies_before_writing(tmp_path):
    holder = {"a": tf.Variable(tf.zeros(64)), "b": tf.Variable(tf.zeros(64))}
    path = tmp_path / "w.npz"
    ws.save(path, {"a": np.full(64, 1, np.float32), "b": np.full(64, 2, np.float32)})
    corrupt(path, np.full(64, 2, np.float32))
    assert tf2.assign(holder, path, include="a").assigned == ["a"]  # b, corrupt, is never read
    holder["a"].assign(tf.zeros(64))
    with pytest.raises(ChecksumError):
        tf2.assign(holder, path)
    assert not holder["a"].numpy().any()  # a was read first, yet nothing was written


@pytest.mark.parametrize("size", [64, 1 << 16], ids=["small", "adopted"])  # the large one TF adopts
@pytest.mark.parametrize("kind", ["tf", "keras"])
def test_assigned_values_share_no_memory_with_maps_or_callers(tmp_path, size, kind):
    path = tmp_path / "w.npz"
    ws.save(path, {"w": np.arange(size, dtype=np.float32)})
    var = tf.Variable(tf.zeros(size)) if kind == "tf" else keras.Variable(np.zeros(size, np.float32))
    tf2.assign({"w": var}, path)
    var.assign_add(tf.ones(size))  # an in-place update of a read-only map would abort the process
    np.testing.assert_array_equal(ws.load(path)["w"], np.arange(size))
    np.testing.assert_array_equal(np.asarray(var.numpy()), np.arange(size) + 1)
    raw = np.zeros(size * 4 + 64, np.uint8)
    mine = raw[-raw.ctypes.data % 64:][:size * 4].view(np.float32)  # aligned: TF would adopt it
    tf2.assign({"w": var}, {"w": mine})
    mine += 7
    assert not np.asarray(var.numpy()).any()


@pytest.mark.parametrize("kind", ["tf", "keras"])
def test_many_small_values_of_mixed_shapes_and_dtypes_each_reach_their_own_variable(tmp_path, kind):
    """Small values are written in groups of one dtype and shape: several full groups of a
    shape and a remainder, a lone shape, scalars, other dtypes and a large value in one batch."""
    rng = np.random.default_rng(0)
    weights = {f"rows/{i}": rng.standard_normal(7).astype(np.float32) for i in range(2 * tf2._GROUP + 5)}
    weights |= {f"scalars/{i}": np.array(i / 3) for i in range(3)}
    weights |= {"lone": rng.standard_normal((2, 3)).astype(np.float32), "ints": np.arange(7, dtype=np.int32),
                "flags": np.array([True, False, True]), "half": sample(np_dtype("bfloat16"), (7,)),
                "large": rng.standard_normal(1 << 15).astype(np.float32)}

    def variable(value):
        if kind == "keras":
            return keras.Variable(np.zeros(value.shape, value.dtype), dtype=value.dtype.name)
        return tf.Variable(tf.zeros(value.shape, tf.as_dtype(value.dtype)))

    holder = {key: variable(value) for key, value in weights.items()}
    path = tmp_path / "w.npz"
    ws.save(path, weights)
    assert tf2.assign(holder, path).assigned == list(weights)
    given = {key: value.copy() for key, value in weights.items()}
    tf2.assign(holder, given)
    for value in given.values():
        value[...] = 0  # the caller's arrays are theirs: the variables keep what was assigned
    for key, value in weights.items():
        got = np.asarray(holder[key].numpy())
        assert got.dtype == value.dtype and got.shape == value.shape, key
        np.testing.assert_array_equal(got, value, err_msg=key)
    for key in ["rows/0", "rows/1", "lone"]:
        holder[key].assign_add(np.ones(weights[key].shape, np.float32))
    np.testing.assert_array_equal(np.asarray(holder["rows/1"].numpy()), weights["rows/1"] + 1)
    np.testing.assert_array_equal(np.asarray(holder["rows/2"].numpy()), weights["rows/2"])
    np.testing.assert_array_equal(ws.load(path)["rows/0"], weights["rows/0"])


@pytest.mark.parametrize("enabled", [True, False])
def test_assign_leaves_the_garbage_collector_as_it_found_it(enabled):
    """An assign pauses the cyclic collector while it runs (a full pass over TF's heap is slow)."""
    holder = {"w": tf.Variable(tf.zeros(3))}
    if not enabled:
        gc.disable()
    try:
        tf2.assign(holder, {"w": np.ones(3, np.float32)})
        assert gc.isenabled() is enabled
        with pytest.raises(AssignmentError, match="shapes differ"):
            tf2.assign(holder, {"w": np.ones(4, np.float32)})
        assert gc.isenabled() is enabled
    finally:
        gc.enable()


def test_inside_a_keras_stateless_scope_assign_is_recorded_not_applied():
    model = mlp()
    before = values_of(model)
    ones = {key: np.ones_like(value) for key, value in before.items()}
    with keras.StatelessScope() as scope:
        tf2.assign(model, ones)
        for var in model.weights:
            np.testing.assert_array_equal(scope.get_current_value(var), np.ones(var.shape))
    for key, value in values_of(model).items():
        np.testing.assert_array_equal(value, before[key])


FLOATS = 32768  # 128 KiB a tensor


@pytest.mark.parametrize("fmt", ["npz", "h5"])
def test_batched_assign_equals_one_shot_and_a_bad_later_value_changes_nothing(tmp_path, monkeypatch, fmt):
    """Two tensors a batch: HDF5 values beyond the budget are read twice, and still verified first."""
    weights = {f"layer_{i}/w": np.full(FLOATS, i + 1, np.float32) for i in range(6)}
    holder = {key: tf.Variable(tf.zeros(FLOATS)) for key in weights}
    path = tmp_path / f"w.{fmt}"
    ws.save(path, weights)
    tf2.assign(holder, path)
    one_shot = values_of(holder)
    for var in holder.values():
        var.assign(tf.zeros(FLOATS))
    monkeypatch.setattr(skeleton, "BATCH_MIN_BYTES", 2 * FLOATS * 4)
    assert tf2.assign(holder, path).assigned == list(weights)
    for key, expected in weights.items():
        np.testing.assert_array_equal(one_shot[key], expected)
        np.testing.assert_array_equal(holder[key].numpy(), expected)
    for var in holder.values():
        var.assign(tf.zeros(FLOATS))
    corrupt(path, weights["layer_5/w"])
    with pytest.raises(ChecksumError, match="layer_5/w"):
        tf2.assign(holder, path)
    assert not any(value.any() for value in values_of(holder).values())


def test_skip_unchanged_uses_checksums(tmp_path):
    model = mlp()
    path = tmp_path / "v.npz"
    weights = tf2.export(model)
    ws.save(path, weights, digests=True)  # skipping compares digests, which a plain save leaves out
    assert not tf2.assign(model, path).skipped  # plain paths are always written
    assert sorted(tf2.assign(model, path, skip_unchanged=True).skipped) == sorted(weights)
    weights["dense/bias"] = weights["dense/bias"] + 1
    ws.save(path, weights, digests=True)
    report = tf2.assign(model, path, skip_unchanged=True)
    assert report.assigned == ["dense/bias"] and len(report.skipped) == len(weights) - 1
    assert not tf2.assign(model, weights, skip_unchanged=True).skipped  # dicts carry no checksums
    fresh = mlp()
    assert not tf2.assign(fresh, path, skip_unchanged=True).skipped  # memory is per variable


def test_a_module_with_string_variables_and_unknown_dimensions_round_trips(tmp_path):
    """A string variable holds no weights (no format stores it): left out of export and assign,
    as TF1 leaves it. A variable of unknown dimensions goes out, and back in, with its value's
    shape; another shape is a mismatch that changes nothing."""
    module = tf.Module()
    module.w = tf.Variable(np.ones(2, np.float32))
    module.vocabulary = tf.Variable("vocab.txt")
    module.rows = tf.Variable(np.ones((3, 2), np.float32), shape=[None, 2])
    ws.save(tmp_path / "m.npz", {key: value * 4 for key, value in tf2.export(module).items()})
    assert sorted(ws.load(tmp_path / "m.npz")) == ["rows", "w"]
    assert sorted(tf2.assign(module, tmp_path / "m.npz").assigned) == ["rows", "w"]
    np.testing.assert_array_equal(module.rows.numpy(), np.full((3, 2), 4))
    with pytest.raises(AssignmentError, match=r"rows: variable is float32\[3, 2\], value is float32\[5, 2\]"):
        tf2.assign(module, {"w": np.zeros(2, np.float32), "rows": np.zeros((5, 2), np.float32)})
    np.testing.assert_array_equal(module.w.numpy(), [4, 4])
    assert module.vocabulary.numpy() == b"vocab.txt"


@pytest.mark.parametrize("suffix", [".npz", ".h5", ".safetensors"])
def test_variables_of_unknown_shape_save_as_their_values(tmp_path, suffix):
    """Variables handed to ``ws.save`` as they are: one of unknown rank (whose ``TensorShape``
    refuses even to be iterated) and one of unknown dimensions are written with their values'
    shapes, in every format, whether or not the writer lays the file out first (HDF5 of large
    tensors does)."""
    weights = {"unranked": tf.Variable(np.arange(600 * 600, dtype=np.float32).reshape(600, 600),
                                       shape=tf.TensorShape(None)),
               "rows": tf.Variable(np.ones((300, 600), np.float32), shape=[None, 600]),
               "known": tf.Variable(np.full((400, 600), 2, np.float32))}
    path = tmp_path / f"w{suffix}"
    ws.save(path, weights)
    loaded = ws.load(path)
    for key, variable in weights.items():
        np.testing.assert_array_equal(loaded[key], variable.numpy())


@pytest.mark.parametrize("source", ["dict", "npz"])
def test_a_variable_named_twice_is_written_once_and_two_different_values_for_it_are_refused(tmp_path, source):
    """A dict naming one variable under two keys: equal values write it once; different ones
    would leave whichever came last, so strict refuses them (nothing changed) and strict=False
    writes the first key's value and lists the other as mismatched."""
    shared, other = tf.Variable(np.zeros(3, np.float32)), tf.Variable(np.zeros(2, np.float32))
    model = {"a": shared, "b": shared, "c": other}

    def weights(a, b):
        arrays = {"a": np.full(3, a, np.float32), "b": np.full(3, b, np.float32), "c": np.ones(2, np.float32)}
        if source == "dict":
            return arrays
        ws.save(tmp_path / f"{a}-{b}.npz", arrays)
        return tmp_path / f"{a}-{b}.npz"

    assert tf2.assign(model, weights(4, 4)).assigned == ["a", "c"]
    np.testing.assert_array_equal(shared.numpy(), np.full(3, 4.0))
    other.assign(np.zeros(2, np.float32))
    with pytest.raises(AssignmentError, match=r"nothing was changed\n  1 mismatched:\n    b: variable is float32\[3\], "
                                              r"value is float32\[3\] \(the same variable as 'a', whose value differs\)"):
        tf2.assign(model, weights(5, 6))
    np.testing.assert_array_equal(shared.numpy(), np.full(3, 4.0))
    np.testing.assert_array_equal(other.numpy(), np.zeros(2))
    report = tf2.assign(model, weights(5, 6), strict=False)
    assert report.assigned == ["a", "c"] and [m.key for m in report.mismatched] == ["b"]
    np.testing.assert_array_equal(shared.numpy(), np.full(3, 5.0))


def test_a_variable_named_twice_takes_values_equal_once_cast_and_checks_their_range_once(tmp_path, recwarn):
    shared = tf.Variable(np.zeros(3, np.float32))
    ws.save(tmp_path / "m.npz", {"a": np.arange(3.0), "b": np.arange(3, dtype=np.float32)})
    assert tf2.assign({"a": shared, "b": shared}, tmp_path / "m.npz", cast=True).assigned == ["a"]
    np.testing.assert_array_equal(shared.numpy(), [0, 1, 2])
    with pytest.raises(AssignmentError, match="beyond float32's range"):
        tf2.assign({"a": shared, "b": shared}, {"a": np.full(3, 1e300), "b": np.full(3, 1e300)}, cast=True)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]  # no numpy cast warning on the way
    np.testing.assert_array_equal(shared.numpy(), [0, 1, 2])


def test_hot_reload_remembers_a_shared_variable_once_whichever_model_wrote_it(tmp_path):
    """A backbone nested in a model is one set of variables under two keys (``feat/kernel`` in
    the backbone, ``backbone/feat/kernel`` in the model): writing it through the backbone must
    make the model's next version write it again, not skip it as what it last received."""
    inputs = keras.Input((2,))
    backbone = keras.Model(inputs, keras.layers.Dense(2, name="feat")(inputs), name="backbone")
    outer = keras.Input((2,))
    full = keras.Model(outer, keras.layers.Dense(1, name="head")(backbone(outer)))

    def version(head: float) -> dict[str, np.ndarray]:
        return {"backbone/feat/kernel": np.eye(2, dtype=np.float32), "backbone/feat/bias": np.zeros(2, np.float32),
                "head/kernel": np.full((2, 1), head, np.float32), "head/bias": np.zeros(1, np.float32)}

    tf2.assign(full, ws.publish(tmp_path / "run", version(1), step=1))
    tf2.assign(backbone, {"feat/kernel": np.full((2, 2), 7, np.float32), "feat/bias": np.ones(2, np.float32)})
    report = tf2.assign(full, ws.publish(tmp_path / "run", version(2), step=2))
    assert sorted(report.assigned) == ["backbone/feat/bias", "backbone/feat/kernel", "head/kernel"]
    assert report.skipped == ["head/bias"]
    np.testing.assert_array_equal(backbone.get_layer("feat").kernel.numpy(), np.eye(2))
    x = np.ones((1, 2), np.float32)
    np.testing.assert_array_equal(full(x), x @ np.eye(2) @ np.full((2, 1), 2))


# --- distributed variables and devices ---------------------------------------------------

def test_sharded_variable_exports_whole_and_assigns_across_shards(tmp_path):
    shards = [tf.Variable(tf.zeros((2, 3)), name="emb/part_0"), tf.Variable(tf.zeros((1, 3)), name="emb/part_1")]
    module = tf.Module()
    module.emb = tf.__internal__.distribute.ShardedVariable(shards)
    value = np.arange(9, dtype=np.float32).reshape(3, 3)
    ws.save(tmp_path / "e.h5", {"emb": value})
    assert tf2.assign(module, tmp_path / "e.h5").assigned == ["emb"]
    np.testing.assert_array_equal(shards[1].numpy(), value[2:])
    np.testing.assert_array_equal(tf2.export(module)["emb"], value)
    assert list(tf2.export([module.emb])) == ["emb"]


DISTRIBUTED = textwrap.dedent("""
    import json, sys
    import numpy as np, tensorflow as tf
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras, weightstore as ws
    from weightstore.adapters import tf2
    out, path = {}, sys.argv[1]

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        module = tf.Module()
        module.w = tf.Variable(tf.zeros(4))
    out["mirrored"] = type(module.w).__name__
    out["exported"] = {k: list(v.shape) for k, v in tf2.export(model).items()}
    ws.save(path, {"dense/kernel": np.full((3, 2), 2, np.float32), "dense/bias": np.ones(2, np.float32)})
    tf2.assign(model, path)
    tf2.assign(module, {"w": np.arange(4, dtype=np.float32)})
    replicas = [strategy.experimental_local_results(v.value) for v in model.weights] + [
        strategy.experimental_local_results(module.w)]
    out["replica_devices"] = sorted({r.device for group in replicas for r in group})
    out["replica_values"] = [r.numpy().ravel().tolist() for group in replicas for r in group]

    with tf.device("/cpu:1"):
        source = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with tf.device("/cpu:0"):
        target = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    out["devices"] = [source.weights[0].value.device, target.weights[0].value.device]
    out["copied"] = tf2.assign(target, tf2.export(source)).assigned
    out["equal"] = all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(source.weights, target.weights))
    print(json.dumps(out))
""")


def test_mirrored_variables_and_device_to_device_copy(tmp_path, tf_fork):
    """In a process of its own (forked from one that imported TensorFlow and ran no op:
    ``conftest.tf_fork``), whose two logical CPUs are set before its runtime starts."""
    done = tf_fork.run(DISTRIBUTED, str(tmp_path / "m.npz"), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["mirrored"] == "MirroredVariable"
    assert out["exported"] == {"dense/kernel": [3, 2], "dense/bias": [2]}  # once, not once per replica
    assert len(out["replica_devices"]) == 2
    kernel, bias, w = [2.0] * 6, [1.0, 1.0], [0.0, 1.0, 2.0, 3.0]
    assert out["replica_values"] == [kernel, kernel, bias, bias, w, w]
    assert out["devices"][0].endswith("CPU:1") and out["devices"][1].endswith("CPU:0")
    assert out["copied"] == ["dense/kernel", "dense/bias"] and out["equal"]


def test_a_large_value_copied_on_several_threads_arrives_whole(tmp_path):
    """Over 32 MB the private copy is cut along the first axis; rows must land where they belong."""
    value = np.arange(4099 * 1025, dtype=np.float32).reshape(4099, 1025)  # 16.8 MB, odd row count, exact
    path = tmp_path / "big.npz"
    ws.save(path, {"w": value})
    var = tf.Variable(tf.zeros(value.shape, tf.float64))
    tf2.assign({"w": var}, path)  # float32 widens to 33.6 MB of float64 in the copy
    np.testing.assert_array_equal(var.numpy(), value)
    var.assign_add(tf.ones(value.shape, tf.float64))
    np.testing.assert_array_equal(ws.load(path)["w"], value)
