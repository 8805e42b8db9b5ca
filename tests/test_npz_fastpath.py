"""Hostile and unusual npz files against the reader's fast path (the manifest read first, the
directory proved against it on whole columns, many tensors viewed at once), and against
``np.load``: whatever weightstore reads from a file, ``np.load`` reads the same from it.

A zip can be laid out so that two readers find two different directories in it (an end
record inside another's comment, a ZIP64 record beside an ordinary end, bytes between the
directory and its end). A file that one tool vets and another loads must not hold two sets
of weights, so weightstore reads only files whose directory every reader finds in one place.
"""

from __future__ import annotations

import random
import re
import struct
import zlib

import ml_dtypes
import numpy as np
import pytest

import hostile
import weightstore as ws
from weightstore import errors
from weightstore.core.manifest import build_manifest
from weightstore.formats import _npz_together, _zipdir, npz

_LOCAL = struct.Struct("<4s5H3I2H")
_CENTRAL = struct.Struct("<4s6H3I5H2I")
_EOCD = struct.Struct("<4s4H2IH")
_EOCD64 = struct.Struct("<4sQ2H2I4Q")
_LOCATOR64 = struct.Struct("<4sIQI")
GOOD, EVIL = np.arange(4, dtype=np.float32), np.full(4, 666, dtype=np.float32)


def local(data: bytes, name: bytes = b"w.npy") -> bytes:
    return _LOCAL.pack(b"PK\x03\x04", 20, 0x800, 0, 0, 0x21, zlib.crc32(data), len(data), len(data), len(name), 0) + name + data


def central(data: bytes, offset: int, name: bytes = b"w.npy", comment: bytes = b"") -> bytes:
    return _CENTRAL.pack(b"PK\x01\x02", 20, 20, 0x800, 0, 0, 0x21, zlib.crc32(data), len(data), len(data), len(name),
                         0, len(comment), 0, 0, 0, offset) + name + comment


def end(count: int, size: int, offset: int, comment_len: int = 0) -> bytes:
    return _EOCD.pack(b"PK\x05\x06", 0, 0, count, count, size, offset, comment_len)


def two_members() -> tuple[bytes, bytes, bytes, int]:
    """``w.npy`` twice, good then evil: ``(file so far, good npy, evil npy, evil's offset)``."""
    good, evil = hostile.npy(GOOD), hostile.npy(EVIL)
    body = local(good)
    return body + local(evil), good, evil, len(body)


def agrees_with_numpy(path) -> None:
    """weightstore refuses the file, or reads what ``np.load`` reads."""
    with np.load(path) as archive:
        expected = {name: archive[name] for name in archive.files}
    assert expected["w"].tobytes() == EVIL.tobytes()  # the file is what it means to be: np.load sees the evil one
    try:
        loaded = ws.load(path)
    except errors.FormatError as exc:
        assert str(path) in str(exc)
        return
    assert {k: v.tobytes() for k, v in loaded.items()} == {k: v.tobytes() for k, v in expected.items()}


def test_bytes_between_directory_and_end_record_are_not_skipped(tmp_path):
    """zipfile takes bytes between the directory and its end record for data prepended to the
    archive, and moves every offset by their length: here onto a second directory."""
    body, good, evil, evil_at = two_members()
    good_directory, evil_directory = central(good, 0), None
    shift = len(good_directory)  # where zipfile will look: every offset moves by the gap
    evil_directory = central(evil, evil_at - shift)
    data = body + good_directory + evil_directory + end(1, len(good_directory), len(body))
    (path := tmp_path / "gap.npz").write_bytes(data)
    agrees_with_numpy(path)


def test_an_end_record_in_the_comment_of_another_is_not_passed_over(tmp_path):
    """The last end record's comment runs past the file's end; zipfile reads that record all the
    same (its directory hidden in the first record's comment and an entry's), not the first."""
    body, good, evil, evil_at = two_members()
    evil_head = central(evil, evil_at, comment=b"x" * _EOCD.size)[: -_EOCD.size]  # its comment: the first end record
    good_directory = central(good, 0, comment=evil_head)
    first_end = end(1, len(good_directory), len(body), comment_len=_EOCD.size)
    evil_directory_at = len(body) + len(good_directory) - len(evil_head)
    last_end = end(1, len(evil_head) + _EOCD.size, evil_directory_at, comment_len=1)
    (path := tmp_path / "two-ends.npz").write_bytes(body + good_directory + first_end + last_end)
    agrees_with_numpy(path)


