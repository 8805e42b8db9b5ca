"""The bytes a reader reads: one :class:`ByteSource` protocol, local or remote, and the choice of one.

A format's reader is given a local path, a :class:`~weightstore.io.remote.RemoteFile` or an
open file object, and reads only through the source :func:`byte_source` makes of it, so it never
opens a file or talks to a storage service itself. Readers ask only for ranges they have proved
lie inside the file, and every source refuses one that does not, so no implementation needs to
trust a length it is given.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

from weightstore.errors import UnsafeFileError
from weightstore.io._local import MappedFile, OwnedFile, StreamFile
from weightstore.io.remote import RemoteFile

__all__ = ["ByteSource", "RangedSource", "beside", "byte_source", "open_source", "prefetch_ranges", "read_whole"]

R = TypeVar("R")


class ByteSource(Protocol):
    """Random access to a file's bytes (:mod:`weightstore.io._local`, :mod:`weightstore.io.remote`)."""

    name: str

    @property
    def size(self) -> int: ...

    def read_at(self, offset: int, length: int) -> bytes | memoryview: ...
    def read_into(self, offset: int, buffer: memoryview) -> None: ...
    def check_unchanged(self, what: str) -> None:
        """Refuse (naming ``what``) a read of a closed source or of a file changed since it was opened."""
    def prefetch(self, offset: int, length: int) -> None: ...
    def release(self, offset: int, length: int) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class RangedSource(Protocol):
    """The optional capability of a source whose reads cross a network: fetch many ranges at once."""

    def prefetch_ranges(self, ranges: list[tuple[int, int]]) -> None: ...


def byte_source(location: Any, name: str, *, mmap: bool = True) -> ByteSource:
    """The byte source for what a reader is given: a local path (mapped, or read into owned
    memory with ``mmap=False``), a remote file, or a file object."""
    if isinstance(location, str):
        return MappedFile(location) if mmap else OwnedFile(location)
    if isinstance(location, RemoteFile):
        return location
    return RemoteFile.from_handle(location, name) or StreamFile(location, name)


def beside(location: Any, name: str, file: str, *, up: int = 0) -> tuple[Any, str]:
    """``(location, name)`` of ``file`` in the folder of the file a reader was given as
    ``location``/``name`` (a local path, or a remote file: then read through the same file
    system), so a reader of several files (an index and its shards) opens them local or remote alike.
    ``file`` is a name the caller has checked (no ``..``); ``up`` folders above that one (a
    sharded version's member names its base relative to the versioned folder, one up)."""
    if isinstance(location, RemoteFile):
        url, path = posixpath.dirname(name), posixpath.dirname(location.path)
        for _ in range(up):
            url, path = posixpath.dirname(url), posixpath.dirname(path)
        url = posixpath.join(url, file)
        return RemoteFile(location.fs, posixpath.join(path, file), url), url
    folder = os.path.dirname(location)
    for _ in range(up):
        folder = os.path.dirname(folder)
    path = os.path.join(folder, file)
    return path, path


def read_whole(source: ByteSource, limit: int, what: str) -> bytes:
    """All of a small file parsed whole before anything else is read (a sharded index), then
    ``source`` closed; one larger than ``limit`` is refused before a byte of it is read."""
    try:
        if source.size > limit:
            raise UnsafeFileError(f"{what} of {source.size} bytes (limit {limit})", path=source.name)
        return bytes(source.read_at(0, source.size))
    finally:
        source.close()


def open_source(location: Any, name: str, read_index: Callable[[ByteSource], R], *, index_at_end: bool,
                mmap: bool = True) -> R:
    """A reader built over the byte source for ``location``; a remote file fetches the index
    window where this format keeps its index (``index_at_end``) in one request, a mapped one
    reads it in one ``pread`` and maps the file only for the first tensor read."""
    source = byte_source(location, name, mmap=mmap)
    try:
        if isinstance(source, (RemoteFile, MappedFile)):
            source.start(index_at_end)
        reader = read_index(source)
    except BaseException:
        source.close()
        raise
    if isinstance(source, (RemoteFile, MappedFile)):
        source.index_read()
    return reader


def prefetch_ranges(source: ByteSource, ranges: Callable[[], list[tuple[int, int]]]) -> None:
    """Tell a source that fetches over the network which byte ranges are read next; local
    sources need no warning, so ``ranges`` is only worked out for a remote one."""
    fetch = getattr(source, "prefetch_ranges", None)  # what isinstance of RangedSource asks, at a tenth of its cost
    if fetch is not None:
        fetch(ranges())
