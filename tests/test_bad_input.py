"""Hostile and broken files: each is refused with the right error, naming the file (and key).

Nothing here may crash the reader, allocate without bound or execute code. Every file is
real, under ``tmp_path``; the zips are made by hand in :mod:`hostile`.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pathlib
import pickle
import re
import subprocess
import sys
import zipfile
import zlib

import h5py
import numpy as np
import pytest

import hostile
import weightstore as ws
from hostile import raises_naming
from weightstore import errors


def write(path, data: bytes):
    path.write_bytes(data)
    return path


def load_all(path, **kwargs):
    """Open, list, read every tensor: the whole reader surface."""
    return ws.load(path, **kwargs)


def good_npz(tmp_path, name="good.npz", **kwargs):
    path = tmp_path / name
    ws.save(path, {"dense/kernel": np.arange(64, dtype=np.float32).reshape(8, 8),
                   "dense/bias": np.arange(8, dtype=np.float64)}, **kwargs)
    return path


def good_h5(tmp_path, name="good.h5", **kwargs):
    path = tmp_path / name
    ws.save(path, {"dense/kernel": np.arange(64, dtype=np.float32).reshape(8, 8),
                   "dense/bias": np.arange(8, dtype=np.float64)}, **kwargs)
    return path


# -- not a weight file at all --------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".npz", ".h5", ".bin"])
def test_empty_file(tmp_path, suffix):
    path = write(tmp_path / f"empty{suffix}", b"")
    with raises_naming(errors.FormatError, path):
        ws.open(path)


@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_random_bytes(tmp_path, suffix):
    path = write(tmp_path / f"noise{suffix}", np.random.default_rng(0).bytes(10_000))
    with raises_naming(errors.FormatError, path):
        ws.open(path)


def test_html_page_saved_as_npz(tmp_path):
    page = b"<!DOCTYPE html><html><head><title>404 Not Found</title></head><body>gone</body></html>\n"
    path = write(tmp_path / "weights.npz", page)
    with raises_naming(errors.FormatError, path):
        ws.load(path)


class _Boom:
    """Unpickling this writes a marker file: proof that something executed pickle data."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_saved_as_npz_is_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"
    path = write(tmp_path / "weights.npz", pickle.dumps({"w": _Boom(marker)}))
    with raises_naming(errors.FormatError, path):
        ws.load(path)
    assert not marker.exists()


def test_pickle_saved_as_h5(tmp_path):
    path = write(tmp_path / "weights.h5", pickle.dumps({"w": [1.0, 2.0]}))
    with raises_naming(errors.FormatError, path):
        ws.load(path)


def test_a_file_of_another_format_than_format_asked_says_which_not_its_name(tmp_path):
    """``ws.open("weights.bin", format="npz")`` of a safetensors file said "its name says npz ...:
    rename it to end in .safetensors", though its name says nothing: it was ``format=`` that said npz."""
    ws.save(tmp_path / "real.safetensors", {"w": np.arange(3, dtype=np.float32)})
    path = write(tmp_path / "weights.bin", (tmp_path / "real.safetensors").read_bytes())
    with pytest.raises(ws.FormatError) as caught:
        ws.open(path, format="npz")
    assert str(caught.value) == (f"{path}: format='npz' was asked for, but its first bytes say safetensors: read it "
                                 "with ws.open(path, format='safetensors')")


@pytest.mark.parametrize("fraction", [0.05, 0.5, 0.95, 0.999])
def test_truncated_npz(tmp_path, fraction):
    path = good_npz(tmp_path)
    data = path.read_bytes()
    write(path, data[: int(len(data) * fraction)])
    with raises_naming(errors.FormatError, path):
        load_all(path)


@pytest.mark.parametrize("keep", [100, 2000, -200, -1])
def test_truncated_npz_tensor_data(tmp_path, keep):
    """Cut inside the member data of a one-tensor file whose directory is then re-appended."""
    payload = hostile.npy(np.arange(1000, dtype=np.float32))
    cut = payload[:keep]
    path = write(tmp_path / "cut.npz", hostile.zip_bytes([hostile.Member("w.npy", cut)]))
    with raises_naming(errors.FormatError, path, "w"):
        load_all(path)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_truncated_h5(tmp_path, fraction):
    path = good_h5(tmp_path)
    data = path.read_bytes()
    write(path, data[: int(len(data) * fraction)])
    with raises_naming(errors.FormatError, path):
        load_all(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nothing.npz"
    with raises_naming(errors.StoreNotFoundError, path):
        ws.load(path)
    with pytest.raises(FileNotFoundError):
        ws.open(path)


# -- bit flips and checksums ------------------------------------------------------------------

@pytest.mark.parametrize("compress", [False, True])
def test_bit_flip_npz_names_the_tensor(tmp_path, compress):
    path = tmp_path / "w.npz"
    kernel = np.arange(64, dtype=np.float32).reshape(8, 8)
    ws.save(path, {"dense/kernel": kernel, "dense/bias": np.zeros(8)}, compress=compress)
    if compress:
        # Rewrite the member with a value changed but a valid stream, so only our checksum can tell.
        flipped = kernel.copy()
        flipped[3, 3] += 1
        _replace_npz_member(path, "dense/kernel.npy", hostile.npy(flipped))
    else:
        hostile.flip_bit(path, hostile.npy_data_offset(path, "dense/kernel.npy") + 4 * 27, 3)
    with raises_naming(errors.ChecksumError, path, "dense/kernel"):
        ws.load(path)
    with ws.open(path) as store:
        assert np.array_equal(store["dense/bias"], np.zeros(8))  # the other tensor still reads
        with raises_naming(errors.ChecksumError, path, "dense/kernel"):
            store["dense/kernel"]
    unverified = ws.load(path, verify=False)["dense/kernel"]
    assert unverified.shape == (8, 8)
    assert (unverified != kernel).sum() == 1
    with ws.open(path, verify=False) as store:
        assert (store["dense/kernel"] != kernel).sum() == 1


def _replace_npz_member(path, name, payload):
    """Rewrite an npz keeping every member but ``name`` byte for byte (same order, deflated)."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        members = [(info.filename, archive.read(info.filename)) for info in archive.infolist()]
    rebuilt = [hostile.Member(n, hostile.deflated(payload if n == name else data), hostile.DEFLATED,
                              size=len(payload if n == name else data),
                              crc=zlib.crc32(payload if n == name else data))
               for n, data in members]
    path.write_bytes(hostile.zip_bytes(rebuilt))


@pytest.mark.parametrize("compress", [False, True])
def test_bit_flip_h5_names_the_tensor(tmp_path, compress):
    path = tmp_path / "w.h5"
    kernel = np.arange(4096, dtype=np.float32).reshape(64, 64)
    ws.save(path, {"dense/kernel": kernel, "dense/bias": np.zeros(8)}, compress=compress)
    if compress:
        with h5py.File(path, "r+") as f:  # a valid gzip stream with one value changed
            f["dense/kernel"][5, 5] = -1.0
    else:
        with h5py.File(path, "r") as f:
            offset = f["dense/kernel"].id.get_offset()
        hostile.flip_bit(path, offset + 4 * 100 + 2, 5)
    with raises_naming(errors.ChecksumError, path, "dense/kernel"):
        ws.load(path)
    assert np.array_equal(ws.load(path, include="dense/bias")["dense/bias"], np.zeros(8))
    unverified = ws.load(path, verify=False)["dense/kernel"]
    assert (unverified != kernel).sum() == 1


def test_bit_flip_in_npy_header_is_caught(tmp_path):
    path = good_npz(tmp_path)
    start, _ = hostile.data_offsets(path)["dense/kernel.npy"]
    raw = bytearray(path.read_bytes())
    header = raw[start : start + 128]
    at = header.index(b"(8, 8)")
    raw[start + at + 1] = ord("4")  # shape (4, 8): the byte count no longer matches
    path.write_bytes(bytes(raw))
    with raises_naming(errors.FormatError, path, "dense/kernel"):
        ws.load(path)


# -- object arrays: refused on write and on read, never unpickled ---------------------------

@pytest.mark.parametrize("suffix", [".npz", ".h5"])
@pytest.mark.parametrize("value", [
    np.array([1, "a", None], dtype=object),
    np.array(["text", "more"]),
    np.array([b"bytes"]),
    np.zeros(3, dtype=[("a", "f4"), ("b", "i4")]),
    np.array(["2020-01-01"], dtype="datetime64[D]"),
    np.ones(3, np.longdouble) if np.dtype(np.longdouble).itemsize > 8 else np.ones(3, np.clongdouble),
    np.ma.masked_array([1.0, 999.0, 3.0], mask=[False, True, False]),
], ids=["object", "unicode", "bytes", "structured", "datetime", "long-double", "masked"])
def test_non_numeric_arrays_refused_on_write(tmp_path, suffix, value):
    """A long double's bits differ between machines (and its padding was uninitialised memory
    in the file); a masked array's placeholders under the mask would become weights."""
    path = tmp_path / f"w{suffix}"
    with raises_naming(errors.UnsupportedDTypeError, path, "bad/tensor"):
        ws.save(path, {"good": np.zeros(2), "bad/tensor": value})
    assert not path.exists()
    assert os.listdir(tmp_path) == []


