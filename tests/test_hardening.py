"""The classes of hostile input, each a test: crashes in a subprocess, memory under an
address-space limit, time under a timeout, and leaked library exceptions as WeightStoreErrors
naming the file and tensor."""

from __future__ import annotations

import itertools
import json
import os
import struct
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import weightstore as ws
from weightstore import errors
from weightstore.formats.tf_checkpoint import natural_order, slice_key

sys.path.insert(0, str(Path(__file__).parent))
import hostile  # noqa: E402
import tf_forge  # noqa: E402
from hostile import raises_naming  # noqa: E402


def _safetensors(path: Path, header: dict | str, data: bytes = b"") -> Path:
    raw = (header if isinstance(header, str) else json.dumps(header)).encode("utf-8")
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _read_all(path) -> None:
    with ws.open(path) as store:
        for key in store:
            store[key]


# -- files truncated in place under an open store ----------------------------------------------

def _checkpoint(tmp_path: Path) -> tuple[str, str]:
    prefix = tf_forge.write(tmp_path / "ckpt", {"a": np.arange(1 << 14, dtype=np.float32),
                                                 "b": np.ones(1 << 14, np.float32)})
    return prefix, f"{prefix}.data-00000-of-00001"


def _safetensors_store(tmp_path: Path) -> tuple[str, str]:
    path = tmp_path / "m.safetensors"
    ws.save(path, {"a": np.arange(1 << 14, dtype=np.float32), "b": np.ones(1 << 14, np.float32)})
    return str(path), str(path)


