"""The operations a versioned folder needs, whatever holds it: a local folder or an fsspec one.

Errors of the storage service (outages, credentials) come out as
:class:`~weightstore.errors.StorageError`, so callers can tell "try again later" from "this
folder is damaged". Each file is written by its commit protocol (:mod:`weightstore.io.commit`);
:mod:`weightstore.sync._publish` orders them (pointer last). A remote folder's pointer is
replaced by its storage backend's compare-and-swap (:mod:`weightstore.io.backends`); where the
backend has none, a publish is refused unless the caller vouches to be the one writer
(:data:`ONE_WRITER`).
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import errno
import logging
import os
import re
import socket
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from weightstore.errors import (
    FileAccessError,
    FormatError,
    PublishError,
    StorageError,
    TargetError,
    WeightStoreError,
    WriteError,
)
from weightstore.io.backends import backend_for
from weightstore.io.commit import Commit, RenameCommit, UploadCommit
from weightstore.io.files import (
    TEMP_MARK,
    check_writable_target,
    fsync_folder,
    fsync_path,
    kind_of,
    pid_space,
    process_alive,
    temporary_beside,
    temporary_done,
    unreadable,
)
from weightstore.io.location import filesystem, location_of, service, uncached
from weightstore.io.remote import RemoteFile

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory lock
    fcntl = None  # type: ignore[assignment]

__all__ = ["ONE_WRITER", "UNSEEN", "FileEntry", "Folder", "LocalFolder", "RemoteFolder", "folder_for", "same_file", "unchanged"]

_log = logging.getLogger(__name__)
#: the folders whose unfinished uploads this process could not look at or abort, said once each
_not_aborted: set[str] = set()

#: the storage option (``storage_options={"one_writer": True}``) by which a caller vouches that
#: only one process ever publishes to a remote folder whose backend has no compare-and-swap, so
#: that plain writes may replace its pointer; taken out before the options reach fsspec
ONE_WRITER = "one_writer"


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    modified: str


class _Unseen:
    def __repr__(self) -> str:
        return "UNSEEN"


#: what :meth:`Folder.fingerprint` answers where it cannot tell without a request (an object the
#: folder has not listed, or wrote since it listed): compared with anything, it differs in nothing
#: (:func:`unchanged`)
UNSEEN: object = _Unseen()


def same_file(was: object, now: object) -> bool:
    """Whether two :meth:`Folder.fingerprint` answers of one name tell the same file: equal, or
    one of them :data:`UNSEEN` (which tells nothing)."""
    return was is UNSEEN or now is UNSEEN or was == now


def unchanged(was: Mapping[str, object], now: Mapping[str, object]) -> bool:
    """Whether files fingerprinted ``was`` (name -> :meth:`Folder.fingerprint`) are the same
    files, by what ``now`` says of each: the same names, each the :func:`same_file`."""
    return was.keys() == now.keys() and all(same_file(was[name], after) for name, after in now.items())


#: what an open of a small file refuses for good, the file's own fault (a link loop, no
#: permission, a name too long, a socket or device): any other error (EIO on a network disk) is the
#: storage's, a transient StorageError, retried
_REFUSALS = frozenset({errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENAMETOOLONG, errno.ENXIO, errno.ENODEV})


class Folder(abc.ABC):
    """The operations a versioned folder needs, whatever holds it.

    Errors of the storage service (outages, credentials) come out as :class:`StorageError`,
    so callers can tell "try again later" from "this folder is damaged".
    """

    where: str

    def url(self, name: str) -> str:
        return f"{self.where.rstrip('/')}/{name}"

    def create(self, *, inner: bool = False) -> None:  # noqa: B027 - a hook only some backends need
        """Make the folder if this kind of folder needs making (object stores do not). ``inner``:
        a folder weightstore makes inside a versioned folder (a sharded version's attempt), which
        must be a real folder there: a link planted in its place would take the writes elsewhere."""

    @abc.abstractmethod
    def exists(self) -> bool: ...

    @abc.abstractmethod
    def files(self) -> list[FileEntry]:
        """The plain files directly in the folder (no folders, no special files)."""

    def names(self) -> list[str]:
        """The names of what :meth:`files` lists, all a publish needs of a folder that may hold
        10,000 versions: locally without a stat and a formatted time for each file."""
        return [entry.name for entry in self.files()]

    def not_files(self) -> dict[str, str]:
        """What lies directly in the folder that :meth:`files` leaves out, each named with what
        it is in words (``"a folder"``, ``"a FIFO"``, ``"a symbolic link (to …)"``): where a
        version's name is one of them, it is listed as no version that reads, never opened."""
        return dict.fromkeys(self.subfolders(), "a folder")

    @abc.abstractmethod
    def read_small(self, name: str, limit: int) -> bytes | None:
        """At most ``limit`` bytes of file ``name``; ``None`` when there is no such file.

        Anything at ``name`` that is not a plain file (a FIFO would block forever, a folder)
        raises :class:`TargetError` instead of being read.
        """

    @abc.abstractmethod
    def tag(self, name: str) -> object | None:
        """What names the current content of file ``name`` without reading it (a remote
        object's ETag: one HEAD, no body); equal tags, equal content. ``None`` when there is
        no such file; a new object each time where the storage cannot tell (then read it).

        Not :meth:`read_tagged`: a poll wants the tag without the body, and on any storage
        fsspec reaches; :meth:`read_tagged` wants body and tag from one GET, for :meth:`put_if`."""

    def fingerprint(self, name: str) -> object | None:
        """What changes when file ``name`` is removed, replaced or written over, told without
        reading it or a request of its own, for a publisher to see that a version it wrote is no
        longer as written; ``None`` when it is gone, :data:`UNSEEN` where that cannot be told
        (here: every file)."""
        return UNSEEN

    @abc.abstractmethod
    def commit(self, name: str, suffix: str = "", *, new: bool = False, swept: bool = False) -> Commit:
        """How a new file ``name`` is written and made visible (protocol 1 or 2). ``new``: only
        where no file has the name when it lands, where the storage can tell (S3: else the
        commit raises :class:`StoreExistsError`); locally the folder's :meth:`lock` keeps other
        writers out. ``swept``: the caller holds :meth:`lock` and has removed dead writers'
        temporaries from the folder since it took it (a publish's one listing), so the write
        lists the folder for them no more."""

    @abc.abstractmethod
    def remove(self, name: str) -> None: ...

    @abc.abstractmethod
    def open_binary(self, name: str, *, file_object: bool = False) -> str | BinaryIO | RemoteFile:
        """A local path, or for a remote file its ranged reads (the first request fetches the
        index, as :func:`weightstore.open` of a URL does) or, with ``file_object``, an fsspec
        file object (h5py's reads); FileNotFoundError if absent, on the first read remotely."""

    def lock(self) -> contextlib.AbstractContextManager[None]:
        """Exclusive access for one writer, where the storage offers it (object stores do not)."""
        return contextlib.nullcontext()

    def read_tagged(self, name: str, limit: int) -> tuple[bytes | None, str | None]:
        """:meth:`read_small` and a tag that :meth:`put_if` can require is unchanged (an ETag);
        ``None`` where the storage has none (a local folder, whose writers take :meth:`lock`).
        Both from one GET, so the tag is the read content's (a :meth:`tag` HEAD could be newer)."""
        return self.read_small(name, limit), None

    def require_compare_and_swap(self, what: str) -> None:  # noqa: B027 - only remote folders refuse
        """Refuse, before anything is written, a commit whose ``what`` (its pointer or index
        write) :meth:`put_if` could not make conditional here. Locally nothing is refused:
        writers take :meth:`lock`, and creation is exclusive."""

    @abc.abstractmethod
    def put_if(self, name: str, data: bytes, *, create: bool = False, expect: str | None = None) -> bool:
        """Write small file ``name`` only if it does not exist (``create``), or only if it is
        unchanged since it was read with tag ``expect``; False (nothing written) otherwise.

        Locally ``expect`` is not checked (writers hold :meth:`lock`), but creation is exclusive:
        the file is linked into place, which fails if the name exists. Remotely both are the
        storage backend's conditional writes (S3: ``If-None-Match: *``, ``If-Match``); a backend
        without them checks and then writes plainly, which only a folder whose caller vouched to
        be its one writer gets this far with (:meth:`require_compare_and_swap`).
        """

    @abc.abstractmethod
    def subfolders(self) -> list[str]:
        """Names of the folders directly in this one."""

    @abc.abstractmethod
    def remove_folder(self, name: str, owned: Callable[[str], bool]) -> list[str]:
        """Remove from folder ``name`` the files whose names ``owned`` takes, then the folder if
        that emptied it; return the names of what stays in it (nothing if it is gone). A
        file ``owned`` refuses, a folder inside it, or a file that cannot be removed stays:
        what weightstore did not write there is a user's."""

    def abort_uploads(self, dead: Callable[[str], bool]) -> list[str]:
        """Abort the unfinished uploads of files in this folder (or a folder in it: ``sub/name``)
        whose names ``dead`` takes (a killed writer's, which an object store keeps unseen); the
        names aborted. None locally: a killed writer's temporaries are files, removed as such."""
        return []


class LocalFolder(Folder):
    def __init__(self, path: str):
        self.root = Path(path)
        self.where = str(path)

    def create(self, *, inner: bool = False) -> None:
        if inner and self.root.is_symlink():
            raise TargetError(f"is a symbolic link (to {os.readlink(self.root)}); a versioned folder's files are never "
                              "written through links: remove it", path=self.where)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise TargetError("is not a folder", path=self.where) from None
        except NotADirectoryError:
            raise TargetError("cannot be made: a folder above it is a file", path=self.where) from None
        except OSError as exc:
            raise WriteError(exc.errno or 0, f"cannot be made ({exc.strerror or exc})", path=self.where) from None

    def exists(self) -> bool:
        return self.root.is_dir()

    def files(self) -> list[FileEntry]:
        found = []
        for entry in _entries(self.root):
            with contextlib.suppress(FileNotFoundError):  # removed while we listed
                info = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(info.st_mode):
                    found.append(FileEntry(entry.name, info.st_size, _iso(info.st_mtime)))
        return found

    def names(self) -> list[str]:
        # the type the listing gave (a stat only where the file system gives none: then one
        # removed while we listed is no file, as is_file says)
        return [entry.name for entry in _entries(self.root) if entry.is_file(follow_symlinks=False)]

    def not_files(self) -> dict[str, str]:
        found = {}
        for entry in _entries(self.root):
            with contextlib.suppress(FileNotFoundError):  # removed while we listed
                mode = entry.stat(follow_symlinks=False).st_mode
                if stat.S_ISLNK(mode):
                    found[entry.name] = f"a symbolic link (to {os.readlink(entry.path)})"
                elif not stat.S_ISREG(mode):
                    found[entry.name] = kind_of(mode) or "not a regular file"
        return found

    def read_small(self, name: str, limit: int) -> bytes | None:
        path = self.root / name
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused just below
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno not in _REFUSALS:  # EIO, EAGAIN, EBUSY, EINTR on a network disk: retried as outages are
                raise StorageError(f"cannot be opened ({exc.strerror or exc})", path=str(path)) from None
            raise FileAccessError(f"cannot be opened ({exc.strerror or exc})", path=str(path)) from None
        kind = kind_of(os.fstat(fd).st_mode)
        if kind is not None:
            os.close(fd)
            raise TargetError(f"{name} is {kind}, not a file", path=self.where)
        with os.fdopen(fd, "rb") as handle:
            try:
                return handle.read(limit)
            except OSError as exc:  # the read the system failed (EIO): the storage's, retried
                raise unreadable(exc, str(path)) from None

    def tag(self, name: str) -> object | None:
        """Always new: a local read costs microseconds, and a file's times and inode can repeat."""
        return object() if os.path.lexists(self.root / name) else None

    def fingerprint(self, name: str) -> object | None:
        """Its inode, size, and modification and change times (``lstat``: a link put in its place
        is a change too; the change time no one sets by hand); ``None`` when it is gone. A
        publish of a delta asks it of each file of its chain: a joined string, no pathlib."""
        try:
            info = os.lstat(os.path.join(self.where, name))
        except OSError:
            return None
        return info.st_mode, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns

    def commit(self, name: str, suffix: str = "", *, new: bool = False, swept: bool = False) -> Commit:
        return RenameCommit(self.root / name, follow_symlinks=False, swept=swept)

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

    def put_if(self, name: str, data: bytes, *, create: bool = False, expect: str | None = None) -> bool:
        target = self.root / name
        if create and os.path.lexists(target):
            return False
        check_writable_target(target, follow_symlinks=False)
        temporary = temporary_beside(target)
        try:
            with open(temporary, "wb") as handle:
                handle.write(data)
            fsync_path(temporary)
            if create:
                try:
                    os.link(temporary, target)  # exclusive: fails if the name exists
                except FileExistsError:
                    return False
            else:
                os.replace(temporary, target)
        finally:
            with contextlib.suppress(OSError):  # never hides why the write failed
                os.unlink(temporary)
            temporary_done(temporary)
        fsync_folder(self.root)
        return True

    def subfolders(self) -> list[str]:
        return sorted(entry.name for entry in _entries(self.root) if entry.is_dir(follow_symlinks=False))

    def remove_folder(self, name: str, owned: Callable[[str], bool]) -> list[str]:
        folder = self.root / name
        left = []
        for entry in _entries(folder):
            if owned(entry.name) and not entry.is_dir(follow_symlinks=False):
                try:
                    os.unlink(entry.path)  # a symbolic link: the link, never what it points to
                    continue
                except FileNotFoundError:
                    continue
                except OSError:  # no permission: it stays, as what rmtree could not remove did
                    pass
            left.append(entry.name)
        if not left:
            with contextlib.suppress(OSError):  # gone already, or written to meanwhile: it stays
                os.rmdir(folder)
        return sorted(left)

    def open_binary(self, name: str, *, file_object: bool = False) -> str:
        """The file's path; a folder, FIFO or symbolic link squatting on the name is a
        :class:`FormatError` saying so, not the missing file that a pruned version is. A link is
        never followed: a version is read from its folder, not from wherever a link points."""
        path = self.root / name
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):
            raise FileNotFoundError(str(path)) from None
        except OSError as exc:
            raise FileAccessError(f"cannot be opened ({exc.strerror or exc})", path=str(path)) from None
        if stat.S_ISLNK(mode):
            raise FormatError(f"is a symbolic link (to {os.readlink(path)}), not a file: a version is read only from "
                              "its folder's own files; to read it, put the file itself in the link's place",
                              path=str(path))
        kind = kind_of(mode)
        if kind is not None:
            raise FormatError(f"is {kind}, not a file", path=str(path))
        return str(path)

    @staticmethod
    def temporaries(names: list[str]) -> list[str]:
        """Names of the targets that have temporaries (``.NAME.wstmp-…``) among ``names``, the
        folder's files as :meth:`names` listed them."""
        return sorted({name.split(TEMP_MARK)[0][1:] for name in names if TEMP_MARK in name})

    #: whether :meth:`lock` shuts other publishers out (``fcntl``: not on Windows)
    locks = fcntl is not None

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        if fcntl is None:  # pragma: no cover - Windows: no advisory lock
            yield
            return
        path, no_link = self.root / ".publish.lock", getattr(os, "O_NOFOLLOW", 0)
        try:  # never through a link planted at the name: it would create a file wherever it points
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | no_link, 0o644)
            except PermissionError:  # another user's lock file (0644) in a folder both write: flock needs no write
                fd = os.open(path, os.O_RDONLY | no_link)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise TargetError("holds .publish.lock as a symbolic link; a versioned folder's files are never "
                                  "written through links: remove it", path=self.where) from None
            raise _unlockable(exc, self.where) from None
        try:
            try:
                _take_lock(fd, self.where)
            except OSError as exc:  # NFS emulates flock by fcntl locks, which a read-only descriptor may not take
                raise _unlockable(exc, self.where) from None
            try:
                yield
            finally:  # its words go with the lock: a next holder that may not write them leaves none of a gone process
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
        finally:  # unlocked, not only closed: a child forked meanwhile holds the lock through its copy of fd
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


