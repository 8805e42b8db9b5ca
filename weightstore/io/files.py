"""Local files: the one regular-file check, durability (fsync), and temporaries beside a target.

**Regular files only.** A FIFO opened for reading waits for a writer forever; a device or a
socket is no weight file; replacing ``/dev/null`` or a named pipe with a weight file is data
loss. So every local reader opens through :func:`open_regular` (a library that opens the file
itself is given that descriptor), and every writer resolves its target through
:func:`check_writable_target`; both decide with :func:`kind_of`.

**Temporaries.** A write goes to ``.NAME.wstmp-PID-SPACE-RANDOM`` beside its target
(:func:`temporary_beside`: same folder, so the same file system, so a rename can commit it).
``SPACE`` names the PID namespace the writer's PID belongs to (:func:`pid_space`; the host's
where none can be read). A writer
killed mid-write leaves its temporary; the next write to that target removes it
(:func:`remove_stale_temporaries`) when its PID is dead *and* ``SPACE`` is this process's, since
a PID means nothing outside its namespace: a writer in a container sharing the folder, or on
another host over NFS, has PIDs that may be dead here while it writes. One named by this very
process (its PID and ``SPACE``) that it is not writing (:func:`temporary_beside` notes each
name until :func:`temporary_done`) is dead too: an earlier process of this PID in a namespace
of this space left it (a container's trainer is often PID 1, and a restarted container's PID
namespace may get the inode its killed one had: the kernel hands out the lowest free one),
while another thread's write of the same target keeps its own. A temporary of another
space is removed only once untouched for :data:`STALE_AFTER` (a day). A name without ``SPACE``
(``.NAME.wstmp-PID-RANDOM``, written by older weightstore) keeps the PID rule alone.
A save takes no lock (libhdf5 locks the files it opens itself and fails under one of ours), so
these rules decide for every temporary but those whose every writer holds a versioned folder's
publish lock: a publish holding it removes those whatever they are named by (``locked``).
The scratch folders of ``TMPDIR`` (an upload's copy of a version file, an unpacked archive) are
named and removed by the same rules (:func:`scratch_folder`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import BinaryIO, overload

from weightstore.core._forks import in_child
from weightstore.core.limits import FILE_NAME_BYTES
from weightstore.errors import FileAccessError, FormatError, StorageError, StoreNotFoundError, TargetError

__all__ = [
    "TEMP_MARK", "kind_of", "open_regular", "open_regular_unbuffered", "unreadable",
    "check_writable_target",
    "fsync_path", "fsync_folder", "temporary_beside", "temporary_done", "remove_stale_temporaries", "pid_space",
    "process_alive",
]

#: marks the temporary file a write puts beside its target (``.NAME.wstmp-PID-SPACE-RANDOM``)
TEMP_MARK = ".wstmp-"

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def kind_of(mode: int) -> str | None:
    """What a non-regular file is, in words; ``None`` for a regular file."""
    if stat.S_ISREG(mode):  # asked first: every open of a weight file asks
        return None
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _not_regular(kind: str, path: str) -> FormatError:
    return FormatError(f"is not a regular file ({kind}); weightstore reads only regular files", path=path)


def unreadable(exc: OSError, path: str) -> StorageError:
    """A read of an open file that the system failed (an I/O error of a disk or a network file
    system, ``/proc/self/mem``), as the :class:`StorageError` naming the file: the storage
    failed, not the file's bytes, and no bare ``OSError`` leaves a reader."""
    return StorageError(f"cannot be read ({exc.strerror or exc})", path=path)


def open_regular(path: str) -> BinaryIO:
    """Open the local file ``path`` for reading, refusing anything but a regular file.

    Opened without blocking, then checked on the open descriptor, so a FIFO (or folder, or
    device) is refused at once with a :class:`FormatError` naming it instead of waiting for a
    writer, and nothing can be swapped in between the check and the read. A missing file raises
    ``FileNotFoundError``, as :func:`open` would; any other refusal of the system's (no
    permission, a symlink loop, a name too long) a :class:`FileAccessError` naming the file.
    """
    fd, _ = _open_regular_fd(path)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def open_regular_unbuffered(path: str) -> tuple[io.FileIO, int]:
    """:func:`open_regular`'s file unbuffered, and its size when opened: for a reader by
    position, which a buffer never serves (a buffered file costs three more system calls, a
    tenth of opening a file of 100 small tensors)."""
    fd, size = _open_regular_fd(path)
    try:
        return io.FileIO(fd, "r"), size
    except BaseException:
        os.close(fd)
        raise


