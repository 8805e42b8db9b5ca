"""Files TensorFlow and Keras wrote themselves, in these tests, assigned into live models.

TF1 training graphs as real code builds them (batch norm updates in ``UPDATE_OPS``, a
placeholder input, ``MonitoredTrainingSession``), Keras ``save_weights``/``model.save`` of
``keras.applications`` architectures and a subclassed model, ``tf.train.Checkpoint`` with
optimizer state, and a TF1 ``Saver`` checkpoint.
"""

from __future__ import annotations

import threading
import time

import ml_dtypes
import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import weightstore as ws  # noqa: E402
from weightstore import sync as versions  # noqa: E402
from weightstore.adapters import tf1, tf2  # noqa: E402
from weightstore.adapters.plan import AssignWarning, Report  # noqa: E402
from weightstore.adapters.serving.follower import Follower  # noqa: E402
from weightstore.adapters.serving.hooks import PublishHook  # noqa: E402
from weightstore.errors import (  # noqa: E402
    AssignmentError,
    FormatError,
    InvalidKeyError,
    SelectionError,
    VersionGoneError,
)

v1 = tf.compat.v1


# --- TF1 graphs as training code builds them -------------------------------------------------

def batch_norm_graph():
    """A conv-free "network": placeholder -> dense -> batch norm whose moving stats update via UPDATE_OPS."""
    x = v1.placeholder(tf.float32, [None, 4], name="x")
    with v1.variable_scope("model_001"):
        kernel = v1.get_variable("dense/kernel", [4, 3], use_resource=True)
        gamma = v1.get_variable("bn/gamma", [3], initializer=v1.ones_initializer(), use_resource=True)
        beta = v1.get_variable("bn/beta", [3], initializer=v1.zeros_initializer(), use_resource=True)
        moving_mean = v1.get_variable("bn/moving_mean", [3], initializer=v1.zeros_initializer(), trainable=False,
                                      use_resource=True)
        moving_var = v1.get_variable("bn/moving_variance", [3], initializer=v1.ones_initializer(), trainable=False,
                                     use_resource=True)
    h = tf.matmul(x, kernel)
    mean, var = tf.nn.moments(h, [0])
    for stat, value in ((moving_mean, mean), (moving_var, var)):  # what tf.compat.v1.layers did
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, stat.assign(0.9 * stat + 0.1 * value))
    y = tf.nn.batch_normalization(h, mean, var, beta, gamma, 1e-3)
    return x, y, [kernel, gamma, beta, moving_mean, moving_var]


def test_tf1_export_reads_only_variables_runs_no_update_and_adds_no_op():
    with tf.Graph().as_default() as graph, v1.Session() as sess:
        _, _, variables = batch_norm_graph()
        sess.run(v1.global_variables_initializer())
        sess.run([v.assign(tf.fill(v.shape, 0.5)) for v in variables])
        before = sess.run(variables)
        ops = len(graph.get_operations())
        graph.finalize()
        exported = tf1.export(sess)  # the placeholder is not fed: only read tensors are fetched
        assert sorted(exported) == ["model_001/bn/beta", "model_001/bn/gamma", "model_001/bn/moving_mean",
                                    "model_001/bn/moving_variance", "model_001/dense/kernel"]
        assert len(graph.get_operations()) == ops
        for old, new in zip(before, sess.run(variables), strict=True):
            np.testing.assert_array_equal(old, new)  # the moving stats did not move
        report = tf1.assign(sess, exported)  # strict, complete: no bogus "…/AssignVariableOp" target
        assert report.ok and len(report.assigned) == 5


def test_tf1_training_under_monitored_session_with_publish_hook(tmp_path):
    rng = np.random.default_rng(0)
    with tf.Graph().as_default():
        step = v1.train.get_or_create_global_step()
        x, y, variables = batch_norm_graph()
        loss = tf.reduce_mean(tf.square(y - 1.0))
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            train = v1.train.GradientDescentOptimizer(0.1).minimize(loss, global_step=step)
        hook = PublishHook(tmp_path, every_n_steps=2, keep=None, include="model_001")
        with v1.train.MonitoredTrainingSession(hooks=[hook], checkpoint_dir=None) as sess:
            for _ in range(6):
                sess.run(train, feed_dict={x: rng.normal(2.0, 1.0, (8, 4))})
            final = sess.run(variables)
    assert [entry.step for entry in versions.list_versions(tmp_path)][-1] == 6
    published = ws.load(ws.latest(tmp_path))
    assert sorted(published) == ["model_001/bn/beta", "model_001/bn/gamma", "model_001/bn/moving_mean",
                                 "model_001/bn/moving_variance", "model_001/dense/kernel"]
    np.testing.assert_array_equal(published["model_001/bn/moving_mean"], final[3])
    assert not np.allclose(final[3], 0)  # training did run the updates


