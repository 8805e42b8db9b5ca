"""HDF5 structures HDF5 itself follows blindly, checked in the file's own bytes before it reads them.

:func:`check_object`: an object header, and a group's symbol table (local heap free list,
B-tree), where a cycle made HDF5 loop and allocate without bound. It also says what the
header makes the object (group or dataset, and whether a dataset's bytes lie plainly in the
file), so the reader need not ask HDF5, which walks the header again to answer.
:func:`check_vlen_attribute`: a variable-length string attribute (the manifest), described below.

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
from typing import NamedTuple

from weightstore.core.limits import HDF5_HEAP_SLACK_BYTES, MAX_HDF5_HEADER_BLOCKS, MAX_HDF5_HEADER_BYTES
from weightstore.errors import FormatError, UnsafeFileError

#: read ``length`` bytes at ``offset`` of the file, or fewer at its end
ReadAt = Callable[[int, int], bytes]

_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_CONTINUATION, _ATTRIBUTE = 0x10, 0x0C
_VLEN_CLASS, _VLEN_STRING = 9, 1
_OBJECT_HEADER = 16  # a heap object's index, reference count, reserved bytes and size
_V1_MESSAGE = struct.Struct("<HH")  # a version-1 header message's type and size (then flags, reserved)


def check_vlen_attribute(read_at: ReadAt, file_size: int, base: int, name: str, limit: int) -> None:
    """Refuse, before HDF5 reads it, a root-group string attribute whose reference lies about its heap object.

    ``base`` is where the superblock lies (after any user block). The root group's object
    header is found from the superblock, not from HDF5, which walks the whole header (and can
    loop on a damaged one) to describe it. Attributes that are not variable-length strings,
    and a root group without the attribute, are left to HDF5. Refusals name no file: the
    reader names it (:func:`~weightstore.errors.naming`), as for the checks below.
    """
    reader = _Bytes(read_at, file_size)
    root = _root_header(reader, base)
    found = None if root is None else _attribute(reader, base, root, name.encode("utf-8"))
    if found is None:
        return
    datatype, data = found
    if len(datatype) < 8 or datatype[0] & 0x0F != _VLEN_CLASS or datatype[1] & 0x0F != _VLEN_STRING:
        return
    if len(data) < 16:
        raise FormatError(f"attribute {name!r} is truncated")
    length, heap, index = struct.unpack_from("<IQI", data)
    if length > limit:
        raise UnsafeFileError(f"{name!r} attribute (manifest) is too large ({length} bytes, limit {limit})")
    stored = _heap_object(reader, base + heap, index, limit)
    if stored != length:
        raise FormatError(f"attribute {name!r} claims {length} bytes but its heap object holds {stored}")


#: bytes read at once by :func:`read_ahead`: the headers of about 50 datasets of 1 KB
READ_AHEAD_WINDOW = 64 << 10


def read_ahead(read_at: ReadAt, window: int = READ_AHEAD_WINDOW) -> ReadAt:
    """``read_at`` that reads ``window`` bytes at a time and serves the small reads that
    follow from them.

    A file's object headers, heaps and tree nodes lie near each other, mostly in increasing
    order, and checking 50,000 of them read each with two or three reads of a few hundred
    bytes (a third of the time to open the file); reads longer than ``window`` pass through.
    """
    start, cached = 0, b""

    def read(offset: int, length: int) -> bytes:
        nonlocal start, cached
        if length > window:
            return read_at(offset, length)
        if not (start <= offset and offset + length <= start + len(cached)):
            start, cached = offset, read_at(offset, window)
        return cached[offset - start : offset - start + length]

    return read


class _Bytes:
    def __init__(self, read_at: ReadAt, size: int):
        self._read_at, self.size = read_at, size
        self._budget = MAX_HDF5_HEADER_BYTES

    def read(self, offset: int, length: int, *, budgeted: bool = True) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise FormatError(f"HDF5 structure points outside the file ({offset}..{offset + length})")
        self._budget -= length if budgeted else 0
        if self._budget < 0:
            raise UnsafeFileError(f"HDF5 object header is larger than {MAX_HDF5_HEADER_BYTES} bytes")
        data = self._read_at(offset, length)
        if len(data) != length:
            raise FormatError(f"short read at byte {offset}")
        return data


def _attribute(reader: _Bytes, base: int, header: int, name: bytes) -> tuple[bytes, bytes] | None:
    """``(datatype, data)`` of the compact attribute ``name``; None when the header has no such attribute."""
    for kind, body in _messages(reader, base, header):
        if kind == _ATTRIBUTE:
            parsed = _parse_attribute(body)
            if parsed[0] == name:
                return parsed[1], parsed[2]
    return None  # absent, or in dense storage (never written by weightstore): left to HDF5


def _parse_attribute(body: bytes) -> tuple[bytes, bytes, bytes]:
    """``(name, datatype, data)`` of an attribute message (versions 1 to 3)."""
    if len(body) < 8:
        raise FormatError("attribute message is truncated")
    version, flags, name_size, type_size, space_size = struct.unpack_from("<BBHHH", body)
    if version not in (1, 2, 3):
        raise FormatError(f"attribute message version {version} is unknown")
    position = 9 if version == 3 else 8
    pad = (lambda n: n + (-n % 8)) if version == 1 else (lambda n: n)
    name = body[position : position + name_size].rstrip(b"\0")
    position += pad(name_size)
    datatype = body[position : position + type_size]
    position += pad(type_size) + pad(space_size)
    if position > len(body):
        raise FormatError("attribute message is truncated")
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
        raise FormatError(f"object header version {prefix[0]} is unknown")
    blocks = [(base + header + 16, struct.unpack_from("<I", prefix, 8)[0])]
    for _ in range(MAX_HDF5_HEADER_BLOCKS):
        if not blocks:
            return
        offset, length = blocks.pop(0)
        block = reader.read(offset, length)
        position, end = 0, len(block)
        while position + 8 <= end:
            kind, size = _V1_MESSAGE.unpack_from(block, position)
            position += 8
            if position + size > end:
                raise FormatError("object header message overruns its block")
            body = block[position : position + size]
            if kind == _CONTINUATION:
                blocks.append(_continuation(body, base))
            yield kind, body
            position += size
    raise UnsafeFileError(f"object header has more than {MAX_HDF5_HEADER_BLOCKS} continuation blocks")


def _messages_v2(reader: _Bytes, base: int, header: int) -> Iterator[tuple[int, bytes]]:
    head = reader.read(base + header, 6)
    flags = head[5]
    position = 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
    width = 1 << (flags & 0x03)
    chunk_size = int.from_bytes(reader.read(base + header + position, width), "little")
    blocks = [(base + header + position + width, chunk_size)]
    message_header = 6 if flags & 0x04 else 4
    for _ in range(MAX_HDF5_HEADER_BLOCKS):
        if not blocks:
            return
        offset, length = blocks.pop(0)
        block = reader.read(offset, length)
        position = 0
        while position + message_header <= len(block):
            kind, size = struct.unpack_from("<BH", block, position)
            body = block[position + message_header : position + message_header + size]
            if len(body) != size:
                raise FormatError("object header message overruns its block")
            if kind == _CONTINUATION:
                start, span = _continuation(body, base)
                if span < 8:
                    raise FormatError("object header continuation block is too small")
                blocks.append((start + 4, span - 8))  # "OCHK" ... checksum
            yield kind, body
            position += message_header + size
    raise UnsafeFileError(f"object header has more than {MAX_HDF5_HEADER_BLOCKS} continuation blocks")


def _continuation(body: bytes, base: int) -> tuple[int, int]:
    if len(body) < 16:
        raise FormatError("object header continuation message is truncated")
    offset, length = struct.unpack_from("<QQ", body)
    return base + offset, length


def _heap_object(reader: _Bytes, collection: int, index: int, limit: int) -> int | None:
    """The size of object ``index`` in the global heap collection at ``collection``, walking
    every object as HDF5 will and refusing any that does not lie inside the collection."""
    head = reader.read(collection, 16)
    if head[:4] != b"GCOL":
        raise FormatError(f"no global heap collection at byte {collection}")
    size = struct.unpack_from("<Q", head, 8)[0]
    if size < 16:
        raise FormatError(f"global heap collection at byte {collection} is too small")
    if size > limit + HDF5_HEAP_SLACK_BYTES:
        raise UnsafeFileError(f"global heap collection of {size} bytes (limit {limit})")
    data = reader.read(collection, size, budgeted=False)
    found = None
    position = 16
    while position + _OBJECT_HEADER <= size:
        number, _, length = struct.unpack_from("<HH4xQ", data, position)
        step = _OBJECT_HEADER + length + (-length % 8) if number else length
        if step <= 0 or position + step > size:
            raise FormatError(f"global heap object {number} at byte {collection + position} "
                              "does not lie inside its collection")
        if number and number == index:
            found = length
        position += step
    return found


_DATASPACE, _LINK_INFO, _DATATYPE, _EXTERNAL_FILES, _LAYOUT = 0x01, 0x02, 0x03, 0x07, 0x08
_FILTERS, _SYMBOL_TABLE = 0x0B, 0x11
_COMPACT, _CONTIGUOUS = 0, 1
_UNDEFINED = (1 << 64) - 1


class ObjectHeader(NamedTuple):
    """What an object is, by the messages of its header, classified as HDF5 classifies it
    (``H5O__obj_class_real``: a symbol table or link info makes a group; else a datatype and a
    dataspace make a dataset)."""

    is_group: bool
    is_dataset: bool
    #: a dataset whose bytes lie in this file as they are: one contiguous or compact layout, and
    #: neither a filter pipeline nor an external file list
    stored_plain: bool
    #: ``(file offset, length)`` of a contiguous dataset's bytes as its layout message states them
    #: (versions 3 and 4, what HDF5 has written since 1.6.3), unchecked: only for reading ahead. None
    #: for any other layout, an older message, or storage not yet allocated.
    extent: tuple[int, int] | None = None


def check_root_group(read_at: ReadAt, file_size: int, base: int) -> None:
    """:func:`check_object` for the root group, whose header is found from the superblock; files
    with addresses of other than 8 bytes (never written by weightstore or h5py's defaults) are
    left to HDF5."""
    reader = _Bytes(read_at, file_size)
    header = _root_header(reader, base)
    if header is not None:
        _check_header(reader, base, header)


def check_object(read_at: ReadAt, file_size: int, base: int, header: int) -> ObjectHeader:
    """Refuse an object whose header, or whose group symbol table, HDF5 would loop over, before
    HDF5 opens or lists it, and say what the object is.

    Every object header's messages are walked, a bounded number of blocks. A version-1 group
    (what weightstore and most tools write) keeps its links in a B-tree of symbol nodes whose
    names live in a local heap. HDF5 follows the heap's free list and the tree's child pointers
    without noticing a cycle: one damaged byte made it loop, allocating until the machine ran
    out of memory. Both are walked here first, each block seen once, each inside the file.
    ``header`` is the object header's address.
    """
    return _check_header(_Bytes(read_at, file_size), base, header)


def _check_header(reader: _Bytes, base: int, header: int) -> ObjectHeader:
    kinds: set[int] = set()
    layouts: list[int] = []
    extent = None
    for kind, body in _messages(reader, base, header):
        kinds.add(kind)
        if kind == _LAYOUT and len(body) >= 3:
            layouts.append(body[2] if body[0] < 3 else body[1])  # versions 1 and 2 keep the class third
            if body[0] in (3, 4) and body[1] == _CONTIGUOUS and len(body) >= 18:
                address, length = struct.unpack_from("<QQ", body, 2)
                extent = (base + address, length) if address != _UNDEFINED else None
        elif kind == _SYMBOL_TABLE:
            if len(body) < 16:
                raise FormatError("symbol table message is truncated")
            tree, heap = struct.unpack_from("<QQ", body)
            heap_size = _check_local_heap(reader, base + heap)
            _check_tree(reader, base, tree, heap_size)
    is_group = _SYMBOL_TABLE in kinds or _LINK_INFO in kinds
    is_dataset = not is_group and _DATATYPE in kinds and _DATASPACE in kinds
    plain = (is_dataset and len(layouts) == 1 and layouts[0] in (_COMPACT, _CONTIGUOUS)
             and _FILTERS not in kinds and _EXTERNAL_FILES not in kinds)
    return ObjectHeader(is_group, is_dataset, plain, extent if plain else None)


def _root_header(reader: _Bytes, base: int) -> int | None:
    """The root group's object header address: in the root symbol table entry (superblock
    versions 0 and 1) or a field of its own (versions 2 and 3). None for files with addresses
    of other than 8 bytes (never written by weightstore or h5py's defaults): left to HDF5."""
    superblock = reader.read(base, 72)
    if not superblock.startswith(_SIGNATURE):
        raise FormatError(f"no HDF5 superblock at byte {base}")
    version = superblock[8]
    sizes = superblock[13:15] if version in (0, 1) else superblock[9:11]
    if tuple(sizes) != (8, 8):
        return None
    return struct.unpack_from("<Q", superblock, {0: 64, 1: 68}.get(version, 36))[0]


def _check_local_heap(reader: _Bytes, address: int) -> int:
    """The data size of the local heap at ``address``, once its free list is known to end."""
    head = reader.read(address, 32)
    if head[:4] != b"HEAP":
        raise FormatError(f"no local heap at byte {address}")
    size, free, data = struct.unpack_from("<QQQ", head, 8)
    if data + size > reader.size:
        raise FormatError(f"local heap at byte {address} lies outside the file")
    seen: set[int] = set()
    while free not in (_UNDEFINED, 1):  # HDF5 writes either for "no free block"
        if free in seen or free + 16 > size:
            raise FormatError(f"local heap at byte {address} has a free list that loops or "
                              "leaves the heap")
        seen.add(free)
        free, length = struct.unpack_from("<QQ", reader.read(data + free, 16))
        if length < 16:
            raise FormatError(f"local heap at byte {address} has a free block of {length} bytes")
    return size


def _check_tree(reader: _Bytes, base: int, root: int, heap_size: int) -> None:
    """Every node of a group's B-tree visited once, one level down each step, inside the file."""
    seen: set[int] = set()
    pending: list[tuple[int, int | None]] = [(root, None)]
    while pending:
        address, level_above = pending.pop()
        if address in seen:
            raise FormatError(f"group B-tree node at byte {base + address} is reached twice")
        seen.add(address)
        head = reader.read(base + address, 24, budgeted=False)
        if head[:4] != b"TREE" or head[4] != 0:
            raise FormatError(f"no group B-tree node at byte {base + address}")
        level, entries = head[5], struct.unpack_from("<H", head, 6)[0]
        if level_above is not None and level != level_above - 1:
            raise FormatError(f"group B-tree node at byte {base + address} is at the wrong level")
        body = reader.read(base + address + 24, 8 + 16 * entries, budgeted=False)
        children = [struct.unpack_from("<Q", body, 8 + 16 * i)[0] for i in range(entries)]
        if level:
            pending.extend((child, level) for child in children)
        else:
            for child in children:
                _check_symbols(reader, base + child, heap_size)


def _check_symbols(reader: _Bytes, address: int, heap_size: int) -> None:
    head = reader.read(address, 8, budgeted=False)
    if head[:4] != b"SNOD":
        raise FormatError(f"no symbol table node at byte {address}")
    count = struct.unpack_from("<H", head, 6)[0]
    entries = reader.read(address + 8, 40 * count, budgeted=False)
    for i in range(count):
        if struct.unpack_from("<Q", entries, 40 * i)[0] >= heap_size:
            raise FormatError(f"symbol table node at byte {address} names a link outside its heap")