def test_a_zip64_record_beside_an_ordinary_end_record_is_not_ignored(tmp_path):
    """A ZIP64 locator just before the end record: zipfile reads the directory the ZIP64 record
    names, even where the end record needs no ZIP64 values."""
    body, good, evil, evil_at = two_members()
    evil_directory = central(evil, evil_at)
    comment_start = len(body) + len(central(good, 0))
    record_at = comment_start + len(evil_directory)
    zip64 = (_EOCD64.pack(b"PK\x06\x06", 44, 45, 45, 0, 0, 1, 1, len(evil_directory), comment_start)
             + _LOCATOR64.pack(b"PK\x06\x07", 0, record_at, 1))
    good_directory = central(good, 0, comment=evil_directory + zip64)
    (path := tmp_path / "zip64-beside.npz").write_bytes(body + good_directory + end(1, len(good_directory), len(body)))
    agrees_with_numpy(path)


# -- the fast path reads what the entry-by-entry path reads ----------------------------------------

def small_weights(count: int, key: str = "layer_{i:02d}/w") -> dict[str, np.ndarray]:
    """Enough small tensors (over 16) that a whole-file read takes the batch path."""
    rng = np.random.default_rng(count)
    kinds = [np.float32, ml_dtypes.bfloat16, np.int8, np.float16, np.complex64]
    shapes = [(3,), (2, 2), (), (0, 4), (1, 3, 1)]
    return {key.format(i=i): rng.standard_normal(shapes[i % 5]).astype(kinds[i % 4]) for i in range(count)}


def same_arrays(loaded: dict, weights: dict) -> bool:
    return list(loaded) == list(weights) and all(
        loaded[k].dtype == v.dtype and loaded[k].shape == v.shape and loaded[k].tobytes() == v.tobytes()
        for k, v in weights.items())


@pytest.mark.parametrize("compress", [False, True, "shuffle"])
@pytest.mark.parametrize("key", ["layer_{i:02d}/w", "schicht_{i:02d}/gewicht_ä", "层{i}/权重"])
def test_keys_compression_and_sources_read_the_same(tmp_path, key, compress):
    """Non-ASCII keys skip the fast path (names are compared as ASCII bytes), compressed members
    skip the batch read; every way in reads the same arrays, and np.load the same bytes."""
    weights = small_weights(24, key)
    path = tmp_path / "m.npz"
    ws.save(path, weights, compress=compress)
    for mmap in (True, False):
        for verify in (True, False):
            assert same_arrays(ws.load(path, mmap=mmap, verify=verify), weights)
    url = f"memory://fastpath/{tmp_path.name}.npz"
    ws.save(url, weights, compress=compress)
    assert same_arrays(ws.load(url), weights)
    if compress != "shuffle":  # numpy has no zstd
        with np.load(path) as archive:
            assert all(archive[k].tobytes() == v.tobytes() for k, v in weights.items() if v.dtype.kind in "fic")


@pytest.mark.parametrize("weights", [{}, {"w": np.float32(2)}], ids=["no-tensors", "one-scalar"])
def test_files_with_no_or_one_tensor_read_back(tmp_path, weights):
    path = tmp_path / "m.npz"
    ws.save(path, weights, metadata={"step": 3})
    with ws.open(path) as store:
        assert store.metadata == {"step": 3}
        assert same_arrays(store.read(), weights)


def test_more_members_than_a_zip_end_record_counts_read_through_zip64(tmp_path):
    """65,535 tensors and the manifest: the count is in the ZIP64 end record only."""
    weights = {f"t{i}": np.full(2, i, np.int32) for i in range(0xFFFF)}
    path = tmp_path / "m.npz"
    ws.save(path, weights)
    assert b"PK\x06\x06" in path.read_bytes()[-200:]
    loaded = ws.load(path)
    assert list(loaded) == list(weights)
    assert np.array_equal(np.stack(list(loaded.values())), np.stack(list(weights.values())))
    with np.load(path) as archive:
        assert np.array_equal(archive["t65534"], weights["t65534"])


