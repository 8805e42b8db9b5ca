"""The checkpoint adapter against files TensorFlow and Keras really write.

Checkpoints are made once per module (building graphs and Keras models is the slow part);
every test writes only under its own ``tmp_path``.
"""

from __future__ import annotations

import os
import re
import signal
import zipfile

import numpy as np
import pytest

import weightstore as ws
from hostile import hostile_keras
from weightstore.errors import ChecksumError, FormatError, SelectionError, StoreNotFoundError, UnsafeFileError
from weightstore.formats.tf_checkpoint import OBJECT_GRAPH_KEY, CheckpointReader, resolve_prefix

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from tf_files import Net, copy_checkpoint, restore_with_saver, same_architecture  # noqa: E402
from weightstore.adapters import _checkpoints  # noqa: E402
from weightstore.adapters import tf2 as tf2_adapter  # noqa: E402
from weightstore.cli import sources  # noqa: E402


def raw(prefix):
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def test_tf1_keys_are_variable_names_and_values_match(made):
    expected = raw(made["tf1"])
    with sources.open_source(made["tf1"]) as source:
        assert source.kind == "TF1 checkpoint"
        assert source.skipped == ["tag"]
        assert set(source.keys()) == set(expected) - {"tag"}
        assert {"model/dense/w/Adam", "model/dense/w/Adam_1", "global_step", "beta1_power"} <= set(source.keys())
        for key in source:
            np.testing.assert_array_equal(source[key], expected[key])
        assert source["model/emb"].shape == (4, 2)  # partitioned, read whole


@pytest.mark.parametrize("spelling", ["prefix", "index", "data", "meta", "folder"])
def test_a_checkpoint_is_found_by_prefix_file_or_folder(made, spelling):
    prefix = made["tf1"]
    path = {"prefix": prefix, "index": prefix + ".index", "data": prefix + ".data-00000-of-00001",
            "meta": prefix + ".meta", "folder": os.path.dirname(prefix)}[spelling]
    assert resolve_prefix(path) == prefix


def test_trainable_keys_come_from_the_meta_graph(made):
    with sources.open_source(made["tf1"]) as source:
        assert source.trainable_keys() == {"model/dense/w", "model/dense/b", "model/emb"}


def test_trainable_keys_without_meta_is_a_clear_error(made):
    with (sources.open_source(made["tf1_nometa"]) as source,
          pytest.raises(FormatError, match=r"needs the graph file .*model\.ckpt-1\.meta, which is missing")):
        source.trainable_keys()
    with (sources.open_source(made["module"]) as source,
          pytest.raises(FormatError, match="does not record which variables are trainable")):
        source.trainable_keys()


def test_tf2_keys_drop_attributes_bookkeeping_and_name_slots(made):
    with sources.open_source(made["module"]) as source:
        assert source.kind == "TF2 object-based checkpoint"
        assert sorted(source.keys()) == [
            "net/b", "net/b/.OPTIMIZER_SLOT/opt/m", "net/b/.OPTIMIZER_SLOT/opt/v",
            "net/w", "net/w/.OPTIMIZER_SLOT/opt/m", "net/w/.OPTIMIZER_SLOT/opt/v",
            "opt/beta1_power", "opt/beta2_power",
        ]
        np.testing.assert_array_equal(source["net/w"], made["net"]["net/w"])


def test_tf2_keras_checkpoint_keeps_only_variables(made, tmp_path):
    expected = raw(made["keras_ckpt"])
    alone = tf.train.Checkpoint(model=made["model"]).write(str(tmp_path / "alone"))  # no optimizer
    with sources.open_source(made["keras_ckpt"]) as source, sources.open_source(alone) as model_only:
        keys = source.keys()
        assert len(keys) == len(expected) - 1  # the object graph is left out
        assert not any(".ATTRIBUTES" in k or k.startswith("_CHECKPOINTABLE") for k in keys)
        assert sorted(values.tobytes() for values in map(source.__getitem__, keys)) == sorted(
            value.tobytes() for name, value in expected.items() if name != OBJECT_GRAPH_KEY)
        weights = [k for k in model_only if not k.startswith("model/optimizer/")]  # compiled: tracked
        assert len(weights) == len(made["model"].weights)
        assert [k for k in keys if k.startswith("model/")] == weights
        for key in weights:
            np.testing.assert_array_equal(source[key], model_only[key])


