"""Versioned folders: a trainer ``publish``es, readers take ``latest`` or ``follow``.

A folder (local path or fsspec URL) holds version files named by step
(``step-000000000042.npz``) and a small JSON pointer, ``LATEST``, naming one of them. The
order of a publish is what makes readers safe without talking to the writer:

1. the version file is written completely (locally: temporary file, fsync, rename; on object
   stores: one upload, which becomes visible all at once);
2. only then is ``LATEST`` replaced (locally by rename; on object stores by one small PUT,
   the last object written);
3. then versions past ``keep`` are pruned, never the one ``LATEST`` names nor the one before
   it, so a reader that has just read ``LATEST`` has a whole publish to open its file.

Readers only ever reach a version through ``LATEST``, so leftovers of a killed publish (a
temporary file, or a complete version ``LATEST`` never named) are invisible to them; the next
publish removes them. It knows which complete file is a leftover because every publish first
records its intent (``.publishing``, naming its step) and removes that record once ``LATEST``
names the new version: a version above ``LATEST`` that the intent names was never published.

**A version above ``LATEST`` that no intent names is never removed.** That is a ``LATEST``
rolled back (restored from a backup, copied from another folder): the newer versions are real,
so a publish whose step is not above the newest of them is refused with :class:`PublishError`
naming them, and one above them keeps them all.

**A missing or damaged ``LATEST``** (deleted by hand, or a first publish killed between its
version file and its pointer) never costs versions: the newest version file's step then counts
as current, so the next publish must be above it (with a warning), and that publish removes
nothing but temporaries of dead writers. A complete version file a killed *first* publish left
is therefore kept: it holds real weights of that step, readers never saw it, and retention
prunes it like any older version.

**A ``LATEST`` that is not a file** (a FIFO, a folder) is reported as damaged and never opened
for reading (a FIFO would block the reader forever); the next publish replaces a FIFO, socket
or empty folder there, and refuses a folder holding files.

**One publisher per folder.** Steps must strictly increase: a publish whose step is not
above the step ``LATEST`` names (or, without a readable ``LATEST``, the newest version file's)
is refused with :class:`PublishError`. On a local folder,
publishes serialise on an advisory lock (``.publish.lock``), so two processes cannot
interleave the check and the write; on object stores there is no lock, but ``LATEST`` is
replaced by compare-and-swap on the ETag read before the check (S3 ``If-Match``; see
:func:`commit_version`), so of two publishers racing there exactly one moves ``LATEST`` and
the other gets :class:`PublishError`; ``LATEST`` never goes backwards. (Their version files
are still plain uploads: two publishers of the *same* step share one name, so run one
publisher per folder there all the same.)

**Pinning.** :func:`follow` opens each version before yielding it. A local file is memory-
mapped, and a mapping survives the file's removal, so a slow reader keeps its version. An
object store has no such thing: the open object's bytes are fetched in ranges as they are read,
so a reader that lags more than one publish behind can still lose a large version; it then gets
:class:`VersionGoneError` and should move to the newest (``Follower`` does). A store opened
from a pinned version (``ws.open(version)``) shares the pin and keeps the file open until it
is closed itself, even after the iteration moved on.

**Outages.** A storage service that fails (an object store down for a while) raises
:class:`StorageError`; :func:`follow` keeps looking, every ``poll`` seconds, and raises it only
when ``timeout`` passes while the service is still failing.

**Hot reload.** ``tf1.assign``/``tf2.assign`` given a :class:`Version` skip every tensor whose
content digest (BLAKE3 of its bytes, with its dtype and shape; never the CRC-32, which a
changed tensor can match) equals what the same target last received (``skip_unchanged=None``
means "only for versions"; pass ``True``/``False`` to force it), and list them in
``report.skipped``. Unchanged tensors are not even read. A file written before digests
(manifest version 2) has every tensor written.

**URLs.** Anything fsspec opens. Credentials and endpoints come from ``storage_options=`` or
from the environment as the client reads it (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``…).
Reads of ``LATEST`` and of version files bypass the file system's per-process listing cache
(s3fs keeps one): a process that listed the folder still sees what another one published
after it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import operator
import os
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

import numpy as np

from weightstore.core import _jsontext as jsontext
from weightstore.core.manifest import utc_now
from weightstore.errors import (
    FormatError,
    PublishError,
    SizeLimitError,
    StorageError,
    StoreNotFoundError,
    TargetError,
    VersionGoneError,
    WeightStoreError,
    named,
    naming,
)
from weightstore.formats import Reader, format_for_suffix, format_named
from weightstore.formats._pointer import (
    LATEST,
    MAX_POINTER_BYTES,
    MIN_BYTES_PER_CONTAINER,
    VERSION_NAME,
    parse_pointer,
    pointer_bytes,
)
from weightstore.io.files import TEMPORARY_EXTRA, remove_stale_temporaries
from weightstore.io.folders import Folder, LocalFolder, folder_for
from weightstore.store._open import Store
from weightstore.store._save import CheckedWeights, checked_metadata, write_file

__all__ = ["Version", "VersionEntry", "PublishOptions", "PointerWatch", "publish", "latest", "follow", "list_versions"]

#: what a publish keeps and writes, and how often a follower looks, unless told: the one
#: default of every publisher (publish, BackgroundPublisher, the hooks, sharded commits) and
#: every follower (follow, Follower, ws follow)
DEFAULT_KEEP = 5
DEFAULT_FORMAT = "npz"
DEFAULT_POLL = 1.0

#: the suffix of a sharded version's index (:mod:`weightstore.sharded._shards`)
SHARDED_SUFFIX = ".wsindex"
INTENT = ".publishing"
#: a file name has at most 255 bytes: ``step-``, the digits, at most 12 more (``.safetensors``,
#: ``.attempt-999``), and what the temporary it is written as adds
_MAX_STEP_DIGITS = 255 - TEMPORARY_EXTRA - len("step-") - 12
_log = logging.getLogger(__name__)


class PublishOptions(TypedDict):
    """How :func:`publish` writes each version; what a trainer's publisher passes on every time."""

    keep: int | None
    format: str
    storage_options: Mapping[str, Any] | None