def test_tf1_empty_name_segments_collapse_and_round_trip(tmp_path):
    with tf.Graph().as_default(), v1.Session() as sess:
        with v1.variable_scope("model_001"), v1.variable_scope(""):
            kernel = v1.get_variable("conv_1/kernel", [2, 2], use_resource=True)
        assert kernel.op.name == "model_001//conv_1/kernel"
        sess.run(v1.global_variables_initializer())
        exported = tf1.export(sess)
        assert list(exported) == ["model_001/conv_1/kernel"]
        ws.save(tmp_path / "m.npz", {key: np.full_like(value, 7.0) for key, value in exported.items()})
        assert tf1.assign(sess, tmp_path / "m.npz").assigned == ["model_001/conv_1/kernel"]
        np.testing.assert_array_equal(sess.run(kernel), np.full((2, 2), 7.0))


def test_tf1_dot_segments_read_as_a_path_and_round_trip_through_a_file_and_a_saver_checkpoint(tmp_path):
    """``variable_scope(".")`` names a variable ``./conv/kernel``; its key is ``conv/kernel``, in
    the graph and in the graph's Saver checkpoint alike, so each assigns into the other."""
    def build():
        with v1.variable_scope("."):
            return v1.get_variable("conv/kernel", initializer=np.arange(4, dtype=np.float32))

    with tf.Graph().as_default(), v1.Session() as sess:
        kernel = build()
        assert kernel.op.name == "./conv/kernel"
        sess.run(v1.global_variables_initializer())
        assert list(tf1.export(sess)) == ["conv/kernel"]
        prefix = v1.train.Saver().save(sess, str(tmp_path / "model.ckpt"))
        ws.save(tmp_path / "m.npz", {"conv/kernel": np.full(4, 7.0, np.float32)})
        assert tf1.assign(sess, tmp_path / "m.npz").assigned == ["conv/kernel"]
        np.testing.assert_array_equal(sess.run(kernel), np.full(4, 7.0))
        assert tf1.assign(sess, prefix).assigned == ["conv/kernel"]
        np.testing.assert_array_equal(sess.run(kernel), np.arange(4))


def test_tf1_a_dot_dot_segment_makes_no_key_and_export_says_how_to_leave_it_out():
    with tf.Graph().as_default(), v1.Session() as sess:
        with v1.variable_scope("block"), v1.variable_scope(".."):
            v1.get_variable("w", [2])
        v1.get_variable("b", [2])
        sess.run(v1.global_variables_initializer())
        with pytest.raises(InvalidKeyError, match=r"variable 'block/\.\./w' makes no key: it has a '\.\.' segment; "
                                                  r"leave it out \(exclude='block/\[\.\]\[\.\]/w'\)"):
            tf1.export(sess)
        assert list(tf1.export(sess, exclude="block/[.][.]/w")) == ["b"]
    with tf.Graph().as_default(), v1.Session() as sess:
        with v1.variable_scope("block"), v1.variable_scope(".."):
            v1.get_variable("w", [4, 2], partitioner=v1.fixed_size_partitioner(2))
        sess.run(v1.global_variables_initializer())
        with pytest.raises(InvalidKeyError, match=r"^variable 'block/\.\./w' makes no key"):  # named whole, not a part
            tf1.export(sess)


def test_tf1_export_names_an_uninitialized_variable_whose_name_holds_a_dot():
    for resource in (True, False):
        with tf.Graph().as_default(), v1.Session() as sess:
            with v1.variable_scope("block"), v1.variable_scope("."):
                v1.get_variable("w", [2], use_resource=resource)
            with pytest.raises(SelectionError, match=r"variable 'block/\./w' of the graph holds no value yet"):
                tf1.export(sess)


def test_tf1_names_that_collapse_to_one_key_are_an_error_naming_both():
    with tf.Graph().as_default(), v1.Session() as sess:
        v1.get_variable("a/b", [1])
        with v1.variable_scope("a"), v1.variable_scope(""):
            v1.get_variable("b", [1])
        with pytest.raises(InvalidKeyError, match=r"variables 'a/b' and 'a//b' both have key 'a/b'"):
            tf1.export(sess)


def test_tf1_assign_from_a_saver_checkpoint(tmp_path):
    with tf.Graph().as_default(), v1.Session() as sess:
        _, _, variables = batch_norm_graph()
        sess.run(v1.global_variables_initializer())
        sess.run([v.assign(tf.fill(v.shape, 3.0)) for v in variables])
        prefix = v1.train.Saver().save(sess, str(tmp_path / "train" / "model.ckpt"), global_step=500)
        assert prefix.endswith("model.ckpt-500")
    with tf.Graph().as_default(), v1.Session() as sess:
        _, _, variables = batch_norm_graph()
        sess.run(v1.global_variables_initializer())
        report = tf1.assign(sess, prefix)
        assert len(report.assigned) == 5
        assert all(np.all(value == 3.0) for value in sess.run(variables))


