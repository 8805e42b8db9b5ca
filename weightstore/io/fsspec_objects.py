"""The generic backend: any fsspec file system, read with ``info`` and ``cat_ranges``.

Without an ETag to pin, an object replaced while open shows only as a changed length: a short
read is a :class:`FormatError`. Serves every file system no other backend claims, so it is the
last entry of :data:`weightstore.io.remote.BACKENDS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightstore.errors import FormatError
from weightstore.io.buffer import aligned_buffer
from weightstore.io.location import service, uncached
from weightstore.io.objects import split_parts, window

__all__ = ["FsspecObject"]


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

    def fill(self, ranges: list[tuple[int, memoryview]], opening: bool = False) -> None:
        parts = split_parts(ranges)
        if not parts:
            return
        try:
            with service(self.name):
                found = self._fs.cat_ranges([self._path] * len(parts), [at for at, _ in parts],
                                            [at + len(view) for at, view in parts], on_error="raise")
        except FileNotFoundError:
            if opening:
                raise
            raise FormatError("the file was removed while it was open", path=self.name) from None
        for (at, view), data in zip(parts, found, strict=True):
            if len(data) != len(view):
                raise FormatError(f"got {len(data)} bytes at byte {at}, not {len(view)}: "
                                  f"the file is shorter than when it was opened (replaced while open?)", path=self.name)
            view[:] = data

