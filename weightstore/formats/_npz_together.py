"""The batched read path of :class:`~weightstore.formats._npz_reader.NpzReader`: ``read_many``.

Plain stored members of a local file with a manifest (the usual case) are checked on whole
columns and read together, so a file of 50,000 small tensors costs microseconds per tensor.
The reader's one-tensor path (:meth:`NpzReader._read_one`) is the rule: any member that fails a
check here goes back to it, which raises the precise error (or reads it). This module works on
the reader's parsed directory and manifest (its underscore attributes): one reader, its two
read paths in two modules, one job each.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
from isal import isal_zlib

from weightstore.core import checksums as _crc
from weightstore.core._gcpause import paused_gc
from weightstore.core._tensortable import NO_CRC
from weightstore.core.manifest import CRC_CHUNK, crc32
from weightstore.formats import _zipdir
from weightstore.formats._npz_layout import layout_of
from weightstore.formats._zipdir import LOCAL, LOCAL_RECORD, LOCAL_SIG, STORED
from weightstore.io._local import MappedFile, OwnedFile

if TYPE_CHECKING:
    from weightstore.formats._npz_reader import NpzReader

#: below this many tensors, reading one by one costs less than setting up column checks
_FEW = 16


#: tensors are checked together this many bytes at a time (a larger one alone), in the keys'
#: order. A cold mapped file is read as its pages are first touched, and the column checks touch
#: every member's local header first: spread through the file, one synchronous read each, then
#: the data after them. A megabyte at a time touches the file in order, which the kernel's
#: read-ahead streams: a cold 256 MB read_many took 0.115 s instead of 0.27-0.29 s (0.106 s for a
#: plain sequential read; 32 MB stretches: 0.27 s), and a warm one 3.5 ms more (14 ms)
_TOGETHER_BYTES = 1 << 20


def read_many(reader: NpzReader, keys: list[str], *, verify: bool) -> list[np.ndarray]:
    """Tensors in ``keys``' order: what ``read`` returns for each, but a file of 50,000 small
    tensors costs microseconds per tensor.

    Plain stored members of a local file with a manifest (the usual case) are checked and
    read together by :func:`_read_together`, from the map, or with ``mmap=False`` from one
    read of the span that holds the small ones; any other member by :meth:`~NpzReader._read_one`, the
    rule (see :func:`_read_together` for the differential test binding the two).
    """
    if len(keys) < _FEW or reader._manifest is None or not isinstance(reader._source, (MappedFile, OwnedFile)):
        return [reader._read_one(key, verify) for key in keys]
    reader._source.check_unchanged(f"{len(keys)} tensors")
    positions = _plain_positions_of(reader, keys)
    if isinstance(reader._source, MappedFile):
        buffer: Any = reader._source.mapping
        base = 0
        reader._source.prefetch(*_span(reader, positions))
    else:  # owned memory: one read of the span the small members lie in, if they fill most of it
        positions[reader._members.column("sizes")[np.maximum(positions, 0)] > CRC_CHUNK] = -1
        found = positions[positions >= 0]
        if not found.size:
            return [reader._read_one(key, verify) for key in keys]
        base, span = _span(reader, positions)
        if span > 2 * int(reader._members.column("sizes")[found].sum()) + CRC_CHUNK:
            return [reader._read_one(key, verify) for key in keys]
        buffer = reader._source.read_at(base, span)
    ends = np.cumsum(np.where(positions >= 0, reader._members.column("sizes")[np.maximum(positions, 0)], 0))
    cuts = [0, *np.searchsorted(ends, np.arange(_TOGETHER_BYTES, int(ends[-1]), _TOGETHER_BYTES), "right").tolist(),
            len(keys)]
    arrays: list[np.ndarray] = []
    with paused_gc():  # an array per tensor, each tracked by the collector: 50,000 of them
        for lo, hi in itertools.pairwise(dict.fromkeys(cuts)):
            arrays += _read_together(reader, keys[lo:hi], positions[lo:hi], buffer, base, verify)
    return arrays


def _span(reader: NpzReader, positions: np.ndarray) -> tuple[int, int]:
    """``(offset, length)`` of the file's stretch that holds the members at ``positions`` (-1s skipped)."""
    found = positions[positions >= 0]
    if not found.size:
        return 0, 0
    start = int(reader._members.column("offsets")[found].min())
    return start, int(reader._members.column("limits")[found].max()) - start