# --- Keras files and TF2 checkpoints into separately built models --------------------------

APPLICATIONS = {
    "MobileNetV2": lambda: keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None,
                                                          classes=5),
    "EfficientNetB0": lambda: keras.applications.EfficientNetB0(input_shape=(32, 32, 3), weights=None, classes=5),
    "ResNet50": lambda: keras.applications.ResNet50(input_shape=(32, 32, 3), weights=None, classes=5),
}


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.encoder = keras.layers.Dense(6, activation="relu")
        self.norm = keras.layers.BatchNormalization()
        self.head = keras.layers.Dense(2)

    def call(self, x, training=False):
        return self.head(self.norm(self.encoder(x), training=training))


def scramble(model, seed=0):
    """Give every variable distinct values, so a wrong pairing changes the predictions."""
    rng = np.random.default_rng(seed)
    for var in model.weights:
        value = rng.standard_normal(var.shape, dtype=np.float32) * np.float32(0.05)  # float32: half the work
        if "variance" in var.path:
            value = np.abs(value) + np.float32(0.5)
        var.assign(value.astype(var.dtype))


@pytest.fixture(scope="module")
def keras_files(tmp_path_factory):
    """Per architecture, made when a test first asks for it (``-m "not slow"`` builds no
    ResNet50): its builder, an input, the original's predictions, and the files Keras wrote."""
    folder = tmp_path_factory.mktemp("keras")
    made = {}

    def files_of(name):
        if name not in made:
            made[name] = _write_keras_files(name, folder)
        return made[name]

    return files_of


def _write_keras_files(name, folder):
    build = {**APPLICATIONS, "Subclassed": Subclassed}[name]
    model = build()
    x = np.random.default_rng(1).random((1, 4) if name == "Subclassed" else (1, 32, 32, 3)).astype("float32")
    if not model.built:  # a subclassed model gets its variables on its first call; an application has them
        model(x)
    scramble(model)
    files = {"weights": folder / f"{name}.weights.h5"}
    model.save_weights(files["weights"])
    if name in ("MobileNetV2", "Subclassed"):  # a .keras file holds the same layout: two are enough
        files["keras"] = folder / f"{name}.keras"
        model.save(files["keras"])
    return build, x, np.asarray(model(x)), files


@pytest.mark.parametrize("name", [*(pytest.param(name, marks=pytest.mark.slow) for name in APPLICATIONS),
                                  "Subclassed"])
def test_keras_files_assign_into_a_separately_built_instance(keras_files, name):
    build, x, expected, files = keras_files(name)
    model = build()  # built again: Keras numbers its layers differently (dense_3 for dense)
    if not model.built:
        model(x)
    keys = sorted(tf2.export(model))
    for path in files.values():
        scramble(model, seed=3)
        report = tf2.assign(model, path)
        assert report.ok and sorted(report.assigned) == keys
        np.testing.assert_array_equal(np.asarray(model(x)), expected)
    for path in files.values():  # in the model's own order, as tf2.export gives it, whatever the file's
        assert list(tf2.load(model, path)) == list(tf2.export(model))


def test_a_bfloat16_keras_file_assigns_as_load_weights_reads_it(tmp_path):
    """Keras stores bfloat16 as raw two-byte values labelled dtype="bfloat16"; they were
    refused as 'unknown dtype V2'. A label that does not fit the bytes is no label."""
    import h5py

    def build():
        return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, dtype="bfloat16")])

    model = build()
    scramble(model)
    model.save_weights(tmp_path / "bf.weights.h5")
    model.save(tmp_path / "bf.keras")
    x = np.random.default_rng(5).random((2, 3)).astype("float32")
    for path in (tmp_path / "bf.weights.h5", tmp_path / "bf.keras"):
        fresh, by_keras = build(), build()
        assert tf2.assign(fresh, path).ok
        by_keras.load_weights(path)
        np.testing.assert_array_equal(np.asarray(fresh(x)), np.asarray(by_keras(x)))
    assert ws.load(tmp_path / "bf.weights.h5")["layers/dense/vars/0"].dtype == ml_dtypes.bfloat16
    with h5py.File(tmp_path / "odd.h5", "w") as handle:
        handle["w"] = np.zeros(3, ml_dtypes.bfloat16)
        handle["w"].attrs["dtype"] = "float32"  # four bytes a value: not these two
    with pytest.raises(FormatError, match="is raw bytes"):
        ws.load(tmp_path / "odd.h5")


