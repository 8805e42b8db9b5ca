"""What a backend for object storage provides: :class:`Backend`, ranged reads and conditional writes.

A backend is one module per storage service, defining ``BACKEND``, an instance of
:class:`Backend`, and named in the one table :data:`weightstore.io.backends.BACKEND_MODULES`. It
does both things weightstore asks of a service:

* reads: :class:`~weightstore.io.remote.RemoteFile` does the caching, coalescing and
  bookkeeping every remote file needs and asks the backend's :class:`RemoteObject` only two
  things: the first window of the object (which also tells the object's size, and lets the
  backend pin the object so a replaced one is noticed) and filling byte ranges;
* conditional writes: a versioned folder's ``LATEST`` (and a sharded version's index) is
  replaced by compare-and-swap (:meth:`Backend.read_tagged`, :meth:`Backend.put_if`), so of two
  publishers exactly one wins. A backend whose service offers no such write says so
  (:attr:`Backend.compare_and_swap` is False), and a publish there is refused unless its
  caller vouches that it is the folder's one writer
  (:meth:`weightstore.io.folders.Folder.require_compare_and_swap`): a plain write would let a
  lost race move ``LATEST`` backwards unseen.

S3 through s3fs's client (:mod:`weightstore.io.s3`: ETag pinning, ``If-Match`` and
``If-None-Match`` writes) comes before the generic fsspec one
(:mod:`weightstore.io.fsspec_objects`), which serves every other file system and has no
compare-and-swap.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["MERGE_GAP", "PART_BYTES", "READ_CHUNK", "Backend", "RemoteObject", "Request", "requests_for", "scatter",
           "window"]

#: a remote read larger than this is fetched as parts of this size, at once (S3 serves each
#: connection at a fraction of its total bandwidth)
PART_BYTES = 8 << 20
#: views at most this far apart in the object are filled by one request (the padding between tensors)
MERGE_GAP = 4096
#: the most of a response body taken off the wire at once: bodies are copied into the caller's
#: views as they arrive, never held whole (a version's worth of them would be a second copy of it)
READ_CHUNK = 1 << 20


class RemoteObject(Protocol):
    """One object on a storage service, as a backend reads it. Errors: a missing object is
    ``FileNotFoundError`` when ``opening`` (else a :class:`~weightstore.errors.StoreNotFoundError`:
    it was removed while open); an object shorter than asked for, or replaced while open, is a
    ``FormatError``; a failure of the service is :func:`~weightstore.io.location.storage_error`."""

    name: str

    def first(self, index_at_end: bool, window: int, size: int | None,
              details: Mapping[str, Any] | None) -> tuple[int, int, memoryview]:
        """``(object size, start, bytes)`` of the first ``window`` bytes at the start or end;
        ``size`` and ``details`` (an fsspec info dict) when the caller already knows them."""

    def fill(self, ranges: list[tuple[int, memoryview]], opening: bool = False, gap: int = MERGE_GAP) -> None:
        """Fill each view with the object's bytes from its offset (requested as :func:`requests_for` says, views
        at most ``gap`` bytes apart joined)."""


class Backend(abc.ABC):
    """One storage service, as weightstore reads and conditionally writes it (see the module docstring).

    Every method takes the fsspec file system (``fs``) and the path on it: the backend holds no
    state, so one instance serves every file system it :meth:`serves`.
    """

    #: whether :meth:`put_if` is the service's own atomic conditional write; False: it checks,
    #: then writes, and two writers in between overwrite each other unseen
    compare_and_swap: bool = True

    @abc.abstractmethod
    def serves(self, fs: Any) -> bool:
        """Whether this backend reads and writes the files of ``fs`` (the first in the table that does, does)."""

    @abc.abstractmethod
    def object(self, fs: Any, path: str, name: str) -> RemoteObject:
        """The object at ``path``, for ranged reads; ``name`` is the URL errors give as their path."""

    @abc.abstractmethod
    def read_tagged(self, fs: Any, path: str, limit: int) -> tuple[bytes | None, str | None]:
        """At most ``limit`` bytes of a small object and the tag :meth:`put_if` can require is
        unchanged (an ETag), from one request, so the tag is the read content's; ``(None, None)``
        when there is no object, a ``None`` tag where the service has none."""

    @abc.abstractmethod
    def put_if(self, fs: Any, path: str, data: bytes, *, create: bool, expect: str | None) -> bool:
        """Write small object ``path`` only if there is none (``create``), or only if the one
        there still has tag ``expect``; False (nothing written) when the condition failed."""

    def abort_uploads(self, fs: Any, folder: str, dead: Callable[[str], bool]) -> list[str]:
        """Abort the unfinished uploads of objects in ``folder`` (a path) whose name there
        (``sub/name`` inside a folder in it) ``dead`` says a dead writer left (S3: a multipart
        upload a killed process never completed nor aborted, whose parts the service keeps, and
        bills, until then); the names aborted. A service whose objects appear whole or not at
        all keeps nothing of a killed upload: none."""
        return []


@dataclass
class Request:
    """One ranged request: the object's bytes ``start`` to ``end`` and the views they fill (``targets``,
    by object offset, in order); bytes between targets are read and dropped."""

    start: int
    end: int
    targets: list[tuple[int, memoryview]]


def requests_for(ranges: list[tuple[int, memoryview]], gap: int = MERGE_GAP) -> list[Request]:
    """The requests that fill ``ranges``, made concurrently by a backend: a view larger than
    :data:`PART_BYTES` in parts of that size, and views at most ``gap`` (:data:`MERGE_GAP`) apart
    joined into one request of at most :data:`PART_BYTES` (a scope's tensors lie side by side,
    each in its own buffer)."""
    parts = sorted(((offset + at, view[at : at + PART_BYTES])
                    for offset, view in ranges for at in range(0, len(view), PART_BYTES)),
                   key=lambda part: part[0])
    requests: list[Request] = []
    for at, view in parts:
        end = at + len(view)
        last = requests[-1] if requests else None
        if last is not None and at <= last.end + gap and max(end, last.end) - last.start <= PART_BYTES:
            last.end = max(last.end, end)
            last.targets.append((at, view))
        else:
            requests.append(Request(at, end, [(at, view)]))
    return requests


def scatter(targets: list[tuple[int, memoryview]], at: int, chunk: memoryview, first: int = 0) -> int:
    """Copy ``chunk`` (the object's bytes from offset ``at``) into the parts of ``targets`` it
    covers; returns the index of the first target not yet filled, to pass as ``first`` with
    the next chunk (chunks arrive in order, so a stream of them costs one pass over the targets)."""
    end = at + len(chunk)
    for offset, view in targets[first:]:
        if offset >= end:
            break
        low, high = max(at, offset), min(end, offset + len(view))
        if low < high:
            view[low - offset : high - offset] = chunk[low - at : high - at]
    while first < len(targets) and targets[first][0] + len(targets[first][1]) <= end:
        first += 1
    return first


def window(index_at_end: bool, size: int, length: int) -> tuple[int, int]:
    """``(start, end)`` of the first ``length`` bytes read of an object of ``size``, at its end or start."""
    return (max(0, size - length), size) if index_at_end else (0, min(size, length))