def _open_regular_fd(path: str) -> tuple[int, int]:
    """The descriptor of the regular file ``path``, open for reading, and its size (see :func:`open_regular`)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise FileAccessError(f"cannot be opened ({exc.strerror or exc})", path=path) from None
    try:
        status = os.fstat(fd)
        kind = kind_of(status.st_mode)
        if kind is not None:
            raise _not_regular(kind, path)
        os.set_blocking(fd, True)
        return fd, status.st_size
    except BaseException:
        os.close(fd)
        raise


def check_writable_target(target: Path | str, *, follow_symlinks: bool = True) -> tuple[str, int | None]:
    """The regular file a write to ``target`` replaces: ``target``, or the file a symlink names;
    with its mode (``st_mode``), or None where there is none yet.

    Refuses, with :class:`TargetError` and before a byte is written, a target that is a folder,
    FIFO, socket or device, and a missing folder with :class:`StoreNotFoundError`. Without
    ``follow_symlinks`` a symlink at ``target`` is refused too: a versioned folder's own files
    (``LATEST``, a version, a member, a done-record) are never written through a link someone
    planted in a shared folder, which would overwrite a file outside it.
    """
    try:  # one lstat where the target is a plain file: a save of a small file felt each call
        mode: int | None = os.lstat(target).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise TargetError(f"cannot write there ({exc.strerror})", path=str(target)) from None
    resolved = os.fspath(target)
    if mode is not None and stat.S_ISLNK(mode):
        if not follow_symlinks:
            raise TargetError(f"is a symbolic link (to {os.readlink(target)}); a versioned folder's files are never "
                              "written through links: remove it", path=str(target))
        resolved = os.path.realpath(target)
        try:
            mode = os.stat(resolved).st_mode
        except FileNotFoundError:
            mode = None
        except OSError as exc:
            raise TargetError(f"cannot write there ({exc.strerror})", path=str(target)) from None
    if mode is not None:
        kind = kind_of(mode)
        if kind is not None:
            raise TargetError(f"is {kind}; weightstore only replaces regular files", path=str(target))
    elif not os.path.isdir(folder := os.path.dirname(resolved) or "."):  # a file there has its folder
        raise StoreNotFoundError(f"folder {folder!r} does not exist", path=str(target))
    return resolved, mode


def fsync_path(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(folder: str | Path, *, written: str | None = None) -> None:
    """fsync ``folder``. ``written``: the target a write just renamed into it, whose sweep
    (:func:`remove_stale_temporaries`) notes the folder's state as that write leaves it."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
        swept = _SWEPT_CLEAN.get(written) if written is not None else None
        if swept is not None and swept[1] is None:
            _SWEPT_CLEAN[written] = (swept[0], _folder_state(os.fstat(fd)))  # type: ignore[index]
    finally:
        os.close(fd)


#: hex digits of a temporary's ``SPACE`` (48 bits: two of a thousand namespaces sharing a folder
#: get the same one with odds of 2e-9, and a PID of one must then be dead in the other)
_SPACE_HEX = 12
#: the most bytes :func:`temporary_beside` adds to a name: a dot, the mark, a pid (at most 7
#: digits on Linux), a dash, the space, a dash and 8 hex digits
TEMPORARY_EXTRA = 1 + len(TEMP_MARK) + 7 + 1 + _SPACE_HEX + 1 + 8
#: hex digits of the hash that stands for the cut-off end of a name too long to carry whole
_CUT_HEX = 8
#: a temporary named by another PID namespace is removed once unmodified for this many seconds.
#: Its writer's PID cannot be asked, but a live writer's writes move the mtime; a day leaves room
#: for any pause of a live one (a slow conversion between two writes, a stopped or suspended
#: process, clocks of NFS hosts minutes apart). Should one outlive it, its rename fails
#: (``FileNotFoundError``): its save fails whole and the target keeps the file it had.
STALE_AFTER = 24 * 3600


