"""Handing memory the C heap holds free back to the system, after a large exchange of buffers.

A follower replaces a model's buffers every version: the new ones are read (or adopted by the
framework) while the old ones are still held, then the old ones are freed. glibc keeps what
is freed for reuse, and reuses it only for allocations that fit where it lies; a version read
into fresh memory while the last one's pages sit free leaves the process holding both for
good, so its resident memory creeps towards two models plus the one being staged.
:func:`give_back` returns those pages after each swap, so what the process holds is what it
uses. ``tf1.assign`` calls it too, once a batch's variables have let go of buffers that were fed
numpy arrays (a TF1 variable keeps an aligned one as its buffer), before TensorFlow's pool is
asked for their replacements. It costs a few milliseconds (5-14 ms measured with TensorFlow
loaded, on a loaded 2-core machine), outside the serving lock; meanwhile another thread's allocation from the arena being
trimmed waits. Elsewhere (macOS, musl) it does nothing: those allocators return large blocks
on free.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import sys
from collections.abc import Callable

__all__ = ["give_back", "populate", "populate_read"]


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):  # not glibc
        return None


def give_back() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``); a no-op elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


#: ``madvise``'s advice to fault a range's pages in, readable or writable, in one call (Linux 5.14)
_POPULATE_READ = 22
_POPULATE_WRITE = 23
_PAGE = 4096


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def populate(address: int, length: int) -> None:
    """Fault in the whole pages of ``address..address+length`` (memory about to be written) in
    one system call: touched one by one, a fresh 256 MB buffer took 64,000 page faults, and the
    kernel's one pass over them costs a fifth less CPU (0.16 CPU-s against 0.20). A no-op where
    the kernel or the C library has no such advice: the pages then fault in as they are written."""
    madvise = _madvise() if sys.platform == "linux" else None
    start = -(-address // _PAGE) * _PAGE
    end = (address + length) // _PAGE * _PAGE
    if madvise is not None and end > start:
        madvise(start, end - start, _POPULATE_WRITE)  # refused (an old kernel): nothing lost


def populate_read(address: int, length: int) -> bool | None:
    """Fault in the pages of ``address..address+length`` (a map of a file, about to be read),
    readable, in one system call that reads what the page cache lacks as the map's own faults
    would, read-ahead included. False where a page could not be (past the file's end: the call
    refuses where a touch would raise SIGBUS); None where the kernel or the C library has no such
    advice (Linux before 5.14, another system)."""
    madvise = _madvise() if sys.platform == "linux" else None
    if madvise is None:
        return None
    start = address // _PAGE * _PAGE
    if length <= 0 or madvise(start, address + length - start, _POPULATE_READ) == 0:
        return True
    return None if ctypes.get_errno() == errno.EINVAL else False
