"""The manifest's tensors as columns (versions 2 and 3), and the npz directory proved against them.

Every column of an untrusted manifest is checked whole; each kind of damage is a
``FormatError`` that names the file and, where one tensor is at fault, that tensor. An npz laid
out as weightstore writes it opens without a step per member; one laid out any other way
(reordered, renamed, written by another tool) opens through the entry-by-entry path and reads
the same tensors.
"""

from __future__ import annotations

import json
import re
import zipfile

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hostile
import weightstore as ws
from hostile import raises_naming
from weightstore import errors
from weightstore.core.manifest import build_manifest, parse_manifest


def columns(**changes) -> dict:
    """A valid version 2 manifest of two tensors, with ``changes`` to its columns."""
    tensors = {"keys": ["dense/kernel", "dense/bias"], "dtypes": ["float32", "bfloat16"], "dtype": [0, 1],
               "ndim": [2, 1], "shape": [3, 4, 4], "crc32": [1, 4294967295]}
    tensors.update(changes)
    return {"format": "weightstore", "version": 2, "metadata": {}, "tensors": tensors}


def parse(document: dict):
    return parse_manifest(json.dumps(document), "m.npz")


def test_columns_read_as_tensor_infos_in_order():
    manifest = parse(columns())
    assert list(manifest.tensors) == ["dense/kernel", "dense/bias"]
    kernel, bias = manifest.tensors["dense/kernel"], manifest.tensors["dense/bias"]
    assert (kernel.dtype, kernel.shape, kernel.nbytes, kernel.checksum) == ("float32", (3, 4), 48, "crc32:00000001")
    assert (bias.dtype, bias.shape, bias.nbytes, bias.checksum) == ("bfloat16", (4,), 8, "crc32:ffffffff")
    assert "dense" not in manifest.tensors


def test_scalars_and_empty_tensors_have_their_own_shapes():
    manifest = parse(columns(keys=["a", "b", "c"], dtype=[0, 0, 1], ndim=[0, 2, 0], shape=[0, 5], crc32=[0, 0, 0]))
    assert [manifest.tensors[k].shape for k in "abc"] == [(), (0, 5), ()]
    assert [manifest.tensors[k].nbytes for k in "abc"] == [4, 0, 2]


@pytest.mark.parametrize(("changes", "named"), [
    ({"crc32": None}, "'crc32'"),
    ({"extra": []}, "columns"),
    ({"keys": "dense/kernel"}, "'keys'"),
    ({"keys": ["dense/kernel", 7]}, "'keys'"),
    ({"keys": ["dense//kernel", "dense/bias"]}, "'dense//kernel'"),
    ({"keys": ["w", "w"]}, "'w' twice"),
    ({"dtypes": ["float32", "float32"]}, "'dtypes'"),
    ({"dtypes": "float32"}, "'dtypes'"),
    ({"dtypes": ["float32", "M8"]}, "tensor 'dense/bias': unknown dtype 'M8'"),
    ({"dtypes": ["float32", "bfloat16", "object"]}, "unknown dtype 'object'"),
    ({"dtype": [0, 2]}, "'dtype'"),
    ({"dtype": [0, -1]}, "'dtype'"),
    ({"dtype": [0, True]}, "'dtype'"),
    ({"dtype": [0, 1.0]}, "'dtype'"),
    ({"dtype": [0]}, "'dtype'"),
    ({"ndim": [2, 65], "shape": [3, 4] + [1] * 65}, "'ndim'"),
    ({"ndim": [2, 2]}, "'shape'"),
    ({"shape": [3, -4, 4]}, "'shape'"),
    ({"shape": [3, 4, False]}, "'shape'"),
    ({"shape": [3, 4, 2**70]}, "'shape'"),
    ({"shape": [2**40, 2**40, 4]}, "'dense/kernel'"),
    ({"ndim": [2, 3], "shape": [3, 4, 0, 2**62, 2**62]}, "'dense/bias'"),
    ({"crc32": [1, 2**32]}, "'crc32'"),
    ({"crc32": [1, -1]}, "'crc32'"),
    ({"crc32": [1, "crc32:00000000"]}, "'crc32'"),
    ({"location": ["dense/bias"]}, "'location'"),
    ({"location": {"dense/other": "x"}}, "'dense/other'"),
    ({"location": {"dense/bias": ""}}, "'dense/bias'"),
    ({"codec": {"dense/bias": "lz77-magic"}}, "'dense/bias'"),
])
def test_each_damaged_column_is_a_format_error_naming_it(changes, named):
    with raises_naming(errors.FormatError, "m.npz", named):
        parse(columns(**changes))


def test_a_missing_column_is_named():
    document = columns()
    del document["tensors"]["ndim"]
    with raises_naming(errors.FormatError, "m.npz", "columns", "'ndim'"):
        parse(document)


def test_a_newer_version_is_refused():
    with raises_naming(errors.FormatError, "m.npz", "version 4"):
        parse({**columns(), "version": 4})


