"""TF checkpoints and Keras files read by the core, in processes where TensorFlow cannot load.

Checkpoints are written by real TensorFlow here; they are read in a subprocess whose
``import tensorflow`` fails and compared, tensor for tensor, with TensorFlow's own reader in
this process. Hostile indexes are forged byte by byte (:mod:`tf_forge`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import crc32c
import ml_dtypes
import numpy as np
import pytest
from typer.testing import CliRunner

import tf_forge
import weightstore as ws
from weightstore.errors import ChecksumError, FormatError, StoreNotFoundError, UnsafeFileError, WeightStoreError
from weightstore.formats import keras_file
from weightstore.formats.tf_checkpoint import CheckpointReader, resolve_prefix, slice_key

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")
from weightstore.cli.main import app  # noqa: E402

NO_TF = "import sys; sys.modules['tensorflow'] = None; sys.modules['keras'] = None\n"
READ_WITHOUT_TF = NO_TF + """
import json, numpy as np, weightstore as ws
out, paths = sys.argv[1], sys.argv[2:]
report = []
for i, path in enumerate(paths):
    with ws.open(path) as store:
        reader = store._reader
        report.append({"path": store.path, "kind": reader.kind, "skipped": reader.skipped,
                       "names": {key: reader.entry_name(key) for key in store.keys()}})
    ws.save(f"{out}/{i}.npz", ws.load(path))
try:
    import tensorflow
except ImportError:
    pass
else:
    raise SystemExit("tensorflow was importable")
json.dump(report, open(f"{out}/report.json", "w"))
"""
DTYPES = [tf.float32, tf.float64, tf.float16, tf.bfloat16, tf.int8, tf.uint8, tf.int16, tf.uint16, tf.int32, tf.uint32,
          tf.int64, tf.uint64, tf.bool, tf.complex64, tf.complex128]


def make_tf1(folder: Path) -> str:
    """A TF1 Saver checkpoint: every numeric dtype, partitioned variables (uneven, along both
    axes) with Adam slots that are partitioned too, and a string variable."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        rng = np.random.default_rng(0)
        for dtype in DTYPES:
            value = np.abs(rng.normal(size=(3, 2))) * 50
            tf.compat.v1.get_variable(f"kinds/{dtype.name}", initializer=tf.cast(value, dtype), trainable=False)
        emb = tf.compat.v1.get_variable("model/emb", shape=[7, 3], partitioner=tf.compat.v1.fixed_size_partitioner(3))
        cols = tf.compat.v1.get_variable("model/cols", shape=[2, 5], partitioner=lambda shape, dtype: [1, 2])
        for name, rows, parts in (("model/hundreds", 300, 3), ("model/long", 20_000, 2)):  # 2- and 3-byte slice keys
            tf.compat.v1.get_variable(name, shape=[rows, 1], partitioner=tf.compat.v1.fixed_size_partitioner(parts),
                                      trainable=False)
        w = tf.compat.v1.get_variable("model/w", initializer=np.arange(6, dtype=np.float32).reshape(2, 3))
        tf.Variable("a tag", name="tag", trainable=False)
        loss = tf.reduce_sum(tf.square(emb.as_tensor())) + tf.reduce_sum(cols) + tf.reduce_sum(w * w)
        train = tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss)
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(train)
        return tf.compat.v1.train.Saver().save(sess, str(folder / "model.ckpt"), global_step=3)


