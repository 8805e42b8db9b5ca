"""The checkpoint adapter against files TensorFlow and Keras really write.

Checkpoints are made once per module (building graphs and Keras models is the slow part);
every test writes only under its own ``tmp_path``.
"""

from __future__ import annotations

import os
import shutil
import zipfile

import numpy as np
import pytest

import weightstore as ws
from weightstore.errors import FormatError, StoreNotFoundError

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from weightstore.adapters import checkpoints  # noqa: E402


def make_tf1(folder, *, meta: bool = True):
    """A TF1 Saver checkpoint with Adam slots, a global step, a partitioned and a string variable."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        w = tf.compat.v1.get_variable("model/dense/w", initializer=np.arange(6, dtype=np.float32).reshape(2, 3))
        b = tf.compat.v1.get_variable("model/dense/b", initializer=np.ones(3, np.float32))
        emb = tf.compat.v1.get_variable("model/emb", shape=[4, 2], partitioner=tf.compat.v1.fixed_size_partitioner(2))
        tf.compat.v1.get_variable("model/stats", initializer=np.zeros(3, np.float32), trainable=False)
        tf.Variable("a tag", name="tag", trainable=False)
        step = tf.compat.v1.train.get_or_create_global_step()
        loss = tf.reduce_sum(w * w) + tf.reduce_sum(b) + tf.reduce_sum(emb)
        train = tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss, global_step=step)
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(train)
        prefix = tf.compat.v1.train.Saver().save(sess, str(folder / "model.ckpt"), global_step=step,
                                                 write_meta_graph=meta)
    return prefix


class Net(tf.Module):
    def __init__(self):
        super().__init__()
        self.w = tf.Variable(np.arange(4, dtype=np.float32).reshape(2, 2), name="w")
        self.b = tf.Variable(np.zeros(2, np.float32), name="b")


def make_tf2_module(folder):
    """A tf.train.Checkpoint of a tf.Module with a compat.v1 Adam: slot variables and bookkeeping."""
    net, opt = Net(), tf.compat.v1.train.AdamOptimizer(0.1)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(net.w * net.w) + tf.reduce_sum(net.b)
    opt.apply_gradients(zip(tape.gradient(loss, [net.w, net.b]), [net.w, net.b]))
    return tf.train.Checkpoint(net=net, opt=opt).save(str(folder / "ckpt")), net


def make_keras(folder):
    """A trained Keras model saved as .weights.h5, .keras and a TF2 checkpoint with its optimizer."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="d1"),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(2, name="d2")])
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 3), np.float32), np.ones((8, 2), np.float32), verbose=0, epochs=1)
    model.save_weights(str(folder / "model.weights.h5"))
    model.save(str(folder / "model.keras"))
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(folder / "tf2" / "ckpt"))
    return model, prefix


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("made")
    (root / "tf1").mkdir(), (root / "tf1_nometa").mkdir(), (root / "module").mkdir()
    model, keras_prefix = make_keras(root)
    module_prefix, net = make_tf2_module(root / "module")
    return {
        "root": root,
        "tf1": make_tf1(root / "tf1"),
        "tf1_nometa": make_tf1(root / "tf1_nometa", meta=False),
        "module": module_prefix,
        "net": {"net/w": net.w.numpy(), "net/b": net.b.numpy()},
        "keras_ckpt": keras_prefix,
        "model": model,
    }


def raw(prefix):
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def test_tf1_keys_are_variable_names_and_values_match(made):
    expected = raw(made["tf1"])
    with checkpoints.open_source(made["tf1"]) as source:
        assert source.kind == "TF1 checkpoint"
        assert source.skipped == ["tag"]
        assert set(source.keys()) == set(expected) - {"tag"}
        assert {"model/dense/w/Adam", "model/dense/w/Adam_1", "global_step", "beta1_power"} <= set(source.keys())
        for key in source.keys():
            np.testing.assert_array_equal(source[key], expected[key])
        assert source["model/emb"].shape == (4, 2)  # partitioned, read whole


