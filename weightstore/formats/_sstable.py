"""The immutable sorted table (LevelDB's SSTable) that a TensorFlow checkpoint's ``.index`` is.

TensorFlow's ``tensorflow/core/lib/io/{table,block,format}.cc`` write it as: data blocks of
prefix-compressed key/value entries, each block followed by a 5-byte trailer (compression
type, masked CRC-32C of the block and that type byte); an index block whose values are the
block handles (two varint64s: offset, size) of the data blocks; and a 48-byte footer holding
the metaindex and index handles, zero padding, and the 8-byte magic number.

The file is hostile until proved otherwise: every handle, varint, length and restart count is
checked against the bytes that exist before it is used, every block's checksum is verified,
and keys must strictly increase (two entries with one name are refused, not shadowed). A key
shares a prefix with the one before it, so 4 bytes of entry can make a key as long as the
last plus one: the keys rebuilt may total at most :data:`SSTABLE_KEY_BYTES_PER_BYTE` times the table's
size (plus :data:`SSTABLE_KEY_BYTES_SLACK`), checked before each key is made, where 50,000 such
entries (200 KB) made 1.2 GB of keys.
Compressed blocks are refused: TensorFlow writes none (``TableBuilderOptions`` in
``tensor_bundle.cc``), and decompressing snappy would need another dependency.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import crc32c as _crc32c

from weightstore.core.limits import SSTABLE_KEY_BYTES_PER_BYTE, SSTABLE_KEY_BYTES_SLACK
from weightstore.errors import FormatError, UnsafeFileError

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_BYTES = 48  # two handles of at most 2 x 10 bytes each, padded to 40, then the magic
TRAILER_BYTES = 5
_NO_COMPRESSION = 0
_SNAPPY = 1
_MASK_DELTA = 0xA282EAD8


def crc32c(data, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of any buffer, hardware-accelerated; ``value`` continues a running one."""
    return _crc32c.crc32c(data, value)


def unmask_crc(masked: int) -> int:
    """The CRC-32C that TensorFlow's ``crc32c::Mask`` stored (rotated and offset, so a CRC of
    data that holds CRCs does not degenerate)."""
    rotated = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rotated >> 17) | (rotated << 15)) & 0xFFFFFFFF


def read_varint(data: bytes, pos: int, end: int, bits: int, *, path: str, what: str,
                key: str | None = None) -> tuple[int, int]:
    """``(value, next position)`` of a little-endian base-128 varint of at most ``bits`` bits.

    A varint that runs past ``end``, takes more bytes than ``bits`` allow, or overflows them
    is a :class:`FormatError` naming ``path`` (and ``key``), its message saying which part of the
    file (``what``) held it: a C reader would silently wrap or read on.
    """
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise FormatError(f"{what}: a varint runs past the end of its block", path=path, key=key)
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if shift >= bits:
            raise FormatError(f"{what}: a varint is longer than {bits} bits allow", path=path, key=key)
    if result >> bits:
        raise FormatError(f"{what}: a varint overflows {bits} bits", path=path, key=key)
    return result, pos


def _handle(data: bytes, pos: int, end: int, path: str, what: str) -> tuple[tuple[int, int], int]:
    offset, pos = read_varint(data, pos, end, 64, path=path, what=what)
    size, pos = read_varint(data, pos, end, 64, path=path, what=what)
    return (offset, size), pos