@pytest.mark.parametrize("make", [_safetensors_store, _checkpoint], ids=["safetensors", "tf-checkpoint"])
def test_file_truncated_in_place_under_an_open_store_is_refused_not_sigbus(tmp_path, make):
    """The npz guard (the file's size checked before each read), now every mapped reader's:
    without it the read of ``b`` touched pages past the new end and the process died of SIGBUS."""
    opened, data_file = make(tmp_path)
    result = hostile.run_isolated(
        f"store = ws.open({opened!r})\n"
        "a = store['a']\n"
        f"with open({data_file!r}, 'r+b') as f:\n"
        "    f.truncate(64)\n"
        "for how in ('getitem', 'read_into'):\n"
        "    try:\n"
        "        store['b'] if how == 'getitem' else store.read_into('b', np.empty(1 << 14, np.float32))\n"
        "    except ws.FormatError as exc:\n"
        "        print('REFUSED', how, exc)\n"
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.count("REFUSED") == 2 and data_file in result.stdout and "'b'" in result.stdout


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
@pytest.mark.parametrize("read", ["one", "all", "some"])
def test_file_cut_between_open_and_the_first_read_is_refused_naming_it(tmp_path, suffix, read):
    """The map is made at the first tensor read, of the size the file had at open (its index
    came from one pread): a file cut before then made ``mmap`` raise ValueError, from
    safetensors' ``read`` of 16 tensors or more."""
    path = tmp_path / f"m{suffix}"
    ws.save(path, {f"t{i:02d}": np.full(64, i, np.float32) for i in range(20)})
    with ws.open(path) as store:
        with open(path, "r+b") as handle:
            handle.truncate(path.stat().st_size // 2)
        with raises_naming(errors.FormatError, path, "changed size"):
            store["t00"] if read == "one" else store.read() if read == "all" else store.read(list(store)[:17])


def test_hdf5_data_truncated_in_place_under_an_open_store_is_refused_not_sigbus(tmp_path):
    """HDF5 datasets are views of the mapped file too: cut inside ``b``'s data, with every
    header intact, the read of ``b`` would touch pages past the new end."""
    path = str(tmp_path / "m.h5")
    ws.save(path, {"a": np.arange(1 << 14, dtype=np.float32), "b": np.ones(1 << 16, np.float32)})
    with h5py.File(path, "r") as file:
        cut = file["b"].id.get_offset() + 4096
    result = hostile.run_isolated(
        f"store = ws.open({path!r})\n"
        "a = store['a']\n"
        f"with open({path!r}, 'r+b') as f:\n"
        f"    f.truncate({cut})\n"
        "try:\n"
        "    print(float(store['b'].sum()))\n"
        "except ws.FormatError as exc:\n"
        "    print('REFUSED', exc)\n"
        "print(float(a.sum()))\n"
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "REFUSED" in result.stdout and path in result.stdout and "'b'" in result.stdout
    assert result.stdout.strip().endswith(str(float(np.arange(1 << 14, dtype=np.float32).sum())))


# -- library exceptions that leaked ------------------------------------------------------------

def test_tf_entry_of_a_shape_numpy_cannot_make_is_a_format_error(tmp_path):
    """``(0, 2**62)`` needs no bytes, but numpy counts the zero as one and raised ValueError."""
    prefix = tf_forge.write(tmp_path / "ckpt", {"w": np.zeros(1, np.float32)},
                            overrides={"w": {"shape": (0, 2**62), "size": 0, "crc": 0}})
    with raises_naming(errors.FormatError, f"{prefix}.index", "'w'", "impossible shape"):
        _read_all(prefix)


def test_tf_scalar_with_two_slices_is_a_format_error(tmp_path):
    """A "partitioned" scalar raised IndexError in the slice-overlap check."""
    prefix = tmp_path / "ckpt"
    items = [(b"", tf_forge.header()), (b"v", tf_forge.entry(shape=(), slices=[[], []])),
             (slice_key(b"v", []), tf_forge.entry(shape=(), size=4))]
    Path(f"{prefix}.index").write_bytes(tf_forge.table(sorted(items)))
    Path(f"{prefix}.data-00000-of-00001").write_bytes(bytes(4))
    with raises_naming(errors.FormatError, f"{prefix}.index", "'v'", "scalar"):
        _read_all(str(prefix))


@pytest.mark.parametrize("edge", ["9" * 5000, "²", "٣"])
def test_keys_order_without_converting_digits(edge):
    """Object-graph edges become key segments and keys sort naturally: 5,000 digits (past
    ``int``'s limit) and ``²`` (``isdigit`` but no ``int``) raised ValueError."""
    keys = [f"model/{edge}/w", "model/10/w", "model/2/w", "model/x/w"]
    ordered = sorted(keys, key=natural_order)
    assert ordered.index("model/2/w") < ordered.index("model/10/w")
    assert set(ordered) == set(keys)


def test_latest_naming_a_step_of_5000_digits_is_a_format_error(tmp_path):
    ws.publish(tmp_path, {"w": np.zeros(2)}, step=1)
    pointer = json.loads((tmp_path / "LATEST").read_text())
    pointer["file"] = "step-" + "9" * 5000 + ".npz"
    (tmp_path / "LATEST").write_text(json.dumps(pointer))
    with raises_naming(errors.FormatError, tmp_path, "LATEST"):
        ws.latest(tmp_path)


def test_safetensors_dtype_that_is_a_json_list_is_a_format_error(tmp_path):
    path = _safetensors(tmp_path / "m.safetensors", {"t": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},
                        bytes(4))
    with raises_naming(errors.FormatError, path, "'t'", "unknown dtype"):
        ws.open(path)


def test_safetensors_metadata_with_a_lone_surrogate_is_refused_at_open(tmp_path):
    """It read, then failed as UnicodeEncodeError on convert and made ``ws ls --json`` print
    bytes that are not UTF-8."""
    path = _safetensors(tmp_path / "m.safetensors",
                        '{"__metadata__": {"note": "\\ud800"}, "t": {"dtype": "F32", "shape": [1], '
                        '"data_offsets": [0, 4]}}', bytes(4))
    with raises_naming(errors.FormatError, path, "'note'", "surrogate"):
        ws.open(path)
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    result = CliRunner().invoke(app, ["ls", "--json", str(path)])
    assert result.exit_code != 0
    report = json.loads(result.stdout.encode("utf-8"))
    assert report["error"]["type"] == "FormatError"


# -- keys a format reserves; a manifest nobody may change --------------------------------------

@pytest.mark.parametrize("save", ["save", "publish"])
def test_safetensors_metadata_key_is_refused_before_anything_is_written(tmp_path, save):
    """A tensor keyed ``__metadata__`` made a file no reader (ours or the library) opens."""
    weights = {"w": np.zeros(2, np.float32), "__metadata__": np.zeros(2, np.float32)}
    target = tmp_path / "m.safetensors"
    with raises_naming(errors.InvalidKeyError, "'__metadata__'", "safetensors"):
        if save == "save":
            ws.save(target, weights)
        else:
            ws.publish(tmp_path / "versions", weights, step=1, format="safetensors")
    assert not target.exists() and not list(tmp_path.glob("versions/step-*"))
    ws.save(tmp_path / "m.npz", weights)  # other formats hold it
    assert "__metadata__" in ws.load(tmp_path / "m.npz")


def _change_user_metadata(path: Path) -> None:
    """Edit the manifest's user metadata in place of the same length, header untouched otherwise."""
    data = path.read_bytes()
    assert data.count(b'\\"lr\\": 0.5') == 1
    path.write_bytes(data.replace(b'\\"lr\\": 0.5', b'\\"lr\\": 9.5'))


def test_changed_safetensors_metadata_fails_load_and_verify(tmp_path):
    path = tmp_path / "m.safetensors"
    ws.save(path, {"w": np.arange(4, dtype=np.float32)}, metadata={"lr": 0.5})
    assert ws.open(path).metadata == {"lr": 0.5}
    _change_user_metadata(path)
    with raises_naming(errors.ChecksumError, path, "manifest"):
        ws.load(path)
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    result = CliRunner().invoke(app, ["verify", str(path)])
    assert result.exit_code != 0 and "checksums match" not in result.output


def test_safetensors_manifest_under_a_damaged_entry_name_is_refused_not_read_unverified(tmp_path):
    """One byte of the entry's name changed made the file a plain safetensors file: its tensors
    read unverified, so a byte changed in their data too was read as it was (found by fuzzing)."""
    path = tmp_path / "m.safetensors"
    ws.save(path, {"w": np.arange(4, dtype=np.float32)})
    data = bytearray(path.read_bytes().replace(b'"weightstore":"', b'"weightst/re":"'))
    data[-1] ^= 0x40
    path.write_bytes(data)
    with raises_naming(errors.FormatError, path, "weightst/re", "manifest"):
        ws.open(path)


def test_safetensors_written_before_the_manifest_checksum_still_read(tmp_path):
    """A file whose ``__metadata__`` has the manifest but no checksum of it (every file written
    before the checksum existed) reads as before, with its tensors verified."""
    path = tmp_path / "m.safetensors"
    ws.save(path, {"w": np.arange(4, dtype=np.float32)}, metadata={"lr": 0.5})
    length = struct.unpack("<Q", path.read_bytes()[:8])[0]
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + length])
    manifest = header["__metadata__"]["weightstore"]
    header["__metadata__"]["weightstore"] = manifest[: manifest.rindex(', "checksum"')] + "}"
    old = json.dumps(header, separators=(",", ":")).encode("utf-8")
    old += b" " * (length - len(old))  # the data stays where it was
    path.write_bytes(raw[:8] + old + raw[8 + length :])
    store = ws.open(path)
    assert store.has_checksums and store.metadata == {"lr": 0.5}
    np.testing.assert_array_equal(store["w"], np.arange(4, dtype=np.float32))


# -- time: slice tiling -------------------------------------------------------------------------

def _many_slices(prefix: Path, count: int, variables: int) -> str:
    """``variables`` partitioned variables of shape ``(2, count)``, each in ``count`` column
    slices: every slice starts at 0 on the first axis, the case a sort by it did not help."""
    import crc32c

    items, data = [(b"", tf_forge.header())], b""
    for number in range(variables):
        name = f"v{number}".encode()
        slices = [[(0, -1), (column, 1)] for column in range(count)]
        items.append((name, tf_forge.entry(shape=(2, count), slices=slices)))
        for extents in slices:
            raw = np.full((2, 1), extents[1][0], "<f4").tobytes()
            items.append((slice_key(name, extents), tf_forge.entry(shape=(2, 1), offset=len(data), size=len(raw),
                                                                    crc=crc32c.crc32c(raw))))
            data += raw
    Path(f"{prefix}.index").write_bytes(tf_forge.table(sorted(items)))
    Path(f"{prefix}.data-00000-of-00001").write_bytes(data)
    return str(prefix)


@pytest.mark.slow
def test_slice_tiling_is_checked_in_n_log_n_not_quadratic_time(tmp_path):
    """Five variables of 4,096 slices (a 1 MB index) took 94 s to open; now about a second,
    here under a 30 s timeout."""
    prefix = _many_slices(tmp_path / "ckpt", 4096, 5)
    result = hostile.run_isolated(
        f"with ws.open({prefix!r}) as store:\n"
        "    print('READ', len(store), store['v4'][1, 4095])\n", timeout=30)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "READ 5 4095.0" in result.stdout


def test_slices_on_an_irregular_grid_are_refused_and_gaps_still_found(tmp_path):
    """Staggered slices (bricks) cut a grid of far more cells than slices: refused, not
    compared pairwise. A partition along both axes is read."""
    import crc32c

    def checkpoint(name: str, slices: list) -> str:
        prefix = tmp_path / name
        items, data = [(b"", tf_forge.header())], b""
        items.append((b"v", tf_forge.entry(shape=(64, 64), slices=slices)))
        for extents in slices:
            shape = tuple(length for _, length in extents)
            raw = np.ones(shape, "<f4").tobytes()
            items.append((slice_key(b"v", extents), tf_forge.entry(shape=shape, offset=len(data), size=len(raw),
                                                                    crc=crc32c.crc32c(raw))))
            data += raw
        Path(f"{prefix}.index").write_bytes(tf_forge.table(sorted(items)))
        Path(f"{prefix}.data-00000-of-00001").write_bytes(data)
        return str(prefix)

    grid = [[(row, 8), (column, 8)] for row in range(0, 64, 8) for column in range(0, 64, 8)]
    np.testing.assert_array_equal(ws.load(checkpoint("grid", grid))["v"], np.ones((64, 64), np.float32))
    bricks = []  # rows of bricks 8 wide, each row shifted one further: 64 x 64 cells for 576 slices
    for row in range(64):
        cuts = sorted({0, 64, *range(row % 8, 64, 8)})
        bricks += [[(row, 1), (start, stop - start)] for start, stop in itertools.pairwise(cuts)]
    with raises_naming(errors.UnsafeFileError, "'v'", "grid"):
        ws.open(checkpoint("bricks", bricks))
    with raises_naming(errors.FormatError, "'v'", "do not cover"):
        ws.open(checkpoint("gap", grid[:-1]))


# -- writes the file system refuses -------------------------------------------------------------

def test_saves_and_publishes_past_a_file_size_limit_are_write_errors_naming_the_target(tmp_path):
    """A full disk or a file-size limit was a bare ``OSError`` without a path, handed as it was
    to the training loop by the background publisher; now a WriteError (an OSError with its
    errno) naming the file, and the target is left as it was."""
    result = hostile.run_isolated(
        "import errno\n"
        "weights = {'w': np.ones(1 << 16, np.float32)}\n"
        f"folder = {str(tmp_path)!r}\n"
        "def report(what, call):\n"
        "    try:\n"
        "        call()\n"
        "    except ws.WriteError as exc:\n"
        "        print('REFUSED', what, isinstance(exc, OSError) and exc.errno == errno.EFBIG, exc.path)\n"
        "report('npz', lambda: ws.save(folder + '/m.npz', weights))\n"
        "report('safetensors', lambda: ws.save(folder + '/m.safetensors', weights))\n"
        "report('publish', lambda: ws.publish(folder + '/versions', weights, step=1))\n"
        "with ws.BackgroundPublisher(folder + '/background') as publisher:\n"
        "    report('background', lambda: publisher.publish(weights, step=2).result())\n",
        file_size=1 << 16,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines == [
        f"REFUSED npz True {tmp_path}/m.npz", f"REFUSED safetensors True {tmp_path}/m.safetensors",
        f"REFUSED publish True {tmp_path}/versions/step-000000000001.npz",
        f"REFUSED background True {tmp_path}/background/step-000000000002.npz",
    ], result.stdout
    assert list(tmp_path.glob("m.*")) == list(tmp_path.glob("*/step-*")) == list(tmp_path.glob("*/LATEST")) == []


# -- PyTorch: the strict plan holds ------------------------------------------------------------

def _tied_autoencoder():
    import torch
    from torch import nn

    class TiedAutoencoder(nn.Module):
        """The decoder's weight is the encoder's, transposed: one storage under two keys."""

        def __init__(self):
            super().__init__()
            self.encoder = nn.Linear(4, 6, bias=False)
            self.decoder = nn.Linear(6, 4, bias=False)
            self.decoder.weight = nn.Parameter(self.encoder.weight.t())

    torch.manual_seed(0)
    return TiedAutoencoder()


def test_torch_tied_transposed_weights_take_one_consistent_value_or_are_refused_naming_both():
    """They took two values, both reported assigned, and the encoder kept the decoder's."""
    pytest.importorskip("torch")
    from weightstore.adapters import torch as torch_adapter

    model = _tied_autoencoder()
    kernel = np.arange(24, dtype=np.float32).reshape(6, 4)
    report = torch_adapter.assign(model, {"encoder/weight": kernel, "decoder/weight": kernel.T.copy()})
    assert sorted(report.assigned) == ["decoder/weight", "encoder/weight"]
    np.testing.assert_array_equal(model.encoder.weight.detach().numpy(), kernel)
    with raises_naming(errors.AssignmentError, "decoder/weight", "encoder/weight", "nothing was changed"):
        torch_adapter.assign(model, {"encoder/weight": kernel, "decoder/weight": -kernel.T.copy()})
    np.testing.assert_array_equal(model.encoder.weight.detach().numpy(), kernel)
    report = torch_adapter.assign(model, {"encoder/weight": 2 * kernel, "decoder/weight": -kernel.T.copy()},
                                  strict=False)
    assert report.assigned == ["encoder/weight"] and [m.key for m in report.mismatched] == ["decoder/weight"]
    np.testing.assert_array_equal(model.decoder.weight.detach().numpy(), 2 * kernel.T)


def test_torch_assign_into_tensors_that_cannot_be_written_in_place_changes_nothing():
    """An inference tensor and an expanded buffer: the first tensors were changed, then
    torch's RuntimeError leaked out of a strict plan."""
    torch = pytest.importorskip("torch")
    from torch import nn

    from weightstore.adapters import torch as torch_adapter

    model = nn.Module()
    model.layer = nn.Linear(2, 2)
    with torch.inference_mode():
        model.register_buffer("frozen", torch.zeros(3))
    model.register_buffer("wide", torch.zeros(1, 3).expand(4, 3))
    before = {key: value.detach().clone() for key, value in torch_adapter.tensors(model).items()}
    weights = {"layer/weight": np.ones((2, 2), np.float32), "layer/bias": np.ones(2, np.float32),
               "frozen": np.ones(3, np.float32), "wide": np.ones((4, 3), np.float32)}
    with raises_naming(errors.AssignmentError, "frozen", "inference tensor", "wide", "expanded"):
        torch_adapter.assign(model, weights)
    assert all(torch.equal(before[key], value) for key, value in torch_adapter.tensors(model).items())
    report = torch_adapter.assign(model, weights, strict=False)
    assert sorted(report.assigned) == ["layer/bias", "layer/weight"]
    assert sorted(m.key for m in report.mismatched) == ["frozen", "wide"]


# -- memory: .keras configs are never used to allocate -----------------------------------------

@pytest.mark.slow
def test_keras_config_claiming_gigabytes_builds_its_model_in_no_memory(tmp_path, tf_fork):
    """``ws export --model-keys`` of a small archive whose Dense claims a billion units (a
    12 GB kernel) allocated it; the model is now built without initializing its variables,
    and the weights, of another shape than the config claims, are refused.
    One process (forked from one that imported Keras: ``conftest.tf_fork``) makes a real tiny
    archive, edits its config, then runs the command under a 4 GB address-space limit, so a
    regression fails instead of exhausting the machine."""
    pytest.importorskip("keras")
    script = (
        "import os, resource, sys, zipfile\n"
        "os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'\n"
        "import keras\n"
        "small, claims, out = sys.argv[1:4]\n"
        "keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name='dense')]).save(small)\n"
        "with zipfile.ZipFile(small) as source, zipfile.ZipFile(claims, 'w') as target:\n"
        "    for info in source.infolist():\n"
        "        data = source.read(info)\n"
        "        if info.filename == 'config.json':\n"
        "            assert data.count(b'\"units\": 4') == 1\n"
        "            data = data.replace(b'\"units\": 4', b'\"units\": 1000000000')\n"
        "        target.writestr(info, data)\n"
        "print('ARCHIVE', os.path.getsize(claims), flush=True)\n"
        "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
        "from weightstore.cli.main import main\n"
        "sys.argv = ['ws', 'export', claims, '-o', out, '--model-keys']\n"
        "main()\n"
    )
    result = tf_fork.run(script, str(tmp_path / "small.keras"), str(tmp_path / "claims.keras"), str(tmp_path / "out.npz"),
                     timeout=240)
    assert "ARCHIVE" in result.stdout, result.stderr[-2000:]
    assert int(result.stdout.split("ARCHIVE ")[1].split()[0]) < 64 << 10
    assert "OOM" not in result.stderr and "MemoryError" not in result.stderr, result.stderr[-2000:]  # allocated
    # the config's model and the archive's weights disagree: refused, naming both, with nothing written
    assert result.returncode == 1 and "does not fit the model of" in result.stderr, result.stderr[-2000:]
    assert "2 of another shape than the model's ('dense/kernel', 'dense/bias')" in result.stderr
    assert not (tmp_path / "out.npz").exists()


# -- memory: TF checkpoint indexes and object graphs ------------------------------------------

def test_index_keys_sharing_prefixes_are_bounded_by_the_table_size(tmp_path):
    """50,000 entries of 4 bytes whose keys each extend the last made 1.2 GB of keys from a
    200 KB index; now refused before a key past 16x the table is made (256 MB here)."""
    prefix = tf_forge.shared_prefix_index(tmp_path / "keys", 40_000)
    assert Path(f"{prefix}.index").stat().st_size < 300 << 10
    result = hostile.run_isolated(
        f"try:\n    ws.open({prefix!r})\nexcept ws.UnsafeFileError as exc:\n    print('REFUSED', exc)\n",
        timeout=60, address_space=256 << 20)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED" in result.stdout and "keys.index" in result.stdout and "shared prefixes" in result.stdout


def test_object_graph_paths_are_bounded_by_the_graph_size(tmp_path):
    """A chain of 12,000 one-letter edges (120 KB) made 72 million path segments (0.7 GB); the
    walk now stops at 8 per byte and the keys fall back to the entry names."""
    prefix = tf_forge.with_object_graph(tmp_path / "deep", tf_forge.chain_graph(12_000),
                                        {"w/.ATTRIBUTES/VARIABLE_VALUE": np.arange(3, dtype=np.float32)})
    result = hostile.run_isolated(
        f"with ws.open({prefix!r}) as store:\n    print('KEYS', store.keys(), store['w'])\n",
        timeout=60, address_space=256 << 20)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "KEYS ['w'] [0. 1. 2.]" in result.stdout


@pytest.mark.parametrize("edge", ["9" * 5000, "²"])
def test_object_graph_edges_that_no_int_reads_key_their_variables(tmp_path, edge):
    from weightstore.formats._tf_protos import TrackableObjectGraph

    graph = TrackableObjectGraph()
    root, layer, variable = graph.nodes.add(), graph.nodes.add(), graph.nodes.add()
    root.children.add(node_id=1, local_name=edge)
    layer.children.add(node_id=2, local_name="kernel")
    variable.attributes.add(name="VARIABLE_VALUE", checkpoint_key="k/.ATTRIBUTES/VARIABLE_VALUE")
    prefix = tf_forge.with_object_graph(tmp_path / "edge", graph.SerializeToString(),
                                        {"k/.ATTRIBUTES/VARIABLE_VALUE": np.ones(2, np.float32),
                                         "z/.ATTRIBUTES/VARIABLE_VALUE": np.zeros(1, np.float32)})
    with ws.open(prefix) as store:
        assert store.keys() == [f"{edge}/kernel", "z"] or store.keys() == ["z", f"{edge}/kernel"]
        np.testing.assert_array_equal(store[f"{edge}/kernel"], np.ones(2, np.float32))


# -- .keras archives ---------------------------------------------------------------------------

def _keras_archive(path: Path, *, extra_members: int = 0,
                   config: str | None = '{"class_name": "Sequential", "config": {}}', tensors: tuple[str, ...] = ("layers/dense/vars/0",)) -> Path:
    """A ``.keras`` archive made by hand: config, metadata and a Keras-style weights file."""
    import io
    import zipfile

    import h5py

    weights = io.BytesIO()
    with h5py.File(weights, "w") as handle:
        for name in tensors:
            handle[name] = np.ones((3, 4), np.float32)
    with zipfile.ZipFile(path, "w") as archive:
        for number in range(extra_members):
            archive.writestr(f"assets/{number}", b"")
        archive.writestr("metadata.json", "{}")
        if config is not None:
            archive.writestr("config.json", config)
        archive.writestr("model.weights.h5", weights.getvalue())
    return path


@pytest.mark.parametrize("name", ["ckpt.index", "ckpt.data-00000-of-00001"])
def test_a_checkpoint_file_holding_a_keras_archive_is_the_checkpoints(tmp_path, name):
    """zipfile finds an archive after any bytes, so a damaged TF index ending in a ``.keras``
    archive (``./tasks fuzz`` made one) read as that archive's weights: a checkpoint's own file
    is refused as the checkpoint's; a zip whose name says nothing is still read as Keras."""
    archive = _keras_archive(tmp_path / "m.keras").read_bytes()
    (tmp_path / "ckpt.index").write_bytes(b"\x00\x1b" + archive)
    (tmp_path / name).write_bytes(b"\x00\x1b" + archive)
    with raises_naming(errors.FormatError, tmp_path / "ckpt.index", "index"):
        ws.load(tmp_path / name)
    (tmp_path / "model").write_bytes(archive)
    assert list(ws.load(tmp_path / "model")) == ["layers/dense/vars/0"]


def test_a_keras_archive_swapped_after_its_check_is_read_as_checked(tmp_path, monkeypatch):
    """The archive is checked to be a regular file, then read: ``zipfile`` given its name opened
    it again, so a file swapped in between (a FIFO would block) was read instead. It is read
    through the descriptor checked."""
    from weightstore.formats import keras_file

    path = _keras_archive(tmp_path / "m.keras")
    checked = keras_file._refuse_crowded

    def swapped(*args):  # the swap lands between the check and zipfile's open
        checked(*args)
        (tmp_path / "other").write_bytes(b"not a zip at all")
        os.replace(tmp_path / "other", path)

    monkeypatch.setattr(keras_file, "_refuse_crowded", swapped)
    assert sorted(ws.load(path)) == ["layers/dense/vars/0"]



@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("checked_file", ["removed", "moved"])
def test_an_hdf5_file_swapped_after_its_check_is_read_as_checked(tmp_path, monkeypatch, mmap, checked_file):
    """The file is opened and checked to be a regular file (a FIFO would make libhdf5 wait for a
    writer), then libhdf5 opens it: given the name, it opened whatever the name held by then, so
    another file renamed over it in between was read. It reads the file checked, whether that
    was removed by the rename or moved elsewhere first."""
    path, other = tmp_path / "m.h5", tmp_path / "other.h5"
    ws.save(path, {"w": np.ones((64, 64), np.float32), "b": np.ones(64, np.float32)})
    ws.save(other, {"w": np.full((64, 64), 2, np.float32), "b": np.full(64, 2, np.float32)})
    libhdf5_opens = h5py.File

    def swapped(*args, **kwargs):  # the swap lands between the check and libhdf5's open
        if other.exists():
            if checked_file == "moved":
                os.replace(path, tmp_path / "elsewhere.h5")
            os.replace(other, path)
        return libhdf5_opens(*args, **kwargs)

    monkeypatch.setattr(h5py, "File", swapped)
    with ws.open(path, mmap=mmap) as store:
        assert {key: float(np.unique(store[key])[0]) for key in store} == {"w": 1.0, "b": 1.0}
    assert not other.exists()

def _sequential(*layers: str) -> str:
    """A Sequential's config.json around ``layers`` (each a layer's JSON), as Keras writes it."""
    return ('{"module": "keras", "class_name": "Sequential", "config": {"name": "sequential", "layers": ['
            + ", ".join(layers) + "]}}")


_DENSE = '{"module": "keras.layers", "class_name": "Dense", "config": {"name": "%s", "use_bias": %s}}'


@pytest.mark.parametrize(("config", "tensors", "why"), [
    (_sequential(_DENSE % ("head", "true")), ("layers/dense/vars/0",),
     "its config gives 'layers/dense/vars/1' a variable the file does not hold"),
    (_sequential(_DENSE % ("head", "false")), ("layers/dense/vars/0", "layers/dense/vars/1000000000"),
     "the file holds 'layers/dense/vars/1000000000', which its config gives no built-in layer"),
    (_sequential(_DENSE % ("head", "false")), ("layers/dense_1/vars/0", "layers/dense/vars/0"),
     "the file holds 'layers/dense_1/vars/0', which its config gives no built-in layer"),
], ids=["fewer-vars", "a-billionth-var", "another-layer"])
def test_keras_archive_whose_config_and_weights_disagree_keeps_its_own_names(tmp_path, config, tensors, why):
    """Never keys guessed from a config the weights contradict: the whole file keeps Keras's paths."""
    path = _keras_archive(tmp_path / "m.keras", config=config, tensors=tensors)
    with ws.open(path) as store:
        assert sorted(store.keys()) == sorted(tensors)
        assert store._reader.keys_note == why


def test_keras_archive_dtype_policy_of_any_json_shape_is_no_error(tmp_path):
    """A policy whose ``config`` is no object says nothing of quantization: the table keys the file."""
    dense = '{"module": "keras.layers", "class_name": "Dense", "config": {"name": "head", "use_bias": false, ' \
            '"dtype": {"class_name": "DTypePolicy", "config": [7]}}}'
    path = _keras_archive(tmp_path / "m.keras", config=_sequential(dense), tensors=("layers/dense/vars/0",))
    with ws.open(path) as store:
        assert store.keys() == ["head/kernel"]


def test_keras_archive_optimizer_state_named_with_a_non_ascii_digit_opens(tmp_path):
    """'optimizer/vars/²' passes str.isdigit but is no number int() reads: ordering the
    optimizer's state by number leaked a bare ValueError from ws.open."""
    path = _keras_archive(tmp_path / "m.keras", config=_sequential(_DENSE % ("head", "false")),
                          tensors=("layers/dense/vars/0", "optimizer/vars/2", "optimizer/vars/\u00b2"))
    with ws.open(path) as store:
        assert {"head/kernel", "optimizer/vars/\u00b2"} <= set(store.keys())


@pytest.mark.parametrize(("config", "words"), [
    ('{"module": "keras", "class_name": "Sequential", "config": {"name": "s", "layers": 7}}', "no list of layers"),
    (_sequential('"dense"'), "not an object with a class_name and a config"),
], ids=["layers-not-a-list", "layer-not-an-object"])
def test_keras_archive_with_a_config_keras_never_writes_is_refused_naming_it(tmp_path, config, words):
    path = _keras_archive(tmp_path / "m.keras", config=config, tensors=("layers/dense/vars/0", "layers/dense_1/vars/0"))
    with raises_naming(errors.FormatError, path, "config.json", words):
        ws.open(path)


def test_keras_archive_of_siblings_named_alike_is_keyed_as_tf2_keys_its_model(tmp_path):
    """A Conv2D the user named ``dense`` beside an automatic Dense: Keras loads it, so ws reads it,
    with ``tf2.export``'s keys, and ``tf2.assign`` puts it into a twin of the model."""
    keras = pytest.importorskip("keras")
    from weightstore.adapters import tf2

    layers = keras.layers
    keras.Sequential([keras.Input((3,)), layers.Dense(2)])  # an earlier Dense: the next is no longer 'dense'

    def build():
        return keras.Sequential([keras.Input((4, 4, 1)), layers.Conv2D(2, 3, name="dense"), layers.Flatten(),
                                 layers.Dense(2)])

    model = build()
    path = tmp_path / "m.keras"
    model.save(path)
    expected = tf2.export(model)
    with ws.open(path) as store:
        assert store.keys() == list(expected) == ["dense/kernel", "dense/bias", "dense_1/kernel", "dense_1/bias"]
        assert store._reader.keys_note == ""
        for key, value in expected.items():
            np.testing.assert_array_equal(store[key], value)
    twin = build()
    tf2.assign(twin, str(path))
    for mine, theirs in zip(twin.weights, model.weights, strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


def test_tf2_assign_of_a_keras_archive_pairs_by_its_own_names_whatever_its_config(tmp_path):
    """Keras's save walk over the live model pairs the file's names: a config ``ws.open`` refuses
    to key the archive by never stops an assign into the model."""
    import zipfile

    keras = pytest.importorskip("keras")
    from weightstore.adapters import tf2

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.save(tmp_path / "m.keras")
    path = tmp_path / "odd.keras"
    with zipfile.ZipFile(tmp_path / "m.keras") as saved, zipfile.ZipFile(path, "w") as odd:
        for member in saved.namelist():
            odd.writestr(member, '{"module": "keras", "class_name": "Sequential", "config": {"name": "s", "layers": 7}}' if member == "config.json"
                         else saved.read(member))
    with raises_naming(errors.FormatError, path, "config.json", "no list of layers"):
        ws.open(path)
    twin = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    tf2.assign(twin, str(path))
    for mine, theirs in zip(twin.weights, model.weights, strict=True):
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


@pytest.mark.parametrize(("names", "keys"), [
    (("dense_\u0663", "dense_3"), ["dense_\u0663/kernel", "dense/kernel"]),
    (("dense_" + "9" * 5000,), ["dense_" + "9" * 5000 + "/kernel"]),
], ids=["unicode-digit", "5000-digits"])
def test_keras_archive_names_keras_never_makes_up_are_the_users_own(tmp_path, names, keys):
    """Only ASCII digits, at most 18, make a name automatic: ``dense_\u0663`` is no ``dense_3``,
    and a 5,000-digit counter is no ValueError from ``int``."""
    tensors = tuple(f"layers/dense{'_' + str(i) if i else ''}/vars/0" for i in range(len(names)))
    path = _keras_archive(tmp_path / "m.keras", config=_sequential(*(_DENSE % (name, "false") for name in names)),
                          tensors=tensors)
    with ws.open(path) as store:
        assert store.keys() == keys
        assert store._reader.keys_note == ""


def test_tf2_names_keras_never_makes_up_are_the_users_own():
    keras = pytest.importorskip("keras")
    from weightstore.adapters import tf2

    long = "dense_" + "9" * 5000
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2, name="dense_\u0663", use_bias=False),
                              keras.layers.Dense(2, name=long, use_bias=False)])
    assert list(tf2.export(model)) == ["dense_\u0663/kernel", f"{long}/kernel"]