@pytest.mark.parametrize("spelling", ["prefix", "index", "data", "meta", "folder"])
def test_a_checkpoint_is_found_by_prefix_file_or_folder(made, spelling):
    prefix = made["tf1"]
    path = {"prefix": prefix, "index": prefix + ".index", "data": prefix + ".data-00000-of-00001",
            "meta": prefix + ".meta", "folder": os.path.dirname(prefix)}[spelling]
    assert checkpoints.checkpoint_prefix(path) == prefix


def test_trainable_keys_come_from_the_meta_graph(made):
    with checkpoints.open_source(made["tf1"]) as source:
        assert source.trainable_keys() == {"model/dense/w", "model/dense/b", "model/emb"}


def test_trainable_keys_without_meta_is_a_clear_error(made):
    with checkpoints.open_source(made["tf1_nometa"]) as source:
        with pytest.raises(FormatError, match=r"needs the graph file .*model\.ckpt-1\.meta, which is missing"):
            source.trainable_keys()
    with checkpoints.open_source(made["module"]) as source:
        with pytest.raises(FormatError, match="does not record which variables are trainable"):
            source.trainable_keys()


def test_tf2_keys_drop_attributes_bookkeeping_and_name_slots(made):
    with checkpoints.open_source(made["module"]) as source:
        assert source.kind == "TF2 object-based checkpoint"
        assert sorted(source.keys()) == [
            "net/b", "net/b/.OPTIMIZER_SLOT/opt/m", "net/b/.OPTIMIZER_SLOT/opt/v",
            "net/w", "net/w/.OPTIMIZER_SLOT/opt/m", "net/w/.OPTIMIZER_SLOT/opt/v",
            "opt/beta1_power", "opt/beta2_power",
        ]
        np.testing.assert_array_equal(source["net/w"], made["net"]["net/w"])


def test_tf2_keras_checkpoint_keeps_only_variables(made):
    expected = raw(made["keras_ckpt"])
    with checkpoints.open_source(made["keras_ckpt"]) as source:
        keys = source.keys()
        assert len(keys) == len(expected) - 1  # the object graph is left out
        assert not any(".ATTRIBUTES" in k or k.startswith("_CHECKPOINTABLE") for k in keys)
        for key in keys:
            np.testing.assert_array_equal(source[key], expected[key + checkpoints.VARIABLE_SUFFIX])


@pytest.mark.parametrize("name", ["model.weights.h5", "model.keras"])
def test_keras_files_read_as_their_hdf5_layout(made, name):
    model = made["model"]
    with checkpoints.open_source(made["root"] / name) as source:
        assert source.kind == "Keras weights file"
        np.testing.assert_array_equal(source["layers/dense/vars/0"], model.get_layer("d1").kernel.numpy())
        np.testing.assert_array_equal(source["layers/batch_normalization/vars/3"],
                                      model.get_layer("bn").moving_variance.numpy())
        assert len([k for k in source.keys() if k.startswith("layers/")]) == len(model.weights)


def test_keras_archive_config_is_never_read(made, tmp_path):
    archive = tmp_path / "odd.keras"
    with zipfile.ZipFile(made["root"] / "model.keras") as original, zipfile.ZipFile(archive, "w") as copy:
        copy.writestr("config.json", "this is not json and would break any deserializer")
        copy.writestr("model.weights.h5", original.read("model.weights.h5"))
    renamed = tmp_path / "weights_without_suffix"
    renamed.write_bytes(archive.read_bytes())
    for path in (archive, renamed):
        with checkpoints.open_source(path) as source:
            assert "layers/dense/vars/0" in source.keys()


