"""What a sharded version says about itself: the index, each rank's block table and done-record, and their checks.

A sharded version is one index file (``step-000000000042.wsindex``) naming member files (one
per rank, each an ordinary safetensors, npz or HDF5 file) and, for every global key, the boxes
(pieces) that tile it: which member holds each and where it sits in the global tensor
(``start``, ``shape``). Everything per *block* lives with its member, in its **block table**
(``rank-00003.blocks`` beside it, :class:`BlockTable`): where each piece's bytes (or each of its
column strips) lie in the member, and a CRC-32 and a digest for each block of it (whole
rows along its first axis, :func:`piece_block_rows`; the digest is of its band: those rows, all
the piece's columns, :func:`crc_band_digests`, or :func:`band_digests` in older tables). So the index grows with pieces, never
with blocks; keys that share a partitioning share one *layout* (their list of boxes); and a
reader of a region fetches the index, then the headers of the tables of the members that hold
its region (their sizes and BLAKE3 digests are in the index) and the pages of CRC-32s of the
blocks that hold the region (:class:`BlockTable`), and only those blocks. A follower also fetches the digests of those tables, to skip a region whose
blocks did not change (the CRC-32 finds damage; only the digest, which nobody but the
version's author could forge, says "unchanged"). Each rank's done-record says what its member holds (boxes, no blocks); the
coordinator merges the done-records into the index without reading a tensor byte.

**Bounds** (:data:`MAX_INDEX_BYTES` and what feeds it) are checked by each rank in
:func:`check_share` before it writes anything, so no index a commit would write is over them:
see ``docs/sharded.md`` for the figures of a 405B model on 1,000 ranks.

Indexes of version 1 (block checksums and digests inside the index, each strip its own piece)
and 2 (tables whose CRC-32s are in block order, read whole) still read: :meth:`ShardIndex.parse`
takes any, and the reader treats a version 1 piece as one already placed.

Every file here is read as hostile input: :meth:`ShardIndex.parse`, :meth:`BlockTable.parse` and
:func:`parse_done` check every field, and :func:`check_tensor` that the pieces of a key lie inside
the tensor, never overlap and cover it, and the block table that they lie inside their member
and never share its bytes, so nothing a reader allocates exceeds what the members hold. Errors
name the key; the caller, which knows the file, names it with :func:`weightstore.errors.naming`.
"""

from __future__ import annotations

import bisect
import heapq
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import numpy as np
import orjson
from isal import isal_zlib

from weightstore.core import checksums
from weightstore.core._jsontext import refuse_deep, refuse_dense, text_field
from weightstore.core._tensortable import fits_an_array
from weightstore.core.keys import validate_key
from weightstore.core.limits import (
    BYTES_PER_CONTAINER,
    KEY_BYTES,
    MAX_DELTA_CHAIN,
    MAX_DONE_BYTES,
    MAX_INDEX_BYTES,
    MAX_INDEX_INTEGER,
    MAX_NDIM,
    MAX_PIECES_PER_KEY,
    MAX_STRIPS,
    MAX_TABLE_BLOCKS,
    MAX_TABLE_HEADER_BYTES,
    MAX_V1_INDEX_BYTES,
    OVERLAP_PAIRS,
    OVERLAP_PAIRS_PER_BYTE,
    RESERVED_BYTES,
    VERSION_NAME_DIGITS,
)
from weightstore.core.manifest import crc32, logical_dtype, raw_bytes
from weightstore.errors import (
    ChecksumError,
    FormatError,
    InvalidKeyError,
    SizeLimitError,
    UnsafeFileError,
    WeightStoreError,
)
from weightstore.io.files import TEMP_MARK

__all__ = ["index_name", "attempt_folder", "member_name", "MEMBER_SUFFIXES", "done_name", "table_name", "BLOCK_BYTES",
           "MIN_BLOCK_BYTES", "PIECE_BLOCKS", "MEMBER_TILES", "MIN_TILE_BYTES", "MAX_TILE_BYTES", "PAGE_CRCS",
           "DELTA_MEMBER_SUFFIX", "SHARD_METADATA", "IndexDelta", "INDEX_FORMAT", "INDEX_VERSION", "DONE_FORMAT", "BLOCKS_FORMAT", "INCARNATION",
           "PieceEntry", "TensorEntry", "Member", "TableRef", "Layout", "Box", "Placed", "BlockTable", "ShardIndex",
           "DoneRecord", "DoneTensor", "parse_done", "check_parsable", "check_tensor", "check_boxes", "check_share",
           "share_bytes", "key_entry_bytes", "member_entry_bytes", "check_member_bytes", "seal",
           "block_rows", "piece_block_rows", "piece_cut", "tile_bytes", "block_crcs", "band_digests", "band_crc64s",
           "crc_band_digests", "CRC_DIGESTS", "DIGEST_HEX",
           "row_bytes", "rows_of", "strip_columns", "STRIPED_FROM", "STRIP_ROW_BYTES", "STRIP_BLOCKS"]

INDEX_FORMAT = "weightstore-sharded"
#: the version of index this weightstore writes: 3, whose block tables are paged
#: (:class:`BlockTable`); 2 (tables read whole) and 1 (no tables) still read
INDEX_VERSION = 3
DONE_FORMAT = "weightstore-shard-done"
#: bytes a checksummed block holds, about: a reader of a region fetches at most one block more
#: than it needs at each end of each piece it touches
BLOCK_BYTES = 256 << 10
#: pieces at least this large whose rows are long are stored as column strips (:func:`strip_columns`)
STRIPED_FROM = 64 << 10
#: a strip's bytes per row, about: a reader of a column range fetches at most this much more per row
STRIP_ROW_BYTES = 256
#: checksummed blocks a strip has, at most, so the index of a large piece stays a small
#: fraction of it (one CRC-32, about 11 bytes of JSON, per block)
STRIP_BLOCKS = 64
#: hex digits of a block's digest (BLAKE3's 256 bits, of its band's bytes or of its CRCs)
DIGEST_HEX = 64
_HEX_DIGEST = re.compile(rf"[0-9a-f]{{{DIGEST_HEX}}}")
BLOCKS_FORMAT = "weightstore-shard-blocks"

# -- how blocks are cut (the bounds on what an index holds are in weightstore.core.limits) ------
#: a block is cut to hold at least this many bytes (whole rows), so a small piece's table stays
#: under 4 bytes of CRC-32 per KiB. 16 KiB made readers of 4-16 FSDP ranks' small pieces (a
#: 7.6 MB LLaMA-shaped model) fetch 1.18-1.45x their share, whole pieces at their regions'
#: edges; 1 KiB, 1.00-1.02x
MIN_BLOCK_BYTES = 1 << 10
#: a block of a column strip (a *tile*) holds at least :func:`tile_bytes` of its member's size:
#: a member's table has about :data:`MEMBER_TILES` CRC-32s (256 KiB), or tiles of
#: :data:`MIN_TILE_BYTES` in a small member. A reader fetches only the CRC-32s of the blocks it
#: reads (:meth:`BlockTable.pages_of`), so small tiles cost a small member little, while a large
#: member's table stays bounded: a 405B model's reader of 1/1,000 fetches under 1 MB of index
#: (docs/sharded.md, Bounds). A flat 6 KiB made readers of thirds of a 24 MB model's 48-row pieces
#: fetch 1.13x their share (tiles of 6 rows, strips of 256 columns)
MEMBER_TILES = 1 << 16
MIN_TILE_BYTES = 256
MAX_TILE_BYTES = 16 << 10
#: a piece is cut into about this many blocks (between :data:`MIN_BLOCK_BYTES` and
#: :data:`BLOCK_BYTES` each): a reader whose region ends inside a piece fetches at most one
#: block more at that end, 1/64 of the piece
PIECE_BLOCKS = 64
#: a job incarnation's identity in a done-record: drawn once per launch of a job, so that two
#: launches writing one step and attempt (a preempted job's zombie and its replacement) are told apart
INCARNATION = re.compile(r"[0-9A-Za-z._:-]{1,64}")


def index_name(step: int) -> str:
    """The index's name: a version file of the folder, named like a plain version."""
    return f"step-{step:012d}.wsindex"


def attempt_folder(step: int, attempt: int) -> str:
    """The folder the members and done-records of one attempt at a step live in, beside the index."""
    return f"step-{step:012d}.attempt-{attempt}"


#: the suffixes a member may have: one per format a member is written in
MEMBER_SUFFIXES = (".safetensors", ".npz", ".h5")
#: the member metadata entry that maps each stored name to its global key, start and shape
SHARD_METADATA = "weightstore-shard"
#: the suffix of a member written as a delta of its rank's member of an older version
#: (:func:`weightstore.formats.delta.open_member`)
DELTA_MEMBER_SUFFIX = ".wsdelta"


def member_name(rank: int, suffix: str = ".safetensors") -> str:
    return f"rank-{rank:05d}{suffix}"


def _member_names(rank: int, folder: str = "", *, deltas: bool = True) -> set[str]:
    """The names rank ``rank``'s member may have (in ``folder``), one per member format
    (``deltas=False``: not a delta member, which indexes before block tables cannot describe)."""
    suffixes = (*MEMBER_SUFFIXES, DELTA_MEMBER_SUFFIX) if deltas else MEMBER_SUFFIXES
    return {folder + member_name(rank, suffix) for suffix in suffixes}


def done_name(rank: int) -> str:
    return f"rank-{rank:05d}.done"