@pytest.mark.parametrize(("config", "words"), [
    (None, "its config.json cannot be read (.keras archive holds no config.json)"),
    ("{not json", "its config.json cannot be read (config.json"),
    (_sequential(_DENSE % ("dense", "false")) + " " * 400, "its config.json cannot be read (config.json declares "),
    (_sequential(_DENSE % ("..", "false")), "its config names a layer that makes no key"),
    (_sequential(_DENSE % ("a/../b", "false")), "its config names a layer that makes no key"),
], ids=["no-config", "not-json", "oversized", "dot-dot", "name-makes-no-key"])
def test_keras_archive_whose_config_cannot_key_it_keeps_its_own_names(tmp_path, monkeypatch, config, words):
    """The weights read without the config, as before it was read: under the file's own names,
    ``keys_note`` saying why (an oversized config is never parsed)."""
    from weightstore.formats import keras_file

    monkeypatch.setattr(keras_file, "MAX_KERAS_CONFIG_BYTES", 400)
    path = _keras_archive(tmp_path / "m.keras", config=config, tensors=("layers/dense/vars/0",))
    with ws.open(path) as store:
        assert store.keys() == ["layers/dense/vars/0"]
        assert store._reader.keys_note.startswith(words), store._reader.keys_note


def test_keras_archive_class_names_reach_ws_ls_escaped_and_bounded(tmp_path):
    """A config's class and module names go into the note ``ws ls`` prints: no terminal escape
    gets there whole, and a megabyte-long name is cut short."""
    evil = "\x1b]0;pwned\x07" + "A" * 1_000_000
    layer = json.dumps({"module": evil, "class_name": evil, "config": {"name": evil}})
    path = _keras_archive(tmp_path / "m.keras", config=_sequential(layer), tensors=("layers/dense/vars/0",))
    with ws.open(path) as store:
        note = store._reader.keys_note
    assert "\x1b" not in note and "\x07" not in note and "\\x1b" in note
    assert "is a" in note and len(note) < 2000