def keras_pair():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense"),
                              keras.layers.BatchNormalization(name="bn")])
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense"),
                              keras.layers.Dense(3, name="out")])
    return model, other


def test_a_keras_file_of_another_architecture_is_reported_without_wrong_hints(tmp_path):
    model, other = keras_pair()
    model.save_weights(tmp_path / "m.weights.h5")
    with pytest.raises(AssignmentError) as caught:
        tf2.assign(other, tmp_path / "m.weights.h5")
    message = str(caught.value)
    assert "no value for variable 'out/kernel'" in message
    assert "no variable 'layers/batch_normalization/vars/3'" in message
    assert "did you mean" not in message  # never 'gamma' for 'vars/3' (which is moving_variance)


def test_not_strict_warns_when_file_and_model_look_like_different_architectures(tmp_path):
    model = keras.Sequential([keras.Input((4,))] + [keras.layers.Dense(4) for _ in range(3)])
    model.save_weights(tmp_path / "m.weights.h5")
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)] + [keras.layers.Dense(3) for _ in range(3)])
    with pytest.warns(AssignWarning, match=r"m\.weights\.h5 \(strict=False\) left 6 of 8 variables as they were; "
                                           r"2 of 6 values fit a variable \(6 share a key with one\): the weights "
                                           r"and the model look like different architectures"):
        report = tf2.assign(other, tmp_path / "m.weights.h5", strict=False)
    assert len(report.assigned) == 2


def test_not_strict_says_when_the_keys_pair_and_only_the_dtypes_differ():
    holder = {name: tf.Variable(np.zeros(3, np.float16)) for name in "abcd"}
    values = {name: np.ones(3, np.float32) for name in "abcd"}
    values["a"] = np.ones(3, np.float16)
    with pytest.warns(AssignWarning, match=r"1 of 4 values fit a variable \(4 share a key with one\): most keys pair, "
                                           r"but their dtypes differ \(report.mismatched lists each; cast=True"):
        report = tf2.assign(holder, values, strict=False)
    assert report.assigned == ["a"] and len(report.mismatched) == 3


def test_assigning_into_an_unbuilt_model_says_to_build_it(tmp_path):
    model = Subclassed()
    with pytest.raises(AssignmentError, match=r"not built.*call it on a batch of inputs, or model.build"):
        tf2.assign(model, {"head/kernel": np.zeros((6, 2), np.float32)})


def small_net(name=None, compiled=False):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2)], name=name)
    if compiled:
        model.compile(keras.optimizers.Adam(0.1), "mse")
        model.optimizer.build(model.trainable_variables)
    return model


@pytest.fixture(scope="module")
def trained():
    """A small net trained two epochs with Adam (its slots filled, its step counted), for the tests
    that save it and its optimizer and assign them elsewhere: trained once, as none of them
    changes it (a fit traces a training step, about 1 CPU-s each)."""
    model = small_net()
    model.compile(keras.optimizers.Adam(0.1), "mse")
    model.fit(np.random.default_rng(0).random((16, 4)), np.ones((16, 2)), epochs=2, verbose=0)
    return model


@pytest.mark.parametrize("written", ["save", "write"])  # write: no ``checkpoint`` state file, the folder's only one
@pytest.mark.parametrize("layout", ["model=", "root"])
def test_tf2_checkpoint_with_optimizer_state_assigns_the_model_only(tmp_path, layout, written, trained):
    model = trained
    checkpoint = (tf.train.Checkpoint(model=model, optimizer=model.optimizer) if layout == "model="
                  else tf.train.Checkpoint(model))
    prefix = (checkpoint.save(str(tmp_path / "ckpt" / "ckpt")) if written == "save"
              else checkpoint.write(str(tmp_path / "ckpt" / "ckpt-1")))
    x = np.random.default_rng(2).random((3, 4)).astype("float32")
    for path in (prefix, tmp_path / "ckpt"):
        fresh = small_net()  # no optimizer: its state must be left out
        report = tf2.assign(fresh, path)
        assert report.ok and sorted(report.assigned) == sorted(tf2.export(fresh))
        np.testing.assert_array_equal(np.asarray(fresh(x)), np.asarray(model(x)))
        loaded = tf2.load(fresh, path)  # ws.load with the model at hand: keyed like tf2.export
        assert loaded.keys() == tf2.export(model).keys()
        assert all(np.array_equal(loaded[key], value) for key, value in tf2.export(model).items())


