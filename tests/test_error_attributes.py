"""Errors from hostile npz and HDF5 files carry the file and the tensor as attributes.

Callers and the CLI filter on ``exc.path`` and ``exc.key``; the message a person reads must
still name both, once each, in the order every error uses: ``"FILE: tensor 'KEY': ..."``.
"""

from __future__ import annotations

import json
import zlib

import h5py
import numpy as np
import pytest

import hostile
import weightstore as ws
from weightstore import errors

MANIFEST_MEMBER = "__weightstore__.npy"


def refusal(exc_type, read, path, key=None) -> errors.WeightStoreError:
    """The error ``read()`` raises, checked to name ``path`` (and ``key``) through its attributes
    and at the head of its message, not written into the message a second time."""
    with pytest.raises(exc_type) as info:
        read()
    exc = info.value
    assert (exc.path, exc.key) == (str(path), key)
    head = f"{path}: tensor {key!r}: " if key is not None else f"{path}: "
    text = str(exc)
    assert text.startswith(head), text
    assert text.count(str(path)) == 1, text
    return exc


def good_file(tmp_path, suffix):
    path = tmp_path / f"good{suffix}"
    ws.save(path, {"dense/kernel": np.arange(64, dtype=np.float32).reshape(8, 8),
                   "dense/bias": np.arange(8, dtype=np.float64)})
    return path


def manifest_member(document: dict) -> hostile.Member:
    value = np.array(json.dumps(document))  # 0-d: hostile.npy's ascontiguousarray would make it 1-d
    return hostile.Member(MANIFEST_MEMBER, hostile.npy_raw(value.dtype.str, (), value.tobytes()))


def rewrite_h5_manifest(path, change) -> None:
    with h5py.File(path, "r+") as f:
        document = json.loads(f.attrs["weightstore"])
        change(document)
        f.attrs["weightstore"] = json.dumps(document)


def test_npz_corrupt_tensor_names_file_and_tensor(tmp_path):
    path = good_file(tmp_path, ".npz")
    hostile.flip_bit(path, hostile.npy_data_offset(path, "dense/kernel.npy") + 4 * 27, 3)
    with ws.open(path) as store:
        exc = refusal(errors.ChecksumError, lambda: store["dense/kernel"], path, "dense/kernel")
    assert "is corrupt" in exc.message


def test_h5_corrupt_tensor_names_file_and_tensor(tmp_path):
    path = good_file(tmp_path, ".h5")
    with h5py.File(path, "r") as f:
        offset = f["dense/kernel"].id.get_offset()
    hostile.flip_bit(path, offset + 4 * 27, 3)
    with ws.open(path) as store:
        exc = refusal(errors.ChecksumError, lambda: store["dense/kernel"], path, "dense/kernel")
    assert "is corrupt" in exc.message


def test_npz_bad_manifest_column_names_file_and_column(tmp_path):
    tensors = {"keys": ["w"], "dtypes": ["float32"], "dtype": [0], "ndim": [1], "shape": [2], "crc32": [-1]}
    path = tmp_path / "column.npz"
    path.write_bytes(hostile.zip_bytes([
        hostile.Member("w.npy", hostile.npy(np.zeros(2, np.float32))),
        manifest_member({"format": "weightstore", "version": 2, "metadata": {}, "tensors": tensors}),
    ]))
    exc = refusal(errors.FormatError, lambda: ws.open(path), path)
    assert "'crc32'" in exc.message


def test_npz_overlapping_member_names_file_and_member(tmp_path):
    payload = hostile.npy(np.zeros(1 << 10, np.float32))
    member = hostile.Member("a.npy", hostile.deflated(payload), hostile.DEFLATED, size=len(payload),
                            crc=zlib.crc32(payload))
    alias = hostile.Member("b.npy", member.data, hostile.DEFLATED, size=len(payload), crc=zlib.crc32(payload),
                           offset=0)
    path = tmp_path / "overlap.npz"
    path.write_bytes(hostile.zip_bytes([member], extra_central=[alias]))
    exc = refusal(errors.UnsafeFileError, lambda: ws.open(path), path)
    assert exc.message.startswith("member 'a.npy' overlaps")


def test_npz_member_that_is_no_npy_names_file_and_member(tmp_path):
    path = tmp_path / "notnpy.npz"
    path.write_bytes(hostile.zip_bytes([hostile.Member("w.npy", b"not an array at all")]))
    exc = refusal(errors.FormatError, lambda: ws.load(path), path)
    assert exc.message.startswith("member 'w.npy'")


