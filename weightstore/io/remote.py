"""A file on object storage read with ranged requests of exactly the bytes a reader asks for.

:class:`RemoteFile` is the :class:`~weightstore.io.source.ByteSource` of every URL; what it asks
of the storage service goes through a backend (:class:`~weightstore.io.objects.RemoteObject`)
chosen by :func:`~weightstore.io.backends.backend_for`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from weightstore.errors import StoreClosedError
from weightstore.io._buffer import aligned_buffer
from weightstore.io._local import check_range
from weightstore.io.backends import backend_for

__all__ = ["INDEX_WINDOW", "RemoteFile"]

#: bytes the first request of a remote open asks for: the tail that holds an npz's zip directory
#: and manifest, or the head that holds a safetensors header. One request for the index of up to
#: ~380 npz tensors (~250 bytes each with keys of ~25 characters) or ~1,000 safetensors ones; a
#: larger index costs one more, of what the reader then knows it lacks. Kept small because every
#: selective read pays it: a 1 MB tensor of a large file comes with 1.09x its bytes (1.25x at 256 KB)
INDEX_WINDOW = 96 << 10

class RemoteFile:
    """A file on object storage read with ranged GETs of exactly the bytes a reader asks for.

    The index (an npz's tail, a safetensors header) comes in one request that also says the
    object's size and ETag; every later request carries ``If-Match`` with that ETag (S3), so an
    object replaced while open is a :class:`FormatError`, never a mix of two files. Nothing is
    read ahead: a tensor costs its own bytes. :meth:`prefetch_ranges` fetches the ranges of
    many tensors at once, each into a buffer of its own (so an array made from one holds only
    its own tensor's memory, and a framework may keep it as a variable's buffer); the backend
    joins neighbours into one request (:data:`~weightstore.io.objects.MERGE_GAP`: a scope's
    tensors lie side by side) and splits large ones into parts of
    :data:`~weightstore.io.objects.PART_BYTES`, requested concurrently (s3fs's
    ``max_concurrency`` storage option, default 10). A prefetched range is dropped once every
    tensor in it has been read, so its bytes live on only in the arrays made from them.
    """

    def __init__(self, fs: Any, path: str, name: str, *,
                 size: int | None = None, details: Mapping[str, Any] | None = None):
        self.name = name
        self.fs = fs  # what a sharded index's members are read through: the same storage options
        self.path = path  # where on ``fs``: a file beside this one is read through the same (:func:`~weightstore.io.source.beside`)
        self._object = backend_for(fs).object(fs, path, name)
        self._known = (size, details)
        self._size: int | None = None
        self._index: list[_Span] = []  # fetched while the reader reads its index; kept until close
        self._ahead: list[_Span] = []  # prefetched for reads to come; each dropped once all are read
        self._indexing = True
        self._closed = False
        self._lock = threading.Lock()

    @classmethod
    def from_handle(cls, handle: Any, name: str) -> RemoteFile | None:
        """The remote file behind an fsspec file object, reusing the size and ETag it already knows."""
        fs, path, details = getattr(handle, "fs", None), getattr(handle, "path", None), getattr(handle, "details", None)
        if fs is None or not isinstance(path, str) or not isinstance(details, Mapping) or "size" not in details:
            return None
        handle.close()
        return cls(fs, path, name, size=int(details["size"]), details=details)

    # -- the index ------------------------------------------------------------------------
    def start(self, index_at_end: bool) -> None:
        """Fetch the index window, from the end or the start of the object; once, before any read."""
        if self._size is not None:
            return
        size, details = self._known
        self._size, start, data = self._object.first(index_at_end, INDEX_WINDOW, size, details)
        self._index.append(_Span(start, data))

    @property
    def size(self) -> int:
        if self._size is None:
            self.start(index_at_end=False)
        assert self._size is not None
        return self._size

    def index_read(self) -> None:
        """The reader has its index: from now on a miss fetches only what it asks for."""
        self._indexing = False

    def _grow_index(self, offset: int, length: int, *, exact: bool = False) -> _Span:
        """Fetch an index read that missed, joined to the window it touches so later index reads
        hit. A read (an npz's directory) grows towards the start to four times the bytes from it
        to the window's end, since an npz manifest lies before its directory and is some 2.5
        times larger (so a large index still costs two requests); an ``exact`` one (a range the
        reader announced: the manifest, whose extent the directory gave) is fetched as asked."""
        end = offset + length
        for position, span in enumerate(self._index):
            if offset <= span.end and end >= span.start:
                if offset < span.start and not exact:
                    offset = max(0, span.end - 4 * (span.end - offset))
                new_start, new_end = min(offset, span.start), max(end, span.end)
                data = aligned_buffer(new_end - new_start, new_start)
                data[span.start - new_start : span.end - new_start] = span.data
                gaps = [(new_start, data[: span.start - new_start]), (span.end, data[span.end - new_start :])]
                self._object.fill([(at, view) for at, view in gaps if len(view)])
                self._index[position] = _Span(new_start, data)
                return self._index[position]
        data = aligned_buffer(length, offset)
        self._object.fill([(offset, data)])
        self._index.append(_Span(offset, data))
        return self._index[-1]

    # -- the ByteSource protocol ----------------------------------------------------------------
    def read_at(self, offset: int, length: int) -> memoryview:
        self._check(offset, length)
        with self._lock:
            held = self._held(offset, length)
            if held is not None:
                return held
            if self._indexing and length:
                return self._grow_index(offset, length).view(offset, length)
        data = aligned_buffer(length, offset)
        if length:
            self._object.fill([(offset, data)])
        return data.toreadonly()

    def read_into(self, offset: int, buffer: memoryview) -> None:
        buffer = buffer.cast("B")
        self._check(offset, len(buffer))
        with self._lock:
            held = self._held(offset, len(buffer))
        if held is not None:
            buffer[:] = held
        elif len(buffer):
            self._object.fill([(offset, buffer)])

    def _held(self, offset: int, length: int) -> memoryview | None:
        """The bytes if already fetched; a prefetched range is let go once all of it is read."""
        for span in self._index:
            if span.holds(offset, length):
                return span.view(offset, length)
        for span in self._ahead:
            if span.holds(offset, length):
                span.unread.discard(offset + length)
                if not span.unread:
                    self._ahead.remove(span)
                return span.view(offset, length)
        return None

    def prefetch(self, offset: int, length: int) -> None:
        self.prefetch_ranges([(offset, length)])

    def prefetch_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """Fetch these ranges now, concurrently, for the reads that follow.

        Ranges already fetched are left as they are; otherwise prefetched ranges not yet read
        are dropped first, so at most one batch is held. While the index is read, the ranges
        join the index window instead.
        """
        with self._lock:
            for offset, length in ranges:
                self._check(offset, length)
            missing = [(offset, length) for offset, length in ranges
                       if length and not any(span.holds(offset, length) for span in self._index + self._ahead)]
            if not missing:
                return
            if self._indexing:
                for offset, length in missing:
                    self._grow_index(offset, length, exact=True)
                return
            self._ahead = []
        wanted = [_Span(start, aligned_buffer(end - start, start), ends) for start, end, ends in _overlapping(missing)]
        self._object.fill([(span.start, span.data) for span in wanted])
        with self._lock:
            self._ahead = wanted

    def release(self, offset: int, length: int) -> None:
        pass

    def _check(self, offset: int, length: int) -> None:
        check_range(offset, length, self.size, self.name)

    def check_unchanged(self, what: str) -> None:
        """Only whether it is closed: every request after the index carries the object's ETag,
        so an object replaced while open fails that request instead."""
        if self._closed:
            raise StoreClosedError(f"store is closed; cannot read {what}", path=self.name)

    def close(self) -> None:
        with self._lock:
            self._index, self._ahead = [], []
            self._closed = True


class _Span:
    """Fetched bytes of the object starting at ``start``; ``unread``: where the prefetched
    ranges in it end, each removed when a read ends there (the last read of a tensor)."""

    __slots__ = ("start", "data", "unread")

    def __init__(self, start: int, data: memoryview, unread: set[int] | None = None):
        self.start, self.data, self.unread = start, data, unread or set()

    @property
    def end(self) -> int:
        return self.start + len(self.data)

    def holds(self, offset: int, length: int) -> bool:
        return self.start <= offset and offset + length <= self.end

    def view(self, offset: int, length: int) -> memoryview:
        return self.data[offset - self.start : offset - self.start + length].toreadonly()


def _overlapping(ranges: list[tuple[int, int]]) -> list[tuple[int, int, set[int]]]:
    """``(start, end, ends of the ranges inside)`` with overlapping ranges joined (a read must lie
    in one buffer); ranges that merely touch keep buffers of their own."""
    merged: list[tuple[int, int, set[int]]] = []
    for offset, length in sorted(ranges):
        end = offset + length
        if merged and offset < merged[-1][1]:
            start, last, ends = merged[-1]
            merged[-1] = (start, max(last, end), ends | {end})
        else:
            merged.append((offset, end, {end}))
    return merged