def make_tf2(folder: Path):
    """A Keras model and its Adam, saved twice with ``tf.train.Checkpoint.save`` (state file and all)."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.BatchNormalization(),
                              keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((8, 3), np.float32), np.ones((8, 2), np.float32), verbose=0, epochs=1)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    checkpoint.save(str(folder / "ckpt"))
    model.fit(np.ones((8, 3), np.float32), np.zeros((8, 2), np.float32), verbose=0, epochs=1)
    return model, checkpoint.save(str(folder / "ckpt"))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    (root / "tf1").mkdir(), (root / "tf2").mkdir()
    model, tf2_prefix = make_tf2(root / "tf2")
    return {"root": root, "tf1": make_tf1(root / "tf1"), "tf2": tf2_prefix, "model": model}


def tf_values(prefix: str) -> dict[str, np.ndarray]:
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize and a.tobytes() == b.tobytes()


def read_without_tf(tmp_path: Path, *paths) -> list[dict]:
    out = tmp_path / "no_tf"
    out.mkdir()
    done = subprocess.run([sys.executable, "-c", READ_WITHOUT_TF, str(out), *map(str, paths)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "report.json").read_text())
    for i, entry in enumerate(report):
        entry["values"] = ws.load(out / f"{i}.npz")
    return report


def test_tf1_checkpoint_reads_without_tensorflow_as_tensorflow_reads_it(made, tmp_path):
    prefix = made["tf1"]
    expected = tf_values(prefix)
    spellings = [prefix, prefix + ".index", prefix + ".data-00000-of-00001", prefix + ".meta", Path(prefix).parent]
    reports = read_without_tf(tmp_path, *spellings)
    for report in reports:
        assert report["path"] == prefix and report["kind"] == "TF1 checkpoint"
        assert report["skipped"] == ["tag"]
        assert set(report["values"]) == set(expected) - {"tag"}
        assert all(name == key for key, name in report["names"].items())  # TF1 keys are the variable names
        for key, value in report["values"].items():
            assert same_bits(value, expected[key]), key
            assert value.dtype == expected[key].dtype, key
    values = reports[0]["values"]
    assert values["model/emb"].shape == (7, 3) and values["model/cols"].shape == (2, 5)  # joined from slices
    assert values["model/long"].shape == (20_000, 1) and values["model/hundreds"].shape == (300, 1)
    assert values["model/emb/Adam"].shape == (7, 3)  # slots of a partitioned variable are partitioned too
    assert {f"kinds/{d.name}" for d in DTYPES} <= set(values)


def test_int4_and_int2_variables_read_as_tensorflow_reads_them(tmp_path):
    """TF keeps them one per byte, as ml_dtypes does; the reader skipped them as "non-numeric",
    so ws.load and ws convert silently lost them."""
    module = tf.Module()
    module.kinds = [tf.Variable(tf.constant(np.array([-2, 1, 0, -1][:size], kind)))
                    for size, kind in ((3, ml_dtypes.int4), (4, ml_dtypes.uint4), (2, ml_dtypes.int2),
                                       (1, ml_dtypes.uint2))]
    prefix = tf.train.Checkpoint(m=module).write(str(tmp_path / "ck"))
    expected = {key: value for key, value in tf_values(prefix).items() if not key.startswith("_")}
    loaded = ws.load(prefix)
    assert len(loaded) == len(expected) == 4
    for (key, value), (tf_key, tf_value) in zip(sorted(loaded.items()), sorted(expected.items()), strict=True):
        assert tf_key.startswith(key) and value.dtype == tf_value.dtype and same_bits(value, tf_value), key


def test_tf2_keras_checkpoint_reads_without_tensorflow(made, tmp_path):
    prefix = made["tf2"]
    expected = tf_values(prefix)
    (report,) = read_without_tf(tmp_path, Path(prefix).parent)  # the folder: its state file names ckpt-2
    assert report["path"] == prefix and prefix.endswith("ckpt-2")
    assert report["kind"] == "TF2 object-based checkpoint"
    for key, value in report["values"].items():
        assert same_bits(value, expected[report["names"][key]]), key
    model = made["model"]
    kernel = "model/_functional/_operations/1/_kernel"
    np.testing.assert_array_equal(report["values"][kernel], model.layers[0].kernel.numpy())
    assert "optimizer/_iterations" in report["values"] and "save_counter" not in report["values"]
    with contextlib.closing(CheckpointReader(prefix)) as reader:
        assert reader.keys() == list(report["values"])  # the core reader in this process agrees


def test_ws_ls_and_export_of_a_checkpoint_never_import_tensorflow(made, tmp_path):
    script = NO_TF + "from weightstore.cli.main import main; sys.argv = ['ws'] + sys.argv[1:]; main()"
    folder = Path(made["tf2"]).parent
    done = subprocess.run([sys.executable, "-c", script, "ls", str(folder)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "model/_functional/_operations/1/_kernel" in done.stdout and "ckpt-2" in done.stdout
    out = tmp_path / "m.npz"
    done = subprocess.run([sys.executable, "-c", script, "export", made["tf1"], "-o", str(out), "--exclude", "*/Adam*"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "model/w" in ws.load(out) and "model/w/Adam" not in ws.load(out)


def test_ws_export_folder_says_which_checkpoint_it_read(made, tmp_path):
    result = CliRunner().invoke(app, ["export", str(Path(made["tf2"]).parent), "-o", str(tmp_path / "x.npz")])
    assert result.exit_code == 0, result.output
    assert f"from TF2 object-based checkpoint {made['tf2']} to" in result.output


def copy_checkpoint(prefix: str, folder: Path, name: str) -> str:
    folder.mkdir(exist_ok=True)
    for path in Path(prefix).parent.glob(Path(prefix).name + ".*"):
        (folder / (name + path.name[len(Path(prefix).name):])).write_bytes(path.read_bytes())
    return str(folder / name)


def test_a_folder_names_its_checkpoint_or_lists_the_candidates(made, tmp_path):
    folder = tmp_path / "run"
    first = copy_checkpoint(made["tf1"], folder, "model.ckpt-9")
    assert resolve_prefix(str(folder)) == first  # the only one: no state file needed
    copy_checkpoint(made["tf1"], folder, "model.ckpt-10")
    with pytest.raises(StoreNotFoundError, match=r"holds 2 checkpoints and no 'checkpoint' state file saying which "
                                                 r"to read; name one of: model\.ckpt-9, model\.ckpt-10$"):
        ws.open(folder)
    (folder / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-9"\nall_model_checkpoint_paths: "x"\n')
    assert resolve_prefix(str(folder)) == first
    (folder / "checkpoint").write_text('model_checkpoint_path: "/elsewhere/old/model.ckpt-10"\n')  # a moved folder
    assert resolve_prefix(str(folder)) == str(folder / "model.ckpt-10")
    (folder / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-11"\n')
    with pytest.raises(StoreNotFoundError, match=r"names checkpoint 'model\.ckpt-11', which is not in the folder; "
                                                 r"the folder holds: model\.ckpt-9, model\.ckpt-10"):
        ws.load(folder)
    elsewhere = copy_checkpoint(made["tf1"], tmp_path / "other", "secret")  # there, but outside the folder
    for named in (elsewhere, "../other/secret"):
        (folder / "checkpoint").write_text(f'model_checkpoint_path: "{named}"\n')
        with pytest.raises(StoreNotFoundError, match=r"names checkpoint '.*secret', which is not in the folder"):
            ws.load(folder)
    copy_checkpoint(made["tf1"], folder, "secret")  # the folder's own file of that name is what is read
    assert resolve_prefix(str(folder)) == str(folder / "secret")
    (folder / "checkpoint").write_bytes(b"\xff\xfe")
    with pytest.raises(FormatError, match="checkpoint state file is not UTF-8 text"):
        ws.open(folder)
    (folder / "checkpoint").write_text("all_model_checkpoint_paths: \"x\"\n")
    with pytest.raises(FormatError, match="names no model_checkpoint_path"):
        ws.open(folder)


def test_tensors_are_read_lazily_and_verified(made, tmp_path):
    prefix = copy_checkpoint(made["tf1"], tmp_path, "copy")
    entry = tf_values(prefix)["model/w"].tobytes()
    with ws.open(prefix) as store:
        assert store["model/w"].tobytes() == entry
    data = Path(prefix + ".data-00000-of-00001")
    raw = bytearray(data.read_bytes())
    at = raw.index(entry)
    raw[at] ^= 0x01
    data.write_bytes(bytes(raw))
    corrupt = r"copy\.data-00000-of-00001: tensor 'model/w': is corrupt \(CRC-32C"
    with ws.open(prefix) as store, pytest.raises(ChecksumError, match=corrupt) as caught:
        store["model/w"]
    assert (caught.value.path, caught.value.key) == (str(data), "model/w")
    flipped = ws.load(prefix, include="model/w", verify=False)["model/w"]
    assert flipped.shape == (2, 3) and flipped.tobytes() != entry
    data.unlink()
    with ws.open(prefix) as store:  # only the index is read at open
        assert "model/w" in store and store.info("model/w").shape == (2, 3)
        with pytest.raises(FormatError, match=r"copy\.data-00000-of-00001: tensor 'model/w': its data file is missing"):
            store["model/w"]
    data.write_bytes(bytes(raw[: at + 2]))  # short: the tensor runs past the end
    with pytest.raises(FormatError, match=r"tensor 'model/w': data file is short: needs bytes"):
        ws.load(prefix, verify=False)


def test_read_into_fills_callers_memory(made):
    expected = tf_values(made["tf1"])
    with ws.open(made["tf1"]) as store:
        for key in ("model/w", "kinds/bfloat16", "kinds/bool", "model/emb"):
            out = np.empty(store.info(key).shape, expected[key].dtype)
            assert store.read_into(key, out) is out and same_bits(out, expected[key])


# --- hostile indexes ----------------------------------------------------------------------

W = np.arange(6, dtype=np.float32).reshape(2, 3)
B = np.ones(3, np.float32)


def forged(tmp_path: Path, **options) -> str:
    return tf_forge.write(tmp_path / "forged", {"w": W, "b": B}, **options)


def test_the_forge_writes_what_tensorflow_reads(tmp_path):
    prefix = forged(tmp_path)
    np.testing.assert_array_equal(tf_values(prefix)["w"], W)
    assert {k: v.tolist() for k, v in ws.load(prefix).items()} == {"b": B.tolist(), "w": W.tolist()}


def rewrite_index(prefix: str, items, **table_options) -> None:
    Path(prefix + ".index").write_bytes(tf_forge.table(items, **table_options))


def valid_items():
    return [(b"", tf_forge.header()),
            (b"b", tf_forge.entry(shape=(3,), offset=24, size=12, crc=0)),
            (b"w", tf_forge.entry(shape=(2, 3), offset=0, size=24, crc=0))]


HOSTILE = {
    "index block outside the file": (dict(index_handle=(10**6, 40)), FormatError, "index block .* lies outside"),
    "data block outside the file": (dict(data_handle=(0, 10**6)), FormatError, "data block .* lies outside"),
    "block checksum": (dict(crc_delta=1), FormatError, "fails its CRC-32C check"),
    "snappy block": (dict(kind=1), FormatError, "snappy-compressed"),
    "varint overflow": (dict(data_block=b"\xff" * 11 + b"\0\0\0\0\1\0\0\0"), FormatError, "varint"),
    "entry past its block": (dict(data_block=b"\0\5\5ab" + b"\0\0\0\0\1\0\0\0"), FormatError, "reaches outside"),
    "restart count lie": (dict(data_block=b"\0\0\0\0\xff\xff\xff\x0f"), FormatError, "restart points"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_tables_are_refused(tmp_path, case):
    options, error, message = HOSTILE[case]
    prefix = forged(tmp_path)
    rewrite_index(prefix, valid_items(), **options)
    with pytest.raises(error, match=message) as caught:
        ws.open(prefix)
    assert "forged.index" in str(caught.value) and caught.value.path == prefix + ".index"


ENTRY_LIES = {
    "size past the data file": ({"w": {"size": 24, "offset": 10**9}}, "tensor 'w': data file is short"),
    "shape disagrees with size": ({"w": {"shape": (2, 4)}}, r"tensor 'w': has shape \(2, 4\) float32, which needs "
                                                            r"32 bytes; its entry says 24"),
    "absurd dims": ({"w": {"shape": (1 << 40, 1 << 40)}}, "needs 4835703278458516698824704 bytes"),
    "negative dim": ({"w": {"shape": (-1, 3)}}, "impossible shape"),
    "overlapping ranges": ({"b": {"offset": 20}}, "tensors 'b' and 'w' overlap|tensors 'w' and 'b' overlap"),
    "shard out of range": ({"w": {"shard": 3}}, "lies in data shard 3, of 1"),
    "negative offset": ({"w": {"offset": -8}}, "negative offset"),
}


@pytest.mark.parametrize("case", sorted(ENTRY_LIES))
def test_entries_that_lie_are_refused_naming_file_and_key(tmp_path, case):
    overrides, message = ENTRY_LIES[case]
    prefix = forged(tmp_path, overrides=overrides)
    with pytest.raises(FormatError, match=message) as caught:
        ws.load(prefix)
    assert "forged." in str(caught.value) and caught.value.path.startswith(f"{prefix}.")
    assert caught.value.key == (None if case == "overlapping ranges" else "w")


def test_names_must_be_utf8_and_unique(tmp_path):
    prefix = forged(tmp_path, extra=[(b"\xffbad", tf_forge.entry(shape=(), size=0))])
    with pytest.raises(FormatError, match=r"entry name b'\\xffbad' is not valid UTF-8"):
        ws.open(prefix)
    items = valid_items()
    rewrite_index(prefix, items[:2] + [items[1]] + items[2:])
    with pytest.raises(FormatError, match="entry 'b' appears twice"):
        ws.open(prefix)
    rewrite_index(prefix, [items[0], items[2], items[1]])
    with pytest.raises(FormatError, match="entry 'b' appears out of order"):
        ws.open(prefix)
    rewrite_index(prefix, items[1:])
    with pytest.raises(FormatError, match="no bundle header"):
        ws.open(prefix)
    rewrite_index(prefix, [(b"", tf_forge.header(endianness=1))] + items[1:])
    with pytest.raises(FormatError, match="big-endian"):
        ws.open(prefix)
    rewrite_index(prefix, [(b"", b"\xff\xff")] + items[1:])
    with pytest.raises(FormatError, match="the bundle header is not a readable protocol buffer"):
        ws.open(prefix)


def test_a_huge_index_is_refused_before_reading(tmp_path, monkeypatch):
    from weightstore.formats import tf_checkpoint

    prefix = forged(tmp_path)
    monkeypatch.setattr(tf_checkpoint, "MAX_TF_INDEX_BYTES", 100)
    with pytest.raises(UnsafeFileError, match=r"forged\.index: checkpoint index is \d+ bytes, over the 100-byte limit"):
        ws.open(prefix)


def test_mutated_indexes_fail_only_with_weightstore_errors(made, tmp_path):
    """A short seeded fuzz: flipped, truncated, grown and spliced indexes of a real checkpoint."""
    prefix = copy_checkpoint(made["tf1"], tmp_path, "fuzz")
    original = Path(prefix + ".index").read_bytes()
    rng = random.Random(9)
    outcomes = {"refused": 0, "read": 0}
    for _ in range(300):
        data = bytearray(original)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(data))
            action = rng.random()
            if action < 0.6:
                data[at] = rng.randrange(256)
            elif action < 0.75:
                del data[at : at + rng.randint(1, 16)]
            elif action < 0.9:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            else:
                data = data[:at]
        Path(prefix + ".index").write_bytes(bytes(data))
        try:
            with ws.open(prefix) as store:
                for key in store:
                    store[key]
            outcomes["read"] += 1
        except WeightStoreError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 250  # block checksums catch nearly every change


# --- Keras files ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keras_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("keras")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="d1"), keras.layers.Dense(2, name="d2")])
    model.save_weights(str(root / "m.weights.h5"))
    model.save(str(root / "m.keras"))
    (root / "m_without_suffix").write_bytes((root / "m.keras").read_bytes())
    return root, model


@pytest.mark.parametrize("name", ["m.weights.h5", "m.keras", "m_without_suffix"])
def test_keras_files_open_in_the_core(keras_files, name):
    """A .weights.h5 by Keras's save walk; a .keras archive, named so or not, keyed like its model by its config."""
    root, model = keras_files
    weights = ws.load(root / name)
    second = "layers/dense_1/vars/0" if name == "m.weights.h5" else "d2/kernel"
    assert sorted(weights) == (["layers/dense/vars/0", "layers/dense/vars/1", "layers/dense_1/vars/0",
                                "layers/dense_1/vars/1"] if name == "m.weights.h5" else
                               ["d1/bias", "d1/kernel", "d2/bias", "d2/kernel"])
    np.testing.assert_array_equal(weights[second], model.get_layer("d2").kernel.numpy())


