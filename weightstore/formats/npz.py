"""npz: a zip of ``.npy`` members that ``np.load(path, allow_pickle=False)`` reads as is.

We write the zip ourselves rather than through :mod:`zipfile` so that each member's array
data starts on a 64-byte boundary (readers map it without copying), sizes and CRCs are known
before the local header is written, and ZIP64 is used exactly when needed. The reader parses
the central directory itself because the stdlib's ``zipfile`` on this Python accepts
overlapping members (zip bombs) and would let a hostile file choose our allocations.

This module is the format's entry in the table; the work is in three beside it:
:mod:`~weightstore.formats._npz_layout` (a member's header and alignment, shared),
:mod:`~weightstore.formats._npz_writer` and :mod:`~weightstore.formats._npz_reader`.
"""

from __future__ import annotations

from weightstore.formats import Format
from weightstore.formats._npz_reader import NpzReader
from weightstore.formats._npz_writer import NpzWriter
from weightstore.formats._zipdir import EOCD_SIG, LOCAL_SIG
from weightstore.io.source import open_source

__all__ = ["FORMAT", "NpzReader", "NpzWriter"]


def _open_reader(location, name: str, *, mmap: bool = True) -> NpzReader:
    """``mmap=False`` reads local tensors into memory they own instead of viewing a map of the file."""
    return open_source(location, name, NpzReader, index_at_end=True, mmap=mmap)


FORMAT = Format(
    name="npz",
    suffixes=(".npz",),
    magic=lambda head: head[:4] in (LOCAL_SIG, EOCD_SIG),
    open_reader=_open_reader,
    open_writer=lambda path, compress: NpzWriter(path, compress),
)
