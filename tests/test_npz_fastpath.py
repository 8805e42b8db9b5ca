"""Hostile and unusual npz files against the reader's fast path (the manifest read first, the
directory proved against it on whole columns, many tensors viewed at once), and against
``np.load``: whatever weightstore reads from a file, ``np.load`` reads the same from it.

A zip can be laid out so that two readers find two different directories in it (an end
record inside another's comment, a ZIP64 record beside an ordinary end, bytes between the
directory and its end). A file that one tool vets and another loads must not hold two sets
of weights, so weightstore reads only files whose directory every reader finds in one place.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

import hostile
import weightstore as ws
from weightstore import errors

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
