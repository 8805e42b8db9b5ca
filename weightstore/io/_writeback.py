"""Writing a file back to the disk while it is still being written, so its fsync finds little left.

A durable save is its writes, then an fsync that waits for every dirty page to reach the disk.
The kernel starts writing dirty pages on its own only past ``dirty_background_ratio`` (a tenth of
memory, gigabytes), so a save of a model smaller than that writes everything into the page cache
first and only then starts the disk: the two run one after the other. :class:`Writeback` asks
the kernel (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, on one background thread, which may wait
for the disk's queue) to start writing each :data:`WRITEBACK_BYTES` as soon as they are written,
so the disk works while the next tensors are converted, hashed and copied, and the fsync at the
end waits only for the last stretch. Where the call is missing (not Linux) it does nothing.
Its thread also takes other disk work a save need not wait for (:func:`behind`).

**Reserving the file's blocks.** Written into a file that has none yet, each 4 KB block is
reserved as it is written (ext4's delayed allocation: a quota charge and an extent-cache entry
per block) and allocated when written back. Told how many bytes the file will hold at least,
:class:`Writeback` reserves them first in one ``fallocate(FALLOC_FL_KEEP_SIZE)``: unwritten
extents, which the writes fill and the write-back marks written. A durable 256 MB safetensors
save took 0.40-0.41 CPU-s/GB without, 0.32-0.36 with (ext4, Linux 6.18; ``save_file`` + fsync
0.32-0.38). Only on ext4 and XFS, which reserve extents without touching the data: tmpfs zeroes
every page it is asked for (0.65 -> 0.76 CPU-s/GB there). The size stays what is written;
blocks reserved past the end of a file that came out shorter (a value that overstated its size,
or an ``fallocate`` that failed part way, ENOSPC keeping what it had allocated) are given back at
:meth:`close`. A reservation larger than the file system's free space is not tried. The
temporaries that killed writers left beside the same target hold their reservations (0 bytes by
size, every block held), so they must be removed first: otherwise a small file system's next save
of that target would fail for want of the space they hold. The commit removes them as the write
begins (:meth:`~weightstore.io.commit.RenameCommit.begin`), before any reservation.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, cast

from weightstore.core._forks import Pool

__all__ = ["WRITEBACK_BYTES", "Writeback", "behind"]

#: how many newly written bytes make the next writeback request
WRITEBACK_BYTES = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2
_writer = Pool(1, "weightstore-writeback")


_FALLOC_FL_KEEP_SIZE = 1
#: ``statfs.f_type`` of the file systems reserved on: ext4 (and ext2/3), XFS
_RESERVES_EXTENTS = frozenset({0xEF53, 0x58465342})
#: a file reserved for holds at least this many bytes: below, the two calls cost more than they save
RESERVE_FROM = 1 << 20


def _libc(name: str, *argtypes: Any) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]  # ctypes' private type
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True)[name]
    except (OSError, AttributeError):
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


_SYNC = _libc("sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
_FALLOCATE = _libc("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
_FSTATFS = _libc("fstatfs", ctypes.c_int, ctypes.c_void_p)


def _reserves_extents(fd: int) -> bool:
    """Whether ``fd``'s file system reserves blocks cheaply (see the module docstring)."""
    if _FALLOCATE is None or _FSTATFS is None:
        return False
    info = ctypes.create_string_buffer(128)  # struct statfs (120 bytes); f_type is its first field, a long
    return not _FSTATFS(fd, info) and ctypes.c_long.from_buffer(info).value in _RESERVES_EXTENTS


def _reserve(fd: int, size: int) -> bool:
    """Try to reserve the first ``size`` bytes' blocks of ``fd``'s file; whether it was tried,
    and so may hold blocks past the file's end, even if it failed (ENOSPC on ext4 keeps what it
    allocated; the writes will say what is wrong)."""
    try:
        stats = os.fstatvfs(fd)
    except OSError:
        return False
    if size > stats.f_bavail * stats.f_frsize:  # cannot be had (and never past fallocate's int64)
        return False
    assert _FALLOCATE is not None
    _FALLOCATE(fd, _FALLOC_FL_KEEP_SIZE, 0, size)
    return True


def behind(work: Callable[..., object], *args: Any) -> Future[object]:
    """Run ``work(*args)`` on the writeback thread: disk work the caller need not wait for
    (the interpreter waits for it at exit)."""
    return _writer.submit(work, *args)


class Writeback:
    """Start writing ``path`` back to the disk as it grows; :meth:`advance` after each write.

    ``reserve``: asked, only where the file system reserves blocks cheaply, how many bytes the
    file will hold at least, whose blocks are then reserved first (see the module docstring).
    It holds a descriptor of its own, so the writer's file object (buffered, or libhdf5's) is
    never touched; :meth:`close` waits for the requests made, so the descriptor is not closed
    under one.
    """

    def __init__(self, path: str, reserve: Callable[[], int] | None = None):
        self._path: str | None = path  # opened once a request's worth is written, unless reserving opened it
        self._fd = -1
        self._reserved = 0
        self._started = 0  # bytes before this offset were handed to the kernel
        self._handed = 0  # bytes given to the writer since the file's size was last asked
        self._pending: Future[None] | None = None
        if _SYNC is None:
            return
        # the size first: a file too small to reserve for (or to write back before its fsync) costs
        # no descriptor and no fstatfs, a twentieth of the CPU beyond save_file + fsync of 100 KB
        size = reserve() if reserve is not None and _FALLOCATE is not None else 0
        if size < RESERVE_FROM:
            return
        try:
            self._fd = os.open(path, os.O_WRONLY)
        except OSError:  # a file created read-only (umask 0o277): written back all the same, unreserved
            return
        try:
            if _reserves_extents(self._fd) and _reserve(self._fd, size):
                self._reserved = size
        except BaseException:  # the caller's save fails (or is interrupted): not with a descriptor left open
            self.close()
            raise

    def advance(self, handed: int) -> None:
        """Hand the bytes written since the last request to the kernel, if there are enough.

        ``handed``: the bytes just given to the writer. The file's size is asked only once they
        add up to a request's worth: an ``fstat`` per tensor cost a save of 50,000 small ones 0.07 s.
        """
        if _SYNC is None:
            return
        self._handed += handed
        if self._handed < WRITEBACK_BYTES or (self._pending is not None and not self._pending.done()):
            return  # too little yet, or the disk is still busy with the last request: ask later, for more
        if self._fd < 0 and self._path is not None:
            with contextlib.suppress(OSError):  # gone (or unreadable): nothing to write back
                self._fd = os.open(self._path, os.O_RDONLY)
            self._path = None  # asked once
        if self._fd < 0:
            return
        size = os.fstat(self._fd).st_size
        if size - self._started < WRITEBACK_BYTES:
            return  # the writer still holds what it was given (buffered, or laid out at the end)
        self._handed = 0
        self._pending = cast("Future[None]", behind(_start, self._fd, self._started, size - self._started))
        self._started = size

    def close(self) -> None:
        if self._fd < 0:
            return
        if self._pending is not None:
            self._pending.result()
        if self._reserved:  # a failed save's file goes anyway: never an error of its own here
            with contextlib.suppress(OSError):
                size = os.fstat(self._fd).st_size
                if size < self._reserved:
                    os.ftruncate(self._fd, size)  # gives back the blocks reserved past the end
        os.close(self._fd)
        self._fd = -1


def _start(fd: int, offset: int, length: int) -> None:
    assert _SYNC is not None
    _SYNC(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # advice: a failure leaves the fsync all the work