def test_keras_config_is_read_as_bounded_json(keras_files, tmp_path):
    root, _ = keras_files
    config = keras_file.read_config(root / "m.keras")
    assert config["class_name"] == "Sequential"
    assert [layer["config"]["name"] for layer in config["config"]["layers"]][-2:] == ["d1", "d2"]
    with pytest.raises(UnsafeFileError, match=r"m\.keras: config\.json declares \d+ bytes, over the 10-byte limit"):
        keras_file.read_config(root / "m.keras", max_bytes=10)
    odd = tmp_path / "odd.keras"
    with zipfile.ZipFile(odd, "w") as archive:
        archive.writestr("config.json", "[1, 2]")
    with pytest.raises(FormatError, match=r"odd\.keras: config\.json holds a JSON list, not an object") as caught:
        keras_file.read_config(odd)
    assert (caught.value.path, caught.value.key) == (str(odd), None)
    with zipfile.ZipFile(odd, "w") as archive:
        archive.writestr("config.json", "{" * 100_000)
    with pytest.raises(UnsafeFileError, match=r"config\.json is not JSON weightstore parses: it holds 100000 JSON"):
        keras_file.read_config(odd)
    for text, refusal in (('{"a": [' * 2_000 + "1" + "]}" * 2_000, r"config\.json is not JSON \(maximum recursion"),
                          # parsed, yet a walk of it or its repr would raise RecursionError deeper in a stack
                          ('{"a": ' + "[" * 400 + "]" * 400 + "}", r"config\.json nests objects and arrays more than 100"),
                          ('{"a": 1, "a": 2}', r"config\.json names 'a' twice")):
        with zipfile.ZipFile(odd, "w") as archive:
            archive.writestr("config.json", text + " " * 16_000)
        with pytest.raises(FormatError, match=refusal):
            keras_file.read_config(odd)
    with zipfile.ZipFile(odd, "w") as archive:  # Keras writes with Python's json: NaN and Infinity are read
        archive.writestr("config.json", '{"class_name": "X", "config": {"max_value": Infinity, "p": NaN}}')
    assert keras_file.read_config(odd)["config"]["max_value"] == float("inf")
    with pytest.raises(FormatError, match="holds no config.json"):
        keras_file.read_config(_weights_only(tmp_path))


