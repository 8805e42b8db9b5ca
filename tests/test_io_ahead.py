"""The disk kept busy ahead of the code: readahead of local sources, writeback during saves,
and the copies TF1 feeds (which TF must copy into its own allocator, not adopt)."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import weightstore as ws
from weightstore.errors import FormatError
from weightstore.io import _local, _writeback
from weightstore.io._local import MappedFile, OwnedFile


@pytest.fixture
def small_steps(monkeypatch):
    """Readahead and writeback in steps of 64 KiB, so a small file takes many of them."""
    monkeypatch.setattr(_local, "READ_AHEAD", 1 << 16)
    monkeypatch.setattr(_writeback, "WRITEBACK_BYTES", 1 << 16)


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".h5"])
def test_save_written_back_while_written_reads_back_exactly(tmp_path, small_steps, suffix):
    weights = {f"layer_{i}/w": np.random.default_rng(i).standard_normal(50_000, dtype=np.float32) for i in range(8)}
    path = tmp_path / f"w{suffix}"
    ws.save(path, weights)
    for key, value in ws.load(path).items():
        np.testing.assert_array_equal(value, weights[key])


def test_writeback_of_a_growing_file_waits_for_its_requests(tmp_path, small_steps):
    path = tmp_path / "grown.bin"
    with open(path, "wb") as out:
        started = _writeback.Writeback(str(path))
        for _ in range(4):
            out.write(os.urandom(1 << 17))
            out.flush()
            started.advance(1 << 17)
        started.close()
        started.close()  # twice is harmless
    assert path.stat().st_size == 4 << 17


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".h5"])
def test_saved_file_holds_no_blocks_past_its_end(tmp_path, suffix):
    """A save reserves its tensors' blocks first (ext4, XFS); the file keeps only what it holds.
    One tensor spans several 4 MB writes and ends inside one (each checksummed as written)."""
    weights = {f"layer_{i}/w": np.random.default_rng(i).standard_normal(300_000, dtype=np.float32) for i in range(8)}
    weights["embedding"] = np.random.default_rng(9).standard_normal((2600, 1031), dtype=np.float32)
    path = tmp_path / f"w{suffix}"
    ws.save(path, weights)
    assert path.stat().st_blocks * 512 <= path.stat().st_size + (64 << 10)  # its extent tree aside
    for key, value in ws.load(path).items():
        np.testing.assert_array_equal(value, weights[key])


def test_writeback_gives_back_blocks_reserved_past_what_was_written(tmp_path):
    path = tmp_path / "short.bin"
    with open(path, "wb") as out:
        started = _writeback.Writeback(str(path), reserve=lambda: 16 << 20)
        out.write(os.urandom(1 << 20))
        out.flush()
        started.advance(1 << 20)
        started.close()
    assert path.stat().st_size == 1 << 20
    assert path.stat().st_blocks * 512 <= (1 << 20) + (64 << 10)


def _reserving(path):
    """Skip unless ``path``'s file system is one the writeback reserves blocks on (ext4, XFS)."""
    if _writeback._FSTATFS is None:
        pytest.skip("no fstatfs here")
    info = ctypes.create_string_buffer(128)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert not _writeback._FSTATFS(fd, info)
    finally:
        os.close(fd)
    if ctypes.c_long.from_buffer(info).value not in (0xEF53, 0x58465342):
        pytest.skip("blocks are reserved on ext4 and XFS only")


def test_writeback_reserves_the_blocks_it_is_told_of_at_once(tmp_path):
    path = tmp_path / "reserved.bin"
    path.touch()
    _reserving(tmp_path)
    started = _writeback.Writeback(str(path), reserve=lambda: 16 << 20)
    try:
        assert path.stat().st_blocks * 512 >= 16 << 20
        assert path.stat().st_size == 0
    finally:
        started.close()
    assert path.stat().st_blocks * 512 <= 64 << 10