def _stage(name: str) -> None:
    """Marks each stage of a publish; does nothing (tests replace it to kill the publisher there)."""


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

    def _weightstore_open(self, *, verify: bool = True) -> Store:
        """What ``ws.open(version)`` returns: a share of the pinned file, or the file opened now."""
        pinned = self._pinned
        if pinned is not None and pinned.acquire():
            return Store(_Borrowed(pinned), self.path, verify)
        return _open_version(self._folder or folder_for(self.path.rsplit("/", 1)[0] if "/" in self.path else "."),
                             self, verify)

    def pin(self) -> None:
        """Open the file now so that pruning cannot take it away; :meth:`release` lets go."""
        if self._pinned is None:
            self._pinned = _SharedReader(self._weightstore_open(verify=True)._reader)

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


def publish(
    folder: Any,
    weights: Mapping[str, Any],
    *,
    step: int,
    keep: int | None = DEFAULT_KEEP,
    metadata: Mapping[str, Any] | None = None,
    format: str = DEFAULT_FORMAT,  # noqa: A002
    storage_options: Mapping[str, Any] | None = None,
) -> Version:
    """Write ``weights`` as version ``step`` of ``folder``, point ``LATEST`` at it, prune.

    Args:
        folder: a local folder (created if missing) or an fsspec URL.
        weights: key -> array, or an open store.
        step: above the step ``LATEST`` names and every version file it does not account for.
        keep: how many versions stay (``None``: all); never fewer than two, so the version a
            reader has just found through ``LATEST`` survives the next publish.
        metadata: JSON-serializable; travels in the file and in ``LATEST``, which readers read
            up to 1 MiB (``SizeLimitError`` refuses more before anything is written).
        format: ``"npz"`` (default), ``"hdf5"`` or ``"safetensors"``.
        storage_options: for URLs, given to fsspec (credentials, ``client_kwargs={"endpoint_url": ...}``).

    Returns:
        The published :class:`Version`.

    Raises:
        PublishError: the step does not go forward (another publisher, or a restored ``LATEST``).
        StorageError: the storage service failed; nothing a reader sees has changed.

    Example:
        >>> ws.publish("runs/a", weights, step=1200, keep=5, metadata={"loss": 0.31})
    """
    step, keep = checked_step(step), checked_keep(keep)
    fmt = format_named(format)
    target = folder_for(folder, storage_options)
    name = f"step-{step:012d}{fmt.suffixes[0]}"
    arrays = CheckedWeights(weights, target.url(name), fmt)
    metadata = checked_pointer_metadata(metadata, step, name, target.url(name))
    target.create()
    written: list[str] = []  # the version file, once this publish wrote it

    def write_version(created: str) -> None:
        with target.commit(name, fmt.suffixes[0]).writing() as local:
            write_file(local, fmt, arrays, metadata, False, created=created)
            _stage("version-temporary")
        written.append(name)

    try:
        return commit_version(target, step, name, write_version, metadata, keep)
    except PublishError:
        # a race lost on object storage: left above LATEST with no intent naming it, the file
        # would read as a restored LATEST's newer version and refuse this very step's retry
        if written and not _names_step(target, step):
            target.remove(name)
        raise


