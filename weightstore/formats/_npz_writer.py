"""Writing an npz: each member's data on a 64-byte boundary, sizes and CRCs known before its
local header, ZIP64 exactly where needed, the central directory written by us."""

from __future__ import annotations

import contextlib
import functools
import struct
import time
from typing import Any, BinaryIO

import numpy as np
from isal import isal_zlib

from weightstore.core.manifest import (
    CRC_CHUNK,
    crc32,
    raw_bytes,
    write_checksummed,
)
from weightstore.formats import _shuffle_zstd, _zipdir
from weightstore.formats._npz_layout import MANIFEST_MEMBER, npy_header
from weightstore.formats._zipdir import (
    CENTRAL_SIG,
    DEFLATED,
    EOCD,
    EOCD64,
    EOCD64_SIG,
    EOCD_SIG,
    LOCAL,
    LOCAL_SIG,
    LOCATOR64,
    LOCATOR64_SIG,
    STORED,
    UTF8_FLAG,
    ZIP64_LIMIT,
)
from weightstore.io._buffer import ALIGNMENT

_COMPRESS_CHUNK = 16 << 20


_CENTRAL = struct.Struct("<4s6H3I5H2I")


#: members start past here only in files near 4 GB: left to the path that writes ZIP64 fields
_SMALL_MEMBERS_END = 0xF0000000


#: small members are gathered up to this many bytes per write
_PENDING_BYTES = 1 << 20


#: the file object's own buffer (headers of large members, deflated pieces)
_BUFFER_BYTES = 1 << 16


#: the zip extra field that pads a member's data to :data:`ALIGNMENT`, by padding length
_PAD_ID = 0xD935  # the extra-field id Android's zipalign uses for the same padding


_PADDING = [struct.pack("<HH", _PAD_ID, n) + bytes(n) for n in range(ALIGNMENT)]


_LOCAL_AND_PAD_ID = LOCAL.size + 4


_LOCAL_SMALL = LOCAL.pack


