"""Delta versions: a version file that holds what changed since the version before it.

A trainer that publishes every optimizer step changes a small part of each tensor's bytes
(about 2% of a bf16 model's elements per RL step), but a full version moves all of them. A
delta version (``step-000000000043.wsdelta``) names its *base* (the previous version's file,
beside it) and stores each tensor as one of:

- ``same``: the base's bytes, unchanged (no payload);
- ``xor-zstd``: the XOR of the new and the base's raw little-endian bytes, in blocks of
  :data:`BLOCK` bytes, each byte-planed (byte 0 of every element, then byte 1, ...: the high
  bytes of the XOR of close values are mostly zeros, the low ones noise that zstd's entropy
  coder alone handles; 0.55x of an fp32 Adam step where the unplaned XOR took 0.64x) and a zstd
  frame (level 1; -1 where most elements changed) that declares its size;
- ``xor-top`` (a dense change, :func:`encode` ``dense=True``, items of 2-16 bytes): as
  ``xor-zstd`` (at level -4), but each block's frame holds every plane but the top one (sign and
  the exponent's high bits: 95-99% zeros in an fp32 Adam step), which follows the frame as a
  :func:`_top_record` (planes that are noise: a frame of zstd's stored blocks, :func:`_noise`); a block table of two lengths per block (frame, record). The codec is
  recorded per tensor: a reader picks its decoder by it; a file that holds one is of head
  version 2, which a reader from before it refuses as newer than it;
- ``sparse``: the positions (``<u4``, or ``<u8`` past 2**32 elements) of the elements that
  changed, as gaps, and the XOR of each with the base's, both byte-planed and zstd-compressed;
- ``raw``: the new bytes as they are (a tensor the base lacks, or one that changed whole).

whichever is smallest. The manifest is weightstore's own (:mod:`weightstore.core.manifest`) and
describes the *resulting* tensors: dtype, shape, CRC-32 and BLAKE3 digest of the bytes a reader
rebuilds, so a reader proves that anchor + chain rebuilt exactly what the trainer had. The base
may itself be a delta; the chain ends at a full version (an *anchor*: npz, HDF5 or safetensors).

Layout, all integers little-endian::

    magic "\\x93WSDELTA" | u64 head bytes | u64 entries bytes | u64 manifest bytes
    head JSON     {"format": "weightstore-delta", "version": 1 or 2, "step", "base", "chain",
                   "chain_bytes", "full_bytes", "block", "manifest_crc"}
    entries JSON  {"codec": [...], "offset": [...], "length": [...]}  (manifest key order)
    manifest JSON (weightstore's manifest of the resulting tensors, user metadata)
    payloads      (offsets relative to here)

``chain`` lists the base, its base, ... down to the anchor (what retention must keep);
``chain_bytes`` adds up the payload bytes of the deltas since the anchor, this one included
(what decides the next anchor). ``manifest_crc`` is the manifest's CRC-32: no tensor's digest
covers its metadata or creation time, so a changed byte there is found by it at open. It is a
field of the head, not of the manifest, because readers before it ignore a head field they do
not know but refuse a manifest field (they read these files as before); a delta written before
it has none and reads unchecked, as it did.

**Hostile input.** Every size is checked against the file's own before anything is allocated:
a zstd frame must declare exactly its block's bytes and is decoded with that as its bound;
positions must be strictly increasing and inside the tensor; the base must be a plain version
name (no folder), of a lower step than the delta's own, so a chain of bases always goes down
and ends (no cycle), at most :data:`MAX_DELTA_CHAIN` deep. A missing or unreadable base is a
:class:`FormatError` naming the version; a chain that does not rebuild the recorded digest a
:class:`ChecksumError` naming the version and the tensor.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import zstandard

from weightstore.core import _jsontext as jsontext
from weightstore.core import _parallel as parallel
from weightstore.core import checksums
from weightstore.core._tensortable import DIGEST_PREFIX, TensorInfo, TensorRow
from weightstore.core.limits import (
    DELTA_BYTES_PER_CONTAINER,
    MAX_DELTA_BLOCK,
    MAX_DELTA_CHAIN,
    MAX_DELTA_ENTRIES_BYTES,
    MAX_DELTA_HEAD_BYTES,
    VERSION_NAME_DIGITS,
)
from weightstore.core.manifest import (
    Manifest,
    build_manifest,
    check_recorded,
    checksum,
    content_digest,
    content_hasher,
    crc32_before_write,
    from_storage,
    parse_manifest,
    storage_dtype,
    to_storage,
)
from weightstore.errors import (
    ChecksumError,
    FileAccessError,
    FormatError,
    SizeLimitError,
    StoreClosedError,
    TargetError,
    UnsafeFileError,
    WeightStoreError,
    naming,
)
from weightstore.formats import Format, Reader, ReaderDefaults, format_for_suffix
from weightstore.formats._pointer import VERSION_NAME
from weightstore.formats._renamed import by_saved_keys
from weightstore.formats._shuffle_zstd import decompressor
from weightstore.io._buffer import aligned_array
from weightstore.io._writeback import Writeback
from weightstore.io.location import service
from weightstore.io.places import Place
from weightstore.io.remote import RemoteFile
from weightstore.io.source import ByteSource, beside, byte_source, open_source, prefetch_ranges

FORMAT_NAME = "weightstore-delta"
SUFFIX = ".wsdelta"
MAGIC = b"\x93WSDELTA"
#: the head's format version: 2 where an entry is :data:`XOR_TOP`, which a reader from before it
#: cannot decode (it then says the file is newer than it, not corrupt); 1 otherwise, so every
#: other delta stays readable by those readers
VERSION = 2
VERSIONS = (1, 2)
_PREFIX = struct.Struct("<8sQQQ")

SAME, RAW, XOR_ZSTD, SPARSE, XOR_TOP = "same", "raw", "xor-zstd", "sparse", "xor-top"
CODECS = (SAME, RAW, XOR_ZSTD, SPARSE, XOR_TOP)

#: bytes XOR-ed and compressed at a time: a block stays in cache between the XOR and zstd, both
#: cores take blocks, and each frame's size is known (and bounded) before it is decoded
BLOCK = 4 << 20
#: zstd's level for a change found by comparing elements first (a sparse or mixed change)
_LEVEL = 1
#: and for a dense one (``encode(dense=True)``: most elements changed, an fp32 step): its low
#: planes are noise that level 1 spends its time failing to shrink; level -1 took a third less
#: CPU for 9% more bytes (fp32 Adam 1e-3: 0.61x a version, not 0.56x), while on a sparse bf16
#: change it costs a third more bytes, so that keeps level 1. With the top plane out of the
#: frame (``xor-top``) what is left matches only where elements did not change: -4 took
#: 0.93-0.95x the encode CPU of -1 for 0.1% more bytes (-10: 0.89-0.92x for 0.4% more)
_TOP_LEVEL = -4
#: the level of a dense change whose top plane stays in the frame (1-byte items, a tensor of at
#: most :data:`_SMALL` bytes): -4 took 3-11% more bytes than -1 for an int8 or small fp32 change
_DENSE_LEVEL = -1
# XOR, not the integer difference of the bit patterns (new - old as int32, wrapping), measured
# on Keras fp32 Adam steps: zigzagged ((d << 1) ^ (d >> 31)) it leaves the
# sign/exponent plane 98.6% zeros where the XOR leaves 96%, for 2-3% fewer bytes, but its three
# more passes per block cost what zstd saves there (encode 0.98-1.09x the XOR's); offset by
# 2**23 instead (one more pass) it took 0.83-0.87x the encode CPU and 0.80-0.86x the decode's
# for 2% fewer bytes, short of the 20% that would pay for a second codec. A top plane all zero
# (worth an "all zero" flag) held 0.1% of the bytes; the noise planes stored raw, 6-14% more
# bytes for 4-16% less CPU. The top plane apart as zstd's huffman-only literals (no way to ask
# zstd for that), or as deflate (ISA-L level 1: 0.4x zstd's CPU there, but 5x its decode): no.
# A C kernel for the XOR and the planes: an fp32 delta publish 0.89x, anchors nothing; not kept.


# -- encoding (the publisher's side) -------------------------------------------------------------

_local = threading.local()


def _compressor(level: int = _LEVEL) -> zstandard.ZstdCompressor:
    """A compressor of ``level`` kept per thread. At level 1, with fixed parameters, those of an
    input of unknown size but a hash table of 2**12 entries (16 KiB, not 64): given the level
    alone, zstd picks them by each input's size and sets its context up again whenever that
    picks others, which a delta's sparse frames (a few KB each, every size) did at almost every
    call; with these they took 0.75x the CPU and 2% fewer bytes, XOR-ed blocks the same CPU and
    bytes. The negative levels keep zstd's choice by size: :func:`_noise` probes 4 KiB slices
    with it."""
    kept = getattr(_local, "compressors", None)
    if kept is None:
        kept = _local.compressors = {}
    found = kept.get(level)
    if found is None:
        if level < 1:
            found = zstandard.ZstdCompressor(level=level, write_content_size=True)
        else:
            fixed = zstandard.ZstdCompressionParameters.from_level(level, hash_log=12, write_content_size=1)
            found = zstandard.ZstdCompressor(compression_params=fixed)
        kept[level] = found
    return found


def _scratch(nbytes: int) -> np.ndarray:
    """A buffer of at least ``nbytes`` kept per thread (at most two blocks): fresh memory for
    every block's XOR cost as much CPU in page faults as zstd took to compress it."""
    found = getattr(_local, "scratch", None)
    if found is not None and len(found) >= nbytes:
        return found
    found = np.empty(nbytes, np.uint8)
    if nbytes <= 2 * BLOCK + 8:
        _local.scratch = found
    return found


