"""Random access to a file's bytes: memory-mapped when local, ranged reads when remote.

The npz reader only ever asks for byte ranges it has already proved lie inside the file, so
neither implementation needs to trust a length it is given.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import BinaryIO, Protocol

from weightstore.errors import FormatError


class ByteSource(Protocol):
    name: str
    size: int

    def read_at(self, offset: int, length: int) -> bytes | memoryview: ...
    def close(self) -> None: ...


class MappedFile:
    """A read-only map of a local file: tensors are views into the page cache, never copies.

    Writers replace files by rename, never in place, so a map stays valid for as long as any
    array made from it lives, even after the file is replaced.
    """

    def __init__(self, path: str):
        self.name = path
        self._handle = open(path, "rb")  # kept for read_into, which bypasses the map
        try:
            self.size = os.fstat(self._handle.fileno()).st_size
            self._map = mmap.mmap(self._handle.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        except BaseException:
            self._handle.close()
            raise

    def read_at(self, offset: int, length: int) -> memoryview:
        self._check(offset, length)
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map)[offset : offset + length]

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Copy bytes from the file into ``buffer`` without mapping them into this process."""
        self._check(offset, len(buffer))
        filled = 0  # positional reads: threads sharing one store never move each other's offset
        while filled < len(buffer):
            count = os.preadv(self._handle.fileno(), [buffer[filled:]], offset + filled)
            if not count:
                raise FormatError(f"{self.name}: short read at byte {offset + filled}")
            filled += count

    def prefetch(self, offset: int, length: int) -> None:
        if self._map is not None and length > 1 << 20:
            start = offset - offset % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_WILLNEED, start, offset + length - start)

    def release(self, offset: int, length: int) -> None:
        """Unmap a range read once and never handed out (compressed bytes): it leaves this
        process's resident memory, the page cache keeps it, a later read maps it again."""
        if self._map is not None and length > 0:
            start = offset - offset % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, start, offset + length - start)

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise FormatError(f"{self.name}: truncated file (needs bytes {offset}..{offset + length}, has {self.size})")

    def close(self) -> None:
        self._handle.close()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # arrays handed out still view the map; it closes when the last one goes


class StreamFile:
    """Ranged reads over any seekable binary file, such as an fsspec file on object storage."""

    def __init__(self, handle: BinaryIO, name: str):
        self.name = name
        self._handle = handle
        self._lock = threading.Lock()  # a seek and its read must not interleave with another thread's
        self.size = handle.seek(0, os.SEEK_END)

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise FormatError(f"{self.name}: truncated file (needs bytes {offset}..{offset + length}, has {self.size})")
        with self._lock:
            self._handle.seek(offset)
            data = self._handle.read(length)
        if len(data) != length:
            raise FormatError(f"{self.name}: short read at byte {offset}")
        return data

    def read_into(self, offset: int, buffer: memoryview) -> None:
        if offset < 0 or offset + len(buffer) > self.size:
            raise FormatError(f"{self.name}: truncated file (needs bytes {offset}..{offset + len(buffer)}, has {self.size})")
        with self._lock:
            self._handle.seek(offset)
            filled = 0
            while filled < len(buffer):
                count = self._handle.readinto(buffer[filled:])
                if not count:
                    raise FormatError(f"{self.name}: short read at byte {offset + filled}")
                filled += count

    def prefetch(self, offset: int, length: int) -> None:
        pass

    def release(self, offset: int, length: int) -> None:
        pass

    def close(self) -> None:
        self._handle.close()

