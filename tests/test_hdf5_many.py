"""HDF5 files of many small tensors: the low-level read and write paths, and the object headers
the reader classifies from the file's bytes instead of asking HDF5."""

from __future__ import annotations

import errno

import fsspec
import h5py
import ml_dtypes
import numpy as np
import pytest

import weightstore as ws
from tests import hostile
from weightstore import errors


def many_weights() -> dict[str, np.ndarray]:
    """600 small tensors in nested groups, a key that becomes a scope after its tensor was written
    and one that is a scope before, and every kind of dtype and shape a header describes."""
    weights = {f"layer_{i // 100:04d}/w_{i % 100:02d}": np.full(256, i, np.float32) for i in range(600)}
    weights.update({
        "deep/a/b/c/d/kernel": np.arange(12, dtype=np.float64).reshape(3, 4),
        "slot": np.arange(3, dtype=np.int64),  # written first, then becomes a scope
        "slot/Adagrad": np.ones(3, np.float32),
        "scope/inner": np.zeros(2, np.int8),
        "scope": np.array(7, np.int16),  # a scope first, then a key
        "flags": np.array([True, False, True]),
        "empty": np.zeros((0, 3), np.float16),
        "big_endian": np.arange(5, dtype=">i4"),
        "bf16": np.arange(6, dtype=ml_dtypes.bfloat16).reshape(2, 3),
        "complex": np.arange(3, dtype=np.complex64),
        "ünïcode/name": np.arange(4, dtype=np.uint16),
    })
    return weights


def assert_same(loaded: dict[str, np.ndarray], weights: dict[str, np.ndarray]) -> None:
    assert loaded.keys() == weights.keys()
    for key, value in weights.items():
        assert loaded[key].dtype == value.dtype.newbyteorder("="), key
        assert loaded[key].shape == value.shape, key
        assert np.array_equal(loaded[key], value), key


def test_many_small_tensors_in_nested_groups_round_trip(tmp_path):
    weights = many_weights()
    path = tmp_path / "many.h5"
    ws.save(path, weights)
    assert_same(ws.load(path), weights)
    assert_same(ws.load(path, verify=False), weights)
    with ws.open(path) as store:
        assert store.keys() == list(weights)
        assert store.info("deep/a/b/c/d/kernel").shape == (3, 4)
    with h5py.File(path, "r") as f:  # plain h5py reads every tensor where its key says
        assert np.array_equal(f["layer_0005/w_99"][()], weights["layer_0005/w_99"])
        assert np.array_equal(f["slot/__weightstore_value__"][()], weights["slot"])
        assert np.array_equal(f["scope/__weightstore_value__"][()], weights["scope"])
        assert f["layer_0000/w_00"].id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
        assert f["layer_0000/w_00"].compression is None


def large_weights() -> dict[str, np.ndarray]:
    """The awkward keys, dtypes and shapes of :func:`many_weights` among tensors large enough
    (over 256 KiB on average) that the writer makes every header before any data, one of them
    over the writer's 4 MB block."""
    small = many_weights()
    weights = {key: value for key, value in small.items() if not key.startswith("layer_")}
    weights["big/kernel"] = np.arange(5 << 18, dtype=np.float32).reshape(1280, 1024)  # 5 MB
    weights["big/bias"] = np.linspace(0, 1, 1024, dtype=np.float32)
    weights["other/kernel"] = np.arange(1 << 19, dtype=np.int32).reshape(512, 1024)  # 2 MB
    weights["big"] = np.arange(4, dtype=np.float32)  # a key that is also the scope of keys made before it
    return weights


def _header_and_data_offsets(path) -> tuple[list[int], list[int]]:
    """Where each object's header lies in the file, and where each dataset's data does."""
    headers, data = [], []

    def visit(name, thing):
        headers.append(h5py.h5o.get_info(thing.id).addr)
        if isinstance(thing, h5py.Dataset) and thing.id.get_offset() is not None:
            data.append(thing.id.get_offset())

    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return headers, data