def _weights_only(tmp_path: Path) -> Path:
    path = tmp_path / "weights_only.keras"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("model.weights.h5", b"")
    return path


def zip_with(path: Path, name: str, payload: bytes, *, method: int = zipfile.ZIP_STORED,
             raw_name: bytes | None = None) -> Path:
    with zipfile.ZipFile(path, "w", method) as archive:
        archive.writestr(name, payload)
    if raw_name is not None:  # a name that is not what its UTF-8 flag says
        data = path.read_bytes().replace(name.encode(), raw_name)
        data = bytearray(data)
        for signature, flag_at in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
            at = data.index(signature)
            data[at + flag_at + 1] |= 0x08  # bit 11 of the flags: names are UTF-8
        path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("suffix", [".keras", ""])
def test_odd_zips_give_clear_errors_not_library_exceptions(tmp_path, suffix):
    cases = [
        zip_with(tmp_path / f"bzip{suffix}", "model.weights.h5", b"x" * 100, method=zipfile.ZIP_BZIP2),
        zip_with(tmp_path / f"name{suffix}", "model.weights.h5", b"x", raw_name=b"model.weights\xff\xfe"),
        tmp_path / f"notzip{suffix}",
    ]
    cases[2].write_bytes(b"PK\x03\x04 but not really a zip")
    for path in cases:
        with pytest.raises(WeightStoreError) as caught:
            ws.open(path)
        assert path.name in str(caught.value)
        result = CliRunner().invoke(app, ["ls", str(path)])
        assert result.exit_code == 1 and "internal error" not in result.output, result.output