def table_name(rank: int) -> str:
    """The name of rank ``rank``'s block table, beside its member."""
    return f"rank-{rank:05d}.blocks"


#: the file rank 0 creates, create-only, in each attempt folder it hands out, naming its launch
#: (``claimed_attempt``); readers ignore it
CLAIM = "claimed-by"
#: an attempt folder's name (a step past 12 digits, a timestamp, is longer): ASCII digits and
#: nothing after them (``\d`` takes ``٣``, ``$`` a final newline)
_ATTEMPT_FOLDER = re.compile(r"step-([0-9]{12,})\.attempt-([0-9]+)\Z")
#: a rank's file in an attempt folder: its member (of any format, or a delta), block table
#: (:func:`table_name`) or done-record (:func:`done_name`); ASCII digits and nothing after them
RANK_FILE = re.compile("^rank-[0-9]{5,}(" + "|".join(
    re.escape(suffix) for suffix in (*MEMBER_SUFFIXES, DELTA_MEMBER_SUFFIX, ".blocks", ".done")) + ")\\Z")


def attempt_of(name: str) -> tuple[int, int] | None:
    """``(step, attempt)`` of a folder named exactly as :func:`attempt_folder` names one; ``None``
    for any other name (``….attempt-01``, ``….attempt-0`` and a newline, ``….attempt-old``): a
    folder weightstore never made, which no listing, prune or clean takes for an attempt."""
    match = _ATTEMPT_FOLDER.match(name)
    if match is None:
        return None
    step, attempt = int(match.group(1)), int(match.group(2))
    return (step, attempt) if attempt_folder(step, attempt) == name else None


def written_in_attempt(name: str) -> bool:
    """Whether weightstore writes a file named ``name`` in an attempt folder: a rank's file
    (:data:`RANK_FILE`), the :data:`CLAIM`, or a temporary of one. Removing an attempt folder
    removes only these: whatever else is in it, a user put there."""
    if name.startswith(".") and TEMP_MARK in name:
        name = name[1:name.index(TEMP_MARK)]
    return name == CLAIM or RANK_FILE.match(name) is not None


def rows_of(shape: Sequence[int]) -> int:
    """Rows along the first axis (a scalar is one row)."""
    return shape[0] if shape else 1


def row_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of one row along the first axis, C order."""
    return math.prod(shape[1:]) * itemsize


def block_rows(shape: Sequence[int], itemsize: int) -> int:
    """Rows a block of a piece of ``shape`` held in an index of version 1: about :data:`BLOCK_BYTES`, at least one row."""
    return max(1, BLOCK_BYTES // max(1, row_bytes(shape, itemsize)))


def piece_block_rows(shape: Sequence[int], itemsize: int) -> int:
    """Rows a block of a piece of ``shape`` holds: about 1/:data:`PIECE_BLOCKS` of the piece,
    within :data:`MIN_BLOCK_BYTES` and :data:`BLOCK_BYTES`, at least one row. A region that
    ends inside a piece fetches at most one block more there, so a reader's excess over its
    share is a sixty-fourth of the pieces it cuts, or 1 KiB of a small one."""
    each = max(1, row_bytes(shape, itemsize))
    return max(1, min(BLOCK_BYTES // each, max(MIN_BLOCK_BYTES // each, -(-rows_of(shape) // PIECE_BLOCKS))))


def strip_columns(shape: Sequence[int], itemsize: int, world: int = 1) -> int | None:
    """Columns (along the second axis) of the strips a piece of ``shape`` is stored as, or None
    to store it whole.

    A piece is stored in C order, so its rows are contiguous and a reader of some of its
    columns would fetch whole rows: half the columns cost twice their bytes. A piece of at
    least :data:`STRIPED_FROM` bytes whose rows hold four strips or more is therefore stored
    as full-height strips of a power-of-two number of columns, each about
    :data:`STRIP_ROW_BYTES` a row (at most :data:`MAX_STRIPS` of them, fewer when ``world``
    ranks each holding a piece of the tensor would take it past :data:`MAX_PIECES_PER_KEY`),
    each its own member
    entry and piece: a reader of a column range fetches the strips it touches, and a reader
    of a row range the rows it needs from each strip. Power-of-two widths make the usual
    halves and quarters fetch exactly their bytes; any other column range fetches at most one
    partial strip at each end.
    """
    if len(shape) < 2 or math.prod(shape) * itemsize < STRIPED_FROM:
        return None
    cell = math.prod(shape[2:]) * itemsize  # bytes of one (row, column)
    columns = 1 << (max(1, STRIP_ROW_BYTES // max(1, cell)).bit_length() - 1)
    most = min(MAX_STRIPS, MAX_PIECES_PER_KEY // (2 * max(1, world)))  # room for a second piece per rank
    while -(-shape[1] // columns) > most and columns < shape[1]:
        columns *= 2
    return columns if columns * 4 <= shape[1] else None


def tile_bytes(member_bytes: int) -> int:
    """The bytes a tile holds at least in a member of ``member_bytes`` (see :data:`MEMBER_TILES`)."""
    return min(MAX_TILE_BYTES, max(MIN_TILE_BYTES, member_bytes // MEMBER_TILES))


def piece_cut(shape: Sequence[int], itemsize: int, tile: int = MAX_TILE_BYTES) -> tuple[int, int]:
    """How a piece of ``shape`` is stored: ``(columns, rows)``, the width of its column strips
    (0: stored whole) and the rows of each block.

    A piece stored whole has blocks of :func:`piece_block_rows`. A piece of long rows is stored
    as column strips (:func:`strip_columns`: about :data:`STRIP_ROW_BYTES` a row), whose blocks
    (a strip's rows, a *tile*) must hold at least ``tile`` bytes (:func:`tile_bytes` of the
    member) or a sixty-fourth of the piece if less: the rows of a tile, a power of two, double
    first (up to an eighth of the piece: a reader of a row range fetches at most that more at
    each end; the usual cuts of FSDP-style pieces, at multiples of a power of two, fall on tile
    edges), then its columns (a reader of a column range fetches at most a strip more at each end;
    power-of-two widths cut halves and quarters exactly). Too few strips left: stored whole.
    """
    rows = piece_block_rows(shape, itemsize)
    columns = strip_columns(shape, itemsize)
    if columns is None:
        return 0, rows
    cell = math.prod(shape[2:]) * itemsize
    rows = min(shape[0], 1 << (max(rows, -(-shape[0] // STRIP_BLOCKS)) - 1).bit_length())
    most_rows = max(rows, 1 << (max(1, shape[0] // 8).bit_length() - 1))
    tile = min(tile, max(MIN_TILE_BYTES, math.prod(shape) * itemsize // PIECE_BLOCKS))
    while rows * columns * cell < tile:
        if rows < most_rows:
            rows = min(most_rows, rows * 2)
        else:
            columns *= 2
            if columns * 4 > shape[1]:
                return 0, piece_block_rows(shape, itemsize)
    return columns, rows


def block_crcs(data: np.ndarray, block_bytes: int) -> list[int]:
    """The CRC-32 of each block of ``block_bytes`` of a stored tensor (a piece, or a column strip
    of one: C order, contiguous), the last one shorter: slices of one byte view (a strip's
    blocks hold a few KiB, where an array slice and the general checksum call per block cost
    more than the checksum)."""
    view = raw_bytes(data)
    if not block_bytes or not len(view):
        return []
    checksum = checksums.crc32 if block_bytes >= checksums.RELEASE_GIL_BYTES else isal_zlib.crc32  # large: GIL let go
    return [checksum(view[at : at + block_bytes]) for at in range(0, len(view), block_bytes)]  # both unsigned


def band_digests(piece: np.ndarray, rows: int) -> list[bytes]:
    """The BLAKE3 digest of each band of ``rows`` rows of a piece (its stored bytes, C order,
    contiguous; the last band shorter): the block digests of a table without ``digest`` in its
    header (every table before :data:`CRC_DIGESTS`, and a writer whose ISA-L has no CRC-64).
    One pass over the piece in the caller's memory, in bands of the whole piece's width."""
    view = raw_bytes(piece)
    step = rows * row_bytes(piece.shape, piece.itemsize) if piece.size else 0
    if not step:
        return []
    return [blake3.blake3(view[at : at + step]).digest() for at in range(0, len(view), step)]


def band_crc64s(piece: np.ndarray, rows: int) -> list[int] | None:
    """The CRC-64 of each band of ``rows`` rows of a piece (as :func:`band_digests` cuts them),
    or None where ISA-L's CRC-64 is not available (:func:`weightstore.core.checksums.crc64`):
    one pass over the piece in the caller's memory, 0.04 CPU-s/GB (BLAKE3: 0.26)."""
    if checksums.crc64(memoryview(b"")) is None:
        return None
    view = raw_bytes(piece)
    step = rows * row_bytes(piece.shape, piece.itemsize) if piece.size else 0
    if not step:
        return []
    return [checksums.crc64(view[at : at + step]) or 0 for at in range(0, len(view), step)]