def test_optimizer_state_is_assigned_when_asked_for(tmp_path, trained):
    model = trained
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ckpt" / "ckpt"))
    model.save_weights(tmp_path / "m.weights.h5")
    expected = tf2.export(model, optimizer=True)
    assert "optimizer/vars/0" in expected and len(expected) > len(tf2.export(model))
    for path in (prefix, tmp_path / "m.weights.h5"):
        fresh = small_net(compiled=True)
        report = tf2.assign(fresh, path, optimizer=True)
        assert report.ok and sorted(report.assigned) == sorted(expected)
        got = tf2.export(fresh, optimizer=True)
        assert all(np.array_equal(got[key], value) for key, value in expected.items())
    with pytest.raises(ws.errors.SelectionError, match=r"has no built optimizer: compile it and build its optimizer "
                                                       r"\(model.optimizer.build\(model.trainable_variables\)\)"):
        tf2.assign(small_net(), prefix, optimizer=True)


def test_optimizer_state_into_an_unbuilt_or_other_optimizer_changes_nothing(tmp_path, trained):
    """An unbuilt Adam holds its step and rate but no slots, an SGD fewer variables than an Adam:
    asked for the optimizer state, an assign of either must not write half of it."""
    model = trained
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ckpt" / "ckpt"))
    model.save_weights(tmp_path / "m.weights.h5")
    ws.save(tmp_path / "m.npz", tf2.export(model, optimizer=True))
    for path in (prefix, tmp_path / "m.weights.h5", tmp_path / "m.npz"):
        unbuilt = small_net()
        unbuilt.compile(keras.optimizers.Adam(0.1), "mse")
        with pytest.raises(ws.errors.SelectionError, match=r"has no built optimizer"):
            tf2.assign(unbuilt, path, optimizer=True)
        other = small_net()
        other.compile(keras.optimizers.SGD(0.1), "mse")
        other.optimizer.build(other.trainable_variables)
        before = tf2.export(other, optimizer=True)
        with pytest.raises(AssignmentError, match=r"nothing was changed[\s\S]*unexpected[\s\S]*no variable 'optimizer/"):
            tf2.assign(other, path, optimizer=True)
        after = tf2.export(other, optimizer=True)
        assert all(np.array_equal(after[key], value) for key, value in before.items())


def test_optimizer_state_in_a_store_is_left_out_unless_asked_for(tmp_path, trained):
    model = trained
    ws.save(tmp_path / "m.npz", tf2.export(model, optimizer=True))
    model.save_weights(tmp_path / "m.weights.h5")
    ws.save(tmp_path / "keras-keyed.npz", ws.load(tmp_path / "m.weights.h5"))  # layers/dense/vars/0, optimizer/vars/3
    x = np.random.default_rng(2).random((3, 4)).astype("float32")
    for path in (tmp_path / "m.npz", tmp_path / "keras-keyed.npz"):
        fresh = small_net()
        report = tf2.assign(fresh, path)
        assert report.ok and sorted(report.assigned) == sorted(tf2.export(model))
        assert len(report.left_out) == len(model.optimizer.variables)
        assert all(key.startswith("optimizer/vars/") for key in report.left_out)
        assert "tf1 and tf2 assign them with optimizer=True" in str(report)
        np.testing.assert_array_equal(np.asarray(fresh(x)), np.asarray(model(x)))


@pytest.fixture
def mixed_precision():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_a_mixed_precision_models_optimizer_state_resumes_training(tmp_path, mixed_precision):
    """Keras wraps a mixed-precision model's optimizer in a LossScaleOptimizer and saves the
    wrapped optimizer's slots twice (``optimizer/vars/<i>`` and
    ``optimizer/inner_optimizer/vars/<i>``), a TF checkpoint once; a strict assign must take
    the whole file, and training resumed from it must go on as from Keras's own loader."""
    x, y = np.random.default_rng(0).random((16, 4)).astype("float32"), np.ones((16, 2), "float32")

    def compiled():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2, dtype="float32")])
        model.compile(keras.optimizers.Adam(0.1), "mse")
        model.optimizer.build(model.trainable_variables)
        return model

    model = compiled()
    model.fit(x, y, epochs=2, verbose=0)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    model.save(tmp_path / "m.keras")
    ws.save(tmp_path / "m.npz", tf2.export(model, optimizer=True))
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(str(tmp_path / "ckpt" / "ckpt"))
    reference = keras.models.load_model(tmp_path / "m.keras")
    loaded = tf2.export(reference, optimizer=True)
    reference.fit(x, y, epochs=1, verbose=0)
    for path in (tmp_path / "m.keras", tmp_path / "m.npz", prefix):
        fresh = compiled()
        report = tf2.assign(fresh, path, optimizer=True)
        assert report.ok and not report.unexpected and not report.left_out
        assigned = tf2.export(fresh, optimizer=True)  # every weight and slot as Keras's own loader left them
        assert assigned.keys() == loaded.keys() and all(np.array_equal(assigned[k], loaded[k]) for k in loaded)
        fresh.fit(x, y, epochs=1, verbose=0)  # two traced training steps may round a last bit apart under load,
        # which relative to an output near zero (0.0025 off by 3e-8 in one run) is more than 1e-5 of it
        np.testing.assert_allclose(np.asarray(fresh(x)), np.asarray(reference(x)), rtol=1e-5, atol=1e-6)
    exported = tf2.export(model, optimizer=True)  # each variable once: the inner slots under their first key
    assert not any(key.startswith("optimizer/inner_optimizer/") for key in exported)
    without = tf2.assign(compiled(), tmp_path / "m.npz")  # the state a store holds is listed, not assigned
    assert without.ok and len(without.left_out) == len(model.optimizer.variables)