def _names_step(target: Folder, step: int) -> bool:
    """Whether ``LATEST`` names ``step`` now; when it cannot be read, as if it did (keep the file)."""
    try:
        current = _latest(target)
    except WeightStoreError:
        return True
    return current is not None and current.step == step


def checked_count(name: str, value: Any) -> int:
    """``value`` as the non-negative int a step (rank, world, attempt) must be: of any integer
    type (numpy's ``int64``, what ``optimizer.iterations.numpy()`` gives), never a bool or a float."""
    number = _integer(value)
    if number is None or number < 0:
        raise ValueError(f"{name} must be a non-negative int, not {value!r}")
    return number


def checked_step(step: Any) -> int:
    """``step`` as :func:`checked_count` takes it, and short enough that its files' names fit
    the 255 bytes a file system allows (``step-…safetensors``, a sharded version's
    ``step-….attempt-N``): a longer one failed the write after the publish recorded its intent."""
    number = checked_count("step", step)
    if len(str(number)) > _MAX_STEP_DIGITS:
        raise ValueError(f"step must have at most {_MAX_STEP_DIGITS} digits, or its file names would be longer than "
                         f"the 255 bytes a file system allows; step {str(number)[:20]}… is too large")
    return number


def checked_pointer_metadata(metadata: Mapping[str, Any] | None, step: int, name: str, where: str) -> dict[str, Any]:
    """``metadata`` as :func:`checked_metadata` takes it, refused as well
    (:class:`SizeLimitError`) when the ``LATEST`` that carries it would be larger than readers
    read: the version would be published and never reached. Checked before anything is written, with
    this moment standing in for the publish's ``created`` (always as long)."""
    metadata = checked_metadata(metadata, where)
    size = len(pointer_bytes(step, name, utc_now(), metadata))
    if size > MAX_POINTER_BYTES:
        raise SizeLimitError(f"metadata makes LATEST {size} bytes, over the {MAX_POINTER_BYTES} bytes readers read "
                             "(LATEST writes each non-ASCII character as 6 bytes); make the metadata smaller", path=where)
    return metadata


def checked_keep(keep: Any) -> int | None:
    """``keep`` (how many versions a publish leaves) as an int of at least 1, or ``None`` (all)."""
    if keep is None:
        return None
    number = _integer(keep)
    if number is None or number < 1:
        raise ValueError(f"keep must be an int of at least 1 (or None to keep all), not {keep!r}")
    return number


