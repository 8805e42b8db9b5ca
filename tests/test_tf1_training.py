"""A TF1 training checkpoint (``MonitoredTrainingSession``, Adam, a global step) into an inference
graph, as the README writes it: optimizer state and the step counter left out and reported."""

from __future__ import annotations

import contextlib
import os
import shutil

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from weightstore.adapters import tf1  # noqa: E402
from weightstore.errors import AssignmentError, SelectionError  # noqa: E402

v1 = tf.compat.v1
MODEL = ["bn/moving_mean", "hidden/bias", "hidden/kernel", "out/kernel"]
TRAINING = ["beta1_power", "beta2_power", "global_step", "hidden/bias/Adam", "hidden/bias/Adam_1",
            "hidden/kernel/Adam", "hidden/kernel/Adam_1", "out/kernel/Adam", "out/kernel/Adam_1"]


def model(x):
    """Two dense layers and a batch-norm-like statistic (non-trainable, updated in UPDATE_OPS)."""
    kernel = v1.get_variable("hidden/kernel", (3, 4))
    bias = v1.get_variable("hidden/bias", (4,), initializer=v1.zeros_initializer())
    mean = v1.get_variable("bn/moving_mean", (4,), initializer=v1.zeros_initializer(), trainable=False)
    hidden = tf.matmul(x, kernel) + bias
    v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, v1.assign(mean, 0.9 * mean + 0.1 * tf.reduce_mean(hidden, 0)))
    return tf.matmul(hidden - mean, v1.get_variable("out/kernel", (4, 1)))


def training_graph():
    x = v1.placeholder(tf.float32, (None, 3))
    loss = tf.reduce_mean(model(x) ** 2)
    step = v1.train.get_or_create_global_step()
    with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
        train = v1.train.AdamOptimizer(0.01).minimize(loss, global_step=step)
    return x, train


@pytest.fixture(scope="module")
def train_dir(tmp_path_factory):
    """A model dir as ``MonitoredTrainingSession`` leaves it after 6 Adam steps: ``model.ckpt-6`` and its ``.meta``."""
    folder = tmp_path_factory.mktemp("train")
    with tf.Graph().as_default():
        x, train = training_graph()
        with v1.train.MonitoredTrainingSession(checkpoint_dir=str(folder), save_checkpoint_steps=6,
                                               save_summaries_steps=None) as sess:
            for _ in range(6):
                sess.run(train, {x: np.ones((2, 3), np.float32)})
    return folder


@contextlib.contextmanager
def inference_session(scope="model_002"):
    with tf.Graph().as_default() as graph, v1.Session(graph=graph) as sess:
        with v1.variable_scope(scope):
            model(v1.placeholder(tf.float32, (None, 3)))
        sess.run(v1.global_variables_initializer())
        yield sess


def checkpoint_values(folder):
    reader = tf.train.load_checkpoint(str(folder))
    return {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()}


def scoped_values(sess, scope="model_002"):
    return {key.removeprefix(f"{scope}/"): value for key, value in tf1.export(sess).items()}


def without_meta(train_dir, tmp_path):
    for name in os.listdir(train_dir):
        if name.startswith("model.ckpt-6.") and not name.endswith(".meta"):
            shutil.copy(train_dir / name, tmp_path / name)
    return str(tmp_path / "model.ckpt-6")


@pytest.mark.parametrize("meta", [True, False], ids=["from .meta", "by slot naming"])
def test_training_checkpoint_assigns_into_an_inference_graph(train_dir, tmp_path, meta):
    path = str(train_dir / "model.ckpt-6") if meta else without_meta(train_dir, tmp_path)
    with inference_session() as sess:
        report = tf1.assign(sess, path, scope="model_002")
        assert sorted(report.assigned) == [f"model_002/{key}" for key in MODEL]
        assert sorted(report.left_out) == TRAINING
        saved = checkpoint_values(train_dir)
        for key, value in scoped_values(sess).items():
            np.testing.assert_array_equal(value, saved[key])
    assert str(report) == ("assigned 4 variables; 9 left out as training state (tf1 and tf2 assign them with "
                           "optimizer=True): 'beta1_power', 'beta2_power', 'global_step' and 6 more.")


def test_the_model_dir_itself_assigns_its_latest_checkpoint(train_dir):
    with inference_session() as sess:
        assert len(tf1.assign(sess, str(train_dir), scope="model_002").assigned) == 4


