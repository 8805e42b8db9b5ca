"""Local byte sources: a file mapped, read with ``pread`` into owned memory, or a stream.

Each opens its file through :func:`~weightstore.io.files.open_regular_unbuffered`, so a FIFO or device is
refused at open instead of blocking. Each refuses a range outside the file before reading it,
so no reader needs to trust a length it was given.

**Reading ahead.** A reader calls ``prefetch(offset, length)`` before it reads a range. A local
source then asks the kernel (``posix_fadvise(WILLNEED)``, from one background thread) to fetch
that range and the :data:`READ_AHEAD` bytes after it, once per byte: a cold file streams from
the disk in large requests while the reader verifies and copies what came before, instead of
faulting a map in page by page. Pages already cached make the advice a cheap lookup, so views of
a cached file stay zero-copy and cost nothing more.

The kernel reads at most ``max(read_ahead_kb, max_sectors_kb)`` of one advice (Linux's
``force_page_cache_ra``), so how the advice is cut depends on the device (:func:`_advice_piece`):
where its own read-ahead is small (the common 128 KB) the advice goes in 1 MB pieces, each read
whole. Where it is large (8 MB on the VMs measured) the kernel's read-ahead on a map's faults
keeps the disk busy by itself, and a mapped file's stretch is faulted into the map instead
(``MADV_POPULATE_READ``, :func:`_populate`), in 8 MB pieces, two at a time on two threads; a
read waits for the pieces that hold its bytes (faulting in itself those no populator has started,
perhaps queued behind another file's) and finds them in its map, where it used to fault them in
page by page while it checksummed them. A cold 256 MB npz read and verified (2 cores,
kernel 6.18, quiet): 0.16 s and 0.05 CPU-s, where one advice of the stretch took 0.25 s and
0.10-0.12 CPU-s (a plain mapped read: 0.14 s).

**The size guard.** Writers replace files by rename, never in place, so a map stays valid for as
long as any array made from it lives. A file truncated or rewritten *in place* by another tool
(``cp``, ``rsync --inplace``) is another matter: touching a page of a map that now lies past the
file's end kills the process with SIGBUS. :class:`SizeGuard` is the one check against that: a
reader of a mapped file calls :meth:`SizeGuard.check` (through ``ByteSource.check_unchanged``)
before each read, and an open store's next read then refuses cleanly. Any reader that maps a
file itself holds a guard made at open (``SizeGuard(fileno, size, path)``). Faulting a stretch
in ahead of the reader is safe even so: the kernel refuses to populate a page past the end
(``EFAULT``, where a touch raises SIGBUS), and that piece is left for the read to refuse; a
read that waited for its pieces checks the size again after the wait, which may be long.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import threading
from concurrent.futures import Future
from typing import Any

import numpy as np

from weightstore.core._forks import Pool
from weightstore.core._heap import populate_read
from weightstore.errors import FormatError, StoreClosedError
from weightstore.io._buffer import aligned_buffer
from weightstore.io.files import open_regular_unbuffered, unreadable

__all__ = ["INDEX_WINDOW", "READ_AHEAD", "SizeGuard", "MappedFile", "OwnedFile", "StreamFile", "check_range"]

#: how far past a range being read the kernel is asked to fetch a local file
READ_AHEAD = 64 << 20
#: bytes a mapped file's open reads for the index (:meth:`MappedFile.start`): the npz index of
#: some 250 tensors, the safetensors header of some 700; a larger index is read from the map
INDEX_WINDOW = 64 << 10
_advisor = Pool(1, "weightstore-readahead", advice=True)  # one thread: the advice queues, the disk reads in order
_CAN_ADVISE = hasattr(os, "posix_fadvise")  # not on macOS, whose own readahead must do
#: a shorter stretch is left to the kernel's own read-ahead (128 KB by default): handing it to
#: the advice thread cost the open of a 100 KB file 4 ms of thread hand-off on a busy machine,
#: five times the rest of the open (``benchmarks/small_bench``)
_ADVISE_FROM = 256 << 10


def _advise(fileno: int, offset: int, length: int, piece: int | None) -> None:
    """``posix_fadvise(WILLNEED)`` on a background thread, in advice of ``piece`` bytes (``None``:
    one advice): the call itself allocates the pages and queues the reads, which a reader should
    not wait for."""
    _advisor.submit(_fadvise, fileno, offset, length, piece or length)


def _fadvise(fileno: int, offset: int, length: int, piece: int) -> None:
    with contextlib.suppress(OSError):  # closed meanwhile (the number may even be reused: advice is harmless)
        for start in range(offset, offset + length, piece):
            os.posix_fadvise(fileno, start, min(piece, offset + length - start), os.POSIX_FADV_WILLNEED)


#: a device whose kernel read-ahead is at least this streams a map's faults by itself
_STREAMS_BY_ITSELF = 4 << 20
_ADVICE_PIECE = 1 << 20  # within what the kernel reads of one advice on any device


@functools.cache
def _advice_piece(device: int) -> int | None:
    """The pieces to advise a file's ranges in: 1 MB, each read whole, where the kernel's own
    read-ahead for the file's device (``st_dev``) is small; ``None`` (one advice, of which the
    kernel reads the head) where it is large. Unknown (no sysfs entry): small. Read from sysfs
    once per device.

    The kernel reads at most ``max(read_ahead_kb, max_sectors_kb)`` of one advice. A cold 256 MB
    load, interleaved in one process (seven rounds, medians, x a plain sequential read): with the
    common 128 KB, one advice 1.32x (npz) and 1.13x (safetensors), 1 MB pieces 1.07x and 0.92x;
    with 8 MB (the VM's setting), one advice 0.91x and 0.99x, the pieces 1.13x and 1.13x, the disk
    queued deep with reads not needed yet while the kernel's read-ahead on the map's faults,
    carrying on from each advice's head, kept pace by itself.
    """
    name = f"{os.major(device)}:{os.minor(device)}"
    for where in (f"/sys/class/bdi/{name}/read_ahead_kb", f"/sys/dev/block/{name}/queue/read_ahead_kb",
                  f"/sys/dev/block/{name}/../queue/read_ahead_kb"):  # a partition's disk
        with contextlib.suppress(OSError, ValueError), open(where) as setting:
            return None if int(setting.read()) << 10 >= _STREAMS_BY_ITSELF else _ADVICE_PIECE
    return _ADVICE_PIECE


def check_range(offset: int, length: int, size: int, name: str) -> None:
    """Refuse a read of bytes ``offset..offset+length`` that the file of ``size`` bytes does not hold."""
    if offset < 0 or length < 0 or offset + length > size:
        raise FormatError(f"truncated file (needs bytes {offset}..{offset + length}, has {size})", path=name)


class SizeGuard:
    """The size a file had when it was opened, checked again before each read of its map."""

    __slots__ = ("_fileno", "name", "size")

    def __init__(self, fileno: int, size: int, name: str):
        self._fileno, self.size, self.name = fileno, size, name

    def check(self, what: str, *, key: str | None = None) -> None:
        """Refuse, naming ``what``, to read a file whose size changed since it was opened.

        It was rewritten in place: the index read at open no longer describes it, and pages of
        a map past its new end would kill the process with SIGBUS when touched.
        """
        size = os.fstat(self._fileno).st_size
        if size != self.size:
            raise FormatError(
                f"file changed size since it was opened ({self.size} -> {size} bytes; rewritten "
                f"in place?); refusing to read {what}. Open it again.", path=self.name, key=key
            )


class _LocalFile:
    """What both local sources share: the open handle, positional reads, the closed state."""

    def __init__(self, path: str):
        self.name = path
        self._handle, self.size = open_regular_unbuffered(path)  # open for the store's whole life, closed by close()
        self._closed = False
        self._guard = SizeGuard(self._handle.fileno(), self.size, path)
        self._ahead = (0, 0)  # the stretch last announced to the kernel, where reading ahead goes on

    def read_into(self, offset: int, buffer: memoryview) -> None:
        """Copy bytes from the file into ``buffer`` without mapping them into this process."""
        self._check(offset, len(buffer))
        filled = 0  # positional reads: threads sharing one store never move each other's offset
        while filled < len(buffer):
            try:
                count = os.preadv(self._handle.fileno(), [buffer[filled:]], offset + filled)
            except OSError as exc:
                raise unreadable(exc, self.name) from None
            if not count:
                raise FormatError(f"short read at byte {offset + filled} (file truncated while open?)", path=self.name)
            filled += count

    def check_unchanged(self, what: str) -> None:
        """Refuse to read a closed store, or (:class:`SizeGuard`) a file changed in place."""
        if self._closed:
            raise StoreClosedError(f"store is closed; cannot read {what}", path=self.name)
        self._guard.check(what)

    def prefetch(self, offset: int, length: int) -> None:
        """Have the kernel fetch ``offset..offset+length`` and :data:`READ_AHEAD` bytes more
        (see the module docstring); what was announced before is not announced again.

        Announced in steps of at least half of :data:`READ_AHEAD`: a step per tensor (each read
        announcing the few megabytes past the last) queued the disk in small requests. A cold
        256 MB safetensors file read tensor by tensor took 0.18 s so, 0.15 s in these steps, and
        0.09 s with the whole stretch announced first, as a reader told which tensors come next
        (``prefetch(keys)``) does. What was announced is the stretch the last announcement
        began, not every byte before its end: reading an npz's index at the end of the file once
        counted the whole file as announced, and no tensor of it was ever read ahead.
        """
        first, last = self._ahead
        if first <= offset and offset + length + READ_AHEAD // 2 <= last:
            return  # well inside what the kernel was asked for already
        start = last if first <= offset <= last else offset  # the stretch goes on, or a new one begins
        end = min(self.size, offset + length + READ_AHEAD)
        if end - start >= _ADVISE_FROM and not self._closed and _CAN_ADVISE:
            self._announce(start, end - start, _advice_piece(os.fstat(self._handle.fileno()).st_dev))
            self._ahead = (first if start == last else start, end)

    def _announce(self, offset: int, length: int, piece: int | None) -> None:
        """Have the kernel fetch a stretch, from the advisor thread, in advice of ``piece`` bytes."""
        _advise(self._handle.fileno(), offset, length, piece)

    def release(self, offset: int, length: int) -> None:
        pass

    def _check(self, offset: int, length: int) -> None:
        if self._closed:
            raise StoreClosedError("store is closed", path=self.name)
        check_range(offset, length, self.size, self.name)

    def fileno(self) -> int:
        """The descriptor of the file opened and checked: for a library that opens files itself
        to open this very one (``/proc/self/fd/N``), not whatever its name names by then."""
        return self._handle.fileno()

    def close(self) -> None:
        self._closed = True
        self._handle.close()


class MappedFile(_LocalFile):
    """A read-only map of a local file: tensors are views into the page cache, never copies.

    Readers call :meth:`check_unchanged` before each read (the module's size guard); for arrays
    that must survive a file changed in place, open with ``mmap=False`` (:class:`OwnedFile`).

    The map is made on the first read the index window does not hold. A reader's index (an
    npz's tail, a safetensors header) comes from that window, read in one ``pread`` at open
    (:meth:`start`, as :class:`~weightstore.io.remote.RemoteFile` fetches its own): an open that
    only lists keys maps nothing: mapping, touching the index's pages and unmapping took 36 us
    where the read takes 15, for the 22 KB index of 100 tensors (whose open takes some 330).
    """

    def __init__(self, path: str):
        super().__init__(path)
        self._map: mmap.mmap | None = None
        self._window: tuple[int, memoryview] | None = None  # (offset, bytes) while the index is read
        #: the pieces the populators fault in (:meth:`_announce`), each (start, end, job) until the
        #: reader finds it done, and the process that asked for them; the list is changed in place
        #: only (append, remove), as threads sharing the file announce and read at once
        self._pieces: list[tuple[int, int, Future[None]]] = []
        self._pieces_of = 0

    def start(self, index_at_end: bool) -> None:
        """Read the :data:`INDEX_WINDOW` bytes at the end or the start of the file, where the
        reader's index lies; reads inside them are served from it until :meth:`index_read`."""
        length = min(self.size, INDEX_WINDOW)
        offset = self.size - length if index_at_end else 0
        try:
            window = os.pread(self._handle.fileno(), length, offset)
        except OSError as exc:
            raise unreadable(exc, self.name) from None
        if len(window) == length:  # else shorter since it was opened: the reads say so, from the map
            self._window = (offset, memoryview(window))

    def index_read(self) -> None:
        """The reader has its index: tensors are read from the map, as views of it."""
        self._window = None

    @property
    def mapping(self) -> mmap.mmap | None:
        """The whole map, for a reader that checks bounds itself and reads many small tensors in
        one loop (slicing the map costs less than a ``read_at`` per header); ``None`` when empty."""
        if self._map is None and self.size:
            self._check(0, 0)  # never a map of a closed file's descriptor
            self._guard.check("its tensors")  # cut since the open: mmap's ValueError, or SIGBUS past its end
            try:
                made = mmap.mmap(self._handle.fileno(), self.size, access=mmap.ACCESS_READ)
            except ValueError as exc:  # cut between the check and the map
                self._guard.check("its tensors")
                raise FormatError(f"cannot map the file: {exc}", path=self.name) from exc
            # no lock (one held by another thread at a fork stays held in the child): of threads
            # that mapped at once, one's map is kept and the others' are dropped
            if self._map is None:
                self._map = made
        return self._map

    def read_at(self, offset: int, length: int) -> memoryview:
        # :meth:`_check`'s test inline (an open of an npz reads here five times); it raises, naming the file
        if self._closed or offset < 0 or length < 0 or offset + length > self.size:
            self._check(offset, length)
        window = self._window
        if window is not None and window[0] <= offset and offset + length <= window[0] + len(window[1]):
            return window[1][offset - window[0] : offset - window[0] + length]
        mapping = self.mapping
        if mapping is None:
            return memoryview(b"")
        if self._pieces:
            self._wait_populated(offset, length)
            # the reader checked the size before this wait, which may have been long: a file cut
            # in place meanwhile would kill the process (SIGBUS) at the first byte past its end
            self._guard.check(f"bytes {offset}..{offset + length}")
        return memoryview(mapping)[offset : offset + length]

    def _wait_populated(self, offset: int, length: int) -> None:
        """Wait for the pieces being faulted in that hold any of these bytes (:meth:`_announce`),
        so the reader finds them in its map rather than faults them in beside the populators
        (which cost a cold 256 MB npz read 1.4x its wall on a loaded machine, and twice the CPU).
        Not in a forked child, whose populators are not its parent's. A piece no populator has
        started is faulted in here instead: it may be queued behind another file's stretch (on a
        slow or hung mount), which this read must not wait for. One not started that ends before
        these bytes is dropped: the reader passed it by (the bytes between the tensors of a
        stretch it reads some of), and populated it would read them all from the disk."""
        if self._pieces_of != os.getpid():
            self._pieces = []
            return
        end = offset + length
        for start, stop, job in list(self._pieces):
            if stop <= offset:
                job.cancel()
            elif start < end:
                if job.cancel() and self._map is not None:  # mapped: the pieces are of its map
                    _populate(self, self._map, self.fileno(), start, stop - start)
                    continue
                with contextlib.suppress(Exception):  # a failed piece is the reads' to report
                    job.result()
        for piece in [piece for piece in self._pieces if piece[2].done()]:
            with contextlib.suppress(ValueError):  # in place: a piece another thread announced meanwhile stays listed
                self._pieces.remove(piece)

    def _announce(self, offset: int, length: int, piece: int | None) -> None:
        """Where the device reads ahead far by itself (``piece`` None), fault the stretch into the
        map, two pieces at a time (:func:`_populate`), else advise it as an owned file does."""
        mapping = self.mapping if piece is None and self._window is None and _populates else None
        if mapping is None:
            super()._announce(offset, length, piece)
            return
        if self._pieces_of != os.getpid():  # a forked child: its parent's pieces are not its own
            self._pieces, self._pieces_of = [], os.getpid()
        for start in range(offset, offset + length, _POPULATE_PIECE):
            stop = min(start + _POPULATE_PIECE, offset + length)
            self._pieces.append((start, stop, _populators.submit(_populate, self, mapping, self.fileno(), start, stop - start)))

    def release(self, offset: int, length: int) -> None:
        """Unmap a range read once and never handed out (compressed bytes): it leaves this
        process's resident memory, the page cache keeps it, a later read maps it again."""
        if self._map is not None and length > 0:
            start = offset - offset % mmap.PAGESIZE
            self._map.madvise(mmap.MADV_DONTNEED, start, offset + length - start)

    def close(self) -> None:
        super().close()
        self._window = None
        if self._map is not None:
            with contextlib.suppress(BufferError):  # arrays handed out still view the map; it closes with the last
                self._map.close()


#: a stretch is populated in pieces of this size, two at a time (:data:`_populators`)
_POPULATE_PIECE = 8 << 20
_populators = Pool(2, "weightstore-populate", advice=True)  # pieces start in order, the next while one waits for the disk
_populates = True  # False once the kernel refused to populate a map (older than 5.14): advice instead


def _populate(source: MappedFile, mapping: mmap.mmap, fileno: int, offset: int, length: int) -> None:
    """Fault ``offset..offset+length`` of ``source``'s map in, unless ``source`` was closed;
    where the kernel cannot, advise it instead (``fileno``: the file's descriptor), and every
    later stretch. The map stays open while the piece is faulted in (a view of it keeps
    ``close`` from unmapping it), and is closed here if ``source`` was meanwhile."""
    global _populates
    try:
        view = np.frombuffer(mapping, np.uint8)
    except ValueError:  # closed before a populator came to it
        return
    if not source._closed and populate_read(view.ctypes.data + offset, length) is None:
        _populates = False  # a page past an end cut in place since the open (False) is the reads' to report
        _fadvise(fileno, offset, length, length)
    del view
    if source._closed:
        with contextlib.suppress(BufferError):  # arrays handed out still view the map; it closes with the last
            mapping.close()


class OwnedFile(_LocalFile):
    """A local file read with ``preadv`` into fresh memory: arrays own their bytes.

    Nothing is mapped, so no later change to the file can reach an array already read. Each
    buffer starts at the same offset modulo :data:`~weightstore.io._buffer.ALIGNMENT` as its bytes
    in the file, so a tensor the writer aligned in the file is aligned in memory too.
    """

    def check_unchanged(self, what: str) -> None:
        """Only whether it is closed: a file changed under positional reads fails them cleanly
        (a short read) or is caught by the header and checksum checks, and no array can change."""
        if self._closed:
            raise StoreClosedError(f"store is closed; cannot read {what}", path=self.name)

    def read_at(self, offset: int, length: int) -> memoryview:
        self._check(offset, length)
        view = aligned_buffer(length, offset)
        self.read_into(offset, view)
        return view


class StreamFile:
    """Ranged reads over any seekable binary file, such as an fsspec file on object storage."""

    def __init__(self, handle: Any, name: str):  # any binary file object with seek, read and readinto
        self.name = name
        self._handle = handle
        self._lock = threading.Lock()  # a seek and its read must not interleave with another thread's
        self.size = handle.seek(0, os.SEEK_END)

    def check_unchanged(self, what: str) -> None:
        """Objects are replaced whole, never changed under a reader: only the closed state to check."""
        if self._handle.closed:
            raise StoreClosedError(f"store is closed; cannot read {what}", path=self.name)

    def read_at(self, offset: int, length: int) -> bytes:
        check_range(offset, length, self.size, self.name)
        with self._lock:
            self._handle.seek(offset)
            data = self._handle.read(length)
        if len(data) != length:
            raise FormatError(f"short read at byte {offset}", path=self.name)
        return data

    def read_into(self, offset: int, buffer: memoryview) -> None:
        check_range(offset, len(buffer), self.size, self.name)
        with self._lock:
            self._handle.seek(offset)
            filled = 0
            while filled < len(buffer):
                count = self._handle.readinto(buffer[filled:])
                if not count:
                    raise FormatError(f"short read at byte {offset + filled}", path=self.name)
                filled += count

    def prefetch(self, offset: int, length: int) -> None:
        pass

    def release(self, offset: int, length: int) -> None:
        pass

    def close(self) -> None:
        self._handle.close()
