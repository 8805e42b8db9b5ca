"""Files of thousands of small tensors: the paths that read and check them column by column.

``ws.load`` and ``Store.read`` of an npz read every member in one pass (local headers and names
checked as arrays, headers and checksums per member); these tests hold that pass to what a read
of one tensor guarantees: the same arrays, and for a damaged member in the middle of thousands
the same error, naming the file and that tensor, with the others still readable.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import hostile
import weightstore as ws
from hostile import raises_naming
from weightstore import errors

COUNT = 3000
VICTIM = "block_0017/unit_04/w"  # index 1704: a float32 of 16 in the middle


def many_weights(count: int = COUNT) -> dict[str, np.ndarray]:
    """Small tensors of every kind a model has: float and int, bfloat16, scalars, empty, 2-D."""
    rng = np.random.default_rng(7)
    weights: dict[str, np.ndarray] = {}
    for i in range(count):
        key = f"block_{i // 100:04d}/unit_{i % 100:02d}/w"
        kind = i % 6
        if kind == 0:
            weights[key] = rng.standard_normal(16).astype(np.float32)
        elif kind == 1:
            weights[key] = rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16)
        elif kind == 2:
            weights[key] = np.array(i, dtype=np.int64)
        elif kind == 3:
            weights[key] = np.zeros((0, 3), np.float16)
        elif kind == 4:
            weights[key] = np.arange(5, dtype=">i4")  # big-endian in, stored little-endian
        else:
            weights[key] = rng.standard_normal((2, 2, 2))
    return weights


@pytest.fixture(scope="module")
def weights():
    return many_weights()


def assert_same(loaded, weights):
    assert list(loaded) == list(weights)
    for key, value in weights.items():
        assert loaded[key].shape == value.shape, key
        assert loaded[key].dtype == value.dtype.newbyteorder("="), key
        native = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("="))
        assert loaded[key].tobytes() == native.tobytes(), key  # bytes: bfloat16 and NaN alike


@pytest.mark.parametrize("mmap", [True, False])
@pytest.mark.parametrize("compress", [False, True, "shuffle"])
def test_thousands_of_small_tensors_round_trip(tmp_path, weights, compress, mmap):
    path = tmp_path / "many.npz"
    ws.save(path, weights, compress=compress)
    assert_same(ws.load(path, mmap=mmap), weights)
    with ws.open(path, mmap=mmap) as store:
        picked = store.keys()[::7]
        assert_same(store.read(picked), {k: weights[k] for k in picked})
        assert np.array_equal(store[VICTIM], weights[VICTIM])
    assert_same(ws.load(path, verify=False), weights)


def test_selection_reads_only_what_it_names(tmp_path, weights):
    path = tmp_path / "many.npz"
    ws.save(path, weights)
    loaded = ws.load(path, scope="block_0003")
    assert sorted(loaded) == sorted(k.split("/", 1)[1] for k in weights if k.startswith("block_0003/"))
    assert np.array_equal(loaded["unit_01/w"].astype(np.float32), weights["block_0003/unit_01/w"].astype(np.float32))


def _victim_member_start(path):
    start, _ = hostile.data_offsets(path)[VICTIM + ".npy"]
    return start


def _damage_data(path):
    hostile.flip_bit(path, hostile.npy_data_offset(path, VICTIM + ".npy") + 9, 2)


def _damage_npy_header(path):
    start = _victim_member_start(path)
    raw = bytearray(path.read_bytes())
    at = raw.index(b"(16,)", start)
    raw[at + 1 : at + 3] = b"15"
    path.write_bytes(bytes(raw))


def _damage_local_name(path):
    raw = bytearray(path.read_bytes())
    start = _victim_member_start(path)
    at = raw.rindex(VICTIM.encode(), 0, start)
    raw[at] ^= 1
    path.write_bytes(bytes(raw))


def _damage_local_signature(path):
    raw = bytearray(path.read_bytes())
    start = _victim_member_start(path)
    at = raw.rindex(b"PK\x03\x04", 0, start)
    raw[at + 3] = 9
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(("damage", "error"), [
    (_damage_data, errors.ChecksumError),
    (_damage_npy_header, errors.FormatError),
    (_damage_local_name, errors.UnsafeFileError),
    (_damage_local_signature, errors.FormatError),
])
def test_one_damaged_member_among_thousands_is_named(tmp_path, damage, error):
    """The member is in the middle of the file: the batch must catch it
    exactly as a read of that one tensor does, and every other tensor must still read."""
    weights = many_weights()
    path = tmp_path / "many.npz"
    ws.save(path, weights)
    damage(path)
    with raises_naming(error, path, VICTIM):
        ws.load(path)
    with ws.open(path) as store:
        with raises_naming(error, path, VICTIM):
            store.read()
        with raises_naming(error, path, VICTIM):
            store[VICTIM]
        others = [k for k in store if k != VICTIM]
        assert_same(store.read(others), {k: weights[k] for k in others})


@pytest.mark.parametrize("bad_key", ["layer_1234//w", "layer_1234/./w", "layer_1234/w:0", "layer_1234/\u202ew"])
def test_a_bad_key_among_thousands_in_a_manifest_is_named(tmp_path, bad_key):
    """Keys are checked in bulk when a file opens; the error still names the bad one."""
    import zipfile

    path = tmp_path / "many.npz"
    ws.save(path, {f"layer_{i:04d}/w": np.zeros(2, np.float32) for i in range(2000)})
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    manifest = json.loads(str(np.load(path)["__weightstore__"]))
    manifest["tensors"]["keys"] = [bad_key if k == "layer_1234/w" else k for k in manifest["tensors"]["keys"]]
    text = np.array(json.dumps(manifest, ensure_ascii=False))
    members["__weightstore__.npy"] = hostile.npy_raw(text.dtype.str, (), text.tobytes())
    path.write_bytes(hostile.zip_bytes([hostile.Member(name, data) for name, data in members.items()]))
    with raises_naming(errors.FormatError, path, repr(bad_key)):
        ws.open(path)


def test_a_directory_whose_names_hold_its_entry_signature_is_walked_entry_by_entry():
    """Entries are found by their signature first; a name holding those bytes must not fool it."""
    from weightstore.formats import _zipdir

    names = ["a.npy", "bPK\x01\x02c.npy", "PK\x01\x02.npy", "d.npy"]
    data = hostile.zip_bytes([hostile.Member(name, hostile.npy(np.zeros(2))) for name in names])
    count, size, offset, _ = _zipdir.locate(data, 0)
    assert list(_zipdir.parse(data[offset : offset + size], count, offset)) == names


@pytest.mark.parametrize("zip64", [[16, 16, 2**64 - 1], [2**63, 2**63], [2**63 - 1, 2**63 - 1]])
def test_zip64_sizes_past_the_file_are_refused_at_open(tmp_path, zip64):
    """The directory's columns are checked in int64: a ZIP64 value no file can hold must be
    refused, not wrap around into a member that seems to fit (and is then read past the map)."""
    import struct

    weights = {f"t{i:02d}": np.arange(4, dtype=np.float32) for i in range(20)}
    path = tmp_path / "z64.npz"
    ws.save(path, weights)
    raw = bytearray(path.read_bytes())
    entry = raw.index(b"PK\x01\x02")  # the first central entry (no tensor holds these bytes)
    name_len = struct.unpack_from("<H", raw, entry + 28)[0]
    extra = struct.pack("<HH", 1, 8 * len(zip64)) + struct.pack(f"<{len(zip64)}Q", *zip64)
    struct.pack_into("<II", raw, entry + 20, 0xFFFFFFFF, 0xFFFFFFFF)  # compressed and size in the extra
    if len(zip64) == 3:
        struct.pack_into("<I", raw, entry + 42, 0xFFFFFFFF)  # and the offset
    struct.pack_into("<H", raw, entry + 30, len(extra))
    start = entry + 46 + name_len
    raw[start:start] = extra
    end = raw.rindex(b"PK\x05\x06")
    struct.pack_into("<I", raw, end + 12, struct.unpack_from("<I", raw, end + 12)[0] + len(extra))
    path.write_bytes(bytes(raw))
    with raises_naming(errors.UnsafeFileError, path, "t00.npy"):
        ws.open(path)


def test_metadata_integers_past_64_bits_stay_exact(tmp_path):
    """The manifest parser reads such integers as the stdlib does, not as rounded floats."""
    metadata = {"step": -(2**63) - 1, "seed": 2**70, "nested": [{"big": -(10**20)}], "lr": 0.5, "huge": 1e20}
    ws.save(tmp_path / "m.npz", {"w": np.zeros(2)}, metadata=metadata)
    ws.save(tmp_path / "m.h5", {"w": np.zeros(2)}, metadata=metadata)
    assert ws.open(tmp_path / "m.npz").metadata == metadata
    assert ws.open(tmp_path / "m.h5").metadata == metadata