def test_a_long_double_file_written_elsewhere_still_reads(tmp_path):
    """Saves refuse long doubles; a file numpy or h5py wrote with them reads as they hold them."""
    values = np.linspace(0, 1, 3).astype(np.longdouble)
    np.savez(tmp_path / "a.npz", a=values)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["a"] = values
    for path in (tmp_path / "a.npz", tmp_path / "a.h5"):
        assert np.array_equal(ws.load(path)["a"], values) and ws.open(path).info("a").shape == (3,)
    if np.dtype(np.longdouble).itemsize > 8:
        with raises_naming(errors.UnsupportedDTypeError, tmp_path / "b.npz", "a"):
            ws.save(tmp_path / "b.npz", ws.open(tmp_path / "a.h5"))  # converting one is a write


def test_object_array_in_npz_refused_on_read_never_unpickled(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.npz"
    np.savez(path, w=np.zeros(3, dtype=np.float32), evil=np.array([_Boom(marker)], dtype=object))
    with raises_naming(errors.UnsafeFileError, path, "evil"):
        ws.load(path)
    with ws.open(path) as store:  # listing is fine; the object member is refused when touched
        assert sorted(store.keys()) == ["evil", "w"]
        with raises_naming(errors.UnsafeFileError, path, "evil"):
            store["evil"]
        assert np.array_equal(store["w"], np.zeros(3))
    assert not marker.exists()


def test_object_array_under_a_manifest_refused(tmp_path):
    """A weightstore file whose member was swapped for a pickle stays refused."""
    path = good_npz(tmp_path)
    marker = tmp_path / "pwned"
    evil = np.array([_Boom(marker)], dtype=object)
    import io

    buffer = io.BytesIO()
    np.save(buffer, evil, allow_pickle=True)
    _rewrite_stored(path, {"dense/bias.npy": buffer.getvalue()})
    with raises_naming(errors.FormatError, path, "dense/bias"):
        ws.load(path)
    assert not marker.exists()


def _rewrite_stored(path, replace):
    import zipfile

    with zipfile.ZipFile(path) as archive:
        members = [(i.filename, replace.get(i.filename, archive.read(i.filename))) for i in archive.infolist()]
    path.write_bytes(hostile.zip_bytes([hostile.Member(n, d) for n, d in members]))


def test_h5_string_dataset_refused(tmp_path):
    path = tmp_path / "strings.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.zeros(3)
        f["names"] = np.array([b"a", b"bc"], dtype=h5py.string_dtype())
    with raises_naming(errors.UnsafeFileError, path, "names"):
        ws.load(path)
    assert np.array_equal(ws.load(path, include="w")["w"], np.zeros(3))


# -- lying npy headers ------------------------------------------------------------------------

def _one_member(tmp_path, payload, name="w.npy"):
    return write(tmp_path / "bad.npz", hostile.zip_bytes([hostile.Member(name, payload)]))


@pytest.mark.parametrize("shape", [(10,), (3,), (2, 2, 2), ()])
def test_npy_shape_does_not_match_byte_count(tmp_path, shape):
    path = _one_member(tmp_path, hostile.npy_raw("<f4", shape, np.zeros(5, np.float32).tobytes()))
    with raises_naming(errors.FormatError, path, "w"):
        load_all(path)


@pytest.mark.parametrize("shape", [(2**40, 2**40), (2**63, 2**63, 2**63), (2**62,)])
def test_npy_shape_product_overflows(tmp_path, shape):
    path = _one_member(tmp_path, hostile.npy_raw("<f8", shape, b"\0" * 64))
    with raises_naming(errors.FormatError, path, "w"):
        load_all(path)
    with ws.open(path) as store, raises_naming(errors.FormatError, path, "w"):
        store.info("w")


def test_npy_header_over_10000_bytes(tmp_path):
    text = "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }" + " " * 20_000
    path = _one_member(tmp_path, hostile.npy_raw("<f4", (1,), b"\0" * 4, header_text=text, version=2))
    with raises_naming(errors.UnsafeFileError, path, "w"):
        load_all(path)


@pytest.mark.parametrize("text", [
    "__import__('os').system('touch pwned')",
    "{'descr': '<f4', 'fortran_order': False}",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (1.5,), }",
    "{'descr': 'nonsense', 'fortran_order': False, 'shape': (1,), }",
    "[" * 10_000 + "]" * 10_000,
    "{'descr': '(2,)<f4', 'fortran_order': False, 'shape': (1,), }",
    "{'descr': 'V0', 'fortran_order': False, 'shape': (4,), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 2**62, 2**62), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), [1]: 2}",
    "{'descr': ',<f', 'fortran_order': False, 'shape': (1,), }",
    "{'descr': '<f4', 'fortran_order': 'yes', 'shape': (1,), }",
    "{'descr': '<f4', 'fortran_order': 0, 'shape': (1,), }",
], ids=["code", "no-shape", "negative", "float-dim", "bad-descr", "deep", "sub-array", "V0", "huge-zero-size",
        "unhashable", "comma-descr", "fortran-str", "fortran-int"])
def test_npy_header_garbage(tmp_path, text):
    path = _one_member(tmp_path, hostile.npy_raw("<f4", (1,), b"\0" * 4, header_text=text[:9000]))
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with raises_naming(errors.FormatError, path, "w"):
            load_all(path)
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "pwned").exists()


def test_npy_structured_descr_refused(tmp_path):
    path = _one_member(tmp_path, hostile.npy(np.zeros(2, dtype=[("a", "<f4"), ("b", "<i4")])))
    with raises_naming(errors.FormatError, path, "w"):
        load_all(path)


# -- zip tricks -----------------------------------------------------------------------------------

def test_duplicate_zip_members(tmp_path):
    first = hostile.npy(np.zeros(4, np.float32))
    second = hostile.npy(np.ones(4, np.float32))
    path = write(tmp_path / "dup.npz", hostile.zip_bytes([hostile.Member("w.npy", first), hostile.Member("w.npy", second)]))
    with raises_naming(errors.UnsafeFileError, path, "w.npy"):
        ws.open(path)


def test_overlapping_zip_members_bomb(tmp_path):
    """Many central entries sharing one local record: each would inflate the same data."""
    payload = hostile.npy(np.zeros(1 << 16, np.float32))
    member = hostile.Member("a.npy", hostile.deflated(payload), hostile.DEFLATED, size=len(payload),
                            crc=zlib.crc32(payload))
    aliases = [hostile.Member(f"b{i}.npy", member.data, hostile.DEFLATED, size=len(payload), crc=zlib.crc32(payload),
                              offset=0) for i in range(50)]
    path = write(tmp_path / "overlap.npz", hostile.zip_bytes([member], extra_central=aliases))
    with raises_naming(errors.UnsafeFileError, path, "overlaps"):
        ws.open(path)


def test_member_pointing_into_another(tmp_path):
    """A central entry whose offset lands inside the previous member's data."""
    a = hostile.npy(np.arange(256, dtype=np.float32))
    b = hostile.npy(np.arange(4, dtype=np.float32))
    data = hostile.zip_bytes([hostile.Member("a.npy", a), hostile.Member("b.npy", b, offset=40)])
    path = write(tmp_path / "overlap.npz", data)
    with raises_naming(errors.FormatError, path):
        load_all(path)


