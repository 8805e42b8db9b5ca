"""A versioned folder as a publish sees it: its version files, ``LATEST``, a killed publish's intent.

What a publish must know before it writes (:class:`FolderState`: which step it must pass,
what dead writers left), how retention prunes, and the checks that a folder can be read or
followed. The protocol that uses them is :mod:`weightstore.sync._publish`'s.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightstore.core import _jsontext as jsontext
from weightstore.core.limits import MAX_POINTER_BYTES, MAX_V1_INDEX_BYTES, POINTER_BYTES_PER_CONTAINER
from weightstore.errors import (
    FileAccessError,
    FormatError,
    PublishError,
    StoreNotFoundError,
    TargetError,
    WeightStoreError,
    named,
)
from weightstore.formats import delta as delta_format
from weightstore.formats._pointer import LATEST, VERSION_NAME, parse_pointer
from weightstore.formats._sharded_index import ShardIndex, attempt_of, written_in_attempt
from weightstore.io.files import remove_stale_temporaries
from weightstore.io.folders import Folder, LocalFolder, folder_for
from weightstore.sync import _stages as stages
from weightstore.sync._pinning import Version, pointer_version, read_latest
from weightstore.sync._writers import taken_over, tried_here, writer

_log = logging.getLogger(__name__)

#: the suffix of a sharded version's index (:mod:`weightstore.sharded._shards`)
SHARDED_SUFFIX = ".wsindex"


INTENT = ".publishing"


@dataclass
class FolderState:
    """What a publish must know before writing: LATEST, the version files, a killed publish's intent."""

    folder: Folder
    pointer: Version | None
    pointer_error: FormatError | None
    #: each version file's step and name, by step
    versions: list[tuple[int, str]]
    intent: int | None
    #: whether a LATEST was there, and its ETag (object storage), for the compare-and-swap
    latest_exists: bool = False
    latest_tag: str | None = None
    #: the process that wrote ``LATEST`` (:mod:`weightstore.sync._writers`), where it says
    latest_writer: object = None
    #: the process that wrote the intent, where it says
    intent_writer: object = None
    #: every file's name, as the one listing of the folder gave them
    names: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, folder: Folder) -> FolderState:
        """What a publish must know, from one listing of the folder (names only: no stat of each
        of 10,000 versions) and a read of ``LATEST`` and of the intent."""
        try:
            data, tag = folder.read_tagged(LATEST, MAX_POINTER_BYTES + 1)
        except TargetError as exc:
            names = folder.names()
            intent, intent_writer = _read_intent(folder)
            return cls(folder, None, FormatError(f"{exc.message}; the next publish replaces it", path=exc.path),
                       version_names(names), intent, True, intent_writer=intent_writer, names=names)
        names = folder.names()  # after LATEST: it names no version this listing could miss
        versions = version_names(names)
        try:
            pointer, error = pointer_version(folder, data), None
        except FormatError as exc:
            pointer, error = None, exc
        latest_writer = parse_pointer(data).get("writer") if pointer is not None and data is not None else None
        intent, intent_writer = _read_intent(folder)
        return cls(folder, pointer, error, versions, intent, data is not None, tag, latest_writer, intent_writer, names)

    @property
    def newest(self) -> int | None:
        """The newest version file's step, but a version :meth:`unpublished` counts."""
        left = {step for step, _ in self.unpublished()}
        return next((step for step, _ in reversed(self.versions) if step not in left), None)

    def unpublished(self) -> list[tuple[int, str]]:
        """Version files above the one LATEST names that a killed publish's intent accounts for.

        Without a readable ``LATEST``, only the intent's version of a publish of this process:
        its own first publish whose ``LATEST`` write failed (a 500, a full disk), which its retry
        of the same step then writes again and completes. Another's (a first publish killed, or
        ``LATEST`` deleted by hand while one was under way) stays, its step counting as current."""
        if self.pointer is None and self.intent_writer != writer():
            return []
        above = -1 if self.pointer is None else self.pointer.step
        return [(step, name) for step, name in self.versions if step > above and step == self.intent]

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
        latest_step = None if self.pointer is None else self.pointer.step
        taken = taken_over(self.folder, self.latest_writer, latest_step)
        if taken is not None:
            raise PublishError(f"step {step} was not published: {taken}", path=where)
        if self.pointer is not None and step <= self.pointer.step:
            raise PublishError(f"step {step} is not after step {self.pointer.step}, which LATEST names; steps must "
                               "increase (is another trainer publishing to this folder, or was this one restarted "
                               f"from an older checkpoint? then its publishes go through once its step passes "
                               f"{self.pointer.step}; to serve its weights before that, publish to a new folder)",
                               path=where)
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
        tried_here(self.folder, self.latest_writer, latest_step)  # it goes on to write

    def clean(self) -> None:
        """Before a publish writes: remove dead writers' temporaries and, in a local folder (whose
        lock keeps other publishers out), the versions killed publishes wrote but never named."""
        if isinstance(self.folder, LocalFolder):
            for name in self.folder.temporaries(self.names):
                remove_stale_temporaries(self.folder.root / name, locked=self._written_locked(name))
            self.remove_unpublished()
            if self.intent is not None:
                self.folder.remove(INTENT)

    def _written_locked(self, name: str) -> bool:
        """Whether every writer of ``name`` holds the folder's lock, which this publish holds, so
        its temporaries are a dead publisher's whatever their PID says: ``LATEST``, the intent,
        and the version of the step a killed publish's intent names (written after the intent).
        Any other name may be a live writer's that takes no lock: a ``ws.save`` beside the
        versions, or a sharded coordinator's index put back after its commit let the lock go;
        those keep the PID rule. Where the lock shuts nobody out (no ``fcntl``), no name."""
        if not (isinstance(self.folder, LocalFolder) and self.folder.locks):
            return False
        match = VERSION_NAME.match(name)
        return name in (LATEST, INTENT) or (match is not None and int(match.group(1)) == self.intent)

    def remove_unpublished_of(self, step: int) -> None:
        """Before this publish uploads ``step``: remove the files of that step above ``LATEST``
        that a killed publish left (the intent names the step), as the upload of a version
        replaces no object (a publisher stopped mid-publish must never replace the version of
        the step that another then published). Were it a live publisher's instead (stopped
        between its upload and its swap of ``LATEST``), its swap fails once this one's has
        succeeded; one that goes on first looks at its object's upload token before its swap and
        is refused, and one that went on between that look and its swap would name this
        publisher's file under its own record, which readers refuse
        (:func:`~weightstore.sync._pinning.own_record`) until the next publish."""
        for unpublished, name in self.unpublished():
            if unpublished == step:
                self.folder.remove(name)
                self.versions.remove((unpublished, name))

    def remove_unpublished(self, step: int | None = None) -> None:
        """Remove the versions above ``LATEST`` that a killed publish's intent names, but ``step``'s.

        On object storage there is no lock, so such a version may be another publisher's in
        flight; it is removed only after this publish's compare-and-swap of ``LATEST``
        succeeded. Its publisher wrote the intent after reading ``LATEST``, so that reading
        came before this swap, and its own swap now fails: the version is dead. So is its
        upload of the intent's step if it was killed mid-way (S3 keeps a multipart upload's
        parts, unseen and billed, until it is aborted): aborted too, with a log line; this
        publish's own version of that step, if it is one, was complete before its swap. So is
        an upload of any step up to ``step``: a publisher that read ``LATEST`` after this swap
        is refused such a step, and one that read it before loses its own swap; a trainer
        killed mid-upload twice in a row leaves one such upload the intent no longer names.
        """
        for unpublished, name in self.unpublished():
            if unpublished != step:
                self.folder.remove(name)  # a sharded one's members: the next commit removes dead attempts
                self.versions.remove((unpublished, name))
        if self.intent is not None and not isinstance(self.folder, LocalFolder):
            intent = self.intent
            steps: dict[str, int] = {}  # of each name asked about, -1 if no version's

            def killed(name: str) -> bool:
                match = VERSION_NAME.match(name)
                steps[name] = -1 if match is None else int(match.group(1))
                return steps[name] == intent or (step is not None and 0 <= steps[name] <= step)

            for name in self.folder.abort_uploads(killed):
                _log.warning("%s: aborted the unfinished upload of %s, which a killed publish of step %d left",
                             self.folder.where, name, steps[name])