@overload
def temporary_beside(target: Path, *, room: int = 0) -> Path: ...
@overload
def temporary_beside(target: str, *, room: int = 0) -> str: ...
def temporary_beside(target: Path | str, *, room: int = 0) -> Path | str:
    """A fresh temporary name beside ``target`` that :func:`remove_stale_temporaries` recognises,
    of the type given (a commit's path stays a ``str``: ``pathlib`` cost a small save 10 us).
    Noted as this process's until :func:`temporary_done` (call it once the temporary is renamed
    or removed), so that no sweep takes it for a dead predecessor's of the same PID.

    ``room`` is how many bytes the writer appends to it (a TF checkpoint's file endings).
    """
    path = os.fspath(target)
    folder, name = os.path.split(path)
    pid = os.getpid()  # asked once: a system call each time
    own = f"{_temporary_head(name, path, room)}{pid}-{pid_space(pid)}-{secrets.token_hex(4)}"
    _IN_USE.add(own)  # before the file exists: another thread's sweep may list it at once
    temporary = os.path.join(folder, own)
    return temporary if isinstance(target, str) else Path(temporary)


def temporary_done(temporary: Path | str) -> None:
    """The write through ``temporary`` (from :func:`temporary_beside`) is over, its file renamed
    or removed: from now on a file of that name is no write of this process's (one left, its
    removal failed, goes with the next sweep)."""
    _IN_USE.discard(os.path.basename(temporary))