def test_keras_archive_missing_its_first_bytes_is_a_format_error(tmp_path):
    """Found by atheris: the weights member then lies before the file's start, and seeking
    there leaked ``OSError [Errno 22]``."""
    import zipfile

    path = _keras_archive(tmp_path / "whole.keras")
    with zipfile.ZipFile(path) as archive:
        weights_at = archive.getinfo("model.weights.h5").header_offset
    cut = tmp_path / "cut.keras"
    cut.write_bytes(path.read_bytes()[weights_at + 1 :])
    with raises_naming(errors.FormatError, cut, "model.weights.h5"):
        ws.load(cut)


def test_keras_archive_directory_of_thousands_of_members_is_refused_before_it_is_parsed(tmp_path):
    """``zipfile`` makes a 500-byte object of each 46-byte entry: 9x the file, unbounded."""
    path = _keras_archive(tmp_path / "crowded.keras", extra_members=5000)
    with raises_naming(errors.UnsafeFileError, path, "5003 members"):
        ws.load(path)
    assert ws.load(_keras_archive(tmp_path / "fine.keras", extra_members=10))["layers/dense/vars/0"].shape == (3, 4)


# -- memory: JSON manifests --------------------------------------------------------------------

def test_deflated_manifest_of_nested_objects_is_refused_before_it_is_inflated(tmp_path):
    """A manifest of 2.7 million empty objects, deflated (UTF-32 JSON deflates 1000x): it
    inflated to 32 MB of text, then parsed into 170 MB of dicts, from a file of 40 KB; the
    member may now inflate 32x, and any manifest holds at most one object per 4 bytes."""
    import zlib

    metadata = "[" + ",".join(["{}"] * 2_700_000) + "]"
    text = json.dumps({"format": "weightstore", "version": 1, "tensors": {}})[:-1] + ', "metadata": ' + metadata + "}"
    payload = hostile.npy(np.array(text))
    path = tmp_path / "nested.npz"
    path.write_bytes(hostile.zip_bytes([hostile.Member("__weightstore__.npy", hostile.deflated(payload),
                                                       method=8, size=len(payload), crc=zlib.crc32(payload))]))
    del payload, text
    assert path.stat().st_size < 64 << 10
    result = hostile.run_isolated(
        f"try:\n    ws.open({str(path)!r})\nexcept ws.UnsafeFileError as exc:\n    print('REFUSED', exc)\n",
        address_space=160 << 20)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED" in result.stdout and "manifest" in result.stdout and "nested.npz" in result.stdout
    from weightstore.core.manifest import parse_manifest

    with raises_naming(errors.UnsafeFileError, "m.npz", "JSON objects and arrays"):
        parse_manifest('{"format": "weightstore", "version": 1, "tensors": {}, "metadata": [' + "[]," * 10_000 + "0]}",
                       "m.npz")


