"""A zip file's central directory, read as hostile input and held as columns.

An npz of 50,000 small tensors has a directory of 50,000 entries: parsed one entry at a time
in Python that alone costs more than safetensors takes to open the same weights. So the
entries are located in one light loop (each entry's length decides where the next begins),
then their fixed fields are gathered into one numpy record array and every rule is checked
on whole columns; only names are made one by one. Members become :class:`Member` records
when a reader asks for one.

The stdlib's ``zipfile`` is not used: on this Python it accepts overlapping members (zip
bombs) and would let a hostile file choose our allocations.
"""

from __future__ import annotations

import functools
import operator
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np

from weightstore.core.limits import DEFLATE_SLACK_BYTES, MAX_DEFLATE_RATIO, MAX_ZIP_MEMBER_BYTES
from weightstore.errors import FormatError, UnsafeFileError

EOCD = struct.Struct("<4s4H2IH")
EOCD64 = struct.Struct("<4sQ2H2I4Q")
LOCATOR64 = struct.Struct("<4sIQI")
LOCAL = struct.Struct("<4s5H3I2H")
CENTRAL_SIZE = 46
#: one entry's fixed part as ``struct`` reads it (:data:`CENTRAL_RECORD`'s fields): for one
#: entry, a tenth of numpy's cost
_CENTRAL = struct.Struct("<4s6H3I5HII")
LOCAL_SIG, CENTRAL_SIG = b"PK\x03\x04", b"PK\x01\x02"
EOCD_SIG, EOCD64_SIG, LOCATOR64_SIG = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"
STORED, DEFLATED = 0, 8
UTF8_FLAG, ENCRYPTED_FLAG = 0x800, 0x1
ZIP64_LIMIT = 0xFFFFFFFF

#: one central directory entry's fixed part, as numpy reads it from the directory's bytes
CENTRAL_RECORD = np.dtype([
    ("sig", "S4"), ("made_by", "<u2"), ("needed", "<u2"), ("flags", "<u2"), ("method", "<u2"),
    ("time", "<u2"), ("date", "<u2"), ("crc", "<u4"), ("compressed", "<u4"), ("size", "<u4"),
    ("name_len", "<u2"), ("extra_len", "<u2"), ("comment_len", "<u2"), ("disk", "<u2"),
    ("internal", "<u2"), ("external", "<u4"), ("offset", "<u4"),
])
#: a member's local header, as numpy reads many of them from the file at once
LOCAL_RECORD = np.dtype([
    ("sig", "S4"), ("needed", "<u2"), ("flags", "<u2"), ("method", "<u2"), ("time", "<u2"), ("date", "<u2"),
    ("crc", "<u4"), ("compressed", "<u4"), ("size", "<u4"), ("name_len", "<u2"), ("extra_len", "<u2"),
])
#: :meth:`Directory.column` name -> the column it is
_COLUMN_OF = {"offsets": "offset", "sizes": "size", "limits": "limit", "methods": "method"}
_LENGTHS = struct.Struct("<3H")  # name, extra and comment lengths, 28 bytes into an entry
#: what an unsafe name holds, in names joined by NUL (substring searches: a regex starting
#: with an alternation is tried at every position, 90 ms for 50,000 names)
_UNSAFE_IN_JOINED = ("\\", "\0/", "../", "..\0")


class Member(NamedTuple):
    name: str
    offset: int
    crc: int
    compressed: int
    size: int
    method: int
    limit: int  # where the next member (or the central directory) begins
    raw_name: bytes