@pytest.mark.parametrize("method", [hostile.BZIP2, hostile.LZMA, 1, 99])
def test_compression_methods_other_than_stored_and_deflate(tmp_path, method):
    payload = hostile.npy(np.zeros(4, np.float32))
    path = write(tmp_path / "method.npz", hostile.zip_bytes([hostile.Member("w.npy", payload, method)]))
    with raises_naming(errors.UnsafeFileError, path, "w.npy", str(method)):
        ws.open(path)


def test_encrypted_member_refused(tmp_path):
    payload = hostile.npy(np.zeros(4, np.float32))
    path = write(tmp_path / "enc.npz", hostile.zip_bytes([hostile.Member("w.npy", payload, flags=0x801)]))
    with raises_naming(errors.UnsafeFileError, path, "w.npy"):
        ws.open(path)


@pytest.mark.parametrize("name", [
    b"../escape.npy", b"a/../../escape.npy", b"..", b"w\x00.npy", b"a\\b.npy", b"/abs.npy", b"/etc/passwd.npy",
], ids=["dotdot", "nested-dotdot", "bare-dotdot", "nul", "backslash", "leading-slash", "absolute"])
def test_unsafe_member_names(tmp_path, name):
    payload = hostile.npy(np.zeros(4, np.float32))
    path = write(tmp_path / "names.npz", hostile.zip_bytes([hostile.Member(name, payload)]))
    with raises_naming(errors.UnsafeFileError, path):
        ws.open(path)


def test_non_npy_member_refused(tmp_path):
    path = write(tmp_path / "extra.npz", hostile.zip_bytes([
        hostile.Member("w.npy", hostile.npy(np.zeros(2))), hostile.Member("readme.txt", b"hello")]))
    with raises_naming(errors.FormatError, path, "readme.txt"):
        ws.open(path)


def test_deflate_member_claiming_huge_size(tmp_path):
    """A few bytes that claim to inflate to 4 GB: refused from the directory, nothing allocated."""
    payload = hostile.npy(np.zeros(16, np.float32))
    member = hostile.Member("w.npy", hostile.deflated(payload), hostile.DEFLATED, size=0xFFFF_FFF0,
                            crc=zlib.crc32(payload))
    path = write(tmp_path / "bomb.npz", hostile.zip_bytes([member]))
    with raises_naming(errors.UnsafeFileError, path, "w.npy"):
        ws.open(path)


def test_deflate_member_inflating_past_its_declared_size(tmp_path):
    """A plausible declared size, but the stream holds more: inflation stops at the declared size."""
    payload = hostile.npy(np.zeros(100_000, np.float32))
    stream = hostile.deflated(payload)
    member = hostile.Member("w.npy", stream, hostile.DEFLATED, size=len(stream) * 10, crc=zlib.crc32(payload))
    path = write(tmp_path / "liar.npz", hostile.zip_bytes([member]))
    with raises_naming(errors.FormatError, path, "w.npy"):
        load_all(path)


def test_deflate_member_shorter_than_declared(tmp_path):
    payload = hostile.npy(np.arange(1000, dtype=np.float32))
    stream = hostile.deflated(payload)
    member = hostile.Member("w.npy", stream, hostile.DEFLATED, size=len(payload) + 400, crc=zlib.crc32(payload))
    path = write(tmp_path / "short.npz", hostile.zip_bytes([member]))
    with raises_naming(errors.FormatError, path, "w.npy"):
        load_all(path)


def test_corrupt_deflate_stream(tmp_path):
    payload = hostile.npy(np.arange(1000, dtype=np.float32))
    stream = bytearray(hostile.deflated(payload))
    stream[len(stream) // 2 :] = b"\xff" * (len(stream) - len(stream) // 2)
    member = hostile.Member("w.npy", bytes(stream), hostile.DEFLATED, size=len(payload), crc=zlib.crc32(payload))
    path = write(tmp_path / "corrupt.npz", hostile.zip_bytes([member]))
    with raises_naming(errors.FormatError, path, "w"):
        load_all(path)


def test_stored_member_with_inconsistent_sizes(tmp_path):
    payload = hostile.npy(np.zeros(16, np.float32))
    path = write(tmp_path / "sizes.npz", hostile.zip_bytes([hostile.Member("w.npy", payload, size=1 << 30)]))
    with raises_naming(errors.FormatError, path, "w.npy"):
        load_all(path)


def test_local_header_naming_another_file(tmp_path):
    """The central directory says ``a.npy`` but the local record it points to is ``b.npy``."""
    payload = hostile.npy(np.zeros(16, np.float32))
    data = bytearray(hostile.zip_bytes([hostile.Member("a.npy", payload)]))
    data[30:35] = b"b.npy"
    path = write(tmp_path / "swap.npz", bytes(data))
    with raises_naming(errors.UnsafeFileError, path, "a.npy"):
        load_all(path)


def test_manifest_that_lies_about_members(tmp_path):
    path = good_npz(tmp_path)
    import zipfile

    with zipfile.ZipFile(path) as archive:
        members = [(i.filename, archive.read(i.filename)) for i in archive.infolist()]
    kept = [hostile.Member(n, d) for n, d in members if n != "dense/bias.npy"]
    path.write_bytes(hostile.zip_bytes(kept))
    with raises_naming(errors.FormatError, path, "dense/bias"):
        ws.open(path)


def test_manifest_not_json(tmp_path):
    manifest = hostile.npy(np.array("{not json"))
    data = hostile.zip_bytes([hostile.Member("w.npy", hostile.npy(np.zeros(2))),
                              hostile.Member("__weightstore__.npy", manifest)])
    path = write(tmp_path / "manifest.npz", data)
    with raises_naming(errors.FormatError, path, "manifest"):
        ws.open(path)


# -- max_bytes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_max_bytes_refuses_before_reading(tmp_path, suffix):
    """Every tensor's bytes are corrupt: had anything been read, a ChecksumError would win."""
    path = tmp_path / f"w{suffix}"
    weights = {"a": np.arange(1000, dtype=np.float32), "b": np.arange(10, dtype=np.float64)}
    ws.save(path, weights)
    _corrupt_every_tensor(path, suffix, weights)
    with raises_naming(errors.SizeLimitError, path, "4080", "4000"):
        ws.load(path, max_bytes=4000)
    with pytest.raises(ValueError):  # catchable as the builtin it refines
        ws.load(path, max_bytes=4079)
    with ws.open(path) as store, raises_naming(errors.SizeLimitError, path):
        store.read(["a"], max_bytes=3999)
    # inside the budget the read happens, and meets the corruption
    with raises_naming(errors.ChecksumError, path, "b"):
        ws.load(path, include="b", max_bytes=80)
    assert ws.load(path, include="b", max_bytes=80, verify=False)["b"].shape == (10,)


def test_read_given_one_key_as_a_string_says_how_to_read_it(tmp_path):
    """A string is iterable: read("embedding") would have asked for tensors "e", "m", ..."""
    ws.save(tmp_path / "w.npz", {"embedding": np.arange(4, dtype=np.float32)})
    with ws.open(tmp_path / "w.npz") as store:
        with pytest.raises(TypeError, match=r"store\.read\(\['embedding'\]\), or store\['embedding'\]"):
            store.read("embedding")
        assert list(store.read(["embedding"])) == ["embedding"]


def _corrupt_every_tensor(path, suffix, weights):
    if suffix == ".npz":
        for key in weights:
            hostile.flip_bit(path, hostile.npy_data_offset(path, f"{key}.npy"), 6)
    else:
        with h5py.File(path, "r") as f:
            offsets = [f[key].id.get_offset() for key in weights]
        for offset in offsets:
            hostile.flip_bit(path, offset, 6)


# -- HDF5 tricks ----------------------------------------------------------------------------------

def test_h5_external_storage(tmp_path):
    raw = tmp_path / "outside.bin"
    raw.write_bytes(np.arange(100, dtype=np.float32).tobytes())
    path = tmp_path / "external.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.zeros(3)
        f.create_dataset("leak", shape=(100,), dtype="<f4", external=[(str(raw), 0, 400)])
    with raises_naming(errors.UnsafeFileError, path, "leak"):
        ws.load(path)
    assert np.array_equal(ws.load(path, include="w")["w"], np.zeros(3))


def test_h5_soft_link(tmp_path):
    path = tmp_path / "soft.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.zeros(3)
        f["alias"] = h5py.SoftLink("/w")
    with raises_naming(errors.UnsafeFileError, path, "alias", "is a SoftLink"):
        ws.open(path)


def test_h5_external_link(tmp_path):
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["secret"] = np.arange(5)
    path = tmp_path / "extlink.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.zeros(3)
        f["scope/leak"] = h5py.ExternalLink(str(other), "/secret")
    with raises_naming(errors.UnsafeFileError, path, "scope/leak", "is an ExternalLink"):
        ws.open(path)


def test_an_h5_dataset_made_but_never_written_is_called_so(tmp_path):
    """h5py reads such a dataset as its fill value; the refusal read as a file cut short."""
    path = tmp_path / "hollow.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", shape=(3,), dtype=np.float32, fillvalue=0.5)
    with raises_naming(errors.FormatError, path, "w", "was made but never written"):
        ws.load(path)


