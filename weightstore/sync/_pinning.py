"""A published version as readers hold it: :class:`Version`, opened and pinned.

**Pinning.** :func:`follow` opens each version before yielding it. A local file is memory-
mapped, and a mapping survives the file's removal, so a slow reader keeps its version; a local
delta version is pinned with its chain, down to its anchor (what a reader holding nothing
reads). A ``Follower`` holding a version of that chain pins the next one down to the version it
holds only (:meth:`Version.pin`'s ``holding``): the deltas it rebuilds onto its copy, so its
cost grows with the versions it missed, not with the chain's depth; the rest of the chain is
read through a share of the held version's pin (so the version it serves reads whole, pruned or
not). Where that pin was let go, a base below is opened only if read; retention removes the
newest first and never a base a kept version needs, so a base pruned by then means the version
is gone too: the read raises :class:`VersionGoneError` and the follower reads ``LATEST`` again.
An object store has no such thing: the open object's bytes are fetched in ranges as they are
read, so a reader that lags more than one publish behind can still lose a large version; it gets
:class:`VersionGoneError` and should move to the newest (``Follower`` does). A store opened
from a pinned version (``ws.open(version)``) shares the pin and keeps the file open until it
is closed itself, even after the iteration moved on.

**Hot reload.** ``tf1.assign``/``tf2.assign`` given a :class:`Version` skip every tensor whose
content digest (BLAKE3 of its bytes, with its dtype and shape; never the CRC-32, which a
changed tensor can match) equals what the same target last received (``skip_unchanged=None``
means "only for versions"; pass ``True``/``False`` to force it), and list them in
``report.skipped``. Unchanged tensors are not even read. A file written before digests
(manifest version 2) has every tensor written.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from dataclasses import dataclass, field
from typing import Any, cast

from weightstore.core.limits import MAX_POINTER_BYTES
from weightstore.errors import (
    FormatError,
    StoreNotFoundError,
    TargetError,
    VersionGoneError,
    WeightStoreError,
    naming,
)
from weightstore.formats import Reader, format_for_suffix, format_named
from weightstore.formats import delta as delta_format
from weightstore.formats._pointer import LATEST, parse_pointer
from weightstore.formats._renamed import RenamedReader, by_saved_keys
from weightstore.formats._sharded_index import index_name
from weightstore.io.folders import Folder, folder_for
from weightstore.store._open import Store


class _SharedReader:
    """One open reader shared by a pin and the stores opened from it; closed when the last lets go.

    A store the user opened from a pinned version must stay readable while they hold it, even
    after the iteration released the pin: closing it under them turned reads into a raw
    ``ValueError: mmap closed``.
    """

    def __init__(self, reader: Any):
        self._reader = reader
        self._holders = 1
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        """Take one more share; False when the last holder already closed the reader."""
        with self._lock:
            if not self._holders:
                return False
            self._holders += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._holders -= 1
            last = not self._holders
        if last:
            self._reader.close()


class _Borrowed:
    """A shared reader as one holder sees it: ``close`` lets go of this holder's share only."""

    def __init__(self, shared: _SharedReader):
        self._shared: _SharedReader | None = shared

    def __getattr__(self, name: str) -> Any:
        shared = self.__dict__.get("_shared")
        if shared is None:
            raise AttributeError(name)
        return getattr(shared._reader, name)

    def close(self) -> None:
        shared, self._shared = self._shared, None
        if shared is not None:
            shared.release()


@dataclass
class Version:
    """One published version. ``ws.open``, ``ws.load`` and the adapters' ``assign`` accept it.

    A version yielded by :func:`follow` is *pinned*: its file is already open, so a local one
    stays readable (even if pruned meanwhile) until the iteration moves on, and a store opened
    from it with ``ws.open`` until that store is closed; on object storage, whose open objects
    are read in ranges, a version pruned mid-read raises :class:`VersionGoneError` (see the
    module's Pinning). One from :func:`latest` is
    opened when first read; if it was pruned by then, that read raises
    :class:`VersionGoneError` — call ``latest`` again and retry. Assigning a Version skips
    tensors whose content digest equals what the same target last received (hot reload).
    """

    step: int
    path: str
    created: str
    metadata: dict[str, Any] = field(default_factory=dict)
    _folder: Folder | None = field(default=None, repr=False, compare=False)
    _pinned: _SharedReader | None = field(default=None, repr=False, compare=False)

    @property
    def file_name(self) -> str:
        """The version's file in its folder (``step-000000001200.npz``), as ``LATEST`` names it."""
        return self.path.rsplit("/", 1)[-1]

    def _weightstore_open(self, *, verify: bool = True) -> Store:
        """What ``ws.open(version)`` returns: a share of the pinned file, or the file opened now."""
        pinned = self._pinned
        if pinned is not None and pinned.acquire():
            return Store(_Borrowed(pinned), self.path, verify)
        return _open_version(self._source(), self, verify)

    def _source(self) -> Folder:
        return self._folder or folder_for(self.path.rsplit("/", 1)[0] if "/" in self.path else ".")

    def pin(self, holding: Version | None = None) -> None:
        """Open the file now so that pruning cannot take it away; :meth:`release` lets go.

        ``holding``: a version whose tensors the reader holds and rebuilds this one onto (a
        ``Follower``'s): a local delta version's chain is opened down to it, not to its anchor,
        and rests on its pin (see the module's Pinning)."""
        if self._pinned is None:
            self._pinned = _SharedReader(_open_version(self._source(), self, True, holding)._reader)

    def release(self) -> None:
        pinned, self._pinned = self._pinned, None
        if pinned is not None:
            pinned.release()

    def held(self) -> Version:
        """A copy of this version with its own share of the pin (pinned now if this one is not).

        For whoever keeps a version past the iteration that yielded it (``Follower`` keeps the
        current one): each copy's :meth:`release` lets go of its own share only.
        """
        copy = dataclasses.replace(self, _pinned=None)
        pinned = self._pinned
        if pinned is not None and pinned.acquire():
            copy._pinned = pinned
        else:
            copy.pin()
        return copy