#: the most bytes of ``.publish.lock`` read to say who holds it
_HOLDER_BYTES = 200
#: seconds a publish waits for the folder's lock before it says whose it is (another publish of
#: the folder, a sharded commit racing this one, holds it for about as long as a write takes)
LOCK_QUIET_FOR = 2.0


def _take_lock(fd: int, where: str) -> None:
    """Lock ``.publish.lock`` (open at ``fd``) for this process, then write in it who holds it.

    A publish holds the lock while it writes; one held longer is a publisher stopped in the
    middle (SIGSTOP, a suspended node or VM, a debugger) or stuck on its storage, which keeps
    every other publisher of the folder waiting until it goes on or dies (the kernel lets go of a
    dead process's lock at once). So a publish that has waited :data:`LOCK_QUIET_FOR` says, once,
    whose lock it waits for and since when, and once it has it, how long it waited: no publish
    waits without a word."""
    started, pause = time.monotonic(), 0.005
    while not _locked_now(fd):
        if time.monotonic() - started < LOCK_QUIET_FOR:
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
            continue
        holder = _holder(os.pread(fd, _HOLDER_BYTES, 0).decode("utf-8", "replace"))
        _log.warning("%s: waiting for its publish lock (.publish.lock), held by %s; a publisher stopped while it "
                     "publishes (SIGSTOP, a suspended node) keeps it until it goes on or is killed", where, holder)
        fcntl.flock(fd, fcntl.LOCK_EX)
        _log.warning("%s: got its publish lock after waiting %.0f s", where, time.monotonic() - started)
        break
    with contextlib.suppress(OSError):  # a lock file it may not write still locks: only the words are lost
        os.ftruncate(fd, 0)
        words = f"{socket.gethostname()} pid {os.getpid()} (PID namespace {pid_space()}), since {_iso(time.time())}"
        os.pwrite(fd, words.encode(), 0)