def test_a_key_with_an_output_suffix_is_refused_quoting_that_suffix(tmp_path):
    with raises_naming(errors.InvalidKeyError, tmp_path / "w.npz", "a/w:1", "(':1')"):
        ws.save(tmp_path / "w.npz", {"a/w:1": np.zeros(1)})


def test_h5_hard_link_twice(tmp_path):
    path = tmp_path / "hard.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.zeros(3)
        f["again"] = f["w"]
    with raises_naming(errors.UnsafeFileError, path):
        ws.open(path)


def test_h5_virtual_dataset(tmp_path):
    source = tmp_path / "source.h5"
    with h5py.File(source, "w") as f:
        f["data"] = np.arange(10, dtype=np.float32)
    layout = h5py.VirtualLayout(shape=(10,), dtype="<f4")
    layout[:] = h5py.VirtualSource(str(source), "data", shape=(10,))
    path = tmp_path / "virtual.h5"
    with h5py.File(path, "w") as f:
        f["w"] = np.zeros(3)
        f.create_virtual_dataset("view", layout)
    with raises_naming(errors.UnsafeFileError, path, "view"):
        ws.load(path)


def test_h5_declared_size_larger_than_stored(tmp_path):
    """A dataset whose declared bytes were never written (4 GB of nothing) is refused unread."""
    path = tmp_path / "hollow.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("big", shape=(1 << 30,), dtype="<f4")
    assert path.stat().st_size < 1 << 20
    with raises_naming(errors.FormatError, path, "big"):
        ws.load(path)


def test_h5_compressed_bomb_ratio(tmp_path):
    path = tmp_path / "bomb.h5"
    with h5py.File(path, "w") as f:
        big = f.create_dataset("big", shape=(1 << 30,), dtype="<f4", chunks=(1 << 20,), compression="gzip")
        big[: 1 << 20] = 0.0  # one chunk stored; the other 1023 read as fill values
    with raises_naming(errors.UnsafeFileError, path, "big"):
        ws.load(path)


def test_h5_unknown_filter(tmp_path):
    path = tmp_path / "scaleoffset.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("w", data=np.arange(1000, dtype=np.int32), scaleoffset=0)
    with raises_naming(errors.UnsafeFileError, path, "w"):
        ws.load(path)


