"""Following a versioned folder: :func:`latest`, :func:`follow` and the cheap looks of :class:`PointerWatch`.

**Outages.** A storage service that fails (an object store down for a while) raises
:class:`StorageError`; where the failure may pass (``transient``: no connection, a timeout, 5xx,
``SlowDown``) :func:`follow` keeps looking, every ``poll`` seconds, and raises it only when
``timeout`` passes while the service is still failing; one that stays (credentials refused, a
host name that names no host) is raised at once if the folder never answered, and waited out
like the others once it has (after a first answer such a failure is more often one that passes:
an expired token renewed, a DNS name of a restarting container, S3's 403 for a key pruned under
a reader without ``s3:ListBucket``). An outage is said once when it starts ("waiting for
<folder>: <cause>; retrying") and once when it ends, on the ``weightstore`` logger, never once a
retry: a stopped server and a mistyped port look the same, and both are waited out.

**URLs.** Anything fsspec opens. Credentials and endpoints come from ``storage_options=`` or
from the environment as the client reads it (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``…).
Reads of ``LATEST`` and of version files bypass the file system's per-process listing cache
(s3fs keeps one): a process that listed the folder still sees what another one published
after it.
"""

from __future__ import annotations

import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from weightstore.core._words import checks_words
from weightstore.errors import (
    FormatError,
    StorageError,
    StoreNotFoundError,
    VersionGoneError,
    WeightStoreError,
)
from weightstore.formats._pointer import (
    LATEST,
)
from weightstore.io.folders import Folder, LocalFolder
from weightstore.sync._checks import checked_count, checked_seconds
from weightstore.sync._defaults import DEFAULT_POLL
from weightstore.sync._folder import check_notifications, versions_folder
from weightstore.sync._pinning import Version, read_latest

_log = logging.getLogger(__name__)


def latest(folder: Any, *, storage_options: Mapping[str, Any] | None = None) -> Version | None:
    """The version ``LATEST`` names, or ``None`` if nothing was published yet.

    Raises :class:`FormatError` when ``LATEST`` is empty, not a pointer, or not a file. The
    file itself is opened only when read; see :class:`Version`.
    """
    return read_latest(versions_folder(folder, storage_options))