def read_latest(folder: Folder) -> Version | None:
    try:
        data = folder.read_small(LATEST, MAX_POINTER_BYTES + 1)  # one byte past the limit: to tell "too large"
    except TargetError as exc:
        raise FormatError(f"{exc.message}; the next publish replaces it", path=exc.path) from None
    return pointer_version(folder, data)


def pointer_version(folder: Folder, data: bytes | None) -> Version | None:
    if data is None:
        return None
    with naming(path=folder.where):
        pointer = parse_pointer(data)
    metadata: dict[str, Any] = pointer["metadata"] if isinstance(pointer.get("metadata"), dict) else {}
    return Version(pointer["step"], folder.url(pointer["file"]), pointer.get("created", ""), metadata, folder)


def _open_version(folder: Folder, version: Version, verify: bool, holding: Version | None = None) -> Store:
    """``version``'s file opened; a local delta version's chain with it, down to its anchor, or
    to ``holding`` (:meth:`Version.pin`), on whose pin it then rests (:func:`_rest_on`; where
    that pin is let go, each base below is opened when first read, and a base found pruned by
    then is a :class:`VersionGoneError`: :class:`_RemovedIsGone`)."""
    name = version.file_name
    fmt = format_for_suffix(name) or format_named("npz")
    try:
        handle = folder.open_binary(name, file_object=fmt.remote_file_object)
    except FileNotFoundError:
        raise _gone(version) from None
    if isinstance(handle, str):
        from weightstore.store._open import open as open_store
        from weightstore.store._open import open_onto_base

        lazy = holding is not None and fmt.name == delta_format.FORMAT_NAME
        try:
            held = None if holding is None else holding.file_name
            store = own_record(open_onto_base(handle, held=held) if lazy else open_store(handle, verify=verify),
                               version)
        except FileNotFoundError as exc:  # pruned between the look and the map, or a sharded version's member lost
            raise _gone_or(exc, folder, version) from None
        if holding is None or not lazy:
            return store
        _rest_on(store._reader, holding)
        return Store(cast(Reader, _RemovedIsGone(store._reader, folder, version)), version.path, verify, store.format)
    try:
        reader = _RemovedIsGone(by_saved_keys(fmt.open_reader(handle, version.path)), folder, version)
        return own_record(Store(cast(Reader, reader), version.path, verify), version)
    except FileNotFoundError as exc:
        handle.close()
        raise _gone_or(exc, folder, version) from None
    except BaseException:
        handle.close()
        raise


#: the form of the ``created`` time a version's file and ``LATEST`` both record (to the millisecond)
_ONE_FORM = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z")


def own_record(store: Store, version: Version) -> Store:
    """``store``, the file ``version`` names, where it was written by the publish whose record
    ``version`` is (the ``created`` time both record, to the millisecond); else closed, and a
    :class:`FormatError`: two publishers of one step on an object store, one paused between
    its upload and its swap of ``LATEST`` while a trainer restarted elsewhere put its own file in
    place of the paused one's, would have readers serve one's weights under the other's
    metadata. A record or file whose time is not in the one form both have recorded since
    (:func:`~weightstore.core.manifest.utc_now`: written by hand, or a file of a weightstore that
    recorded seconds) is taken as it is. So is a sharded version's index written before its
    record: an index is only created where none is, and a retried commit adopts the identical
    one its killed coordinator left (its members and metadata), which weightstore before this
    check recorded in ``LATEST`` under the retry's later time."""
    if _ONE_FORM.fullmatch(version.created) and _ONE_FORM.fullmatch(store.created) \
            and store.created != version.created \
            and not (version.path.endswith(index_name(version.step)) and store.created < version.created):
        store.close()
        raise FormatError(f"LATEST names it with the record of a publish made at {version.created}, but the file was "
                          f"written by another, at {store.created} (two publishers of step {version.step}: one "
                          "paused while another took the folder over); it is not read, and the next publish names "
                          "a version of its own", path=version.path)
    return store