def checked_seconds(name: str, value: Any) -> float:
    """``value`` as a wait a thread can make: seconds, neither negative, NaN (which no comparison
    refuses: a loop on it would never end, or never pause) nor past ``threading.TIMEOUT_MAX``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)) or not (
            0 <= value <= threading.TIMEOUT_MAX):
        raise ValueError(f"{name} must be seconds from 0 to {threading.TIMEOUT_MAX:.0f}, not {value!r}")
    return float(value)


def _integer(value: Any) -> int | None:
    """``value`` as an int where it is of an integer type (not a bool), else ``None``."""
    if isinstance(value, (bool, np.bool_)) or not hasattr(type(value), "__index__"):
        return None
    return operator.index(value)


def commit_version(target: Folder, step: int, name: str, write: Callable[[str], None],
                   metadata: Mapping[str, Any] | None, keep: int | None) -> Version:
    """The publish protocol around one version file: check the step, clean what killed publishes
    left, record the intent, ``write(created)`` the file ``name``, replace ``LATEST``, prune.

    :func:`publish` writes a plain version file; :func:`weightstore.sharded._shards.commit_shards` a
    sharded version's index. On object storage ``LATEST`` is replaced by compare-and-swap on the
    ETag read at the start (``If-Match``; ``If-None-Match: *`` when there was none), so a
    publisher that lost a race gets :class:`PublishError` and ``LATEST`` never goes backwards.
    """
    with target.lock():
        _stage("locked")
        state = _FolderState.read(target)
        state.check_step(step)
        state.clean()
        _stage("cleaned")
        _write_small(target, INTENT, json.dumps({"step": step, "file": name}).encode())
        created = utc_now()
        pointer = pointer_bytes(step, name, created, metadata or {})
        write(created)
        _stage("version-written")
        _write_latest(target, state, pointer, step)
        _stage("latest-written")
        if not isinstance(target, LocalFolder):
            state.remove_unpublished(step)  # only now: see _FolderState.remove_unpublished
        target.remove(INTENT)
        _prune(target, step, None if keep is None else max(keep, 2))
        _stage("pruned")
    return Version(step, target.url(name), created, dict(metadata or {}), target)


def _write_latest(target: Folder, state: _FolderState, pointer: bytes, step: int) -> None:
    """Replace ``LATEST``: by rename under the folder's lock locally, by compare-and-swap remotely."""
    if isinstance(target, LocalFolder):
        target.replace_special(LATEST)
        with target.commit(LATEST).writing() as local:
            with open(local, "wb") as handle:
                handle.write(pointer)
            _stage("latest-temporary")
        return
    _stage("latest-temporary")
    if not target.put_if(LATEST, pointer, create=not state.latest_exists, expect=state.latest_tag):
        raise PublishError(f"LATEST changed while step {step} was being published (another publisher committed "
                           "first); this version was not published: publish it again (with a step above the one "
                           "LATEST names now)", path=target.where)


def latest(folder: Any, *, storage_options: Mapping[str, Any] | None = None) -> Version | None:
    """The version ``LATEST`` names, or ``None`` if nothing was published yet.

    Raises :class:`FormatError` when ``LATEST`` is empty, not a pointer, or not a file. The
    file itself is opened only when read; see :class:`Version`.
    """
    return _latest(versions_folder(folder, storage_options))


def follow(
    folder: Any,
    *,
    poll: float = DEFAULT_POLL,
    timeout: float | None = None,
    after: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
    max_poll: float | None = None,
    notifications: str | None = None,
) -> Iterator[Version]:
    """Yield each new version of ``folder``, pinned, in step order.

    Starts from the latest version (with ``after``, once the latest is above it: older versions
    still kept are not yielded); versions published while the caller was busy are skipped in
    favour of the newest. A ``LATEST`` that goes back below the last version yielded (the folder
    made anew by a run that started over, or restored from a backup) is followed, with a
    logged warning: it names what the folder now serves. Stops after ``timeout`` seconds
    without a new version (``None``: never). A version pruned between reading ``LATEST`` and
    opening it is retried at once; ``LATEST`` naming a file that stays missing raises
    :class:`StoreNotFoundError`. A version whose file is damaged (it does not open: truncated,
    corrupt) is passed over with a logged warning, not yielded, and the looks go on: one
    damaged copy must not end the loop that the next good publish would have fed. A storage
    outage is waited out (see the module docstring). The arguments are checked by the call
    itself, not at the first ``next``.

    Looks at ``LATEST`` every ``poll`` seconds at first; each look that finds nothing new
    doubles the wait, up to ``max_poll`` (default ``4 * poll``; pass ``poll`` for a fixed
    interval), and a new version resets it. On an object store a look whose ``LATEST`` has
    the ETag of the last one read is one HEAD request and moves no body (:class:`PointerWatch`).
    With ``notifications`` (an SQS queue URL the bucket's event notifications feed), an event
    naming ``LATEST`` ends the wait at once (:mod:`weightstore.sync._notify`); polling goes on too.
    A local folder, whose writes no bucket announces, refuses it. A local folder that does not
    exist yet is waited for, with one logged warning, since a mistyped path waits for good.
    """
    timeout = None if timeout is None else checked_seconds("timeout", timeout)
    after = None if after is None else checked_count("after", after)
    watch = PointerWatch(versions_folder(folder, storage_options), poll, max_poll, notifications)
    return _follow(watch, timeout, after)