def test_legacy_output_suffixes_are_dropped(tmp_path):
    import h5py

    with h5py.File(tmp_path / "legacy.h5", "w") as handle:
        handle["dense/dense/kernel:0"] = np.ones((2, 2), np.float32)
    with checkpoints.open_source(tmp_path / "legacy.h5") as source:
        assert source.keys() == ["dense/dense/kernel"]


def test_missing_and_junk_sources(tmp_path):
    with pytest.raises(StoreNotFoundError, match="no such file or checkpoint"):
        checkpoints.open_source(tmp_path / "absent.ckpt")
    (tmp_path / "junk.ckpt.index").write_bytes(b"not a table")
    with pytest.raises(FormatError, match="junk.ckpt: not a readable TensorFlow checkpoint"):
        checkpoints.open_source(tmp_path / "junk.ckpt")
    with pytest.raises(StoreNotFoundError, match="holds no 'checkpoint' state file"):
        checkpoints.open_source(tmp_path)


def restore_with_saver(prefix, shapes):
    """Values TF1's own Saver restores into fresh variables named by ``shapes``' keys."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        variables = {k: tf.compat.v1.get_variable(k, shape=s, dtype=tf.float32) for k, s in shapes.items()}
        tf.compat.v1.train.Saver(variables).restore(sess, prefix)
        return {k: sess.run(v) for k, v in variables.items()}


def test_write_checkpoint_is_read_by_saver_and_load_checkpoint(tmp_path):
    prefix = str(tmp_path / "out.ckpt")
    weights = {"a/w": np.arange(6, dtype=np.float32).reshape(2, 3), "a/b": np.ones(3, np.float32)}
    checkpoints.write_checkpoint(prefix, weights)
    restored = restore_with_saver(prefix, {k: v.shape for k, v in weights.items()})
    for key, value in weights.items():
        np.testing.assert_array_equal(restored[key], value)
    assert sorted(os.listdir(tmp_path)) == ["out.ckpt.data-00000-of-00001", "out.ckpt.index"]


def copy_checkpoint(prefix, folder):
    """A copy of the checkpoint at ``prefix`` in ``folder``, so a test may change it."""
    base = os.path.basename(prefix)
    for name in os.listdir(os.path.dirname(prefix)):
        if name.startswith(base + "."):
            shutil.copy(os.path.join(os.path.dirname(prefix), name), folder / name)
    return str(folder / base)


def test_write_checkpoint_merges_and_keeps_non_numeric_entries(made, tmp_path):
    target = copy_checkpoint(made["tf1"], tmp_path)
    before = raw(target)
    checkpoints.write_checkpoint(target, {"extra/v": np.full(2, 7.0, np.float32), "model/dense/b": np.zeros(3, np.float32)})
    after = raw(target)
    assert set(after) == set(before) | {"extra/v"}
    assert after["tag"] == before["tag"]
    np.testing.assert_array_equal(after["model/dense/b"], np.zeros(3, np.float32))
    np.testing.assert_array_equal(after["model/dense/w"], before["model/dense/w"])


def test_write_checkpoint_failure_leaves_the_old_one(tmp_path, monkeypatch):
    prefix = str(tmp_path / "keep.ckpt")
    checkpoints.write_checkpoint(prefix, {"w": np.ones(2, np.float32)})
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}

    def failing_replace(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints.os, "replace", failing_replace)
    with pytest.raises(OSError):
        checkpoints.write_checkpoint(prefix, {"w": np.zeros(2, np.float32)})
    monkeypatch.undo()
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_write_checkpoint_refuses_object_based_targets(made):
    with pytest.raises(FormatError, match="TF2 object-based checkpoint"):
        checkpoints.checkpoint_names(made["module"])


def test_stores_keep_their_kind_and_metadata(tmp_path):
    ws.save(tmp_path / "m.npz", {"w": np.ones(2)}, metadata={"run": 3})
    with checkpoints.open_source(tmp_path / "m.npz") as source:
        assert source.kind == "weightstore file"
        assert source.metadata == {"run": 3}