def _dos_time() -> tuple[int, int]:
    t = time.localtime()
    return (t.tm_hour << 11) | (t.tm_min << 5) | (t.tm_sec // 2), ((t.tm_year - 1980) << 9) | (t.tm_mon << 5) | t.tm_mday


#: a member written: ``(name, offset, crc, compressed size, size, method)``
_Written = tuple[bytes, int, int, int, int, int]


#: a writer keeps each member's fields end to end in one list: one ``+=`` per small tensor, and
#: each field's column a slice
_WRITTEN_FIELDS = 6


@functools.lru_cache(maxsize=4096)  # a model's tensors come in few (dtype, shape) pairs
def _npy_header_and_crc(dtype: np.dtype, shape: tuple[int, ...]) -> tuple[bytes, int]:
    header = npy_header(dtype, shape)
    return header, isal_zlib.crc32(header) & 0xFFFFFFFF


class NpzWriter:
    """Streams members into a seekable file; :meth:`commit` adds the manifest and directory.

    ``compress=True`` deflates npy members (``np.load`` reads them); ``"shuffle"`` stores
    byte-shuffled zstd members (see :mod:`weightstore.formats._shuffle_zstd`) that only
    weightstore decodes: ``np.load`` lists them as raw bytes under their own suffix.
    """

    def __init__(self, path: str, compress: bool | str):
        # a buffer size given, so the open asks no isatty (an ioctl, a syscall of each save)
        self._file: BinaryIO = open(path, "wb", buffering=_BUFFER_BYTES)  # noqa: SIM115 - open until commit() or abort() closes it
        self._compress = compress
        self._small = not compress  # small members are gathered (see _add_small) unless encoded
        self._written: list[Any] = []  # _WRITTEN_FIELDS per member, end to end (see _central_directory)
        self._offset = 0  # where the next member starts
        self._pending = bytearray()  # small members not yet handed to the file
        self._time = _dos_time()
        self.locations: dict[str, str] = {}
        self.codecs: dict[str, str] = {}

    def add(self, key: str, dtype_name: str, data: np.ndarray, crc: int | None = None) -> int:
        nbytes = data.nbytes
        if self._small and nbytes <= CRC_CHUNK and self._offset < _SMALL_MEMBERS_END:
            return self._add_small((key + ".npy").encode("utf-8"), data, nbytes, crc)
        if self._compress == "shuffle" and data.ndim and nbytes:
            self.codecs[key] = _shuffle_zstd.CODEC
            return self._add_member(key + _shuffle_zstd.MEMBER_SUFFIX, b"", data, shuffle=True)
        return self._add_member(key + ".npy", _npy_header_and_crc(data.dtype, data.shape)[0], data, crc=crc)

    def _flush_pending(self) -> None:
        self._file.write(self._pending)
        self._pending.clear()

    def _add_small(self, name: bytes, data: np.ndarray, nbytes: int, known: int | None = None) -> int:
        """A small stored member, gathered with others into one write and its offset counted
        rather than asked: a ``write``, ``tell`` or seek costs more than a small tensor's bytes,
        and a file may hold 50,000 of them (so this is one flat function, its constants local)."""
        header, header_crc = _npy_header_and_crc(data.dtype, data.shape)
        payload = data if data.flags.c_contiguous else raw_bytes(data)  # an array is a buffer too, without a view
        data_crc = isal_zlib.crc32(payload) if known is None else known
        size = len(header) + nbytes
        offset = self._offset
        fixed = offset + _LOCAL_AND_PAD_ID + len(name)
        padding = -fixed % ALIGNMENT
        crc = isal_zlib.crc32_combine(header_crc, data_crc, nbytes)
        pending = self._pending
        pending += _LOCAL_SMALL(LOCAL_SIG, 20, UTF8_FLAG, STORED, *self._time, crc, size, size, len(name), 4 + padding)
        pending += name
        pending += _PADDING[padding]
        pending += header
        pending.extend(payload)  # a buffer: not "+=", where numpy would add elementwise
        if len(pending) >= _PENDING_BYTES:
            self._flush_pending()
        self._offset = fixed + padding + size
        self._written += (name, offset, crc, size, size, STORED)
        return data_crc

    def _add_member(self, name: str, header: bytes, data: np.ndarray, *, shuffle: bool = False,
                    crc: int | None = None) -> int:
        """Write one member, checksumming the data as it is written; returns the data's CRC-32.

        A large or encoded member's local header goes first with a zero CRC (and size, when
        encoded), patched once the data is written: one pass over the tensor instead of a
        checksum pass before it. A small one is checksummed first (it stays in cache for the
        write), so thousands of small tensors cost no seeks. A stored one whose CRC-32 the
        caller gives (``crc``) is neither checksummed nor patched.
        """
        self._flush_pending()
        payload = raw_bytes(data)
        size = len(header) + len(payload)
        deflate = bool(self._compress) and not shuffle and size > 0 and data.ndim > 0
        patched = deflate or shuffle or (crc is None and len(payload) > CRC_CHUNK)
        data_crc = 0 if patched else crc32(payload) if crc is None else crc
        # the zip CRC covers the npy header too; combining saves a second pass over the data
        crc = 0 if patched else isal_zlib.crc32_combine(isal_zlib.crc32(header), data_crc, len(payload))
        # the encoded size is only bounded, not known: ZIP64 when it might pass 4 GB
        offset = self._offset  # counted, not asked: each ``tell`` of a file being written costs a system call
        zip64 = size >= (0xF0000000 if deflate or shuffle else ZIP64_LIMIT) or offset >= ZIP64_LIMIT
        encoded = name.encode("utf-8")
        zip64_extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        fixed = offset + LOCAL.size + len(encoded) + len(zip64_extra) + 4
        padding = struct.pack("<HH", _PAD_ID, -fixed % ALIGNMENT) + b"\0" * (-fixed % ALIGNMENT)
        method = DEFLATED if deflate else STORED
        sizes = (ZIP64_LIMIT, ZIP64_LIMIT) if zip64 else (size, size)
        local = (LOCAL.pack(LOCAL_SIG, 45 if zip64 else 20, UTF8_FLAG, method, *self._time, crc, *sizes,
                            len(encoded), len(zip64_extra) + len(padding))
                 + encoded + zip64_extra + padding)
        self._file.write(local)
        if deflate:
            data_crc, compressed = self._deflate(header, payload)
        elif shuffle:
            data_crc, stored_crc, size = _shuffle_zstd.encode(payload, data.dtype.itemsize, self._file)
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
                self._file.seek(offset + LOCAL.size + len(encoded) + 4)
                self._file.write(struct.pack("<QQ", size, compressed))
            self._file.seek(end)
        self._written += (encoded, offset, crc, compressed, size, method)
        self._offset = offset + len(local) + compressed
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
        """The manifest, the directory and its end records, gathered with the small members
        still pending into one write (a file of small tensors is then written in one)."""
        manifest = np.array(manifest_text)
        if self._small and manifest.nbytes <= CRC_CHUNK and self._offset < _SMALL_MEMBERS_END:
            self._add_small(MANIFEST_MEMBER.encode("utf-8"), manifest, manifest.nbytes)
        else:
            self._add_member(MANIFEST_MEMBER, npy_header(manifest.dtype, ()), manifest)
        directory_offset = self._offset
        directory = self._central_directory()
        directory_size = len(directory)
        pending = self._pending
        pending += directory
        count = len(self._written) // _WRITTEN_FIELDS
        if count >= 0xFFFF or directory_offset >= ZIP64_LIMIT or directory_size >= ZIP64_LIMIT:
            record_offset = directory_offset + directory_size
            pending += EOCD64.pack(EOCD64_SIG, 44, 45, 45, 0, 0, count, count, directory_size, directory_offset)
            pending += LOCATOR64.pack(LOCATOR64_SIG, 0, record_offset, 1)
            count, directory_size, directory_offset = 0xFFFF, ZIP64_LIMIT, ZIP64_LIMIT
        pending += EOCD.pack(EOCD_SIG, 0, 0, count, count, directory_size, directory_offset, 0)
        self._flush_pending()
        self._file.close()

    def _central_directory(self) -> bytes:
        """Every member's directory entry, in one buffer for one write.

        Built as columns: a record array of the fixed fields, the names laid in between (50,000
        small tensors would otherwise pack 50,000 entries one by one). A directory with a ZIP64
        member is built entry by entry (a file past 4 GB has few enough members).
        """
        written = self._written
        names, offsets, crcs, compressed, sizes, methods = (written[i::_WRITTEN_FIELDS] for i in range(_WRITTEN_FIELDS))
        if max(max(offsets), max(compressed), max(sizes)) >= ZIP64_LIMIT:
            return b"".join(map(self._central_entry, zip(names, offsets, crcs, compressed, sizes, methods, strict=True)))
        count = len(names)
        records = np.zeros(count, _zipdir.CENTRAL_RECORD)
        records["sig"], records["made_by"], records["needed"], records["flags"] = CENTRAL_SIG, (3 << 8) | 45, 20, UTF8_FLAG
        records["time"], records["date"], records["external"] = *self._time, 0o100644 << 16
        records["method"], records["crc"], records["compressed"], records["size"] = methods, crcs, compressed, sizes
        records["name_len"] = name_lens = np.fromiter(map(len, names), np.int64, count)
        records["offset"] = offsets
        fixed = _zipdir.fixed_fields(name_lens)
        directory = np.empty(len(fixed), np.uint8)
        directory[fixed] = records.view(np.uint8)
        directory[~fixed] = np.frombuffer(b"".join(names), np.uint8)
        return directory.tobytes()

    def _central_entry(self, member: _Written) -> bytes:
        name, offset, crc, compressed, size, method = member
        big = [v for v in (size, compressed, offset) if v >= ZIP64_LIMIT]
        extra = struct.pack("<HH", 1, 8 * len(big)) + struct.pack(f"<{len(big)}Q", *big) if big else b""
        clip = lambda v: ZIP64_LIMIT if v >= ZIP64_LIMIT else v  # noqa: E731
        return _CENTRAL.pack(
            CENTRAL_SIG, (3 << 8) | 45, 45 if big else 20, UTF8_FLAG, method, *self._time, crc,
            clip(compressed), clip(size), len(name), len(extra), 0, 0, 0, 0o100644 << 16, clip(offset),
        ) + name + extra

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # closing flushes, and may fail as the write did: report that error
            self._file.close()
