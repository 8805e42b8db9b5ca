"""What a backend for files on object storage provides: :class:`RemoteObject`, and the table of them.

:class:`~weightstore.io.remote.RemoteFile` does the caching, coalescing and bookkeeping every
remote file needs and asks its backend only two things: the first window of the object (which
also tells the object's size, and lets the backend pin the object so a replaced one is noticed)
and filling byte ranges. A backend is one module with one class implementing
:class:`RemoteObject`, named in the table :data:`weightstore.io.remote.BACKENDS`: S3 through
s3fs's client (:mod:`weightstore.io.s3`, with ETag pinning) before the generic fsspec one
(:mod:`weightstore.io.fsspec_objects`), which serves every other file system.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["PART_BYTES", "RemoteObject", "split_parts", "window"]

#: a remote read larger than this is fetched as parts of this size, at once (S3 serves each
#: connection at a fraction of its total bandwidth)
PART_BYTES = 8 << 20


class RemoteObject(Protocol):
    """One object on a storage service, as a backend reads it. Errors: a missing object is
    ``FileNotFoundError`` when ``opening`` (else a :class:`~weightstore.errors.FormatError`: it was
    removed while open); an object shorter than asked for, or replaced while open, is a
    ``FormatError``; a failure of the service is :func:`~weightstore.io.location.storage_error`."""

    name: str

    def first(self, index_at_end: bool, window: int, size: int | None,
              details: Mapping[str, Any] | None) -> tuple[int, int, memoryview]:
        """``(object size, start, bytes)`` of the first ``window`` bytes at the start or end;
        ``size`` and ``details`` (an fsspec info dict) when the caller already knows them."""

    def fill(self, ranges: list[tuple[int, memoryview]], opening: bool = False) -> None:
        """Fill each view with the object's bytes from its offset (split by :func:`split_parts`)."""


def split_parts(ranges: list[tuple[int, memoryview]]) -> list[tuple[int, memoryview]]:
    """Each range as parts of at most :data:`PART_BYTES`, requested concurrently by a backend."""
    return [(offset + at, view[at : at + PART_BYTES])
            for offset, view in ranges for at in range(0, len(view), PART_BYTES)]


def window(index_at_end: bool, size: int, length: int) -> tuple[int, int]:
    """``(start, end)`` of the first ``length`` bytes read of an object of ``size``, at its end or start."""
    return (max(0, size - length), size) if index_at_end else (0, min(size, length))
