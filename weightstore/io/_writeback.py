"""Writing a file back to the disk while it is still being written, so its fsync finds little left.

A durable save is its writes, then an fsync that waits for every dirty page to reach the disk.
The kernel starts writing dirty pages on its own only past ``dirty_background_ratio`` (a tenth of
memory, gigabytes), so a save of a model smaller than that writes everything into the page cache
first and only then starts the disk: the two run one after the other. :class:`Writeback` asks
the kernel (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, on one background thread, which may wait
for the disk's queue) to start writing each :data:`WRITEBACK_BYTES` as soon as they are written,
so the disk works while the next tensors are converted, hashed and copied, and the fsync at the
end waits only for the last stretch. Where the call is missing (not Linux) it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["WRITEBACK_BYTES", "Writeback"]

#: how many newly written bytes make the next writeback request
WRITEBACK_BYTES = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2
_writer: ThreadPoolExecutor | None = None
_writer_lock = threading.Lock()


def _sync_file_range() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]  # ctypes' private type
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC = _sync_file_range()


class Writeback:
    """Start writing ``path`` back to the disk as it grows; :meth:`advance` after each write.

    It holds a read-only descriptor of its own, so the writer's file object (buffered, or
    libhdf5's) is never touched; :meth:`close` waits for the requests made, so the descriptor
    is not closed under one.
    """

    def __init__(self, path: str):
        self._fd = -1
        self._started = 0  # bytes before this offset were handed to the kernel
        self._handed = 0  # bytes given to the writer since the file's size was last asked
        self._pending: Future[None] | None = None
        if _SYNC is not None:
            with contextlib.suppress(OSError):
                self._fd = os.open(path, os.O_RDONLY)

    def advance(self, handed: int) -> None:
        """Hand the bytes written since the last request to the kernel, if there are enough.

        ``handed``: the bytes just given to the writer. The file's size is asked only once they
        add up to a request's worth: an ``fstat`` per tensor cost a save of 50,000 small ones 0.07 s.
        """
        if self._fd < 0:
            return
        self._handed += handed
        if self._handed < WRITEBACK_BYTES or (self._pending is not None and not self._pending.done()):
            return  # too little yet, or the disk is still busy with the last request: ask later, for more
        size = os.fstat(self._fd).st_size
        if size - self._started < WRITEBACK_BYTES:
            return  # the writer still holds what it was given (buffered, or laid out at the end)
        self._handed = 0
        global _writer
        with _writer_lock:
            if _writer is None:
                _writer = ThreadPoolExecutor(1, thread_name_prefix="weightstore-writeback")
        self._pending = _writer.submit(_start, self._fd, self._started, size - self._started)
        self._started = size

    def close(self) -> None:
        if self._fd < 0:
            return
        if self._pending is not None:
            self._pending.result()
        os.close(self._fd)
        self._fd = -1


def _start(fd: int, offset: int, length: int) -> None:
    assert _SYNC is not None
    _SYNC(fd, offset, length, _SYNC_FILE_RANGE_WRITE)  # advice: a failure leaves the fsync all the work