def test_a_file_of_large_tensors_has_every_header_before_any_data_and_reads_back(tmp_path, monkeypatch):
    """Made one by one, headers lie between one tensor's data and the next, and a cold read
    streams around them; made first, the data lies in one stretch after them."""
    from weightstore.formats.hdf5 import Hdf5Writer

    made = []
    create = Hdf5Writer._create_plain
    monkeypatch.setattr(Hdf5Writer, "_create_plain", lambda self, *args: made.append(args[1]) or create(self, *args))
    weights = large_weights()
    path = tmp_path / "large.h5"
    ws.save(path, weights)
    assert len(made) == len(weights)  # every header made once, as planned: none made again when its tensor came
    headers, data = _header_and_data_offsets(path)
    assert len(data) == len(weights) - 1  # all but the empty tensor have data in the file
    assert max(headers) < min(data)
    assert_same(ws.load(path), weights)
    assert_same(ws.load(path, mmap=False), weights)
    with h5py.File(path, "r") as f:  # plain h5py reads every tensor where its key says
        assert np.array_equal(f["big/kernel"][()], weights["big/kernel"])
        assert np.array_equal(f["big/__weightstore_value__"][()], weights["big"])
        assert np.array_equal(f["slot/__weightstore_value__"][()], weights["slot"])
    small = tmp_path / "small.h5"  # small tensors: each header where its tensor is, as before
    ws.save(small, many_weights())
    headers, data = _header_and_data_offsets(small)
    assert max(headers) > min(data)


@pytest.mark.parametrize("writer", ["weightstore", "h5py-earliest", "h5py-latest"])
def test_reading_many_tensors_announces_the_stretch_their_bytes_lie_in_once(tmp_path, monkeypatch, writer):
    """A cold file streams when the kernel is told the whole stretch first; told tensor by
    tensor, it was told in steps. The stretch comes from the headers the reader checked at open
    (layout messages), and is exactly where HDF5 says the bytes are."""
    from weightstore.io._local import MappedFile

    weights = large_weights()
    path = tmp_path / "large.h5"
    if writer == "weightstore":
        ws.save(path, weights)
    else:
        with h5py.File(path, "w", libver=writer.split("-")[1]) as f:
            for key, value in weights.items():
                if key not in ("slot", "scope", "big", "big_endian", "bf16"):  # keys h5py keeps as groups; dtypes it cannot
                    f[key] = value
    with h5py.File(path, "r") as f:
        spans = []
        f.visititems(lambda name, thing: spans.append((thing.id.get_offset(), thing.id.get_storage_size()))
                     if isinstance(thing, h5py.Dataset) and thing.id.get_offset() is not None else None)
    announced = []
    monkeypatch.setattr(MappedFile, "prefetch", lambda self, offset, length: announced.append((offset, length)))
    with ws.open(path) as store:
        store.read()
    start = min(offset for offset, _ in spans)
    assert announced[0] == (start, max(offset + size for offset, size in spans) - start)


def test_a_tensor_unlike_its_planned_header_is_written_as_it_is(tmp_path):
    """The writer makes headers from what it was told would come; a tensor that comes otherwise
    (a shape changed between the check and the write) is written as it is, not refused or cut."""
    from weightstore.core.manifest import TensorInfo
    from weightstore.formats.hdf5 import Hdf5Writer

    path = str(tmp_path / "changed.h5")
    told = [TensorInfo("a", "float32", (1024, 1024), 4 << 20), TensorInfo("b", "float32", (4,), 16),
            TensorInfo("s", "float32", (2,), 8), TensorInfo("s/x", "float32", (3,), 12)]  # s moves inside its group
    came = {"a": np.ones((1024, 1024), np.float64), "b": np.arange(6, dtype=np.float32),
            "s": np.arange(5, dtype=np.int16), "s/x": np.full(3, 7, np.float32)}
    writer = Hdf5Writer(path, False, lambda: told)
    for key, value in came.items():
        writer.add(key, value.dtype.name, value)
    writer.commit("{}")
    with h5py.File(path, "r") as f:
        for key, value in came.items():
            stored = f["s/__weightstore_value__" if key == "s" else key][()]
            assert stored.dtype == value.dtype and np.array_equal(stored, value), key


def test_many_small_tensors_round_trip_through_a_url(tmp_path):
    """A URL is read through a file object (seek and read), not a descriptor: the structures the
    reader checks come through it too, in whatever reads its own buffering makes."""
    weights = many_weights()
    ws.save(tmp_path / "many.h5", weights)
    url = f"memory://{tmp_path.name}/many.h5"
    with fsspec.open(url, "wb") as handle:
        handle.write((tmp_path / "many.h5").read_bytes())
    assert_same(ws.load(url), weights)


def test_many_small_tensors_compressed_round_trip(tmp_path):
    weights = many_weights()
    weights["compressible"] = np.zeros(4096, np.float32)
    path = tmp_path / "many.h5"
    ws.save(path, weights, compress=True)
    assert_same(ws.load(path), weights)
    with h5py.File(path, "r") as f:
        assert f["compressible"].compression == "gzip"
        assert f["layer_0000/w_00"].compression is None  # too small to pay