def _gone_or(missing: FileNotFoundError, folder: Folder, version: Version) -> Exception:
    """What a file found missing while ``version`` is read means: the version was pruned (its
    file is gone: :class:`VersionGoneError`, read ``LATEST`` again), or, its file still there,
    a part of it is lost (a sharded version's member), which no retry mends: ``missing``
    itself, named."""
    if folder.tag(version.file_name) is None:
        return _gone(version)
    if isinstance(missing, WeightStoreError):
        return missing
    return StoreNotFoundError(f"a file it needs is missing ({missing.filename or missing})", path=version.path)


class _RemovedIsGone:
    """A version's reader that may open files after the version was found: a remote one (an
    object store cannot pin it), or a local delta version pinned down to a version its reader
    holds (:meth:`Version.pin`), whose lower bases are opened when first read. A file removed
    mid-read (pruned under a reader that lagged more than ``keep`` publishes) raises
    :class:`VersionGoneError`, the error that tells a reader to read ``LATEST`` again (see
    :func:`_gone_or`); so does a base of its chain found missing once the version's own file
    is gone too: retention removes the newest first and never a base a kept version needs, so
    that version was pruned, not damaged (a base removed by hand under a version still there
    stays the :class:`FormatError` naming it)."""

    def __init__(self, reader: Reader, folder: Folder, version: Version):
        self._reader, self._folder, self._version = reader, folder, version

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._reader, name)
        if not callable(attribute):
            return attribute

        def gone_when_removed(*args: Any, **kwargs: Any) -> Any:
            try:
                return attribute(*args, **kwargs)
            except VersionGoneError:
                raise
            except FileNotFoundError as exc:
                raise _gone_or(exc, self._folder, self._version) from None
            except FormatError:
                if _pruned(self._folder, self._version):
                    raise _gone(self._version) from None
                raise
        return gone_when_removed


def _rest_on(reader: Reader, holding: Version) -> None:
    """Give the chain of ``reader`` (a delta version opened down to ``holding``) a share of
    ``holding``'s pin as its base: the version a ``Follower`` serves stays readable whole
    (``ws.load(follower.version)``, after it stopped too) however much retention prunes, as when
    its chain was pinned down to the anchor, while pinning it opened only the deltas since."""
    shared = holding._pinned
    if shared is None or not shared.acquire():
        return
    lent = _Lent(shared)
    top = reader._reader if isinstance(reader, RenamedReader) else reader
    if not (isinstance(top, delta_format.DeltaReader)
            and top.rest_on(holding.file_name, lent.reader, lent.close)):
        lent.close()


class _Lent:
    """A share of a pinned version's reader, lent as the base of the next version's chain
    (:attr:`reader`: as a chain reads its base, a delta by its stored keys, an anchor as
    ``ws.open`` reads it), let go when that chain is closed."""

    def __init__(self, shared: _SharedReader):
        self._shared: _SharedReader | None = shared
        reader = shared._reader
        reader = reader._reader if isinstance(reader, _RemovedIsGone) else reader
        if isinstance(reader, RenamedReader) and isinstance(reader._reader, delta_format.DeltaReader):
            reader = reader._reader
        self.reader: Reader = reader

    def close(self) -> None:
        """Let go of the share; one let go while another is (the chain it was lent to, closing,
        closes the version below, which closes the one below it...) waits for it to be done, so
        the stack stays the same however long the line of versions (a chain 300 deep closed each
        within the one above passed Python's 1,000 frames)."""
        shared, self._shared = self._shared, None
        if shared is None:
            return
        queue: list[_SharedReader] | None = getattr(_letting_go, "queue", None)
        if queue is not None:
            queue.append(shared)
            return
        queue, failed = [shared], None
        _letting_go.queue = queue
        try:
            while queue:  # every one let go, whichever fails
                try:
                    queue.pop().release()
                except Exception as exc:
                    failed = failed or exc
        finally:
            _letting_go.queue = None
        if failed is not None:
            raise failed


#: the shares :meth:`_Lent.close` is letting go of in this thread
_letting_go = threading.local()


def _pruned(folder: Folder, version: Version) -> bool:
    """Whether ``version``'s file is gone from ``folder``; ``False`` where the look fails."""
    try:
        return folder.tag(version.file_name) is None
    except (WeightStoreError, OSError):
        return False


def _gone(version: Version) -> VersionGoneError:
    return VersionGoneError(f"version {version.step} is gone (pruned); read LATEST again and retry",
                            path=version.path)