def test_h5_manifest_that_lies(tmp_path):
    path = good_h5(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["dense/bias"]
    with raises_naming(errors.FormatError, path):
        ws.open(path)


def test_h5_manifest_shape_disagrees_with_dataset(tmp_path):
    path = good_h5(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["dense/bias"]
        f["dense/bias"] = np.zeros(9)
    with raises_naming(errors.FormatError, path, "dense/bias"):
        ws.load(path)


# -- the error hierarchy --------------------------------------------------------------------------

def test_every_error_is_a_weightstore_error_and_its_builtin():
    refines = {
        "InvalidKeyError": ValueError, "UnsupportedDTypeError": TypeError, "SelectionError": ValueError,
        "StoreNotFoundError": FileNotFoundError, "VersionGoneError": FileNotFoundError,
        "StoreExistsError": FileExistsError, "KeyNotInStoreError": KeyError, "FormatError": ValueError,
        "ChecksumError": ValueError, "UnsafeFileError": ValueError, "SizeLimitError": ValueError,
        "StoreClosedError": ValueError, "WriteError": OSError,
        "AssignmentError": ValueError, "PublishError": RuntimeError, "MissingDependencyError": ImportError,
        "TargetError": ValueError, "StorageError": OSError, "FileAccessError": OSError, "LayoutError": ValueError,
        "ShardTimeoutError": TimeoutError, "UnsupportedTargetError": TypeError, "PieceError": ValueError,
        "NotAPathError": TypeError,
    }
    assert set(errors.__all__) == set(refines) | {"WeightStoreError"}
    for name, builtin in refines.items():
        cls = getattr(errors, name)
        assert issubclass(cls, errors.WeightStoreError) and issubclass(cls, builtin), name
        assert getattr(ws, name) is cls
    assert issubclass(errors.ChecksumError, errors.FormatError)
    assert issubclass(errors.UnsafeFileError, errors.FormatError)
    assert issubclass(errors.VersionGoneError, errors.StoreNotFoundError)
    assert issubclass(errors.PieceError, errors.PublishError)
    assert not issubclass(errors.FileAccessError, errors.StorageError)  # a follower retries only the latter


def test_key_not_in_store_message_is_not_quoted(tmp_path):
    path = good_npz(tmp_path)
    with ws.open(path) as store, pytest.raises(KeyError) as info:
        store["dense/kernl"]
    message = str(info.value)
    assert str(path) in message and "dense/kernl" in message
    assert not message.startswith(("'", '"'))


def test_import_weightstore_does_not_import_any_framework():
    frameworks = "('tensorflow', 'keras', 'torch', 'jax', 'jaxlib', 'flax')"
    code = f"import sys, weightstore; print(sorted(m for m in sys.modules if m.split('.')[0] in {frameworks}))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stdout


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_saving_and_opening_a_file_of_another_format_does_not_import_h5py(tmp_path, suffix):
    """h5py (some 60 ms and 10 MB of a process) is imported for HDF5 files only: finding the
    format of an npz or safetensors file by its suffix passes no HDF5 entry."""
    path = tmp_path / f"m{suffix}"
    code = ("import sys, numpy as np, weightstore as ws\n"
            f"ws.save({str(path)!r}, {{'w': np.ones(3, np.float32)}})\n"
            f"with ws.open({str(path)!r}) as store: store['w']\n"
            "print('h5py' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def test_messages_name_the_file_not_a_repr(tmp_path):
    path = write(tmp_path / "garbage.npz", b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(errors.FormatError) as info:
        ws.open(path)
    assert re.search(re.escape(str(path)), str(info.value))


def test_max_bytes_on_a_foreign_compressed_npz_refuses_before_inflating(tmp_path):
    """No manifest: sizes come from each member's npy header, read without inflating the rest."""
    path = tmp_path / "foreign.npz"
    np.savez_compressed(path, big=np.arange(100_000, dtype=np.float64), small=np.arange(3, dtype=np.int8))
    raw = bytearray(path.read_bytes())
    start, length = hostile.data_offsets(path)["big.npy"]
    raw[start + length - 64 : start + length] = b"\xff" * 64  # the end of the stream is garbage
    path.write_bytes(bytes(raw))
    with ws.open(path) as store:
        assert store.info("big").shape == (100_000,) and store.info("big").nbytes == 800_000
        with raises_naming(errors.FormatError, path, "big"):
            store["big"]
    with raises_naming(errors.SizeLimitError, path, "800003"):
        ws.load(path, max_bytes=1000)
    assert ws.load(path, include="small", max_bytes=3)["small"].tolist() == [0, 1, 2]


# -- a manifest that lies small about a large member ----------------------------------------

def _manifest_member(tensors: dict) -> hostile.Member:
    import json

    text = json.dumps({"format": "weightstore", "version": 1, "metadata": {}, "tensors": tensors})
    value = np.array(text)  # 0-d: hostile.npy's ascontiguousarray would make it 1-d
    return hostile.Member("__weightstore__.npy", hostile.npy_raw(value.dtype.str, (), value.tobytes()))


def test_manifest_lying_small_cannot_front_a_large_deflated_member(tmp_path):
    """The manifest says ``w`` is one float32 (4 bytes, passes ``max_bytes=100``), the member
    inflates to 200 MB: refused from the sizes alone, before inflating or allocating."""
    stream, size, crc = hostile.deflated_npy_zeros("<f4", (50_000_000,))
    path = write(tmp_path / "liar.npz", hostile.zip_bytes([
        hostile.Member("w.npy", stream, hostile.DEFLATED, size=size, crc=crc),
        _manifest_member({"w": {"dtype": "float32", "shape": [1], "checksum": None}}),
    ]))
    assert path.stat().st_size < 1 << 20
    with raises_naming(errors.FormatError, path, "'w'"):
        ws.load(path, max_bytes=100)
    with ws.open(path) as store, raises_naming(errors.FormatError, path, "'w'"):
        store.read_into("w", np.empty(1, np.float32))
    growth, out = hostile.peak_rss_growth(
        f"try:\n    ws.load({str(path)!r}, max_bytes=100)\nexcept ws.FormatError as exc:\n    print('REFUSED', exc)\n"
    )
    assert "REFUSED" in out and str(path) in out
    assert growth < 32 << 20, f"peak memory rose by {growth >> 20} MB refusing a 4-byte tensor"


def test_manifest_lying_small_about_a_stored_member(tmp_path):
    payload = hostile.npy(np.zeros(1 << 16, np.float32))
    path = write(tmp_path / "liar.npz", hostile.zip_bytes([
        hostile.Member("w.npy", payload),
        _manifest_member({"w": {"dtype": "float32", "shape": [1], "checksum": None}}),
    ]))
    with ws.open(path) as store:
        assert store.info("w").nbytes == 4
        with raises_naming(errors.FormatError, path, "'w'"):
            store["w"]
        with raises_naming(errors.FormatError, path, "'w'"):
            store.read_into("w", np.empty(1, np.float32))


# -- read_into without a manifest checksum ----------------------------------------------------

def test_read_into_without_manifest_checksum_still_verifies(tmp_path):
    """A manifest whose checksum is null: read_into falls back to read, which checks the zip CRC."""
    value = np.arange(1000, dtype=np.float32)
    good = hostile.npy(value)
    bad = bytearray(good)
    bad[-100] ^= 0xFF
    path = write(tmp_path / "nullsum.npz", hostile.zip_bytes([
        hostile.Member("w.npy", bytes(bad), crc=zlib.crc32(good)),
        _manifest_member({"w": {"dtype": "float32", "shape": [1000], "checksum": None}}),
    ]))
    with ws.open(path) as store:
        with raises_naming(errors.ChecksumError, path, "'w'"):
            store["w"]
        with raises_naming(errors.ChecksumError, path, "'w'"):
            store.read_into("w", np.empty(1000, np.float32))
    with ws.open(path, verify=False) as store:
        assert store.read_into("w", np.empty(1000, np.float32))[0] == 0


# -- names in files without a manifest ---------------------------------------------------------

@pytest.mark.parametrize("name", ["c//d", "a/./b", "e\x01", "a/__weightstore_x", "w/", "tab\there"],
                         ids=["empty-segment", "dot-segment", "control", "reserved", "trailing-slash", "tab"])
def test_foreign_npz_member_that_is_no_key_refused(tmp_path, name):
    path = write(tmp_path / "foreign.npz", hostile.zip_bytes([
        hostile.Member("ok.npy", hostile.npy(np.zeros(2))), hostile.Member(name + ".npy", hostile.npy(np.ones(2)))]))
    with raises_naming(errors.FormatError, path, repr(name + ".npy")):
        ws.open(path)


@pytest.mark.parametrize("name", ["__weightstore_value__", "e\x01", "a/__weightstore_moving__", "a\\b"],
                         ids=["root-value", "control", "reserved", "backslash"])
def test_foreign_h5_dataset_that_is_no_key_refused(tmp_path, name):
    path = tmp_path / "foreign.h5"
    with h5py.File(path, "w") as f:
        f["ok"] = np.zeros(2)
        f[name] = np.ones(2)
    with raises_naming(errors.FormatError, path, repr(name)):
        ws.open(path)


@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_foreign_output_suffix_is_dropped(tmp_path, suffix):
    """Old tf.keras HDF5 files name datasets ``dense/kernel:0``: the key is ``dense/kernel``."""
    path = tmp_path / f"keras{suffix}"
    values = {"dense/kernel:0": np.arange(4.0), "dense/bias:12": np.ones(2), "plain": np.zeros(1)}
    if suffix == ".npz":
        np.savez(path, **values)
    else:
        with h5py.File(path, "w") as f:
            for name, value in values.items():
                f[name] = value
    loaded = ws.load(path)
    assert sorted(loaded) == ["dense/bias", "dense/kernel", "plain"]
    assert loaded["dense/kernel"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with ws.open(path) as store:
        assert store.info("dense/bias").shape == (2,)


@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_foreign_names_that_drop_to_one_key_refused(tmp_path, suffix):
    path = tmp_path / f"twice{suffix}"
    if suffix == ".npz":
        np.savez(path, **{"w": np.zeros(1), "w:0": np.ones(1)})
    else:
        with h5py.File(path, "w") as f:
            f["w"], f["w:0"] = np.zeros(1), np.ones(1)
    with raises_naming(errors.FormatError, path, "'w'", "'w:0"):
        ws.open(path)


def _h5_with_manifest_attribute(path, value):
    with h5py.File(path, "w") as f:
        f["w"] = np.zeros(2)
        f.attrs["weightstore"] = value
    return path


def test_h5_manifest_over_the_size_limit_refused_before_parsing(tmp_path):
    """A variable-length string (16 bytes of storage, whatever its length) of 64 MB + 1."""
    from weightstore.core.limits import MAX_MANIFEST_BYTES

    path = _h5_with_manifest_attribute(tmp_path / "huge.h5", "[" * (MAX_MANIFEST_BYTES + 1))
    with raises_naming(errors.UnsafeFileError, path, "manifest", "too large"):
        ws.open(path)


def test_h5_manifest_over_the_size_limit_in_utf8_bytes(tmp_path):
    """Fewer characters than the limit, more bytes: the limit is on the bytes."""
    from weightstore.core.limits import MAX_MANIFEST_BYTES

    path = _h5_with_manifest_attribute(tmp_path / "wide.h5", "模" * (MAX_MANIFEST_BYTES // 3 + 1))
    with raises_naming(errors.UnsafeFileError, path, "manifest", "too large"):
        ws.open(path)


@pytest.mark.parametrize("value", [np.array(["{}", "{}"], dtype=h5py.string_dtype()), h5py.Empty("f4"), 7],
                         ids=["array-of-strings", "empty", "number"])
def test_h5_manifest_attribute_that_is_not_one_string(tmp_path, value):
    path = _h5_with_manifest_attribute(tmp_path / "odd.h5", value)
    with raises_naming(errors.FormatError, path, "manifest attribute is not one text value"):
        ws.open(path)


# -- files changed under an open store; owned arrays ------------------------------------------

def test_npz_truncated_in_place_under_an_open_store_is_refused_not_fatal(tmp_path):
    """``cp new.npz model.npz`` over a mapped file: the next read refuses, naming file and key,
    instead of dying of SIGBUS on the pages past the new end."""
    path = tmp_path / "m.npz"
    ws.save(path, {"a": np.arange(1 << 16, dtype=np.float32), "b": np.ones(1 << 16, np.float32)})
    result = hostile.run_isolated(
        f"store = ws.open({str(path)!r})\n"
        "a = store['a']\n"
        f"with open({str(path)!r}, 'r+b') as f:\n"
        "    f.truncate(4096)\n"
        "try:\n"
        "    store['b']\n"
        "except ws.FormatError as exc:\n"
        "    print('REFUSED', exc.path == str(store.path), exc)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "REFUSED True" in result.stdout and str(path) in result.stdout and "'b'" in result.stdout


def test_mmap_false_arrays_own_aligned_memory_and_survive_rewrites_in_place(tmp_path):
    path = tmp_path / "m.npz"
    weights = {"w": np.arange(1000, dtype=np.float32), "v": np.arange(7, dtype=np.int64)}
    ws.save(path, weights)
    mapped = ws.load(path)
    owned = ws.load(path, mmap=False)
    assert not mapped["w"].flags.writeable
    for key, value in owned.items():
        assert value.flags.writeable and value.ctypes.data % 64 == 0
        np.testing.assert_array_equal(value, weights[key])
    with open(path, "r+b") as handle:  # rewritten in place, same size
        handle.write(b"\0" * path.stat().st_size)
    np.testing.assert_array_equal(owned["w"], weights["w"])
    with raises_naming(errors.FormatError, path):
        ws.load(path, mmap=False)


def test_h5_compressed_save_over_a_file_size_limit_raises_and_does_not_crash(tmp_path):
    path = tmp_path / "big.h5"
    result = hostile.run_isolated(
        "import gc\n"
        "rng = np.random.default_rng(0)\n"
        "weights = {f'l{i}/w': rng.standard_normal((256, 256)).astype(np.float32) for i in range(8)}\n"
        "try:\n"
        f"    ws.save({str(path)!r}, weights, compress=True)\n"
        "except ws.WriteError as exc:\n"
        "    print('REFUSED', type(exc).__name__, exc.errno)\n"
        "gc.collect()\n"
        "print('ALIVE')\n",
        file_size=1 << 20,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"REFUSED WriteError {errno.EFBIG}" in result.stdout and "ALIVE" in result.stdout
    assert not path.exists()


def test_h5_groups_nested_deeper_than_the_limit_refused_early(tmp_path):
    """10,000 levels overflowed HDF5's recursive visit (3,000 took 13 s)."""
    path = tmp_path / "deep.h5"
    with h5py.File(path, "w") as f:
        f.create_group("/".join(["g"] * 10_000))["w"] = np.zeros(2)
    result = hostile.run_isolated(
        f"try:\n    ws.open({str(path)!r})\nexcept ws.UnsafeFileError as exc:\n    print('REFUSED', exc)\n", timeout=60
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "REFUSED" in result.stdout and "deeper than" in result.stdout


REGRESSIONS = sorted((pathlib.Path(__file__).parent / "data" / "regressions").glob("*"))


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.name for p in REGRESSIONS])
def test_regression_files_end_in_a_clean_error(tmp_path, path):
    """Files that once hung, crashed, allocated gigabytes or read as other data
    (``tests/data/regressions``, from hand-made mutants and ``./tasks fuzz``): each is opened
    and read in a separate process with a timeout and 1 GB of address space, and must end in a
    WeightStoreError. A ``.latest`` file is the ``LATEST`` pointer of an otherwise empty
    versions folder."""
    if path.suffix == ".latest":
        (tmp_path / "LATEST").write_bytes(path.read_bytes())
        reader = f"ws.latest({str(tmp_path)!r})"
    else:
        reader = f"ws.load({str(path)!r})"
    result = hostile.run_isolated(
        f"try:\n    {reader}\n    print('READ')\nexcept ws.WeightStoreError as exc:\n    print('REFUSED', exc)\n",
        timeout=30, address_space=1 << 30,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    named = str(tmp_path) if path.suffix == ".latest" else path.name
    assert "REFUSED" in result.stdout and named in result.stdout, result.stdout


# -- every byte that decides what a tensor is ---------------------------------------------------

def test_npy_header_under_a_manifest_must_be_the_one_the_writer_writes(tmp_path):
    """fortran_order flipped (same length) used to return a silently reordered array."""
    path = good_npz(tmp_path)
    start, _ = hostile.data_offsets(path)["dense/kernel.npy"]
    raw = bytearray(path.read_bytes())
    at = raw.index(b"'fortran_order': False", start)
    raw[at : at + 22] = b"'fortran_order': True "
    path.write_bytes(bytes(raw))
    for verify in (True, False):
        with raises_naming(errors.FormatError, path, "dense/kernel", "npy header") as caught:
            ws.load(path, verify=verify)
        assert str(caught.value).endswith(  # the two dictionaries as text, not the header's raw bytes
            "has npy header {'descr': '<f4', 'fortran_order': True , 'shape': (8, 8), }, where its manifest entry "
            "((8, 8) float32) implies {'descr': '<f4', 'fortran_order': False, 'shape': (8, 8), }")
    raw[at - 12 : at] = b"\x00" * 12  # the dictionary itself unreadable: said, not echoed
    path.write_bytes(bytes(raw))
    with raises_naming(errors.FormatError, path, "dense/kernel", "has a damaged npy header, where its manifest"):
        ws.load(path)
        with ws.open(path, verify=verify) as store, raises_naming(errors.FormatError, path, "dense/kernel"):
            store.read_into("dense/kernel", np.empty((8, 8), np.float32))


def test_npz_manifest_member_is_always_crc_checked(tmp_path):
    path = good_npz(tmp_path, metadata={"lr": 0.125})
    raw = path.read_bytes()
    path.write_bytes(raw.replace("0.125".encode("utf-32-le"), "0.375".encode("utf-32-le")))
    for verify in (True, False):
        with raises_naming(errors.ChecksumError, path, "manifest"):
            ws.open(path, verify=verify)


def _rewrite_h5_manifest(path, change):
    import json

    with h5py.File(path, "r+") as f:
        document = json.loads(f.attrs["weightstore"])
        change(document)
        f.attrs["weightstore"] = json.dumps(document)


@pytest.mark.parametrize("location", ["dense/kernel", "dense/other"], ids=["two-keys-one-dataset", "elsewhere"])
def test_h5_manifest_location_must_be_the_keys_own(tmp_path, location):
    path = good_h5(tmp_path)
    _rewrite_h5_manifest(path, lambda d: d["tensors"].setdefault("location", {}).update({"dense/bias": location}))
    with raises_naming(errors.FormatError, path, "dense/bias"):
        ws.open(path)


@pytest.mark.parametrize("dtype", ["(2,)f4", ",<f", "V0", "float32,float32", "f4\x00", 7, "M8", "a" * 500])
@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_manifest_dtype_junk_is_a_format_error(tmp_path, suffix, dtype):
    path = tmp_path / f"m{suffix}"
    weights = {"w": np.zeros(2, np.float32)}
    if suffix == ".npz":
        write(path, hostile.zip_bytes([
            hostile.Member("w.npy", hostile.npy(weights["w"])),
            _manifest_member({"w": {"dtype": dtype, "shape": [2], "checksum": None}}),
        ]))
    else:
        ws.save(path, weights)
        _rewrite_h5_manifest(path, lambda d: d["tensors"].update(dtypes=[dtype]))
    with raises_naming(errors.FormatError, path, "'w'"):
        ws.open(path)


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("suffix", [".npz", ".h5"])
def test_manifest_metadata_nan_refused_on_read_as_on_write(tmp_path, suffix, constant):
    with pytest.raises(TypeError):
        ws.save(tmp_path / f"x{suffix}", {"w": np.zeros(1)}, metadata={"loss": float(constant.lower())})
    path = tmp_path / f"m{suffix}"
    if suffix == ".npz":
        document = (f'{{"format": "weightstore", "version": 1, "metadata": {{"loss": {constant}}}, '
                    '"tensors": {"w": {"dtype": "float64", "shape": [1], "checksum": null}}}')
        value = np.array(document)
        write(path, hostile.zip_bytes([
            hostile.Member("w.npy", hostile.npy(np.zeros(1))),
            hostile.Member("__weightstore__.npy", hostile.npy_raw(value.dtype.str, (), value.tobytes())),
        ]))
    else:
        ws.save(path, {"w": np.zeros(1)})
        with h5py.File(path, "r+") as f:
            text = f.attrs["weightstore"]
            f.attrs["weightstore"] = text.replace('"metadata": {}', f'"metadata": {{"loss": {constant}}}')
    with raises_naming(errors.FormatError, path, constant):
        ws.open(path)


# -- every error a WeightStoreError naming file and key ----------------------------------------

def test_h5_empty_dataspace_in_info_is_a_format_error(tmp_path):
    path = tmp_path / "empty.h5"
    with h5py.File(path, "w") as f:
        f["w"] = h5py.Empty("f4")
    with ws.open(path) as store:
        with raises_naming(errors.FormatError, path, "'w'"):
            store.info("w")
        with raises_naming(errors.FormatError, path, "'w'"):
            store["w"]


@pytest.mark.parametrize("opener", [
    lambda p: ws.open(p / "m.npz"), lambda p: ws.open(p / "m.npz", mmap=False), lambda p: ws.open(p / "m.h5"),
    lambda p: ws.open(p / "foreign.npz"), lambda p: ws.open(p / "foreign.h5"),
], ids=["npz", "npz-owned", "h5", "foreign-npz", "foreign-h5"])
def test_reading_a_closed_store_raises_store_closed(tmp_path, opener):
    weights = {"w": np.arange(4, dtype=np.float32)}
    ws.save(tmp_path / "m.npz", weights)
    ws.save(tmp_path / "m.h5", weights)
    np.savez(tmp_path / "foreign.npz", **weights)
    with h5py.File(tmp_path / "foreign.h5", "w") as f:
        f["w"] = weights["w"]
    store = opener(tmp_path)
    store.close()
    with raises_naming(errors.StoreClosedError, "closed", "'w'"):
        store["w"]
    with pytest.raises(errors.StoreClosedError):
        store.read_into("w", np.empty(4, np.float32))
    with pytest.raises(errors.StoreClosedError):
        store.read()


@pytest.mark.parametrize("form", ["wsindex", "hf-sharded"])
def test_a_closed_sharded_store_refuses_reads_and_opens_no_member_again(tmp_path, form):
    """A sharded store holds its members open (or opens its shards as read): closed, or left by
    its ``with`` block, it refuses as a plain store does instead of opening them again."""
    weights = {"w": np.arange(4, dtype=np.float32), "v": np.ones(8, np.float32)}
    if form == "wsindex":
        ws.publish_shard(tmp_path, weights, step=1, rank=0, world=1, attempt=0)
        ws.commit_shards(tmp_path, step=1, world=1, attempt=0, timeout=5)
        path = tmp_path / "step-000000000001.wsindex"
    else:
        ws.save(tmp_path / "hf", weights, max_shard_size=16)  # a shard each
        path = tmp_path / "hf" / "model.safetensors.index.json"
    with ws.open(path) as store:
        assert store["w"].tolist() == [0, 1, 2, 3]  # "v" is never read while open
    with raises_naming(errors.StoreClosedError, "closed", "'w'", path):
        store["w"]
    with raises_naming(errors.StoreClosedError, "closed", "'v'", path):
        store["v"]
    with pytest.raises(errors.StoreClosedError):
        store.read_into("v", np.empty(8, np.float32))
    with pytest.raises(errors.StoreClosedError):
        store.read()


def test_a_bytes_path_is_a_local_path_as_os_takes_it(tmp_path):
    """``open`` and ``os`` take a path as bytes; so do save, load and open (decoded as
    ``os.fsdecode`` decodes it), and their errors name it as text."""
    weights = {"w": np.arange(3, dtype=np.float32)}
    path = os.fsencode(tmp_path / "m.npz")
    ws.save(path, weights)
    assert ws.load(path)["w"].tolist() == [0, 1, 2]
    with ws.open(path) as store:
        assert store.path == str(tmp_path / "m.npz")
    with raises_naming(errors.StoreNotFoundError, tmp_path / "missing.npz"):
        ws.load(os.fsencode(tmp_path / "missing.npz"))


def test_a_path_holding_a_nul_byte_is_a_file_access_error_naming_it_at_every_entry_point(tmp_path):
    """No file name holds a NUL: ``os`` refused it with a bare ``ValueError`` ('embedded null
    byte') from load, open, save, publish, latest and follow, naming nothing."""
    weights = {"w": np.arange(3, dtype=np.float32)}
    for name in ("m\0.npz", "m\0.h5", "m\0.safetensors", "m\0.keras", "ckpt\0", "run\0"):
        path = f"{tmp_path}/{name}"
        calls = [lambda p: ws.load(p), lambda p: ws.open(p), lambda p: ws.save(p + ".npz", weights),
                 lambda p: ws.publish(p, weights, step=1), lambda p: ws.latest(p),
                 lambda p: next(ws.follow(p, timeout=0))]
        for call in calls:
            with pytest.raises(errors.FileAccessError, match="NUL") as caught:
                call(path)
            assert caught.value.path is not None and caught.value.path.startswith(f"{tmp_path}/")
            assert "\\x00" in caught.value.path and "\0" not in str(caught.value)  # shown, never cut
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="Linux's /proc")
def test_a_read_the_system_fails_is_a_storage_error_naming_the_file(tmp_path, monkeypatch):
    """An I/O error of the disk (or a network file system) while reading: ``/proc/self/mem`` is
    a regular file whose first read fails so; a bare ``OSError`` (EIO) left ws.load naming
    nothing. Where a map or an index is read, the same error is simulated at ``os.pread``."""
    with raises_naming(errors.StorageError, "/proc/self/mem", "cannot be read (Input/output error)"):
        ws.load("/proc/self/mem")
    paths = [tmp_path / f"m{suffix}" for suffix in (".npz", ".safetensors")]
    for path in paths:
        ws.save(path, {"w": np.arange(3, dtype=np.float32)})

    def failing(*args):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "pread", failing)
    monkeypatch.setattr(os, "preadv", failing)
    for path in paths:
        with raises_naming(errors.StorageError, path, "cannot be read (Input/output error)"):
            ws.load(path)


@pytest.mark.skipif(not os.path.exists("/proc/self/mem"), reason="Linux's /proc")
@pytest.mark.parametrize("name, failing", [("ck", "ck.index"), ("m.weights.json", "m.weights.json"),
                                           ("m.keras", "m.keras")], ids=["tf-index", "keras-map", "keras-archive"])
def test_an_index_or_map_read_the_system_fails_is_a_storage_error_naming_it(tmp_path, name, failing):
    """A TF checkpoint's ``.index``, a Keras sharded map and a ``.keras`` archive's end record
    are read by their formats' own code: an I/O error there (a link to ``/proc/self/mem``, a
    regular file whose reads fail) left a bare ``OSError`` naming nothing."""
    os.symlink("/proc/self/mem", tmp_path / failing)
    with raises_naming(errors.StorageError, tmp_path / failing, "cannot be read (Input/output error)"):
        ws.open(tmp_path / name)


def test_a_checkpoint_index_that_is_a_link_loop_or_dangling_link_says_so(tmp_path):
    """``x.index`` a link to itself, or to nothing: ``ws.open("x")`` said "no such file" of a
    prefix whose index is listed right beside it."""
    os.symlink("loop.index", tmp_path / "loop.index")
    os.symlink(tmp_path / "gone", tmp_path / "dangling.index")
    with raises_naming(errors.FileAccessError, tmp_path / "loop.index", "cannot be opened (Too many levels"):
        ws.open(tmp_path / "loop")
    with raises_naming(errors.StoreNotFoundError, tmp_path / "dangling.index", "is a link to", "which is missing"):
        ws.open(tmp_path / "dangling")


@pytest.mark.parametrize("config, weights", [
    (("config.json",), "model.safetensors"), (("config.json",), "model.safetensors.index.json"),
    (("config.json", "metadata.json"), "model.weights.h5"),
], ids=["hf-single", "hf-index", "keras-hub"])
def test_a_model_folder_whose_weights_file_is_a_link_loop_names_that_file(tmp_path, config, weights):
    """An HF or keras-hub preset folder whose weights (or index) file is a link loop was "a
    folder that holds no TF checkpoint": the file that cannot be opened is named."""
    for name in config:
        (tmp_path / name).write_text("{}")
    os.symlink(weights, tmp_path / weights)
    with raises_naming(errors.FileAccessError, tmp_path / weights, "cannot be opened"):
        ws.open(tmp_path)


# -- keys that print alike, or cannot be stored --------------------------------------------------

@pytest.mark.parametrize("key", [
    "a\ud800b", "k" * 65_532, "x\x85y", "a\x9fb", "evil\u202egnp.exe", "a\u200eb", "zero\u200bwidth", "\ufeffbom",
    "cafe\u0301",
], ids=["surrogate", "too-long", "nel-c1", "c1", "bidi-override", "lrm", "zwsp", "bom", "nfd"])
def test_keys_that_cannot_be_stored_or_print_alike_are_refused(tmp_path, key):
    with pytest.raises(errors.InvalidKeyError):
        ws.save(tmp_path / "k.npz", {key: np.zeros(1)})
    assert not (tmp_path / "k.npz").exists()
    name = key.encode("utf-8", "surrogatepass") + b".npy"
    if len(name) <= 0xFFFF:  # a longer one cannot be in a zip at all
        path = write(tmp_path / "foreign.npz", hostile.zip_bytes([hostile.Member(name, hostile.npy(np.ones(2)))]))
        with raises_naming(errors.FormatError, path, "member"):
            ws.open(path)


def test_longest_key_an_npz_member_can_hold_round_trips(tmp_path):
    key = "k" * (65_535 - len(".npy"))
    ws.save(tmp_path / "k.npz", {key: np.zeros(1)})
    assert ws.load(tmp_path / "k.npz")[key].shape == (1,)


def test_non_nfc_key_message_names_the_nfc_form():
    with pytest.raises(errors.InvalidKeyError) as info:
        ws.remap({"cafe\u0301/w": np.zeros(1)})
    assert "'caf\\xe9/w'" in str(info.value) and "NFC" in str(info.value)


# -- what a save is given ---------------------------------------------------------------------

def test_a_value_numpy_cannot_make_an_array_of_is_refused_naming_its_key(tmp_path):
    for call in (lambda: ws.save(tmp_path / "r.npz", {"ok": np.ones(2), "ragged": [[1], [2, 3]]}),
                 lambda: ws.publish(tmp_path / "run", {"ragged": [[1], [2, 3]]}, step=1)):
        with pytest.raises(errors.UnsupportedDTypeError, match="tensor 'ragged': is no array") as caught:
            call()
        assert caught.value.key == "ragged"
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_dir()) == []


@pytest.mark.parametrize("metadata, said", [({1: "a", "1": "b"}, "keys 1 and '1' are both '1'"),
                                            ({"run": [{"lr": {None: 1, "null": 2}}]}, "keys None and 'null'")])
def test_metadata_keys_json_would_write_alike_are_refused(tmp_path, metadata, said):
    """JSON writes ``1`` as ``"1"``: ``{1: "a", "1": "b"}`` came back as ``{"1": "b"}``. Unique
    keys that are not strings (an ``id2label`` map) are written as strings, as JSON does."""
    with pytest.raises(TypeError, match=f"metadata {said}"):
        ws.save(tmp_path / "m.npz", {"w": np.ones(2)}, metadata=metadata)
    assert not (tmp_path / "m.npz").exists()
    ws.save(tmp_path / "m.npz", {"w": np.ones(2)}, metadata={"id2label": {0: "cat", 1: "dog"}})
    assert ws.open(tmp_path / "m.npz").metadata == {"id2label": {"0": "cat", "1": "dog"}}


@pytest.mark.parametrize("suffix", [".npz", ".h5", ".safetensors"])
def test_metadata_of_weightstores_own_names_entry_is_refused_not_dropped(tmp_path, suffix):
    """An npz or HDF5 file of PyTorch's names says so under ``weightstore-names``: a caller's own
    entry of that name was written nowhere, its file read back without it; or, saying "torch",
    would have a file's ``a.b`` read as ``a/b``. Refused before anything is written, whatever
    the format; a publish too."""
    for call in (lambda: ws.save(tmp_path / f"m{suffix}", {"a.b": np.ones(2)}, metadata={"weightstore-names": "torch"}),
                 lambda: ws.publish(tmp_path / "run", {"w": np.ones(2)}, step=1, format=suffix.lstrip(".").replace(
                     "h5", "hdf5"), metadata={"run": 1, "weightstore-names": "mine"})):
        with pytest.raises(TypeError, match="metadata 'weightstore-names' is weightstore's own"):
            call()
    assert not (tmp_path / f"m{suffix}").exists() and not (tmp_path / "run").exists()


def test_an_hdf5_key_nested_deeper_than_readers_go_is_refused_before_writing(tmp_path):
    deepest = "/".join(["a"] * 256)
    ws.save(tmp_path / "ok.h5", {deepest: np.ones(1)})
    assert list(ws.load(tmp_path / "ok.h5")) == [deepest]
    with pytest.raises(errors.InvalidKeyError, match="has 257 segments; hdf5 files are read only 256 deep"):
        ws.save(tmp_path / "deep.h5", {"w": np.ones(1), deepest + "/a": np.ones(1)})
    assert not (tmp_path / "deep.h5").exists()
    ws.save(tmp_path / "deep.npz", {deepest + "/a": np.ones(1)})  # other formats have no such limit
    assert list(ws.load(tmp_path / "deep.npz")) == [deepest + "/a"]


def test_an_hdf5_tensor_of_more_axes_than_libhdf5_holds_is_refused_before_writing(tmp_path):
    """libhdf5 failed halfway through the file, naming its temporary name."""
    most, beyond = np.zeros((1,) * 32, np.float32), np.zeros((1,) * 33, np.float32)
    ws.save(tmp_path / "ok.h5", {"w": most})
    assert ws.load(tmp_path / "ok.h5")["w"].shape == most.shape
    ws.save(tmp_path / "x.npz", {"x": beyond})  # other formats hold 64
    for source in ({"w": np.ones(2), "x": beyond}, ws.open(tmp_path / "x.npz")):
        with pytest.raises(errors.UnsupportedDTypeError, match="has 33 axes; hdf5 files hold at most 32") as caught:
            ws.save(tmp_path / "many.h5", source)
        assert caught.value.path == str(tmp_path / "many.h5") and caught.value.key == "x"
    assert sorted(os.listdir(tmp_path)) == ["ok.h5", "x.npz"]


def test_a_fifo_given_as_a_folder_of_versions_is_refused_not_waited_on(tmp_path):
    os.mkfifo(tmp_path / "run")
    for call in (lambda: ws.latest(tmp_path / "run"), lambda: next(ws.follow(tmp_path / "run"))):
        with pytest.raises(errors.StoreNotFoundError, match="is a file, not a folder of versions"):
            call()


# -- JSON nested past what repr and json.dumps can show ---------------------------------------

def _nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize("field, depth", [("created", 1020), ("producer", 1020), ("created", 200),
                                          ("metadata", 990), ("metadata", 101)])
def test_a_manifest_nesting_a_field_deep_is_refused_naming_the_file(tmp_path, field, depth):
    """orjson parses 1,024 levels; ``str()`` of ``created`` raised RecursionError at open, and
    metadata as deep raised one from ``ws ls --json`` (a leak, not an error naming the file)."""
    from typer.testing import CliRunner

    from weightstore.cli.main import app

    path = good_npz(tmp_path, metadata={"note": "HERE"})
    with zipfile.ZipFile(path) as archive:
        members = {name: archive.read(name) for name in archive.namelist()}
    document = json.loads(str(np.load(io.BytesIO(members["__weightstore__.npy"]))))
    document["metadata"] = {}
    document[field] = "HERE" if field != "metadata" else {"note": "HERE"}
    text = np.array(json.dumps(document).replace('"HERE"', _nested(depth)))
    members["__weightstore__.npy"] = hostile.npy_raw(text.dtype.str, (), text.tobytes())
    path.write_bytes(hostile.zip_bytes([hostile.Member(name, data) for name, data in members.items()]))
    with raises_naming(errors.FormatError, path, field):
        ws.open(path)
    result = CliRunner().invoke(app, ["ls", "--json", str(path)])
    assert result.exit_code == 1 and '"type": "FormatError"' in result.output, result.output[-500:]


def test_metadata_is_written_only_as_deep_as_it_is_read(tmp_path):
    from weightstore.core.limits import MAX_JSON_DEPTH

    def deep(levels):
        value: object = 1
        for _ in range(levels - 1):
            value = [value]
        return {"deep": value}  # the metadata object is the first level

    ws.save(tmp_path / "ok.npz", {"w": np.zeros(1)}, metadata=deep(MAX_JSON_DEPTH))
    assert ws.open(tmp_path / "ok.npz").metadata == deep(MAX_JSON_DEPTH)
    with pytest.raises(TypeError, match=f"at most {MAX_JSON_DEPTH} levels deep"):
        ws.save(tmp_path / "deep.npz", {"w": np.zeros(1)}, metadata=deep(MAX_JSON_DEPTH + 1))
    assert not (tmp_path / "deep.npz").exists()