def crc_band_digests(crc64s: Sequence[int], strip_crcs: Sequence[Sequence[int]]) -> list[bytes]:
    """The block digests of a table whose header says :data:`CRC_DIGESTS`: per band, the BLAKE3
    (in its own key-derivation context, so it never equals a digest of bytes) of the band's
    CRC-64 and its blocks' CRC-32s (one a strip, in strip order; a piece stored whole: its one
    block). A *change digest*: a band whose bytes changed keeps it only if the change is a
    multiple of both CRC polynomials, about 2^-96 for a change not chosen to collide, and
    nothing a writer computes beyond one CRC-64 pass (docs/sharded.md says whom it is trusted
    against: the version's author is not)."""
    tiles = np.array(strip_crcs, "<u4").reshape(len(strip_crcs), -1).T
    base = blake3.blake3(derive_key_context=_CRC_DIGEST_CONTEXT)
    digests = []
    for crc, row in zip(crc64s, tiles, strict=True):
        hasher = base.copy()
        hasher.update(int(crc).to_bytes(8, "little") + row.tobytes())
        digests.append(hasher.digest())
    return digests


@dataclass(frozen=True)
class PieceEntry:
    """One stored run of a piece, placed: its box in the tensor, its bytes in its member, its
    blocks' CRC-32s and digests (``blocks``: None where they were not recorded, or not
    fetched). An index of version 1 holds these itself, one per column strip; a version 2 index
    holds :class:`Box` es, which a reader places through their member's :class:`BlockTable`."""

    member: int
    start: tuple[int, ...]
    shape: tuple[int, ...]
    offset: int
    rows: int
    crcs: tuple[int, ...]
    digest: str
    blocks: tuple[str, ...] | None = None
    #: whether ``blocks`` are change digests (:func:`crc_band_digests`), not BLAKE3 of bytes
    crc_digests: bool = False

    def to_json(self) -> dict[str, Any]:
        found = {"member": self.member, "start": list(self.start), "shape": list(self.shape), "offset": self.offset,
                 "rows": self.rows, "crcs": list(self.crcs), "digest": self.digest}
        return found if self.blocks is None else found | {"blake3": list(self.blocks)}


@dataclass(frozen=True)
class Box:
    """A piece as a version 2 index names it: which member holds it, where it sits in the tensor."""

    member: int
    start: tuple[int, ...]
    shape: tuple[int, ...]


class Layout:
    """The boxes that tile the tensors of one partitioning, as arrays (a reader of a 64 MB index
    makes no object per box; it picks the boxes a region touches, :meth:`boxes_in`). Keys that
    are cut alike share one: a version's index grows with the partitionings, not the keys."""

    def __init__(self, members: np.ndarray, starts: np.ndarray, shapes: np.ndarray):
        self.members, self.starts, self.shapes = members, starts, shapes

    @property
    def ndim(self) -> int:
        return int(self.starts.shape[1])

    def __len__(self) -> int:
        return len(self.members)

    def boxes_in(self, bounds: Sequence[tuple[int, int]]) -> list[Box]:
        """The non-empty boxes that hold part of the region ``bounds`` (``(start, stop)`` per axis)."""
        lo = np.array([b[0] for b in bounds], np.int64).reshape(1, -1)
        hi = np.array([b[1] for b in bounds], np.int64).reshape(1, -1)
        ends = self.starts + self.shapes
        hit = np.all((self.starts < hi) & (ends > lo), axis=1) & np.all(self.shapes > 0, axis=1)
        return [Box(int(self.members[i]), tuple(self.starts[i].tolist()), tuple(self.shapes[i].tolist()))
                for i in np.flatnonzero(hit)]

    def to_json(self) -> list[int]:
        return [self.ndim, *np.concatenate([self.members.reshape(-1, 1), self.starts, self.shapes], axis=1)
                .reshape(-1).tolist()]

    @classmethod
    def of(cls, boxes: Sequence[Box], ndim: int) -> Layout:
        members = np.array([b.member for b in boxes], np.int64)
        starts = np.array([b.start for b in boxes], np.int64).reshape(len(boxes), ndim)
        shapes = np.array([b.shape for b in boxes], np.int64).reshape(len(boxes), ndim)
        return cls(members, starts, shapes)


@dataclass(frozen=True)
class TensorEntry:
    """A key: its dtype, global shape and pieces (``pieces``: an index of version 1's, placed;
    ``layout``: a version 2 index's boxes)."""

    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[PieceEntry, ...] = ()
    layout: Layout | None = None

    @property
    def itemsize(self) -> int:
        return logical_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "pieces": [p.to_json() for p in self.pieces]}


@dataclass(frozen=True)
class TableRef:
    """What the index says of a member's block table: ``head`` bytes whose BLAKE3 is ``blake3``,
    and ``digests`` bytes of block digests (what a follower fetches too; the header carries
    their BLAKE3; 0: a table of none, from ``publish_shard(digests=False)``). A *paged* table
    (index version 3) has its header alone in its head, then its CRC-32s in pages a reader
    fetches as it needs them (:meth:`BlockTable.pages_of`), then the digests; an older one has
    header and CRC-32s in its head, fetched whole."""

    head: int
    digests: int
    blake3: str
    paged: bool = False
    #: the table's bytes where head and digests cannot say them (a paged table without digests,
    #: whose CRC-32s only its header counts): given in its done-record, for the commit's check
    crcs: int | None = None

    @property
    def blocks(self) -> int:
        """The blocks the digests cover (0 in a table without digests)."""
        return self.digests // DIGEST_BYTES

    @property
    def digests_at(self) -> int:
        """Where the digests start in the table."""
        return self.head + (4 * self.blocks if self.paged else 0)

    @property
    def size(self) -> int | None:
        """The table file's bytes: its head, its paged CRC-32s, its digests; ``None`` for a paged
        table without digests whose done-record did not give its CRC-32s' bytes (at least ``head``)."""
        if self.paged and not self.digests:
            return None if self.crcs is None else self.head + self.crcs
        return self.digests_at + self.digests


@dataclass(frozen=True)
class Member:
    """One rank's file: its name relative to the index's folder, its size in bytes, and (version 2) its block table."""

    file: str
    size: int
    rank: int
    table: TableRef | None = None

    def table_file(self) -> str:
        """The block table's name, relative to the index's folder."""
        return f"{self.file.rsplit('/', 1)[0]}/{table_name(self.rank)}" if "/" in self.file else table_name(self.rank)


def key_entry_bytes(key: str, dtype: str, shape: Sequence[int], layout: int) -> int:
    """Bytes a key's entry takes in a version 2 index (a layout number as long as ``layout``)."""
    return len(orjson.dumps({key: [dtype, list(shape), layout]})) - 1


def member_entry_bytes(file: str, size: int, table: TableRef) -> int:
    """Bytes a member's entry takes in a version 2 index, its commas included."""
    return len(orjson.dumps([file.rsplit("/", 1)[-1], size, table.head, table.digests, table.blake3])) + 1


def share_bytes(boxes: Sequence[Box], world: int) -> int:
    """Bytes ``boxes`` take in a version 2 index as a rank's at most (each box as its member
    number, start and shape, written out, with commas); identical layouts of several keys are
    written once, so the index holds less."""
    rank_digits = len(str(max(0, world - 1)))
    return sum(rank_digits + 1 + sum(len(str(v)) + 1 for v in b.start) + sum(len(str(v)) + 1 for v in b.shape)
               for b in boxes)


def check_share(*, world: int, keys: Mapping[str, tuple[str, tuple[int, ...]]], boxes: Sequence[Box],
                member: tuple[str, int, TableRef], where: str) -> None:
    """That what one rank adds to its version's index keeps the index under :data:`MAX_INDEX_BYTES`,
    before the rank writes anything: its member entry and boxes within its share
    (``(MAX_INDEX_BYTES - KEY_BYTES - RESERVED_BYTES) // world``), its keys' entries within
    :data:`KEY_BYTES` (the commit checks the union of every rank's keys against it too).

    Raises:
        SizeLimitError: naming ``where`` (the member) and what to change.
    """
    layout_digits = len(str(max(1, len(keys))))
    keyed = sum(key_entry_bytes(key, dtype, shape, 10 ** (layout_digits - 1)) + 1
                for key, (dtype, shape) in keys.items())
    if keyed > KEY_BYTES:
        raise SizeLimitError(f"the entries of this rank's keys ({len(keys)}) would take {keyed} bytes of the version's "
                             f"index, over the {KEY_BYTES} its keys may take (docs/sharded.md, Bounds); publish fewer "
                             "keys per version", path=where)
    share = (MAX_INDEX_BYTES - KEY_BYTES - RESERVED_BYTES) // max(1, world)
    mine = member_entry_bytes(*member) + share_bytes(boxes, world)
    if mine > share:
        raise SizeLimitError(f"this rank's {len(boxes)} pieces would take {mine} bytes of the version's index, over "
                             f"the {share} bytes each of {world} ranks may add to it (docs/sharded.md, Bounds); "
                             "hold fewer, larger pieces per rank (column strips do not count)", path=where)


@dataclass(frozen=True)
class IndexDelta:
    """What an index of a version with delta members says of its chain: the indexes of the
    versions its members build on (the newest first, down to the anchor: what retention keeps),
    the bytes of the members since the anchor, this version's included, and of its tensors (what
    decides the next anchor)."""

    chain: tuple[str, ...]
    chain_bytes: int
    full_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"chain": list(self.chain), "chain_bytes": self.chain_bytes, "full_bytes": self.full_bytes}

    @classmethod
    def parse(cls, raw: Any, step: int) -> IndexDelta:
        if not isinstance(raw, dict) or not isinstance(raw.get("chain"), list) or not raw["chain"] or \
                len(raw["chain"]) > MAX_DELTA_CHAIN:
            raise FormatError(f"delta is not an object of a chain of 1 to {MAX_DELTA_CHAIN} indexes and sizes")
        steps = [int(found.group(1)) if isinstance(name, str) and (found := _INDEX_NAME.fullmatch(name)) else None
                 for name in raw["chain"]]
        if None in steps or any(b >= a for a, b in zip([step, *steps], steps, strict=False)):  # type: ignore[operator]
            raise FormatError("delta names a chain that is not of indexes of lower steps, each lower than the one "
                              "before")
        return cls(tuple(raw["chain"]), _count(raw.get("chain_bytes"), "delta chain_bytes"),
                   _count(raw.get("full_bytes"), "delta full_bytes"))