def test_a_model_variable_keyed_like_optimizer_state_is_assigned_as_any_other():
    class Holder(tf.Module):
        def __init__(self):
            super().__init__()
            self.vars = [tf.Variable(tf.zeros(2))]

    class Model(tf.Module):
        def __init__(self):
            super().__init__()
            self.optimizer = Holder()  # a part of the model that happens to be called so

    model = Model()
    assert tf2.keys(model) == ["optimizer/vars/0"]
    report = tf2.assign(model, {"optimizer/vars/0": np.ones(2, np.float32)})
    assert report.ok and report.assigned == ["optimizer/vars/0"] and not report.left_out
    assert model.optimizer.vars[0].numpy().tolist() == [1.0, 1.0]


def test_a_file_of_one_member_assigns_under_its_scope_in_an_ensemble(tmp_path):
    single = small_net()
    x = np.random.default_rng(4).random((3, 4)).astype("float32")
    single(x)
    scramble(single)
    single.save_weights(tmp_path / "m.weights.h5")
    inputs = keras.Input((4,))
    members = [small_net(name="model_001"), small_net(name="model_002")]
    ensemble = keras.Model(inputs, [member(inputs) for member in members])
    before = np.asarray(ensemble(x)[0])
    report = tf2.assign(ensemble, tmp_path / "m.weights.h5", scope="model_002")
    assert report.ok and all(key.startswith("model_002/") for key in report.assigned) and len(report.assigned) == 8
    np.testing.assert_array_equal(np.asarray(ensemble(x)[1]), np.asarray(single(x)))
    np.testing.assert_array_equal(np.asarray(ensemble(x)[0]), before)
    with pytest.raises(ws.errors.SelectionError, match=r"has no layer or module at scope 'model_003' to pair a file"):
        tf2.assign(ensemble, tmp_path / "m.weights.h5", scope="model_003")


def test_tf2_checkpoint_of_another_model_names_the_file(tmp_path):
    model, _ = keras_pair()
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt-7"))
    unrelated = tf.Module()
    unrelated.w = tf.Variable(tf.zeros([2]))
    refusal = r"ckpt-7: no part of this checkpoint has the structure of the model"
    with pytest.raises(FormatError, match=refusal) as caught:
        tf2.assign(unrelated, prefix)
    assert (caught.value.path, caught.value.key) == (prefix, None)


def test_an_ensembles_tf2_checkpoint_given_to_one_member_says_where_the_members_are(tmp_path):
    """``tf.train.Checkpoint(model=ensemble)`` holds each member deeper than a model's own node is
    looked for: given to a lone member, it said no part of the checkpoint had the member's
    structure, when three did. It names them, and the ensemble's load takes one out."""
    inputs = keras.Input((4,))
    members = [small_net(name=f"model_00{i}") for i in (1, 2, 3)]
    ensemble = keras.Model(inputs, [member(inputs) for member in members])
    rng = np.random.default_rng(3)
    for var in ensemble.weights:
        var.assign(rng.normal(size=var.shape).astype(var.dtype))
    prefix = tf.train.Checkpoint(model=ensemble).write(str(tmp_path / "ensemble"))
    lone = small_net()
    with pytest.raises(FormatError) as caught:
        tf2.assign(lone, prefix)
    assert caught.value.path == prefix
    assert str(caught.value).startswith(
        f"{prefix}: the model (Sequential) is not the checkpoint's, nor a part near its root: the checkpoint holds it "
        "deeper, 3 times, at 'model/_operations/1', 'model/_operations/2', 'model/_operations/3' (an ensemble's members)")
    second = {key.removeprefix("model_002/"): value for key, value in tf2.load(ensemble, prefix).items()
              if key.startswith("model_002/")}
    tf2.assign(lone, second)
    x = rng.normal(size=(5, 4)).astype("float32")
    np.testing.assert_array_equal(lone(x), members[1](x))