class Table:
    """The entries of one SSTable held in memory (an index is small: about 100 bytes a tensor)."""

    def __init__(self, data: bytes, path: str):
        self._data = data
        self.path = path
        if len(data) < FOOTER_BYTES:
            raise FormatError(f"not a TensorFlow checkpoint index ({len(data)} bytes, shorter than a table footer)",
                              path=path)
        footer = len(data) - FOOTER_BYTES
        (magic,) = struct.unpack_from("<Q", data, len(data) - 8)
        if magic != TABLE_MAGIC:
            raise FormatError("not a TensorFlow checkpoint index (bad table magic number)", path=path)
        metaindex, pos = _handle(data, footer, len(data) - 8, path, "table footer")
        self._index, _ = _handle(data, pos, len(data) - 8, path, "table footer")
        self._check_handle(metaindex, footer, "metaindex block")
        self._check_handle(self._index, footer, "index block")
        self._end = footer
        self._key_budget = SSTABLE_KEY_BYTES_PER_BYTE * len(data) + SSTABLE_KEY_BYTES_SLACK

    def _check_handle(self, handle: tuple[int, int], limit: int, what: str) -> None:
        offset, size = handle
        if offset + size + TRAILER_BYTES > limit:
            raise FormatError(f"the {what} (bytes {offset}..{offset + size}) lies outside the {limit}-byte table",
                              path=self.path)

    def _block(self, handle: tuple[int, int], what: str) -> tuple[int, int]:
        """The checked bounds of a block's contents; its trailer's type and CRC verified."""
        offset, size = handle
        kind = self._data[offset + size]
        (stored,) = struct.unpack_from("<I", self._data, offset + size + 1)
        if kind == _SNAPPY:
            raise FormatError(f"the {what} is snappy-compressed, which TensorFlow never writes "
                              "and weightstore does not read", path=self.path)
        if kind != _NO_COMPRESSION:
            raise FormatError(f"the {what} has unknown compression type {kind}", path=self.path)
        actual = crc32c(memoryview(self._data)[offset : offset + size + 1])
        if actual != unmask_crc(stored):
            raise FormatError(f"the {what} at byte {offset} fails its CRC-32C check (corrupt index)",
                              path=self.path)
        return offset, offset + size

    def _entries(self, start: int, end: int, what: str) -> Iterator[tuple[bytes, bytes]]:
        """Key/value pairs of one block, keys rebuilt from their shared prefixes."""
        data = self._data
        if end - start < 4:
            raise FormatError(f"the {what} is too short to hold its restart count", path=self.path)
        (restarts,) = struct.unpack_from("<I", data, end - 4)
        if restarts * 4 > end - start - 4:
            raise FormatError(f"the {what} declares {restarts} restart points, more than it can hold", path=self.path)
        limit = end - 4 - 4 * restarts
        pos = start
        key = b""
        while pos < limit:
            shared, pos = read_varint(data, pos, limit, 32, path=self.path, what=what)
            unshared, pos = read_varint(data, pos, limit, 32, path=self.path, what=what)
            value_size, pos = read_varint(data, pos, limit, 32, path=self.path, what=what)
            if shared > len(key) or pos + unshared + value_size > limit:
                raise FormatError(f"{what}: an entry at byte {pos} reaches outside its block", path=self.path)
            self._key_budget -= shared + unshared
            if self._key_budget < 0:
                raise UnsafeFileError(f"{what}: its keys, rebuilt from their shared prefixes, would take more than "
                                      f"{SSTABLE_KEY_BYTES_PER_BYTE} times the table's {len(data)} bytes", path=self.path)
            key = key[:shared] + data[pos : pos + unshared]
            pos += unshared
            yield key, data[pos : pos + value_size]
            pos += value_size

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """Every entry in key order; blocks must follow one another without overlapping."""
        index_start, index_end = self._block(self._index, "index block")
        previous_key: bytes | None = None
        block_floor = 0
        for _, value in self._entries(index_start, index_end, "index block"):
            handle, used = _handle(value, 0, len(value), self.path, "index block")
            if used != len(value):
                raise FormatError("index block entry holds bytes after its block handle", path=self.path)
            self._check_handle(handle, self._end, "data block")
            if handle[0] < block_floor or handle[0] + handle[1] + TRAILER_BYTES > index_start and handle[0] < index_end:
                raise FormatError(f"data block at byte {handle[0]} overlaps another block", path=self.path)
            block_floor = handle[0] + handle[1] + TRAILER_BYTES
            start, end = self._block(handle, f"data block at byte {handle[0]}")
            for key, item in self._entries(start, end, f"data block at byte {handle[0]}"):
                if previous_key is not None and key <= previous_key:
                    what = "twice" if key == previous_key else "out of order"
                    raise FormatError(f"entry {_shown(key)} appears {what}", path=self.path)
                previous_key = key
                yield key, item


def _shown(key: bytes) -> str:
    try:
        return repr(key.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(key)