def sliced(tmp_path: Path, full_shape, slices, pieces) -> str:
    """A checkpoint of one partitioned float variable ``v``: ``pieces`` are ``(extents, array)``."""
    prefix = tmp_path / "sliced"
    items, data = [(b"", tf_forge.header())], b""
    items.append((b"v", tf_forge.entry(shape=full_shape, slices=slices)))
    for extents, array in pieces:
        raw = array.astype("<f4").tobytes()
        items.append((slice_key(b"v", extents), tf_forge.entry(shape=array.shape, offset=len(data), size=len(raw),
                                                                 crc=crc32c.crc32c(raw))))
        data += raw
    Path(f"{prefix}.index").write_bytes(tf_forge.table(sorted(items)))
    Path(f"{prefix}.data-00000-of-00001").write_bytes(data)
    return str(prefix)


def test_forged_slices_join_like_tensorflows(tmp_path):
    top, bottom = np.zeros((1, 3), np.float32), np.ones((2, 3), np.float32)
    prefix = sliced(tmp_path, (3, 3), [[(0, 1), (0, -1)], [(1, 2), (0, -1)]],
                    [([(0, 1), (0, -1)], top), ([(1, 2), (0, -1)], bottom)])
    np.testing.assert_array_equal(ws.load(prefix)["v"], tf_values(prefix)["v"])


