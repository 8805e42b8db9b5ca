"""Checksums split across threads: the same CRC-32 as one pass, and the work really is shared."""

from __future__ import annotations

import ctypes
import io
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from isal import isal_zlib

import weightstore as ws
from weightstore.core import _parallel as parallel
from weightstore.core import checksums as crc
from weightstore.core.manifest import checksum, crc32
from weightstore.errors import ChecksumError, FormatError
from weightstore.formats import _shuffle_zstd

DATA = Path(__file__).resolve().parent / "data"
GOLDEN = [f"golden_v{version}{suffix}" for version in (1, 2)
          for suffix in (".npz", "_compressed.npz", ".h5", "_compressed.h5", "_shuffled.npz")] + ["plain_numpy.npz"]


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Every buffer above a few bytes takes the threaded path, in chunks that do not divide it."""
    monkeypatch.setattr(crc, "RELEASE_GIL_BYTES", 1)
    monkeypatch.setattr(crc, "PARALLEL_BYTES", 64)
    monkeypatch.setattr(crc, "CHUNK_BYTES", 48)


@pytest.fixture
def for_each_calls(monkeypatch) -> list[int]:
    """The job counts :func:`parallel.for_each` was asked to share (it still runs for real)."""
    calls: list[int] = []
    real = parallel.for_each

    def recording(count, job):
        calls.append(count)
        return real(count, job)

    monkeypatch.setattr(parallel, "for_each", recording)
    return calls


def random_bytes(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


@pytest.mark.parametrize("size", [0, 1, 47, 48, 63, 64, 65, 96, 1000, 4099])
def test_crc_of_split_chunks_equals_the_whole(tiny_chunks, size):
    data = random_bytes(size, seed=size)
    assert crc.crc32(memoryview(data)) == zlib.crc32(data)
    assert crc.crc32(memoryview(data), 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF)  # continuing a CRC


@pytest.mark.parametrize("size", [crc.RELEASE_GIL_BYTES - 1, crc.PARALLEL_BYTES - 1, crc.PARALLEL_BYTES,
                                  crc.PARALLEL_BYTES + crc.CHUNK_BYTES // 2 + 3])
def test_crc_at_the_real_thresholds_equals_zlib(size):
    data = random_bytes(size, seed=size)
    assert crc.crc32(memoryview(data)) == zlib.crc32(data)
    assert crc32(data.view(np.float32) if size % 4 == 0 else data) == zlib.crc32(data)


@pytest.mark.parametrize("kernel", ["crc32_gzip_refl", "crc32_gzip_refl_avx2"])
def test_each_isal_kernel_equals_zlib_at_every_length_and_alignment(kernel):
    """The kernel called by name where ISA-L's dispatcher would not pick it gives zlib's CRC-32
    for short tails, odd starts and a continued CRC alike (skipped where the CPU lacks it)."""
    if kernel != "crc32_gzip_refl" and crc._kernel_name() != kernel:
        pytest.skip(f"this CPU takes {crc._kernel_name()}")
    native = crc._CRC_FN((kernel, ctypes.CDLL(isal_zlib.__file__)))
    data = random_bytes(70_000, seed=7)
    for size in [*range(0, 260, 7), 511, 512, 513, 4099, 65_536, 69_000]:
        for start in (0, 1, 15, 33):
            piece = data[start : start + size]
            for initial in (0, 0xDEADBEEF):
                assert native(initial, piece.ctypes.data, piece.nbytes) == zlib.crc32(piece, initial), (size, start)


@pytest.mark.parametrize(("flags", "kernel"), [
    ("fpu sse4_2 pclmulqdq avx avx2 vaes vpclmulqdq", "crc32_gzip_refl_avx2"),  # no GFNI: by8 by ISA-L's choice
    ("fpu sse4_2 pclmulqdq avx avx2", "crc32_gzip_refl"),  # no VPCLMULQDQ
    ("fpu sse4_2 pclmulqdq avx avx2 avx512f gfni vaes vpclmulqdq", "crc32_gzip_refl"),  # left to ISA-L's dispatcher
])
def test_the_avx2_kernel_only_where_the_cpu_has_it_and_isal_would_not_pick_better(tmp_path, flags, kernel):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert crc._kernel_name(str(cpuinfo)) == (kernel if sys.platform.startswith("linux") else "crc32_gzip_refl")
    assert crc._kernel_name(str(tmp_path / "missing")) == "crc32_gzip_refl"


def test_a_kernel_that_disagrees_with_isal_zlib_is_never_used():
    """A kernel called by name is checked once before any CRC is taken with it: one whose
    contract differs (here: the CRC not inverted, or off by one byte) is refused."""
    real = crc._CRC_FN(("crc32_gzip_refl", ctypes.CDLL(isal_zlib.__file__)))
    assert crc._agrees(real)
    assert not crc._agrees(lambda initial, address, length: real(initial, address, length) ^ 0xFFFFFFFF)
    assert not crc._agrees(lambda initial, address, length: real(initial, address, max(0, length - 1)))


def test_threaded_path_only_above_the_threshold(for_each_calls):
    crc.crc32(memoryview(random_bytes(crc.PARALLEL_BYTES - 1)))
    assert for_each_calls == []  # a small tensor pays no hand-off
    crc.crc32(memoryview(random_bytes(crc.PARALLEL_BYTES + 1)))
    assert len(for_each_calls) == 1 and for_each_calls[0] >= 2  # one call, work for two threads


def test_large_tensor_loads_verified_through_the_threaded_path(tmp_path, tiny_chunks, for_each_calls):
    path = tmp_path / "m.npz"
    original = {"kernel": np.arange(3000, dtype=np.float32).reshape(30, 100), "bias": np.ones(3, np.float32)}
    ws.save(path, original)
    loaded = ws.load(path)
    assert loaded["kernel"].tobytes() == original["kernel"].tobytes()
    assert -(-original["kernel"].nbytes // 48) in for_each_calls


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_files_verify_through_the_threaded_path(tiny_chunks, for_each_calls, name):
    verified = ws.load(DATA / name, verify=True)  # a split CRC that differed would be a ChecksumError
    assert any(count > 1 for count in for_each_calls)
    unverified = ws.load(DATA / name, verify=False)
    assert {k: v.tobytes() for k, v in verified.items()} == {k: v.tobytes() for k, v in unverified.items()}


def test_golden_checksums_are_unchanged_when_split(tiny_chunks):
    """The manifest's own checksums (written by an old version) against the split CRC of each tensor."""
    with ws.open(DATA / "golden_v1.npz", verify=False) as store:
        for key in store:
            assert checksum(store[key]) == store.info(key).checksum, key


