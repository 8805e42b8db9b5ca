"""CRC-32 of large buffers without holding the GIL, on two cores when they are large.

One core cannot checksum a tensor as fast as memory delivers it (ISA-L reads a tensor
fresh from the page cache at about 20 GB/s here, page faults included). So a buffer of at
least :data:`PARALLEL_BYTES` is cut into :data:`CHUNK_BYTES` chunks checksummed by the
caller and a helper thread (:func:`weightstore.core._parallel.for_each`), and the chunk CRCs are
joined with ``crc32_combine``: the same CRC-32 as one pass, only the work is split.

The chunks go through ISA-L's ``crc32_gzip_refl``, from the library the isal package has
already loaded, called through ctypes, which releases the GIL for the call
(``isal_zlib.crc32`` holds it; ``zlib.crc32`` releases it but is about 8x slower). Where
the library does not export that symbol, every CRC runs on the caller's thread through
``isal_zlib.crc32``, as before.

**Which of ISA-L's kernels.** Its dispatcher takes the 256-bit VPCLMULQDQ kernel
(``crc32_gzip_refl_avx2``) only where the CPU also reports GFNI and VAES, which that kernel
never executes (it holds AVX2 and VPCLMULQDQ instructions only); a CPU or VM without them
(the AMD EPYC VM the benchmarks ran on) got the 128-bit ``by8`` kernel: 0.096 CPU-s/GB, the
whole of a durable safetensors save's CPU beyond ``save_file``'s (0.30-0.37). So where Linux
reports AVX2 and VPCLMULQDQ and no AVX-512 (a CPU with AVX-512 is left to the dispatcher, whose
AVX-512 kernel asks for a whole set of its extensions), we call the AVX2 kernel by name: 0.060
CPU-s/GB there (:func:`_kernel_name`). It is checked against ``isal_zlib.crc32`` once before
its first use, and left for the dispatcher's choice if it ever disagrees (:func:`_agrees`).

**CRC-64** (:func:`crc64`): ISA-L's ``crc64_ecma_refl`` (CRC-64/XZ), from the same library and
called the same way, for a sharded member's *change digests*: a second, independent check
beside the blocks' CRC-32s that a follower compares to skip what did not change
(docs/sharded.md, Followers), at 0.04 CPU-s/GB where BLAKE3 takes 0.26. Checked against the
standard check value once; where the library lacks it or disagrees, :func:`crc64` says None.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
from collections.abc import Callable

import numpy as np
from isal import isal_zlib

from weightstore.core import _parallel as parallel

#: below this a buffer is checksummed by ``isal_zlib.crc32``: the ctypes call and the
#: address lookup cost more than the GIL held for this long (about 3 us)
RELEASE_GIL_BYTES = 64 << 10
#: from this size on a buffer is split across threads. Tensors read fresh from the page
#: cache here (``benchmarks/split_bench`` timing): break-even at 1 MB, 1.18x faster at 2 MB, 1.3x
#: at 4 MB, 1.4-1.7x from 8 MB; at 256 KB the hand-off (30-50 us) makes it 1.7x slower
PARALLEL_BYTES = 2 << 20
#: work claimed by one thread at a time (a buffer under two is halved): small enough that
#: the threads finish close together, large enough that the per-chunk cost is noise
CHUNK_BYTES = 2 << 20

_CRC_FN = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint64)
_CRC64_FN = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64)
#: CRC-64/XZ of b"123456789", the catalogue's check value
_CRC64_CHECK = 0x995DC9BBDF1939FA


@functools.lru_cache(maxsize=1)
def _isal_crc() -> Callable[[int, int, int], int] | None:
    """ISA-L's CRC-32 entry point, ``(crc, address, length) -> crc``; None where not exported."""
    try:
        library = ctypes.CDLL(isal_zlib.__file__)
    except OSError:
        return None
    for name in dict.fromkeys((_kernel_name(), "crc32_gzip_refl")):
        with contextlib.suppress(AttributeError):  # an ISA-L without the AVX2 kernel: its dispatcher's choice
            kernel = _CRC_FN((name, library))
            if _agrees(kernel):
                return kernel
    return None