def _follow(watch: PointerWatch, timeout: float | None, after: int | None) -> Iterator[Version]:
    """:func:`follow`'s loop, a generator of its own so that ``follow`` checks its words when called."""
    last, followed = after, False
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            version = watch.newer(last, followed=followed)
        except StorageError as exc:
            if deadline is not None and time.monotonic() >= deadline:
                raise
            _log.warning("weightstore: following %s: %s; retrying in %ss", watch.source.where, exc, watch.interval)
            version = None
        except FormatError as exc:
            if watch.unreadable is None:  # LATEST itself: it names nothing to wait past
                raise
            _log.warning("weightstore: following %s: passing over version %d, which cannot be read (%s); "
                         "waiting for a later one", watch.source.where, watch.unreadable, exc)
            last = watch.unreadable  # waited past as a version taken is: not opened again every look
            version = None
        if version is not None:
            try:
                yield version
            finally:
                version.release()
            last, followed = version.step, True
            deadline = None if timeout is None else time.monotonic() + timeout
            continue
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return
        watch.sleep(watch.interval if remaining is None else min(watch.interval, remaining))


class PointerWatch:
    """``LATEST`` as one reader polls it: cheap looks while nothing changes.

    A look first asks the folder for the pointer's tag (:meth:`Folder.tag`: an object's ETag,
    from a HEAD that moves no body); the same tag as the pointer last read means nothing was
    published, and nothing more is read. :attr:`interval`, the wait before the next look,
    doubles with each look that finds nothing new, up to ``max_poll``, and is back at ``poll``
    once one does; :meth:`sleep` ends early when ``notifications`` (an SQS queue URL, see
    :mod:`weightstore.sync._notify`) says ``LATEST`` was written. :func:`follow` and ``Follower``
    poll through it.
    """

    def __init__(self, source: Folder, poll: float, max_poll: float | None = None, notifications: str | None = None):
        poll = checked_seconds("poll", poll)
        max_poll = None if max_poll is None else checked_seconds("max_poll", max_poll)
        self.source = source
        self.poll = poll
        self.max_poll = min(threading.TIMEOUT_MAX, max(poll, 4 * poll if max_poll is None else max_poll))
        self.interval = poll
        self._read: object | None = None  # the tag of the pointer last read through; never matches at first
        self._fresh = True
        #: the step of the version the last look found damaged (its file does not open), if it did
        self.unreadable: int | None = None
        self.wake = None
        check_notifications(source, notifications)
        if notifications is not None:
            from weightstore.sync._notify import QueueWake

            self.wake = QueueWake(notifications, urllib.parse.urlsplit(source.url(LATEST)).path.lstrip("/"))
        # waiting is right before a trainer's first publish, and forever on a typo: said once, for a local
        # folder (an object store's listing would cost a request, and may wait out an outage first)
        if isinstance(source, LocalFolder) and not source.exists():
            _log.warning("weightstore: following %s: no such folder yet; waiting for its first version", source.where)

    def sleep(self, seconds: float, stop: threading.Event | None = None) -> None:
        """Wait ``seconds`` before the next look, or less: until ``stop`` is set, or a
        notification says ``LATEST`` was written (then the next look reads it whatever its tag)."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0 and not (stop is not None and stop.is_set()):
            if self.wake is None:
                if stop is None:
                    time.sleep(left)
                else:
                    stop.wait(left)
                return
            if self.wake.wait(left):
                self.forget()
                self.interval = self.poll
                return

    def newer(self, last: int | None, *, followed: bool = False) -> Version | None:
        """The latest version if it is above ``last``, pinned; None when there is none (or the
        pointer did not change since the last look).

        ``followed``: ``last`` is the step of a version the caller took (not only a step to start
        after), so a pointer that went back below it (the folder deleted and a run started over
        in it, ``LATEST`` restored from a backup) names what the folder now serves: that version
        is returned too, with a warning, rather than waited past in silence."""
        tag = self.source.tag(LATEST)
        if not self._fresh and tag == self._read:
            self._idle()
            return None
        self.unreadable = None
        try:
            version = self._newer_pinned(last, back=followed)
        except FormatError:
            if self.unreadable is not None:  # read through, and nothing new to take: as a quiet look
                self._read, self._fresh = tag, False
                self._idle()
            raise
        self._read, self._fresh = tag, False
        if version is None:
            self._idle()
        else:
            self.interval = self.poll
        return version

    def _newer_pinned(self, last: int | None, *, back: bool) -> Version | None:
        """The latest version if it is above ``last`` (with ``back``, below it too), opened;
        retries while it is pruned away. A version whose file does not open (damaged) is noted in
        :attr:`unreadable` before its error is raised."""
        gone = None
        while True:
            version = _latest(self.source)
            if version is None or (last is not None and (version.step == last if back else version.step <= last)):
                return None
            went_back = last is not None and version.step < last  # only asked for with ``back``
            try:
                version.pin()
            except FormatError:
                self.unreadable = version.step
                raise
            except VersionGoneError:
                if gone == version.step and went_back:
                    _log.warning("weightstore: following %s: LATEST went back to %s, which does not exist; keeping "
                                 "step %d", self.source.where, version.path, last)
                    return None  # a pointer restored to a version pruned since: nothing to follow down to
                if gone == version.step:  # LATEST still names it: not a race, a damaged folder
                    raise StoreNotFoundError(f"LATEST names {version.path}, which does not exist; publish again to "
                                             "repair", path=self.source.where) from None
                gone = version.step
                continue
            if went_back:
                _log.warning("weightstore: following %s: LATEST went back from step %d to %d (the folder was made "
                             "anew, or LATEST restored); following it", self.source.where, last, version.step)
            return version

    def forget(self) -> None:
        """Read the pointer on the next look even if its tag did not change (its version went away)."""
        self._fresh = True

    def _idle(self) -> None:
        self.interval = min(self.max_poll, self.interval * 2 or self.max_poll)


def list_versions(folder: Any, *, storage_options: Mapping[str, Any] | None = None) -> list[VersionEntry]:
    """Every version file in ``folder``, oldest first, marking the one ``LATEST`` names.

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
        pointer, damage = _latest(source), None
    except FormatError as exc:
        pointer, damage = None, exc
    named = pointer.path.rsplit("/", 1)[-1] if pointer else None
    return [VersionEntry(step, entry.name, source.url(entry.name), entry.size, entry.modified, entry.name == named,
                         *_sharded_sizes(source, entry.name))
            for step, entry in _versions(source)], damage