def test_damage_in_a_late_chunk_is_caught_naming_file_and_key(tmp_path, tiny_chunks):
    path = tmp_path / "m.npz"
    kernel = np.arange(3000, dtype=np.float32)
    ws.save(path, {"dense/kernel": kernel})
    data = bytearray(path.read_bytes())
    at = data.find(kernel[-10:].tobytes())  # inside the last of 250 chunks
    assert at > 0
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"m\.npz.*dense/kernel"):
        ws.load(path)


def test_a_helper_shares_the_work():
    """Job 0 waits until job 1 has run: only a second thread can run job 1 meanwhile."""
    ran_on: dict[int, int] = {}
    second_ran = threading.Event()

    def job(index: int) -> None:
        ran_on[index] = threading.get_ident()
        if index == 0:
            assert second_ran.wait(timeout=30), "no helper took job 1"
        else:
            second_ran.set()

    parallel.for_each(2, job)
    assert ran_on[0] != ran_on[1]


def test_every_job_runs_once_and_all_finish_before_return():
    counts = [0] * 500
    lock = threading.Lock()

    def job(index: int) -> None:
        with lock:
            counts[index] += 1

    parallel.for_each(len(counts), job)
    assert counts == [1] * 500


def test_first_failure_is_raised_after_running_jobs_finish():
    started, finished = threading.Event(), threading.Event()
    caller = threading.get_ident()

    def job(index: int) -> None:
        if threading.get_ident() == caller:
            assert started.wait(timeout=30), "no helper took job 1"
            raise FormatError("m.npz: block 0 is corrupt")
        started.set()
        finished.wait(0.2)  # still running on the helper when the caller's job fails
        finished.set()

    with pytest.raises(FormatError, match="block 0"):
        parallel.for_each(2, job)
    assert finished.is_set()  # the helper's job was waited for, not left running


