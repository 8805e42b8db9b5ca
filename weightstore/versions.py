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
publish removes them.

**A missing or damaged ``LATEST``** (deleted by hand, or a first publish killed between its
version file and its pointer) never costs versions: the newest version file's step then counts
as current, so the next publish must be above it (with a warning), and that publish removes
nothing but temporaries of dead writers. A complete version file a killed *first* publish left
is therefore kept: it holds real weights of that step, readers never saw it, and retention
prunes it like any older version.

**One publisher per folder.** Steps must strictly increase: a publish whose step is not
above the step ``LATEST`` names (or, without a readable ``LATEST``, the newest version file's)
is refused with :class:`PublishError`. On a local folder,
publishes serialise on an advisory lock (``.publish.lock``), so two processes cannot
interleave the check and the write; on object stores there is no lock and the check is
best-effort (read ``LATEST``, then write), so run one publisher per folder there.

**Pinning.** :func:`follow` opens each version before yielding it. A local file is memory-
mapped, and a mapping survives the file's removal, so a slow reader keeps its version. An
object store has no such thing: the open object's bytes are fetched in ranges as they are read,
so a reader that lags more than one publish behind can still lose a large version; it then gets
:class:`VersionGoneError` and should move to the newest (``Follower`` does).

**Hot reload.** ``tf1.assign``/``tf2.assign`` given a :class:`Version` skip every tensor whose
manifest checksum equals what the same target last received (``skip_unchanged=None`` means
"only for versions"; pass ``True``/``False`` to force it), and list them in ``report.skipped``.
Unchanged tensors are not even read.

**URLs.** Anything fsspec opens. Credentials and endpoints come from ``storage_options=`` or
from the environment as the client reads it (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``…).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightstore.errors import FormatError, PublishError, StoreNotFoundError, VersionGoneError
from weightstore.formats import format_for_suffix, format_named
from weightstore.store import (
    TEMP_MARK,
    Store,
    _checked,
    _fsspec,
    checked_metadata,
    atomic_target,
    is_url,
    remove_stale_temporaries,
    write_file,
)

__all__ = ["Version", "VersionEntry", "publish", "latest", "follow", "list_versions"]

LATEST = "LATEST"
LOCK = ".publish.lock"
POINTER_FORMAT = "weightstore-latest"
_NAME = re.compile(r"^step-(\d+)(\.[A-Za-z0-9]+)$")
_MAX_POINTER_BYTES = 1 << 20

def _stage(name: str) -> None:
    """Marks each stage of a publish; does nothing (tests replace it to kill the publisher there)."""


@dataclass
class Version:
    """One published version. ``ws.open``, ``ws.load`` and the adapters' ``assign`` accept it.

    A version yielded by :func:`follow` is *pinned*: its file is already open, so it stays
    readable (even if pruned meanwhile) until the iteration moves on. One from :func:`latest`
    is opened when first read; if it was pruned by then, that read raises
    :class:`VersionGoneError` — call ``latest`` again and retry. Assigning a Version skips
    tensors whose checksum equals what the same target last received (hot reload).
    """

    step: int
    path: str
    created: str
    metadata: dict[str, Any] = field(default_factory=dict)
    _folder: "_Folder | None" = field(default=None, repr=False, compare=False)
    _pinned: Store | None = field(default=None, repr=False, compare=False)

    def _weightstore_open(self, *, verify: bool = True) -> Store:
        """What ``ws.open(version)`` returns: a view of the pinned file, or the file opened now."""
        if self._pinned is not None:
            return Store(_Borrowed(self._pinned._reader), self.path, verify)
        folder = self._folder or _folder_for(self.path.rsplit("/", 1)[0] if "/" in self.path else ".")
        return folder.open_version(self, verify)

    def pin(self) -> None:
        """Open the file now so that pruning cannot take it away; :meth:`release` lets go."""
        if self._pinned is None:
            self._pinned = self._weightstore_open(verify=True)

    def release(self) -> None:
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None


class _Borrowed:
    """A pinned version's reader, lent to a Store whose ``close`` must not end the pin."""

    def __init__(self, reader: Any):
        self._reader = reader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class VersionEntry:
    """A version file as ``ws versions`` lists it."""

    step: int
    name: str
    path: str
    size: int
    modified: str
    latest: bool


def publish(
    folder: Any,
    weights: Mapping[str, Any],
    *,
    step: int,
    keep: int | None = 5,
    metadata: Mapping[str, Any] | None = None,
    format: str = "npz",  # noqa: A002
    storage_options: Mapping[str, Any] | None = None,
) -> Version:
    """Write ``weights`` as version ``step`` of ``folder``, point ``LATEST`` at it, prune.

    ``step`` must be above the step ``LATEST`` names (one publisher per folder). ``keep`` is how
    many versions stay (``None``: all); never fewer than two, so the version a reader has just
    found through ``LATEST`` survives the next publish. ``storage_options`` go to fsspec for
    URLs (credentials, ``client_kwargs={"endpoint_url": ...}``).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, not {step!r}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be at least 1 (or None to keep all), not {keep!r}")
    fmt = format_named(format)
    target = _folder_for(folder, storage_options)
    name = f"step-{step:012d}{fmt.suffixes[0]}"
    arrays = _checked(weights, target.url(name), fmt)
    metadata = checked_metadata(metadata, target.url(name))
    target.create()
    with target.publish_lock():
        _stage("locked")
        current, named = target.current_step()
        if current is not None and step <= current:
            which = "LATEST names" if named else "is the newest version file (LATEST is missing or damaged)"
            raise PublishError(
                f"{target.where}: step {step} is not after step {current}, which {which}; steps must increase"
                " (is another trainer publishing to this folder?)"
            )
        target.remove_leftovers(current, named)
        _stage("cleaned")
        created = _now()
        pointer = json.dumps({"format": POINTER_FORMAT, "version": 1, "step": step, "file": name,
                              "created": created, "metadata": dict(metadata or {})}, sort_keys=True)
        target.write_version(name, fmt, arrays, metadata)
        _stage("version-written")
        target.write_latest(pointer.encode())
        _stage("latest-written")
        target.prune(step, None if keep is None else max(keep, 2))
        _stage("pruned")
    return Version(step, target.url(name), created, dict(metadata or {}), target)


def latest(folder: Any, *, storage_options: Mapping[str, Any] | None = None) -> Version | None:
    """The version ``LATEST`` names, or ``None`` if nothing was published yet.

    Raises :class:`FormatError` when ``LATEST`` is empty or not a pointer. The file itself is
    opened only when read; see :class:`Version`.
    """
    return _folder_for(folder, storage_options).latest()


def follow(
    folder: Any,
    *,
    poll: float = 1.0,
    timeout: float | None = None,
    after: int | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Iterator[Version]:
    """Yield each new version of ``folder``, pinned, in increasing step order.

    Starts from the latest version (or the first above ``after``); versions published while
    the caller was busy are skipped in favour of the newest. Stops after ``timeout`` seconds
    without a new version (``None``: never). A version pruned between reading ``LATEST`` and
    opening it is retried at once; ``LATEST`` naming a file that stays missing raises
    :class:`StoreNotFoundError`.
    """
    source = _folder_for(folder, storage_options)
    last = after
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        version = _newer_pinned(source, last)
        if version is not None:
            try:
                yield version
            finally:
                version.release()
            last = version.step
            deadline = None if timeout is None else time.monotonic() + timeout
            continue
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return
        time.sleep(poll if remaining is None else min(poll, remaining))


def _newer_pinned(source: "_Folder", last: int | None) -> Version | None:
    """The latest version if it is above ``last``, opened; retries while it is pruned away."""
    gone = None
    while True:
        version = source.latest()
        if version is None or (last is not None and version.step <= last):
            return None
        try:
            version.pin()
            return version
        except VersionGoneError:
            if gone == version.step:  # LATEST still names it: not a race, a damaged folder
                raise StoreNotFoundError(
                    f"{source.where}: LATEST names {version.path}, which does not exist; publish again to repair"
                ) from None
            gone = version.step


def list_versions(folder: Any, *, storage_options: Mapping[str, Any] | None = None) -> list[VersionEntry]:
    """Every version file in ``folder``, oldest first, marking the one ``LATEST`` names."""
    source = _folder_for(folder, storage_options)
    if not source.exists():
        raise StoreNotFoundError(f"{source.where}: no such folder")
    pointer = source.latest()
    named = pointer.path.rsplit("/", 1)[-1] if pointer else None
    return [
        VersionEntry(step, name, source.url(name), size, modified, name == named)
        for step, name, size, modified in source.entries()
    ]


def _gone(version: Version) -> VersionGoneError:
    return VersionGoneError(f"{version.path}: version {version.step} is gone (pruned); read LATEST again and retry")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse_pointer(data: bytes, where: str) -> dict[str, Any]:
    if not data.strip():
        raise FormatError(f"{where}: LATEST is empty; publish again to repair it")
    try:
        pointer = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        pointer = None
    if (
        not isinstance(pointer, dict) or pointer.get("format") != POINTER_FORMAT
        or not isinstance(pointer.get("step"), int) or not isinstance(pointer.get("file"), str)
        or _NAME.match(pointer["file"]) is None or int(_NAME.match(pointer["file"]).group(1)) != pointer["step"]
    ):
        raise FormatError(f"{where}: LATEST is not a weightstore version pointer; publish again to repair it")
    return pointer


class _Folder:
    """The handful of operations a versioned folder needs; local and fsspec versions below."""

    where: str

    def url(self, name: str) -> str:
        return f"{self.where.rstrip('/')}/{name}"

    def latest(self) -> Version | None:
        data = self.read_latest()
        if data is None:
            return None
        pointer = _parse_pointer(data, self.where)
        metadata = pointer.get("metadata") if isinstance(pointer.get("metadata"), dict) else {}
        return Version(pointer["step"], self.url(pointer["file"]), str(pointer.get("created", "")), metadata, self)

    def current_step(self) -> tuple[int | None, bool]:
        """The step a new publish must exceed, and whether LATEST names it.

        LATEST's step when it is readable; when it is damaged or missing but version files
        exist, the newest file's, so a folder that lost its pointer neither goes backwards nor
        loses versions. ``None`` for a folder with no versions.
        """
        try:
            version = self.latest()
        except FormatError as exc:
            warnings.warn(f"{exc}; the next publish replaces it", stacklevel=3)
            return self._newest_file(), False
        if version is not None:
            return version.step, True
        newest = self._newest_file()
        if newest is not None:
            warnings.warn(f"{self.where}: LATEST is missing but version files exist; the newest, step {newest}, "
                          "counts as current and the next publish names its own version", stacklevel=3)
        return newest, False

    def _newest_file(self) -> int | None:
        steps = [step for step, *_ in self.entries()]
        return max(steps) if steps else None

    def remove_leftovers(self, current: int | None, named: bool) -> None:
        """Remove versions above the one LATEST names: a killed publish wrote them, LATEST never named them.

        Without a readable LATEST (``named`` false) no version is removed: any of them may be
        the one a reader or a person still needs. Temporaries of dead writers go either way.
        """
        if not named:
            return
        for step, name, *_ in self.entries():
            if step > current:
                self.remove(name)

    def prune(self, newest: int, keep: int | None) -> None:
        if keep is None:
            return
        entries = [entry for entry in self.entries() if entry[0] <= newest]
        for _, name, *_ in entries[:-keep]:
            self.remove(name)
            _stage("pruning")

    def create(self) -> None:
        """Make the folder if this kind of folder needs making (object stores do not)."""

    # implemented by each kind of folder
    def exists(self) -> bool: ...
    def read_latest(self) -> bytes | None: ...
    def entries(self) -> list[tuple[int, str, int, str]]: ...
    def write_version(self, name: str, fmt, arrays, metadata) -> None: ...
    def write_latest(self, data: bytes) -> None: ...
    def remove(self, name: str) -> None: ...
    def open_version(self, version: Version, verify: bool) -> Store: ...
    def publish_lock(self) -> contextlib.AbstractContextManager: ...


class _LocalFolder(_Folder):
    def __init__(self, path: str):
        self.root = Path(path)
        self.where = str(path)

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def exists(self) -> bool:
        return self.root.is_dir()

    def read_latest(self) -> bytes | None:
        try:
            with open(self.root / LATEST, "rb") as handle:
                return handle.read(_MAX_POINTER_BYTES)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def entries(self) -> list[tuple[int, str, int, str]]:
        found = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.root):
                match = _NAME.match(entry.name)
                if match:
                    with contextlib.suppress(FileNotFoundError):  # pruned while we listed
                        stat = entry.stat()
                        found.append((int(match.group(1)), entry.name, stat.st_size, _iso(stat.st_mtime)))
        return sorted(found)

    def write_version(self, name: str, fmt, arrays, metadata) -> None:
        with atomic_target(self.root / name) as temporary:
            write_file(temporary, fmt, arrays, metadata, False)
            _stage("version-temporary")

    def write_latest(self, data: bytes) -> None:
        with atomic_target(self.root / LATEST) as temporary:
            with open(temporary, "wb") as handle:
                handle.write(data)
            _stage("latest-temporary")

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / name)

    def remove_leftovers(self, current: int | None, named: bool) -> None:
        targets = {entry.name.split(TEMP_MARK)[0][1:] for entry in os.scandir(self.root) if TEMP_MARK in entry.name}
        for name in targets:
            remove_stale_temporaries(self.root / name)
        super().remove_leftovers(current, named)

    def open_version(self, version: Version, verify: bool) -> Store:
        from weightstore.store import open as open_store

        try:
            return open_store(version.path, verify=verify)
        except FileNotFoundError:  # also when pruned between ``open``'s look and its map
            raise _gone(version) from None

    @contextlib.contextmanager
    def publish_lock(self) -> Iterator[None]:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no advisory lock, steps still checked
            yield
            return
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


class _RemoteFolder(_Folder):
    """An fsspec folder: no rename, so each object is written whole, LATEST last."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None):
        self.where = url.rstrip("/")
        self.fs, self.root = _fsspec().core.url_to_fs(url, **dict(storage_options or {}))
        self.root = self.root.rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self) -> bool:
        self.fs.invalidate_cache(self.root)
        return bool(self.fs.exists(self.root)) or bool(self.entries())

    def read_latest(self) -> bytes | None:
        try:
            return self.fs.cat_file(self._path(LATEST))  # no range: S3 refuses one on an empty object
        except FileNotFoundError:
            return None

    def entries(self) -> list[tuple[int, str, int, str]]:
        self.fs.invalidate_cache(self.root)
        try:
            listing = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        found = []
        for info in listing:
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            match = _NAME.match(name)
            if match and info.get("type") != "directory":
                found.append((int(match.group(1)), name, int(info.get("size") or 0), _modified(info)))
        return sorted(found)

    def write_version(self, name: str, fmt, arrays, metadata) -> None:
        with tempfile.TemporaryDirectory(prefix="weightstore-publish-") as scratch:
            local = os.path.join(scratch, name)
            write_file(local, fmt, arrays, metadata, False)
            _stage("version-temporary")
            self.fs.put_file(local, self._path(name))

    def write_latest(self, data: bytes) -> None:
        self.fs.pipe_file(self._path(LATEST), data)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))

    def open_version(self, version: Version, verify: bool) -> Store:
        name = version.path.rsplit("/", 1)[-1]
        try:
            handle = self.fs.open(self._path(name), "rb")
        except FileNotFoundError:
            raise _gone(version) from None
        try:
            fmt = format_for_suffix(name) or format_named("npz")
            return Store(fmt.open_reader(handle, version.path), version.path, verify)
        except FileNotFoundError:
            handle.close()
            raise _gone(version) from None
        except BaseException:
            handle.close()
            raise

    @contextlib.contextmanager
    def publish_lock(self) -> Iterator[None]:
        yield  # object stores offer no lock; the step check guards, best-effort


def _folder_for(folder: Any, storage_options: Mapping[str, Any] | None = None) -> _Folder:
    text = os.fspath(folder)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if is_url(text):
        return _RemoteFolder(text, storage_options)
    return _LocalFolder(text)


def _iso(timestamp: float) -> str:
    moment = datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def _modified(info: Mapping[str, Any]) -> str:
    for key in ("LastModified", "mtime", "created", "updated"):
        value = info.get(key)
        if isinstance(value, datetime.datetime):
            return _iso(value.timestamp())
        if isinstance(value, (int, float)):
            return _iso(float(value))
        if isinstance(value, str) and value:
            return value
    return ""