def test_safetensors_header_dense_with_arrays_is_refused_before_it_is_parsed(tmp_path):
    """A 3 MB header of a million empty lists made 81 MB of lists before its entry was found
    malformed; it is now refused from a count of its brackets (9 MB in all)."""
    header = '{"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "x": [' + ",".join(["[]"] * 1_000_000) + "]}"
    path = _safetensors(tmp_path / "dense.safetensors", header, bytes(4))
    result = hostile.run_isolated(
        f"try:\n    ws.open({str(path)!r})\nexcept ws.UnsafeFileError as exc:\n    print('REFUSED', exc)\n",
        address_space=48 << 20)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED" in result.stdout and "dense.safetensors" in result.stdout and "JSON objects and arrays" in result.stdout


def _hf_folder(folder: Path, index: str) -> Path:
    folder.mkdir()
    ws.save(folder / "s1.safetensors", {"m.w": np.ones(2, np.float32)})
    (folder / "model.safetensors.index.json").write_text(index)
    return folder


def test_hugging_face_index_dense_with_arrays_is_refused_before_it_is_parsed(tmp_path):
    """8 MB of empty lists in an index's metadata made 220 MB of lists (27x the file)."""
    metadata = "[" + ",".join(["[]"] * 2_800_000) + "]"
    folder = _hf_folder(tmp_path / "dense", '{"weight_map": {"m.w": "s1.safetensors"}, "metadata": {"x": '
                        + metadata + "}}")
    result = hostile.run_isolated(
        f"try:\n    ws.open({str(folder)!r})\nexcept ws.UnsafeFileError as exc:\n    print('REFUSED', exc)\n",
        address_space=160 << 20)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED" in result.stdout and "model.safetensors.index.json" in result.stdout