def test_writeback_gives_back_what_a_failed_reservation_kept(tmp_path, monkeypatch):
    """An fallocate that fails ENOSPC on ext4 keeps what it allocated: given back all the same."""
    path = tmp_path / "failed.bin"
    path.touch()
    _reserving(tmp_path)
    real = _writeback._FALLOCATE

    def allocates_then_fails(fd, mode, offset, length):
        real(fd, mode, offset, length)
        return -1
    monkeypatch.setattr(_writeback, "_FALLOCATE", allocates_then_fails)
    _writeback.Writeback(str(path), reserve=lambda: 16 << 20).close()
    assert path.stat().st_blocks * 512 <= 64 << 10


def test_writeback_of_a_file_it_cannot_write_still_writes_it_back(tmp_path, monkeypatch, small_steps):
    """A file created read-only (umask 0o277) is written back, unreserved (root writes any file,
    so its O_WRONLY open is refused here the way a user's is)."""
    path = tmp_path / "read-only.bin"
    path.touch()
    opened = os.open

    def refuses_writing(name, flags, *args):
        if flags & os.O_WRONLY:
            raise PermissionError(13, "Permission denied", name)
        return opened(name, flags, *args)
    monkeypatch.setattr(os, "open", refuses_writing)
    if _writeback._SYNC is None:
        pytest.skip("no sync_file_range here")
    real, requests = _writeback._SYNC, []
    monkeypatch.setattr(_writeback, "_SYNC", lambda *args: requests.append(args[1:3]) or real(*args))
    started = _writeback.Writeback(str(path), reserve=lambda: 16 << 20)
    with open(path, "ab") as out:
        out.write(os.urandom(1 << 17))
        out.flush()
        started.advance(1 << 17)
    started.close()
    assert requests == [(0, 1 << 17)]


class _Overstated:
    """An array-like whose ``nbytes`` claims 64 MB: the save reserves them, the file holds 16 KB."""

    def __init__(self, array):
        self._array = array
        self.dtype, self.shape = array.dtype, array.shape

    def __array__(self, dtype=None, copy=None):
        return self._array

    nbytes = 64 << 20


@pytest.mark.parametrize("suffix", [".npz", ".safetensors", ".h5"])
def test_save_of_a_value_that_overstates_its_size_holds_no_blocks_past_its_end(tmp_path, suffix):
    _reserving(tmp_path)
    path = tmp_path / f"w{suffix}"
    ws.save(path, {"w": _Overstated(np.arange(4096, dtype=np.float32))})
    assert path.stat().st_blocks * 512 <= path.stat().st_size + (64 << 10)
    np.testing.assert_array_equal(ws.load(path)["w"], np.arange(4096, dtype=np.float32))