class Directory:
    """The members of a zip, by name, in directory order; checked in full when built.

    Columns come as lists, tuples or arrays; a :class:`Member` (made only for the names a
    reader asks about) takes its values from sequences (a Python int from a list is cheaper
    than one from an array), checks on many members from arrays (:meth:`column`). The names'
    bytes are one string end to end.
    """

    def __init__(self, names: list[str] | Callable[[], list[str]], name_blob: bytes, name_lens: list[int] | np.ndarray,
                 columns: dict[str, list[int]] | dict[str, tuple[int, ...]] | dict[str, np.ndarray]):
        self._names = names
        self._name_blob = name_blob
        self._name_lens = name_lens
        self._arrays: dict[str, np.ndarray] = {}
        self._columns = columns

    @functools.cached_property
    def names(self) -> list[str]:
        """Member names in directory order (made on first use when given as a function)."""
        return self._names if isinstance(self._names, list) else self._names()

    @functools.cached_property
    def _lists(self) -> dict[str, Sequence[int]]:
        return {field: values if isinstance(values, (list, tuple)) else values.tolist()
                for field, values in self._columns.items()}

    @functools.cached_property
    def index(self) -> dict[str, int]:
        """Name -> position; made on first use (a reader that knows positions never asks)."""
        return dict(zip(self.names, range(len(self.names)), strict=True))

    @functools.cached_property
    def _name_ends(self) -> list[int]:
        """Where each name ends in the names' bytes (made on first use: listing keys needs none)."""
        return self.column("name_ends").tolist()

    def raw_name(self, i: int) -> bytes:
        return self._name_blob[self._name_ends[i - 1] if i else 0 : self._name_ends[i]]

    def raw_names_of(self, positions: np.ndarray) -> np.ndarray:
        """The names at ``positions``, their bytes end to end (uint8)."""
        blob = np.frombuffer(self._name_blob, np.uint8)
        if len(positions) == len(self.names) and np.array_equal(positions, np.arange(len(positions))):
            return blob
        lengths = self.column("name_lens")[positions]
        return spans(blob, self.column("name_ends")[positions] - lengths, lengths)

    def column(self, name: str) -> np.ndarray:
        """``offsets``, ``sizes``, ``limits``, ``methods``, ``name_lens`` or ``name_ends`` as an int64
        array, for checks on many members at once (made on first use)."""
        array = self._arrays.get(name)
        if array is None:
            if name == "name_ends":
                array = self._arrays[name] = np.cumsum(self.column("name_lens"), dtype=np.int64)
                return array
            values = self._name_lens if name == "name_lens" else self._columns[_COLUMN_OF[name]]
            array = self._arrays[name] = np.asarray(values, dtype=np.int64)
        return array

    def __len__(self) -> int:
        return len(self.index)

    def __iter__(self) -> Iterator[str]:
        return iter(self.index)

    def __contains__(self, name: object) -> bool:
        return name in self.index

    def __getitem__(self, name: str) -> Member:
        return self.member(self.index[name])

    def member(self, i: int) -> Member:
        lists = self._lists
        return Member(self.names[i], lists["offset"][i], lists["crc"][i], lists["compressed"][i], lists["size"][i],
                      lists["method"][i], lists["limit"][i], self.raw_name(i))

    def pop(self, name: str) -> Member | None:
        """Take one member out of the listing (the manifest: it is no tensor)."""
        if name not in self.index:
            return None
        member = self[name]
        del self.index[name]
        return member


def locate(tail: bytes, tail_start: int) -> tuple[int, int, int, int]:
    """``(entries, directory size, directory offset, end record offset)`` from the file's last
    bytes, the end record found where ``zipfile`` (so ``np.load``) finds it: the last 22 bytes
    if they are one without a comment, else the last signature. That one's comment must end
    the file; passing over it to an earlier record would read another directory than numpy's.
    Values a ZIP64 record gives are for :func:`locate_zip64` to read."""
    position = len(tail) - EOCD.size
    if position < 0 or tail[position : position + 4] != EOCD_SIG or tail[-2:] != b"\0\0":
        position = tail.rfind(EOCD_SIG)
    if position < 0 or position + EOCD.size > len(tail):
        raise FormatError("not an npz file (no zip directory; truncated or not a zip)")
    _, disk, cd_disk, disk_count, count, cd_size, cd_offset, comment = EOCD.unpack_from(tail, position)
    if position + EOCD.size + comment != len(tail):
        raise FormatError("zip end record's comment does not end the file (another end record in it?)")
    if disk or cd_disk:
        raise FormatError("multi-disk zip archives are not supported")
    if disk_count != count:
        raise FormatError(f"zip end record disagrees with itself ({disk_count}, {count} entries)")
    return count, cd_size, cd_offset, tail_start + position