_INDEX_NAME = re.compile(rf"step-([0-9]{{12,{VERSION_NAME_DIGITS}}})\.wsindex")


@dataclass
class ShardIndex:
    step: int
    attempt: int
    world: int
    created: str
    members: list[Member]
    tensors: dict[str, TensorEntry]
    metadata: dict[str, Any] = field(default_factory=dict)
    producer: str = ""
    version: int = 3
    layouts: list[Layout] = field(default_factory=list)
    #: set where some member is a delta (:data:`DELTA_MEMBER_SUFFIX`)
    delta: IndexDelta | None = None

    def to_json(self) -> bytes:
        head = {"format": INDEX_FORMAT, "version": self.version, "step": self.step, "attempt": self.attempt,
                "world": self.world, "created": self.created, "producer": self.producer, "metadata": self.metadata}
        if self.delta is not None:
            head["delta"] = self.delta.to_json()
        if self.version == 1:
            return seal(head | {
                "members": [{"file": m.file, "size": m.size, "rank": m.rank} for m in self.members],
                "tensors": {key: entry.to_json() for key, entry in self.tensors.items()}})
        numbers = {id(layout): at for at, layout in enumerate(self.layouts)}
        tables = [m.table or TableRef(0, 0, "") for m in self.members]
        return seal(head | {
            "members": {"files": [m.file.rsplit("/", 1)[-1] for m in self.members],
                        "sizes": [m.size for m in self.members], "heads": [t.head for t in tables],
                        "digests": [t.digests for t in tables], "blake3": [t.blake3 for t in tables]},
            "layouts": [layout.to_json() for layout in self.layouts],
            "tensors": {key: [entry.dtype, list(entry.shape), numbers[id(entry.layout)]]
                        for key, entry in self.tensors.items()},
        })

    @classmethod
    def parse(cls, data: bytes) -> ShardIndex:
        """An index read from a file (version 1, 2 or 3), every field checked (see the module docstring)."""
        raw = _document(data, INDEX_FORMAT, MAX_V1_INDEX_BYTES, (1, 2, INDEX_VERSION))
        if raw["version"] != 1 and len(data) > MAX_INDEX_BYTES:
            raise FormatError(f"is over {MAX_INDEX_BYTES} bytes; not a {INDEX_FORMAT} file")
        step, attempt, world = (_count(raw.get(name), name) for name in ("step", "attempt", "world"))
        metadata = raw.get("metadata", {})
        if not isinstance(metadata, dict):
            raise FormatError("metadata is not an object")
        refuse_deep(metadata, "metadata")
        created, producer = text_field(raw, "created", "the index's"), text_field(raw, "producer", "the index's")
        if raw["version"] != 1:
            members = _members_v2(raw.get("members"), step, attempt, world, paged=raw["version"] == INDEX_VERSION)
            layouts = _layouts(raw.get("layouts"), world)
            tensors = _tensors_v2(raw.get("tensors"), layouts, members, nbytes=len(data))
            delta = None if raw.get("delta") is None else IndexDelta.parse(raw["delta"], step)
            if delta is None and any(m.file.endswith(DELTA_MEMBER_SUFFIX) for m in members):
                raise FormatError("names delta members, and no chain of the versions they build on")
            return cls(step, attempt, world, created, members, tensors, metadata, producer, raw["version"], layouts,
                       delta)
        members_raw = raw.get("members")
        if not isinstance(members_raw, list) or len(members_raw) != world:
            raise FormatError(f"the index must name {world} members, one per rank")
        members = []
        for rank, entry in enumerate(members_raw):
            if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or entry.get("rank") != rank:
                raise FormatError(f"member {rank} is not a file entry of rank {rank}")
            expected = f"{attempt_folder(step, attempt)}/{member_name(rank)}"
            if entry["file"] not in _member_names(rank, f"{attempt_folder(step, attempt)}/", deltas=False):
                raise FormatError(f"member {rank} must be {expected!r} (or another member format's suffix), "
                                  f"not {entry['file'][:200]!r}")
            members.append(Member(entry["file"], _count(entry.get("size"), f"member {rank} size"), rank))
        tensors = _tensors(raw.get("tensors"), members, nbytes=len(data))
        check_member_bytes(tensors, members)
        return cls(step, attempt, world, created, members, tensors, metadata, producer, 1)


def _members_v2(raw: Any, step: int, attempt: int, world: int, *, paged: bool) -> list[Member]:
    columns = ("files", "sizes", "heads", "digests", "blake3")
    if not isinstance(raw, dict) or not all(isinstance(raw.get(name), list) and len(raw[name]) == world
                                            for name in columns):
        raise FormatError(f"members is not an object of {', '.join(columns)}: {world} of each, one per rank")
    folder = f"{attempt_folder(step, attempt)}/"
    members = []
    for rank, (file, size, head, digests, digest) in enumerate(zip(*(raw[name] for name in columns), strict=True)):
        if not isinstance(file, str) or file not in _member_names(rank):
            raise FormatError(f"member {rank} must be {member_name(rank)!r} (or another member format's suffix), "
                              f"not {str(file)[:200]!r}")
        if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest):
            raise FormatError(f"member {rank}'s block table digest is not {DIGEST_HEX} hex digits")
        head, digests = _count(head, f"member {rank}'s block table head"), _count(digests, f"member {rank} digests")
        if head > MAX_TABLE_HEADER_BYTES + 4 * MAX_TABLE_BLOCKS + 16 or digests != 8 * (digests // 8) or \
                digests > DIGEST_BYTES * MAX_TABLE_BLOCKS:
            raise FormatError(f"member {rank}'s block table is not of a size a table has ({head} + {digests} bytes)")
        members.append(Member(folder + file, _count(size, f"member {rank} size"), rank,
                              TableRef(head, digests, digest, paged)))
    return members


def _layouts(raw: Any, world: int) -> list[Layout]:
    if not isinstance(raw, list):
        raise FormatError("layouts is not a list")
    layouts = []
    for at, flat in enumerate(raw):
        if not isinstance(flat, list) or not flat or not all(type(v) is int and 0 <= v < MAX_INDEX_INTEGER
                                                             for v in flat):
            raise FormatError(f"layout {at} is not a list of non-negative integers below 2**62")
        ndim = flat[0]
        stride = 1 + 2 * ndim
        if ndim > MAX_NDIM or (len(flat) - 1) % stride:
            raise FormatError(f"layout {at} is not {ndim}-dimensional boxes (member, start, shape)")
        if (len(flat) - 1) // stride > MAX_PIECES_PER_KEY:
            raise FormatError(f"layout {at} has {(len(flat) - 1) // stride} pieces, over {MAX_PIECES_PER_KEY}")
        table = np.array(flat[1:], np.int64).reshape(-1, stride)
        if len(table) and int(table[:, 0].max()) >= world:
            raise FormatError(f"layout {at} has a piece in member {int(table[:, 0].max())}, of {world}")
        layouts.append(Layout(table[:, 0].copy(), table[:, 1 : 1 + ndim].copy(), table[:, 1 + ndim :].copy()))
    return layouts


def _tensors_v2(raw: Any, layouts: list[Layout], members: list[Member], *, nbytes: int = 0) -> dict[str, TensorEntry]:
    if not isinstance(raw, dict):
        raise FormatError("tensors is not an object")
    tensors = {}
    checked: set[tuple[int, tuple[int, ...]]] = set()
    shape_of: dict[int, tuple[int, ...]] = {}  # the shape each layout was first checked against
    budget = OverlapBudget(nbytes)
    for key, entry in raw.items():
        _check_key(key)
        if not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], str) or \
                type(entry[2]) is not int or not 0 <= entry[2] < len(layouts):
            raise FormatError(f"is not a tensor entry [dtype, shape, layout] of one of {len(layouts)} layouts", key=key)
        try:
            itemsize = logical_dtype(entry[0]).itemsize
        except WeightStoreError:
            raise FormatError(f"has unknown dtype {entry[0][:40]!r}", key=key) from None
        shape = _counts(entry[1], "shape", key)
        if not fits_an_array(shape, itemsize):
            raise FormatError(f"has a shape {list(shape)} too large for any array", key=key)
        layout = layouts[entry[2]]
        if layout.ndim != len(shape):
            raise FormatError(f"has shape {list(shape)} and a layout of {layout.ndim}-dimensional pieces", key=key)
        if (entry[2], shape) not in checked:  # keys of one shape and layout: checked once
            first = shape_of.setdefault(entry[2], shape)
            if first != shape and 0 not in shape:  # boxes that tile one shape exactly tile no other
                raise FormatError(f"its pieces do not cover it: its layout {entry[2]} tiles shape {list(first)}, not "
                                  f"{list(shape)}", key=key)
            check_boxes(key, shape, layout, members, budget=budget)
            checked.add((entry[2], shape))
        tensors[key] = TensorEntry(entry[0], shape, (), layout)
    return tensors


