"""npz: a zip of ``.npy`` members that ``np.load(path, allow_pickle=False)`` reads as is.

We write the zip ourselves rather than through :mod:`zipfile` so that each member's array
data starts on a 64-byte boundary (readers map it without copying), sizes and CRCs are known
before the local header is written, and ZIP64 is used exactly when needed. The reader parses
the central directory itself because the stdlib's ``zipfile`` on this Python accepts
overlapping members (zip bombs) and would let a hostile file choose our allocations.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import math
import struct
import time
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from isal import isal_zlib

from weightstore.errors import ChecksumError, FormatError, KeyNotInStoreError, UnsafeFileError
from weightstore.formats import Format, foreign_keys, shuffle_zstd
from weightstore.formats.source import ALIGNMENT, ByteSource, open_source, prefetch_ranges
from weightstore.manifest import (
    CRC_CHUNK,
    MAX_MANIFEST_BYTES,
    MAX_NDIM,
    Manifest,
    TensorInfo,
    checksum,
    checksum_text,
    crc32,
    dtype_name,
    from_storage,
    parse_manifest,
    raw_bytes,
    storage_dtype,
    write_checksummed,
)

MANIFEST_MEMBER = "__weightstore__.npy"
MAX_NPY_HEADER = 10_000
#: deflate cannot expand data by more than this factor; a member claiming more is a bomb
MAX_DEFLATE_RATIO = 1032
_COMPRESS_CHUNK = 16 << 20
#: inflate input chunk: isal inflates 1 MB pieces faster than 16 MB ones (2.6 vs 2.9 s CPU per GB here)
_INFLATE_CHUNK = 1 << 20
#: most bytes one inflate call may return: bounds the transient copy beside the output buffer
_INFLATE_PIECE = 4 << 20
#: numpy refuses an array whose size, counting zero dimensions as one, overflows a signed 64-bit count
_MAX_ARRAY_BYTES = (1 << 63) - 1

_LOCAL = struct.Struct("<4s5H3I2H")
_CENTRAL = struct.Struct("<4s6H3I5H2I")
_EOCD = struct.Struct("<4s4H2IH")
_EOCD64 = struct.Struct("<4sQ2H2I4Q")
_LOCATOR64 = struct.Struct("<4sIQI")
_LOCAL_SIG, _CENTRAL_SIG = b"PK\x03\x04", b"PK\x01\x02"
_EOCD_SIG, _EOCD64_SIG, _LOCATOR64_SIG = b"PK\x05\x06", b"PK\x06\x06", b"PK\x06\x07"
_STORED, _DEFLATED = 0, 8
_UTF8_FLAG, _ENCRYPTED_FLAG = 0x800, 0x1
_ZIP64_LIMIT = 0xFFFFFFFF
_PAD_ID = 0xD935  # the extra-field id Android's zipalign uses for the same padding


def _dos_time() -> tuple[int, int]:
    t = time.localtime()
    return (t.tm_hour << 11) | (t.tm_min << 5) | (t.tm_sec // 2), ((t.tm_year - 1980) << 9) | (t.tm_mon << 5) | t.tm_mday


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """An npy v1.0 header padded so the data after it starts 64-byte aligned."""
    text = f"{{'descr': {np.lib.format.dtype_to_descr(dtype)!r}, 'fortran_order': False, 'shape': {tuple(shape)!r}, }}"
    total = 10 + len(text) + 1
    text += " " * (-total % ALIGNMENT) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")


@dataclass(frozen=True)
class _Layout:
    """What a manifest entry says a member holds, byte for byte: the header, then the data."""

    header: bytes
    storage: np.dtype
    logical: np.dtype  # what the stored bytes are viewed as (native order, ml_dtypes by name)


@functools.lru_cache(maxsize=4096)  # files hold many tensors of few (dtype, shape) pairs
def _layout(dtype_name: str, shape: tuple[int, ...]) -> _Layout:
    storage = storage_dtype(dtype_name)
    return _Layout(npy_header(storage, shape), storage, from_storage(np.empty(0, storage), dtype_name).dtype)


@dataclass
class _Written:
    name: bytes
    offset: int
    crc: int
    compressed: int
    size: int
    method: int


class NpzWriter:
    """Streams members into a seekable file; :meth:`commit` adds the manifest and directory.

    ``compress=True`` deflates npy members (``np.load`` reads them); ``"shuffle"`` stores
    byte-shuffled zstd members (see :mod:`weightstore.formats.shuffle_zstd`) that only
    weightstore decodes: ``np.load`` lists them as raw bytes under their own suffix.
    """

    def __init__(self, path: str, compress: bool | str):
        self._file: BinaryIO = open(path, "wb")  # noqa: SIM115 - open until commit() or abort() closes it
        self._compress = compress
        self._members: list[_Written] = []
        self._time = _dos_time()
        self.locations: dict[str, str] = {}
        self.codecs: dict[str, str] = {}

    def add(self, key: str, dtype_name: str, data: np.ndarray) -> int:
        if self._compress == "shuffle" and data.ndim and data.nbytes:
            self.codecs[key] = shuffle_zstd.CODEC
            return self._add_member(key + shuffle_zstd.MEMBER_SUFFIX, b"", data, shuffle=True)
        return self._add_member(key + ".npy", npy_header(data.dtype, data.shape), data)

    def _add_member(self, name: str, header: bytes, data: np.ndarray, *, shuffle: bool = False) -> int:
        """Write one member, checksumming the data as it is written; returns the data's CRC-32.

        A large or encoded member's local header goes first with a zero CRC (and size, when
        encoded), patched once the data is written: one pass over the tensor instead of a
        checksum pass before it. A small one is checksummed first (it stays in cache for the
        write), so thousands of small tensors cost no seeks.
        """
        payload = raw_bytes(data)
        size = len(header) + len(payload)
        deflate = bool(self._compress) and not shuffle and size > 0 and data.ndim > 0
        patched = deflate or shuffle or len(payload) > CRC_CHUNK
        data_crc = 0 if patched else crc32(payload)
        # the zip CRC covers the npy header too; combining saves a second pass over the data
        crc = 0 if patched else isal_zlib.crc32_combine(isal_zlib.crc32(header), data_crc, len(payload))
        # the encoded size is only bounded, not known: ZIP64 when it might pass 4 GB
        zip64 = size >= (0xF0000000 if deflate or shuffle else _ZIP64_LIMIT) or self._file.tell() >= _ZIP64_LIMIT
        encoded = name.encode("utf-8")
        offset = self._file.tell()
        zip64_extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        fixed = offset + _LOCAL.size + len(encoded) + len(zip64_extra) + 4
        padding = struct.pack("<HH", _PAD_ID, -fixed % ALIGNMENT) + b"\0" * (-fixed % ALIGNMENT)
        method = _DEFLATED if deflate else _STORED
        sizes = (_ZIP64_LIMIT, _ZIP64_LIMIT) if zip64 else (size, size)
        self._file.write(
            _LOCAL.pack(_LOCAL_SIG, 45 if zip64 else 20, _UTF8_FLAG, method, *self._time, crc, *sizes,
                        len(encoded), len(zip64_extra) + len(padding))
            + encoded + zip64_extra + padding
        )
        if deflate:
            data_crc, compressed = self._deflate(header, payload)
        elif shuffle:
            data_crc, stored_crc, size = shuffle_zstd.encode(payload, data.dtype.itemsize, self._file)
            compressed = size
        elif patched:
            self._file.write(header)
            data_crc = write_checksummed(payload, self._file.write)
            compressed = size
        else:
            self._file.write(header)
            self._file.write(payload)
            compressed = size
        if patched:
            crc = stored_crc if shuffle else isal_zlib.crc32_combine(isal_zlib.crc32(header), data_crc, len(payload))
            end = self._file.tell()
            self._file.seek(offset + 14)
            self._file.write(struct.pack("<I", crc) + (b"" if zip64 else struct.pack("<II", compressed, size)))
            if zip64:
                self._file.seek(offset + _LOCAL.size + len(encoded) + 4)
                self._file.write(struct.pack("<QQ", size, compressed))
            self._file.seek(end)
        self._members.append(_Written(encoded, offset, crc, compressed, size, method))
        return data_crc

    def _deflate(self, header: bytes, payload: memoryview) -> tuple[int, int]:
        """Deflate header and payload; returns (CRC-32 of the payload, bytes written)."""
        engine = isal_zlib.compressobj(isal_zlib.ISAL_DEFAULT_COMPRESSION, isal_zlib.DEFLATED, -15)
        written = self._file.write(engine.compress(header))
        crc = 0
        for start in range(0, len(payload), _COMPRESS_CHUNK):
            chunk = payload[start : start + _COMPRESS_CHUNK]
            crc = isal_zlib.crc32(chunk, crc)
            written += self._file.write(engine.compress(chunk))
        return crc & 0xFFFFFFFF, written + self._file.write(engine.flush())

    def commit(self, manifest_text: str) -> None:
        manifest = np.array(manifest_text)
        self._add_member(MANIFEST_MEMBER, npy_header(manifest.dtype, ()), manifest)
        directory_offset = self._file.tell()
        for member in self._members:
            self._file.write(self._central_entry(member))
        directory_size = self._file.tell() - directory_offset
        count = len(self._members)
        if count >= 0xFFFF or directory_offset >= _ZIP64_LIMIT or directory_size >= _ZIP64_LIMIT:
            record_offset = self._file.tell()
            self._file.write(_EOCD64.pack(_EOCD64_SIG, 44, 45, 45, 0, 0, count, count, directory_size, directory_offset))
            self._file.write(_LOCATOR64.pack(_LOCATOR64_SIG, 0, record_offset, 1))
            count, directory_size, directory_offset = 0xFFFF, _ZIP64_LIMIT, _ZIP64_LIMIT
        self._file.write(_EOCD.pack(_EOCD_SIG, 0, 0, count, count, directory_size, directory_offset, 0))
        self._file.close()

    def _central_entry(self, member: _Written) -> bytes:
        big = [v for v in (member.size, member.compressed, member.offset) if v >= _ZIP64_LIMIT]
        extra = struct.pack("<HH", 1, 8 * len(big)) + struct.pack(f"<{len(big)}Q", *big) if big else b""
        clip = lambda v: _ZIP64_LIMIT if v >= _ZIP64_LIMIT else v  # noqa: E731
        return _CENTRAL.pack(
            _CENTRAL_SIG, (3 << 8) | 45, 45 if big else 20, _UTF8_FLAG, member.method, *self._time, member.crc,
            clip(member.compressed), clip(member.size), len(member.name), len(extra), 0, 0, 0,
            0o100644 << 16, clip(member.offset),
        ) + member.name + extra

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # closing flushes, and may fail as the write did: report that error
            self._file.close()


@dataclass
class _Member:
    name: str
    offset: int
    crc: int
    compressed: int
    size: int
    method: int
    limit: int  # where the next member (or the central directory) begins
    raw_name: bytes


class NpzReader:
    """Reads the central directory and manifest at open; each tensor only when asked."""

    def __init__(self, source: ByteSource):
        self._source = source
        self.name = source.name
        self._members = self._read_directory()
        self._data_offsets: dict[str, int] = {}
        manifest_member = self._members.pop(MANIFEST_MEMBER, None)
        manifest = self._read_manifest(manifest_member) if manifest_member else None
        self._manifest = manifest
        self.metadata = manifest.metadata if manifest else {}
        self.created = manifest.created if manifest else ""
        self.has_checksums = manifest is not None
        member_keys = {}
        for name in self._members:
            if name.endswith(".npy"):
                member_keys[name[:-4]] = name
            elif name.endswith(shuffle_zstd.MEMBER_SUFFIX) and manifest is not None:
                member_keys[name[: -len(shuffle_zstd.MEMBER_SUFFIX)]] = name
            else:
                raise FormatError(f"{self.name}: member {name!r} is not an .npy array")
        self._member_of = member_keys if manifest is not None else foreign_keys(member_keys.items(), self.name, "member")
        if manifest is not None:
            listed, present = set(manifest.tensors), set(member_keys)
            if listed != present:
                missing = sorted(listed - present)[:3]
                extra = sorted(present - listed)[:3]
                raise FormatError(
                    f"{self.name}: manifest and members disagree (listed but absent: {missing}, present but unlisted: {extra})"
                )
        self._infos: dict[str, TensorInfo] = dict(manifest.tensors) if manifest else {}
        self._codecs = manifest.codecs if manifest else {}
        if len(member_keys) != len(self._members):
            raise FormatError(f"{self.name}: two members hold the same tensor (.npy and {shuffle_zstd.MEMBER_SUFFIX})")

    # -- the directory -------------------------------------------------------------------
    def _read_directory(self) -> dict[str, _Member]:
        size = self._source.size
        if size == 0:
            raise FormatError(f"{self.name}: file is empty")
        tail_start = max(0, size - (_EOCD.size + 0xFFFF))
        tail = bytes(self._source.read_at(tail_start, size - tail_start))
        position = tail.rfind(_EOCD_SIG)
        while position >= 0 and position + _EOCD.size <= len(tail):
            comment = struct.unpack_from("<H", tail, position + 20)[0]
            if position + _EOCD.size + comment == len(tail):
                break
            position = tail.rfind(_EOCD_SIG, 0, position)
        else:
            position = -1
        if position < 0:
            raise FormatError(f"{self.name}: not an npz file (no zip directory; truncated or not a zip)")
        eocd_offset = tail_start + position
        _, disk, cd_disk, disk_count, count, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, position)
        if disk or cd_disk:
            raise FormatError(f"{self.name}: multi-disk zip archives are not supported")
        if disk_count != count:
            raise FormatError(f"{self.name}: zip end record disagrees with itself ({disk_count}, {count} entries)")
        if count == 0xFFFF or cd_size == _ZIP64_LIMIT or cd_offset == _ZIP64_LIMIT:
            count, cd_size, cd_offset, eocd_offset = self._read_zip64_end(eocd_offset)
        if cd_offset + cd_size > eocd_offset or count * _CENTRAL.size > cd_size:
            raise FormatError(f"{self.name}: zip directory points outside the file (truncated?)")
        directory = bytes(self._source.read_at(cd_offset, cd_size))
        return self._parse_members(directory, count, cd_offset)

    def _read_zip64_end(self, eocd_offset: int) -> tuple[int, int, int, int]:
        if eocd_offset < _LOCATOR64.size:
            raise FormatError(f"{self.name}: ZIP64 locator missing")
        sig, _, record, _ = _LOCATOR64.unpack(bytes(self._source.read_at(eocd_offset - _LOCATOR64.size, _LOCATOR64.size)))
        if sig != _LOCATOR64_SIG or record + _EOCD64.size > eocd_offset:
            raise FormatError(f"{self.name}: ZIP64 locator is corrupt")
        fields = _EOCD64.unpack(bytes(self._source.read_at(record, _EOCD64.size)))
        if fields[0] != _EOCD64_SIG:
            raise FormatError(f"{self.name}: ZIP64 end record is corrupt")
        return fields[7], fields[8], fields[9], record

    def _parse_members(self, directory: bytes, count: int, cd_offset: int) -> dict[str, _Member]:
        members: dict[str, _Member] = {}
        position = 0
        for _ in range(count):
            if position + _CENTRAL.size > len(directory):
                raise FormatError(f"{self.name}: zip directory is truncated")
            (sig, _, _, flags, method, _, _, crc, compressed, size, name_len, extra_len, comment_len,
             _, _, _, offset) = _CENTRAL.unpack_from(directory, position)
            if sig != _CENTRAL_SIG:
                raise FormatError(f"{self.name}: zip directory entry {len(members)} is corrupt")
            start = position + _CENTRAL.size
            raw_name = directory[start : start + name_len]
            extra = directory[start + name_len : start + name_len + extra_len]
            position = start + name_len + extra_len + comment_len
            name = self._member_name(raw_name, flags)
            if flags & _ENCRYPTED_FLAG:
                raise UnsafeFileError(f"{self.name}: member {name!r} is encrypted")
            if method not in (_STORED, _DEFLATED):
                raise UnsafeFileError(f"{self.name}: member {name!r} uses compression method {method}; only stored and deflate are read")
            if extra or _ZIP64_LIMIT in (size, compressed, offset):
                size, compressed, offset = _apply_zip64(extra, size, compressed, offset, self.name, name)
            if name in members:
                raise UnsafeFileError(f"{self.name}: member {name!r} appears twice")
            members[name] = _Member(name, offset, crc, compressed, size, method, 0, raw_name)
        if position != len(directory):  # else a count that lies small hides members (the manifest among them)
            raise FormatError(f"{self.name}: zip directory holds more than the {count} entries its end record counts")
        ordered = sorted(members.values(), key=lambda m: m.offset)
        for member, following in zip(ordered, [*ordered[1:], None], strict=True):
            member.limit = following.offset if following else cd_offset
            if member.offset + _LOCAL.size + len(member.raw_name) + member.compressed > member.limit:
                raise UnsafeFileError(f"{self.name}: member {member.name!r} overlaps the next one (zip bomb?)")
            if member.method == _DEFLATED and member.size > member.compressed * MAX_DEFLATE_RATIO + 1024:
                raise UnsafeFileError(f"{self.name}: member {member.name!r} claims an impossible compression ratio")
            if member.method == _STORED and member.size != member.compressed:
                raise FormatError(f"{self.name}: stored member {member.name!r} has inconsistent sizes")
        return members

    def _member_name(self, raw: bytes, flags: int) -> str:
        try:
            name = raw.decode("utf-8" if flags & _UTF8_FLAG else "cp437")
        except UnicodeDecodeError:
            raise FormatError(f"{self.name}: a member name is not valid UTF-8") from None
        if "\0" in name or "\\" in name or name.startswith("/") or (".." in name and ".." in name.split("/")):
            raise UnsafeFileError(f"{self.name}: unsafe member name {name!r}")
        return name

    # -- members ------------------------------------------------------------------------
    def _data_offset(self, member: _Member) -> int:
        cached = self._data_offsets.get(member.name)
        if cached is not None:
            return cached
        # header and name in one read: the directory proved both lie before the next member
        header = bytes(self._source.read_at(member.offset, _LOCAL.size + len(member.raw_name)))
        sig, _, _, method, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack_from(header)
        if sig != _LOCAL_SIG or method != member.method:
            raise FormatError(f"{self.name}: local header of {member.name!r} is corrupt")
        if name_len != len(member.raw_name) or header[_LOCAL.size :] != member.raw_name:
            raise UnsafeFileError(f"{self.name}: local header of {member.name!r} names another file")
        start = member.offset + _LOCAL.size + name_len + extra_len
        if start + member.compressed > member.limit:
            raise UnsafeFileError(f"{self.name}: member {member.name!r} overlaps the next one (zip bomb?)")
        self._data_offsets[member.name] = start
        return start

    def _member_bytes(self, member: _Member, budget: int) -> memoryview:
        """A member's bytes: a view into the map when stored, inflated (and bounded) when not."""
        if member.size > budget:
            raise UnsafeFileError(f"{self.name}: member {member.name!r} is larger than allowed ({member.size} > {budget})")
        prefetch_ranges(self._source, lambda: [self._extent(member)])
        start = self._data_offset(member)
        if member.method == _STORED:
            self._source.prefetch(start, member.size)
            return memoryview(self._source.read_at(start, member.size))
        out = bytearray(member.size)
        view = memoryview(out)
        engine = isal_zlib.decompressobj(-15)
        filled = 0
        for chunk_start in range(start, start + member.compressed, _INFLATE_CHUNK):
            chunk = self._source.read_at(chunk_start, min(_INFLATE_CHUNK, start + member.compressed - chunk_start))
            pending = bytes(chunk)
            self._source.release(chunk_start, len(chunk))  # else the compressed pages stay in RSS
            while True:
                # Each piece is capped, so 1 MB of input that inflates to a whole tensor never
                # exists twice (piece + output): the input left over waits in unconsumed_tail,
                # output already inflated inside the engine comes out on the next call (even
                # with no input left). The +1 lets a stream that runs past the declared size show.
                wanted = min(_INFLATE_PIECE, member.size - filled + 1)
                try:
                    piece = engine.decompress(pending, wanted)
                except isal_zlib.error as exc:  # type: ignore[misc]  # isal's stubs do not say it is an exception
                    raise FormatError(f"{self.name}: member {member.name!r} is corrupt (deflate: {exc})") from None
                if filled + len(piece) > member.size:
                    raise FormatError(f"{self.name}: member {member.name!r} inflates past its declared size")
                view[filled : filled + len(piece)] = piece
                filled += len(piece)
                pending = engine.unconsumed_tail
                if engine.eof or (not pending and len(piece) < wanted):
                    break
        if filled != member.size or not engine.eof:
            raise FormatError(f"{self.name}: member {member.name!r} is truncated or corrupt (deflate)")
        return view

    def _extent(self, member: _Member) -> tuple[int, int]:
        """The bytes reading a member touches (local header, name, padding, data), within its limit."""
        most = _LOCAL.size + len(member.raw_name) + 0xFFFF + member.compressed
        return member.offset, min(member.limit - member.offset, most)

    def prefetch(self, keys: list[str]) -> None:
        """Announce the tensors read next, so a remote source fetches them at once; each is
        bounded first, as a read would be."""
        def extents() -> list[tuple[int, int]]:
            found = []
            for key in keys:
                member = self._member(key)
                if self._manifest is not None:
                    self._listed(key, member)  # a member larger than its manifest entry is refused, not fetched
                found.append(self._extent(member))
            return found

        prefetch_ranges(self._source, extents)

    def _member_head(self, member: _Member) -> memoryview:
        """The first bytes of a member, enough for its npy header, without reading or inflating the rest."""
        start = self._data_offset(member)
        wanted = min(member.size, 12 + MAX_NPY_HEADER)
        if member.method == _STORED:
            return memoryview(self._source.read_at(start, wanted))
        engine = isal_zlib.decompressobj(-15)
        head = bytearray()
        position, end = start, start + member.compressed
        while len(head) < wanted and position < end and not engine.eof:
            chunk = bytes(self._source.read_at(position, min(1 << 16, end - position)))
            position += len(chunk)
            try:
                head += engine.decompress(chunk, wanted - len(head))
            except isal_zlib.error as exc:  # type: ignore[misc]  # isal's stubs do not say it is an exception
                raise FormatError(f"{self.name}: member {member.name!r} is corrupt (deflate: {exc})") from None
        return memoryview(head)

    def _parse_npy(
        self, member: _Member, data: memoryview, size: int | None = None,
    ) -> tuple[np.dtype, tuple[int, ...], bool, int]:
        """Check a member's npy header; ``size`` is the whole member's when ``data`` is only its head."""
        where = f"{self.name}: member {member.name!r}"
        size = len(data) if size is None else size
        if len(data) < 10 or bytes(data[:6]) != b"\x93NUMPY":
            raise FormatError(f"{where} is not an npy array")
        major = data[6]
        if major == 1:
            header_len, prefix = struct.unpack("<H", data[8:10])[0], 10
        elif major in (2, 3) and len(data) >= 12:
            header_len, prefix = struct.unpack("<I", data[8:12])[0], 12
        else:
            raise FormatError(f"{where} has unknown npy version {major}")
        if header_len > MAX_NPY_HEADER:
            raise UnsafeFileError(f"{where} has an npy header of {header_len} bytes (limit {MAX_NPY_HEADER})")
        if prefix + header_len > len(data):
            raise FormatError(f"{where} is truncated inside its npy header")
        try:
            text = bytes(data[prefix : prefix + header_len]).decode("utf-8" if major == 3 else "latin1")
            fields = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
            raise FormatError(f"{where} has an unreadable npy header") from None
        if not isinstance(fields, dict) or set(fields) != {"descr", "fortran_order", "shape"}:
            raise FormatError(f"{where} has an npy header without descr/fortran_order/shape")
        shape, descr, fortran = fields["shape"], fields["descr"], fields["fortran_order"]
        if (not isinstance(shape, tuple) or len(shape) > MAX_NDIM
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise FormatError(f"{where} has an invalid shape {shape!r}")
        if not isinstance(fortran, bool):
            raise FormatError(f"{where} has fortran_order {fortran!r}, not True or False")
        if not isinstance(descr, str):
            raise UnsafeFileError(f"{where} holds a structured array; only plain numeric arrays are read")
        try:
            dtype = np.lib.format.descr_to_dtype(descr)  # type: ignore[arg-type]  # a str descr is valid
        except Exception:  # numpy's dtype parser raises TypeError, ValueError or SyntaxError on junk
            raise FormatError(f"{where} has an unknown dtype {descr!r}") from None
        if dtype.hasobject:
            raise UnsafeFileError(f"{where} holds an object array; weightstore never unpickles")
        if dtype.fields is not None or dtype.subdtype is not None or dtype.itemsize == 0:
            raise FormatError(f"{where} has dtype {descr!r}; only plain numeric arrays are read")
        if math.prod(max(d, 1) for d in shape) * dtype.itemsize > _MAX_ARRAY_BYTES:
            raise FormatError(f"{where} has a shape {shape} too large for any array")
        expected = math.prod(shape) * dtype.itemsize
        start = prefix + header_len
        if size - start != expected:
            raise FormatError(
                f"{where}: header says {shape} of {dtype} ({expected} bytes) but the member holds {size - start}"
            )
        return dtype, shape, fortran, start

    def _read_manifest(self, member: _Member) -> Manifest:
        """The manifest, always checked against its zip CRC-32: it decides what every tensor is."""
        data = self._member_bytes(member, 4 * MAX_MANIFEST_BYTES + MAX_NPY_HEADER)
        if isal_zlib.crc32(raw_bytes(data)) & 0xFFFFFFFF != member.crc:
            raise ChecksumError(f"{self.name}: manifest member {member.name!r} is corrupt (zip CRC-32 mismatch)")
        dtype, shape, _, start = self._parse_npy(member, data)
        if dtype.kind != "U" or shape != ():
            raise FormatError(f"{self.name}: manifest member is not a text scalar")
        text = bytes(data[start:]).decode("utf-32-le" if dtype.byteorder in "<=|" else "utf-32-be", "replace")
        return parse_manifest(text.rstrip("\0"), self.name)

    # -- the Reader protocol -----------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._infos) if self._manifest else sorted(self._member_of)

    def _member(self, key: str) -> _Member:
        name = self._member_of.get(key)
        if name is None:
            raise KeyNotInStoreError(f"{self.name}: no tensor {key!r}")
        return self._members[name]

    def info(self, key: str) -> TensorInfo:
        info = self._infos.get(key)
        if info is None:
            member = self._member(key)
            self._source.check_unchanged(f"tensor {key!r}")
            dtype, shape, _, _ = self._parse_npy(member, self._member_head(member), member.size)
            name = dtype_name(dtype, key) if dtype.kind != "V" else f"V{dtype.itemsize}"
            info = TensorInfo(key, name, shape, math.prod(shape) * dtype.itemsize, None)
            self._infos[key] = info
        return info

    def _listed(self, key: str, member: _Member) -> tuple[TensorInfo, _Layout]:
        """A tensor's manifest entry and the exact bytes its member must begin with.

        The member must be that npy header followed by exactly the entry's bytes: refused from
        the sizes alone, before anything is inflated or allocated, so a manifest that lies
        small (to pass ``max_bytes``) cannot front a large member.
        """
        info = self._infos[key]
        layout = _layout(info.dtype, info.shape)
        shuffled = member.name.endswith(shuffle_zstd.MEMBER_SUFFIX)
        if shuffled != (self._codecs.get(key) == shuffle_zstd.CODEC):
            raise FormatError(f"{self.name}: tensor {key!r} is stored as member {member.name!r} but its manifest "
                              f"entry says codec {self._codecs.get(key)!r}")
        if shuffled:
            if member.method != _STORED or member.size > shuffle_zstd.max_encoded_size(info.nbytes):
                raise UnsafeFileError(f"{self.name}: tensor {key!r} (member {member.name!r}) holds {member.size} "
                                      f"encoded bytes for {info.nbytes} plain ones; refusing to read it")
            return info, layout
        if member.size != len(layout.header) + info.nbytes:
            raise UnsafeFileError(
                f"{self.name}: tensor {key!r} (member {member.name!r}) holds {member.size} bytes but the manifest "
                f"says {info.shape} {info.dtype} ({info.nbytes} bytes after a {len(layout.header)}-byte header); "
                "refusing to read it"
            )
        return info, layout

    def _check_header(self, key: str, info: TensorInfo, layout: _Layout, head: memoryview) -> None:
        """Byte for byte, as the writer would have written it: dtype, shape and order all decide what
        the data means, and nothing else checks them (the tensor checksum covers the data only)."""
        found = bytes(head[: len(layout.header)])
        if found != layout.header:
            raise FormatError(
                f"{self.name}: tensor {key!r} has npy header {found[:96]!r}, not the one its manifest entry "
                f"({info.shape} {info.dtype}) implies"
            )

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        member = self._member(key)
        self._source.check_unchanged(f"tensor {key!r}")
        if self._manifest is None:
            return self._read_foreign(key, member, verify)
        info, layout = self._listed(key, member)
        if self._codecs.get(key):
            return self._read_shuffled(key, member, info, layout, verify)
        data = self._member_bytes(member, member.size)
        self._check_header(key, info, layout, data)
        payload = data[len(layout.header) :]
        if verify:
            self._verify(key, member, data, payload, info)
        count = math.prod(info.shape)
        array = np.frombuffer(payload, dtype=layout.storage, count=count) if count else np.empty(0, layout.storage)
        return array.reshape(info.shape).view(layout.logical)

    def _read_shuffled(self, key: str, member: _Member, info: TensorInfo, layout: _Layout, verify: bool) -> np.ndarray:
        """A ``compress="shuffle"`` tensor, decoded into memory it owns and checked against the
        manifest's CRC-32 of the plain bytes (the zip CRC, of the encoded bytes, is not needed)."""
        where = f"{self.name}: tensor {key!r} (member {member.name!r})"
        plain, crc = shuffle_zstd.decode(self._member_bytes(member, member.size), layout.storage.itemsize,
                                         info.nbytes, where)
        self._source.release(self._data_offset(member), member.size)  # else the encoded pages stay in RSS
        if verify and info.checksum and checksum_text(crc) != info.checksum:
            raise ChecksumError(f"{self.name}: tensor {key!r} is corrupt (checksum {checksum_text(crc)}, "
                                f"manifest {info.checksum})")
        return plain.view(layout.storage).reshape(info.shape).view(layout.logical)

    def _read_foreign(self, key: str, member: _Member, verify: bool) -> np.ndarray:
        """A member of a file without a manifest: its own npy header is all there is to go on."""
        data = self._member_bytes(member, member.size)
        dtype, shape, fortran, start = self._parse_npy(member, data)
        payload = data[start:]
        if verify:
            self._verify(key, member, data, payload, None)
        if dtype.kind == "V":
            raise FormatError(f"{self.name}: tensor {key!r} is raw bytes ({dtype}) and no manifest says what they are")
        dtype_name(dtype, key)
        array = np.frombuffer(payload, dtype=dtype, count=math.prod(shape)) if payload.nbytes else np.empty(0, dtype)
        array = array.reshape(shape, order="F" if fortran else "C")
        return array if dtype.isnative else array.astype(dtype.newbyteorder("="))

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        """Read a stored tensor straight into ``out``; False when only :meth:`read` can.

        That is: deflated, no manifest, or (when verifying) no checksum in the manifest, where
        :meth:`read` checks the zip CRC-32 instead.
        """
        member = self._member(key)
        self._source.check_unchanged(f"tensor {key!r}")
        if member.method != _STORED or self._manifest is None or self._codecs.get(key):
            return False
        info, layout = self._listed(key, member)
        if verify and not info.checksum:
            return False
        start = self._data_offset(member)
        self._check_header(key, info, layout, memoryview(self._source.read_at(start, len(layout.header))))
        payload = raw_bytes(out) if out.nbytes else memoryview(b"")
        self._source.read_into(start + len(layout.header), out.reshape(-1).view(np.uint8).data)
        if verify and checksum(payload) != info.checksum:
            raise ChecksumError(f"{self.name}: tensor {key!r} is corrupt (checksum {checksum(payload)}, manifest {info.checksum})")
        return True

    def _verify(self, key: str, member: _Member, data: memoryview, payload: memoryview, info: TensorInfo | None) -> None:
        if info is not None and info.checksum:
            actual = checksum(payload)
            if actual != info.checksum:
                raise ChecksumError(f"{self.name}: tensor {key!r} is corrupt (checksum {actual}, manifest {info.checksum})")
        elif crc32(data) != member.crc:
            raise ChecksumError(f"{self.name}: tensor {key!r} is corrupt (zip CRC-32 mismatch)")

    def close(self) -> None:
        self._source.close()


def _apply_zip64(extra: bytes, size: int, compressed: int, offset: int, where: str, name: str) -> tuple[int, int, int]:
    position = 0
    while position + 4 <= len(extra):
        tag, length = struct.unpack_from("<HH", extra, position)
        body = extra[position + 4 : position + 4 + length]
        if tag == 1:
            values = list(struct.unpack_from(f"<{len(body) // 8}Q", body))
            try:
                if size == _ZIP64_LIMIT:
                    size = values.pop(0)
                if compressed == _ZIP64_LIMIT:
                    compressed = values.pop(0)
                if offset == _ZIP64_LIMIT:
                    offset = values.pop(0)
            except IndexError:
                raise FormatError(f"{where}: ZIP64 field of {name!r} is truncated") from None
            return size, compressed, offset
        position += 4 + length
    if _ZIP64_LIMIT in (size, compressed, offset):
        raise FormatError(f"{where}: member {name!r} lacks its ZIP64 sizes")
    return size, compressed, offset


def _open_reader(location, name: str, *, mmap: bool = True) -> NpzReader:
    """``mmap=False`` reads local tensors into memory they own instead of viewing a map of the file."""
    return open_source(location, name, NpzReader, index_at_end=True, mmap=mmap)


FORMAT = Format(
    name="npz",
    suffixes=(".npz",),
    magic=lambda head: head[:4] in (_LOCAL_SIG, _EOCD_SIG),
    open_reader=_open_reader,
    open_writer=lambda path, compress: NpzWriter(path, compress),
)
