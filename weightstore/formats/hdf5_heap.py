"""Bounds on a variable-length string attribute, checked in the file's own bytes before HDF5 reads it.

A variable-length string attribute holds only a reference: a length, the address of a global
heap collection and an object index. HDF5 allocates whatever length the reference claims
(one 30 KB file made it allocate 4 GB) and walks the collection's objects by their declared
sizes, looping forever on a free-space object of size zero. HDF5 offers no call that
reads the reference without following it, so this module finds it itself: the root object
header's messages (versions 1 and 2, following continuation blocks a bounded number of
times), the attribute message, then the heap collection, walked exactly as HDF5 walks it
but refusing any object that does not lie inside it. Only when the referenced object's size
equals the claimed length, and both lie in the file, may HDF5 read it.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator

from weightstore.errors import FormatError, UnsafeFileError

#: read ``length`` bytes at ``offset`` of the file, or fewer at its end
ReadAt = Callable[[int, int], bytes]

_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_CONTINUATION, _ATTRIBUTE, _ATTRIBUTE_INFO = 0x10, 0x0C, 0x15
_VLEN_CLASS, _VLEN_STRING = 9, 1
_OBJECT_HEADER = 16  # a heap object's index, reference count, reserved bytes and size
_MAX_BLOCKS = 64  # object header chunks followed before giving up
_MAX_HEADER_BYTES = 16 << 20


def check_vlen_attribute(read_at: ReadAt, file_size: int, base: int, header: int, name: str, limit: int,
                         where: str) -> None:
    """Refuse, before HDF5 follows it, a string attribute whose reference lies about its heap object.

    ``base`` is where the superblock lies (after any user block), ``header`` the object header's
    address relative to it. Attributes that are not variable-length strings are left alone.
    """
    reader = _Bytes(read_at, file_size, where)
    superblock = reader.read(base, 16)
    if not superblock.startswith(_SIGNATURE):
        raise FormatError(f"{where}: no HDF5 superblock at byte {base}")
    sizes = superblock[13:15] if superblock[8] in (0, 1) else superblock[9:11]
    if tuple(sizes) != (8, 8):
        raise UnsafeFileError(f"{where}: HDF5 addresses of {sizes[0]} bytes; manifests are read from 8-byte ones only")
    found = _attribute(reader, base, header, name.encode("utf-8"))
    if found is None:
        return
    datatype, data = found
    if len(datatype) < 8 or datatype[0] & 0x0F != _VLEN_CLASS or datatype[1] & 0x0F != _VLEN_STRING:
        return
    if len(data) < 16:
        raise FormatError(f"{where}: attribute {name!r} is truncated")
    length, heap, index = struct.unpack_from("<IQI", data)
    if length > limit:
        raise UnsafeFileError(f"{where}: {name!r} attribute (manifest) is too large ({length} bytes, limit {limit})")
    stored = _heap_object(reader, base + heap, index, limit)
    if stored != length:
        raise FormatError(f"{where}: attribute {name!r} claims {length} bytes but its heap object holds {stored}")


class _Bytes:
    def __init__(self, read_at: ReadAt, size: int, where: str):
        self._read_at, self.size, self.where = read_at, size, where
        self._budget = _MAX_HEADER_BYTES

    def read(self, offset: int, length: int, *, budgeted: bool = True) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise FormatError(f"{self.where}: HDF5 structure points outside the file ({offset}..{offset + length})")
        self._budget -= length if budgeted else 0
        if self._budget < 0:
            raise UnsafeFileError(f"{self.where}: HDF5 object header is larger than {_MAX_HEADER_BYTES} bytes")
        data = self._read_at(offset, length)
        if len(data) != length:
            raise FormatError(f"{self.where}: short read at byte {offset}")
        return data


def _attribute(reader: _Bytes, base: int, header: int, name: bytes) -> tuple[bytes, bytes] | None:
    """``(datatype, data)`` of the compact attribute ``name``; None when the header has no such attribute."""
    dense = False
    for kind, body in _messages(reader, base, header):
        if kind == _ATTRIBUTE_INFO:
            dense = True
        elif kind == _ATTRIBUTE:
            parsed = _parse_attribute(body, reader.where)
            if parsed[0] == name:
                return parsed[1], parsed[2]
    if dense:
        raise UnsafeFileError(f"{reader.where}: attributes in dense storage; manifests are read from compact ones only")
    return None


def _parse_attribute(body: bytes, where: str) -> tuple[bytes, bytes, bytes]:
    """``(name, datatype, data)`` of an attribute message (versions 1 to 3)."""
    if len(body) < 8:
        raise FormatError(f"{where}: attribute message is truncated")
    version, flags, name_size, type_size, space_size = struct.unpack_from("<BBHHH", body)
    if version not in (1, 2, 3):
        raise FormatError(f"{where}: attribute message version {version} is unknown")
    position = 9 if version == 3 else 8
    pad = (lambda n: n + (-n % 8)) if version == 1 else (lambda n: n)
    name = body[position : position + name_size].rstrip(b"\0")
    position += pad(name_size)
    datatype = body[position : position + type_size]
    position += pad(type_size) + pad(space_size)
    if position > len(body):
        raise FormatError(f"{where}: attribute message is truncated")
    if flags & 0x03:  # a shared datatype or dataspace is a reference, not the thing itself
        datatype = b""
    return name, datatype, body[position:]


def _messages(reader: _Bytes, base: int, header: int) -> Iterator[tuple[int, bytes]]:
    """``(type, body)`` of every message of an object header, following continuation blocks."""
    prefix = reader.read(base + header, 16)
    if prefix[:4] == b"OHDR":
        yield from _messages_v2(reader, base, header)
        return
    if prefix[0] != 1:
        raise FormatError(f"{reader.where}: object header version {prefix[0]} is unknown")
    blocks = [(base + header + 16, struct.unpack_from("<I", prefix, 8)[0])]
    for _ in range(_MAX_BLOCKS):
        if not blocks:
            return
        offset, length = blocks.pop(0)
        block = reader.read(offset, length)
        position = 0
        while position + 8 <= len(block):
            kind, size = struct.unpack_from("<HH", block, position)
            body = block[position + 8 : position + 8 + size]
            if len(body) != size:
                raise FormatError(f"{reader.where}: object header message overruns its block")
            if kind == _CONTINUATION:
                blocks.append(_continuation(body, base, reader.where))
            yield kind, body
            position += 8 + size
    raise UnsafeFileError(f"{reader.where}: object header has more than {_MAX_BLOCKS} continuation blocks")


def _messages_v2(reader: _Bytes, base: int, header: int) -> Iterator[tuple[int, bytes]]:
    head = reader.read(base + header, 6)
    flags = head[5]
    position = 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
    width = 1 << (flags & 0x03)
    chunk_size = int.from_bytes(reader.read(base + header + position, width), "little")
    blocks = [(base + header + position + width, chunk_size)]
    message_header = 6 if flags & 0x04 else 4
    for _ in range(_MAX_BLOCKS):
        if not blocks:
            return
        offset, length = blocks.pop(0)
        block = reader.read(offset, length)
        position = 0
        while position + message_header <= len(block):
            kind, size = struct.unpack_from("<BH", block, position)
            body = block[position + message_header : position + message_header + size]
            if len(body) != size:
                raise FormatError(f"{reader.where}: object header message overruns its block")
            if kind == _CONTINUATION:
                start, span = _continuation(body, base, reader.where)
                if span < 8:
                    raise FormatError(f"{reader.where}: object header continuation block is too small")
                blocks.append((start + 4, span - 8))  # "OCHK" ... checksum
            yield kind, body
            position += message_header + size
    raise UnsafeFileError(f"{reader.where}: object header has more than {_MAX_BLOCKS} continuation blocks")


def _continuation(body: bytes, base: int, where: str) -> tuple[int, int]:
    if len(body) < 16:
        raise FormatError(f"{where}: object header continuation message is truncated")
    offset, length = struct.unpack_from("<QQ", body)
    return base + offset, length


def _heap_object(reader: _Bytes, collection: int, index: int, limit: int) -> int | None:
    """The size of object ``index`` in the global heap collection at ``collection``, walking
    every object as HDF5 will and refusing any that does not lie inside the collection."""
    head = reader.read(collection, 16)
    if head[:4] != b"GCOL":
        raise FormatError(f"{reader.where}: no global heap collection at byte {collection}")
    size = struct.unpack_from("<Q", head, 8)[0]
    if size < 16:
        raise FormatError(f"{reader.where}: global heap collection at byte {collection} is too small")
    if size > limit + (1 << 20):
        raise UnsafeFileError(f"{reader.where}: global heap collection of {size} bytes (limit {limit})")
    data = reader.read(collection, size, budgeted=False)
    found = None
    position = 16
    while position + _OBJECT_HEADER <= size:
        number, _, length = struct.unpack_from("<HH4xQ", data, position)
        step = _OBJECT_HEADER + length + (-length % 8) if number else length
        if step <= 0 or position + step > size:
            raise FormatError(f"{reader.where}: global heap object {number} at byte {collection + position} "
                              "does not lie inside its collection")
        if number and number == index:
            found = length
        position += step
    return found
