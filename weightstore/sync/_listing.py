"""``ws versions``: every version file of a folder, with the one ``LATEST`` names marked."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightstore.core.limits import MAX_V1_INDEX_BYTES
from weightstore.errors import (
    FormatError,
    WeightStoreError,
)
from weightstore.formats import delta as delta_format
from weightstore.io.folders import Folder
from weightstore.sync._folder import SHARDED_SUFFIX, not_file_versions, read_index, require_folder, version_files
from weightstore.sync._pinning import read_latest

#: the kind of a version whose name is held by no file (a FIFO, a folder, a symbolic link)
NOT_A_FILE = "not a file"


@dataclass(frozen=True)
class VersionEntry:
    """A version file as ``ws versions`` lists it."""

    step: int
    name: str
    path: str
    size: int
    modified: str
    latest: bool
    #: a sharded version's member files and their bytes (``None`` for a plain version)
    members: int | None = None
    member_bytes: int | None = None
    #: ``"full"``, ``"delta"`` (stored as a change of ``base``), ``"sharded"`` or ``"sharded-delta"``
    #: (a sharded version some of whose members are deltas of ``base``'s), or ``"not a file"``
    kind: str = "full"
    #: a delta version's base file (``None`` for the others, and for a delta whose head does not read)
    base: str | None = None
    #: what holds its name where that is no file (kind ``"not a file"``): ``"a FIFO"``,
    #: ``"a folder"``, ``"a symbolic link (to …)"``; no reader opens it
    not_file: str | None = None


def list_versions(folder: Any, *, storage_options: Mapping[str, Any] | None = None) -> list[VersionEntry]:
    """Every version file in ``folder``, oldest first, marking the one ``LATEST`` names. A
    version's name held by no file (a folder, a FIFO, a symbolic link) is listed too, of kind
    ``"not a file"``, its :attr:`~VersionEntry.not_file` saying what it is: no reader opens it.

    A damaged ``LATEST`` marks none, with a warning saying what is wrong with it: the listing is
    what one needs then (which versions are there, which step a repairing publish must pass)."""
    entries, damage = version_listing(folder, storage_options=storage_options)
    if damage is not None:
        warnings.warn(str(damage), stacklevel=2)
    return entries


def version_listing(folder: Any, *, storage_options: Mapping[str, Any] | None = None,
                    ) -> tuple[list[VersionEntry], FormatError | None]:
    """:func:`list_versions`, with what is wrong with ``LATEST`` (``None`` when it reads) as a
    value rather than a warning, for a caller that reports it itself (``ws versions --json``)."""
    source = require_folder(folder, storage_options=storage_options)
    try:
        pointer, damage = read_latest(source), None
    except FormatError as exc:
        pointer, damage = None, exc
    named = pointer.file_name if pointer else None
    entries = []
    chain: list[str] | None = None  # the chain a delta of the version before lists, where that one's was read
    for step, entry in version_files(source):
        kind, base, own = _kind(source, entry.name, step, chain)
        chain = None if own is None else [entry.name, *own]
        entries.append(VersionEntry(step, entry.name, source.url(entry.name), entry.size, entry.modified,
                                    entry.name == named, *_sharded_sizes(source, entry.name), kind, base))
    entries += [VersionEntry(step, name, source.url(name), 0, "", name == named, kind=NOT_A_FILE, not_file=kind)
                for step, name, kind in not_file_versions(source)]
    return sorted(entries, key=lambda entry: (entry.step, entry.name)), damage


def _kind(folder: Folder, name: str, step: int, expected: list[str] | None,
          ) -> tuple[str, str | None, list[str] | None]:
    """How a version is stored, a delta's base (from its head; ``None`` where it does not read)
    and the chain its head lists (``[]`` for a full version; ``None`` for a sharded one, and a
    delta that does not read: one whose head says another step than its name, ``step``, does
    not, as a reader refuses it). ``expected``: the chain a delta of the
    version before lists, where
    known; a head that lists just that is not checked name by name again (each head of a chain
    1,000 deep lists every base below it: checked whole, a listing matched half a million names)."""
    if name.endswith(SHARDED_SUFFIX):
        try:
            delta = read_index(folder, name).delta
        except (WeightStoreError, FileNotFoundError):
            return "sharded", None, None
        return ("sharded", None, None) if delta is None else ("sharded-delta", delta.chain[0], None)
    if not name.endswith(delta_format.SUFFIX):
        return "full", None, []
    try:
        head = delta_format.read_head(folder.open_binary(name), folder.url(name), checked=expected)
    except (WeightStoreError, FileNotFoundError):
        return "delta", None, None
    if head.step != step:  # a head of another step than its name's, which every reader refuses
        return "delta", None, None
    return "delta", head.base, head.chain


def _sharded_sizes(folder: Folder, name: str) -> tuple[int | None, int | None]:
    """How many members a sharded version has and their bytes, from its index; ``(None, None)``
    for a plain version or an index that does not parse."""
    if not name.endswith(SHARDED_SUFFIX):
        return None, None
    from weightstore.formats._sharded_index import ShardIndex

    data = folder.read_small(name, MAX_V1_INDEX_BYTES + 1)
    try:
        index = ShardIndex.parse(data or b"")
    except FormatError:
        return None, None
    return len(index.members), sum(member.size for member in index.members)