def test_a_keras_file_into_a_tf_module_is_refused_naming_the_file(tmp_path):
    model, _ = keras_pair()
    model.save_weights(tmp_path / "m.weights.h5")
    module = tf.Module()
    module.w = tf.Variable(tf.zeros([2]))
    with pytest.raises(AssignmentError, match=r"m\.weights\.h5: a Keras file pairs with the Keras model or layer "
                                              r"that saved it, not a Module") as caught:
        tf2.assign(module, tmp_path / "m.weights.h5")
    assert caught.value.path == str(tmp_path / "m.weights.h5")


def test_a_damaged_checkpoint_is_a_weightstore_error_naming_the_file(tmp_path):
    model, _ = keras_pair()
    prefix = tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt-7"))
    index = tmp_path / "ckpt-7.index"
    index.write_bytes(index.read_bytes()[:40])
    with pytest.raises(ws.errors.WeightStoreError, match="ckpt-7"):
        tf2.assign(model, prefix)


# --- selection and reports -----------------------------------------------------------------

def test_also_keeps_batch_norm_statistics_with_trainable_only():
    model, _ = keras_pair()
    kept = tf2.export(model, trainable_only=True, also="bn/moving_*")
    assert sorted(kept) == ["bn/beta", "bn/gamma", "bn/moving_mean", "bn/moving_variance", "dense/bias",
                            "dense/kernel"]
    assert sorted(tf2.export(model, trainable_only=True)) == ["bn/beta", "bn/gamma", "dense/bias", "dense/kernel"]
    report = tf2.assign(model, kept, trainable_only=True, also="*/moving_*")
    assert report.ok and len(report.assigned) == 6


def test_report_reads_as_one_short_paragraph():
    report = Report(assigned=[f"layer_{i}/kernel" for i in range(500)], missing=["a", "b", "c", "d"],
                    skipped=["s"])
    assert str(report) == ("assigned 500 variables; 1 skipped as unchanged: 's'; "
                           "4 missing (no value): 'a', 'b', 'c' and 1 more.")
    assert repr(report) == "Report(assigned=500, missing=4, unexpected=0, mismatched=0, skipped=1, left_out=0)"


# --- the follower's current version ----------------------------------------------------------

def test_follower_version_stays_readable_while_held_then_is_gone(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="d")])
    ws.publish(tmp_path, {"d/kernel": np.ones((2, 2), np.float32), "d/bias": np.zeros(2, np.float32)}, step=1)
    with Follower(model, tmp_path, poll=0.005) as follower:
        first = follower.wait(1, timeout=30)
        time.sleep(0.05)  # the follow loop has moved past the version it yielded
        with follower.reading():
            assert np.all(ws.load(follower.version)["d/kernel"] == 1)
        store = ws.open(first)
        for step in (2, 3):
            ws.publish(tmp_path, {"d/kernel": np.full((2, 2), step, np.float32), "d/bias": np.zeros(2, np.float32)},
                       step=step, keep=1)
            follower.wait(step, timeout=30)
        assert np.all(store["d/kernel"] == 1)  # a store opened while current stays readable while held
        store.close()
        with pytest.raises(VersionGoneError, match="version 1 is gone"):
            ws.load(first)  # pruned once released


