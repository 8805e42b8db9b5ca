"""Where weights live and how a write becomes visible: locations, commit protocols, folders.

Every byte weightstore writes goes through this module; no other module decides "local path
or URL?" for itself, names a temporary file, or calls ``fsync``.

**Locations.** :func:`location_of` turns what a user passes (a path, ``file://`` URL, fsspec URL,
or anything with a ``.path`` such as a ``Version``) into a :class:`Location`, decided once.

**Commit protocols.** A reader must only ever see a whole file, old or new, and a crash at any
instant must leave one of the two. Each way we reach that is a named type or a documented
composition of them:

1. *Rename* (:class:`RenameCommit`; every local file: ``save``, version files, ``LATEST``).
   The data goes to a temporary beside the target (``.NAME.wstmp-PID-RANDOM``: same folder,
   so the same file system), is fsynced, renamed over the target, and the folder is fsynced.
   A crash before the rename leaves the old file plus a temporary; after it, the new file.
   The temporary of a killed writer is removed by the next write to that target once its PID
   is dead (:func:`remove_stale_temporaries`). Only regular files are replaced: a folder, FIFO,
   socket or device at the target is refused before anything is written, a symlink is
   written *through* (its target file is replaced, the link stays), and the new file keeps
   the permission bits of the one it replaces.
2. *Upload* (:class:`UploadCommit`; URLs). Object stores have no rename, but make an object
   visible all at once when its upload completes (S3 PutObject / CompleteMultipartUpload), so
   the file is written to a local scratch folder and sent in one ``put``: on S3, a file of at
   least two parts (:data:`UPLOAD_PART_BYTES`) goes as a multipart upload whose parts are sent
   concurrently (s3fs's ``max_concurrency`` storage option, default 10), and the object appears
   only at CompleteMultipartUpload. A crash leaves the old object; an unfinished multipart
   upload is invisible (s3fs aborts it when a part fails).
3. *Pointer last* (versioned folders, :mod:`weightstore.versions`). Each version file is
   committed by 1 or 2, and only then the small ``LATEST`` pointer, by the same protocol.
   Readers reach versions only through ``LATEST``, so a crash between the two leaves a version
   file no reader sees; the publisher's intent record says which file that is (see versions).
4. *Index last* (TF checkpoints written by ``ws import``). A checkpoint is ``PREFIX.index`` plus
   data files whose names TensorFlow fixes; the new data files take names the old index never
   reads, are committed by rename, and renaming the ``.index`` is the single commit point.

**Folders.** :class:`Folder` is the handful of operations a versioned folder needs, with a
local (:class:`LocalFolder`) and an fsspec (:class:`RemoteFolder`) backend.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import os
import re
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from weightstore.errors import (
    MissingDependencyError,
    StorageError,
    StoreNotFoundError,
    TargetError,
    WeightStoreError,
    WriteError,
)

__all__ = [
    "TEMP_MARK", "Location", "location_of", "is_url", "filesystem", "Commit", "RenameCommit", "UploadCommit",
    "commit_for", "temporary_beside", "remove_stale_temporaries", "fsync_path", "fsync_folder",
    "check_writable_target", "Folder", "LocalFolder", "RemoteFolder", "folder_for", "FileEntry",
]

#: marks the temporary file a write puts beside its target (``.NAME.wstmp-PID-RANDOM``)
TEMP_MARK = ".wstmp-"
#: part size of a multipart upload to S3 (at least 5 MiB, S3's floor): s3fs's own default of
#: 50 MiB sends anything under 100 MiB as one serial PUT
UPLOAD_PART_BYTES = 8 << 20


def is_url(path: object) -> bool:
    """Whether ``path`` names an fsspec URL rather than a local file (``file://`` is local)."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return "://" in text and not text.startswith("file://")


@dataclass(frozen=True)
class Location:
    """A path or URL, with the one decision every caller needs made once: is it remote?"""

    text: str
    remote: bool

    def __str__(self) -> str:
        return self.text


def location_of(path: Any) -> Location:
    """The location behind anything weightstore accepts as a file (``Version`` has ``.path``)."""
    if hasattr(path, "path") and not isinstance(path, (str, os.PathLike)):
        path = path.path
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    return Location(text, is_url(text))


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec file system and its path for ``url``; fsspec is imported only for URLs."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        raise MissingDependencyError("reading URLs needs fsspec: pip install 'weightstore[s3]'") from None
    return fsspec.core.url_to_fs(url, **dict(storage_options or {}))


# -- local durability ----------------------------------------------------------------------

def fsync_path(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(folder: str | Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_beside(target: Path) -> Path:
    """A fresh temporary name beside ``target`` that :func:`remove_stale_temporaries` recognises."""
    return target.with_name(f".{target.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def remove_stale_temporaries(target: Path, suffix: str = "") -> None:
    """Remove temporaries of earlier writes to ``target`` whose process has died (SIGKILL).

    ``suffix`` is a pattern for what a writer appends after the temporary's name (the file
    endings of a TF checkpoint written under a temporary prefix).
    """
    pattern = re.compile(re.escape(f".{target.name}{TEMP_MARK}") + r"(\d+)-[0-9a-f]+" + suffix + "$")
    with contextlib.suppress(OSError):
        for entry in os.scandir(target.parent):
            match = pattern.match(entry.name)
            if match and not _process_alive(int(match.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind_of(mode: int) -> str | None:
    """What a non-regular file is, in words; ``None`` for a regular file."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return None if stat.S_ISREG(mode) else "not a regular file"


def check_writable_target(target: Path) -> Path:
    """The regular file a write to ``target`` replaces: ``target``, or the file a symlink names.

    Refuses, with :class:`TargetError` and before a byte is written, a target that is a folder,
    FIFO, socket or device (replacing ``/dev/null`` or a named pipe with a weight file is data
    loss), and a missing folder with :class:`StoreNotFoundError`.
    """
    resolved = Path(os.path.realpath(target)) if target.is_symlink() else target
    try:
        mode = os.stat(resolved).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise TargetError(f"cannot write there ({exc.strerror})", path=str(target)) from None
    if mode is not None:
        kind = _kind_of(mode)
        if kind is not None:
            raise TargetError(f"is {kind}; weightstore only replaces regular files", path=str(target))
    if not resolved.parent.is_dir():
        raise StoreNotFoundError(f"folder {str(resolved.parent)!r} does not exist", path=str(target))
    return resolved


# -- commit protocols ----------------------------------------------------------------------

class Commit(abc.ABC):
    """One way a file becomes visible at its target (see the module docstring).

    :meth:`writing` yields a local path to write the whole file to; leaving the block normally
    commits it, an exception discards it and leaves the target as it was.
    """

    target: str

    @abc.abstractmethod
    def begin(self) -> str:
        """Prepare and return the local path the writer fills."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Make the written file visible at the target, durably."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Remove whatever :meth:`begin` and the writer left; the target is untouched."""

    @contextlib.contextmanager
    def writing(self) -> Iterator[str]:
        """A write the file system refuses (disk full, file-size limit, read-only) comes out as
        a :class:`WriteError` naming the target and keeping the ``errno``, so a caller that
        handles ``OSError`` still does and a background publish says which file failed."""
        path = self.begin()
        try:
            yield path
            self.finalize()
        except WeightStoreError:
            self.discard()
            raise
        except OSError as exc:
            self.discard()
            raise WriteError(exc.errno or 0, f"writing failed: {exc.strerror or exc}", path=self.target) from exc
        except BaseException:
            self.discard()
            raise


class RenameCommit(Commit):
    """Protocol 1: a temporary beside the target, fsync, rename over it, fsync the folder."""

    def __init__(self, target: str | Path, *, stale_suffix: str = ""):
        self.target = str(target)
        self._final = Path(target)
        self._stale_suffix = stale_suffix
        self._temporary: Path | None = None

    def begin(self) -> str:
        self._final = check_writable_target(Path(self.target))
        remove_stale_temporaries(self._final, self._stale_suffix)
        self._temporary = temporary_beside(self._final)
        return str(self._temporary)

    def finalize(self) -> None:
        assert self._temporary is not None, "begin() first"
        fsync_path(self._temporary)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(self._temporary, stat.S_IMODE(os.stat(self._final).st_mode))  # a re-save keeps 0600
        os.replace(self._temporary, self._final)
        self._temporary = None
        fsync_folder(self._final.parent)

    def discard(self) -> None:
        if self._temporary is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._temporary)
            self._temporary = None


class UploadCommit(Commit):
    """Protocol 2: written in a local scratch folder, then sent in one upload."""

    def __init__(self, url: str, *, suffix: str = "", storage_options: Mapping[str, Any] | None = None):
        self.target = url
        self._fs, self._remote = filesystem(url, storage_options)
        self._suffix = suffix
        self._scratch: str | None = None

    def begin(self) -> str:
        self._scratch = tempfile.mkdtemp(prefix="weightstore-upload-")
        return os.path.join(self._scratch, "upload" + self._suffix)

    def finalize(self) -> None:
        assert self._scratch is not None, "begin() first"
        local = os.path.join(self._scratch, "upload" + self._suffix)
        options = {"chunksize": UPLOAD_PART_BYTES} if "s3" in _protocols(self._fs) else {}
        try:
            self._fs.put_file(local, self._remote, **options)
        except Exception as exc:
            raise _storage_error(exc, self.target) from exc
        self.discard()

    def discard(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def exists(self) -> bool:
        try:
            return bool(self._fs.exists(self._remote))
        except Exception as exc:
            raise _storage_error(exc, self.target) from exc


def _protocols(fs: Any) -> tuple[str, ...]:
    return tuple(fs.protocol) if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)


def commit_for(location: Location, *, suffix: str = "",
               storage_options: Mapping[str, Any] | None = None) -> RenameCommit | UploadCommit:
    """The commit protocol a write to ``location`` uses: rename locally, one upload to a URL."""
    if location.remote:
        return UploadCommit(location.text, suffix=suffix, storage_options=storage_options)
    return RenameCommit(location.text)


def _storage_error(exc: BaseException, where: str) -> StorageError:
    """A failure of the storage service itself (network, credentials, outage), as a weightstore error."""
    return StorageError(f"storage failed ({type(exc).__name__}: {str(exc).strip() or 'no detail'})", path=where)


# -- folders -------------------------------------------------------------------------------

@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    modified: str


class Folder(abc.ABC):
    """The operations a versioned folder needs, whatever holds it.

    Errors of the storage service (outages, credentials) come out as :class:`StorageError`,
    so callers can tell "try again later" from "this folder is damaged".
    """

    where: str

    def url(self, name: str) -> str:
        return f"{self.where.rstrip('/')}/{name}"

    def create(self) -> None:  # noqa: B027 - a hook only some backends need; object stores have no folders
        """Make the folder if this kind of folder needs making (object stores do not)."""

    @abc.abstractmethod
    def exists(self) -> bool: ...

    @abc.abstractmethod
    def files(self) -> list[FileEntry]:
        """The plain files directly in the folder (no folders, no special files)."""

    @abc.abstractmethod
    def read_small(self, name: str, limit: int) -> bytes | None:
        """At most ``limit`` bytes of file ``name``; ``None`` when there is no such file.

        Anything at ``name`` that is not a plain file (a FIFO would block forever, a folder)
        raises :class:`TargetError` instead of being read.
        """

    @abc.abstractmethod
    def commit(self, name: str, suffix: str = "") -> Commit:
        """How a new file ``name`` is written and made visible (protocol 1 or 2)."""

    @abc.abstractmethod
    def remove(self, name: str) -> None: ...

    @abc.abstractmethod
    def open_binary(self, name: str) -> BinaryIO | str:
        """A local path, or an open binary handle for a remote file; FileNotFoundError if absent."""

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Exclusive access for one writer, where the storage offers it (object stores do not)."""
        return contextlib.nullcontext()


class LocalFolder(Folder):
    def __init__(self, path: str):
        self.root = Path(path)
        self.where = str(path)

    def create(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise TargetError("is not a folder", path=self.where) from None

    def exists(self) -> bool:
        return self.root.is_dir()

    def files(self) -> list[FileEntry]:
        found = []
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in os.scandir(self.root):
                with contextlib.suppress(FileNotFoundError):  # removed while we listed
                    info = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(info.st_mode):
                        found.append(FileEntry(entry.name, info.st_size, _iso(info.st_mtime)))
        return found

    def read_small(self, name: str, limit: int) -> bytes | None:
        path = self.root / name
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused just below
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except (FileNotFoundError, NotADirectoryError):
            return None
        kind = _kind_of(os.fstat(fd).st_mode)
        if kind is not None:
            os.close(fd)
            raise TargetError(f"{name} is {kind}, not a file", path=self.where)
        with os.fdopen(fd, "rb") as handle:
            return handle.read(limit)

    def commit(self, name: str, suffix: str = "") -> Commit:
        return RenameCommit(self.root / name)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.root / name)

    def replace_special(self, name: str) -> bool:
        """Remove a FIFO, socket or empty folder squatting on ``name``; False if there is none.

        Only for names the folder's owner writes itself (``LATEST``): anything holding data (a
        folder with files, a device) is left alone and refused with :class:`TargetError`.
        """
        path = self.root / name
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return False
        if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
            os.unlink(path)
            return True
        if stat.S_ISDIR(mode):
            try:
                os.rmdir(path)
            except OSError:
                raise TargetError(f"{name} is a folder with files in it; move it away", path=self.where) from None
            return True
        return False

    def open_binary(self, name: str) -> str:
        path = self.root / name
        if not path.is_file():
            raise FileNotFoundError(str(path))
        return str(path)

    def rename(self, name: str, new_name: str) -> None:
        os.replace(self.root / name, self.root / new_name)
        fsync_folder(self.root)

    def temporaries(self) -> list[str]:
        """Names of the targets that have temporaries beside them (``.NAME.wstmp-…``)."""
        with contextlib.suppress(FileNotFoundError):
            return sorted({entry.name.split(TEMP_MARK)[0][1:] for entry in os.scandir(self.root)
                           if TEMP_MARK in entry.name})
        return []

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        try:
            import fcntl
        except ImportError:  # pragma: no cover - Windows: no advisory lock
            yield
            return
        fd = os.open(self.root / ".publish.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


class RemoteFolder(Folder):
    """An fsspec folder: no rename, so each object is written whole and the caller orders them."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None):
        self.where = url.rstrip("/")
        self._storage_options = storage_options
        self.fs, root = filesystem(url, storage_options)
        self.root = root.rstrip("/")

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    @contextlib.contextmanager
    def _service(self) -> Iterator[None]:
        try:
            yield
        except (FileNotFoundError, StoreNotFoundError, TargetError):
            raise
        except Exception as exc:
            raise _storage_error(exc, self.where) from exc

    def exists(self) -> bool:
        with self._service():
            self.fs.invalidate_cache(self.root)
            return bool(self.fs.exists(self.root)) or bool(self.files())

    def files(self) -> list[FileEntry]:
        with self._service():
            self.fs.invalidate_cache(self.root)
            try:
                listing = self.fs.ls(self.root, detail=True)
            except FileNotFoundError:
                return []
        return [FileEntry(info["name"].rstrip("/").rsplit("/", 1)[-1], int(info.get("size") or 0), _modified(info))
                for info in listing if info.get("type") != "directory"]

    def read_small(self, name: str, limit: int) -> bytes | None:
        with self._service():
            try:
                data = self.fs.cat_file(self._path(name))  # no range: S3 refuses one on an empty object
            except FileNotFoundError:
                return None
        return data[:limit]

    def commit(self, name: str, suffix: str = "") -> Commit:
        return UploadCommit(self.url(name), suffix=suffix, storage_options=self._storage_options)

    def remove(self, name: str) -> None:
        with self._service(), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))

    def open_binary(self, name: str) -> BinaryIO:
        with self._service():
            return self.fs.open(self._path(name), "rb")


def folder_for(folder: Any, storage_options: Mapping[str, Any] | None = None) -> Folder:
    location = location_of(folder)
    if location.remote:
        return RemoteFolder(location.text, storage_options)
    return LocalFolder(location.text)


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