def test_optimizer_true_asks_for_slots_the_inference_graph_lacks(train_dir):
    """Asked for, the slots are unexpected; no hint offers the variable a slot is named after (it has its value)."""
    with inference_session() as sess, pytest.raises(AssignmentError) as caught:
        tf1.assign(sess, str(train_dir), scope="model_002", optimizer=True)
    message = str(caught.value)
    assert "9 unexpected (values with no variable):" in message
    assert "    no variable 'model_002/hidden/kernel/Adam'\n" in message
    assert "did you mean" not in message


def test_into_the_training_graph_optimizer_state_moves_only_when_asked(train_dir):
    saved = checkpoint_values(train_dir)
    with tf.Graph().as_default() as graph, v1.Session(graph=graph) as sess:
        training_graph()
        sess.run(v1.global_variables_initializer())
        report = tf1.assign(sess, str(train_dir))
        assert sorted(report.assigned) == MODEL and sorted(report.left_out) == TRAINING
        assert not np.array_equal(tf1.export(sess)["hidden/kernel/Adam"], saved["hidden/kernel/Adam"])
        report = tf1.assign(sess, str(train_dir), optimizer=True)
        assert sorted(report.assigned) == sorted(MODEL + TRAINING) and not report.left_out
        for key, value in tf1.export(sess).items():
            np.testing.assert_array_equal(value, saved[key])


def test_a_partitioned_model_s_training_checkpoint_leaves_its_slots_out_from_the_meta_too(tmp_path):
    """The .meta names a part's slot w/part_0/Adam, the checkpoint the whole w/Adam: the slots
    were reported unexpected, so the .meta made a strict assign fail where naming passed; so did
    an ExponentialMovingAverage shadow, which is no training op's input."""
    def partitioned(x):
        weight = v1.get_variable("w", (4, 2), partitioner=v1.fixed_size_partitioner(2))
        return tf.matmul(x, weight)

    batch = np.arange(12, dtype=np.float32).reshape(3, 4)
    with tf.Graph().as_default(), v1.Session() as sess:
        x = v1.placeholder(tf.float32, (None, 4))
        y = partitioned(x)
        train = v1.train.AdamOptimizer(0.1).minimize(tf.reduce_mean(y ** 2))
        with tf.control_dependencies([train]):  # an average of the weights, as many trainers keep
            train = v1.train.ExponentialMovingAverage(0.99).apply(v1.trainable_variables())
        sess.run(v1.global_variables_initializer())
        sess.run(train, {x: batch})
        prefix = v1.train.Saver().save(sess, str(tmp_path / "model.ckpt"))
        expected = sess.run(y, {x: batch})
    assert os.path.exists(prefix + ".meta")
    with tf.Graph().as_default() as graph, v1.Session(graph=graph) as sess:
        x = v1.placeholder(tf.float32, (None, 4))
        y = partitioned(x)
        graph.finalize()
        report = tf1.assign(sess, prefix)
        assert report.ok and sorted(report.left_out) == ["beta1_power", "beta2_power", "w/Adam", "w/Adam_1",
                                                         "w/ExponentialMovingAverage"]
        np.testing.assert_array_equal(sess.run(y, {x: batch}), expected)


def test_a_training_checkpoint_goes_into_keras_and_pytorch_without_its_training_state(train_dir):
    """The same Saver checkpoint (Adam's slots and beta powers, the global step) into a Keras
    model under an ensemble member's scope and into a PyTorch module ported by layout: both
    leave the training state out and list it, as tf1.assign does, where both refused the
    checkpoint naming every slot as a value with no variable."""
    keras = pytest.importorskip("keras")
    torch = pytest.importorskip("torch")
    from weightstore.adapters import tf2
    from weightstore.adapters import torch as torch_adapter

    saved = checkpoint_values(train_dir)

    def member(name):
        hidden, out = keras.layers.Dense(4, name="hidden"), keras.layers.Dense(1, use_bias=False, name="out")
        return keras.Sequential([keras.Input((3,)), hidden, out], name=name)

    inputs = keras.Input((3,))
    ensemble = keras.Model(inputs, [member("model_001")(inputs), member("model_002")(inputs)])
    report = tf2.assign(ensemble, str(train_dir), scope="model_002", exclude="bn")
    assert sorted(report.assigned) == ["model_002/hidden/bias", "model_002/hidden/kernel", "model_002/out/kernel"]
    assert sorted(report.left_out) == TRAINING
    exported = tf2.export(ensemble, scope="model_002")
    for key in ("hidden/kernel", "hidden/bias", "out/kernel"):
        np.testing.assert_array_equal(exported[key], saved[key])

    module = torch.nn.ModuleDict({"hidden": torch.nn.Linear(3, 4), "out": torch.nn.Linear(4, 1, bias=False)})
    report = torch_adapter.assign(module, str(train_dir), layout="keras", exclude="bn")
    assert sorted(report.assigned) == ["hidden/bias", "hidden/weight", "out/weight"]
    assert sorted(report.left_out) == TRAINING
    np.testing.assert_array_equal(module["hidden"].weight.detach().numpy(), saved["hidden/kernel"].T)


