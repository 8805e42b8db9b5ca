"""Random access to a file's bytes: memory-mapped when local, ranged reads when remote.

The npz reader only ever asks for byte ranges it has already proved lie inside the file, so
no implementation needs to trust a length it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import re
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

import numpy as np

from weightstore.errors import FormatError, StorageError, StoreClosedError, WeightStoreError

R = TypeVar("R")
#: the boundary tensor data is aligned to, in the file and in memory read from it
ALIGNMENT = 64


class ByteSource(Protocol):
    name: str

    @property
    def size(self) -> int: ...

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
                raise FormatError(f"short read at byte {offset + filled} (file truncated while open?)", path=self.name)
            filled += count

    def check_unchanged(self, what: str) -> None:
        """Refuse, naming ``what``, to read a file whose size changed since it was opened.

        It was rewritten in place (``cp``, ``rsync --inplace``): the index read at open no
        longer describes it, and pages of a map past its new end would kill the process with
        SIGBUS when touched.
        """
        if self._closed:
            raise StoreClosedError(f"store is closed; cannot read {what}", path=self.name)
        size = os.fstat(self._handle.fileno()).st_size
        if size != self.size:
            raise FormatError(
                f"file changed size since it was opened ({self.size} -> {size} bytes; rewritten "
                f"in place?); refusing to read {what}. Open it again.", path=self.name
            )

    def prefetch(self, offset: int, length: int) -> None:
        pass

    def release(self, offset: int, length: int) -> None:
        pass

    def _check(self, offset: int, length: int) -> None:
        if self._closed:
            raise StoreClosedError("store is closed", path=self.name)
        if offset < 0 or length < 0 or offset + length > self.size:
            raise FormatError(f"truncated file (needs bytes {offset}..{offset + length}, has {self.size})",
                              path=self.name)

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

    @property
    def mapping(self) -> mmap.mmap | None:
        """The whole map, for a reader that checks bounds itself and reads many small tensors in
        one loop (slicing the map costs less than a ``read_at`` per header); ``None`` when empty."""
        return self._map

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
            raise StoreClosedError(f"store is closed; cannot read {what}", path=self.name)

    def read_at(self, offset: int, length: int) -> memoryview:
        self._check(offset, length)
        raw = np.empty(length + ALIGNMENT, dtype=np.uint8)
        skip = (offset - raw.ctypes.data) % ALIGNMENT
        view = raw[skip : skip + length].data
        self.read_into(offset, view)
        return view


class StreamFile:
    """Ranged reads over any seekable binary file, such as an fsspec file on object storage."""

    def __init__(self, handle: Any, name: str):  # any binary file object with seek, read and readinto
        self.name = name
        self._handle = handle
        self._lock = threading.Lock()  # a seek and its read must not interleave with another thread's
        self.size = handle.seek(0, os.SEEK_END)

    def check_unchanged(self, what: str) -> None:
        """Objects are replaced whole, never changed under a reader: only the closed state to check."""
        if self._handle.closed:
            raise StoreClosedError(f"store is closed; cannot read {what}", path=self.name)

    def read_at(self, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise FormatError(f"truncated file (needs bytes {offset}..{offset + length}, has {self.size})",
                              path=self.name)
        with self._lock:
            self._handle.seek(offset)
            data = self._handle.read(length)
        if len(data) != length:
            raise FormatError(f"short read at byte {offset}", path=self.name)
        return data

    def read_into(self, offset: int, buffer: memoryview) -> None:
        if offset < 0 or offset + len(buffer) > self.size:
            raise FormatError(f"truncated file (needs bytes {offset}..{offset + len(buffer)}, "
                              f"has {self.size})", path=self.name)
        with self._lock:
            self._handle.seek(offset)
            filled = 0
            while filled < len(buffer):
                count = self._handle.readinto(buffer[filled:])
                if not count:
                    raise FormatError(f"short read at byte {offset + filled}", path=self.name)
                filled += count

    def prefetch(self, offset: int, length: int) -> None:
        pass

    def release(self, offset: int, length: int) -> None:
        pass

    def close(self) -> None:
        self._handle.close()


# -- object storage -------------------------------------------------------------------------

#: bytes the first request of a remote open asks for: the tail that holds an npz's zip directory
#: and manifest, or the head that holds a safetensors header (one request for up to ~350 tensors)
INDEX_WINDOW = 256 << 10
#: a remote read larger than this is fetched as parts of this size, at once (S3 serves each
#: connection at a fraction of its total bandwidth)
PART_BYTES = 8 << 20
#: concurrent requests per file when the file system names none (s3fs: ``max_concurrency``)
DEFAULT_CONCURRENCY = 8
#: prefetched ranges at most this far apart are fetched as one (the padding between tensors)
MERGE_GAP = 4096
_ALIGNMENT = 64


class RemoteFile:
    """A file on object storage read with ranged GETs of exactly the bytes a reader asks for.

    The index (an npz's tail, a safetensors header) comes in one request that also says the
    object's size and ETag; every later request carries ``If-Match`` with that ETag (S3), so an
    object replaced while open is a :class:`FormatError`, never a mix of two files. Nothing is
    read ahead: a tensor costs its own bytes. :meth:`prefetch_ranges` fetches the ranges of
    many tensors at once: neighbours joined into one range (a scope's tensors lie side by side),
    each range split into parts of :data:`PART_BYTES`, the parts requested concurrently (s3fs's
    ``max_concurrency`` storage option, default 10). A prefetched range is dropped once every
    tensor in it has been read, so its bytes live on only in the arrays made from them.
    """

    def __init__(self, fs: Any, path: str, name: str, *,
                 size: int | None = None, details: Mapping[str, Any] | None = None):
        self.name = name
        self._object = _S3Object(fs, path, name) if _is_s3(fs) else _FsspecObject(fs, path, name)
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

    def _grow_index(self, offset: int, length: int) -> _Span:
        """Fetch an index read that missed, joined to the window it touches so later index reads
        hit; grown at least fourfold towards the start, since an npz manifest lies before its
        directory and is often several times larger (so a large index still costs few requests)."""
        end = offset + length
        for position, span in enumerate(self._index):
            if offset <= span.end and end >= span.start:
                if offset < span.start:
                    offset = max(0, min(offset, span.start - 4 * len(span.data)))
                new_start, new_end = min(offset, span.start), max(end, span.end)
                data = _aligned_buffer(new_start, new_end - new_start)
                data[span.start - new_start : span.end - new_start] = span.data
                gaps = [(new_start, data[: span.start - new_start]), (span.end, data[span.end - new_start :])]
                self._object.fill([(at, view) for at, view in gaps if len(view)])
                self._index[position] = _Span(new_start, data)
                return self._index[position]
        data = _aligned_buffer(offset, length)
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
        data = _aligned_buffer(offset, length)
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
                    self._grow_index(offset, length)
                return
            self._ahead = []
        wanted = [_Span(start, _aligned_buffer(start, end - start), ends) for start, end, ends in _coalesce(missing)]
        self._object.fill([(span.start, span.data) for span in wanted])
        with self._lock:
            self._ahead = wanted

    def release(self, offset: int, length: int) -> None:
        pass

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise FormatError(f"truncated file (needs bytes {offset}..{offset + length}, has {self.size})",
                              path=self.name)

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


def _aligned_buffer(offset: int, length: int) -> memoryview:
    """A writable buffer whose address is ``offset`` modulo 64, so arrays made from the bytes
    of a file that aligns its tensors (npz, safetensors) are aligned in memory too."""
    raw = np.empty(length + _ALIGNMENT, np.uint8)
    shift = (offset - raw.ctypes.data) % _ALIGNMENT
    return raw[shift : shift + length].data.cast("B")


def _coalesce(ranges: list[tuple[int, int]]) -> list[tuple[int, int, set[int]]]:
    """``(start, end, ends of the ranges inside)`` with ranges at most :data:`MERGE_GAP` apart joined."""
    merged: list[tuple[int, int, set[int]]] = []
    for offset, length in sorted(ranges):
        end = offset + length
        if merged and offset <= merged[-1][1] + MERGE_GAP:
            start, last, ends = merged[-1]
            merged[-1] = (start, max(last, end), ends | {end})
        else:
            merged.append((offset, end, {end}))
    return merged


def _parts(ranges: list[tuple[int, memoryview]]) -> list[tuple[int, memoryview]]:
    return [(offset + at, view[at : at + PART_BYTES])
            for offset, view in ranges for at in range(0, len(view), PART_BYTES)]


def _is_s3(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocol and hasattr(fs, "_call_s3")


def _storage_error(exc: BaseException, name: str) -> StorageError:
    return StorageError(f"storage failed ({type(exc).__name__}: {str(exc).strip() or 'no detail'})", path=name)


def _window(index_at_end: bool, size: int, window: int) -> tuple[int, int]:
    return (max(0, size - window), size) if index_at_end else (0, min(size, window))


class _FsspecObject:
    """Any fsspec file system: the size from ``info``, ranges from ``cat_ranges`` (concurrent
    on asynchronous file systems). Without an ETag, a replaced object shows only as a changed
    length: a short read is a :class:`FormatError`."""

    def __init__(self, fs: Any, path: str, name: str):
        self._fs, self._path, self.name = fs, path, name

    def first(self, index_at_end: bool, window: int, size: int | None,
              details: Mapping[str, Any] | None) -> tuple[int, int, memoryview]:
        if size is None:
            try:
                info = self._fs.info(self._path)
            except FileNotFoundError:
                raise
            except Exception as exc:
                raise _storage_error(exc, self.name) from exc
            if info.get("type") == "directory":
                raise FileNotFoundError(self.name)
            size = int(info["size"])
        start, end = _window(index_at_end, size, window)
        data = _aligned_buffer(start, end - start)
        self.fill([(start, data)], opening=True)
        return size, start, data

    def fill(self, ranges: list[tuple[int, memoryview]], opening: bool = False) -> None:
        parts = _parts(ranges)
        if not parts:
            return
        try:
            found = self._fs.cat_ranges([self._path] * len(parts), [at for at, _ in parts],
                                        [at + len(view) for at, view in parts], on_error="raise")
        except FileNotFoundError:
            if opening:
                raise
            raise FormatError("the file was removed while it was open", path=self.name) from None
        except Exception as exc:
            raise _storage_error(exc, self.name) from exc
        for (at, view), data in zip(parts, found, strict=True):
            if len(data) != len(view):
                raise FormatError(f"got {len(data)} bytes at byte {at}, not {len(view)}: "
                                  f"the file is shorter than when it was opened (replaced while open?)", path=self.name)
            view[:] = data


class _S3Object:
    """An S3 object through s3fs's client: the first request is a suffix range (``bytes=-N``), whose
    ``Content-Range`` gives the size, so opening costs one request; later ones carry ``If-Match``."""

    def __init__(self, fs: Any, path: str, name: str):
        self._fs, self.name = fs, name
        self._bucket, self._key, version = fs.split_path(path)
        self._pinned: dict[str, str] = {"VersionId": version} if version else {}
        self.concurrency = max(1, int(getattr(fs, "max_concurrency", None) or DEFAULT_CONCURRENCY))

    def first(self, index_at_end: bool, window: int, size: int | None,
              details: Mapping[str, Any] | None) -> tuple[int, int, memoryview]:
        if size is not None:
            self._pin(details or {})
            start, end = _window(index_at_end, size, window)
            data = _aligned_buffer(start, end - start)
            self.fill([(start, data)], opening=True)
            return size, start, data
        wanted = f"bytes=-{window}" if index_at_end else f"bytes=0-{window - 1}"
        try:
            response, body = self._run(self._get, wanted, True, opening=True)
        except _EmptyObject:
            return 0, 0, memoryview(b"")
        self._pin(response)
        total, start = len(body), 0
        match = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", str(response.get("ContentRange", "")))
        if match:
            start, total = int(match.group(1)), int(match.group(3))
        if start + len(body) > total:
            raise FormatError("the storage returned more bytes than the object holds", path=self.name)
        data = _aligned_buffer(start, len(body))
        data[:] = body
        return total, start, data

    def _pin(self, described: Mapping[str, Any]) -> None:
        etag = described.get("ETag") or described.get("etag")
        if etag and "VersionId" not in self._pinned:
            self._pinned["IfMatch"] = str(etag)

    def fill(self, ranges: list[tuple[int, memoryview]], opening: bool = False) -> None:
        parts = _parts(ranges)
        if parts:
            self._run(self._fill, parts, opening=opening)

    async def _fill(self, parts: list[tuple[int, memoryview]]) -> None:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(at: int, view: memoryview) -> None:
            async with gate:
                _, data = await self._get(f"bytes={at}-{at + len(view) - 1}")
            if len(data) != len(view):
                raise FormatError(f"got {len(data)} bytes at byte {at}, not {len(view)}: "
                                  f"the object is shorter than its index says", path=self.name)
            view[:] = data

        await asyncio.gather(*(one(at, view) for at, view in parts))

    async def _get(self, wanted: str, empty_is_ok: bool = False) -> tuple[Mapping[str, Any], bytes]:
        try:
            response = await self._fs._call_s3("get_object", Bucket=self._bucket, Key=self._key,
                                               Range=wanted, **self._pinned)
        except OSError as exc:
            code = _s3_code(exc)
            if empty_is_ok and code in ("InvalidRange", "416"):
                raise _EmptyObject() from None
            raise
        body = response["Body"]
        try:
            return response, await body.read()
        finally:
            body.close()

    def _run(self, method: Any, *args: Any, opening: bool = False) -> Any:
        from fsspec.asyn import sync

        try:
            return sync(self._fs.loop, method, *args)
        except (WeightStoreError, _EmptyObject):
            raise
        except FileNotFoundError:
            if opening:
                raise
            raise FormatError("the object was removed while it was open", path=self.name) from None
        except Exception as exc:
            if _s3_code(exc) in ("PreconditionFailed", "412"):
                raise FormatError("the object changed while it was open (its ETag no longer matches); open it again",
                                  path=self.name) from None
            if _s3_code(exc) in ("InvalidRange", "416"):
                raise FormatError("the object is shorter than its index says", path=self.name) from None
            raise _storage_error(exc, self.name) from exc


class _EmptyObject(Exception):
    """S3 refuses any range of an empty object."""


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code behind an exception s3fs translated (it keeps the botocore error as the cause)."""
    seen = 0
    while exc is not None and seen < 5:
        response = getattr(exc, "response", None)
        if isinstance(response, Mapping):
            error = response.get("Error") or {}
            return str(error.get("Code") or response.get("ResponseMetadata", {}).get("HTTPStatusCode") or "")
        exc, seen = exc.__cause__ or exc.__context__, seen + 1  # type: ignore[assignment]
    return None


# -- choosing a source ----------------------------------------------------------------------

def byte_source(location: Any, name: str, *, mmap: bool = True) -> ByteSource:
    """The byte source for what a reader is given: a local path (mapped, or read into owned
    memory with ``mmap=False``), a remote file, or a file object."""
    if isinstance(location, str):
        return MappedFile(location) if mmap else OwnedFile(location)
    if isinstance(location, RemoteFile):
        return location
    return RemoteFile.from_handle(location, name) or StreamFile(location, name)


def open_source(location: Any, name: str, read_index: Callable[[ByteSource], R], *, index_at_end: bool,
                mmap: bool = True) -> R:
    """A reader built over the byte source for ``location``; a remote file fetches the index
    window where this format keeps its index (``index_at_end``), in one request."""
    source = byte_source(location, name, mmap=mmap)
    try:
        if isinstance(source, RemoteFile):
            source.start(index_at_end)
        reader = read_index(source)
    except BaseException:
        source.close()
        raise
    if isinstance(source, RemoteFile):
        source.index_read()
    return reader


def prefetch_ranges(source: ByteSource, ranges: Callable[[], list[tuple[int, int]]]) -> None:
    """Tell a source that fetches over the network which byte ranges are read next; local
    sources need no warning, so ``ranges`` is only worked out for a remote one."""
    fetch = getattr(source, "prefetch_ranges", None)
    if fetch is not None:
        fetch(ranges())