@dataclass(frozen=True)
class DoneTensor:
    """What a done-record says of one key: dtype, global shape, and each piece's start, shape and
    digest (of its bands' digests: replicas written alike are told apart by it at the commit)."""

    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[tuple[tuple[int, ...], tuple[int, ...], str], ...]


@dataclass(frozen=True)
class DoneRecord:
    """What one rank says it wrote: its member file (name in the attempt folder, size), its block
    table (:class:`TableRef`) and its pieces' boxes. No block of them: those are in the table."""

    step: int
    attempt: int
    rank: int
    world: int
    member: Member
    tensors: dict[str, DoneTensor]
    #: which launch of the job wrote it (:data:`INCARNATION`); "" in records of a weightstore
    #: before incarnations, or of a rank that ran outside any cluster
    incarnation: str = ""
    #: the step of the version a delta member builds on (``None``: the member is full)
    base: int | None = None

    def to_json(self) -> bytes:
        table = self.member.table or TableRef(0, 0, "")
        return seal({
            "format": DONE_FORMAT, "version": 3 if table.paged else 2, "step": self.step, "attempt": self.attempt, "rank": self.rank,
            "world": self.world, "member": {"file": self.member.file, "size": self.member.size},
            **({"incarnation": self.incarnation} if self.incarnation else {}),
            **({"base": self.base} if self.base is not None else {}),
            "table": [table.head, table.digests, table.blake3, *([] if table.crcs is None else [table.crcs])],
            "tensors": {key: [entry.dtype, list(entry.shape), [[*start, *shape, digest]
                                                              for start, shape, digest in entry.pieces]]
                        for key, entry in self.tensors.items()},
        })


def parse_done(data: bytes) -> DoneRecord:
    """A done-record read from a rank's folder, every field checked."""
    raw = _document(data, DONE_FORMAT, MAX_DONE_BYTES, (1, 2, 3))
    if raw["version"] == 1:
        raise FormatError("is a done-record of version 1, written by a weightstore before block tables: this "
                          "weightstore cannot commit its attempt; publish the step again (every rank, a new attempt) "
                          "or run ws clean")
    step, attempt, rank, world = (_count(raw.get(name), name) for name in ("step", "attempt", "rank", "world"))
    member_raw, table = raw.get("member"), raw.get("table")
    if not isinstance(member_raw, dict) or not isinstance(member_raw.get("file"), str):
        raise FormatError("member is not a file entry")
    if member_raw["file"] not in _member_names(rank):
        raise FormatError(f"member must be {member_name(rank)!r} (or another member format's suffix)")
    if not isinstance(table, list) or len(table) not in (3, 4) or not isinstance(table[2], str) or \
            not _HEX_DIGEST.fullmatch(table[2]):
        raise FormatError("table is not [head bytes, digest bytes, BLAKE3 of the head(, CRC-32 bytes)]")
    crcs = _count(table[3], "table CRC-32 bytes") if len(table) == 4 else None
    if crcs is not None and (crcs % 4 or crcs > 4 * MAX_TABLE_BLOCKS or raw["version"] != 3 or table[1] != 0):
        raise FormatError(f"table CRC-32 bytes {crcs} is not of a size a table has, or given for a table whose head "
                          "and digests say it (only a paged table without digests gives it)")
    ref = TableRef(_count(table[0], "table head"), _count(table[1], "table digests"), table[2], raw["version"] == 3,
                   crcs)
    member = Member(member_raw["file"], _count(member_raw.get("size"), "member size"), rank, ref)
    incarnation = raw.get("incarnation", "")
    if not isinstance(incarnation, str) or (incarnation and not INCARNATION.fullmatch(incarnation)):
        raise FormatError(f"incarnation is not a job incarnation ({INCARNATION.pattern})")
    base = raw.get("base")
    if (base is None) == member.file.endswith(DELTA_MEMBER_SUFFIX) or (base is not None and (
            _count(base, "base") >= step)):
        raise FormatError("base must name the lower step a delta member builds on, and only a delta member's")
    tensors_raw = raw.get("tensors")
    if not isinstance(tensors_raw, dict):
        raise FormatError("tensors is not an object")
    tensors = {}
    for key, entry in tensors_raw.items():
        _check_key(key)
        if not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], str) or \
                not isinstance(entry[2], list):
            raise FormatError("is not a tensor entry [dtype, shape, pieces]", key=key)
        try:
            logical_dtype(entry[0])
        except WeightStoreError:
            raise FormatError(f"has unknown dtype {entry[0][:40]!r}", key=key) from None
        shape = _counts(entry[1], "shape", key)
        if len(entry[2]) > MAX_PIECES_PER_KEY:
            raise FormatError(f"has {len(entry[2])} pieces, over {MAX_PIECES_PER_KEY}", key=key)
        pieces = []
        for piece in entry[2]:
            if not isinstance(piece, list) or len(piece) != 2 * len(shape) + 1 or not isinstance(piece[-1], str) \
                    or len(piece[-1]) > 80:
                raise FormatError(f"has a piece that is not [start, shape, digest] of {len(shape)} axes", key=key)
            numbers = tuple(_count(v, "a piece's start and shape", key) for v in piece[:-1])
            pieces.append((numbers[: len(shape)], numbers[len(shape) :], piece[-1]))
        tensors[key] = DoneTensor(entry[0], shape, tuple(pieces))
    return DoneRecord(step, attempt, rank, world, member, tensors, incarnation, base)


#: bytes of one block's digest in a block table
DIGEST_BYTES = 32
#: what a table's block digests are when its header's ``digest`` says so: :func:`crc_band_digests`.
#: A header without it (every table before) holds :func:`band_digests`, BLAKE3 of each band's bytes
CRC_DIGESTS = "crc64+crc32"
_CRC_DIGEST_CONTEXT = "weightstore 2026-12 sharded block change digest: CRC-64/XZ of a band, CRC-32 of its blocks"
_TABLE_MAGIC = b"WSBLOCKS"