@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_manifest_dtype_junk_names_file_and_tensor(tmp_path, suffix):
    """Version 1 entries (npz, by hand) and version 2 columns (HDF5, as written) alike."""
    path = tmp_path / f"junk{suffix}"
    if suffix == ".npz":
        path.write_bytes(hostile.zip_bytes([
            hostile.Member("w.npy", hostile.npy(np.zeros(2, np.float32))),
            manifest_member({"format": "weightstore", "version": 1, "metadata": {},
                             "tensors": {"w": {"dtype": "M8", "shape": [2], "checksum": None}}}),
        ]))
    else:
        ws.save(path, {"w": np.zeros(2, np.float32)})
        rewrite_h5_manifest(path, lambda d: d["tensors"].update(dtypes=["M8"]))
    exc = refusal(errors.FormatError, lambda: ws.open(path), path, "w")
    assert exc.message == "unknown dtype 'M8'"


def test_h5_oversized_manifest_names_file(tmp_path):
    from weightstore.core.limits import MAX_MANIFEST_BYTES

    path = tmp_path / "huge.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.zeros(2)
        f.attrs["weightstore"] = "[" * (MAX_MANIFEST_BYTES + 1)
    exc = refusal(errors.UnsafeFileError, lambda: ws.open(path), path)
    assert "too large" in exc.message


def test_h5_dataset_stored_elsewhere_names_file_and_tensor(tmp_path):
    raw = tmp_path / "outside.bin"
    raw.write_bytes(np.arange(100, dtype=np.float32).tobytes())
    path = tmp_path / "external.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("leak", shape=(100,), dtype="<f4", external=[(str(raw), 0, 400)])
    with ws.open(path) as store:
        exc = refusal(errors.UnsafeFileError, lambda: store["leak"], path, "leak")
    assert "external files" in exc.message


def test_npz_shuffled_member_not_shuffle_zstd_names_file_and_tensor(tmp_path):
    """A ``compress="shuffle"`` member whose bytes are not shuffle-zstd: the decoder names both."""
    path = tmp_path / "shuffled.npz"
    ws.save(path, {"dense/kernel": np.arange(64, dtype=np.float32).reshape(8, 8)}, compress="shuffle")
    start, _ = hostile.data_offsets(path)["dense/kernel.shuffled-zstd"]
    hostile.flip_bit(path, start, 0)  # the format's magic
    with ws.open(path) as store:
        exc = refusal(errors.FormatError, lambda: store["dense/kernel"], path, "dense/kernel")
    assert "shuffle-zstd" in exc.message


@pytest.mark.parametrize("suffix", [".npz", ".h5", ".safetensors"])
def test_a_missing_tensor_names_file_and_tensor(tmp_path, suffix):
    path = good_file(tmp_path, suffix)
    with ws.open(path) as store:
        refusal(errors.KeyNotInStoreError, lambda: store["dense/kernl"], path, "dense/kernl")
        refusal(errors.KeyNotInStoreError, lambda: store.read(["dense/bias", "dense/kernl"]), path, "dense/kernl")
        refusal(errors.KeyNotInStoreError, lambda: store.info("dense/kernl"), path, "dense/kernl")


def test_a_key_of_tens_of_kilobytes_is_shown_by_its_ends_and_kept_whole_on_the_error(tmp_path):
    """A valid key may be 65,531 bytes: a message quoting it whole was a 70 KB line."""
    key = "block/" + "k" * 60_000 + "/kernel"
    path = tmp_path / "long.npz"
    ws.save(path, {key: np.ones(2, np.float32)})
    with ws.open(path) as store, pytest.raises(errors.KeyNotInStoreError) as caught:
        store[key[:-1]]
    assert caught.value.key == key[:-1] and caught.value.path == str(path)
    shown = str(caught.value)
    assert len(shown) < 400 and shown.startswith(f"{path}: tensor 'block/kkk") and "(60012 characters)" in shown


class _DtypeThatChanges:
    """States float32 (checked before the write starts) and turns out an object array when
    converted, as the write converts each value: the late refusal still names file and tensor."""

    dtype = np.dtype("float32")
    shape = (2,)

    def __array__(self, dtype=None, copy=None):
        return np.array(["a", "b"], dtype=object)


def test_save_names_file_and_tensor_when_a_value_is_converted(tmp_path):
    path = tmp_path / "late.npz"
    refusal(errors.UnsupportedDTypeError, lambda: ws.save(path, {"ok": np.ones(2), "w": _DtypeThatChanges()}),
            path, "w")
    assert not path.exists()


def test_save_names_file_and_tensor_of_a_key_the_format_keeps(tmp_path):
    path = tmp_path / "reserved.safetensors"
    refusal(errors.InvalidKeyError, lambda: ws.save(path, {"__metadata__": np.ones(2)}), path, "__metadata__")
    assert not path.exists()


def test_messages_name_a_few_things_and_count_the_rest():
    """One form for every message that names several keys, each bounded: a hostile file may
    list thousands of keys 65 KB long, and the message stays a line or two."""
    named = errors.named
    assert named([]) == "none"
    assert named(["a", "b"]) == "'a', 'b'"
    assert named(["a", "b", "c", "d", "e"]) == "'a', 'b', 'c' and 2 more"
    assert named([3, 4, 5, 6], shown=2) == "3, 4 and 2 more"
    assert len(named(["k" * 65_000] * 5_000)) < 1_000