@functools.lru_cache(maxsize=1)
def _isal_crc64() -> Callable[[int, int, int], int] | None:
    """ISA-L's CRC-64/XZ entry point, ``(crc, address, length) -> crc``; None where not exported
    or where it does not give the check value (continued across a split, as :func:`crc64` uses it)."""
    try:
        kernel = _CRC64_FN(("crc64_ecma_refl", ctypes.CDLL(isal_zlib.__file__)))
    except (OSError, AttributeError):
        return None
    data = np.frombuffer(b"123456789", np.uint8)
    address = data.ctypes.data
    return kernel if kernel(kernel(0, address, 4), address + 4, 5) == _CRC64_CHECK else None


def crc64(view: memoryview) -> int | None:
    """CRC-64/XZ of a flat, contiguous byte view, on the caller's thread with the GIL let go
    (a caller that wants it beside other work runs it on the helper thread); None where
    ISA-L's is not available (see the module docstring)."""
    native = _isal_crc64()
    if native is None:
        return None
    return int(native(0, np.frombuffer(view, np.uint8).ctypes.data, len(view)))


def _agrees(kernel: Callable[[int, int, int], int]) -> bool:
    """Whether ``kernel`` gives ``isal_zlib.crc32``'s CRCs, from odd offsets, over lengths on
    both sides of its block sizes and continued: a kernel called by name is checked once before
    any file is written with it, so another ISA-L's contract can never write a wrong CRC."""
    data = np.frombuffer(bytes(range(256)) * 260, np.uint8)
    address = data.ctypes.data
    for start, length, crc in ((0, 0, 0), (1, 1, 0), (1, 255, 0), (3, 4099, 7), (1, 65539, 0xFFFFFFFF)):
        expected = isal_zlib.crc32(data[start:start + length].tobytes(), crc) & 0xFFFFFFFF
        if kernel(crc, address + start, length) != expected:
            return False
    return True


def _kernel_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """``crc32_gzip_refl_avx2`` where the CPU's flags (Linux's ``/proc/cpuinfo``, which lists
    AVX2 only where the kernel enabled its registers) have AVX2 and VPCLMULQDQ but not AVX-512,
    else ``crc32_gzip_refl`` (ISA-L's dispatcher: see the module docstring)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError), open(cpuinfo) as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.partition(":")[2].split())
                    if {"avx", "avx2", "pclmulqdq", "vpclmulqdq"} <= flags and "avx512f" not in flags:
                        return "crc32_gzip_refl_avx2"
                    break
    return "crc32_gzip_refl"


def crc32(view: memoryview, crc: int = 0) -> int:
    """CRC-32 of a flat, contiguous byte view, continuing ``crc``."""
    size = len(view)
    native = _isal_crc() if size >= RELEASE_GIL_BYTES else None
    if native is None:
        return isal_zlib.crc32(view, crc) & 0xFFFFFFFF
    address = np.frombuffer(view, np.uint8).ctypes.data  # the view stays alive, so does its memory
    if size < PARALLEL_BYTES:
        return native(crc, address, size)
    step = min(CHUNK_BYTES, -(-size // 2))
    count = -(-size // step)
    chunk_crcs = [0] * count

    def chunk(index: int) -> None:
        start = index * step
        chunk_crcs[index] = native(0, address + start, min(step, size - start))

    parallel.for_each(count, chunk)
    return joined(chunk_crcs, step, size, crc)


def joined(crcs: list[int], block_bytes: int, size: int, crc: int = 0) -> int:
    """CRC-32 of ``size`` bytes, continuing ``crc``, from the CRC-32s of their blocks of
    ``block_bytes`` (the last one shorter), with ``crc32_combine``: 0.2 us a block, not another
    pass over the bytes. What a sharded member's writer records as each stored tensor's CRC-32,
    from the block CRC-32s its block table holds anyway."""
    if not crcs:
        return crc & 0xFFFFFFFF
    combine = isal_zlib.crc32_combine
    for block_crc in crcs[:-1]:
        crc = combine(crc, block_crc, block_bytes)
    return combine(crc, crcs[-1], size - (len(crcs) - 1) * block_bytes) & 0xFFFFFFFF