def test_follower_calls_that_would_deadlock_inside_reading_raise(tmp_path):
    """wait(), stop() or a second reading() inside a reading() block would wait for a swap that
    waits for the block: each raises at once, and the follower goes on."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="d")])
    ws.publish(tmp_path, {"d/kernel": np.ones((2, 2), np.float32), "d/bias": np.zeros(2, np.float32)}, step=1)
    with Follower(model, tmp_path, poll=0.005) as follower:
        follower.wait(1, timeout=30)
        with follower.reading():
            for call in (lambda: follower.wait(2, timeout=1), follower.stop, follower.reading().__enter__):
                with pytest.raises(RuntimeError, match="inside reading()"):
                    call()
        ws.publish(tmp_path, {"d/kernel": np.full((2, 2), 2, np.float32), "d/bias": np.zeros(2, np.float32)}, step=2)
        assert follower.wait(2, timeout=30).step == 2


def test_a_follower_stopped_and_started_again_runs_one_loop(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="d")])
    ws.publish(tmp_path, {"d/kernel": np.ones((2, 2), np.float32), "d/bias": np.zeros(2, np.float32)}, step=1)
    follower = Follower(model, tmp_path, poll=0.005).start()
    follower.wait(1, timeout=30)
    follower.stop(timeout=0)  # the loop may still be running: it must end on its own
    follower.start()
    ws.publish(tmp_path, {"d/kernel": np.full((2, 2), 2, np.float32), "d/bias": np.zeros(2, np.float32)}, step=2)
    assert follower.wait(2, timeout=30).step == 2
    time.sleep(0.1)
    loops = [t for t in threading.enumerate() if t.name == f"weightstore-follower {tmp_path}"]
    follower.stop()
    assert len(loops) == 1


@pytest.mark.parametrize("words", [{"poll": float("nan")}, {"poll": float("inf")}, {"poll": -1.0}, {"poll": 1e12},
                                   {"max_poll": float("nan")}, {"after": "0"}, {"after": -1}, {"after": 1.5}])
def test_a_follower_refuses_words_no_thread_can_follow_when_made(tmp_path, words):
    """Refused by the constructor, as follow() refuses them: not on the following thread, whose
    failure shows only at the first wait."""
    with pytest.raises(ValueError, match=f"{next(iter(words))} must"):
        Follower(keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)]), tmp_path, **words)


def test_tf1_checkpoint_with_empty_name_segments_assigns_strictly(tmp_path):
    """A Saver checkpoint of a graph built under ``variable_scope("")`` reads with the keys the
    TF1 adapter gives those variables, so a strict assign from the checkpoint finds every one."""
    def build():
        with tf.compat.v1.variable_scope("model_001"), tf.compat.v1.variable_scope(""):
            return tf.compat.v1.get_variable("conv_1/kernel", initializer=np.arange(6, dtype=np.float32))

    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        kernel = build()
        assert kernel.op.name == "model_001//conv_1/kernel"
        sess.run(tf.compat.v1.global_variables_initializer())
        prefix = tf.compat.v1.train.Saver().save(sess, str(tmp_path / "model.ckpt"))
    assert sorted(ws.load(prefix)) == ["model_001/conv_1/kernel"]
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        kernel = build()
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(kernel.assign(np.zeros(6, np.float32)))
        report = tf1.assign(sess, prefix)
        assert report.assigned == ["model_001/conv_1/kernel"]
        np.testing.assert_array_equal(sess.run(kernel), np.arange(6, dtype=np.float32))


# -- Keras sharded weights (save_weights(..., max_shard_size=...)) ------------------------------

def _sharded_weights(tmp_path):
    """A model and the sharded weights Keras wrote of it: the map and several shards."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(256), keras.layers.BatchNormalization(),
                              keras.layers.Dense(64), keras.layers.Dense(3)])
    model(np.zeros((1, 8), np.float32))
    path = tmp_path / "m.weights.json"
    model.save_weights(str(path), max_shard_size=0.00007)  # 70 KB: the 64 KB kernel alone in a shard
    return model, path


def test_keras_sharded_weights_assign_as_load_weights_restores_them(tmp_path):
    model, path = _sharded_weights(tmp_path)
    assert len(list(tmp_path.glob("m_*.weights.h5"))) >= 2
    fresh, theirs = (keras.models.clone_model(model) for _ in range(2))
    theirs.load_weights(str(path))
    report = tf2.assign(fresh, path)
    assert not report.missing and not report.unexpected
    x = np.random.default_rng(0).normal(size=(5, 8)).astype(np.float32)
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), theirs.predict(x, verbose=0))
    np.testing.assert_array_equal(fresh.predict(x, verbose=0), model.predict(x, verbose=0))
    with ws.open(path) as store:  # one store with the keys the unsharded file would have
        assert "layers/dense/vars/0" in store and store["layers/dense/vars/0"].shape == (8, 256)


@pytest.mark.parametrize(("edit", "words"), [
    (lambda m: {**m, "weight_map": {"/layers/dense/vars": ["../elsewhere.weights.h5"]}}, "not a shard in its folder"),
    (lambda m: {**m, "weight_map": {"/layers/dense/vars": "gone_00009.weights.h5"}}, "which is not in its folder"),
    (lambda m: {"metadata": {}}, "holds no weight_map"),
    (lambda m: [m], "holds no weight_map"),
])
def test_a_hostile_keras_sharded_map_is_refused_naming_it(tmp_path, edit, words):
    import json

    _, path = _sharded_weights(tmp_path)
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(ws.FormatError, match=words) as caught:
        ws.load(path)
    assert caught.value.path == str(path)


def test_a_tensor_in_two_keras_shards_is_refused(tmp_path):
    import json
    import shutil

    _, path = _sharded_weights(tmp_path)
    weight_map = json.loads(path.read_text())
    first = sorted(tmp_path.glob("m_*.weights.h5"))[0]
    shutil.copy(first, tmp_path / "m_09999.weights.h5")
    weight_map["weight_map"]["/copy"] = ["m_09999.weights.h5"]
    path.write_text(json.dumps(weight_map))
    with pytest.raises(ws.FormatError, match="both hold this tensor"):
        ws.load(path)