def make_adam_checkpoint(folder):
    """A Keras 3 model with auto-named layers, trained one step with Adam, saved with its optimizer."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.Adam(0.1), loss="mse")
    rng = np.random.default_rng(0)
    model.fit(rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32),
              batch_size=8, epochs=1, verbose=0)
    prefix = tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(folder / "ckpt"))
    return model, prefix


def test_tf2_keras_weights_stay_under_model_when_saved_with_adam(tmp_path):
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    model, prefix = make_adam_checkpoint(tmp_path)
    assert any(k.startswith("optimizer/_trainable_variables/") for k in raw(prefix))  # what TF itself writes
    out = tmp_path / "model.npz"
    result = CliRunner().invoke(app, ["export", prefix, "-o", str(out), "--exclude", "optimizer"])
    assert result.exit_code == 0, result.output
    exported = ws.load(out)
    assert len(exported) == len(model.weights) == 8
    assert all(k.startswith("model/") for k in exported)
    # every weight once, by value (no two weights of this model are equal after a step)
    unused = dict(exported)
    for weight in model.weights:
        match = [k for k, v in unused.items() if v.shape == tuple(weight.shape) and np.array_equal(v, weight.numpy())]
        assert len(match) == 1, weight.path
        del unused[match[0]]
    # the same keys as a checkpoint of the model alone
    with sources.open_source(tf.train.Checkpoint(model=model).write(str(tmp_path / "alone"))) as alone:
        assert sorted(exported) == sorted(k for k in alone if not k.startswith("model/optimizer/"))
    kernel = model.layers[0].kernel.numpy()
    np.testing.assert_array_equal(exported["model/_functional/_operations/1/_kernel"], kernel)
    with sources.open_source(prefix) as source:  # the optimizer's own state stays under optimizer/
        optimizer_keys = [k for k in source if k.startswith("optimizer/")]
        assert optimizer_keys == ["optimizer/_iterations", "optimizer/_learning_rate",
                                  *[f"optimizer/_momentums/{i}" for i in range(6)],
                                  *[f"optimizer/_velocities/{i}" for i in range(6)]]
        assert source["optimizer/_iterations"] == 1
        momentum = model.optimizer._momentums[0]
        assert momentum.shape == model.layers[0].kernel.shape
        np.testing.assert_array_equal(source["optimizer/_momentums/0"], momentum.numpy())


def test_tf2_keys_are_equal_for_two_models_of_one_architecture(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    first, first_prefix = make_adam_checkpoint(tmp_path / "a")
    second, second_prefix = make_adam_checkpoint(tmp_path / "b")
    assert [layer.name for layer in first.layers] != [layer.name for layer in second.layers]  # dense vs dense_2
    with sources.open_source(first_prefix) as a, sources.open_source(second_prefix) as b:
        assert a.keys() == b.keys()
        assert len(a.keys()) == len(raw(first_prefix)) - 1


class Tower(tf.Module):
    def __init__(self):
        super().__init__()
        self.embed = tf.Variable(np.ones((3, 2), np.float32), name="Variable")
        self.blocks = [Net(), Net()]
        self.alias = self.blocks[1]  # a second path to the same variables, shorter than blocks/1


def test_tf2_module_keys_are_attribute_paths(tmp_path):
    tower = Tower()
    opt = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
    variables = [tower.embed, tower.blocks[0].w, tower.blocks[1].b]
    with tf.GradientTape() as tape:
        loss = sum(tf.reduce_sum(v * v) for v in variables)
    opt.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
    prefix = tf.train.Checkpoint(tower=tower, optimizer=opt).write(str(tmp_path / "ckpt"))
    with sources.open_source(prefix) as source:
        assert source.keys() == [
            "tower/alias/b", "tower/alias/b/.OPTIMIZER_SLOT/optimizer/momentum", "tower/alias/w",
            "tower/blocks/0/b", "tower/blocks/0/w", "tower/blocks/0/w/.OPTIMIZER_SLOT/optimizer/momentum",
            "tower/embed", "tower/embed/.OPTIMIZER_SLOT/optimizer/momentum",
        ]
        np.testing.assert_array_equal(source["tower/embed"], tower.embed.numpy())
        np.testing.assert_array_equal(source["tower/alias/b"], tower.blocks[1].b.numpy())


def test_a_weights_file_reads_as_its_hdf5_layout(made):
    model = made["model"]
    with sources.open_source(made["root"] / "model.weights.h5") as source:
        assert source.kind == "Keras weights file"
        np.testing.assert_array_equal(source["layers/dense/vars/0"], model.get_layer("d1").kernel.numpy())
        np.testing.assert_array_equal(source["layers/batch_normalization/vars/3"],
                                      model.get_layer("bn").moving_variance.numpy())
        assert len([k for k in source if k.startswith("layers/")]) == len(model.weights)


def test_a_keras_archive_reads_keyed_like_its_model(made):
    model = made["model"]
    with sources.open_source(made["root"] / "model.keras") as source:
        assert source.kind == "Keras weights file"
        np.testing.assert_array_equal(source["d1/kernel"], model.get_layer("d1").kernel.numpy())
        np.testing.assert_array_equal(source["bn/moving_variance"], model.get_layer("bn").moving_variance.numpy())
        assert source.stored_names()["bn/moving_variance"] == "layers/batch_normalization/vars/3"
        assert [k for k in source if not k.startswith("optimizer/")] == list(tf2_adapter.export(model))


def test_keras_archive_config_is_read_as_data_only(made, tmp_path):
    """A class the config names is never looked up, let alone run: the file keeps its own names;
    so does one whose config is no JSON (the weights read without it), saying why."""
    with zipfile.ZipFile(made["root"] / "model.keras") as original:
        weights = original.read("model.weights.h5")

    def archive(path, config):
        with zipfile.ZipFile(path, "w") as copy:
            copy.writestr("config.json", config)
            copy.writestr("model.weights.h5", weights)
        return path

    config = '{"module": "os", "class_name": "system", "config": {"name": "rm -rf /"}}'
    for path in (archive(tmp_path / "odd.keras", config), archive(tmp_path / "odd_without_suffix", config)):
        with sources.open_source(path) as source:
            assert "layers/dense/vars/0" in source
            assert source.keys_note == "its layer 'rm -rf /' is a 'system' from 'os', not one of Keras's built-in layers"
    broken = archive(tmp_path / "broken.keras", "this is not json and would break any deserializer")
    with sources.open_source(broken) as source:
        assert "layers/dense/vars/0" in source
        assert source.keys_note.startswith("its config.json cannot be read (config.json "), source.keys_note




def test_keras_archive_bombs_are_refused_before_inflating(tmp_path, monkeypatch):
    import tempfile
    import zlib

    scratch = tmp_path / "scratch"  # a temporary folder of our own: other processes use the shared one
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    payload = b"\0" * (1 << 20)  # deflates about 1000 to 1
    bomb = hostile_keras(tmp_path / "bomb.keras", payload, declared=0xF000_0000)  # claims 3.75 GiB
    with pytest.raises(UnsafeFileError, match="declares 4026531840 bytes .* a zip bomb"):
        sources.open_source(bomb)
    short = hostile_keras(tmp_path / "short.keras", payload, declared=1000)  # inflates past what it declares
    with pytest.raises(FormatError, match="corrupt .keras archive"):
        sources.open_source(short)
    lying = hostile_keras(tmp_path / "lying.keras", payload, declared=1000, crc=zlib.crc32(payload[:1000]))
    with pytest.raises(FormatError):  # only the declared 1000 bytes come out: not an HDF5 file
        sources.open_source(lying)
    assert list(scratch.iterdir()) == []  # the unpacking folder is gone


def test_legacy_output_suffixes_are_dropped(tmp_path):
    import h5py

    with h5py.File(tmp_path / "legacy.h5", "w") as handle:
        handle["dense/dense/kernel:0"] = np.ones((2, 2), np.float32)
    with sources.open_source(tmp_path / "legacy.h5") as source:
        assert source.keys() == ["dense/dense/kernel"]


def test_missing_and_junk_sources(tmp_path):
    with pytest.raises(StoreNotFoundError, match="absent.ckpt: no such file or checkpoint"):
        sources.open_source(tmp_path / "absent.ckpt")
    (tmp_path / "junk.ckpt.index").write_bytes(b"not a table")
    with pytest.raises(FormatError, match=r"junk\.ckpt\.index: not a TensorFlow checkpoint index"):
        sources.open_source(tmp_path / "junk.ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreNotFoundError, match=r"empty: is an empty folder, not a weight file$"):
        sources.open_source(tmp_path / "empty")
    (tmp_path / "empty" / "notes.txt").write_text("")
    with pytest.raises(StoreNotFoundError, match=r"empty: is a folder, not a weight file, and holds no TF checkpoint "
                                                 r"\(no 'checkpoint' state file, no \.index file\)"):
        sources.open_source(tmp_path / "empty")


def test_write_checkpoint_is_read_by_saver_and_load_checkpoint(tmp_path):
    prefix = str(tmp_path / "out.ckpt")
    weights = {"a/w": np.arange(6, dtype=np.float32).reshape(2, 3), "a/b": np.ones(3, np.float32)}
    _checkpoints.write_checkpoint(prefix, weights)
    restored = restore_with_saver(prefix, {k: v.shape for k, v in weights.items()})
    for key, value in weights.items():
        np.testing.assert_array_equal(restored[key], value)
    assert sorted(os.listdir(tmp_path)) == ["out.ckpt.data-00000-of-00001", "out.ckpt.index"]


def test_write_checkpoint_merges_and_keeps_non_numeric_entries(made, tmp_path):
    target = copy_checkpoint(made["tf1"], tmp_path)
    before = raw(target)
    _checkpoints.write_checkpoint(target, {"extra/v": np.full(2, 7.0, np.float32),
                                           "model/dense/b": np.zeros(3, np.float32)})
    after = raw(target)
    assert set(after) == set(before) | {"extra/v"}
    assert after["tag"] == before["tag"]
    np.testing.assert_array_equal(after["model/dense/b"], np.zeros(3, np.float32))
    np.testing.assert_array_equal(after["model/dense/w"], before["model/dense/w"])


def test_write_checkpoint_failure_leaves_the_old_one(tmp_path, monkeypatch):
    prefix = str(tmp_path / "keep.ckpt")
    _checkpoints.write_checkpoint(prefix, {"w": np.ones(2, np.float32)})
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}

    def failing_replace(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_checkpoints.os, "replace", failing_replace)
    with pytest.raises(OSError):
        _checkpoints.write_checkpoint(prefix, {"w": np.zeros(2, np.float32)})
    monkeypatch.undo()
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def data_files(folder):
    return sorted(name for name in os.listdir(folder) if ".data-" in name)


def test_write_checkpoint_never_overwrites_the_data_the_old_index_reads(tmp_path):
    prefix = str(tmp_path / "m.ckpt")
    _checkpoints.write_checkpoint(prefix, {"a": np.ones(2, np.float32), "b": np.zeros(3, np.float32)})
    assert data_files(tmp_path) == ["m.ckpt.data-00000-of-00001"]
    _checkpoints.write_checkpoint(prefix, {"a": np.full(2, 5, np.float32)})
    assert data_files(tmp_path) == ["m.ckpt.data-00000-of-00002", "m.ckpt.data-00001-of-00002"]
    restored = restore_with_saver(prefix, {"a": (2,), "b": (3,)})
    np.testing.assert_array_equal(restored["a"], [5, 5])
    np.testing.assert_array_equal(restored["b"], [0, 0, 0])
    _checkpoints.write_checkpoint(prefix, {"b": np.full(3, 2, np.float32)})
    assert sorted(os.listdir(tmp_path)) == ["m.ckpt.data-00000-of-00001", "m.ckpt.index"]
    assert {k: v.tolist() for k, v in raw(prefix).items()} == {"a": [5, 5], "b": [2, 2, 2]}


KILLED_BEFORE_INDEX = """
import os, signal, sys
import numpy as np
from weightstore.adapters import _checkpoints
real = os.replace
def replace(src, dst):
    if str(dst).endswith(".index"):
        os.kill(os.getpid(), signal.SIGKILL)  # the data files are in place, the index not yet
    real(src, dst)