def check_notifications(source: Folder, notifications: str | None) -> None:
    """Refuse ``notifications`` for a local folder: no bucket sends its events, so the queue
    would stay silent while the option seemed to work."""
    if notifications is not None and isinstance(source, LocalFolder):
        raise ValueError(f"notifications wake followers of an object-storage folder (s3://...), and "
                         f"{source.where} is local: drop them; the poll interval sets how often LATEST is read")


def versions_folder(folder: Any, storage_options: Mapping[str, Any] | None = None) -> Folder:
    """``folder`` opened for reading versions, which may not exist yet (a follower waits for it),
    but is refused when it is a local file, FIFO or device: nothing will turn that into a
    folder, and a follower would wait for good."""
    source = folder_for(folder, storage_options)
    if os.path.exists(source.where) and not os.path.isdir(source.where):  # a file, a FIFO, a device
        raise StoreNotFoundError("is a file, not a folder of versions", path=source.where)
    return source


def require_folder(folder: Any, *, storage_options: Mapping[str, Any] | None = None, hint: str = "") -> Folder:
    """``folder`` opened, or :class:`StoreNotFoundError` naming it when it does not exist."""
    source = versions_folder(folder, storage_options)
    if not source.exists():
        raise StoreNotFoundError("no such folder" + (f"; {hint}" if hint else ""), path=source.where)
    return source


def _sharded_sizes(folder: Folder, name: str) -> tuple[int | None, int | None]:
    """How many members a sharded version has and their bytes, from its index; ``(None, None)``
    for a plain version or an index that does not parse."""
    if not name.endswith(SHARDED_SUFFIX):
        return None, None
    from weightstore.formats._sharded_index import MAX_INDEX_BYTES, ShardIndex

    data = folder.read_small(name, MAX_INDEX_BYTES + 1)
    try:
        index = ShardIndex.parse(data or b"")
    except FormatError:
        return None, None
    return len(index.members), sum(member.size for member in index.members)