def _temporary_head(name: str, path: str, room: int = 0) -> str:
    """What every temporary of the file ``name`` (at ``path``) starts with: ``.NAME.wstmp-``,
    where a name too long to leave room for the rest under :data:`FILE_NAME_BYTES` has its end
    replaced by ``~`` and a hash of the whole name, so any name a file system takes can be
    saved. A name it cannot take at all is a :class:`TargetError` naming it."""
    raw = name.encode(errors="surrogateescape")
    if len(raw) > FILE_NAME_BYTES:
        raise TargetError(f"has a name of {len(raw)} bytes; a file system allows at most {FILE_NAME_BYTES}",
                          path=path)
    keep = FILE_NAME_BYTES - TEMPORARY_EXTRA - room
    if len(raw) <= keep:
        return f".{name}{TEMP_MARK}"
    cut = hashlib.blake2b(raw, digest_size=_CUT_HEX // 2).hexdigest()
    short = raw[:keep - 1 - _CUT_HEX].decode(errors="ignore")  # whole characters only
    return f".{short}~{cut}{TEMP_MARK}"


#: the names of the temporaries this process is writing and of the scratch folders it made and has
#: not removed (see :func:`temporary_beside`, :func:`scratch_folder`): one named by its own PID and
#: space that is not among them is a dead predecessor's
_IN_USE: set[str] = set()
#: the space of this process's PID namespace, by the namespace (see :func:`pid_space`)
_SPACES: dict[tuple[int, int], str] = {}
#: ``(PID, space)`` of this process once asked (see :func:`pid_space`)
_OWN_SPACE: tuple[int, str] | None = None


def pid_space(pid: int | None = None) -> str:
    """This process's PID namespace, as a temporary names it: a hash of the host's boot (a
    container sees its host's ``boot_id``) and the namespace's inode (one per namespace).
    Asked once per process (a ``stat`` of ``/proc``, a hundredth of a small save): a process
    never leaves its PID namespace (``unshare(CLONE_NEWPID)`` and ``setns`` move only the
    children forked after them), but such a child keeps its parent's memory while it has PIDs
    of another namespace, so a forked child asks again (:func:`_forget_space`, and a PID that
    is not the one asked as). Where ``/proc`` cannot tell (macOS), the host's (:func:`_host_space`).
    ``pid``: this process's, where the caller asked it already."""
    global _OWN_SPACE
    pid = os.getpid() if pid is None else pid
    if _OWN_SPACE is not None and _OWN_SPACE[0] == pid:
        return _OWN_SPACE[1]
    try:
        space = os.stat("/proc/self/ns/pid")
    except OSError:
        return _host_space()
    seen = (space.st_dev, space.st_ino)
    known = _SPACES.get(seen)
    if known is None:
        try:
            with open("/proc/sys/kernel/random/boot_id", "rb") as handle:
                boot = handle.read().strip()
        except OSError:
            return _host_space()
        known = _SPACES[seen] = _hashed(boot + f"/{space.st_dev}/{space.st_ino}".encode())
    _OWN_SPACE = (pid, known)
    return known


def _forget_space() -> None:
    """In a forked child: its space is asked again (see :func:`pid_space`), and its first write
    to a target sweeps it, as a new process's does (see :func:`remove_stale_temporaries`)."""
    global _OWN_SPACE
    _OWN_SPACE = None
    _SWEPT_CLEAN.clear()
    _SCRATCH_SWEPT.clear()
    _IN_USE.clear()  # its parent's, named by the parent's PID


in_child(_forget_space)


@functools.cache
def _host_space() -> str:
    """The space of a host without PID namespaces to read: a hash of its name and its boot time
    (to the minute), so every process of one boot shares it and the PID rule applies among them,
    while another host's writers, or ones of an earlier boot, get the day. Clocks that disagree
    (the wall clock stepped since) give another space: the safe side, the day's wait."""
    clock = getattr(time, "CLOCK_BOOTTIME", getattr(time, "CLOCK_MONOTONIC", None))  # counting sleep
    since_boot = time.monotonic() if clock is None else time.clock_gettime(clock)
    return _hashed(f"{socket.gethostname()}/{round((time.time() - since_boot) / 60)}".encode())


def _hashed(seen: bytes) -> str:
    return hashlib.blake2b(seen, digest_size=_SPACE_HEX // 2).hexdigest()


#: a target whose folder looks untouched is still swept once this many seconds have passed since
#: its last sweep (see :func:`remove_stale_temporaries`'s ``unless_clean``)
SWEEP_AGAIN_AFTER = 60.0
#: the most targets :data:`_SWEPT_CLEAN` remembers: past it, it starts again empty
_SWEPT_TARGETS = 4096
#: target -> ``(time.monotonic() of its last sweep in this process, which left no temporary of it,
#: its folder's (device, inode, mtime) once this process's write that followed landed, or None)``
_SWEPT_CLEAN: dict[str, tuple[float, tuple[int, int, int] | None]] = {}


def _folder_state(status: os.stat_result) -> tuple[int, int, int]:
    return status.st_dev, status.st_ino, status.st_mtime_ns


def remove_stale_temporaries(target: Path | str, suffix: str = "", *, room: int = 0, locked: bool = False,
                             unless_clean: bool = False) -> None:
    """Remove temporaries of earlier writes to ``target`` whose writer has died (SIGKILL).

    Dead means: named by this PID namespace and its PID is gone, or it is this process's PID and
    this process is not writing it (an earlier process of this PID's); named by another, unmodified
    for :data:`STALE_AFTER`; named without one (older weightstore), its PID is gone (see the
    module docstring). ``locked``: the caller holds the lock every writer of ``target`` takes,
    so each temporary there is a dead writer's, whatever its name says: a writer killed on
    another node sharing the folder, or in a container whose restarted process got the same PID
    (a trainer is often PID 1), left it. ``suffix`` is a pattern for what a writer appends after
    the temporary's name (the file endings of a TF checkpoint written under a temporary prefix),
    and ``room`` the most bytes it appends, as :func:`temporary_beside` was told.

    ``unless_clean``: skip the listing (a fifth of a small save's setup) where this process's
    last sweep of ``target``, less than :data:`SWEEP_AGAIN_AFTER` ago, left no temporary of it
    (not even a live writer's) and nothing in the folder has changed since its write that
    followed (:func:`fsync_folder` ``written=``): the folder's modification time is the same.
    So a temporary left by a writer killed since is still removed by the next write; one begun
    while this process wrote the target, or within the file system's timestamp granularity
    after (a few milliseconds where the kernel stamps coarsely), goes within the minute.
    """
    key = os.fspath(target)
    folder, base = os.path.split(key)
    if unless_clean:
        swept = _SWEPT_CLEAN.get(key)
        if swept is not None and swept[1] is not None and time.monotonic() - swept[0] < SWEEP_AGAIN_AFTER:
            with contextlib.suppress(OSError):
                if _folder_state(os.stat(folder or ".")) == swept[1]:
                    _SWEPT_CLEAN[key] = (swept[0], None)  # the state this write leaves, noted as it lands
                    return
    head = _temporary_head(base, key, room)
    pattern = re.compile(rf"([0-9]+)-(?:([0-9a-f]{{{_SPACE_HEX}}})-)?[0-9a-f]+(?={suffix}\Z)")
    left = True  # unless the listing says otherwise
    with contextlib.suppress(OSError):
        names = os.listdir(folder or ".")  # a listing, and names compared first: the folder may be large
        left = False
        for name in names:
            match = name.startswith(head) and pattern.match(name, len(head))
            if match and (locked or _dead(os.path.join(folder, name), int(match.group(1)), match.group(2),
                                          name[:match.end()])):
                with contextlib.suppress(OSError):  # gone already, or a folder: the next one may still go
                    os.unlink(os.path.join(folder, name))
                    continue
            left = left or bool(match)
    if left:
        _SWEPT_CLEAN.pop(key, None)
    else:
        if len(_SWEPT_CLEAN) >= _SWEPT_TARGETS:
            _SWEPT_CLEAN.clear()
        _SWEPT_CLEAN[key] = (time.monotonic(), None)


#: the heads whose dead writers' scratch folders this process has removed (see :func:`scratch_folder`)
_SCRATCH_SWEPT: set[str] = set()


def scratch_folder(head: str) -> str:
    """A new private folder in the system's temporary folder (``TMPDIR``), ``HEAD PID-SPACE-RANDOM``:
    named by its writer as a temporary is, so that the first call in a process with ``head``
    removes the folders a writer killed while it used one left (an upload's copy of a version
    file, an unpacked archive: a trainer killed mid-publish left a model-sized file in ``/tmp``
    at each kill, which no restart removed). Dead means what it does for a temporary (see
    :func:`remove_stale_temporaries`): one named by this very process that it did not make is
    dead too, an earlier process's of this PID in a namespace of this space (a container's
    trainer is often PID 1, and a restarted container's PID namespace may get the inode its killed
    one had: the kernel hands out the lowest free one). Only this user's folders are removed,
    never through a link. Removed with :func:`remove_scratch`."""
    temporary = tempfile.gettempdir()
    if head not in _SCRATCH_SWEPT:
        _SCRATCH_SWEPT.add(head)
        _remove_dead_scratch(temporary, head)
    pid = os.getpid()
    while True:  # mkdtemp's loop, the name noted first: another thread's sweep must never take it for a dead one's
        name = f"{head}{pid}-{pid_space(pid)}-{secrets.token_hex(4)}"
        _IN_USE.add(name)
        try:
            os.mkdir(os.path.join(temporary, name), 0o700)
        except FileExistsError:
            _IN_USE.discard(name)
            continue
        return os.path.abspath(os.path.join(temporary, name))


def remove_scratch(folder: str) -> None:
    """Remove a folder :func:`scratch_folder` made, and whatever is in it."""
    shutil.rmtree(folder, ignore_errors=True)
    _IN_USE.discard(os.path.basename(folder))


def _remove_dead_scratch(temporary: str, head: str) -> None:
    """Remove the folders :func:`scratch_folder` made in ``temporary`` with ``head`` whose writer is dead."""
    pattern = re.compile(rf"([0-9]+)-([0-9a-f]{{{_SPACE_HEX}}})-[0-9a-z_]+\Z")
    with contextlib.suppress(OSError):
        for entry in os.scandir(temporary):
            match = entry.name.startswith(head) and pattern.match(entry.name, len(head))
            if not match or not entry.is_dir(follow_symlinks=False):
                continue
            pid, space = int(match.group(1)), match.group(2)
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid == os.getuid() and \
                        _dead(entry.path, pid, space, entry.name):
                    shutil.rmtree(entry.path, ignore_errors=True)


def _dead(path: str, pid: int, space: str | None, name: str) -> bool:
    """Whether the writer of the temporary ``path``, named by ``pid`` in ``space``, is gone. One
    named by this very process is, unless ``name`` (its name, less what its writer appends) is
    one this process is using (:data:`_IN_USE`): another of this PID and space
    is an earlier process's (see the module docstring). Not where the space is a host's
    (:func:`_host_space`: no ``/proc`` to tell namespaces apart), which every container there
    shares: their PID 1s may all be live."""
    here = space == pid_space()
    if here and pid == os.getpid() and space != _host_space():
        return name not in _IN_USE
    if space is None or here:
        return not process_alive(pid)
    try:
        return time.time() - os.lstat(path).st_mtime > STALE_AFTER
    except OSError:  # gone already, or not ours to ask: left alone
        return False


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this PID namespace still runs (another user's does; a PID no
    system has is taken for a live one, never wrongly for a dead one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True