def _steps(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {named(steps, shown=5)}"


def version_files(folder: Folder) -> list[tuple[int, Any]]:
    found = []
    for entry in folder.files():
        match = VERSION_NAME.match(entry.name)
        if match:
            found.append((int(match.group(1)), entry))
    return sorted(found, key=lambda item: item[0])


def version_names(names: list[str]) -> list[tuple[int, str]]:
    """The step and name of each version file among ``names``, by step."""
    found = []
    for name in names:
        match = VERSION_NAME.match(name)
        if match:
            found.append((int(match.group(1)), name))
    return sorted(found)


def not_file_versions(folder: Folder) -> list[tuple[int, str, str]]:
    """Version names held by what is no file (a folder, a FIFO, a symbolic link): each one's
    step, name and what it is (:meth:`Folder.not_files`). No reader opens them; ``ws versions``
    and ``ws verify`` list them, so a follower's refusal is not the first sign of one."""
    found = []
    for name, kind in folder.not_files().items():
        match = VERSION_NAME.match(name)
        if match:
            found.append((int(match.group(1)), name, kind))
    return sorted(found)


def intent_bytes(step: int, name: str) -> bytes:
    """The intent record of a publish of ``step`` writing the file ``name``, by this process."""
    return json.dumps({"step": step, "file": name, "writer": writer()}).encode()


def _read_intent(folder: Folder) -> tuple[int | None, object]:
    """The step a killed (or failed) publish was writing, and the process that wrote it, from its
    intent record (a writer ``None`` where it does not say); ``(None, None)`` when there is none,
    or none this process can open (a link to itself, another user's file): no version is then a
    killed publish's, so every one above ``LATEST`` is kept, and a reader needs none."""
    try:
        data = folder.read_small(INTENT, 4096)
    except (TargetError, FileAccessError):
        return None, None
    try:
        record = jsontext.loads(data, what=INTENT, min_bytes=POINTER_BYTES_PER_CONTAINER) if data else None
        step = record["step"] if record is not None else None
    except (FormatError, TypeError, KeyError):
        return None, None
    if not isinstance(step, int) or isinstance(step, bool):
        return None, None
    return step, record.get("writer") if isinstance(record, dict) else None


def write_small(folder: Folder, name: str, data: bytes, *, swept: bool = False) -> None:
    with folder.commit(name, swept=swept).writing() as local, open(local, "wb") as handle:
        handle.write(data)


def prune(folder: Folder, newest: int, keep: int | None, versions: list[tuple[int, str]] | None = None,
          chain: Sequence[str] = ()) -> None:
    """Remove the versions past the newest ``keep`` (up to step ``newest``), but never a base a
    kept delta version needs; the newest first, so a delta is never left without its base.
    ``versions``: the folder's version files (step, name) where the caller knows them (a local
    publish, whose lock has kept other publishers out since it listed the folder), else listed.
    ``chain``: the chain of the delta version just published (its base first, down to its
    anchor: :attr:`~weightstore.formats.delta.Head.chain`), whose publisher holds it.

    The oldest kept version's chain is all that is needed: a kept delta's chain runs from its
    anchor to itself, and where that anchor is older than the oldest kept version, so is the
    oldest's own (no anchor lies between them). So at most one head is read per prune, none
    where the oldest kept version is in ``chain`` (its own chain is the rest of it; reading that
    head took 0.1 ms, 1% of a 3.3 MB model's delta publish). A head that cannot be read stops
    the pruning of anything older this time (its chain is unknown), with a warning."""
    if keep is None:
        return
    listed = versions if versions is not None else version_names(folder.names())
    names = [name for step, name in listed if step <= newest]
    if len(names) <= keep:
        return
    oldest = names[-keep]
    needed = set(chain[chain.index(oldest) + 1 :]) if oldest in chain else needed_bases(folder, oldest)
    if needed is None:
        return
    for name in reversed(names[:-keep]):
        if name not in needed:
            remove_version(folder, name)
            stages.reached("pruning")


def needed_bases(folder: Folder, name: str) -> set[str] | None:
    """Every file version ``name`` builds on (none for a full version; a sharded version's, the
    indexes its delta members build on); ``None`` when its head (or index) does not read."""
    try:
        if name.endswith(SHARDED_SUFFIX):
            delta = read_index(folder, name).delta
            return set() if delta is None else set(delta.chain)
        if not name.endswith(delta_format.SUFFIX):
            return set()
        return set(delta_format.read_head(folder.open_binary(name), folder.url(name)).chain)
    except (WeightStoreError, FileNotFoundError) as exc:
        warnings.warn(f"{folder.url(name)}: its head cannot be read ({exc}), so the bases it needs are unknown: "
                      "nothing older is pruned this time", stacklevel=3)
        return None


def read_index(folder: Folder, name: str) -> ShardIndex:
    """The sharded version's index ``name``, parsed (``FileNotFoundError`` when it is gone)."""
    data = folder.read_small(name, MAX_V1_INDEX_BYTES + 1)
    if data is None:
        raise FileNotFoundError(folder.url(name))
    return ShardIndex.parse(data)


def remove_version(folder: Folder, name: str) -> None:
    """Remove a version file; a sharded version's index first, then every attempt folder of its
    step (:func:`remove_attempt`)."""
    folder.remove(name)
    if name.endswith(SHARDED_SUFFIX):
        step = int(name[len("step-"):-len(SHARDED_SUFFIX)])
        for sub in folder.subfolders():
            held = attempt_of(sub)
            if held is not None and held[0] == step:
                remove_attempt(folder, sub)


def remove_attempt(folder: Folder, name: str) -> bool:
    """Remove attempt folder ``name``: the files weightstore writes there, then the folder.
    Anything else in it (a user's file or folder) stays, and so does the folder, with a warning
    naming it. Whether the folder is gone."""
    left = folder.remove_folder(name, written_in_attempt)
    if left:
        shown = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        warnings.warn(f"{folder.url(name)}: kept: it holds what weightstore does not write there ({shown})",
                      UserWarning, stacklevel=3)
    return not left


def names_step(target: Folder, step: int) -> bool:
    """Whether ``LATEST`` names ``step`` now; when it cannot be read, as if it did (keep the file).
    A sharded commit that lost its swap of ``LATEST`` removes its index unless so: its index was
    created only where none was (so it is its own), and below a later ``LATEST`` it would name
    members the winner's commit may have removed as a dead attempt's."""
    try:
        current = read_latest(target)
    except WeightStoreError:
        return True
    return current is not None and current.step == step


def kept_by_latest(target: Folder, step: int, name: str) -> bool:
    """Whether the file ``name`` of ``step``, which a publish that was then refused wrote, must
    stay: ``LATEST`` names it, or names a later step (the file is history below it then, and may
    be another writer's of that step: a publisher stopped mid-publish on one node while a trainer
    restarted on another published the same step, then more, would remove a published version).
    When ``LATEST`` cannot be read, as if it named it (keep the file)."""
    try:
        current = read_latest(target)
    except WeightStoreError:
        return True
    return current is not None and (current.step > step or (current.step == step and current.file_name == name))


def versions_folder(folder: Any, storage_options: Mapping[str, Any] | None = None) -> Folder:
    """``folder`` opened for reading versions, which may not exist yet (a follower waits for it),
    but is refused when it is a local file, FIFO or device: nothing will turn that into a
    folder, and a follower would wait for good."""
    source = folder_for(folder, storage_options)
    if os.path.exists(source.where) and not os.path.isdir(source.where):  # a file, a FIFO, a device
        parent, name = os.path.split(source.where)
        whose = (f"; give the folder it is in, {parent or '.'}" if name == LATEST or VERSION_NAME.match(name)
                 else "")  # ws follow run/LATEST: the folder's own files name it
        raise StoreNotFoundError(f"is a file, not a folder of versions{whose}", path=source.where)
    return source


def require_folder(folder: Any, *, storage_options: Mapping[str, Any] | None = None, hint: str = "") -> Folder:
    """``folder`` opened, or :class:`StoreNotFoundError` naming it when it does not exist."""
    source = versions_folder(folder, storage_options)
    if not source.exists():
        raise StoreNotFoundError("no such folder" + (f"; {hint}" if hint else ""), path=source.where)
    return source


def check_notifications(source: Folder, notifications: str | None) -> None:
    """Refuse ``notifications`` for a local folder: no bucket sends its events, so the queue
    would stay silent while the option seemed to work."""
    if notifications is not None and isinstance(source, LocalFolder):
        raise ValueError(f"notifications wake followers of an object-storage folder (s3://...), and "
                         f"{source.where} is local: drop them; the poll interval sets how often LATEST is read")
