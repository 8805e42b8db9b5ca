"""Byte shuffle + zstd: the npz codec behind ``compress="shuffle"``.

Trained weights compress poorly byte by byte (the low mantissa bytes are noise), but their
high bytes (sign, exponent, top of the mantissa) repeat: grouping byte 0 of every element,
then byte 1, ... before zstd level 1 gives 1.2x on float32 and 1.45x on bfloat16, where
plain deflate gives 1.08x / 1.28x, and zstd inflates several times faster than deflate.

A tensor is cut into blocks of about 1 MB, each shuffled and compressed on its own: a block
stays in cache between the two steps, both cores decode blocks at once (zstd and numpy's
copy release the GIL), and each block's output size is known before it is decoded, so a
hostile frame cannot make us allocate or write more than the tensor's declared bytes.

Readability: the encoded bytes are not an npy array. The npz member that holds them has its
own suffix and magic, so ``np.load`` lists it as raw bytes and never returns it as an array;
only weightstore decodes it (0-d and empty tensors stay npy members numpy reads). HDF5 files
saved with ``compress="shuffle"`` use HDF5's own shuffle and gzip filters instead: h5py reads them.
"""

from __future__ import annotations

import struct
import threading
from typing import BinaryIO

import numpy as np
import zstandard
from isal import isal_zlib

from weightstore.core import _parallel as parallel
from weightstore.core import checksums as crc
from weightstore.core.limits import MAX_SHUFFLE_BLOCK
from weightstore.errors import FormatError

CODEC = "shuffle-zstd"
MEMBER_SUFFIX = ".shuffled-zstd"
MAGIC = b"\x93WSZSTD\x01"  # not npy's b"\x93NUMPY": np.load hands the member back as bytes
_HEAD = struct.Struct("<8sIIQI")  # magic, item size, block size, data bytes, block count
_BLOCK = 1 << 20
_LEVEL = 1
_WORDS: dict[int, np.dtype] = {2: np.dtype("<u2"), 4: np.dtype("<u4")}  # little-endian: plane 0 is each word's low byte