@pytest.mark.parametrize(("index", "refusal", "error"), [
    ('{"weight_map": {"m.w": "s1.safetensors"}, "metadata": {"total_size": NaN}}', "NaN is not JSON", errors.FormatError),
    ('{"weight_map": {"m.w": "s1.safetensors", "m.w": "s2.safetensors"}}', "names 'm.w' twice", errors.UnsafeFileError),
    ('{"weight_map": {"m.w": "' + "x" * 300 + '.safetensors"}}', "which cannot be opened", errors.FormatError),
], ids=["nan", "duplicate-name", "name-too-long"])
def test_hugging_face_index_that_no_writer_makes_is_refused_naming_it(tmp_path, index, refusal, error):
    """NaN in the metadata reached ``ws ls --json`` as invalid JSON; a name twice was taken
    last-wins; a shard name the file system refuses leaked ``OSError``."""
    folder = _hf_folder(tmp_path / "hf", index)
    with raises_naming(error, folder / "model.safetensors.index.json", refusal):
        _read_all(folder)


def test_symlink_loop_and_overlong_names_are_file_access_errors_naming_the_file(tmp_path):
    loops = [tmp_path / f"loop{suffix}" for suffix in (".npz", ".h5", ".keras")]  # HDF5 and Keras: opened by path
    for loop in loops:
        loop.symlink_to(loop)
    overlong = [tmp_path / ("y" * 300 + suffix) for suffix in (".npz", ".h5")]
    for path, why in [*((loop, "Too many levels of symbolic links") for loop in loops),
                      *((path, "File name too long") for path in overlong)]:
        with raises_naming(errors.FileAccessError, path, f"cannot be opened ({why})") as caught:
            ws.load(path)
        assert isinstance(caught.value, OSError) and not isinstance(caught.value, errors.StorageError)  # no retry
    shard_loop = _hf_folder(tmp_path / "hf", '{"weight_map": {"m.w": "x.safetensors"}}') / "x.safetensors"
    shard_loop.symlink_to(shard_loop)
    with raises_naming(errors.FormatError, shard_loop.parent / "model.safetensors.index.json",
                       "shard 'x.safetensors', which cannot be opened"):
        _read_all(shard_loop.parent)