def test_save_frees_killed_saves_temporaries_before_it_reserves(tmp_path, monkeypatch):
    """A killed save's temporary holds every block it reserved (0 bytes by size): the next save
    of the target removes it before reserving, or a small file system would refuse it."""
    _reserving(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".w.safetensors.wstmp-{dead.pid}-0123abcd"
    stale.touch()
    real = _writeback._FALLOCATE
    left = []

    def noting(fd, mode, offset, length):
        left.append(stale.exists())
        return real(fd, mode, offset, length)
    monkeypatch.setattr(_writeback, "_FALLOCATE", noting)
    ws.save(tmp_path / "w.safetensors", {"w": np.ones(1 << 20, np.float32)})
    assert left == [False]


def test_writeback_interrupted_while_reserving_closes_its_descriptor(tmp_path, monkeypatch):
    """Not only a failed ``reserve()``: any exception while reserving (Ctrl-C in ``fallocate``)
    leaves no descriptor open."""
    _reserving(tmp_path)
    path = tmp_path / "w.safetensors"
    path.touch()

    def interrupted(fd, size):
        raise KeyboardInterrupt
    monkeypatch.setattr(_writeback, "_reserve", interrupted)
    before = sorted(os.listdir("/proc/self/fd"))
    with pytest.raises(KeyboardInterrupt):
        _writeback.Writeback(str(path), reserve=lambda: 16 << 20)
    assert sorted(os.listdir("/proc/self/fd")) == before


class _Misstated:
    """An array-like whose ``nbytes`` fails: saved from what it converts to."""

    def __init__(self, array):
        self._array = array
        self.dtype, self.shape = array.dtype, array.shape

    def __array__(self, dtype=None, copy=None):
        return self._array

    @property
    def nbytes(self):
        raise RuntimeError("not known")


def test_save_of_values_whose_sizes_fail_or_are_missing(tmp_path):
    weights = {"a": _Misstated(np.arange(1 << 20, dtype=np.float32)), "b": np.ones(1 << 19, np.float32), "c": [1.0, 2.0]}
    path = tmp_path / "w.safetensors"
    ws.save(path, weights)
    loaded = ws.load(path)
    np.testing.assert_array_equal(loaded["a"], np.arange(1 << 20, dtype=np.float32))
    np.testing.assert_array_equal(loaded["c"], [1.0, 2.0])
    assert path.stat().st_blocks * 512 <= path.stat().st_size + (64 << 10)


def test_writeback_of_a_missing_file_does_nothing(tmp_path):
    missing = _writeback.Writeback(str(tmp_path / "none"))
    missing.advance(1 << 30)
    missing.close()


@pytest.mark.parametrize("source", [MappedFile, OwnedFile])
def test_readahead_stays_inside_the_file_and_ignores_a_closed_one(tmp_path, small_steps, source):
    data = os.urandom(300_000)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    opened = source(str(path))
    opened.prefetch(0, 1000)
    opened.prefetch(250_000, 50_000)  # the window reaches past the end: clamped
    assert bytes(opened.read_at(250_000, 50_000)) == data[250_000:]
    opened.close()
    opened.prefetch(0, 1000)


def test_readahead_serves_a_cold_npz_restore(tmp_path, small_steps):
    weights = {f"w{i}": np.full(40_000, i, np.float32) for i in range(6)}
    path = tmp_path / "w.npz"
    ws.save(path, weights)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    with ws.open(path) as store:
        for key, value in weights.items():
            np.testing.assert_array_equal(store[key], value)



def _resident(path, offset: int, length: int) -> bool:
    """Whether the page cache holds all of these bytes (``mincore`` on a map of the file, which
    touches nothing; a read told not to wait, ``RWF_NOWAIT``, starts the kernel's read-ahead)."""
    page = mmap.PAGESIZE
    start = offset - offset % page
    pages = (offset + length - start + page - 1) // page
    found = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as handle:
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)  # writable, so ctypes can take its address
        anchor = ctypes.c_char.from_buffer(mapping)
        try:
            failed = _libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor) + start),
                                   ctypes.c_size_t(offset + length - start), found)
        finally:
            del anchor
            mapping.close()
    assert not failed, os.strerror(ctypes.get_errno())
    return all(flag & 1 for flag in found)


_libc = ctypes.CDLL(None, use_errno=True)