DIGESTS = "ab" * 32 + "0123456789abcdef" * 4


def test_version_3_digests_read_per_tensor_and_are_optional():
    manifest = parse({**columns(blake3=DIGESTS), "version": 3})
    assert manifest.tensors["dense/kernel"].digest == "blake3:" + "ab" * 32
    assert manifest.tensors["dense/bias"].digest == "blake3:" + "0123456789abcdef" * 4
    assert manifest.tensors["dense/bias"].checksum == "crc32:ffffffff"  # CRC-32 still there for what checks it
    assert parse({**columns(), "version": 3}).tensors["dense/kernel"].digest is None
    assert parse(columns()).tensors["dense/kernel"].digest is None  # version 2: no digests


@pytest.mark.parametrize("column", [DIGESTS[:-2], DIGESTS + "00", DIGESTS.upper(), DIGESTS[:-1] + "g",
                                    ["ab" * 32, "cd" * 32], 7])
def test_a_damaged_digest_column_is_a_format_error_naming_it(column):
    with raises_naming(errors.FormatError, "m.npz", "'blake3'"):
        parse({**columns(blake3=column), "version": 3})


def test_a_digest_column_in_a_version_2_manifest_is_refused():
    """What a version 2 reader does with it, so a file reads the same wherever it is read."""
    with raises_naming(errors.FormatError, "m.npz", "columns"):
        parse(columns(blake3=DIGESTS))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["float32", "int8", "bfloat16", "bool", "complex64"]),
                          st.lists(st.integers(0, 5), max_size=4), st.integers(0, 2**32 - 1)),
                max_size=20))
def test_build_then_parse_gives_back_every_row(rows):
    tensors = [(f"t{i}/w", name, tuple(shape), crc) for i, (name, shape, crc) in enumerate(rows)]
    manifest = parse_manifest(build_manifest(tensors, {"step": 3}, "test"), "m.npz")
    assert manifest.metadata == {"step": 3}
    assert list(manifest.tensors) == [key for key, *_ in tensors]
    for key, name, shape, crc in tensors:
        info = manifest.tensors[key]
        itemsize = ml_dtypes.bfloat16(0).itemsize if name == "bfloat16" else np.dtype(name).itemsize
        assert (info.dtype, info.shape, info.nbytes, info.checksum) == (
            name, shape, int(np.prod(shape)) * itemsize, f"crc32:{crc:08x}")


# -- the npz directory, proved against the manifest or read entry by entry ---------------------------

def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {f"layer_{i}/w": rng.standard_normal(i % 5 + 1).astype(np.float32) for i in range(40)}


def members_of(path) -> list[hostile.Member]:
    with zipfile.ZipFile(path) as archive:
        return [hostile.Member(name, archive.read(name)) for name in archive.namelist()]


def test_npz_written_by_another_layout_reads_the_same(tmp_path):
    """Members reordered (and no alignment padding): not the writer's layout, so the directory
    is read entry by entry; the tensors are the same."""
    path = tmp_path / "m.npz"
    original = weights()
    ws.save(path, original)
    members = members_of(path)
    tensors, manifest = members[:-1], members[-1]
    path.write_bytes(hostile.zip_bytes([manifest, *reversed(tensors)]))
    loaded = ws.load(path)
    assert list(loaded) == list(original)
    for key, value in original.items():
        assert loaded[key].tobytes() == value.tobytes()


def test_npz_member_missing_from_the_manifest_order_is_named(tmp_path):
    """Directory and manifest list different keys: refused, naming what differs."""
    path = tmp_path / "m.npz"
    ws.save(path, weights())
    members = members_of(path)
    members[3] = hostile.Member("layer_3/renamed.npy", members[3].data)
    path.write_bytes(hostile.zip_bytes(members))
    with raises_naming(errors.FormatError, path, "layer_3/w", "layer_3/renamed"):
        ws.open(path)


def test_npz_with_a_member_overlapping_the_next_is_refused_as_in_any_order(tmp_path):
    """The writer's order and names, but a directory offset pointing into the previous member:
    the column proof fails, and the entry-by-entry path names the overlap."""
    path = tmp_path / "m.npz"
    ws.save(path, weights())
    raw = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as archive:
        sixth = archive.infolist()[5]
    entry = raw.index(b"PK\x01\x02")  # the directory's first entry (no name here holds the signature)
    for _ in range(5):
        entry = raw.index(b"PK\x01\x02", entry + 1)
    raw[entry + 42 : entry + 46] = (sixth.header_offset - 8).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with raises_naming(errors.UnsafeFileError, path, "overlaps"):
        ws.open(path)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["keys", "dtypes", "dtype", "ndim", "shape", "crc32", "location", "codec"]),
       st.integers(0, 5), JSON_VALUES, st.booleans())