def test_keras_config_dense_with_arrays_is_refused_before_it_is_parsed(tmp_path):
    """16 MB of empty lists deflate into a 17 KB archive, and parsed made 490 MB of lists."""
    import zipfile

    path = tmp_path / "dense.keras"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("config.json", '{"class_name": "Sequential", "config": {"x": [' + "[]," * 5_000_000 + "[]]}}")
        archive.writestr("metadata.json", "{}")
    assert path.stat().st_size < 64 << 10
    result = hostile.run_isolated(
        "from weightstore.formats import keras_file\n"
        f"try:\n    keras_file.read_config({str(path)!r})\nexcept ws.UnsafeFileError as exc:\n    print('REFUSED', exc)\n",
        address_space=200 << 20)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED" in result.stdout and "dense.keras" in result.stdout and "config.json" in result.stdout


def test_torch_parameters_in_one_flat_buffer_are_assigned_without_a_conflict():
    """Parameters that are disjoint views of one storage (a flattened model, as FSDP keeps
    them) share memory but no element: each gets its own value."""
    torch = pytest.importorskip("torch")
    from torch import nn

    from weightstore.adapters import torch as torch_adapter

    flat = torch.zeros(10)
    model = nn.Module()
    model.register_buffer("a", flat[:4].view(2, 2))
    model.register_buffer("b", flat[4:])
    weights = {"a": np.ones((2, 2), np.float32), "b": np.arange(6, dtype=np.float32)}
    assert sorted(torch_adapter.assign(model, weights).assigned) == ["a", "b"]
    np.testing.assert_array_equal(flat.numpy(), np.r_[np.ones(4), np.arange(6)])