def locate_zip64(read_at: Callable[[int, int], bytes], end: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """The directory's ``(entries, size, offset, end)`` as a ZIP64 end record gives them, read
    whenever its locator lies just before the end record (as ``zipfile`` reads it, even where
    the end record needs no ZIP64 value), the record just before the locator; ``end`` (from
    :func:`locate`) where there is no locator."""
    count, cd_size, cd_offset, eocd_offset = end
    marked = count == 0xFFFF or cd_size == ZIP64_LIMIT or cd_offset == ZIP64_LIMIT
    locator = read_at(eocd_offset - LOCATOR64.size, LOCATOR64.size) if eocd_offset >= LOCATOR64.size else b""
    if locator[:4] != LOCATOR64_SIG:
        if marked:
            raise FormatError("ZIP64 locator missing")
        return end
    _, _, record, _ = LOCATOR64.unpack(locator)
    if record + EOCD64.size != eocd_offset - LOCATOR64.size:
        raise FormatError("ZIP64 locator is corrupt")
    fields = EOCD64.unpack(read_at(record, EOCD64.size))
    if fields[0] != EOCD64_SIG:
        raise FormatError("ZIP64 end record is corrupt")
    wide = fields[7], fields[8], fields[9]
    markers = (0xFFFF, ZIP64_LIMIT, ZIP64_LIMIT)  # a value the end record cannot hold; any other must agree
    if any(value not in (marker, full) for value, marker, full in zip(end[:3], markers, wide, strict=True)):
        raise FormatError(f"ZIP64 end record disagrees with the end record ({wide} against {end[:3]})")
    return (*wide, record)


def parse(directory: bytes, count: int, cd_offset: int) -> Directory:
    """Every entry of ``directory`` (``count`` of them, ending where the directory ends).

    The rule for reading a directory; :func:`parse_expected` is its fast twin for the layout
    this project writes (see there for the differential test binding them). Its errors name
    the entry, not the file: the caller names that with :func:`~weightstore.errors.naming`."""
    positions = _entry_positions(directory, count)
    records = np.frombuffer(directory, np.uint8)[
        np.asarray(positions, dtype=np.int64)[:, None] + np.arange(CENTRAL_SIZE)
    ].view(CENTRAL_RECORD)[:, 0] if count else np.zeros(0, CENTRAL_RECORD)
    bad = np.flatnonzero(records["sig"] != CENTRAL_SIG)
    if bad.size:
        raise FormatError(f"zip directory entry {bad[0]} is corrupt")
    name_lens = records["name_len"].tolist()
    raw_names = [directory[p + CENTRAL_SIZE : p + CENTRAL_SIZE + n] for p, n in zip(positions, name_lens, strict=True)]
    flags = records["flags"]
    names = _names(raw_names, flags)
    encrypted = np.flatnonzero(flags & ENCRYPTED_FLAG)
    if encrypted.size:
        raise UnsafeFileError(f"member {names[encrypted[0]]!r} is encrypted")
    methods = records["method"]
    odd = np.flatnonzero((methods != STORED) & (methods != DEFLATED))
    if odd.size:
        raise UnsafeFileError(f"member {names[odd[0]]!r} uses compression method {methods[odd[0]]}; "
                              "only stored and deflate are read")
    columns = {field: records[field].tolist() for field in ("crc", "compressed", "size", "offset", "method")}
    for i in np.flatnonzero((records["extra_len"] > 0) | (records["size"] == ZIP64_LIMIT)
                            | (records["compressed"] == ZIP64_LIMIT) | (records["offset"] == ZIP64_LIMIT)).tolist():
        start = positions[i] + CENTRAL_SIZE + name_lens[i]
        extra = directory[start : start + int(records["extra_len"][i])]
        size, compressed, offset = _apply_zip64(
            extra, columns["size"][i], columns["compressed"][i], columns["offset"][i], names[i])
        # the column checks below add these in int64: values past the file cannot be true anyway
        if offset >= cd_offset or compressed > cd_offset or size > MAX_ZIP_MEMBER_BYTES:
            raise UnsafeFileError(f"member {names[i]!r} has ZIP64 sizes or offset past the file's end")
        columns["size"][i], columns["compressed"][i], columns["offset"][i] = size, compressed, offset
    if len(set(names)) != len(names):
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise UnsafeFileError(f"member {name!r} appears twice")
            seen.add(name)
    columns["limit"] = _limits(names, name_lens, columns, cd_offset)
    return Directory(names, b"".join(raw_names), records["name_len"].astype(np.int64), columns)


def _entry_positions(directory: bytes, count: int) -> list[int]:
    """Where each entry starts: found by its signature, then proved by each entry's lengths
    leading exactly to the next (a name holding the signature's bytes spoils the guess; the
    loop below then walks entry by entry, the one sequential step)."""
    if count > 1:
        raw = np.frombuffer(directory, np.uint8)
        found = np.flatnonzero((raw[:-3] == 0x50) & (raw[1:-2] == 0x4B) & (raw[2:-1] == 1) & (raw[3:] == 2))
        if len(found) == count and found[0] == 0 and found[-1] + CENTRAL_SIZE <= len(raw):
            lengths = raw[found[:, None] + np.arange(28, 34)].view("<u2").astype(np.int64).sum(axis=1)
            following = found + CENTRAL_SIZE + lengths
            if np.array_equal(following[:-1], found[1:]) and following[-1] == len(raw):
                return found.tolist()
    positions = []
    position, end = 0, len(directory)
    lengths = _LENGTHS.unpack_from
    for _ in range(count):
        if position + CENTRAL_SIZE > end:
            raise FormatError("zip directory is truncated")
        positions.append(position)
        name, extra, comment = lengths(directory, position + 28)
        position += CENTRAL_SIZE + name + extra + comment
    if position != end:  # else a count that lies small hides members (the manifest among them)
        raise FormatError(f"zip directory holds more than the {count} entries its end record counts")
    return positions


def _names(raw_names: list[bytes], flags: np.ndarray) -> list[str]:
    """Decoded and checked names: the joined text is scanned once, each name only if it finds something."""
    try:
        if np.all(flags & UTF8_FLAG):
            names = [raw.decode("utf-8") for raw in raw_names]
        else:
            names = [raw.decode("utf-8" if flag & UTF8_FLAG else "cp437")
                     for raw, flag in zip(raw_names, flags.tolist(), strict=True)]
    except UnicodeDecodeError:
        raise FormatError("a member name is not valid UTF-8") from None
    joined = "\0".join(names)
    if (joined.count("\0") != max(len(names) - 1, 0) or joined.startswith("/") or joined.endswith("..")
            or any(unsafe in joined for unsafe in _UNSAFE_IN_JOINED)):
        for name in names:
            if _unsafe_name(name):
                raise UnsafeFileError(f"unsafe member name {name!r}")
    return names


def _unsafe_name(name: str) -> bool:
    return "\0" in name or "\\" in name or name.startswith("/") or (".." in name and ".." in name.split("/"))


def _limits(names: list[str], name_lens: list[int], columns: dict[str, list[int]], cd_offset: int) -> list[int]:
    """Where each member must end (the next member by offset, or the directory), checking that
    none overlaps the next or claims more than its bytes can hold."""
    offsets = np.asarray(columns["offset"], dtype=np.int64)
    compressed = np.asarray(columns["compressed"], dtype=np.int64)
    sizes = np.asarray(columns["size"], dtype=np.int64)
    methods = np.asarray(columns["method"])
    order = np.argsort(offsets, kind="stable")
    limits = np.empty_like(offsets)
    limits[order] = np.append(offsets[order][1:], cd_offset)
    overlapping = offsets + LOCAL.size + np.asarray(name_lens, dtype=np.int64) + compressed > limits
    # in file order, so the first member reported is the first that overlaps
    for i in order[overlapping[order]][:1].tolist():
        raise UnsafeFileError(f"member {names[i]!r} overlaps the next one (zip bomb?)")
    bombs = np.flatnonzero((methods == DEFLATED) & (sizes > compressed * MAX_DEFLATE_RATIO + DEFLATE_SLACK_BYTES))
    if bombs.size:
        raise UnsafeFileError(f"member {names[bombs[0]]!r} claims an impossible compression ratio")
    inconsistent = np.flatnonzero((methods == STORED) & (sizes != compressed))
    if inconsistent.size:
        raise FormatError(f"stored member {names[inconsistent[0]]!r} has inconsistent sizes")
    return limits.tolist()


def _apply_zip64(extra: bytes, size: int, compressed: int, offset: int, name: str) -> tuple[int, int, int]:
    position = 0
    while position + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, position)
        body = extra[position + 4 : position + 4 + length]
        if tag == 1:
            values = list(struct.unpack_from(f"<{len(body) // 8}Q", body))
            try:
                if size == ZIP64_LIMIT:
                    size = values.pop(0)
                if compressed == ZIP64_LIMIT:
                    compressed = values.pop(0)
                if offset == ZIP64_LIMIT:
                    offset = values.pop(0)
            except IndexError:
                raise FormatError(f"ZIP64 field of {name!r} is truncated") from None
            return size, compressed, offset
        position += 4 + length
    if ZIP64_LIMIT in (size, compressed, offset):
        raise FormatError(f"member {name!r} lacks its ZIP64 sizes")
    return size, compressed, offset