def test_ws_convert_by_layout_leaves_a_training_checkpoints_state_out_and_says_so(train_dir, tmp_path):
    """`ws convert ckpt t.safetensors --layout keras-to-torch` refused every slot, beta power and
    the step (no layout rule converts them) and has no --exclude: it leaves them out now, as an
    assign does, and its caution line lists them."""
    from typer.testing import CliRunner

    import weightstore as ws
    from weightstore.cli.main import app

    out = tmp_path / "t.safetensors"
    result = CliRunner().invoke(app, ["convert", str(train_dir / "model.ckpt-6"), str(out), "--layout", "keras-to-torch"])
    assert result.exit_code == 0, result.output
    assert "left out 9 tensors of training state: 'beta1_power', 'beta2_power', 'global_step'" in result.output
    converted = ws.load(out)
    assert sorted(converted) == ["bn/running_mean", "hidden/bias", "hidden/weight", "out/weight"]
    np.testing.assert_array_equal(converted["hidden/weight"], checkpoint_values(train_dir)["hidden/kernel"].T)


@pytest.mark.parametrize("words", [{"mapping": {"hidden/kernel/Adam": "adam_kernel"}},
                                   {"include": "*/Adam"}], ids=["mapping", "include"])
def test_words_that_name_only_left_out_training_state_say_so(train_dir, words):
    """A word naming a slot the checkpoint holds was refused as matching "no key", which sent the
    user looking for a typo: the key is there, left out as training state until optimizer=True."""
    with inference_session() as sess:
        before = scoped_values(sess)
        with pytest.raises(SelectionError) as caught:
            tf1.assign(sess, str(train_dir), scope="model_002", **words)
        for key, value in scoped_values(sess).items():
            np.testing.assert_array_equal(value, before[key])
    message = str(caught.value)
    assert message.startswith(str(train_dir / "model.ckpt-6")) and "matches no key" not in message
    assert "'hidden/kernel/Adam'" in message and "training state" in message and "optimizer=True" in message


def test_an_ema_checkpoint_restores_its_averages_by_one_mapping_rule(tmp_path):
    """``Saver(ema.variables_to_restore())`` restores ``w`` from ``w/ExponentialMovingAverage``;
    the ``*/ExponentialMovingAverage=*`` rule (FROM and TO naming the end of a key) does the
    same: the shadow is read as ``w`` in place of the raw ``w``, a variable without a shadow
    (the batch-norm statistic) keeps its own value, and the training state is left out as ever."""
    batch = np.arange(6, dtype=np.float32).reshape(2, 3)
    with tf.Graph().as_default(), v1.Session() as sess:
        x, train = training_graph()
        ema = v1.train.ExponentialMovingAverage(0.5)
        with tf.control_dependencies([train]):
            train = ema.apply(v1.trainable_variables())
        sess.run(v1.global_variables_initializer())
        for _ in range(5):
            sess.run(train, {x: batch})
        prefix = v1.train.Saver().save(sess, str(tmp_path / "model.ckpt"))
    predictions = {}
    for how in ("saver", "weightstore", "into a renamed top scope"):
        with tf.Graph().as_default() as graph, v1.Session(graph=graph) as sess:
            x = v1.placeholder(tf.float32, (None, 3))
            with v1.variable_scope("student" if how == "into a renamed top scope" else ""):
                y = model(x)
            if how == "saver":
                v1.train.Saver(v1.train.ExponentialMovingAverage(0.5).variables_to_restore()).restore(sess, prefix)
            else:
                graph.finalize()
                renamed = how != "weightstore"  # the scope rule first: the end is rewritten all the same
                mapping = ["=student", "*/ExponentialMovingAverage=*"] if renamed else ["*/ExponentialMovingAverage=*"]
                report = tf1.assign(sess, prefix, mapping=mapping)
                assert report.ok and sorted(report.left_out) == TRAINING
                assert sorted(report.assigned) == [f"student/{key}" if renamed else key for key in MODEL]
            predictions[how] = sess.run(y, {x: batch})
    raw = tf.train.load_checkpoint(prefix)
    assert not np.array_equal(raw.get_tensor("out/kernel"), raw.get_tensor("out/kernel/ExponentialMovingAverage"))
    np.testing.assert_array_equal(predictions["weightstore"], predictions["saver"])
    np.testing.assert_array_equal(predictions["into a renamed top scope"], predictions["saver"])
