"""Local files: the one regular-file check, durability (fsync), and temporaries beside a target.

**Regular files only.** A FIFO opened for reading waits for a writer forever; a device or a
socket is no weight file; replacing ``/dev/null`` or a named pipe with a weight file is data
loss. So every local reader opens through :func:`open_regular` (or checks with
:func:`refuse_special_file` where another library opens the file), and every writer resolves
its target through :func:`check_writable_target`; all three decide with :func:`kind_of`.

**Temporaries.** A write goes to ``.NAME.wstmp-PID-RANDOM`` beside its target
(:func:`temporary_beside`: same folder, so the same file system, so a rename can commit it). A
writer killed mid-write leaves its temporary; the next write to that target removes those whose
PID is dead (:func:`remove_stale_temporaries`).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

from weightstore.errors import FileAccessError, FormatError, StoreNotFoundError, TargetError

__all__ = [
    "TEMP_MARK", "kind_of", "open_regular", "open_regular_unbuffered", "refuse_special_file", "check_writable_target",
    "fsync_path", "fsync_folder", "temporary_beside", "target_of_temporary", "remove_stale_temporaries",
]

#: marks the temporary file a write puts beside its target (``.NAME.wstmp-PID-RANDOM``)
TEMP_MARK = ".wstmp-"
_TEMPORARY_NAME = re.compile(r"\.(.+)" + re.escape(TEMP_MARK) + r"\d+-[0-9a-f]+$")

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


def refuse_special_file(path: str) -> None:
    """Refuse a FIFO, device or folder where a file belongs, for readers another library opens.

    Raises ``FileNotFoundError`` as :func:`open` would when nothing is there.
    """
    kind = kind_of(os.stat(path).st_mode)
    if kind is not None:
        raise _not_regular(kind, path)


def check_writable_target(target: Path, *, follow_symlinks: bool = True) -> Path:
    """The regular file a write to ``target`` replaces: ``target``, or the file a symlink names.

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
    resolved = target
    if mode is not None and stat.S_ISLNK(mode):
        if not follow_symlinks:
            raise TargetError(f"is a symbolic link (to {os.readlink(target)}); a versioned folder's files are never "
                              "written through links: remove it", path=str(target))
        resolved = Path(os.path.realpath(target))
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
    elif not resolved.parent.is_dir():  # a file there has its folder
        raise StoreNotFoundError(f"folder {str(resolved.parent)!r} does not exist", path=str(target))
    return resolved


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


#: the most bytes :func:`temporary_beside` adds to a name: a dot, the mark, a pid (at most 7
#: digits on Linux), a dash and 8 hex digits; a name must leave room for them under 255 bytes
TEMPORARY_EXTRA = 1 + len(TEMP_MARK) + 7 + 1 + 8


def temporary_beside(target: Path) -> Path:
    """A fresh temporary name beside ``target`` that :func:`remove_stale_temporaries` recognises."""
    return target.with_name(f".{target.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def target_of_temporary(path: str | Path) -> Path | None:
    """The target that :func:`temporary_beside` named ``path`` for, or None if it names none."""
    path = Path(path)
    match = _TEMPORARY_NAME.match(path.name)
    return None if match is None else path.with_name(match.group(1))


def remove_stale_temporaries(target: Path, suffix: str = "", *, locked: bool = False) -> None:
    """Remove temporaries of earlier writes to ``target`` whose process has died (SIGKILL).

    ``suffix`` is a pattern for what a writer appends after the temporary's name (the file
    endings of a TF checkpoint written under a temporary prefix). ``locked``: the caller holds
    the lock every writer of ``target`` takes, so each temporary there is a dead writer's, its
    PID alive here or not: a writer killed on another node sharing the folder, or in a container
    whose restarted process got the same PID (a trainer is often PID 1), left it.
    """
    pattern = re.compile(re.escape(f".{target.name}{TEMP_MARK}") + r"(\d+)-[0-9a-f]+" + suffix + "$")
    with contextlib.suppress(OSError):
        for entry in os.scandir(target.parent):
            match = pattern.match(entry.name)
            if match and (locked or not _process_alive(int(match.group(1)))):
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