def test_arrays_read_together_outlive_the_store():
    """Every array of a batch read views one buffer over the map; closing the store must leave
    the map open until the last array dies (else touching one is a segfault)."""
    result = hostile.run_isolated(
        "import gc, tempfile, os\n"
        "path = os.path.join(tempfile.mkdtemp(), 'm.npz')\n"
        "ws.save(path, {f'w{i}': np.full(1000, i, np.float32) for i in range(40)})\n"
        "with ws.open(path) as store:\n"
        "    arrays = store.read()\n"
        "kept = arrays['w39']\n"
        "del arrays, store\n"
        "gc.collect()\n"
        "os.remove(path)\n"
        "print('SUM', float(kept.sum()))\n",
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "SUM 39000.0" in result.stdout


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fastpath") / "m.npz"
    ws.save(path, small_weights(30), metadata={"lr": 0.5})
    return path.read_bytes()


def outcome(path, monkeypatch, *, fast: bool) -> tuple:
    """What a verified read of the whole file gives: arrays, or the error's kind."""
    with monkeypatch.context() as patch:
        if not fast:  # the reference: the directory read entry by entry, each tensor alone
            patch.setattr(_zipdir, "last_member", lambda *_: None)
            patch.setattr(npz.NpzReader, "read_many", lambda self, keys, verify: [self.read(k, verify=verify) for k in keys])
        try:
            with ws.open(path) as store:
                return "read", {k: (v.dtype, v.shape, v.tobytes()) for k, v in store.read().items()}, store.metadata
        except errors.WeightStoreError as exc:
            assert str(path) in str(exc)
            return ("refused",)


@pytest.mark.parametrize("few_entries", [_zipdir.FEW_ENTRIES, 0], ids=["entry-by-entry-proof", "column-proof"])
@pytest.mark.parametrize("stretch", [_npz_together._TOGETHER_BYTES, 40],
                         ids=["one-stretch", "stretches-of-a-few-tensors"])
@pytest.mark.parametrize("seed", range(4))
def test_damaged_directories_read_alike_on_either_path(tmp_path, monkeypatch, written, seed, stretch, few_entries):
    """Fields of the central directory and the local headers set to edge values: the fast path
    reads exactly what the entry-by-entry path reads, or refuses what it refuses, and never
    raises anything but a WeightStoreError; whether it checks the file at once or a stretch at a
    time (as it reads a large file, in order), or proves a directory of a few entries with
    ``struct`` or with numpy's columns (as it does one of many), changes nothing."""
    monkeypatch.setattr(_npz_together, "_TOGETHER_BYTES", stretch)
    monkeypatch.setattr(_zipdir, "FEW_ENTRIES", few_entries)
    rng = random.Random(seed)
    directory = written.rfind(b"PK\x05\x06") - int.from_bytes(written[-10:-6], "little")
    headers = [m.start() for m in re.finditer(b"PK\x03\x04", written)]
    path = tmp_path / "m.npz"
    for _ in range(60):
        data = bytearray(written)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(directory, len(data) - 22) if rng.random() < 0.7 else rng.choice(headers) + rng.randrange(30)
            width = rng.choice([1, 2, 4])
            value = rng.choice([0, 1, 0xFF, 2**(8 * width) - 1, rng.randrange(2**(8 * width)), data[at] ^ 1])
            data[at : at + width] = (value % 2**(8 * width)).to_bytes(width, "little")
        path.write_bytes(bytes(data))
        assert outcome(path, monkeypatch, fast=True) == outcome(path, monkeypatch, fast=False)


# -- the manifest read first: only a guess until the directory is read --------------------------------

def manifest_npy(metadata: dict) -> bytes:
    text = build_manifest([("w", "float32", (4,), zlib.crc32(GOOD.tobytes()))], metadata, "test")
    return hostile.npy_raw(f"<U{len(text)}", (), text.encode("utf-32-le"))


@pytest.mark.parametrize(("form", "read"), [
    ("as-written", True), ("big-endian", True), ("npy-version-2", True), ("wider-padding", True),
    ("declares-one-more-character", False), ("an-array-of-one", False), ("bytes-not-text", False),
    ("a-width-no-dtype-holds", False)])
def test_the_manifest_member_reads_as_numpy_reads_it_in_any_npy_form(tmp_path, form, read):
    """The manifest's npy header, as numpy writes it, is read without numpy; any other form is
    read by numpy's parse, and what either reads is the text ``np.load`` reads there."""
    text = build_manifest([("w", "float32", (4,), zlib.crc32(GOOD.tobytes()))], {"who": "me"}, "test")
    descr, payload, shape = f"<U{len(text)}", text.encode("utf-32-le"), ()
    header, version = None, 1
    if form == "big-endian":
        descr, payload = f">U{len(text)}", text.encode("utf-32-be")
    elif form == "npy-version-2":
        version = 2
    elif form == "wider-padding":
        header = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': (), }}" + " " * 64
    elif form == "declares-one-more-character":
        descr = f"<U{len(text) + 1}"
    elif form == "a-width-no-dtype-holds":  # 4 GB a character: numpy's dtype() raised TypeError, not ours
        descr = "<U999999999"
    elif form == "an-array-of-one":
        shape = (1,)
    elif form == "bytes-not-text":
        descr, payload = f"|S{len(payload)}", payload
    manifest = hostile.npy_raw(descr, shape, payload, header_text=header, version=version)
    path = tmp_path / "m.npz"
    path.write_bytes(hostile.zip_bytes([hostile.Member("w.npy", hostile.npy(GOOD)),
                                        hostile.Member("__weightstore__.npy", manifest)]))
    if not read:
        with pytest.raises(errors.FormatError) as refused:
            ws.open(path)
        assert str(path) in str(refused.value)
        return
    with np.load(path) as archive:
        assert str(archive["__weightstore__"]) == text
    with ws.open(path) as store:
        assert store.metadata == {"who": "me"} and store["w"].tobytes() == GOOD.tobytes()


@pytest.mark.parametrize("lookalike", ["another-manifest", "pointing-at-a-tensor"])
def test_a_lookalike_of_the_manifest_entry_at_the_directory_end_is_not_read_as_it(tmp_path, lookalike):
    """The manifest's entry is first in the directory; the last entry's comment ends with what
    looks like the manifest's entry, pointing at another manifest (or at a tensor). The reader
    tries the directory's last bytes first: what it read there must not stand (nor be where
    the real entry is read from), and reading it must not refuse a file np.load reads."""
    real, fake, tensor = manifest_npy({"who": "real"}), manifest_npy({"who": "fake, and longer"}), hostile.npy(GOOD)
    name = b"__weightstore__.npy"
    body = local(real, name) + local(tensor)
    fake_at = len(body) if lookalike == "another-manifest" else len(local(real, name))
    body += local(fake, name)
    lookalike_entry = central(fake, fake_at, name)
    directory = central(real, 0, name) + central(tensor, len(local(real, name)), comment=lookalike_entry)
    (path := tmp_path / "m.npz").write_bytes(body + directory + end(2, len(directory), len(body)))
    with np.load(path) as archive:
        assert archive["w"].tobytes() == GOOD.tobytes()
    with ws.open(path) as store:
        assert store.metadata == {"who": "real"}
        assert store["w"].tobytes() == GOOD.tobytes()


def test_an_entry_at_the_zip64_marker_is_not_proved_past_4_gib():
    """The fast path proves entries against ``end``, the manifest's offset, which lies below the
    ZIP64 marker in any file it is given; past it an offset of 0xFFFFFFFF is the marker, which
    :func:`_zipdir.parse` refuses, so the fast path answers nothing."""
    name = b"w.npy"
    entry = struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 0, 0, 0, 0, 16, 16, len(name), 0, 0, 0, 0, 0,
                        _zipdir.ZIP64_LIMIT) + name
    name_lens = [len(name)]
    assert _zipdir.parse_expected(entry, 5 << 30, lambda: ["w.npy"], name, name_lens) is None
    ordinary = entry[:-len(name) - 4] + struct.pack("<I", 0) + name
    assert _zipdir.parse_expected(ordinary, 1 << 20, lambda: ["w.npy"], name, name_lens) is not None
