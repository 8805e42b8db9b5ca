"""Files read only at byte ranges another file's index gives: the members of a sharded version.

A plain store reads its own header first; a member of a sharded version never needs to, since
the version's index says where each piece's bytes lie and what their CRC-32s are. So a reader
of a region fetches exactly the blocks it asks for: locally by ``preadv``
(:class:`~weightstore.io._local.OwnedFile`), on object storage by ranged GETs through the
backend table of :mod:`weightstore.io.backends`, with no index window and no ``If-Match`` (the
CRCs in the index pin the bytes: a member replaced under the index fails its checksums).
"""

from __future__ import annotations

import inspect
from typing import Any

from weightstore.errors import StoreNotFoundError
from weightstore.io._local import OwnedFile, check_range
from weightstore.io.backends import backend_for
from weightstore.io.location import location_of, on_filesystem, service, uncached
from weightstore.io.objects import MERGE_GAP, RemoteObject

__all__ = ["RangedFile"]


def joinable_gap(ranges: list[tuple[int, memoryview]]) -> int:
    """The largest gap between two wanted views that one request reads across: at most
    :data:`~weightstore.io.objects.MERGE_GAP` and 1/16 of the smallest view, so what is read and
    dropped stays under 1/16 of what was asked for (an npz member's headers between its column
    strips cost no request each; a neighbour's piece between two small ones is not fetched)."""
    return min(MERGE_GAP, min((len(view) for _, view in ranges), default=0) // 16)


class RangedFile:
    """A local or remote file whose byte ranges are filled on request.

    A local file is opened at once (so a version pruned while it is read keeps its members, as
    a plain version's mapped file does); a remote one is only described, and its size asked
    for (one ``HEAD``) before its first read, so no range past its end is ever allocated.
    """

    #: the files it holds open (a sharded reader counts them against its budget)
    files = 1

    def __init__(self, location: str, *, fs: Any = None):
        where = location_of(location)
        self.name = where.text
        self._local: OwnedFile | None = None
        self._object: RemoteObject | None = None
        self._fs, self._path, self._size = fs, "", -1
        self._exact = False  # whether the backend's fill takes a gap (one written before may not)
        if not where.remote:
            self._local = OwnedFile(where.text)
            self._size = self._local.size
        else:
            self._fs, self._path = on_filesystem(where.text, fs)

    @property
    def size(self) -> int:
        if self._size < 0:
            with service(self.name):
                info = self._fs.info(uncached(self._fs, self._path))
            self._size = int(info.get("size") or 0)
        return self._size

    def fill(self, ranges: list[tuple[int, memoryview]]) -> None:
        """Fill each view with the file's bytes from its offset (a remote file: concurrently)."""
        for offset, view in ranges:
            check_range(offset, len(view), self.size, self.name)
        if self._local is not None:
            for offset, view in ranges:
                self._local.read_into(offset, view)
            return
        if self._object is None:
            self._object = backend_for(self._fs).object(self._fs, self._path, self.name)
            self._exact = "gap" in inspect.signature(self._object.fill).parameters
        wanted = [(offset, view) for offset, view in ranges if len(view)]
        try:
            self._object.fill(wanted, gap=joinable_gap(wanted)) if self._exact else self._object.fill(wanted)
        except FileNotFoundError:
            raise StoreNotFoundError("the member was removed while it was read", path=self.name) from None

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
