"""Random access to a file's bytes: memory-mapped when local, ranged reads when remote.

The npz reader only ever asks for byte ranges it has already proved lie inside the file, so
no implementation needs to trust a length it is given.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from typing import BinaryIO, Protocol

import numpy as np

from weightstore.errors import FormatError, StoreClosedError

#: the boundary tensor data is aligned to, in the file and in memory read from it
ALIGNMENT = 64


class ByteSource(Protocol):
    name: str
    size: int

    def read_at(self, offset: int, length: int) -> bytes | memoryview: ...
    def read_into(self, offset: int, buffer: memoryview) -> None: ...
    def check_unchanged(self, what: str) -> None: ...
    def prefetch(self, offset: int, length: int) -> None: ...
    def release(self, offset: int, length: int) -> None: ...
    def close(self) -> None: ...


class _LocalFile:
    """What both local sources share: the open handle, positional reads, the closed state."""

    def __init__(self, path: str):
        self.name = path
        self._handle = open(path, "rb")  # noqa: SIM115 - open for the store's whole life, closed by close()
        self._closed = False
        try:
            self.size = os.fstat(self._handle.fileno()).st_size
        except BaseException:
            self._handle.close()
            raise

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Copy bytes from the file into ``buffer`` without mapping them into this process."""
        self._check(offset, len(buffer))
        filled = 0  # positional reads: threads sharing one store never move each other's offset
        while filled < len(buffer):
            count = os.preadv(self._handle.fileno(), [buffer[filled:]], offset + filled)
            if not count:
                raise FormatError(f"{self.name}: short read at byte {offset + filled} (file truncated while open?)")
            filled += count

    def check_unchanged(self, what: str) -> None:
        """Refuse, naming ``what``, to read a file whose size changed since it was opened.

        It was rewritten in place (``cp``, ``rsync --inplace``): the index read at open no
        longer describes it, and pages of a map past its new end would kill the process with
        SIGBUS when touched.
        """
        if self._closed:
            raise StoreClosedError(f"{self.name}: store is closed; cannot read {what}")
        size = os.fstat(self._handle.fileno()).st_size
        if size != self.size:
            raise FormatError(
                f"{self.name}: file changed size since it was opened ({self.size} -> {size} bytes; rewritten "
                f"in place?); refusing to read {what}. Open it again."
            )

    def prefetch(self, offset: int, length: int) -> None:
        pass

    def release(self, offset: int, length: int) -> None:
        pass

    def _check(self, offset: int, length: int) -> None:
        if self._closed:
            raise StoreClosedError(f"{self.name}: store is closed")
        if offset < 0 or length < 0 or offset + length > self.size:
            raise FormatError(f"{self.name}: truncated file (needs bytes {offset}..{offset + length}, has {self.size})")

    def close(self) -> None:
        self._closed = True
        self._handle.close()


class MappedFile(_LocalFile):
    """A read-only map of a local file: tensors are views into the page cache, never copies.

    Writers replace files by rename, never in place, so a map stays valid for as long as any
    array made from it lives, even after the file is replaced. A file truncated *in place*
    is another matter: touching a page of an array already handed out that now lies past the
    file's end kills the process with SIGBUS, and a file rewritten in place changes such
    arrays under their holder. Readers call :meth:`check_unchanged` before each read, so the
    store's next read refuses cleanly; for arrays that must survive that, open with
    ``mmap=False`` (:class:`OwnedFile`).
    """

    def __init__(self, path: str):
        super().__init__(path)
        try:
            self._map = mmap.mmap(self._handle.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None
        except BaseException:
            self._handle.close()
            raise

    def read_at(self, offset: int, length: int) -> memoryview:
        self._check(offset, length)
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map)[offset : offset + length]

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

    def close(self) -> None:
        super().close()
        if self._map is not None:
            with contextlib.suppress(BufferError):  # arrays handed out still view the map; it closes with the last
                self._map.close()


class OwnedFile(_LocalFile):
    """A local file read with ``preadv`` into fresh memory: arrays own their bytes.

    Nothing is mapped, so no later change to the file can reach an array already read. Each
    buffer starts at the same offset modulo :data:`ALIGNMENT` as its bytes in the file, so a
    tensor the writer aligned in the file is aligned in memory too.
    """

    def check_unchanged(self, what: str) -> None:
        """Only whether it is closed: a file changed under positional reads fails them cleanly
        (a short read) or is caught by the header and checksum checks, and no array can change."""
        if self._closed:
            raise StoreClosedError(f"{self.name}: store is closed; cannot read {what}")

    def read_at(self, offset: int, length: int) -> memoryview:
        self._check(offset, length)
        raw = np.empty(length + ALIGNMENT, dtype=np.uint8)
        skip = (offset - raw.ctypes.data) % ALIGNMENT
        view = memoryview(raw[skip : skip + length])
        self.read_into(offset, view)
        return view


class StreamFile:
    """Ranged reads over any seekable binary file, such as an fsspec file on object storage."""

    def __init__(self, handle: BinaryIO, name: str):
        self.name = name
        self._handle = handle
        self._lock = threading.Lock()  # a seek and its read must not interleave with another thread's
        self.size = handle.seek(0, os.SEEK_END)

    def check_unchanged(self, what: str) -> None:
        """Objects are replaced whole, never changed under a reader: only the closed state to check."""
        if self._handle.closed:
            raise StoreClosedError(f"{self.name}: store is closed; cannot read {what}")

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