@checks_words("ws.follow")
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
    logged warning: it names what the folder now serves; so is a ``LATEST`` removed (the folder
    deleted: said once) and published again at the step last yielded. Stops after ``timeout`` seconds
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
    naming ``LATEST`` ends the wait at once; polling goes on too.
    A local folder, whose writes no bucket announces, refuses it. A local folder that does not
    exist yet is waited for, with one logged warning, since a mistyped path waits for good.
    """
    timeout = None if timeout is None else checked_seconds("timeout", timeout)
    after = None if after is None else checked_count("after", after)
    watch = PointerWatch(versions_folder(folder, storage_options), poll, max_poll, notifications)
    return following(watch, timeout, after)


def following(watch: PointerWatch, timeout: float | None, after: int | None, *,
              waiting: Callable[[int | None], object] | None = None) -> Iterator[Version]:
    """:func:`follow`'s loop over ``watch``, its arguments checked: a generator of its own so that
    ``follow`` checks its words when called. ``waiting`` (``ws follow``'s, which says what it
    waits for) is given, once, the step ``LATEST`` names (``None``: none) where the first look
    the folder answers finds nothing to yield: no request more, and an outage at the start is
    waited out first."""
    last, followed, answered = after, False, False
    outage = Outage(watch.source.where)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            version = watch.newer(last, followed=followed)
            answered = True
            outage.over()
            if waiting is not None and version is None:
                waiting(watch.named)
            waiting = None
        except StorageError as exc:
            if (not exc.transient and not answered) or (deadline is not None and time.monotonic() >= deadline):
                raise
            outage.failed(exc)
            version = None
        except FormatError as exc:
            if watch.unreadable is None:  # LATEST itself: it names nothing to wait past
                raise
            _log.warning("weightstore: following %s: passing over version %d, which cannot be read (%s); "
                         "waiting for a later one", watch.source.where, watch.unreadable, exc)
            waiting = None  # said: what it waits for
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


class Outage:
    """A reader's storage outage, said once when it starts and once when it ends: a line a retry
    buries the rest of the log under one cause, and none at all leaves a mistyped port looking
    like a folder nobody publishes to."""

    def __init__(self, where: str, said: str = "weightstore:"):
        self.where = where
        self.said = said  # how the reader's lines start (a Follower names itself)
        self.cause: BaseException | None = None

    def failed(self, exc: BaseException) -> None:
        """A look or read failed; said if the storage answered the one before, or the cause changed
        kind (its type, or whether it may pass: a 503 that became a 403 needs someone to act)."""
        if self.cause is None or _kind(exc) != _kind(self.cause):
            shown = exc.message if isinstance(exc, WeightStoreError) and exc.path == self.where and exc.key is None \
                else exc
            _log.warning("%s waiting for %s: %s; retrying", self.said, self.where, shown)
        self.cause = exc

    def over(self) -> None:
        """The storage answered: said if it had failed."""
        if self.cause is not None:
            _log.warning("%s %s answers again", self.said, self.where)
            self.cause = None


def _kind(exc: BaseException) -> tuple[type, bool | None]:
    return type(exc), getattr(exc, "transient", None)


class PointerWatch:
    """``LATEST`` as one reader polls it: cheap looks while nothing changes.

    A look first asks the folder for the pointer's tag (:meth:`Folder.tag`: an object's ETag,
    from a HEAD that moves no body); the same tag as the pointer last read means nothing was
    published, and nothing more is read. :attr:`interval`, the wait before the next look,
    doubles with each look that finds nothing new, up to ``max_poll``, and is back at ``poll``
    once one does; :meth:`sleep` ends early when ``notifications`` (an SQS queue URL)
    says ``LATEST`` was written. :func:`follow` and ``Follower``
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
        #: the step ``LATEST`` named when last read (``None``: no ``LATEST``)
        self.named: int | None = None
        #: ``LATEST`` was removed (the folder deleted) since a look read it: the next version is of a folder
        #: made anew, taken even at the step last taken (a run started over publishes its steps again)
        self._removed = False
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

    def newer(self, last: int | None, *, followed: bool = False, holding: Version | None = None) -> Version | None:
        """The latest version if it is above ``last``, pinned; None when there is none (or the
        pointer did not change since the last look).

        ``followed``: ``last`` is the step of a version the caller took (not only a step to start
        after), so a pointer that went back below it (the folder deleted and a run started over
        in it, ``LATEST`` restored from a backup) names what the folder now serves: that version
        is returned too, with a warning, rather than waited past in silence. ``holding``: the
        version whose tensors the caller holds (:meth:`Version.pin`)."""
        tag = self.source.tag(LATEST)
        if not self._fresh and tag == self._read:
            self._idle()
            return None
        self.unreadable = None
        try:
            version = self._newer_pinned(last, back=followed, holding=holding)
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

    def _newer_pinned(self, last: int | None, *, back: bool, holding: Version | None) -> Version | None:
        """The latest version if it is above ``last`` (with ``back``, below it too), opened;
        retries while it is pruned away. A version whose file does not open (damaged) is noted in
        :attr:`unreadable` before its error is raised."""
        gone = None
        while True:
            version = read_latest(self.source)
            if version is None and self.named is not None:
                self._said_removed()
            self.named = None if version is None else version.step
            anew = back and self._removed and version is not None and version.step == last
            if version is None or (last is not None and not anew and (version.step == last if back else version.step <= last)):
                return None
            went_back = last is not None and version.step < last  # only asked for with ``back``
            try:
                version.pin(holding)
            except FormatError:  # passed over as a version taken is: the run made anew was seen
                self.unreadable, self._removed = version.step, False
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
            elif anew:
                _log.warning("weightstore: following %s: step %d was published anew since LATEST was removed (the "
                             "folder made anew); following it", self.source.where, version.step)
            self._removed = False
            return version

    def _said_removed(self) -> None:
        """``LATEST``, read at the last look, is gone: said once, as waiting in silence looks like a hang."""
        removed = "the folder was removed" if isinstance(self.source, LocalFolder) and not self.source.exists() \
            else "LATEST was removed"
        _log.warning("weightstore: following %s: %s; waiting for a version to be published", self.source.where,
                     removed)
        self._removed = True

    def forget(self) -> None:
        """Read the pointer on the next look even if its tag did not change (its version went away)."""
        self._fresh = True

    def _idle(self) -> None:
        self.interval = min(self.max_poll, self.interval * 2 or self.max_poll)