SLICE_LIES = {
    "a slice the index lacks": ([[(0, 1), (0, -1)], [(1, 2), (0, -1)]], 1, "lists a slice .* the index does not hold"),
    "slices that leave a gap": ([[(0, 1), (0, -1)]], 1, "do not cover its shape"),
    "overlapping slices": ([[(0, 2), (0, -1)], [(1, 2), (0, -1)]], 2, "tensor 'v': two of its slices overlap"),
    "a slice outside the shape": ([[(0, 1), (0, -1)], [(1, 5), (0, -1)]], 2, "reaches outside its shape"),
}


@pytest.mark.parametrize("case", sorted(SLICE_LIES))
def test_forged_slices_that_lie_are_refused(tmp_path, case):
    slices, backed, message = SLICE_LIES[case]
    pieces = [(extents, np.ones([length if length >= 0 else 3 for _, length in extents], np.float32))
              for extents in slices[:backed]]
    with pytest.raises(FormatError, match=message):
        ws.open(sliced(tmp_path, (3, 3), slices, pieces))


def test_a_huge_sliced_tensor_is_refused_before_it_is_allocated(tmp_path):
    prefix = tmp_path / "huge"
    side = 1 << 24
    items = [(b"", tf_forge.header()), (b"v", tf_forge.entry(shape=(side, side), slices=[[(0, -1), (0, -1)]])),
             (slice_key(b"v", [(0, -1), (0, -1)]), tf_forge.entry(shape=(side, side), size=4 * side * side))]
    Path(f"{prefix}.index").write_bytes(tf_forge.table(sorted(items)))
    Path(f"{prefix}.data-00000-of-00001").write_bytes(b"\0" * 64)
    with ws.open(prefix) as store:
        assert store.info("v").nbytes == 4 << 48  # what the index claims; max_bytes can refuse it
        with pytest.raises(FormatError, match=r"tensor 'v': data file is short: needs bytes 0\.\.1125899906842624"):
            store["v"]