def _plain_positions_of(reader: NpzReader, keys: list[str]) -> np.ndarray:
    """Each key's directory position if its member is a plain stored ``.npy``, else -1."""
    members = reader._members
    if reader._plain_positions is None and reader._in_table_order:
        reader._plain_positions = reader._table.row_index  # type: ignore[union-attr]  # only with a manifest
    if reader._plain_positions is None:
        index, codecs = members.index, reader._codecs
        reader._plain_positions = (
            {key: index[name] for key, name in reader._member_of.items()
             if len(name) == len(key) + len(".npy") and key not in codecs}
            if codecs or not reader._only_npy else
            dict(zip(reader._member_of, map(index.__getitem__, reader._member_of.values()), strict=True))
        )
    positions = np.fromiter(map(reader._plain_positions.get, keys, itertools.repeat(-1)), np.int64, len(keys))
    positions[members.column("methods")[np.maximum(positions, 0)] != STORED] = -1
    return positions


def _read_together(reader: NpzReader, keys: list[str], positions: np.ndarray, buffer: Any, base: int,
                   verify: bool) -> list[np.ndarray]:
    """What :meth:`~NpzReader._read_one` checks, for many members at once, in ``buffer`` (the file's
    bytes from offset ``base``): local headers and names on whole columns
    (:func:`_data_starts`), then per member only what must be: its npy header compared byte
    for byte as a slice, its data viewed in place and checksummed. A member that fails a
    check, or is not a plain stored ``.npy`` (position -1), goes to :meth:`~NpzReader._read_one`, which
    raises the precise error (or reads it).

    Fast twin of :meth:`~NpzReader._read_one`, which is the rule; bound by the differential test
    ``tests/test_npz_fastpath.py::test_damaged_directories_read_alike_on_either_path``
    (every tensor read, or refused, alike) and by
    ``test_npz_fastpath.py::test_keys_compression_and_sources_read_the_same``."""
    table = reader._table
    names, shapes, nbytes, crcs = table.rows()  # type: ignore[union-attr]  # read_many checked there is one
    rows = (positions.tolist() if reader._in_table_order and positions.min() >= 0
            else table.positions(keys).tolist())  # type: ignore[union-attr]
    # Every array is a view of this one, its base: it holds the one export of ``buffer``
    # that keeps a map open while any array lives. (``frombuffer`` per tensor would make a
    # memoryview each, 50,000 objects for the cyclic collector to walk once it resumes.)
    whole = np.frombuffer(buffer, np.uint8)
    starts, ends = _data_starts(reader, positions, whole, base)
    small_crc, released_from = isal_zlib.crc32, _crc.RELEASE_GIL_BYTES  # as crc32() would choose
    arrays = []
    for key, row, start, end in zip(keys, rows, starts, ends, strict=True):
        shape = shapes[row]
        layout = layout_of(names[row], shape)
        size = nbytes[row]
        data = start + len(layout.header)
        if start < 0 or end != data + size or buffer[start:data] != layout.header:
            arrays.append(reader._read_one(key, verify))
            continue
        array = np.ndarray(shape, layout.storage, whole, data) if size else np.empty(shape, layout.storage)
        if verify and ((small_crc(array) if size < released_from else crc32(array)) != crcs[row]
                       if crcs[row] != NO_CRC
                       else crc32(memoryview(buffer)[start:end]) != reader._members[reader._member_of[key]].crc):
            arrays.append(reader._read_one(key, verify))
            continue
        arrays.append(array.view(layout.logical) if layout.viewed else array)
    return arrays


def _data_starts(reader: NpzReader, positions: np.ndarray, file_bytes: np.ndarray,
                 base: int) -> tuple[list[int], list[int]]:
    """Where each member's data (npy header first) starts and ends in ``file_bytes``, or -1
    where the position is -1 or the member's local header does not check out.

    The local headers are read as one record array and checked as columns: the signature,
    the method, the name (same length and bytes as the directory's), and the data within the
    member's limit, as :meth:`~NpzReader._data_offset` checks one member.
    """
    members = reader._members
    chosen = np.flatnonzero(positions >= 0)
    found = positions[chosen]
    offsets, name_lens = members.column("offsets")[found] - base, members.column("name_lens")[found]
    local = file_bytes[offsets[:, None] + np.arange(LOCAL.size)].view(LOCAL_RECORD)[:, 0]
    starts = offsets + LOCAL.size + local["name_len"] + local["extra_len"].astype(np.int64)
    ends = starts + members.column("sizes")[found]
    good = ((local["sig"] == LOCAL_SIG) & (local["method"] == STORED) & (local["name_len"] == name_lens)
            & (ends <= members.column("limits")[found] - base))
    # every name's bytes, gathered end to end, against the directory's names end to end
    differs = _zipdir.spans(file_bytes, offsets + LOCAL.size, name_lens) != members.raw_names_of(found)
    if differs.any():
        good &= ~np.logical_or.reduceat(differs, np.concatenate(([0], np.cumsum(name_lens)[:-1])))
    all_starts = np.full(len(positions), -1, dtype=np.int64)
    all_ends = np.full(len(positions), -1, dtype=np.int64)
    all_starts[chosen] = np.where(good, starts, -1)
    all_ends[chosen] = ends
    return all_starts.tolist(), all_ends.tolist()
