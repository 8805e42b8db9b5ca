"""The generic backend: any fsspec file system, read with ``info`` and ``cat_ranges``.

Without an ETag to pin, an object replaced while open shows only as a changed length: a short
read is a :class:`FormatError`. Without a conditional write, a pointer is replaced by a check
and then a plain write, which two writers can interleave: this backend says so
(``compare_and_swap = False``), and a versioned folder refuses to publish through it unless its
caller vouches that it is the one writer. Serves every file system no other backend claims, so
it is the last entry of :data:`weightstore.io.backends.BACKEND_MODULES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightstore.errors import FormatError, StoreNotFoundError
from weightstore.io._buffer import aligned_buffer
from weightstore.io.location import service, uncached
from weightstore.io.objects import MERGE_GAP, Backend, Request, requests_for, scatter, window

__all__ = ["BACKEND", "FsspecBackend", "FsspecObject"]

#: bytes of requests handed to ``cat_ranges`` at once: it returns whole bodies, so this bounds
#: what is held twice (body and view) while many small requests still go together
BATCH_BYTES = 64 << 20


class FsspecObject:
    """An object on any fsspec file system: the size from ``info``, ranges from ``cat_ranges``
    (concurrent on asynchronous file systems)."""

    def __init__(self, fs: Any, path: str, name: str):
        self._fs, self._path, self.name = fs, path, name

    def first(self, index_at_end: bool, length: int, size: int | None,
              details: Mapping[str, Any] | None) -> tuple[int, int, memoryview]:
        if size is None:
            with service(self.name):
                info = self._fs.info(uncached(self._fs, self._path))
            if info.get("type") == "directory":
                raise FileNotFoundError(self.name)
            size = int(info["size"])
        start, end = window(index_at_end, size, length)
        data = aligned_buffer(end - start, start)
        self.fill([(start, data)], opening=True)
        return size, start, data

    def fill(self, ranges: list[tuple[int, memoryview]], opening: bool = False, gap: int = MERGE_GAP) -> None:
        for batch in _batches(requests_for(ranges, gap)):
            try:
                with service(self.name):
                    found = self._fs.cat_ranges([self._path] * len(batch), [request.start for request in batch],
                                                [request.end for request in batch], on_error="raise")
            except FileNotFoundError:
                if opening:
                    raise
                raise StoreNotFoundError("the file was removed while it was open", path=self.name) from None
            for request, data in zip(batch, found, strict=True):
                if len(data) != request.end - request.start:
                    raise FormatError(f"got {len(data)} bytes at byte {request.start}, not {request.end - request.start}: "
                                      f"the file is shorter than when it was opened (replaced while open?)", path=self.name)
                scatter(request.targets, request.start, memoryview(data))


def _batches(requests: list[Request]) -> list[list[Request]]:
    """``requests`` in order, in runs of at most :data:`BATCH_BYTES` (a larger request alone)."""
    batches: list[list[Request]] = []
    filled = 0
    for request in requests:
        size = request.end - request.start
        if not batches or filled + size > BATCH_BYTES:
            batches.append([])
            filled = 0
        batches[-1].append(request)
        filled += size
    return batches


class FsspecBackend(Backend):
    """Any fsspec file system: :class:`FsspecObject` reads; writes that check, then write plainly."""

    compare_and_swap = False

    def serves(self, fs: Any) -> bool:
        return True

    def object(self, fs: Any, path: str, name: str) -> FsspecObject:
        return FsspecObject(fs, path, name)

    def read_tagged(self, fs: Any, path: str, limit: int) -> tuple[bytes | None, str | None]:
        """At most ``limit`` bytes of the object, read through a file opened on it (which asks no
        range of an empty object: S3-like services refuse one), so a hostile object of gigabytes
        brings no more into memory; and no tag: nothing here could require it unchanged."""
        try:
            with fs.open(uncached(fs, path), "rb", block_size=limit, cache_type="none") as handle:
                return bytes(handle.read(limit)), None
        except FileNotFoundError:
            return None, None

    def put_if(self, fs: Any, path: str, data: bytes, *, create: bool, expect: str | None) -> bool:
        """Creation is checked first, ``expect`` not at all; then a plain write (see the module
        docstring: only for a folder whose caller vouched to be its one writer)."""
        if create and fs.exists(uncached(fs, path)):
            return False
        fs.pipe_file(path, data)
        return True


BACKEND = FsspecBackend()