# -- the folder's state, as a publish sees it ------------------------------------------------

@dataclass
class _FolderState:
    """What a publish must know before writing: LATEST, the version files, a killed publish's intent."""

    folder: Folder
    pointer: Version | None
    pointer_error: FormatError | None
    versions: list[tuple[int, Any]]
    intent: int | None
    #: whether a LATEST was there, and its ETag (object storage), for the compare-and-swap
    latest_exists: bool = False
    latest_tag: str | None = None

    @classmethod
    def read(cls, folder: Folder) -> _FolderState:
        try:
            data, tag = folder.read_tagged(LATEST, MAX_POINTER_BYTES + 1)
        except TargetError as exc:
            return cls(folder, None, FormatError(f"{exc.message}; the next publish replaces it", path=exc.path),
                       _versions(folder), _read_intent(folder), True)
        try:
            pointer, error = _pointer_version(folder, data), None
        except FormatError as exc:
            pointer, error = None, exc
        return cls(folder, pointer, error, _versions(folder), _read_intent(folder), data is not None, tag)

    @property
    def newest(self) -> int | None:
        return self.versions[-1][0] if self.versions else None

    def unpublished(self) -> list[tuple[int, Any]]:
        """Version files above the one LATEST names that a killed publish's intent accounts for."""
        if self.pointer is None:
            return []
        return [(step, entry) for step, entry in self.versions if step > self.pointer.step and step == self.intent]

    def above_latest(self) -> list[int]:
        """Steps above LATEST's that no intent accounts for: a LATEST that was rolled back."""
        if self.pointer is None:
            return []
        return [step for step, _ in self.versions if step > self.pointer.step and step != self.intent]

    def check_step(self, step: int) -> None:
        """Refuse a step that does not go forward; warn about a damaged or missing LATEST."""
        where = self.folder.where
        if self.pointer_error is not None:
            warnings.warn(f"{self.pointer_error}; the next publish replaces it", stacklevel=4)
        elif self.pointer is None and self.newest is not None:
            warnings.warn(f"{where}: LATEST is missing but version files exist; the newest, step {self.newest}, "
                          "counts as current and the next publish names its own version", stacklevel=4)
        if self.pointer is not None and step <= self.pointer.step:
            raise PublishError(f"step {step} is not after step {self.pointer.step}, which LATEST names; steps must "
                               "increase (is another trainer publishing to this folder?)", path=where)
        rolled_back = self.above_latest()
        if self.pointer is not None and rolled_back and step <= rolled_back[-1]:
            raise PublishError(
                f"step {step} is not after step {rolled_back[-1]}: LATEST names step {self.pointer.step}, "
                f"but {_steps(rolled_back)} above it {'were' if len(rolled_back) > 1 else 'was'} published before "
                "(was LATEST restored from an older copy?); publish a later step, or move those files away",
                path=where,
            )
        if self.pointer is None and self.newest is not None and step <= self.newest:
            raise PublishError(f"step {step} is not after step {self.newest}, which is the newest version file "
                               "(LATEST is missing or damaged); steps must increase", path=where)

    def clean(self) -> None:
        """Before a publish writes: remove dead writers' temporaries and, in a local folder (whose
        lock keeps other publishers out), the versions killed publishes wrote but never named."""
        if isinstance(self.folder, LocalFolder):
            for name in self.folder.temporaries():
                remove_stale_temporaries(self.folder.root / name)
            self.remove_unpublished()
            if self.intent is not None:
                self.folder.remove(INTENT)

    def remove_unpublished(self, step: int | None = None) -> None:
        """Remove the versions above ``LATEST`` that a killed publish's intent names, but ``step``'s.

        On object storage there is no lock, so such a version may be another publisher's in
        flight; it is removed only after this publish's compare-and-swap of ``LATEST``
        succeeded. Its publisher wrote the intent after reading ``LATEST``, so that reading
        came before this swap, and its own swap now fails: the version is dead.
        """
        for unpublished, entry in self.unpublished():
            if unpublished != step:
                self.folder.remove(entry.name)  # a sharded one's members: the next commit removes dead attempts