def _block_size(itemsize: int) -> int:
    return max(itemsize, _BLOCK // itemsize * itemsize)


def _shuffled(block: memoryview, itemsize: int) -> np.ndarray:
    items = np.frombuffer(block, np.uint8).reshape(-1, itemsize)
    if itemsize == 1:
        return items
    planes = np.empty((itemsize, len(items)), np.uint8)
    for byte in range(itemsize):  # a plane at a time: 6x faster than copying the transpose at once
        planes[byte] = items[:, byte]
    return planes


def _unshuffle(plain: bytes, target: np.ndarray, itemsize: int) -> None:
    planes = np.frombuffer(plain, np.uint8).reshape(itemsize, -1)
    word = _WORDS.get(itemsize)
    if word is None:
        items = target.reshape(-1, itemsize)
        for byte in range(itemsize):
            items[:, byte] = planes[byte]
        return
    # Each plane widened into whole words (a plain cast, not a cast inside the shift), shifted
    # to its byte and or-ed in, through scratch reused per thread: 1.15x the shift-with-cast
    # for 4-byte items, 1.3x byte copies into every 4th place; 8-byte words lose to copies.
    words = target.view(word)
    spare = _scratch(len(target)).view(word)[: len(words)]
    words[:] = planes[-1]
    np.left_shift(words, 8 * (itemsize - 1), out=words)
    for byte in range(itemsize - 2, -1, -1):
        spare[:] = planes[byte]
        if byte:
            np.left_shift(spare, 8 * byte, out=spare)
        np.bitwise_or(words, spare, out=words)


def encode(payload: memoryview, itemsize: int, file: BinaryIO) -> tuple[int, int, int]:
    """Write ``payload`` encoded at ``file``'s position.

    Returns the CRC-32 of the plain bytes (the manifest's), the CRC-32 of the encoded bytes
    (the zip directory's), and the number of encoded bytes. Both CRCs are taken block by block
    while the block is in cache. The block table is written last, over its placeholder, so no
    frame is held after it is written.
    """
    size = _block_size(itemsize)
    count = -(-len(payload) // size)
    compressor = zstandard.ZstdCompressor(level=_LEVEL, write_content_size=True)
    begin = file.tell()
    head = _HEAD.pack(MAGIC, itemsize, size, len(payload), count)
    file.write(head + b"\0" * (4 * count))
    lengths, plain_crc, frames_crc = [], 0, 0
    for start in range(0, len(payload), size):
        block = payload[start : start + size]
        plain_crc = crc.crc32(block, plain_crc)
        frame = compressor.compress(_shuffled(block, itemsize).data)
        frames_crc = isal_zlib.crc32(frame, frames_crc)
        lengths.append(len(frame))
        file.write(frame)
    table = struct.pack(f"<{count}I", *lengths)
    file.seek(begin + len(head))
    file.write(table)
    file.seek(begin + len(head) + len(table) + sum(lengths))
    stored_crc = isal_zlib.crc32_combine(isal_zlib.crc32(head + table), frames_crc, sum(lengths))
    return plain_crc & 0xFFFFFFFF, stored_crc & 0xFFFFFFFF, len(head) + len(table) + sum(lengths)


def max_encoded_size(nbytes: int) -> int:
    """The most bytes an honest encoding of ``nbytes`` takes: zstd's worst case per block, plus the table."""
    count = -(-nbytes // _BLOCK) + 1
    return _HEAD.size + 4 * count + nbytes + count * (_BLOCK // 128 + 64)


_local = threading.local()


def decompressor() -> zstandard.ZstdDecompressor:
    """One per thread: a decompressor is not thread-safe, and making one per block costs."""
    found = getattr(_local, "decompressor", None)
    if found is None:
        found = _local.decompressor = zstandard.ZstdDecompressor()
    return found


def _scratch(nbytes: int) -> np.ndarray:
    """Unshuffle scratch, kept per thread for blocks of the size we write (a fresh megabyte
    per block is a fresh page-faulted megabyte); a larger block gets its own."""
    found = getattr(_local, "scratch", None)
    if found is not None and len(found) >= nbytes:
        return found
    if nbytes > _BLOCK:
        return np.empty(nbytes, np.uint8)
    found = _local.scratch = np.empty(_BLOCK, np.uint8)
    return found


def decode(blob: memoryview, itemsize: int, nbytes: int, path: str, key: str) -> tuple[np.ndarray, int]:
    """The plain bytes of tensor ``key``'s encoded member in file ``path``, as a new uint8 array
    of exactly ``nbytes``, and their CRC-32 (taken block by block as each is decoded, while it is
    in cache).

    Every size is checked against ``nbytes`` (from the manifest, already bounded by the
    caller) and the member's own length before anything is allocated or decoded.
    """
    if len(blob) < _HEAD.size:
        raise FormatError("is truncated (no shuffle-zstd header)", path=path, key=key)
    magic, stored_itemsize, size, stored_nbytes, count = _HEAD.unpack_from(blob)
    if magic != MAGIC:
        raise FormatError("is not shuffle-zstd data", path=path, key=key)
    if stored_itemsize != itemsize or stored_nbytes != nbytes:
        raise FormatError(f"holds {stored_nbytes} bytes of {stored_itemsize}-byte items; "
                          f"its manifest entry says {nbytes} bytes of {itemsize}-byte items", path=path, key=key)
    if not 0 < size <= MAX_SHUFFLE_BLOCK or size % itemsize or count != -(-nbytes // size):
        raise FormatError(f"has a corrupt shuffle-zstd header ({count} blocks of {size} bytes)", path=path, key=key)
    table_end = _HEAD.size + 4 * count
    if table_end > len(blob):
        raise FormatError("is truncated inside its block table", path=path, key=key)
    lengths = struct.unpack_from(f"<{count}I", blob, _HEAD.size)
    if table_end + sum(lengths) != len(blob):
        raise FormatError("its blocks do not add up to the member's size (truncated or corrupt)", path=path, key=key)
    out = np.empty(nbytes, np.uint8)
    jobs, position = [], table_end
    for index, length in enumerate(lengths):
        start = index * size
        jobs.append((blob[position : position + length], start, min(size, nbytes - start)))
        position += length

    block_crcs = [0] * len(jobs)

    def decode_block(index: int) -> None:
        frame, start, length = jobs[index]
        try:
            if zstandard.frame_content_size(frame) != length:
                raise FormatError(f"block at byte {start} does not declare its {length} bytes (corrupt)",
                                  path=path, key=key)
            plain = decompressor().decompress(frame, max_output_size=length)
        except zstandard.ZstdError as exc:
            raise FormatError(f"is corrupt (zstd: {exc})", path=path, key=key) from None
        if len(plain) != length:
            raise FormatError(f"block at byte {start} decodes to {len(plain)} bytes, not {length}", path=path, key=key)
        target = out[start : start + length]
        _unshuffle(plain, target, itemsize)
        block_crcs[index] = crc.crc32(target.data)

    parallel.for_each(len(jobs), decode_block)
    total = 0
    for (_, _, length), block_crc in zip(jobs, block_crcs, strict=True):
        total = isal_zlib.crc32_combine(total, block_crc, length)
    return out, total & 0xFFFFFFFF