def test_any_damage_to_a_column_is_read_or_refused_as_a_format_error(column, index, value, whole):
    """Replace a column, or one of its values, with any JSON: the result is a manifest whose every
    entry reads, or a FormatError, never another exception."""
    document = columns(location={"dense/bias": "dense/bias/__weightstore_value__"}, codec={"dense/kernel": "shuffle-zstd"})
    tensors = document["tensors"]
    if whole or not isinstance(tensors[column], list):
        tensors[column] = value
    else:
        tensors[column][index % len(tensors[column])] = value
    try:
        manifest = parse(document)
    except errors.FormatError:
        return
    for key in manifest.tensors:
        info = manifest.tensors[key]
        assert info.nbytes == int(np.prod(info.shape, dtype=object)) * np.dtype(
            ml_dtypes.bfloat16 if info.dtype == "bfloat16" else info.dtype).itemsize


@pytest.mark.parametrize(("entry", "named"), [
    ({"dtype": "float32", "shape": [2], "checksum": "crc32:xyz"}, "checksum of 'w'"),
    ({"dtype": "float32", "shape": [2], "checksum": "crc32:-1"}, "checksum of 'w'"),
    ({"dtype": "float32", "shape": [2**40, 2**40, 2**40], "checksum": None}, "'w'"),
    ({"dtype": "float32", "shape": [0, 2**62, 2**62], "checksum": None}, "'w'"),
])
def test_version_1_entries_are_held_to_the_same_rules(entry, named):
    """Files of the first version still read; their checksums and shapes are checked as tightly."""
    with raises_naming(errors.FormatError, "m.npz", named):
        parse({"format": "weightstore", "version": 1, "tensors": {"w": entry}})


def test_version_1_manifest_reads_as_the_same_table():
    entries = {"a": {"dtype": "bfloat16", "shape": [2, 3], "checksum": "crc32:0000abcd"},
               "b": {"dtype": "int8", "shape": [], "checksum": None}}
    manifest = parse({"format": "weightstore", "version": 1, "tensors": entries})
    assert manifest.tensors["a"] == ("a", "bfloat16", (2, 3), 12, "crc32:0000abcd", None)  # no digest before version 3
    assert manifest.tensors["b"] == ("b", "int8", (), 1, None, None)


#: a JSON value nested as deep as orjson reads (1,024 levels), past where ``repr`` raises RecursionError
DEEP = "[" * 1000 + "]" * 1000
V2_TENSORS = '"keys": ["w"], "dtypes": ["float32"], "dtype": [0], "ndim": [0], "shape": [], "crc32": [0]'


@pytest.mark.parametrize(("version", "tensors"), [
    ("2", '{"keys": ["w"], "dtypes": [DEEP], "dtype": [0], "ndim": [0], "shape": [], "crc32": [0]}'),
    ("2", '{"keys": ["w"], "dtypes": ["float32", DEEP], "dtype": [0], "ndim": [0], "shape": [], "crc32": [0]}'),
    ("2", '{' + V2_TENSORS + ', "location": {"w": DEEP}}'),
    ("2", '{' + V2_TENSORS + ', "codec": {"w": DEEP}}'),
    ("DEEP", '{' + V2_TENSORS + '}'),
    ("1", '{"w": {"dtype": "float32", "shape": [DEEP], "checksum": null}}'),
    ("1", '{"w": {"dtype": "float32", "shape": [], "checksum": DEEP}}'),
    ("1", '{"w": {"dtype": DEEP, "shape": [], "checksum": null}}'),
    ("1", '{"w": {"dtype": "float32", "shape": [], "checksum": null, "location": DEEP}}'),
    ("3", '{"keys": [DEEP], "dtypes": ["float32"], "dtype": [0], "ndim": [0], "shape": [], "crc32": [0]}'),
    ("3", '{"keys": ["w", DEEP], "dtypes": ["float32"], "dtype": [0, 0], "ndim": [0, 0], "shape": [], "crc32": [0, 0]}'),
], ids=["v2-dtypes", "v2-second-dtype", "v2-location", "v2-codec", "version", "v1-shape", "v1-checksum", "v1-dtype",
        "v1-location", "v3-key", "v3-second-key"])
def test_a_deeply_nested_value_is_a_format_error(version, tensors):
    """A value nested a thousand deep where a string or number belongs: refused as any wrong
    value is (its message shows it cut short), not a RecursionError from printing it."""
    text = f'{{"format": "weightstore", "version": {version}, "tensors": {tensors}}}'.replace("DEEP", DEEP)
    with raises_naming(errors.FormatError, "m.npz"):
        parse_manifest(text, "m.npz")


@pytest.mark.parametrize(("keys", "words"), [
    (["dense/kernel", 3], "manifest 'keys' is not a list of strings"),
    (["dense//kernel", 3], "manifest 'keys' is not a list of strings"),  # whatever else is wrong, a non-string says so
    ([None, "dense/bias"], "manifest 'keys' is not a list of strings"),
    (["dense//kernel", "dense/bias"], "invalid key: it has an empty segment"),
])
def test_keys_that_are_no_strings_are_refused_as_such_before_any_rule_of_keys(keys, words):
    with pytest.raises(errors.FormatError, match=re.escape(words)):
        parse(columns(keys=keys))