def last_member(directory: bytes, cd_offset: int, name: str) -> Member | None:
    """The directory's last entry, if it is the stored or deflated member ``name`` with nothing
    after its name (where this project's writer puts the manifest); ``None`` otherwise. Its
    bytes lie before the directory; that no other member overlaps them is for the caller to
    prove (:func:`parse_expected`, or :func:`parse`)."""
    raw = name.encode("utf-8")
    start = len(directory) - CENTRAL_SIZE - len(raw)
    if start < 0 or directory[start + CENTRAL_SIZE :] != raw:
        return None
    (sig, _, _, flags, method, _, _, crc, compressed, size, name_len, extra_len, comment_len, _, _, _,
     offset) = _CENTRAL.unpack_from(directory, start)
    if (sig != CENTRAL_SIG or name_len != len(raw) or extra_len or comment_len
            or flags & ENCRYPTED_FLAG or ZIP64_LIMIT in (compressed, size, offset)
            or not (method == STORED and size == compressed
                    or method == DEFLATED and size <= compressed * MAX_DEFLATE_RATIO + DEFLATE_SLACK_BYTES)
            or offset + LOCAL.size + len(raw) + compressed > cd_offset):
        return None
    return Member(name, offset, crc, compressed, size, method, cd_offset, raw)


def spans(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The bytes of ``data`` from each start for its length, end to end: one gather, no step per span."""
    firsts = np.concatenate(([0], np.cumsum(lengths)[:-1])) if len(starts) else lengths
    return data[np.repeat(starts - firsts, lengths) + np.arange(int(lengths.sum()))]


#: a directory entry's signature as an integer
_CENTRAL_SIG_INT = int.from_bytes(CENTRAL_SIG, "little")
#: the fields of an entry :func:`parse_expected` reads, the signature as an integer (numpy
#: compares bytes 10x slower) and the name's, extra field's and comment's lengths (with the
#: disk number after them) as one, so that one comparison checks the three
_EXPECTED_RECORD = np.dtype({
    "names": ["sig", "flags", "method", "crc", "compressed", "size", "lengths", "offset"],
    "formats": ["<u4", "<u2", "<u2", "<u4", "<u4", "<u4", "<u8", "<u4"],
    "offsets": [0, 8, 10, 16, 20, 24, 28, 42], "itemsize": CENTRAL_SIZE,
})
#: ``lengths`` without the disk number: the name's length alone, where extra field and comment are empty
_NAME_EXTRA_COMMENT = (1 << 48) - 1
#: True, False, ... : each entry's fixed fields, then its name (tiled once, not per directory)
_FIXED_THEN_NAME = np.tile(np.array([True, False]), 1 << 16)


def fixed_fields(name_lens: np.ndarray) -> np.ndarray:
    """Over a directory whose entries hold nothing after their names: True on each entry's
    fixed fields, False on its name (so both are gathered, or laid down, in one step each)."""
    lengths = np.empty(2 * len(name_lens), dtype=np.int64)
    lengths[0::2], lengths[1::2] = CENTRAL_SIZE, name_lens
    return _FIXED_THEN_NAME[: 2 * len(name_lens)].repeat(lengths) if len(name_lens) <= _FIXED_THEN_NAME.size // 2 \
        else np.tile(_FIXED_THEN_NAME[:2], len(name_lens)).repeat(lengths)


def parse_expected(directory: bytes, end: int, names: Callable[[], list[str]], name_blob: bytes,
                   name_lens: list[int]) -> Directory | None:
    """The directory, if it is exactly what this project's writer writes for ``names`` (in that
    order, each entry its name and nothing after it, the members in the same order before
    ``end``): proved on whole columns, with no step per entry (up to :data:`FEW_ENTRIES`
    entries, in one light loop). ``None`` for anything else, which :func:`parse` then reads
    entry by entry (and names what is wrong).

    ``end`` must lie below the ZIP64 marker (``ZIP64_LIMIT``), as the manifest's offset does in a
    file with no ZIP64 records: only then can no entry's offset be the marker, which
    :func:`parse` refuses; past it, ``None``.

    Fast twin of :func:`parse`, which is the rule: what this returns, :func:`parse` returns too.
    Bound by the differential test
    ``tests/test_npz_fastpath.py::test_damaged_directories_read_alike_on_either_path`` (damaged
    directories read, or refused, alike on either path)."""
    count = len(name_lens)
    # the names' bytes are ``name_blob`` (checked below), whose lengths ``name_lens`` holds
    if end >= ZIP64_LIMIT or not count or CENTRAL_SIZE * count + len(name_blob) != len(directory):
        return None
    if count <= FEW_ENTRIES:
        found = _few_as_written(directory, end, names, name_blob, name_lens)
        if found is not None:
            return found
    lengths_of_names = np.array(name_lens, dtype=np.int64)
    raw = np.frombuffer(directory, np.uint8)
    fixed = fixed_fields(lengths_of_names)
    if raw[~fixed].tobytes() != name_blob:
        return None
    # the gathered bytes viewed as records, few whole-column steps and one test of them all, each
    # a C call (``count_nonzero``, not ``any``, which goes through Python): numpy's cost per call
    # is more than its work on a directory of 100 entries
    records = raw[fixed].view(_EXPECTED_RECORD)
    offsets, compressed, sizes = (records[field].astype(np.int64) for field in ("offset", "compressed", "size"))
    methods = records["method"]
    limits = np.empty_like(offsets)
    limits[:-1], limits[-1] = offsets[1:], end
    # in order, none overlapping, the last before ``end`` (the manifest's offset, below the ZIP64
    # marker): so no offset or compressed size is a marker, nor a stored member's size
    wrong = ((records["sig"] != _CENTRAL_SIG_INT) | ((records["lengths"] & _NAME_EXTRA_COMMENT) != lengths_of_names)
             | (offsets + LOCAL.size + lengths_of_names + compressed > limits) | (records["flags"] & ENCRYPTED_FLAG))
    if np.count_nonzero(wrong | (sizes != compressed) | methods) and (np.count_nonzero(wrong) or not np.all(
            ((methods == STORED) & (sizes == compressed))
            | ((methods == DEFLATED) & (sizes <= compressed * MAX_DEFLATE_RATIO + DEFLATE_SLACK_BYTES)
               & (sizes != ZIP64_LIMIT)))):  # not all stored: a deflated member's rules
        return None
    columns = {"offset": offsets, "crc": records["crc"], "compressed": compressed, "size": sizes, "method": methods,
               "limit": limits}
    return Directory(names, name_blob, lengths_of_names, columns)


#: up to this many entries :func:`parse_expected` proves the usual directory (every member
#: stored) in one Python loop over ``struct`` reads, which an open of a few tensors then makes
#: without a numpy call: numpy's cost per call, paid in full by an open whose caches went cold
#: (a first open, one after a wait), was 0.13-0.2 ms of the 0.6 a cold open of 100 tensors took.
#: The loop costs some 0.25 us an entry: warm, numpy's columns cost as much at 100 entries and
#: less above; cold, the loop costs less up to some 200.
FEW_ENTRIES = 128
#: one entry as :func:`_few_as_written` reads it: signature, flags, method, CRC, compressed
#: size, size, the four lengths (name, extra field, comment, disk number) as one integer (as in
#: :data:`_EXPECTED_RECORD`), offset, then the name (``%d``: its length)
_ENTRY_AS_WRITTEN = "<I4xHH4xIIIQ6xI%ds"
#: name length -> the ``unpack_from`` of its entry (:func:`_entry_reader`)
_ENTRY_READERS: dict[int, Callable[[bytes, int], tuple]] = {}


def _entry_reader(name_len: int) -> Callable[[bytes, int], tuple]:
    """The reader of an entry whose name is ``name_len`` bytes long, kept for the next entry of
    that length (a model's names take a few dozen lengths; at most 4,096 are kept)."""
    reader = struct.Struct(_ENTRY_AS_WRITTEN % name_len).unpack_from
    if len(_ENTRY_READERS) < 4096:
        _ENTRY_READERS[name_len] = reader
    return reader


def _few_as_written(directory: bytes, end: int, names: Callable[[], list[str]], name_blob: bytes,
                    name_lens: list[int]) -> Directory | None:
    """:func:`parse_expected`'s answer for a directory of stored members, read entry by entry
    (one ``struct`` call each, its name included) and proved on whole columns; ``None`` where
    it proves nothing (a deflated member, a damaged entry), which the numpy path then reads and
    decides."""
    readers, entries, position = _ENTRY_READERS, [], 0
    for name_len in name_lens:  # where each entry lies, if every length is as expected (checked below)
        entries.append((readers.get(name_len) or _entry_reader(name_len))(directory, position))
        position += CENTRAL_SIZE + name_len
    sigs, flags, methods, crcs, compressed, sizes, lengths, offsets, raw_names = zip(*entries, strict=True)
    limits = (*offsets[1:], end)
    # each member's local header (fixed part and name) and data end before the next member's
    # offset (or ``end``): so in order, none overlapping, no offset or size a ZIP64 marker
    reach = map(operator.add, map(operator.add, offsets, compressed), name_lens)
    if (sigs.count(_CENTRAL_SIG_INT) != len(sigs) or list(lengths) != name_lens or b"".join(raw_names) != name_blob
            or methods.count(STORED) != len(methods) or sizes != compressed
            or any(flag & ENCRYPTED_FLAG for flag in set(flags))
            or not all(map(operator.le, map(LOCAL.size.__add__, reach), limits))):
        return None
    columns = {"offset": offsets, "crc": crcs, "compressed": compressed, "size": sizes, "method": methods,
               "limit": limits}
    return Directory(names, name_blob, name_lens, columns)