def _flip_one_value(path, dataset: str) -> None:
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as handle:
        handle.seek(offset + 4)
        byte = handle.read(1)[0]
        handle.seek(offset + 4)
        handle.write(bytes([byte ^ 0x40]))


def test_a_damaged_tensor_among_many_is_refused_naming_it(tmp_path):
    weights = many_weights()
    path = tmp_path / "many.h5"
    ws.save(path, weights)
    _flip_one_value(path, "layer_0003/w_42")
    with pytest.raises(errors.ChecksumError, match=r"many\.h5.*'layer_0003/w_42'"):
        ws.load(path)
    unverified = ws.load(path, verify=False)  # what a user asked for: the bytes as stored
    assert not np.array_equal(unverified["layer_0003/w_42"], weights["layer_0003/w_42"])
    assert np.array_equal(unverified["layer_0003/w_41"], weights["layer_0003/w_41"])


@pytest.mark.parametrize("replacement", [
    np.full(256, 7, np.int32),  # same size, another type: HDF5 would convert it without a word
    np.full((16, 16), 7, np.float32),  # same bytes, another shape: the checksum cannot tell
    np.full(256, 7, ">f4"),  # same values stored big-endian: not what weightstore writes
], ids=["int32", "reshaped", "big-endian"])
def test_a_dataset_unlike_its_manifest_entry_is_refused_naming_it(tmp_path, replacement):
    path = tmp_path / "many.h5"
    ws.save(path, {f"layer_{i}/w": np.full(256, 7, np.float32) for i in range(50)})
    with h5py.File(path, "r+") as f:
        del f["layer_17/w"]
        f["layer_17/w"] = replacement
    with pytest.raises(errors.FormatError, match=r"many\.h5.*'layer_17/w'.*manifest"):
        ws.load(path, verify=False)


def _compact(group: h5py.Group, name: str, value: np.ndarray) -> None:
    """A dataset whose bytes sit in its own object header (h5py has no keyword for it)."""
    creation = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    creation.set_layout(h5py.h5d.COMPACT)
    space = h5py.h5s.create_simple(value.shape)
    h5py.h5d.create(group.id, name.encode(), h5py.h5t.py_create(value.dtype), space, dcpl=creation).write(
        h5py.h5s.ALL, h5py.h5s.ALL, value)


@pytest.mark.parametrize("libver", ["earliest", "latest"])  # object headers of version 1 and 2
def test_every_storage_layout_of_a_plain_h5py_file_reads_back(tmp_path, libver):
    """Whether a dataset's bytes lie plainly in the file is read from its header: each layout
    must come back exactly, however its header is classified."""
    values = {f"g{i}/v": np.arange(300, dtype=np.float32) * i for i in range(4)}
    path = tmp_path / "layouts.h5"
    with h5py.File(path, "w", libver=libver) as f:
        f.create_dataset("g0/v", data=values["g0/v"])
        f.create_dataset("g1/v", data=values["g1/v"], chunks=(100,))
        f.create_dataset("g2/v", data=values["g2/v"], chunks=(100,), compression="gzip", shuffle=True)
        _compact(f.create_group("g3"), "v", values["g3/v"])
    assert_same(ws.load(path), values)


def test_a_named_datatype_in_the_tree_is_refused_naming_it(tmp_path):
    path = tmp_path / "typed.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.zeros(3)
        f["scope/kind"] = np.dtype("<f4")  # a committed datatype: neither group nor dataset
    with pytest.raises(errors.FormatError, match=r"typed\.h5.*'scope/kind'"):
        ws.open(path)


def test_many_small_tensors_over_a_file_size_limit_raise_write_error_naming_the_tensor(tmp_path):
    """Small uncompressed tensors once waited in HDF5's sieve buffer until their dataset was
    closed, where a failed write crashed the process (SIGSEGV). Now the failure is a WriteError
    (EFBIG, as a full disk gives ENOSPC) naming the file being written and the tensor, the
    process lives on, and nothing is left behind."""
    path = tmp_path / "many.h5"
    result = hostile.run_isolated(
        "weights = {f'layer_{i // 100:04d}/w_{i % 100:02d}': np.full(256, i, np.float32) for i in range(4000)}\n"
        "try:\n"
        f"    ws.save({str(path)!r}, weights)\n"
        "except ws.WriteError as exc:\n"
        "    print('REFUSED', exc.errno, exc)\n"
        "print('ALIVE')\n",
        file_size=1 << 20,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"REFUSED {errno.EFBIG} {tmp_path}"), result.stdout
    assert "many.h5" in result.stdout and "tensor 'layer_" in result.stdout
    assert "ALIVE" in result.stdout
    assert not any(tmp_path.iterdir())