def test_nested_sharing_does_not_deadlock():
    inner = [0] * 8

    def outer(index: int) -> None:
        def job(j: int) -> None:
            inner[j] += 1

        if index == 0:
            parallel.for_each(8, job)  # its helper is busy with outer job 1, or free: either way it finishes

    parallel.for_each(2, outer)
    assert inner == [1] * 8


def test_a_job_beside_runs_once_on_the_caller_while_the_helper_is_busy():
    release, busy = threading.Event(), threading.Event()
    hold = parallel.beside(lambda: (busy.set(), release.wait(10)))  # occupies the one helper
    busy.wait(10)
    runs: list[str] = []
    job = parallel.beside(lambda: runs.append(threading.current_thread().name) or len(runs))
    assert job.result() == 1  # not started by the busy helper: the caller ran it, without waiting
    assert runs == [threading.current_thread().name]
    release.set()
    hold.result()
    assert runs == [threading.current_thread().name]  # the helper never ran it too


def test_a_job_beside_that_fails_raises_from_result():
    def fail() -> None:
        raise ValueError("broken hash")

    with pytest.raises(ValueError, match="broken hash"):
        parallel.beside(fail).result()


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_shuffled_blocks_decode_in_parallel_exactly(itemsize):
    plain = random_bytes(3 * (1 << 20) + 24, seed=itemsize)  # three whole blocks and a short one
    encoded = _encode(plain, itemsize)
    out, plain_crc = _shuffle_zstd.decode(encoded, itemsize, len(plain), "m.npz", "k")
    assert out.tobytes() == plain.tobytes()
    assert plain_crc == zlib.crc32(plain)


def test_corrupt_block_decoded_by_a_helper_names_file_and_key():
    plain = random_bytes(4 << 20, seed=9)
    encoded = bytearray(_encode(plain, 4))
    last_frame = len(encoded) - struct.unpack_from("<4I", encoded, 28)[-1]
    encoded[last_frame : last_frame + 4] = b"\0\0\0\0"  # no zstd magic: the helper may well be the one to find it
    with pytest.raises(FormatError, match=r"m\.npz: tensor 'k'"):
        _shuffle_zstd.decode(memoryview(encoded), 4, len(plain), "m.npz", "k")


def _encode(plain: np.ndarray, itemsize: int) -> memoryview:
    file = io.BytesIO()
    _shuffle_zstd.encode(memoryview(plain), itemsize, file)
    return file.getbuffer()


FORKED_CHILD = """
import os, threading, zlib
from weightstore.core import checksums as crc
from weightstore.core import _parallel as parallel

parallel.for_each(2, lambda index: None)  # the parent's pool and its thread exist before the fork
pid = os.fork()
if pid == 0:  # the child: exit 0 only if a second thread ran job 1 while job 0 waited for it
    second_ran, waited = threading.Event(), []

    def job(index):
        if index == 0:
            waited.append(second_ran.wait(timeout=10))
        else:
            second_ran.set()

    parallel.for_each(2, job)
    data = b"x" * (crc.PARALLEL_BYTES + 5)
    os._exit(0 if waited == [True] and crc.crc32(memoryview(data)) == zlib.crc32(data) else 1)
_, status = os.waitpid(pid, 0)
raise SystemExit(os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_gets_its_own_helper():
    """A child inherits the pool object but not its thread: it must start a helper of its own
    (a data-loader worker would otherwise check every tensor on one core, or hang waiting).

    The fork happens in a fresh interpreter holding only weightstore's own helper thread: the
    test process may run TensorFlow's and JAX's threads, which a fork must not copy mid-work."""
    done = subprocess.run([sys.executable, "-c", FORKED_CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("size, block", [(0, 8), (1, 8), (8, 8), (9, 8), (64, 8), (1000, 64), (65, 64)])
@pytest.mark.parametrize("start", [0, 0x1234ABCD])
def test_a_crc_joined_from_block_crcs_is_the_crc_of_the_bytes(size, block, start):
    """What a sharded member records as a tensor's CRC-32 (joined from its block table's CRC-32s,
    the last block shorter, continuing a CRC) is exactly zlib's CRC-32 of its bytes."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    crcs = [zlib.crc32(data[at : at + block]) for at in range(0, size, block)]
    assert crc.joined(crcs, block, size, start) == zlib.crc32(data, start)