def test_a_closed_checkpoint_refuses_reads(made):
    store = ws.open(made["tf1"])
    store.close()
    with pytest.raises(FormatError, match="tensor 'model/w': the checkpoint is closed; open it again"):
        store["model/w"]


def test_a_data_file_the_system_will_not_open_is_a_file_access_error_naming_it_and_the_tensor(tmp_path):
    """A symbolic link loop where a data file belongs: the system's refusal, said in its words,
    not a FormatError reading 'unreadable (None)'."""
    prefix = forged(tmp_path)
    data = Path(prefix + ".data-00000-of-00001")
    data.unlink()
    data.symlink_to(data.name)
    with ws.open(prefix) as store, pytest.raises(ws.FileAccessError, match="symbolic links") as caught:
        store["w"]
    assert caught.value.path == str(data) and caught.value.key == "w"


def test_fifos_where_files_belong_are_refused_not_waited_on(tmp_path):
    prefix = forged(tmp_path)
    data = Path(prefix + ".data-00000-of-00001")
    data.unlink()
    os.mkfifo(data)
    with ws.open(prefix) as store, pytest.raises(FormatError, match=r"data-00000-of-00001: is not a regular file"):
        store["w"]
    index = Path(prefix + ".index")
    index.unlink()
    os.mkfifo(index)
    with pytest.raises(FormatError, match=r"forged\.index: is not a regular file"):
        ws.open(prefix)
    os.mkfifo(tmp_path / "pipe.keras")
    with pytest.raises(FormatError, match=r"pipe\.keras: is not a regular file"):
        ws.open(tmp_path / "pipe.keras")


def test_a_checkpoint_folder_beside_a_dangling_safetensors_index_reads_its_checkpoint(made, tmp_path):
    """A TF checkpoint folder whose model.safetensors.index.json is a dangling link (a Hugging Face
    export moved away) is read as the checkpoint it holds, not refused on the broken link."""
    folder = tmp_path / "run"
    prefix = copy_checkpoint(made["tf2"], folder, "ckpt-1")
    (folder / "model.safetensors.index.json").symlink_to(tmp_path / "moved-away.json")
    loaded = ws.load(folder)
    assert loaded.keys() == ws.load(prefix).keys() and loaded