@dataclass(frozen=True)
class Placed:
    """One piece in its member's block table: its key, dtype and box, the width of its column
    strips (0: stored whole), rows per block, its first block in the table, and each strip's
    offset in the member (strips are full height, in column order)."""

    key: str
    dtype: str
    start: tuple[int, ...]
    shape: tuple[int, ...]
    columns: int
    rows: int
    first: int
    offsets: tuple[int, ...]

    @property
    def strips(self) -> int:
        return -(-self.shape[1] // self.columns) if self.columns else 1

    def strip_box(self, strip: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if not self.columns:
            return self.start, self.shape
        at = strip * self.columns
        return ((self.start[0], self.start[1] + at, *self.start[2:]),
                (self.shape[0], min(self.columns, self.shape[1] - at), *self.shape[2:]))

    def strip_bytes(self, strip: int) -> int:
        return math.prod(self.strip_box(strip)[1]) * logical_dtype(self.dtype).itemsize

    @property
    def blocks_per_strip(self) -> int:
        return -(-rows_of(self.shape) // self.rows) if self.rows and math.prod(self.shape) else 0

    def flat(self) -> list[Any]:
        """As its table's header lists it; strips that follow one another in the member (as a
        safetensors member holds them) by their first offset alone."""
        offsets = self.offsets
        if len(offsets) > 1 and all(offsets[i] + self.strip_bytes(i) == offsets[i + 1] for i in range(len(offsets) - 1)):
            offsets = offsets[:1]
        return [self.key, self.dtype, len(self.start), *self.start, *self.shape, self.columns, self.rows, self.first,
                len(self.offsets), *offsets]


#: CRC-32s one page of a paged block table holds (8 KiB): a reader fetches the pages that hold
#: its blocks' CRC-32s, each checked against its BLAKE3 in the table's header
PAGE_CRCS = 2048


def stored_order(pieces: Sequence[Placed], blocks: int) -> np.ndarray:
    """Where each block's CRC-32 lies in a paged table (``position[block]``): in order of the
    middle of the rows the block holds, as a fraction of its piece's rows (ties in block order).
    A reader of the same rows of every piece a member holds (an FSDP rank of another world
    size: the bottom half of each) needs the CRC-32s of one run of the table, not a few of
    every piece's, so it fetches the pages of that run and no other."""
    middles = np.zeros(blocks, np.float64)
    for piece in pieces:
        count = piece.blocks_per_strip
        if count:
            middles[piece.first : piece.first + count * piece.strips] = np.tile(
                (2 * np.arange(count) + 1) / (2 * count), piece.strips)
    order = np.lexsort((np.arange(blocks), middles))
    position = np.empty(blocks, np.int64)
    position[order] = np.arange(blocks)
    return position


class BlockTable:
    """One member's block table (``rank-00003.blocks``): where each of its pieces lies in it and
    a CRC-32 and a digest per block. The file: ``WSBLOCKS``, the header's length (8 bytes,
    little-endian), the header (sealed JSON: step, attempt, rank, member, its size, the blocks,
    the BLAKE3 of the digests, each piece as :meth:`Placed.flat`, and the BLAKE3 of each page
    of CRC-32s), the CRC-32s (4 bytes each, little-endian, in :func:`stored_order`, in pages of
    :data:`PAGE_CRCS`) and the digests (32 bytes each, in block order: each block's band's,
    :func:`crc_band_digests` where the header's ``digest`` says :data:`CRC_DIGESTS`, else
    :func:`band_digests`; none in a member published with ``digests=False``, whose regions
    have no digest and are read again by every follower). The index gives the
    size and BLAKE3 of the header; a reader fetches it, then the pages of CRC-32s of the blocks
    it reads. A table of an index of version 2 (header version 1) has its CRC-32s in block order
    inside its head, which a reader fetches whole."""

    def __init__(self, *, step: int, attempt: int, rank: int, member: str, size: int, pieces: list[Placed],
                 crcs: np.ndarray, digests: bytes | None, digests_blake3: str, pages: list[str] | None = None,
                 digest_kind: str | None = None):
        self.step, self.attempt, self.rank, self.member, self.size = step, attempt, rank, member, size
        self.digest_kind = digest_kind  # CRC_DIGESTS, or None: BLAKE3 of each band's bytes
        self.pieces, self.crcs, self.digests, self.digests_blake3 = pieces, crcs, digests, digests_blake3
        self._by_box = {(p.key, p.start): p for p in pieces}
        self.position = stored_order(pieces, len(crcs))
        self.order = np.argsort(self.position)
        if pages is None:  # written here: every CRC-32 known
            stored = self.crcs[self.order].astype("<u4").tobytes()
            pages = [blake3.blake3(stored[at : at + 4 * PAGE_CRCS]).hexdigest()
                     for at in range(0, len(stored), 4 * PAGE_CRCS)]
            self.have = np.ones(len(pages), bool)
        else:
            self.have = np.zeros(len(pages), bool)
        self.pages = pages
        self.paged = True

    def head_bytes(self) -> bytes:
        """The header, as a paged table starts (what the index's head size and BLAKE3 are of)."""
        header = seal({"format": BLOCKS_FORMAT, "version": 2, "step": self.step, "attempt": self.attempt,
                       "rank": self.rank, "member": self.member, "size": self.size, "blocks": len(self.crcs),
                       "blake3": self.digests_blake3, "pieces": [p.flat() for p in self.pieces],
                       "pages": self.pages, **({"digest": self.digest_kind} if self.digest_kind else {})})
        return _TABLE_MAGIC + len(header).to_bytes(8, "little") + header

    def body_bytes(self) -> bytes:
        """What follows the header: the CRC-32s in :func:`stored_order`, then the digests."""
        return self.crcs[self.order].astype("<u4").tobytes() + (self.digests or b"")

    def ref(self) -> TableRef:
        head = self.head_bytes()
        return TableRef(len(head), len(self.digests or b""), blake3.blake3(head).hexdigest(), True,
                        None if self.digests else 4 * len(self.crcs))

    def find(self, key: str, start: tuple[int, ...]) -> Placed | None:
        return self._by_box.get((key, start))

    def pages_of(self, blocks: np.ndarray) -> list[tuple[int, int]]:
        """The runs ``(first page, pages)`` of CRC-32s not fetched yet that hold those of ``blocks``."""
        if not self.paged or not len(blocks):
            return []
        wanted = np.unique(self.position[blocks] // PAGE_CRCS)
        wanted = wanted[~self.have[wanted]].tolist()
        runs: list[list[int]] = []
        for page in wanted:
            if runs and runs[-1][0] + runs[-1][1] == page:
                runs[-1][1] += 1
            else:
                runs.append([page, 1])
        return [(first, count) for first, count in runs]

    def page_span(self, first: int, count: int, head: int) -> tuple[int, int]:
        """``(offset, bytes)`` in the table file of ``count`` pages from ``first`` (``head``: the header's size)."""
        stop = min(len(self.crcs), (first + count) * PAGE_CRCS)
        return head + 4 * first * PAGE_CRCS, 4 * (stop - first * PAGE_CRCS)

    def take_pages(self, first: int, data: bytes) -> None:
        """Pages of CRC-32s from ``first``, fetched: each refused unless its BLAKE3 is the header's."""
        for at in range(0, len(data), 4 * PAGE_CRCS):
            page = first + at // (4 * PAGE_CRCS)
            chunk = data[at : at + 4 * PAGE_CRCS]
            if page >= len(self.pages) or blake3.blake3(chunk).hexdigest() != self.pages[page]:
                raise ChecksumError(f"its page {page} of CRC-32s does not match the BLAKE3 its header gives")
            stored = page * PAGE_CRCS
            self.crcs[self.order[stored : stored + len(chunk) // 4]] = np.frombuffer(chunk, "<u4")
            self.have[page] = True

    def placed(self, piece: Placed, member: int, digests: bool = False) -> list[PieceEntry]:
        """``piece`` as the stored runs a reader fetches: one :class:`PieceEntry` a strip, with
        its blocks' CRC-32s (and digests, once :meth:`take_digests` has them and ``digests``).
        A block whose CRC-32 was not fetched (:meth:`pages_of`) gets 2**32, which no block's
        CRC-32 is: reading it is refused as damage, never trusted."""
        found = []
        count = piece.blocks_per_strip
        for strip in range(piece.strips):
            start, shape = piece.strip_box(strip)
            first = piece.first + strip * count
            values = self.crcs[first : first + count].astype(np.int64)
            if self.paged:
                values[~self.have[self.position[first : first + count] // PAGE_CRCS]] = 1 << 32
            blocks = None
            if digests and self.digests is not None:
                blocks = tuple(self.digests[at * DIGEST_BYTES : (at + 1) * DIGEST_BYTES].hex()
                               for at in range(first, first + count))
            found.append(PieceEntry(member, start, shape, piece.offsets[strip], piece.rows, tuple(values.tolist()),
                                    "", blocks, self.digest_kind == CRC_DIGESTS))
        return found

    def take_digests(self, data: bytes) -> None:
        """The table's digests, fetched: refused unless their BLAKE3 is the header's."""
        if len(data) != DIGEST_BYTES * len(self.crcs) or blake3.blake3(data).hexdigest() != self.digests_blake3:
            raise ChecksumError("its block digests do not match the BLAKE3 its header gives")
        self.digests = data

    @classmethod
    def parse_head(cls, data: bytes, ref: TableRef, member: Member, step: int, attempt: int,
                   extent: int | None = None) -> BlockTable:
        """The head of ``member``'s table (a paged table's header; an older one's header and
        CRC-32s), checked: its BLAKE3 is the index's (``ref``), its header names this member,
        step and attempt, and its pieces lie inside the member without sharing a byte, their
        strips and blocks as their shapes say. ``extent``: the bytes a delta member rebuilds
        (its stored tensors end to end, in its manifest's order), which its pieces lie in instead."""
        if len(data) != ref.head or blake3.blake3(data).hexdigest() != ref.blake3:
            raise ChecksumError("is not the block table the index names (its size or BLAKE3 differs)")
        if data[:8] != _TABLE_MAGIC:
            raise FormatError(f"is not a {BLOCKS_FORMAT} file")
        length = int.from_bytes(data[8:16], "little")
        if 16 + length > len(data) or (len(data) - 16 - length) % 4 or (ref.paged and 16 + length != len(data)):
            raise FormatError(f"has a header of {length} bytes that its {len(data)} do not hold with whole CRC-32s")
        raw = _document(data[16 : 16 + length], BLOCKS_FORMAT, MAX_TABLE_HEADER_BYTES, (2,) if ref.paged else (1,))
        blocks = _count(raw.get("blocks"), "blocks")
        crcs = np.zeros(blocks, np.uint32) if ref.paged else np.frombuffer(data, "<u4", offset=16 + length).astype(
            np.uint32)
        if blocks != len(crcs) or blocks > MAX_TABLE_BLOCKS:
            raise FormatError(f"says {blocks} blocks and holds {len(crcs)} CRC-32s (at most {MAX_TABLE_BLOCKS})")
        if (raw.get("step"), raw.get("attempt"), raw.get("rank"), raw.get("member"), raw.get("size")) != (
                step, attempt, member.rank, member.file.rsplit("/", 1)[-1], member.size):
            raise FormatError(f"is not the table of {member.file} ({member.size} bytes) of step {step} attempt "
                              f"{attempt}")
        digest = raw.get("blake3")
        if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest) or ref.digests not in (
                0, DIGEST_BYTES * blocks):  # 0: written without digests
            raise FormatError("has no BLAKE3 of its digests, or the index gives another count of them")
        kind = raw.get("digest")
        if kind not in (None, CRC_DIGESTS):
            raise FormatError(f"has block digests of a kind this weightstore does not know ({str(kind)[:64]!r}): "
                              "a newer weightstore wrote it")
        pages = raw.get("pages") if ref.paged else []
        if not isinstance(pages, list) or (ref.paged and len(pages) != -(-blocks // PAGE_CRCS)) or not all(
                isinstance(page, str) and _HEX_DIGEST.fullmatch(page) for page in pages):
            raise FormatError(f"has no BLAKE3 of each page of {PAGE_CRCS} of its {blocks} CRC-32s")
        pieces = _placed(raw.get("pieces"), blocks, member, member.size if extent is None else extent)
        table = cls(step=step, attempt=attempt, rank=member.rank, member=raw["member"], size=member.size,
                    pieces=pieces, crcs=crcs, digests=None if blocks else b"", digests_blake3=digest, pages=pages,
                    digest_kind=kind)
        table.paged = ref.paged
        return table


def _placed(raw: Any, blocks: int, member: Member, extent: int) -> list[Placed]:
    if not isinstance(raw, list):
        raise FormatError("pieces is not a list")
    pieces: list[Placed] = []
    spans: list[tuple[int, int, str]] = []
    seen: set[tuple[str, tuple[int, ...]]] = set()
    first = 0
    for flat in raw:
        if not isinstance(flat, list) or len(flat) < 4 or not isinstance(flat[0], str) or \
                not isinstance(flat[1], str) or type(flat[2]) is not int:
            raise FormatError("has a piece that is not [key, dtype, ndim, start, shape, columns, rows, first, "
                              "strips, offsets]")
        key, dtype, ndim = flat[0], flat[1], flat[2]
        try:
            validate_key(key)
            itemsize = logical_dtype(dtype).itemsize
        except WeightStoreError as exc:
            raise FormatError(f"has a piece of an invalid key or dtype ({exc.message})", key=key[:200]) from None
        if not 0 <= ndim <= MAX_NDIM or len(flat) < 3 + 2 * ndim + 4:
            raise FormatError("has a piece too short for its axes", key=key)
        numbers = [_count(v, "a piece's field", key) for v in flat[3:]]
        start, shape = tuple(numbers[:ndim]), tuple(numbers[ndim : 2 * ndim])
        columns, rows, at, strips = numbers[2 * ndim : 2 * ndim + 4]
        offsets = tuple(numbers[2 * ndim + 4 :])
        piece = Placed(key, dtype, start, shape, columns, rows, at, offsets)
        if (columns and (ndim < 2 or not shape[1])) or strips != piece.strips or strips > MAX_STRIPS or \
                len(offsets) not in (1, strips):
            raise FormatError(f"has a piece of shape {list(shape)} with {len(offsets)} strip offsets for {strips} "
                              f"strips of {columns} columns", key=key)
        if len(offsets) < strips:  # strips end to end
            ends = np.cumsum([offsets[0]] + [piece.strip_bytes(i) for i in range(strips - 1)]).tolist()
            piece = Placed(key, dtype, start, shape, columns, rows, at, tuple(ends))
            offsets = piece.offsets
        nbytes = math.prod(shape) * itemsize
        if (columns and (ndim < 2 or not shape[1])) or strips != len(offsets) or strips != piece.strips:
            raise FormatError(f"has a piece of shape {list(shape)} with {len(offsets)} strip offsets for strips of "
                              f"{columns} columns", key=key)
        if (nbytes and not rows) or at != first:
            raise FormatError("has a piece whose blocks are not the next in the table", key=key)
        first += strips * piece.blocks_per_strip
        if first > blocks:
            raise FormatError(f"has pieces whose blocks number over the table's {blocks}", key=key)
        if (key, start) in seen:
            raise FormatError(f"has two pieces at {list(start)}", key=key)
        seen.add((key, start))
        for strip, offset in enumerate(offsets):
            length = piece.strip_bytes(strip)
            if offset + length > extent:
                raise FormatError(f"has a piece at byte {offset} of {length} bytes, past the end of member "
                                  f"{member.file} ({extent} bytes)", key=key)
            if length:
                spans.append((offset, offset + length, key))
        pieces.append(piece)
    if first != blocks:
        raise FormatError(f"has pieces of {first} blocks, and {blocks} CRC-32s")
    spans.sort()
    for (_, end, _), (start_at, _, key) in zip(spans, spans[1:], strict=False):
        if start_at < end:
            raise FormatError(f"has a piece whose bytes overlap another's in member {member.file}", key=key)
    return pieces


#: how a sealed document ends: its CRC-32, of every byte before this trailer
_SEAL = re.compile(rb',"crc32":(\d{1,10})\}\s*$')


def seal(document: dict[str, Any]) -> bytes:
    """``document`` as JSON ending in the CRC-32 of the bytes before it, so damage to any key,
    offset or checksum in it is found before it is believed (a hostile writer can recompute it:
    the checks of :func:`check_tensor` do not rely on it)."""
    body = orjson.dumps(document)[:-1]
    return body + b',"crc32":%d}' % crc32(np.frombuffer(body, np.uint8))


def check_parsable(data: bytes, kind: str, limit: int, error: type[WeightStoreError] = FormatError) -> None:
    """That a reader will parse ``data``: at most ``limit`` bytes, and at most one JSON object
    or array per :data:`BYTES_PER_CONTAINER` (so what its parse allocates stays a few times
    its size). A coordinator checks its index with it before committing it."""
    if len(data) > limit:
        raise error(f"is over {limit} bytes; not a {kind} file")
    try:
        refuse_dense(data, BYTES_PER_CONTAINER, kind)
    except UnsafeFileError as exc:
        if issubclass(UnsafeFileError, error):
            raise
        raise error(exc.message) from None


def _document(data: bytes, kind: str, limit: int, versions: tuple[int, ...] = (1,)) -> dict[str, Any]:
    check_parsable(data, kind, limit)
    trailer = _SEAL.search(data[-32:])
    if trailer is None:
        raise FormatError(f"is not a {kind} file (no checksum at its end)")
    body = data[: len(data) - 32 + trailer.start()] if len(data) > 32 else data[: trailer.start()]
    if crc32(np.frombuffer(body, np.uint8)) != int(trailer.group(1)):
        raise FormatError(f"is corrupt (its CRC-32 does not match); not a readable {kind} file")
    try:
        raw = orjson.loads(data)
    except orjson.JSONDecodeError:
        raw = None
    if not isinstance(raw, dict) or raw.get("format") != kind:
        raise FormatError(f"is not a {kind} file")
    if raw.get("version") not in versions:
        raise FormatError(f"is {kind} version {raw.get('version')!r}; this weightstore reads version "
                          f"{' or '.join(map(str, versions))}")
    return raw


def _count(value: Any, what: str, key: str | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < MAX_INDEX_INTEGER:
        raise FormatError(f"{what} is not a non-negative integer below 2**62", key=key)
    return value


def _counts(value: Any, what: str, key: str, length: int | None = None) -> tuple[int, ...]:
    if not isinstance(value, list) or (length is not None and len(value) != length) or len(value) > MAX_NDIM:
        raise FormatError(f"{what} is not a list of {length if length is not None else 'at most ' + str(MAX_NDIM)} "
                          "integers", key=key)
    return tuple(_count(v, what, key) for v in value)


def _tensors(raw: Any, members: list[Member], *, own: bool = False, nbytes: int = 0) -> dict[str, TensorEntry]:
    if not isinstance(raw, dict):
        raise FormatError("tensors is not an object")
    tensors = {}
    budget = OverlapBudget(nbytes)
    for key, entry in raw.items():
        _check_key(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("pieces"), list):
            raise FormatError("is not a tensor entry with pieces", key=key)
        try:
            logical_dtype(entry["dtype"] if isinstance(entry.get("dtype"), str) else "")
        except WeightStoreError:
            raise FormatError(f"has unknown dtype {str(entry.get('dtype'))[:40]!r}", key=key) from None
        shape = _counts(entry.get("shape"), "shape", key)
        if not fits_an_array(shape, logical_dtype(entry["dtype"]).itemsize):  # (0, 2**61): nothing, yet no array
            raise FormatError(f"has a shape {list(shape)} too large for any array", key=key)
        if len(entry["pieces"]) > MAX_PIECES_PER_KEY:
            raise FormatError(f"has {len(entry['pieces'])} pieces, over {MAX_PIECES_PER_KEY}", key=key)
        pieces = tuple(_piece(p, key, len(shape), len(members), own) for p in entry["pieces"])
        tensors[key] = TensorEntry(entry["dtype"], shape, pieces)
        if not own:
            check_tensor(key, tensors[key], members, budget=budget)
    return tensors


def _piece(raw: Any, key: str, ndim: int, members: int, own: bool) -> PieceEntry:
    if not isinstance(raw, dict):
        raise FormatError("has a piece that is not an object", key=key)
    member = 0 if own and "member" not in raw else _count(raw.get("member"), "a piece's member", key)
    if member >= members:
        raise FormatError(f"has a piece in member {member}, of {members}", key=key)
    crcs = raw.get("crcs")
    if not isinstance(crcs, list) or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 1 << 32
                                             for c in crcs):
        raise FormatError("has a piece whose crcs are not CRC-32 values", key=key)
    digest = raw.get("digest")
    if not isinstance(digest, str) or len(digest) > 80:
        raise FormatError("has a piece without a digest", key=key)
    blocks = raw.get("blake3")
    if blocks is not None and (not isinstance(blocks, list) or not all(  # counts: checked against the blocks
            isinstance(b, str) and _HEX_DIGEST.fullmatch(b) for b in blocks)):
        raise FormatError(f"has a piece whose blake3 is not a list of {DIGEST_HEX}-digit hex digests, one per "
                          "block", key=key)
    rows = _count(raw.get("rows"), "a piece's rows", key)
    return PieceEntry(member, _counts(raw.get("start"), "a piece's start", key, ndim),
                      _counts(raw.get("shape"), "a piece's shape", key, ndim),
                      _count(raw.get("offset"), "a piece's offset", key), rows, tuple(crcs), digest,
                      None if blocks is None else tuple(blocks))


def check_tensor(key: str, entry: TensorEntry, members: Sequence[Member],
                 error: type[WeightStoreError] = FormatError, budget: OverlapBudget | None = None) -> None:
    """An index of version 1's key: its pieces as :func:`check_boxes` checks boxes, and each
    inside its member, its block checksums and digests as many as its blocks."""
    if len(entry.pieces) > MAX_PIECES_PER_KEY:
        raise error(f"has {len(entry.pieces)} pieces, over {MAX_PIECES_PER_KEY}", key=key)
    itemsize = entry.itemsize
    for piece in entry.pieces:
        if any(s + n > d for s, n, d in zip(piece.start, piece.shape, entry.shape, strict=True)):
            raise error(f"has a piece at {list(piece.start)} of shape {list(piece.shape)} outside its shape "
                        f"{list(entry.shape)}", key=key)
        nbytes = math.prod(piece.shape) * itemsize
        if piece.offset + nbytes > members[piece.member].size:
            raise error(f"has a piece at byte {piece.offset} of {nbytes} bytes, past the end of member "
                        f"{members[piece.member].file} ({members[piece.member].size} bytes)", key=key)
        blocks = -(-rows_of(piece.shape) // piece.rows) if piece.rows and nbytes else 0
        if (nbytes and not piece.rows) or len(piece.crcs) != blocks:
            raise error(f"has a piece with {len(piece.crcs)} block checksums for {blocks} blocks", key=key)
        if piece.blocks is not None and len(piece.blocks) != blocks:
            raise error(f"has a piece with {len(piece.blocks)} block digests for {blocks} blocks", key=key)
    check_boxes(key, entry.shape, Layout.of([Box(p.member, p.start, p.shape) for p in entry.pieces], len(entry.shape)),
                members, error, budget)


def check_boxes(key: str, shape: tuple[int, ...], layout: Layout, members: Sequence[Member],
                error: type[WeightStoreError] = FormatError, budget: OverlapBudget | None = None) -> None:
    """That ``key`` (of ``shape``) has at most :data:`MAX_PIECES_PER_KEY` pieces (a coordinator
    merging every rank's pieces checks the sum, which no done-record alone bounds: an index
    over it would be committed and then refused by every reader), that they lie in the tensor,
    never overlap, and cover it. ``budget``: the comparisons the whole index may still make."""
    if len(layout) > MAX_PIECES_PER_KEY:
        raise error(f"has {len(layout)} pieces, over {MAX_PIECES_PER_KEY}", key=key)
    ends = layout.starts + layout.shapes
    outside = np.flatnonzero(np.any(ends > np.array(shape, np.int64).reshape(1, -1), axis=1)) \
        if len(layout) and layout.ndim else np.zeros(0, np.int64)
    if len(outside):
        i = int(outside[0])
        raise error(f"has a piece at {layout.starts[i].tolist()} of shape {layout.shapes[i].tolist()} outside its "
                    f"shape {list(shape)}", key=key)
    _check_no_overlap(key, layout, members, error, OverlapBudget() if budget is None else budget)
    covered = sum(math.prod(box) for box in layout.shapes.tolist())
    if covered != math.prod(shape):
        raise error(f"its pieces do not cover it: they hold {covered} of its {math.prod(shape)} elements "
                    f"(shape {list(shape)}); a rank left a gap", key=key)


class OverlapBudget:
    """The pairs of pieces one index (or one commit) may still compare for overlap:
    :data:`OVERLAP_PAIRS`, or :data:`OVERLAP_PAIRS_PER_BYTE` for each of ``nbytes`` (the index's
    size, for a reader) where that is more."""

    def __init__(self, nbytes: int = 0) -> None:
        self.total = self.left = max(OVERLAP_PAIRS, OVERLAP_PAIRS_PER_BYTE * nbytes)

    def spend(self, pairs: int, key: str, error: type[WeightStoreError]) -> None:
        self.left -= pairs
        if self.left < 0:
            raise error(f"has pieces whose extents interleave along three axes or more: checking them against each "
                        f"other would take over {self.total} comparisons in this index; no layout of writers' parts "
                        "looks so", key=key)


def _check_no_overlap(key: str, layout: Layout, members: Sequence[Member], error: type[WeightStoreError],
                      budget: OverlapBudget) -> None:
    full = np.flatnonzero(np.all(layout.shapes > 0, axis=1)) if layout.ndim else np.arange(len(layout))
    if len(full) < 2:
        return
    ndim = max(1, layout.ndim)
    starts = layout.starts[full].reshape(len(full), -1) if layout.ndim else np.zeros((len(full), 1), np.int64)
    ends = starts + (layout.shapes[full].reshape(len(full), -1) if layout.ndim else 1)
    starts, ends = starts.reshape(len(full), ndim), ends.reshape(len(full), ndim)
    # two pieces overlap where they overlap along every axis; along an axis where every piece
    # spans the same extent (the whole tensor, where it is covered), all do, so only the axes
    # along which pieces differ decide
    split = np.flatnonzero((starts != starts[:1]).any(axis=0) | (ends != ends[:1]).any(axis=0))
    if len(split) <= 2:
        found = _sweep_overlap(starts[:, split], ends[:, split])
        if found is not None:
            ranks = [members[int(layout.members[full[at]])].rank for at in found]
            raise error(f"has pieces that overlap: at {starts[found[0]].tolist()} (rank {ranks[0]}) and "
                        f"{starts[found[1]].tolist()} (rank {ranks[1]})", key=key)
        return
    # a sweep along one axis compares each piece with those starting before it ends along that
    # axis: along the axis where that is fewest (column strips: the columns, not the rows)
    order, lasts, pairs = min((_sweep(starts, ends, axis) for axis in range(ndim)), key=lambda sweep: sweep[2].sum())
    starts, ends = starts[order], ends[order]
    budget.spend(int(pairs.sum()), key, error)
    for i in np.flatnonzero(pairs):
        last = int(lasts[i])
        hits = np.all((starts[i + 1 : last] < ends[i]) & (ends[i + 1 : last] > starts[i]), axis=1)
        if hits.any():
            j = i + 1 + int(np.argmax(hits))
            ranks = [members[int(layout.members[full[order[at]]])].rank for at in (i, j)]
            raise error(f"has pieces that overlap: at {starts[i].tolist()} (rank {ranks[0]}) and {starts[j].tolist()} "
                        f"(rank {ranks[1]})", key=key)


def _sweep_overlap(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int] | None:
    """Two boxes (rows of ``starts``/``ends``, at most 2 axes) that overlap, or None, in n log n.

    Boxes are taken in order of their start along the first axis; those still open there (not
    ended at or before it) hold intervals along the second axis that do not overlap, kept sorted,
    so a new box overlaps one of them exactly where it overlaps the one before or after its place.
    Two boxes that overlap are both open at the later start, so none is missed. With one axis,
    the intervals are the boxes themselves; with none, every box spans the tensor.
    """
    count, axes = starts.shape
    if axes == 0:
        return (0, 1) if count > 1 else None
    if axes == 1:
        order = np.argsort(starts[:, 0], kind="stable")
        hits = np.flatnonzero(starts[order[1:], 0] < ends[order[:-1], 0])
        return (int(order[hits[0]]), int(order[hits[0] + 1])) if hits.size else None
    order = np.argsort(starts[:, 0], kind="stable").tolist()
    first_starts, first_ends = starts[:, 0].tolist(), ends[:, 0].tolist()
    lows, highs = starts[:, 1].tolist(), ends[:, 1].tolist()
    ending: list[tuple[int, int]] = []  # (end along the first axis, box) of the open boxes
    open_lows: list[int] = []  # their starts along the second axis, sorted; and which box each is
    open_boxes: list[int] = []
    for box in order:
        while ending and ending[0][0] <= first_starts[box]:
            _, done = heapq.heappop(ending)
            at = bisect.bisect_left(open_lows, lows[done])
            while open_boxes[at] != done:  # equal starts only where boxes of no extent share one
                at += 1
            del open_lows[at], open_boxes[at]
        at = bisect.bisect_left(open_lows, lows[box])
        if at > 0 and highs[open_boxes[at - 1]] > lows[box]:
            return open_boxes[at - 1], box
        if at < len(open_lows) and open_lows[at] < highs[box]:
            return open_boxes[at], box
        open_lows.insert(at, lows[box])
        open_boxes.insert(at, box)
        heapq.heappush(ending, (first_ends[box], box))
    return None


def _sweep(starts: np.ndarray, ends: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pieces in order along ``axis``: ``(order, lasts, pairs)``, where the pieces from ``i + 1``
    to ``lasts[i]`` (in that order) start before piece ``i`` ends, ``pairs[i]`` of them."""
    order = np.argsort(starts[:, axis], kind="stable")
    lasts = np.searchsorted(starts[order, axis], ends[order, axis], side="left")
    return order, lasts, np.maximum(lasts - np.arange(len(order)) - 1, 0)


def check_member_bytes(tensors: Mapping[str, TensorEntry], members: Sequence[Member]) -> None:
    """That no two pieces share bytes of a member: what readers allocate stays within the members' sizes."""
    spans: list[list[tuple[int, int, str]]] = [[] for _ in members]
    for key, entry in tensors.items():
        for piece in entry.pieces:
            nbytes = math.prod(piece.shape) * entry.itemsize
            if nbytes:
                spans[piece.member].append((piece.offset, piece.offset + nbytes, key))
    for member, found in zip(members, spans, strict=True):
        found.sort()
        for (_, end, _), (start, _, key) in zip(found, found[1:], strict=False):
            if start < end:
                raise FormatError(f"has a piece whose bytes overlap another's in member {member.file}",
                                  key=key)


def _check_key(key: str) -> None:
    """A key an index, table or done-record names, refused as the file's damage when it is no key."""
    try:
        validate_key(key)
    except InvalidKeyError as exc:
        raise FormatError(f"names an invalid key ({exc.message})", key=key) from None