_checkpoints.os.replace = replace
_checkpoints.write_checkpoint(sys.argv[1], {"a": np.full(2, 9, np.float32), "b": np.full(3, 9, np.float32)})
"""


def test_a_write_killed_before_the_index_swap_leaves_the_old_checkpoint(tmp_path, tf_fork):
    """The writer is a process of its own, forked from one that imported TensorFlow (``conftest.tf_fork``)."""
    prefix = str(tmp_path / "m.ckpt")
    old = {"a": np.ones(2, np.float32), "b": np.zeros(3, np.float32)}
    _checkpoints.write_checkpoint(prefix, old)
    done = tf_fork.run(KILLED_BEFORE_INDEX, prefix, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    left = sorted(os.listdir(tmp_path))
    assert "m.ckpt.data-00000-of-00002" in left and any(".wstmp-" in name for name in left)
    restored = restore_with_saver(prefix, {"a": (2,), "b": (3,)})  # the old checkpoint, whole
    for key, value in old.items():
        np.testing.assert_array_equal(restored[key], value)
    _checkpoints.write_checkpoint(prefix, {"a": np.full(2, 4, np.float32)})  # cleans up after the dead writer
    assert not [name for name in os.listdir(tmp_path) if ".wstmp-" in name]
    assert len(data_files(tmp_path)) == 1
    assert {k: v.tolist() for k, v in raw(prefix).items()} == {"a": [4, 4], "b": [0, 0, 0]}


def test_a_mixed_single_entry_checkpoint_is_refused_on_read(tmp_path):
    """The one case that renames data over data: a crash before the index leaves a mix TF refuses."""
    prefix = str(tmp_path / "one.ckpt")
    _checkpoints.write_checkpoint(prefix, {"a": np.ones(2, np.float32)})
    old_index = (tmp_path / "one.ckpt.index").read_bytes()
    _checkpoints.write_checkpoint(prefix, {"a": np.full(2, 3, np.float32)})
    assert data_files(tmp_path) == ["one.ckpt.data-00000-of-00001"]
    (tmp_path / "one.ckpt.index").write_bytes(old_index)  # the state a crash between the renames leaves
    corrupt = r"data-00000-of-00001: tensor 'a': is corrupt \(CRC-32C"
    with sources.open_source(prefix) as source, pytest.raises(ChecksumError, match=corrupt):
        source["a"]


def test_write_checkpoint_refuses_object_based_targets(made):
    with pytest.raises(FormatError, match="TF2 object-based checkpoint"):
        _checkpoints.checkpoint_names(made["module"])


def test_stores_keep_their_kind_and_metadata(tmp_path):
    ws.save(tmp_path / "m.npz", {"w": np.ones(2)}, metadata={"run": 3})
    with sources.open_source(tmp_path / "m.npz") as source:
        assert source.kind == "weightstore file"
        assert source.metadata == {"run": 3}


# -- values replaced in TF2 object-based checkpoints; the state file of a new prefix ------------

def test_values_replaced_in_an_object_checkpoint_are_what_checkpoint_restore_reads(made, tmp_path):
    target = copy_checkpoint(made["keras_ckpt"], tmp_path)
    before = raw(target)
    with ws.open(target) as source:
        kernel = next(k for k in source if k.startswith("model/") and k.endswith("/_kernel"))
        gamma = next(k for k in source if k.startswith("model/") and k.endswith("/gamma"))
        new = {key: np.full(source.info(key).shape, 7.5, np.float32) for key in (kernel, gamma)}
    entries = {key: CheckpointReader(target).entry_name(key) for key in new}
    assert all(name.endswith("/.ATTRIBUTES/VARIABLE_VALUE") for name in entries.values())
    _checkpoints.replace_in_object_checkpoint(target, new)
    after = raw(target)
    assert set(after) == set(before)  # same entry names, no new ones
    assert after[OBJECT_GRAPH_KEY] == before[OBJECT_GRAPH_KEY]
    for name, value in before.items():
        if name not in entries.values():
            np.testing.assert_array_equal(after[name], value)  # optimizer state, save counter, the rest
    model = same_architecture()
    tf.train.Checkpoint(model=model).restore(target).expect_partial()
    np.testing.assert_array_equal(model.get_layer("d1").kernel.numpy(), new[kernel])
    np.testing.assert_array_equal(model.get_layer("bn").gamma.numpy(), new[gamma])
    np.testing.assert_array_equal(model.get_layer("d2").bias.numpy(), made["model"].get_layer("d2").bias.numpy())


@pytest.mark.parametrize("value, message", [
    (np.zeros((5, 4), np.float32), "is float32 [3, 4] in the checkpoint, the imported tensor is float32 [5, 4]"),
    (np.zeros((3, 4), np.float64), "is float32 [3, 4] in the checkpoint, the imported tensor is float64 [3, 4]"),
])
def test_object_checkpoint_shape_and_dtype_mismatches_write_nothing(made, tmp_path, value, message):
    target = copy_checkpoint(made["keras_ckpt"], tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    with ws.open(target) as source:
        kernel = next(k for k in source if k.startswith("model/") and source.info(k).shape == (3, 4))
    with pytest.raises(SelectionError, match=re.escape(f"{target}: tensor {kernel!r}: {message}")) as caught:
        _checkpoints.replace_in_object_checkpoint(target, {kernel: value})
    assert (caught.value.path, caught.value.key) == (target, kernel)
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_object_checkpoint_refuses_keys_it_does_not_have(made, tmp_path):
    target = copy_checkpoint(made["module"], tmp_path)
    before = (tmp_path / (os.path.basename(target) + ".index")).read_bytes()
    with pytest.raises(SelectionError, match=re.escape(f"{target}: tensor 'net/extra': the TF2 object-based "
                                                       "checkpoint has no such variable; tf.train.Checkpoint.restore "
                                                       "ignores")) as caught:
        _checkpoints.replace_in_object_checkpoint(target, {"net/w": np.ones((2, 2), np.float32),
                                                          "net/extra": np.ones(2, np.float32)})
    assert (caught.value.path, caught.value.key) == (target, "net/extra")  # one key at fault: ws --json names it
    assert (tmp_path / (os.path.basename(target) + ".index")).read_bytes() == before
    with pytest.raises(FormatError, match="is a name-based"):
        _checkpoints.replace_in_object_checkpoint(copy_checkpoint(made["tf1"], tmp_path), {})


def test_state_file_lists_every_recorded_prefix_and_tensorflow_reads_it(tmp_path):
    for name in ("a.ckpt", 'odd "name".ckpt', "a.ckpt"):
        prefix = str(tmp_path / name)
        _checkpoints.write_checkpoint(prefix, {"w": np.ones(2, np.float32)})
        _checkpoints.write_state_file(prefix, _checkpoints.state_file_text(prefix))
    assert tf.train.latest_checkpoint(str(tmp_path)) == str(tmp_path / "a.ckpt")
    state = tf.train.get_checkpoint_state(str(tmp_path))
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == ['odd "name".ckpt', "a.ckpt"]
    (tmp_path / "checkpoint").write_text("not a state file\n")
    with pytest.raises(FormatError, match="checkpoint state file names no model_checkpoint_path"):
        _checkpoints.state_file_text(str(tmp_path / "b.ckpt"))


def test_a_checkpoint_write_refused_as_it_begins_notes_no_temporary_for_good(tmp_path):
    """A write whose commit fails as it begins (its ``.index`` a link to itself: its ``stat``
    fails) leaves no temporary's name noted as this process's: a long-running importer would
    keep one per failure, and that name's file would never be taken for a dead writer's."""
    from weightstore.io import files

    prefix = tmp_path / "loop.ckpt"
    os.symlink("loop.ckpt.index", tmp_path / "loop.ckpt.index")
    noted = set(files._IN_USE)
    with pytest.raises(OSError):
        _checkpoints.write_checkpoint(str(prefix), {"w": np.ones(2, np.float32)})
    assert noted == files._IN_USE