#: a holder's words in ``.publish.lock``: ``HOST pid N (PID namespace SPACE), since …``
_HOLDER_WORDS = re.compile(r"(.*) pid ([0-9]+) \(PID namespace ([0-9a-f]+)\),")


def _holder(said: str) -> str:
    """Who holds the lock, from what ``.publish.lock`` says: its holder's words (``HOST pid N (PID
    namespace SPACE), since …``), unless they name a process of this PID namespace (:func:`pid_space`: a
    container sharing its host's name has PIDs of its own) that is gone. A holder that may not write
    the file (another user's, taken read-only) says nothing, and finds there the words of the last
    holder killed while it held the lock (others take theirs away as they let go of it)."""
    words = "".join(c if c.isprintable() else " " for c in said).strip()
    named = _HOLDER_WORDS.match(words)
    if named and named[1] == socket.gethostname() and named[3] == pid_space() and not process_alive(int(named[2])):
        words = ""
    return words or ("a process that does not say who (one that may not write .publish.lock, another user's "
                     "file, cannot)")


def _unlockable(exc: OSError, where: str) -> WriteError:
    """The error of a ``.publish.lock`` the system will not open or lock, naming the folder."""
    return WriteError(exc.errno or 0, f"cannot be locked (.publish.lock: {exc.strerror or exc})", path=where)


