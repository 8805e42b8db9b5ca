"""SavedModels (``tf.saved_model.save`` of a Keras model and of a ``tf.Module``, Keras's
``model.export()``), TF Serving bases and TensorBoard events files, written here by TF itself."""

import os
import shutil

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

import weightstore as ws  # noqa: E402
from weightstore.adapters import tf2  # noqa: E402

X = np.random.default_rng(6).normal(size=(4, 3)).astype("float32")


def dense_model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])


class Affine(tf.Module):
    def __init__(self, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.w = tf.Variable(rng.normal(size=(3, 2)).astype("float32"))
        self.inner = tf.Module()
        self.inner.b = tf.Variable(rng.normal(size=2).astype("float32"))

    @tf.function(input_signature=[tf.TensorSpec((None, 3), tf.float32)])
    def __call__(self, x):
        return x @ self.w + self.inner.b


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (folder, the object saved)."""
    root = tmp_path_factory.mktemp("saved_models")
    keras_model, exported, module, compiled = dense_model(), dense_model(), Affine(1), dense_model()
    tf.saved_model.save(keras_model, str(root / "keras"))
    exported.export(str(root / "export"), verbose=False)
    tf.saved_model.save(module, str(root / "module"))
    compiled.compile(keras.optimizers.Adam(0.1), "mse")  # its optimizer lists the kernels too
    compiled.fit(X, np.ones((4, 2), "float32"), verbose=0)
    tf.saved_model.save(compiled, str(root / "compiled"))
    return {"keras": (str(root / "keras"), keras_model), "export": (str(root / "export"), exported),
            "module": (str(root / "module"), module), "compiled": (str(root / "compiled"), compiled)}


@pytest.mark.parametrize("kind", ["keras", "export", "module"])
def test_ws_load_reads_a_saved_models_variables(saved, kind):
    folder, obj = saved[kind]
    loaded = ws.load(folder)
    values = sorted(np.asarray(v).tobytes() for v in loaded.values())
    assert set(values) == {np.asarray(v.numpy()).tobytes() for v in obj.variables}
    with ws.open(folder) as store:
        assert store.path == os.path.join(folder, "variables", "variables")


@pytest.mark.parametrize("kind", ["keras", "export", "module"])
def test_ws_ls_and_export_take_a_saved_model_folder(saved, kind, tmp_path):
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    folder, _ = saved[kind]
    listed = CliRunner().invoke(app, ["ls", folder])
    assert listed.exit_code == 0, listed.output
    done = CliRunner().invoke(app, ["export", folder, "-o", str(tmp_path / "w.npz")])
    assert done.exit_code == 0, done.output
    assert sorted(ws.load(tmp_path / "w.npz")) == sorted(ws.load(folder))


@pytest.mark.parametrize("kind", ["keras", "export"])
def test_a_keras_saved_model_assigns_into_a_fresh_instance(saved, kind):
    folder, model = saved[kind]
    fresh = dense_model()
    report = tf2.assign(fresh, folder)
    assert report.ok and len(report.assigned) == 4
    np.testing.assert_array_equal(fresh(X), model(X))


def test_a_module_saved_model_assigns_into_a_fresh_module(saved):
    folder, module = saved["module"]
    fresh = Affine(2)
    assert tf2.assign(fresh, folder).ok
    np.testing.assert_array_equal(fresh(X), module(X))


@pytest.mark.parametrize("kind", ["keras", "export", "module", "compiled"])
def test_export_of_a_loaded_saved_model_keys_as_the_folder_does(saved, kind):
    folder, _ = saved[kind]
    loaded = tf.saved_model.load(folder)
    exported = tf2.export(loaded)
    on_disk = ws.load(folder)
    assert sorted(exported) == sorted(on_disk)
    for key, value in exported.items():
        np.testing.assert_array_equal(value, on_disk[key])
    assert tf2.assign(loaded, {key: value + 1 for key, value in exported.items()}).ok
    assert tf2.assign(loaded, folder).ok  # and back from the folder itself: the two pair key by key
    restored = tf2.export(loaded)
    assert all(np.array_equal(restored[key], value) for key, value in on_disk.items())


def test_a_tf_serving_base_is_said_to_be_one(saved, tmp_path):
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    base = tmp_path / "base"
    for version in (1, 2):
        shutil.copytree(saved["keras"][0], base / str(version))
    # names TF Serving does not take as versions: str.isdigit() takes "²" (int() raised ValueError)
    # and int() takes "١" (Arabic-Indic one); like TF Serving, they are no versions
    for name in ("²", "\u0661", "1" * 200):
        shutil.copytree(saved["keras"][0], base / name)
    expected = (f"{base}: is a TF Serving model base (SavedModel versions 1, 2), not one model; name a version's "
                f"folder, such as {base / '2'}")
    with pytest.raises(ws.StoreNotFoundError) as caught:
        ws.load(base)
    assert str(caught.value) == expected
    assert sorted(ws.load(base / "2")) == sorted(ws.load(saved["keras"][0]))
    for command in (["versions", str(base)], ["follow", str(base), "--timeout", "1"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code != 0
        assert (f"{base}: is a TF Serving model base (SavedModel versions 1, 2), not a folder of ws.publish "
                f"versions; read one version with ws ls {base / '2'}") in " ".join(result.output.split())


def test_a_tensorboard_events_file_is_named_as_one(tmp_path):
    """Written as TF's event writer writes one (TensorBoard itself is not installed here): TFRecords of Events."""
    from tensorflow.core.util import event_pb2

    events = tmp_path / "events.out.tfevents.1796000000.host"
    with tf.io.TFRecordWriter(str(events)) as writer:
        writer.write(event_pb2.Event(wall_time=1.0, file_version="brain.Event:2").SerializeToString())
        writer.write(event_pb2.Event(wall_time=2.0, step=1).SerializeToString())
    with pytest.raises(ws.FormatError) as caught:
        ws.open(events)
    assert str(caught.value) == f"{events}: is a TFRecord file (a TensorBoard events file, or tf.data records), not weights"


def test_a_sharded_variable_assigns_from_a_tf2_checkpoint_across_other_shards(tmp_path):
    """Checkpoint.restore restores a ShardedVariable from its one whole tensor; so does assign, into any sharding."""
    sharded = tf.__internal__.distribute.ShardedVariable

    def holder(value, cuts):
        module = tf.Module()
        module.w = sharded([tf.Variable(part) for part in np.split(value, cuts)])
        return module

    value = np.arange(8, dtype=np.float32).reshape(4, 2)
    prefix = tf.train.Checkpoint(model=holder(value, [2])).save(str(tmp_path / "ckpt"))
    target = holder(np.zeros_like(value), [1, 2])
    assert tf2.assign(target, prefix).assigned == ["w"]
    np.testing.assert_array_equal(np.concatenate([shard.numpy() for shard in target.w.variables]), value)


class Pair(keras.layers.Layer):
    """Layers in a dict attribute, below a list."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.parts = {"a": keras.layers.Dense(3), "b": keras.layers.Dense(3)}

    def call(self, x):
        return self.parts["b"](self.parts["a"](x))


class ListHeld(keras.Model):
    """Layers in a plain Python list: Keras 3 tracks them, TF's checkpoint walk does not, and
    ``tf.saved_model.save`` saves them (under ``blocks/0``, ``blocks/1/parts/a``...)."""

    def __init__(self):
        super().__init__()
        self.blocks = [keras.layers.Dense(4), Pair()]
        self.head = keras.layers.Dense(2)

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_a_saved_model_of_layers_held_in_python_lists_assigns_as_tf_loads_it(tmp_path):
    model = ListHeld()
    expected = model(X)
    folder = str(tmp_path / "listed")
    tf.saved_model.save(model, folder)
    assert any(key.startswith("blocks/1/parts/a/") for key in ws.load(folder))
    fresh = ListHeld()
    fresh(X)
    report = tf2.assign(fresh, folder)
    assert report.ok and len(report.assigned) == 8
    served = tf.saved_model.load(folder).signatures["serving_default"](inputs=tf.constant(X))["output_0"]
    np.testing.assert_array_equal(fresh(X), served)
    np.testing.assert_array_equal(fresh(X), expected)