_UINTS: dict[int, np.dtype] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def _changed_mask(new: np.ndarray, base: np.ndarray, itemsize: int) -> np.ndarray:
    """Which items of ``itemsize`` bytes differ, compared as words, a block at a time on both cores."""
    word = _UINTS.get(itemsize)
    if word is None:
        return np.asarray((new.reshape(-1, itemsize) != base.reshape(-1, itemsize)).any(axis=1))
    new_words, base_words = new.view(word), base.view(word)
    per_block = BLOCK // itemsize
    if len(new_words) <= per_block:  # one block (most tensors): no job to hand out
        return np.not_equal(new_words, base_words)
    mask = np.empty(len(new_words), bool)

    def block(index: int) -> None:
        span = slice(index * per_block, (index + 1) * per_block)
        np.not_equal(new_words[span], base_words[span], out=mask[span])

    parallel.for_each(-(-len(new_words) // per_block), block)
    return mask


#: a tensor of at least this many bytes is compared as 8-byte words of elements (:func:`_group`)
_GROUPED = 16 << 10


def _group(itemsize: int, nbytes: int) -> int:
    """How many elements :func:`encode` compares as one 8-byte word: of 1-, 2- or 4-byte items
    whose bytes are whole words, at least :data:`_GROUPED` of them, else 1. numpy finds the
    set entries of a mask 2-10% set with a mispredicted branch for each (16 ns: 0.35 ms for a
    768 KB bf16 tensor 5.6% changed, more than zstd took for its frames) and above 12% without
    (0.5 ns an entry): words of four bf16 elements are set 12-25% where the elements are 3-6%,
    and the elements of the set words 25%+."""
    return 8 // itemsize if itemsize in (1, 2, 4) and nbytes % 8 == 0 and nbytes >= _GROUPED else 1


def _changes(new: np.ndarray, base: np.ndarray, itemsize: int, group: int, mask: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
    """The positions (int64, rising) of the elements that differ and the XOR of each (a word,
    or a row of bytes where ``itemsize`` has none), from ``mask``: which words of ``group``
    elements (:func:`_group`) differ."""
    at = mask.nonzero()[0]
    word = _UINTS.get(itemsize)
    if word is None:  # gathered as rows of bytes
        return at, np.bitwise_xor(new.reshape(-1, itemsize)[at], base.reshape(-1, itemsize)[at])
    wide = _UINTS[itemsize * group]
    xored = np.bitwise_xor(new.view(wide).take(at), base.view(wide).take(at))  # take: a third less than [at]
    if group == 1:
        return at, xored
    lanes = xored.view(word)  # each set word's elements, a quarter or more of them changed
    found = np.not_equal(lanes, 0).nonzero()[0]
    shift = group.bit_length() - 1
    positions = at.take(found >> shift)
    positions <<= shift
    positions |= found & (group - 1)
    return positions, lanes.take(found)


def _position_dtype(elements: int) -> np.dtype:
    return np.dtype("<u4") if elements < 1 << 32 else np.dtype("<u8")


@dataclass
class Encoded:
    """One tensor as a delta stores it: its codec and payload (a list of byte buffers)."""

    codec: str
    parts: list[Any]
    #: the CRC-32 of the tensor's new bytes where the encode took it in passing (XOR-ed in
    #: blocks: each block's while that block is in cache for the XOR), else ``None``
    crc: int | None = None
    #: whether making it wrote into ``base`` (``spend=True``, an XOR in blocks was made): those
    #: bytes are no longer the base's, whichever codec was kept
    spent: bool = False
    #: the payload's bytes, added up once: a plan asks it of every tensor several times
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = sum(memoryview(part).nbytes for part in self.parts)


def encode(new: np.ndarray, base: np.ndarray | None, itemsize: int, *, dense: bool = False,
           sparse: bool = True, spend: bool = False) -> Encoded:
    """``new`` (a tensor's stored bytes, uint8, C-contiguous) against ``base`` (the base
    version's bytes of the same tensor, same dtype and shape; ``None`` when it has none): the
    smallest of :data:`SAME`, :data:`XOR_ZSTD`, :data:`SPARSE` and :data:`RAW`.

    A first pass compares the elements as words (8-byte words of them where they fill whole
    ones: :func:`_group`), block by block on both cores (numpy releases the GIL). Where at most
    :data:`SPARSE_DENSITY` of them changed, the sparse form is made of those (:func:`_changes`);
    XOR + zstd (block by block, the XOR never held whole) is then tried only where the sparse
    form takes more than two bytes per changed element: XOR + zstd took 2.2-2.4 where the
    sparse form took 1.2 (bf16, 2-3.7% changed), and costs most of a publish's CPU (0.7 s/GB).
    ``dense`` (an :func:`estimate` found most elements changed) skips the first pass: XOR + zstd,
    the top plane apart (:data:`XOR_TOP`).
    ``sparse=False`` (the tensor's last delta was XOR + zstd) does not try the sparse form
    above :data:`SPARSE_ALWAYS` of the elements: an fp32 step's changed elements cost more
    than two bytes each in it, so it was made for nothing (0.24 s/GB of an fp32 Adam step, a
    tensor 12% changed).
    ``spend=True``: ``base`` is the caller's own copy, not needed once this returns (a
    publisher's remembered version): the XOR's frames are moved into its memory as they are
    made (:func:`_spend`), so the result may be views of ``base``.
    """
    nbytes = len(new)
    if base is None or not nbytes:  # an empty tensor: nothing to compare, and RAW costs no bytes
        return Encoded(RAW, [new])
    if dense:
        top = nbytes > _SMALL and _plane_size(itemsize, BLOCK) > 1
        xor = _xor_zstd(new, base, [1] * -(-nbytes // BLOCK), itemsize, _TOP_LEVEL if top else _DENSE_LEVEL, top=top,
                        spend=spend)
        return xor if xor.nbytes < nbytes else Encoded(RAW, [new], xor.crc, xor.spent)
    elements = nbytes // itemsize if itemsize else 0
    group = _group(itemsize, nbytes)
    mask = _changed_mask(new, base, itemsize * group)
    words = int(np.count_nonzero(mask))  # at most ``group`` changed elements each
    if not words:
        return Encoded(SAME, [])
    most = elements * (SPARSE_DENSITY if sparse else SPARSE_ALWAYS)
    found = _changes(new, base, itemsize, group, mask) if words <= most else None
    total = words if found is None else len(found[0])
    best = _sparse(*found, itemsize, elements) if found is not None and total <= most else None
    if best is None or best.nbytes > 2 * total:
        per_block = BLOCK // (itemsize * group)
        changed = [words] if len(mask) <= per_block else [
            int(np.count_nonzero(mask[start : start + per_block])) for start in range(0, len(mask), per_block)]
        xor = _xor_zstd(new, base, changed, itemsize, spend=spend)
        if best is None or xor.nbytes < best.nbytes:
            best = xor
        best.crc, best.spent = xor.crc, xor.spent
    return best if best.nbytes < nbytes else Encoded(RAW, [new], best.crc, best.spent)


#: the most changed elements (a fraction) for which the sparse form is tried
SPARSE_DENSITY = 0.25
#: ... and with ``sparse=False``: a tensor XOR-ed last step whose change became small again (a
#: bf16 step of 2%: 1.9 bytes per changed element sparse, 2.9 XOR-ed) returns to the sparse form
SPARSE_ALWAYS = 0.05

#: the share of a tensor's bytes :func:`estimate` encodes, in slices of :data:`_SLICE` bytes spread over it
SAMPLE_FRACTION = 1 / 32
_SLICE = 4096


@dataclass
class Estimate:
    """What :func:`estimate` found of one tensor."""

    #: about how many bytes :func:`encode` makes of it
    nbytes: int
    #: the codec the sample took
    codec: str
    #: the tensor's encoding itself, when it was small enough to encode whole
    encoded: Encoded | None = None


def estimate(new: np.ndarray, base: np.ndarray | None, itemsize: int) -> Estimate:
    """:func:`encode` of slices spread over the tensor (:data:`SAMPLE_FRACTION` of its bytes),
    scaled to its size; a tensor of at most 32 slices (128 KiB) is encoded whole instead. A publisher asks this
    of every tensor before it encodes any, so a step whose delta will not pay (an fp32 step, its
    chain near a full version's bytes) costs a thirty-second of an encode, not the encode of the
    tensors before the chain overflows (60% of them)."""
    nbytes = len(new)
    if base is None or not itemsize:
        return Estimate(nbytes, RAW)
    width = max(itemsize, _SLICE // itemsize * itemsize)
    if nbytes * SAMPLE_FRACTION <= width:  # its sample would be one slice: encoded whole, no work done twice
        whole = encode(new, base, itemsize)
        return Estimate(whole.nbytes, whole.codec, whole)
    count = max(1, int(nbytes * SAMPLE_FRACTION) // width)
    starts = (np.linspace(0, nbytes - width, count) // itemsize).astype(np.int64) * itemsize
    new_part = np.concatenate([new[start : start + width] for start in starts.tolist()])
    base_part = np.concatenate([base[start : start + width] for start in starts.tolist()])
    sample = encode(new_part, base_part, itemsize)
    return Estimate(min(nbytes, sample.nbytes * nbytes // len(new_part)), sample.codec)


def _planes(values: np.ndarray, size: int) -> np.ndarray:
    """``values`` (``size``-byte items) as byte planes, byte 0 of every item first: the high
    bytes of small gaps and of XORs of close values are zeros zstd makes nothing of. Items held
    as words are split by :func:`_split_planes`."""
    planes = np.empty((size, len(values)), np.uint8)
    word = _UINTS.get(size)
    if size > 1 and word is not None and values.dtype == word and values.ndim == 1:
        _split_planes(values, planes)
    else:
        planes[:] = values.view(np.uint8).reshape(-1, size).T
    return planes


def _sparse(positions: np.ndarray, values: np.ndarray, itemsize: int, elements: int) -> Encoded:
    """Positions (as gaps, each position minus the one before, the first plus one) and the XOR of
    each changed element (:func:`_changes`), each byte-planed and compressed: ``<QQQ`` count and
    the two frames' lengths, then the frames."""
    gaps = np.empty(len(positions), _position_dtype(elements))  # np.diff(positions, prepend=-1), in place: a tenth the calls
    gaps[0] = positions[0] + 1
    np.subtract(positions[1:], positions[:-1], out=gaps[1:], casting="unsafe")
    gap_frame = _compressor().compress(_planes(gaps, gaps.itemsize).data)
    value_frame = _compressor().compress(_planes(values, itemsize).data)
    return Encoded(SPARSE, [struct.pack("<QQQ", len(positions), len(gap_frame), len(value_frame)), gap_frame,
                            value_frame])


def _plane_size(itemsize: int, block: int) -> int:
    """How many byte planes an xor-zstd block of ``itemsize``-byte elements is split into (1: none)."""
    return itemsize if 1 < itemsize <= 16 and block % itemsize == 0 else 1


def _split_planes(words: np.ndarray, planes: np.ndarray) -> None:
    """``words`` (little-endian unsigned integers, left as they are) split into byte ``planes``
    (one row per byte, the low byte first): each plane is the words shifted down to that byte,
    cast to bytes as it is stored. Contiguous casts and shifts run on SIMD, where copying a
    strided column of bytes moves one at a time: 0.41 s/GB against 0.56 for 4-byte items, 0.25
    against 0.53 for 2. Shifted into each plane, not the words shifted in place a byte at a
    time and each copied (two passes a plane, not one): 0.78x the CPU for a 4 MiB block of
    4-byte items (an fp32 step's XOR), and no copy of words that must stay as they are."""
    np.copyto(planes[0], words, casting="unsafe")  # the low byte: an unsafe cast truncates
    for byte in range(1, len(planes)):
        np.right_shift(words, 8 * byte, out=planes[byte], casting="unsafe")


#: a tensor of at most this many bytes is XOR-ed by :func:`_xor_zstd` as Python integers and bytes:
#: numpy's dozen calls per block cost more than that and zstd's compression of it together
_SMALL = 2 << 10
_ONE_FRAME = struct.Struct("<II")


def _xor_zstd(new: np.ndarray, base: np.ndarray, changed: list[int], itemsize: int, level: int = _LEVEL, *,
              top: bool = False, spend: bool = False) -> Encoded:
    """The XOR in blocks of :data:`BLOCK` bytes, each byte-planed and a zstd frame of ``level``
    (an unchanged block's: one of zeros). ``top`` (a dense change, every block XOR-ed): each
    block's top plane is kept out of its frame as a :func:`_top_record`, an :data:`XOR_TOP` entry.
    ``spend``: each block's frame and record are moved into ``base``'s bytes of that block
    once it is XOR-ed (:func:`_spend`)."""
    nbytes, count, size = len(new), len(changed), _plane_size(itemsize, BLOCK)
    if nbytes <= _SMALL:  # one block, XOR-ed and planed as Python bytes: the same frame, a third of the calls
        xor = (int.from_bytes(new.data, "little") ^ int.from_bytes(base.data, "little")).to_bytes(nbytes, "little")
        if size > 1:
            xor = b"".join([xor[byte::size] for byte in range(size)])
        frame = _compressor(level if changed[0] else _LEVEL).compress(xor)
        return Encoded(XOR_ZSTD, [_ONE_FRAME.pack(1, len(frame)), frame])
    top = top and size > 1

    def block(index: int) -> None:
        start = index * BLOCK
        length = min(BLOCK, nbytes - start)
        crcs[index] = crc32_before_write(new[start : start + length].data)
        if changed[index]:
            buffer = _scratch(2 * length + 8)
            xor, planes = buffer[:length], buffer[length : 2 * length]
            word = _UINTS.get(size)
            if word is not None and size > 1:  # XOR-ed as words, then split (see _split_planes)
                words = xor.view(word)
                np.bitwise_xor(new[start : start + length].view(word), base[start : start + length].view(word),
                               out=words)
                _split_planes(words, planes.reshape(size, -1))
                xor = planes
            else:
                np.bitwise_xor(new[start : start + length], base[start : start + length], out=xor)
                if size > 1:  # a plane at a time: faster than copying the transpose at once
                    items, planed = xor.reshape(-1, size), planes.reshape(size, -1)
                    for byte in range(size):
                        planed[byte] = items[:, byte]
                    xor = planes
            if top:  # the top plane ends the planes, and the 8 bytes after them pad it to words
                low = length - length // size
                buffer[2 * length : 2 * length + 8] = 0
                records[index] = _top_record(buffer[length + low : 2 * length + 8], length // size)
                xor = xor[:low]
            region = base[start : start + length]  # this block of the base is read: spent, it takes what was made of it
            stored = spend and top and _noise(xor, length // size) and _stored_frame(xor, region)
            if stored:
                frames[index], records[index] = region[:stored], _spend(region[stored:], records[index])
            else:
                frames[index] = _compressor(level).compress(xor.data)
                if spend:
                    frames[index], *records[index] = _spend(region, [frames[index], *records[index]])

    frames: list[Any] = [b""] * count  # bytes, or views of the base where spent
    records: list[list[Any]] = [[] for _ in range(count)]
    crcs = [0] * count
    parallel.for_each(count, block)
    crc = checksums.joined(crcs, BLOCK, nbytes)
    if top:
        lengths = [len(frame) for frame in frames]
        sizes = [sum(part.nbytes for part in record) for record in records]
        table = struct.pack(f"<I{2 * count}I", count, *(n for pair in zip(lengths, sizes, strict=True) for n in pair))
        return Encoded(XOR_TOP, [table, *(part for frame, record in zip(frames, records, strict=True)
                                         for part in (frame, *record))], crc, spend)
    zeros: dict[int, bytes] = {}
    for index, frame in enumerate(frames):
        if not len(frame):
            length = min(BLOCK, nbytes - index * BLOCK)
            frames[index] = zeros.get(length) or zeros.setdefault(length, _compressor().compress(bytes(length)))
    table = struct.pack(f"<I{count}I", count, *map(len, frames))
    return Encoded(XOR_ZSTD, [table, *frames], crc, spend)


#: slices of the highest low plane :func:`_noise` compresses, and their bytes: one every 45,000
#: elements of an fp32 block, so a span of unchanged elements that long (a pruned head's rows)
#: holds one; 3 slices of 32 KiB (the same bytes, 0.03 ms less a block) let such spans between
#: them be stored raw, not compressed to nothing (a delta 1.3-2x its size)
_PROBES, _PROBE = 24, 4 << 10
#: the smallest plane :func:`_noise` probes; a smaller one is compressed
_PROBED_PLANE = 32 << 10
_ZSTD_MAGIC = struct.pack("<I", 0xFD2FB528)
#: a zstd frame header: one segment (no window size), an 8-byte content size, no checksum
_STORED_HEAD = struct.Struct("<4sBQ")
#: the most bytes one zstd block holds
_ZSTD_BLOCK = 128 << 10


def _noise(low: np.ndarray, plane: int) -> bool:
    """Whether an xor-top block's low planes (``low``, planes of ``plane`` bytes) are noise zstd
    cannot shrink: slices spread over the highest of them (the least noisy) do not compress.
    An fp32 Adam step's are (1.00003x at level -4: zstd stores them, after 0.5 ms per 3 MB
    looking for matches), except where elements did not change (an embedding's rows: 0.12x)."""
    if plane < _PROBED_PLANE:
        return False
    highest = low[len(low) - plane :]
    compressor = _compressor(_TOP_LEVEL)
    for start in np.linspace(0, plane - _PROBE, min(_PROBES, plane // _PROBE)).astype(np.int64).tolist():
        if len(compressor.compress(highest[start : start + _PROBE].data)) < _PROBE:
            return False
    return True


def _stored_frame(data: np.ndarray, out: np.ndarray) -> int:
    """``data`` written into ``out`` as a zstd frame of stored (raw) blocks, declaring its size,
    which any zstd decoder reads: what zstd makes of noise, for a copy's CPU (0.15 ms per 3 MB,
    not 0.5). The frame's length, or 0 where it does not fit in ``out``."""
    count = -(-len(data) // _ZSTD_BLOCK)
    nbytes = _STORED_HEAD.size + 3 * count + len(data)
    if nbytes > len(out):
        return 0
    out[: _STORED_HEAD.size] = np.frombuffer(_STORED_HEAD.pack(_ZSTD_MAGIC, 0xE0, len(data)), np.uint8)
    at = _STORED_HEAD.size
    for first in range(0, len(data), _ZSTD_BLOCK):
        size = min(_ZSTD_BLOCK, len(data) - first)
        out[at : at + 3] = np.frombuffer((size << 3 | (first + size >= len(data))).to_bytes(3, "little"), np.uint8)
        out[at + 3 : at + 3 + size] = data[first : first + size]
        at += 3 + size
    return nbytes


def _spend(memory: np.ndarray, parts: list[Any]) -> list[Any]:
    """``parts`` (a block's frame and top record) copied into ``memory`` (the base's bytes of
    that block, XOR-ed already and needed no more), where they fit, as views of it: the
    compressor's output is let go at once and its memory taken again by the next block's.
    Held together until written, a delta's frames were fresh pages faulted in every publish
    (14,000 faults per delta of a 128 MB fp32 model, its encode 0.88 -> 0.68 CPU-s/GB without)."""
    sizes = [memoryview(part).nbytes for part in parts]
    if sum(sizes) > len(memory):
        return parts
    placed, at = [], 0
    for part, size in zip(parts, sizes, strict=True):
        memory[at : at + size] = np.frombuffer(part, np.uint8)
        placed.append(memory[at : at + size])
        at += size
    return placed


def _top_record(padded: np.ndarray, count: int) -> list[np.ndarray]:
    """A block's top plane (``count`` bytes, then zeros to whole 8-byte words: ``padded``) as
    which of its words are not zero (a bitmap), which bytes of those are not (a bitmap, a byte
    per such word), and those bytes. The sign and exponent's high bits of a dense fp32 step's
    XOR are 95-99% zeros: zstd found a match between every two of them, 0.4-0.6 s/GB of the
    tensor, half of its encode; this takes a third of that for as many bytes."""
    words = padded[: -(-count // 8) * 8].view(np.uint64)
    marked = words != 0
    picked = words[marked.nonzero()[0]].view(np.uint8)
    nonzero = picked != 0  # the positions found in it, not in ``picked``: nonzero() of bools is 6x faster
    return [np.packbits(marked), np.packbits(nonzero), picked[nonzero.nonzero()[0]]]


#: marked words of a :func:`_top_record` decoded at a time: its positions are int64, up to 8 per
#: word (a hostile record marks every byte), so a slice's temporaries stay about 16 MiB, not 30
#: bytes per byte of the plane (832 MB for a 64 MiB block of 2-byte items)
_TOP_SLICE = 64 << 10
_POPCOUNT = np.array([bin(byte).count("1") for byte in range(256)], np.uint8)


def _apply_top(record: memoryview, column: np.ndarray) -> None:
    """XOR the top plane a :func:`_top_record` holds into ``column`` (the top byte of each item,
    a strided view), where it is not zero: not made into a plane of zeros and XOR-ed whole (a
    strided pass over every element, for 1-5% of them). Its sizes are checked against the
    record's before any byte changes, then it is decoded in slices of :data:`_TOP_SLICE` words."""
    count = len(column)
    words = -(-count // 8)
    head = -(-words // 8)
    if len(record) < head:
        raise FormatError(f"has a truncated xor-top record ({len(record)} bytes, not {head} of bitmap at least)")
    word_map = np.frombuffer(record[:head], np.uint8)
    tail = np.uint8(0xFF << (8 * head - words) & 0xFF)  # the last bitmap byte's bits for words there are
    marked = int(_POPCOUNT[word_map[:-1]].sum(dtype=np.int64)) + int(_POPCOUNT[word_map[-1] & tail]) if head else 0
    if len(record) < head + marked:
        raise FormatError(f"has a truncated xor-top record ({len(record)} bytes for {marked} words marked)")
    byte_map = np.frombuffer(record[head : head + marked], np.uint8)
    changed = int(_POPCOUNT[byte_map].sum(dtype=np.int64))
    if len(record) != head + marked + changed:
        raise FormatError(f"has an xor-top record of {len(record)} bytes where its bitmaps mark "
                          f"{head + marked + changed}")
    past = 8 * words - count  # padding bytes of the last word: only it can reach past the plane
    last = int(byte_map[-1]) & ((1 << past) - 1) if marked and word_map[-1] & tail & (0x80 >> ((words - 1) & 7)) else 0
    if last:  # byte j of a word is its bitmap's bit 7 - j
        raise FormatError(f"has an xor-top record that changes byte {8 * words - last.bit_length()} of a "
                          f"{count}-byte plane")
    values = np.frombuffer(record[head + marked :], np.uint8)
    mark_at = value_at = 0
    for first in range(0, words, _TOP_SLICE):  # a slice of words, on a whole bitmap byte (_TOP_SLICE % 8 == 0)
        span = min(_TOP_SLICE, words - first)
        where = np.unpackbits(word_map[first // 8 : first // 8 + -(-span // 8)], count=span).view(bool).nonzero()[0]
        if not len(where):
            continue
        spots = np.unpackbits(byte_map[mark_at : mark_at + len(where)]).view(bool).nonzero()[0]
        mark_at += len(where)
        positions = where[spots >> 3]
        positions += first
        positions <<= 3
        positions += spots & 7
        column[positions] ^= values[value_at : value_at + len(spots)]
        value_at += len(spots)


@dataclass
class Head:
    """What a delta version says of itself before its tensors: its step, its base and chain."""

    step: int
    base: str
    #: the base, its base, ... the anchor: every file this version needs
    chain: list[str]
    #: payload bytes of the deltas since the anchor, this one's included
    chain_bytes: int
    #: bytes of the tensors this version rebuilds
    full_bytes: int
    block: int = BLOCK
    #: the manifest's CRC-32 as a read head records it (``crc32:...``); ``None`` in a delta
    #: written before it was recorded, and in a head to be written (:func:`write` adds it)
    manifest_crc: str | None = None

    @property
    def depth(self) -> int:
        """How many deltas lie between the anchor and this version, this one included."""
        return len(self.chain)

    def document(self, version: int = 1) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "version": version, "step": self.step, "base": self.base,
                "chain": self.chain, "chain_bytes": self.chain_bytes, "full_bytes": self.full_bytes,
                "block": self.block}


def write(file: BinaryIO, head: Head, rows: Sequence[TensorRow], digests: Sequence[bytes],
          encoded: Sequence[Encoded], metadata: dict[str, Any], producer: str, created: str, *,
          path: str | None = None) -> int:
    """Write a delta version to ``file`` (the caller's commit makes it atomic); return its bytes.
    ``path``: the file ``file`` writes, whose blocks are then reserved first and written back to
    the disk as it grows (:class:`~weightstore.io._writeback.Writeback`, as a full version's are):
    without, an fp32 delta's write took 0.39 CPU-s/GB of its model where 0.18 with, its fsync all
    the write-back."""
    offsets, lengths, at = [], [], 0
    for item in encoded:
        offsets.append(at)
        lengths.append(item.nbytes)
        at += item.nbytes
    manifest_text = build_manifest(rows, metadata, producer, digests=digests, created=created).encode("utf-8",
                                                                                                   "surrogatepass")
    version = VERSION if any(item.codec == XOR_TOP for item in encoded) else 1
    head_text = json.dumps(head.document(version) | {"manifest_crc": checksum(manifest_text)}).encode()
    entries_text = json.dumps({"codec": [item.codec for item in encoded], "offset": offsets,
                               "length": lengths}).encode()
    nbytes = _PREFIX.size + len(head_text) + len(entries_text) + len(manifest_text) + at
    writeback = None if path is None else Writeback(path, lambda: nbytes)
    try:
        file.write(_PREFIX.pack(MAGIC, len(head_text), len(entries_text), len(manifest_text)))
        file.write(head_text)
        file.write(entries_text)
        file.write(manifest_text)
        for item in encoded:
            for part in item.parts:
                file.write(part)
            if writeback is not None:
                writeback.advance(item.nbytes)
        if writeback is not None:
            file.flush()  # all of it in the file before what was reserved past its end is given back
    finally:
        if writeback is not None:
            writeback.close()
    return nbytes


# -- reading -------------------------------------------------------------------------------------

def _prefix(source: ByteSource) -> tuple[int, int, int]:
    if source.size < _PREFIX.size:
        raise FormatError("is not a delta version (shorter than its header)", path=source.name)
    magic, head, entries, manifest = _PREFIX.unpack(bytes(source.read_at(0, _PREFIX.size)))
    if magic != MAGIC:
        raise FormatError("is not a delta version (wrong magic bytes)", path=source.name)
    if head > MAX_DELTA_HEAD_BYTES or entries > MAX_DELTA_ENTRIES_BYTES or manifest > MAX_DELTA_ENTRIES_BYTES or (
            _PREFIX.size + head + entries + manifest > source.size):
        raise FormatError(f"has a corrupt header (sections of {head}, {entries} and {manifest} bytes in a file of "
                          f"{source.size})", path=source.name)
    return head, entries, manifest


#: a base a sharded version's delta member names: the member of its rank in an older step's
#: attempt folder, relative to the versioned folder (``step-000000000041.attempt-0/rank-00003.safetensors``)
MEMBER_BASE = re.compile(rf"^step-([0-9]{{1,{VERSION_NAME_DIGITS}}})\.attempt-[0-9]{{1,9}}/"
                         r"rank-[0-9]{5}\.(?:safetensors|npz|h5|wsdelta)$")


def _step_of(name: str, member: bool = False) -> int | None:
    match = (MEMBER_BASE if member else VERSION_NAME).match(name)
    return int(match.group(1)) if match else None


def parse_head(data: bytes, where: str, *, member: bool = False, checked: list[str] | None = None) -> Head:
    """The head's fields, checked: a plain version name of a lower step as the base (a
    member's base: :data:`MEMBER_BASE`), a chain that starts with it and goes down, sizes that
    are counts, a manifest CRC-32 that is text (or none: a delta written before it). A field it
    does not know is ignored: a later writer may add one without stopping this reader.

    ``checked``: the chain below this version as the delta above it says (its chain past its
    base, this file), names and steps checked there; a chain equal to it is not checked name
    by name again, and is kept as that list. Each head of a chain lists every base below it, so
    checking each name of each head cost a chain of 1,000 half a million name matches (0.85 s
    to open a version, and 46 MB held of its heads' names)."""
    with naming(path=where):
        document = jsontext.loads(data, what="delta head", min_bytes=DELTA_BYTES_PER_CONTAINER)
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        raise FormatError("is not a delta version (its head is not a weightstore-delta head)", path=where)
    version = document.get("version")
    if type(version) is not int or version not in VERSIONS:
        raise FormatError(f"is a delta version of format version {str(version)[:20]}, which this "
                          "weightstore does not read", path=where)
    step, base, chain = document.get("step"), document.get("base"), document.get("chain")
    numbers = [document.get(field) for field in ("chain_bytes", "full_bytes", "block")]
    manifest_crc = document.get("manifest_crc")
    known = checked is not None and chain == checked  # its names and steps checked in the head above it
    if not (_count(step) and all(map(_count, numbers)) and isinstance(base, str) and isinstance(chain, list)
            and chain and len(chain) <= MAX_DELTA_CHAIN and chain[0] == base
            and (known or all(isinstance(n, str) for n in chain))
            and (manifest_crc is None or isinstance(manifest_crc, str))):
        raise FormatError("has a corrupt delta head (step, base, chain, sizes or manifest CRC)", path=where)
    steps = [_step_of(name, member) for name in (chain[:1] if known else chain)]
    if None in steps or any(b >= a for a, b in zip([step, *steps], steps, strict=False)):  # type: ignore[operator]
        raise FormatError(f"names base {base[:80]!r} (chain {len(chain)} deep), which is not a version file of a "
                          f"lower step {'(a member of its rank) ' if member else ''}beside it, each lower than the "
                          "one before", path=where)
    if not 0 < numbers[2] <= MAX_DELTA_BLOCK:  # type: ignore[operator]
        raise FormatError(f"has a corrupt delta head (blocks of {numbers[2]} bytes)", path=where)
    chain_bytes, full_bytes, block = numbers
    return Head(step, base, checked if known else list(chain), chain_bytes, full_bytes, block,  # type: ignore[arg-type]
                manifest_crc)


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


def read_head(location: Any, name: str, *, member: bool = False, checked: list[str] | None = None) -> Head:
    """Only the head of the delta version at ``location`` (a path or remote file): what
    retention and ``ws versions`` need, without its tensors' entries (``member``: of a sharded
    version's delta member). ``checked``: the chain it should list, as :func:`parse_head` takes it
    (a listing passes its base and the chain the base's head listed)."""
    source = byte_source(location, name)
    try:
        if isinstance(source, RemoteFile):
            source.start(index_at_end=False)
        head, _, _ = _prefix(source)
        return parse_head(bytes(source.read_at(_PREFIX.size, head)), name, member=member, checked=checked)
    finally:
        source.close()


class DeltaReader(ReaderDefaults):
    """A delta version as a store: each tensor rebuilt from its base's, then checked against
    the digest the publisher recorded (``verify``). A local chain is opened whole when this is,
    so it is pinned (mapped) with it, or down to ``until`` (a base's file name), the bases below
    it opened when first read; a remote base is opened when first read, so a reader that
    rebuilds onto a version it holds (:meth:`read_from`) never fetches the anchor's index."""

    def __init__(self, source: ByteSource, name: str, open_base: Callable[[str, int, list[str]], Reader],
                 depth: int, expect_step: int | None, *, eager: bool = True, member: bool = False,
                 most_files: int | None = None, chained: bool = False, checked: list[str] | None = None,
                 until: str | None = None):
        self._source = source
        self.name = name
        head_bytes, entries_bytes, manifest_bytes = _prefix(source)
        at = _PREFIX.size
        self.head = parse_head(bytes(source.read_at(at, head_bytes)), name, member=member, checked=checked)
        if expect_step is not None and self.head.step != expect_step:
            raise FormatError(f"says it is step {self.head.step}, but is named as step {expect_step}", path=name)
        if depth + len(self.head.chain) > MAX_DELTA_CHAIN + 1:
            raise FormatError(f"is more than {MAX_DELTA_CHAIN} deltas from its anchor", path=name)
        if eager and most_files is not None and depth + len(self.head.chain) + 1 > most_files:
            raise SizeLimitError(f"is read with its chain held open, {len(self.head.chain) + 1} files down to its "
                                 f"anchor, more than the {most_files} a reader may hold (a quarter of the soft limit "
                                 "on open files, RLIMIT_NOFILE: raise it, ulimit -n)", path=name)
        at += head_bytes
        entries = bytes(source.read_at(at, entries_bytes))
        at += entries_bytes
        text = bytes(source.read_at(at, manifest_bytes))
        recorded = self.head.manifest_crc
        if recorded is not None:
            check_recorded(text, recorded, "manifest", name)
        try:
            self._manifest: Manifest = parse_manifest(text.decode("utf-8", "surrogatepass"), name)
        except UnicodeDecodeError:
            raise FormatError("has a manifest that is not UTF-8", path=name) from None
        self._payload_start = at + manifest_bytes
        self._entries = self._parse_entries(entries)
        self._open_base = functools.partial(open_base, self.head.base, depth + 1, self.head.chain[1:])
        self._opened: Reader | None = None
        self._let_go: Callable[[], None] | None = None  # the base is another's, lent: see rest_on
        self._opening = threading.Lock()  # tensors are rebuilt in parallel: the base is opened once
        if eager and not chained:  # chained: a local chain's base, opened by its top (_open_chain); or chain=False
            self._open_chain(until)

    def _open_chain(self, until: str | None = None) -> None:
        """Open each base of this version's local chain down to its anchor, or to ``until`` (a
        base's file name, not opened: a reader that holds its bytes reads nothing below it, so a
        follower's pin costs the deltas since the version it holds, not the chain's depth), one
        after the other, not each inside the one above: a reader's stack stays the same however
        deep its chain (a chain of 165 small deltas opened within each other passed Python's
        1,000 frames, and a sound chain read as corrupt). A base that fails is named once, as a remote chain's is:
        "in its chain, <the delta above it>: ..." (nested once a level, a missing anchor below 130
        deltas made a 4 KB message for each, and ``ws verify`` printed 370 KB)."""
        levels: list[DeltaReader] = [self]
        try:
            while levels[-1].head.base != until:
                level = levels[-1]
                try:
                    level._opened = level._open_base()
                except (FormatError, StoreClosedError, SizeLimitError) as exc:  # named by the delta above it
                    raise named_here(exc, self.name, None) from None
                if not isinstance(level._opened, DeltaReader):
                    return
                levels.append(level._opened)
        except BaseException:  # this file is closed by whoever opened it (open_source), the bases here
            if len(levels) > 1:
                levels[1].close()
            raise

    def rest_on(self, held: str, reader: Reader, let_go: Callable[[], None]) -> bool:
        """Take ``reader``, version ``held`` open elsewhere (the pin of the version a ``Follower``
        holds), as the base where this version's chain, opened down to ``held``
        (:func:`open_reader`), stops; whether it did. Closing this version calls ``let_go``
        for it, not its ``close``. So the chain stays readable whole, its lower files pruned or
        not, without opening them again, and is still walked in a loop, not a call a version."""
        level = self._chain()[-1]
        with level._opening:
            if level.head.base != held or level._opened is not None:
                return False
            level._opened, level._let_go = reader, let_go
        return True

    @property
    def _base(self) -> Reader:
        """The base's reader, opened when first needed (at once where ``eager``)."""
        if self._opened is None:
            with self._opening:
                if self._opened is None:
                    self._opened = self._open_base()
        return self._opened

    def _parse_entries(self, data: bytes) -> dict[str, tuple[str, int, int]]:
        with naming(path=self.name):
            document = jsontext.loads(data, what="delta entries", min_bytes=DELTA_BYTES_PER_CONTAINER)
        keys = list(self._manifest.tensors)
        columns = [document.get(field) if isinstance(document, dict) else None for field in ("codec", "offset", "length")]
        codecs, offsets, lengths = (column if isinstance(column, list) and len(column) == len(keys) else None
                                    for column in columns)
        if codecs is None or offsets is None or lengths is None:
            raise FormatError("has delta entries that do not list every tensor of its manifest", path=self.name)
        payload = self._source.size - self._payload_start
        if keys and not self._manifest.tensors.has_digests:
            raise FormatError("records no digest of the tensor it rebuilds", path=self.name, key=keys[0])
        found: dict[str, tuple[str, int, int]] = {}
        # each tensor's bytes from the table's column: a TensorInfo made per tensor cost a quarter
        # of opening a chain 1,000 deep
        for key, codec, offset, length, nbytes in zip(keys, codecs, offsets, lengths,
                                                      self._manifest.tensors.rows()[2], strict=True):
            if codec not in CODECS or not _count(offset) or not _count(length) or offset + length > payload:
                raise FormatError(f"has a corrupt delta entry ({str(codec)[:20]} at {str(offset)[:20]}, "
                                  f"{str(length)[:20]} bytes, in {payload} bytes of payload)", path=self.name, key=key)
            if (codec == SAME and length) or (codec == RAW and length != nbytes):
                raise FormatError(f"has a {codec} entry of {length} bytes for a tensor of {nbytes}",
                                  path=self.name, key=key)
            found[key] = (codec, offset, length)
        return found

    # -- the Reader protocol ---------------------------------------------------------------------
    @property
    def kind(self) -> str | None:  # type: ignore[override]  # a property here, a class attribute in the defaults
        return f"weightstore delta version (base {self.head.base}, {self.head.depth} from its anchor)"

    @property
    def metadata(self) -> dict[str, Any]:
        return self._manifest.metadata

    @property
    def created(self) -> str:
        return self._manifest.created

    @property
    def has_checksums(self) -> bool:
        return True

    def keys(self) -> list[str]:
        return list(self._manifest.tensors)

    def info(self, key: str) -> TensorInfo:
        return self._manifest.tensors[key]

    @property
    def open_files(self) -> int:
        """The files it holds open: its own and, where its chain is opened with it (local), each base's."""
        count, level = 1, self._opened
        while isinstance(level, DeltaReader):
            count, level = count + 1, level._opened
        return count + (level is not None)

    def _chain(self) -> list[DeltaReader]:
        """This version and each delta of its chain opened so far, this one first, down to a
        base lent to it (:meth:`rest_on`)."""
        found: list[DeltaReader] = []
        level: Reader | None = self
        while isinstance(level, DeltaReader):
            found.append(level)
            level = None if level._let_go is not None else level._opened
        return found

    @property
    def file_bytes(self) -> int:
        """This file's own bytes (not its chain's)."""
        return self._source.size

    def codec(self, key: str) -> str:
        """How ``key`` is stored here (:data:`CODECS`)."""
        return self._entries[key][0]

    def payload_bytes(self, key: str) -> int:
        return self._entries[key][2]

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        info = self._manifest.tensors[key]
        out = self.stored_bytes(key, verify=verify)
        return from_storage(out.view(storage_dtype(info.dtype)).reshape(info.shape), info.dtype)

    def stored_bytes(self, key: str, *, verify: bool = True) -> np.ndarray:
        """``key``'s stored bytes rebuilt (uint8, a new array), checked against the recorded digest (``verify``)."""
        try:
            out = self.rebuilt(key)
        except WeightStoreError as exc:
            raise named_here(exc, self.name, key) from None
        if verify and DIGEST_PREFIX + content_digest(out).hex() != self._manifest.tensors[key].digest:
            raise ChecksumError(self._corrupt_link(key) or (
                f"rebuilding it from base {self.head.base} (and its chain) does not give the digest its publisher "
                "recorded: the base or the delta is corrupt"), path=self.name, key=key)
        return out

    def _corrupt_link(self, key: str) -> str | None:
        """Which file of this version's chain is corrupt for ``key``, said when its rebuild failed
        the digest (``None`` where none is found): the anchor checked against its own checksums,
        then each delta from the oldest against the digest it records. A base damaged after it was
        written fails every delta built on it until the next anchor, so each of their errors names
        that one file, as what is wrong with it ("in its chain, step-….npz: is corrupt (checksum
        …)"), not inside a second message about the digest, which named the base twice. An anchor
        that reads whole proves only that it is a whole file, not the one the first delta was built
        on (a delta records its base's name, not its bytes): where that delta fails, either may be
        at fault, and both are named. The chain is read again for ``key`` on this failure path only
        (a rebuild checks the digest at the top)."""
        levels: list[DeltaReader] = []  # the deltas key is rebuilt through, down to one storing it raw
        level: Any = self
        while isinstance(level, DeltaReader):
            levels.append(level)
            if level._entries[key][0] == RAW:
                break
            level = level._base
        out = None
        on_anchor = not isinstance(level, DeltaReader)
        reading = levels[-1].head.base  # the file read, as the chain names it (a sharded member's with its attempt)
        try:
            if on_anchor:
                stored = np.ascontiguousarray(to_storage(level.read(key, verify=True), key)[1])
                out = _aligned_copy(stored.reshape(-1).view(np.uint8) if stored.size else np.empty(0, np.uint8))
            for at in reversed(range(len(levels))):
                level, reading = levels[at], self.name if at == 0 else levels[at - 1].head.base
                out = level._apply_own(key, out)
                if DIGEST_PREFIX + content_digest(out).hex() != level._manifest.tensors[key].digest:
                    where, said = ("this delta", "") if at == 0 else (reading, "in its chain, ")
                    if on_anchor and level is levels[-1]:
                        return (f"{said}{where} is corrupt, or its base {level.head.base} is another whole file than "
                                "the one it was built on (restored from another copy?): that base reads whole, "
                                f"{where} does not rebuild the digest its publisher recorded on it")
                    return (f"{said}{where} is corrupt: its base rebuilds whole, {where} does not rebuild the digest "
                            "its publisher recorded on it")
        except WeightStoreError as exc:
            return exc.message if reading == self.name else f"in its chain, {reading}: {exc.message}"
        return None

    def proven_bytes(self) -> int:
        """Bytes of every tensor this version rebuilds, each proven before any is rebuilt: held
        ``raw`` here (its payload that long), or of the same dtype and shape in its base, down to
        the anchor, whose file holds them. What a reader may allocate for them; the sizes a
        hostile delta claims are refused here, not met with memory."""
        total = 0
        for key, info in self._manifest.tensors.items():
            level: Any = self
            while isinstance(level, DeltaReader) and level._entries[key][0] != RAW:
                level._check_base(key, info, self.name)
                level = level._base
            total += info.nbytes
        return total

    def rebuilt(self, key: str) -> np.ndarray:
        """``key``'s stored bytes rebuilt (uint8, a new writable array), not yet verified: the
        deltas it changes through found down to one storing it raw or the anchor, then applied
        from the oldest, in a loop (a stack the same however deep the chain)."""
        levels: list[DeltaReader] = [self]
        out = None
        info = self._manifest.tensors[key]
        while levels[-1]._entries[key][0] != RAW:
            level = levels[-1]
            info = level._check_base(key, info, level.name)
            base = level._base
            if not isinstance(base, DeltaReader):
                out = level._anchor_bytes(key, base)
                break
            levels.append(base)
        for level in reversed(levels):
            if level._entries[key][0] != SAME:  # the base's bytes, of its dtype and shape (checked above)
                out = level._apply_own(key, out)
        assert out is not None
        return out

    def _apply_own(self, key: str, out: np.ndarray | None, hasher: Any = None) -> np.ndarray:
        """This version's change of ``key`` applied to ``out`` (its base's bytes, writable; not
        needed for ``raw``), in place where it can be. ``hasher`` (a :func:`content_hasher`, for
        a ``sparse`` entry only) is fed the whole result as it is made."""
        info = self._manifest.tensors[key]
        codec, offset, length = self._entries[key]
        payload = memoryview(self._source.read_at(self._payload_start + offset, length))
        if codec == RAW:
            return _aligned_copy(np.frombuffer(payload, np.uint8))
        assert out is not None
        if len(out) != info.nbytes:
            raise FormatError(f"its base holds {len(out)} bytes, not the {info.nbytes} it changes", path=self.name,
                              key=key)
        with naming(path=self.name, key=key):
            if codec in (XOR_ZSTD, XOR_TOP):
                _apply_xor(payload, out, self.head.block, storage_dtype(info.dtype).itemsize, top=codec == XOR_TOP)
            elif codec == SPARSE:
                _apply_sparse(payload, out, storage_dtype(info.dtype).itemsize, hasher)
        return out

    def levels(self, held: str) -> list[DeltaReader] | None:
        """The deltas from this version down to the one whose base is ``held`` (a file name),
        this one first; ``None`` when ``held`` is not in this version's chain."""
        found: list[DeltaReader] = []
        level: Any = self
        while isinstance(level, DeltaReader):
            found.append(level)
            if level.head.base == held:
                return found
            level = level._base
        return None

    @staticmethod
    def _needed(key: str, levels: list[DeltaReader]) -> list[DeltaReader] | None:
        """Of ``levels`` (the newest first), those ``key`` is rebuilt from: down to the first that
        stores it ``raw`` (nothing older is needed); ``None`` when one lacks it."""
        for at, level in enumerate(levels):
            entry = level._entries.get(key)
            if entry is None:
                return None
            if entry[0] == RAW:
                return levels[: at + 1]
        return levels

    def chain_payload(self, keys: list[str], held: str | None) -> int | None:
        """Bytes a reader holding version ``held`` fetches to rebuild ``keys`` here: the payloads
        of the deltas after it (down to a ``raw`` copy where one is nearer); a tensor the chain
        cannot rebuild counts whole. ``None`` when ``held`` is not in this version's chain.

        ``held=None``: what a reader that holds nothing fetches, the anchor's bytes of ``keys``
        and their share of the chain's payloads, told by the head alone (counting it exactly
        would open every file of the chain, a fetch of each on an object store)."""
        if held is None:
            nbytes = sum(self._manifest.tensors[key].nbytes for key in keys)
            return nbytes + self.head.chain_bytes * nbytes // max(1, self.head.full_bytes)
        levels = self.levels(held)
        if levels is None:
            return None
        total = 0
        for key in keys:
            needed = self._needed(key, levels)
            total += self._manifest.tensors[key].nbytes if needed is None else sum(
                level._entries[key][2] for level in needed)
        return total

    def read_from(self, key: str, held: str, data: np.ndarray, *, verify: bool,
                  in_place: bool = False) -> np.ndarray | None:
        """``key`` rebuilt onto ``data``, the bytes of ``key`` in version ``held`` (a file name in
        this version's chain), reading only the deltas after it (from the newest that stores it
        ``raw``), and verified against the recorded digest; ``None`` when ``held`` is not in the
        chain, or a tensor on the way is not a change of the one before (then read it whole:
        :meth:`read`). ``in_place``: ``data`` (uint8, writable) is rebuilt where it lies, no
        copy made (a failure leaves it half changed), and the result is a view of it."""
        if np.asarray(data).nbytes != self._manifest.tensors[key].nbytes:  # not this tensor's bytes (a
            return None  # hostile member's size against its index box): read whole, proven there
        levels = self.levels(held)
        needed = None if levels is None else self._needed(key, levels)
        if needed is None:
            return None
        for level in needed:  # every payload at once, for a remote chain
            _, offset, length = level._entries[key]
            if length:
                prefetch_ranges(level._source, functools.partial(list, [(level._payload_start + offset, length)]))
        if needed[-1]._entries[key][0] == RAW:
            out = None
        else:
            out = data if in_place else _aligned_copy(np.asarray(data).reshape(-1).view(np.uint8))
        # the newest change, when sparse, is hashed as it is applied, a piece at a time while
        # that piece is in cache: one pass over the tensor's memory instead of two (-20% CPU)
        hasher = content_hasher() if verify and needed[0]._entries[key][0] == SPARSE else None
        try:
            for level in reversed(needed):
                out = level._apply_own(key, out, hasher if level is needed[0] else None)
        except WeightStoreError as exc:
            raise named_here(exc, self.name, key) from None
        if in_place and out is not data and out is not None:
            np.copyto(data, out)
            out = data
        info = self._manifest.tensors[key]
        assert out is not None
        if verify and DIGEST_PREFIX + (content_digest(out) if hasher is None else hasher.digest()).hex() != info.digest:
            raise ChecksumError(f"rebuilding it onto {held} does not give the digest its publisher recorded",
                                path=self.name, key=key)
        return from_storage(out.view(storage_dtype(info.dtype)).reshape(info.shape), info.dtype)

    def _check_base(self, key: str, info: TensorInfo, where: str) -> TensorInfo:
        """That the base holds ``key`` as ``info`` (dtype and shape), a change of which this
        version stores; ``where``: the file a refusal names. The base's own info of it, which
        the check of the base's base takes (asked once a level of a chain 1,000 deep)."""
        try:
            held = self._base.info(key)
        except KeyError:
            raise FormatError(f"is stored as a change of base {self.head.base}, which has no such tensor",
                              path=where, key=key) from None
        if held.dtype != info.dtype or tuple(held.shape) != tuple(info.shape):
            raise FormatError(f"is stored as a change of base {self.head.base}'s tensor, which is {held.dtype} "
                              f"{held.shape}, not {info.dtype} {info.shape}", path=where, key=key)
        return held

    def _anchor_bytes(self, key: str, base: Reader) -> np.ndarray:
        """``key``'s stored bytes in ``base``, this version's anchor (uint8, a new writable array)."""
        try:
            array = base.read(key, verify=False)
        except FileNotFoundError as exc:
            raise FormatError(f"its base {self.head.base} went missing while it was read ({exc})",
                              path=self.name, key=key) from None
        stored = np.ascontiguousarray(to_storage(array, key)[1])
        return _aligned_copy(stored.reshape(-1).view(np.uint8) if stored.size else np.empty(0, np.uint8))

    def prefetch(self, keys: list[str]) -> None:
        """Warn each file of the chain of the ranges ``keys`` are rebuilt from, in a loop down to
        the anchor (a stack the same however deep the chain). A remote base is opened here,
        first; one that fails is named from this version, as a rebuild names it (it was named
        from the delta above it: ``ws.load`` of step 6 said step 4 needs a missing step 3)."""
        level: Reader = self
        try:
            while isinstance(level, DeltaReader):
                prefetch_ranges(level._source, functools.partial(level._ranges, keys))
                keys = [key for key in keys if key in level._entries and level._entries[key][0] != RAW]
                if not keys:
                    return
                level = level._base
                held = set(level.keys())
                keys = [key for key in keys if key in held]
            level.prefetch(keys)
        except WeightStoreError as exc:
            raise named_here(exc, self.name, None) from None

    def _ranges(self, keys: list[str]) -> list[tuple[int, int]]:
        """The payload ranges of ``keys`` in this file."""
        return [(self._payload_start + self._entries[key][1], self._entries[key][2]) for key in keys
                if key in self._entries and self._entries[key][2]]

    def close(self) -> None:
        """Close this file and each of its chain opened, in a loop, not each inside the one above;
        every one is closed, whichever fails."""
        levels = self._chain()
        anchor = levels[-1]._opened
        with contextlib.ExitStack() as closing:  # runs the last pushed first: this file, then down
            if levels[-1]._let_go is not None:
                closing.callback(levels[-1]._let_go)
            elif anchor is not None:
                closing.callback(anchor.close)
            for level in reversed(levels):
                closing.callback(level._source.close)

def _aligned_copy(data: np.ndarray) -> np.ndarray:
    """A copy of ``data`` (uint8) in 64-byte-aligned memory of its own: what a rebuilt tensor is
    made in, so that a follower can hand it to the framework as a variable's buffer instead of
    copying it again while serving waits (:func:`weightstore.adapters.skeleton.handed_over`)."""
    out = aligned_array(len(data))
    np.copyto(out, data)
    return out


def named_here(error: WeightStoreError, name: str, key: str | None) -> WeightStoreError:
    """``error``, raised reading this version's chain, naming this version (and the file of the
    chain it came from in its message), so that whoever reads a version learns which one failed."""
    if error.path is None or error.path == name:
        error.path = name
        error.key = error.key if error.key is not None else key
        return error
    where = _file_name(error.path)
    named = type(error)(f"in its chain, {where}: {error.message}", path=name,
                        key=error.key if error.key is not None else key) if type(error) in _SIMPLE else (
        FormatError(f"in its chain, {where}: {error.message}", path=name, key=error.key if error.key is not None else key))
    return named


_SIMPLE = (FormatError, ChecksumError, UnsafeFileError, SizeLimitError)


def _file_name(path: str) -> str:
    """The last part of ``path``, a file of a version's chain, as an error about another names it."""
    return path.replace("\\", "/").rsplit("/", 1)[-1]


def _apply_xor(payload: memoryview, out: np.ndarray, block: int, itemsize: int, *, top: bool = False) -> None:
    """XOR the frames of ``payload`` (byte-planed, see :func:`_plane_size`) into ``out``, each
    frame bounded by its block's size; ``top`` (:data:`XOR_TOP`): each frame holds the planes but
    the top one, which follows it as a :func:`_top_record`."""
    nbytes, planes = len(out), _plane_size(itemsize, block)
    count, per, name = -(-nbytes // block), 1 + top, XOR_TOP if top else XOR_ZSTD
    if top and planes == 1:
        raise FormatError(f"has an xor-top entry for {itemsize}-byte items in blocks of {block} bytes (no planes)")
    if len(payload) < 4 + 4 * per * count or struct.unpack_from("<I", payload)[0] != count:
        raise FormatError(f"has a corrupt {name} table (not {count} blocks of {block} bytes)")
    lengths = struct.unpack_from(f"<{per * count}I", payload, 4)
    if 4 + 4 * per * count + sum(lengths) != len(payload):
        raise FormatError(f"has {name} frames that do not add up to its payload (truncated or corrupt)")
    jobs, at = [], 4 + 4 * per * count
    for index in range(count):
        frame = payload[at : at + lengths[per * index]]
        at += lengths[per * index]
        record = payload[at : at + lengths[per * index + 1]] if top else None
        at += lengths[per * index + 1] if top else 0
        jobs.append((frame, record, index * block, min(block, nbytes - index * block)))

    def one(index: int) -> None:
        frame, record, start, size = jobs[index]
        low = size - size // planes if top else size
        try:
            if zstandard.frame_content_size(frame) != low:
                raise FormatError(f"has an {name} frame at byte {start} that does not declare its {low} bytes")
            plain = decompressor().decompress(frame, max_output_size=low)
        except zstandard.ZstdError as exc:
            raise FormatError(f"has a corrupt {name} frame at byte {start} ({exc})") from None
        if len(plain) != low:
            raise FormatError(f"has an {name} frame at byte {start} that decodes to {len(plain)} bytes, not {low}")
        target = out[start : start + size]
        if planes == 1:
            np.bitwise_xor(target, np.frombuffer(plain, np.uint8), out=target)
            return
        items, planed = target.reshape(-1, planes), np.frombuffer(plain, np.uint8).reshape(-1, size // planes)
        if record is not None:
            _apply_top(record, items[:, -1])
        for byte in range(len(planed)):  # a plane at a time: twice as fast as the transpose at once
            np.bitwise_xor(items[:, byte], planed[byte], out=items[:, byte])

    parallel.for_each(len(jobs), one)


def _unplaned(frame: memoryview, count: int, size: int, dtype: np.dtype, what: str) -> np.ndarray:
    """A frame of ``count`` byte-planed items of ``size`` bytes, decoded to exactly that many bytes."""
    expected = count * size
    try:
        if zstandard.frame_content_size(frame) != expected:
            raise FormatError(f"has a sparse {what} frame that does not declare its {expected} bytes")
        plain = decompressor().decompress(frame, max_output_size=expected) if expected else b""
    except zstandard.ZstdError as exc:
        raise FormatError(f"has a corrupt sparse {what} frame ({exc})") from None
    if len(plain) != expected:
        raise FormatError(f"has a sparse {what} frame of {len(plain)} bytes, not {expected}")
    planed, items = np.frombuffer(plain, np.uint8).reshape(size, count), np.empty((count, size), np.uint8)
    for byte in range(size):  # a plane at a time: 5-20x faster than copying the transpose at once
        items[:, byte] = planed[byte]
    return items.view(dtype).reshape(count, -1)


def _apply_sparse(payload: memoryview, out: np.ndarray, itemsize: int, hasher: Any = None) -> None:
    """XOR the changed elements ``payload`` lists into ``out``; positions must rise and stay
    inside. ``hasher`` (a :func:`content_hasher`) is fed ``out`` a piece at a time, each just
    after its changes are applied."""
    elements = len(out) // itemsize if itemsize else 0
    positions = _position_dtype(elements)
    if len(payload) < 24:
        raise FormatError("has a truncated sparse entry")
    count, gap_bytes, value_bytes = struct.unpack_from("<QQQ", payload)
    if count > elements or 24 + gap_bytes + value_bytes != len(payload):
        raise FormatError(f"has a sparse entry of {count} elements in {len(payload)} bytes, for a tensor of "
                          f"{elements} elements")
    if not count:
        if hasher is not None:
            hasher.update(out)
        return
    gaps = _unplaned(payload[24 : 24 + gap_bytes], count, positions.itemsize, positions, "position").reshape(-1)
    values = _unplaned(payload[24 + gap_bytes :], count, itemsize, np.dtype(np.uint8), "value")
    where = np.cumsum(gaps, dtype=np.uint64)  # a wrap past 2**64 shows as a position going down
    # gaps of at least one rise, unless their sum wraps: 32-bit gaps (fewer than 2**32 of them) cannot
    if int(gaps.min()) < 1 or int(where[-1]) > elements or (
            positions.itemsize > 4 and count > 1 and not bool(np.all(where[1:] > where[:-1]))):
        raise FormatError("has sparse positions that are out of range or not increasing")
    at = where.view(np.int64)  # at most ``elements``: the same numbers, in place
    at -= 1
    word = _UINTS.get(itemsize)
    if word is not None and out.ctypes.data % itemsize == 0:  # as words: a row gather of bytes costs several times more
        target, changes = out.view(word), np.ascontiguousarray(values).view(word).reshape(-1)
    else:
        target, changes = out.reshape(-1, itemsize), values
    if hasher is None:
        target[at] = np.bitwise_xor(target[at], changes)
        return
    per = max(1, _HASH_PIECE // max(1, itemsize))
    bounds = np.searchsorted(at, np.arange(0, elements + per, per)).tolist()
    for index in range(-(-elements // per)):
        low, high = bounds[index], bounds[index + 1]
        if high > low:
            spots = at[low:high]
            target[spots] = np.bitwise_xor(target[spots], changes[low:high])
        hasher.update(out[index * per * itemsize : (index + 1) * per * itemsize])


#: bytes of a tensor a sparse change is applied to, then hashed, at a time: they stay in cache between
_HASH_PIECE = 1 << 20


def open_reader(location: Any, name: str, *, mmap: bool = True, chain: bool | str = True,
                checked: list[str] | None = None) -> Reader:
    """The delta version at ``location``, its chain of bases opened beside it. ``chain=False``:
    each base is opened when first read instead, as a remote one is (a reader that holds the
    base's bytes proven rebuilds onto them and opens none: ``ws verify FOLDER``); a base's file
    name: the chain is opened down to that base, not it (a follower holding that version, which
    rebuilds onto it: :meth:`DeltaReader.read_from`), each base below when first read;
    ``checked``: the chain its head should list, as :func:`parse_head` takes it."""
    return _open(location, name, mmap, 0, chained=chain is False, checked=checked,
                 until=chain if isinstance(chain, str) else None)


def open_member(location: Any, name: str, *, mmap: bool = True, most_files: int | None = None) -> DeltaReader:
    """A sharded version's delta member at ``location`` (``…/step-….attempt-N/rank-R.wsdelta``):
    its bases are its rank's members of older steps (:data:`MEMBER_BASE`), opened from the
    versioned folder above its attempt folder. Its tensors are the member's stored names.
    ``most_files``: the files its local chain may hold open (:attr:`DeltaReader.open_files`);
    a longer chain is a ``SizeLimitError`` before any base is opened."""
    return _open(location, name, mmap, 0, member=True, most_files=most_files)


def _open(location: Any, name: str, mmap: bool, depth: int, *, member: bool = False,
          most_files: int | None = None, chained: bool = False, checked: list[str] | None = None,
          until: str | None = None) -> DeltaReader:
    parts = name.replace("\\", "/").rsplit("/", 2)
    own = "/".join(parts[-2:]) if member else parts[-1]

    def open_base(base: str, at: int, below: list[str]) -> Reader:
        if at > MAX_DELTA_CHAIN:
            raise FormatError(f"is more than {MAX_DELTA_CHAIN} deltas from its anchor", path=name)
        fmt = format_for_suffix(base)
        if fmt is None or not fmt.writes and fmt.name != FORMAT_NAME:
            raise FormatError(f"names base {base!r}, which is not a version file a delta builds on", path=name)
        try:
            if fmt.name == FORMAT_NAME:
                return _open(*beside(location, name, base, up=int(member)), mmap, at, member=member,
                             most_files=most_files, chained=True, checked=below)
            located, url = beside(location, name, base, up=int(member))
            if isinstance(located, RemoteFile) and fmt.remote_file_object:
                return by_saved_keys(_through_file_object(fmt, located, url))
            return by_saved_keys(fmt.open_reader(located, url, mmap=mmap))
        except (FormatError, StoreClosedError, SizeLimitError) as exc:  # a damaged base: this version cannot be read
            raise named_here(exc, name, None) from None
        except FileNotFoundError:
            raise FormatError(f"needs its base {base}, which is missing (pruned by hand, or never copied with it)",
                              path=name) from None
        except FileAccessError as exc:
            raise FormatError(f"needs its base {base}, which {exc.message}", path=name) from None

    return open_source(location, name, lambda source: DeltaReader(source, name, open_base, depth,
                                                                 _step_of(own, member),
                                                                 eager=not isinstance(source, RemoteFile),
                                                                 member=member, most_files=most_files,
                                                                 chained=chained, checked=checked, until=until),
                       index_at_end=False, mmap=mmap)


def _through_file_object(fmt: Format, located: RemoteFile, url: str) -> Reader:
    """A remote base of a format that reads through an fsspec file object (h5py's reads), as
    ``ws.open`` of its URL reads it: given ranged reads, h5py refused the anchor of every delta."""
    located.close()
    with service(url):
        handle = Place(url, remote=True, fs=located.fs, path=located.path).open_file()
    try:
        return fmt.open_reader(handle, url)
    except BaseException:
        handle.close()
        raise


def _no_writer(path: str, compress: bool | str) -> Any:
    raise TargetError("delta versions are written by ws.publish(folder, weights, step=..., delta=True)", path=path)


FORMAT = Format(name=FORMAT_NAME, suffixes=(SUFFIX,), magic=lambda head: head.startswith(MAGIC),
                open_reader=open_reader, open_writer=_no_writer, compresses=False, writes=False)