def _locked_now(fd: int) -> bool:
    """Whether the lock on ``fd`` was free and is this process's now."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    """What local folder ``folder`` holds (nothing if it is gone or a file). One the system will
    not list (a symbolic link loop, no permission) is a :class:`FileAccessError` naming it, one
    whose listing fails (EIO) the storage's :class:`StorageError`: no bare ``OSError`` leaves."""
    try:
        with os.scandir(folder) as entries:
            return list(entries)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        refused = FileAccessError if exc.errno in _REFUSALS else StorageError
        raise refused(f"cannot be listed ({exc.strerror or exc})", path=str(folder)) from None


class RemoteFolder(Folder):
    """An fsspec folder: no rename, so each object is written whole and the caller orders them."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None):
        self.where = url.rstrip("/")
        #: each file's fingerprint by the last listing of the folder (``None``: not listed yet)
        self._listed: dict[str, object] | None = None
        options = dict(storage_options or {})
        self._one_writer = bool(options.pop(ONE_WRITER, False))
        self._storage_options = options
        self.fs, root = filesystem(url, options)
        self.root = root.rstrip("/")
        self.backend = backend_for(self.fs)

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _service(self) -> contextlib.AbstractContextManager[None]:
        return service(self.where)

    def exists(self) -> bool:
        with self._service():
            self.fs.invalidate_cache(self.root)
            return bool(self.fs.exists(self.root)) or bool(self.files())

    def _listing(self) -> list[dict[str, Any]]:
        """The folder's entries as the store lists them now (not from fsspec's cache); none if absent."""
        with self._service():
            self.fs.invalidate_cache(self.root)
            try:
                return list(self.fs.ls(self.root, detail=True))
            except FileNotFoundError:
                return []

    def files(self) -> list[FileEntry]:
        listing = [info for info in self._listing() if info.get("type") != "directory"]
        entries = [FileEntry(info["name"].rstrip("/").rsplit("/", 1)[-1], int(info.get("size") or 0), _modified(info))
                   for info in listing]
        self._listed = {entry.name: (info.get("ETag") or info.get("etag"), entry.size, entry.modified)
                        for entry, info in zip(entries, listing, strict=True)}
        return entries

    def fingerprint(self, name: str) -> object | None:
        """Its ETag, size and modification time as the folder's last listing gave them (a
        publisher lists its folder each publish: no request more); :data:`UNSEEN` before a listing,
        for a file written since, and for a file in a folder inside this one."""
        if self._listed is None or "/" in name:
            return UNSEEN
        return self._listed.get(name)

    def _written(self, name: str) -> None:
        """Forget what the last listing said of ``name``, written or removed since."""
        if self._listed is not None:
            self._listed[name] = UNSEEN

    def read_small(self, name: str, limit: int) -> bytes | None:
        return self.read_tagged(name, limit)[0]

    def tag(self, name: str) -> object | None:
        with self._service():
            try:
                info = self.fs.info(uncached(self.fs, self._path(name)))
            except FileNotFoundError:
                return None
        # without an ETag, nothing short of the bytes tells two writes apart (times repeat within a second)
        return info.get("ETag") or info.get("etag") or object()

    def commit(self, name: str, suffix: str = "", *, new: bool = False, swept: bool = False) -> Commit:
        self._written(name)
        return UploadCommit(self.url(name), suffix=suffix, storage_options=self._storage_options, new=new)

    def remove(self, name: str) -> None:
        self._written(name)
        with self._service(), contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))

    def open_binary(self, name: str, *, file_object: bool = False) -> BinaryIO | RemoteFile:
        if not file_object:
            return RemoteFile(self.fs, self._path(name), self.url(name))
        with self._service():
            return self.fs.open(uncached(self.fs, self._path(name)), "rb")

    def read_tagged(self, name: str, limit: int) -> tuple[bytes | None, str | None]:
        with self._service():
            return self.backend.read_tagged(self.fs, self._path(name), limit)

    def require_compare_and_swap(self, what: str) -> None:  # noqa: B027 - only remote folders refuse
        if self.backend.compare_and_swap or self._one_writer:
            return
        protocol = self.where.partition("://")[0]
        raise PublishError(f"{what} needs a compare-and-swap, and weightstore has no backend with conditional writes "
                           f"for {protocol}://: a plain write would let two writers overwrite each other unseen. "
                           "Use S3 or a local folder, add a backend for this storage (docs/design.md), or, if no "
                           f"other process ever publishes to this folder, pass storage_options={{{ONE_WRITER!r}: True}}",
                           path=self.where)

    def put_if(self, name: str, data: bytes, *, create: bool = False, expect: str | None = None) -> bool:
        self.require_compare_and_swap(f"writing {name}")
        self._written(name)
        with self._service():
            return self.backend.put_if(self.fs, self._path(name), data, create=create, expect=expect)

    def subfolders(self) -> list[str]:
        listing = self._listing()
        return sorted(info["name"].rstrip("/").rsplit("/", 1)[-1] for info in listing
                      if info.get("type") == "directory")

    def abort_uploads(self, dead: Callable[[str], bool]) -> list[str]:
        """As :meth:`Folder.abort_uploads`; a failure (a policy without ``s3:ListBucketMultipartUploads``
        or ``s3:AbortMultipartUpload``, an outage) is logged and aborts nothing: it must not keep a
        publish from tidying the rest of the folder."""
        try:
            with self._service():
                return self.backend.abort_uploads(self.fs, self.root, dead)
        except (OSError, WeightStoreError) as error:
            if self.where not in _not_aborted:  # once a folder: a sharded commit looks at every commit
                _not_aborted.add(self.where)
                _log.warning("%s: unfinished uploads a killed writer may have left were not aborted (%s); the "
                             "storage keeps them until aborted (an S3 lifecycle rule, AbortIncompleteMultipartUpload, "
                             "does it)", self.where, error)
            return []

    def remove_folder(self, name: str, owned: Callable[[str], bool]) -> list[str]:
        prefix = self._path(name)
        with self._service():
            self.fs.invalidate_cache(prefix)
            try:
                found = [path.rstrip("/")[len(prefix) + 1:] for path in self.fs.find(prefix)]
            except FileNotFoundError:
                found = []
            gone = [name for name in found if "/" not in name and owned(name)]
            left = sorted({name.split("/", 1)[0] for name in found if name not in gone})
            with contextlib.suppress(FileNotFoundError):
                if not left:  # all weightstore's: the prefix goes whole (a store's folder markers with it)
                    self.fs.rm(prefix, recursive=True)
                elif gone:
                    self.fs.rm([f"{prefix}/{name}" for name in gone])
        self.fs.invalidate_cache(self.root)
        return left


def folder_for(folder: Any, storage_options: Mapping[str, Any] | None = None) -> Folder:
    location = location_of(folder, reading=False)  # a folder is never what ws.latest gave
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