def _steps(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {named(steps, shown=5)}"


def _versions(folder: Folder) -> list[tuple[int, Any]]:
    found = []
    for entry in folder.files():
        match = VERSION_NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry))
    return sorted(found, key=lambda item: item[0])


def _read_intent(folder: Folder) -> int | None:
    """The step a killed publish was writing, from its intent record; ``None`` when there is none."""
    try:
        data = folder.read_small(INTENT, 4096)
    except TargetError:
        return None
    try:
        step = jsontext.loads(data, what=INTENT, min_bytes=MIN_BYTES_PER_CONTAINER)["step"] if data else None
    except (FormatError, TypeError, KeyError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _write_small(folder: Folder, name: str, data: bytes) -> None:
    with folder.commit(name).writing() as local, open(local, "wb") as handle:
        handle.write(data)


def _prune(folder: Folder, newest: int, keep: int | None) -> None:
    if keep is None:
        return
    entries = [entry for step, entry in _versions(folder) if step <= newest]
    for entry in entries[:-keep]:
        remove_version(folder, entry.name)
        _stage("pruning")


def remove_version(folder: Folder, name: str) -> None:
    """Remove a version file; a sharded version's index first, then every attempt folder of its step."""
    folder.remove(name)
    if name.endswith(SHARDED_SUFFIX):
        prefix = name[: -len(SHARDED_SUFFIX)] + ".attempt-"
        for sub in folder.subfolders():
            if sub.startswith(prefix):
                folder.remove_folder(sub)


def _latest(folder: Folder) -> Version | None:
    try:
        data = folder.read_small(LATEST, MAX_POINTER_BYTES + 1)  # one byte past the limit: to tell "too large"
    except TargetError as exc:
        raise FormatError(f"{exc.message}; the next publish replaces it", path=exc.path) from None
    return _pointer_version(folder, data)


def _pointer_version(folder: Folder, data: bytes | None) -> Version | None:
    if data is None:
        return None
    with naming(path=folder.where):
        pointer = parse_pointer(data)
    metadata: dict[str, Any] = pointer["metadata"] if isinstance(pointer.get("metadata"), dict) else {}
    return Version(pointer["step"], folder.url(pointer["file"]), pointer.get("created", ""), metadata, folder)


def _open_version(folder: Folder, version: Version, verify: bool) -> Store:
    name = version.path.rsplit("/", 1)[-1]
    fmt = format_for_suffix(name) or format_named("npz")
    try:
        handle = folder.open_binary(name, file_object=fmt.remote_file_object)
    except FileNotFoundError:
        raise _gone(version) from None
    if isinstance(handle, str):
        from weightstore.store._open import open as open_store

        try:
            return open_store(handle, verify=verify)
        except FileNotFoundError as exc:  # pruned between the look and the map, or a sharded version's member lost
            raise _gone_or(exc, folder, version) from None
    try:
        reader = _RemovedIsGone(fmt.open_reader(handle, version.path), folder, version)
        return Store(cast(Reader, reader), version.path, verify)
    except FileNotFoundError as exc:
        handle.close()
        raise _gone_or(exc, folder, version) from None
    except BaseException:
        handle.close()
        raise


def _gone_or(missing: FileNotFoundError, folder: Folder, version: Version) -> Exception:
    """What a file found missing while ``version`` is read means: the version was pruned (its
    file is gone: :class:`VersionGoneError`, read ``LATEST`` again), or, its file still there,
    a part of it is lost (a sharded version's member), which no retry mends: ``missing``
    itself, named."""
    if folder.tag(version.path.rsplit("/", 1)[-1]) is None:
        return _gone(version)
    if isinstance(missing, WeightStoreError):
        return missing
    return StoreNotFoundError(f"a file it needs is missing ({missing.filename or missing})", path=version.path)


class _RemovedIsGone:
    """A remote version's reader: a file removed mid-read (pruned under a reader that lagged
    more than ``keep`` publishes; an object store cannot pin it) raises :class:`VersionGoneError`,
    the error that tells a reader to read ``LATEST`` again (see :func:`_gone_or`)."""

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
        return gone_when_removed


def _gone(version: Version) -> VersionGoneError:
    return VersionGoneError(f"version {version.step} is gone (pruned); read LATEST again and retry",
                            path=version.path)