@pytest.mark.skipif(sys.platform != "linux", reason="mincore and posix_fadvise as Linux has them")
@pytest.mark.parametrize("piece", [1 << 20, None], ids=["advised", "populated"])
def test_reading_an_npz_reads_ahead_though_its_index_was_read_at_the_end(tmp_path, monkeypatch, piece):
    """Opening an npz reads its directory and manifest at the end of the file; the first tensor
    read must still have the kernel fetch the bytes after it (it once counted the end as announced),
    whether the stretch is advised in pieces (a device of small read-ahead) or faulted into the map."""
    monkeypatch.setattr(_local, "READ_AHEAD", 24 << 20)
    monkeypatch.setattr(_local, "_advice_piece", lambda device: piece)  # whatever the device's setting
    weights = {"a": np.ones(1 << 14, np.float32), "b": np.zeros(8 << 20, np.float32)}  # 64 KiB, then 32 MB
    path = tmp_path / "w.npz"
    ws.save(path, weights)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    far = 16 << 20  # past what the kernel reads around a fault by itself (8 MB on the machine measured)
    if _resident(path, far, 1 << 20):
        pytest.skip("this file system keeps the file cached (tmpfs?)")
    with ws.open(path) as store:
        np.testing.assert_array_equal(store["a"], weights["a"])
        deadline = time.monotonic() + 10
        while not _resident(path, far, 1 << 20) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _resident(path, far, 1 << 20)


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_READ is Linux's")
def test_a_map_populated_ahead_past_an_end_cut_in_place_refuses_the_read_and_lives(tmp_path, monkeypatch):
    """The advisor faults a stretch into the map; where the file was cut in place meanwhile, the
    pages past its new end are refused by the kernel (a touch would have raised SIGBUS and killed
    the process), the advisor stops, and the read refuses cleanly; later maps are still populated."""
    monkeypatch.setattr(_local, "_advice_piece", lambda device: None)  # populate, whatever the device's setting
    data = os.urandom(4 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    opened = MappedFile(str(path))
    assert bytes(opened.read_at(0, 1000)) == data[:1000]  # mapped
    os.truncate(path, 1 << 20)  # in place, as no weightstore writer ever does
    opened.prefetch(2 << 20, 1 << 20)
    opened._wait_populated(2 << 20, 1 << 20)  # the populators are past that stretch
    with pytest.raises(FormatError, match="changed size"):
        opened.check_unchanged("a tensor")
    opened.close()
    assert _local._populates


@pytest.mark.skipif(sys.platform != "linux", reason="MADV_POPULATE_READ is Linux's")
def test_a_read_does_not_wait_for_populators_busy_with_another_file(tmp_path, monkeypatch):
    """The populators are shared by every open file: while both fault in another file's stretch
    (a slow or hung mount), a read of this one faults its own pieces in rather than waiting behind."""
    monkeypatch.setattr(_local, "_advice_piece", lambda device: None)  # populate, whatever the device's setting
    data = os.urandom(4 << 20)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    opened = MappedFile(str(path))
    busy = threading.Event()
    for _ in range(2):
        _local._populators.submit(busy.wait)
    read: list[bytes] = []
    try:
        opened.prefetch(0, 1 << 20)
        reader = threading.Thread(target=lambda: read.append(bytes(opened.read_at(1 << 20, 1 << 20))))
        reader.start()
        reader.join(60)  # only a hang detector: the read returns at once
        assert not reader.is_alive(), "the read waited for the other file's populators"
    finally:
        busy.set()
        opened.close()
    assert read == [data[1 << 20 : 2 << 20]]


@pytest.mark.skipif(sys.platform != "linux", reason="mincore and MADV_POPULATE_READ as Linux has them")
def test_reading_two_tensors_apart_does_not_read_the_file_between_them(tmp_path, monkeypatch):
    """Reading a few tensors announces the stretch they span; the pieces of it the reader passes
    by (the bytes of tensors not asked for) are not faulted in: once, reading the first and the
    last tensor of a checkpoint read every byte of it from the disk. The populators are held busy
    until both reads are done, so every piece is still waiting when the reader passes it."""
    monkeypatch.setattr(_local, "_advice_piece", lambda device: None)  # populate, whatever the device's setting
    path = tmp_path / "w.safetensors"
    ws.save(path, {"a": np.ones(1024, np.float32), "m": np.zeros(64 << 20, np.uint8), "z": np.ones(1024, np.float32)})
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    middle = (24 << 20, 24 << 20)  # well inside "m", past what the kernel reads around a fault itself
    if _resident(path, *middle):
        pytest.skip("this file system keeps the file cached (tmpfs?)")
    busy = threading.Event()
    for _ in range(2):
        _local._populators.submit(busy.wait)
    try:
        with ws.open(path) as store:
            got = store.read(["a", "z"])
            busy.set()
            _local._populators.submit(lambda: None).result()  # every piece before it has run or was dropped
            assert not _resident(path, *middle)
    finally:
        busy.set()
    np.testing.assert_array_equal(got["z"], np.ones(1024, np.float32))
