"""What a sharded version says about itself: the index, each rank's done-record, and their checks.

A sharded version is one index file (``step-000000000042.wsindex``) naming member files (one
per rank, each an ordinary safetensors, npz or HDF5 file) and, for every global key, the pieces that tile
it: where each sits in the global tensor (``start``, ``shape``), where its bytes lie in its
member (``offset``), and a CRC-32 and a BLAKE3 digest for each *block* of it (``rows`` rows
along its first axis, about :data:`BLOCK_BYTES`), so a reader of a region fetches and verifies
only the blocks that hold it, and a follower skips a region whose blocks' digests did not change
(the CRC-32 finds damage; only the digest, which cannot be forged, says "unchanged"). Each rank's done-record says the same of its own member; the coordinator merges the
done-records into the index without reading a tensor byte.

Both files are read as hostile input: :meth:`ShardIndex.parse` and :func:`parse_done` check
every field, and :func:`check_tensor` that the pieces of a key lie inside the tensor and inside
their member, never overlap (in the tensor, or in a member's bytes) and cover the tensor, so
nothing a reader allocates exceeds what the members hold. Errors name the key; the caller, which
knows the file, names it with :func:`weightstore.errors.naming`.
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

from weightstore.core._jsontext import refuse_deep, refuse_dense, text_field
from weightstore.core._tensortable import MAX_NDIM, fits_an_array
from weightstore.core.keys import validate_key
from weightstore.core.manifest import crc32, logical_dtype, raw_bytes
from weightstore.errors import FormatError, InvalidKeyError, UnsafeFileError, WeightStoreError

__all__ = ["index_name", "attempt_folder", "member_name", "MEMBER_SUFFIXES", "done_name", "BLOCK_BYTES", "INDEX_FORMAT", "DONE_FORMAT", "MAX_INDEX_BYTES", "MAX_DONE_BYTES", "BYTES_PER_CONTAINER", "MAX_PIECES_PER_KEY", "INCARNATION",
           "PieceEntry", "TensorEntry", "Member", "ShardIndex", "DoneRecord", "parse_done", "check_parsable", "check_tensor",
           "check_member_bytes", "seal",
           "block_rows", "block_crcs", "block_digests", "DIGEST_HEX", "row_bytes", "rows_of", "strip_columns", "STRIPED_FROM", "STRIP_ROW_BYTES",
           "MAX_STRIPS", "STRIP_BLOCKS"]

INDEX_FORMAT = "weightstore-sharded"
DONE_FORMAT = "weightstore-shard-done"
#: bytes a checksummed block holds, about: a reader of a region fetches at most one block more
#: than it needs at each end of each piece it touches
BLOCK_BYTES = 256 << 10
#: pieces at least this large whose rows are long are stored as column strips (:func:`strip_columns`)
STRIPED_FROM = 256 << 10
#: a strip's bytes per row, about: a reader of a column range fetches at most this much more per row
STRIP_ROW_BYTES = 256
#: strips one piece is cut into, at most
MAX_STRIPS = 256
#: checksummed blocks a strip has, at most, so the index of a large piece stays a small
#: fraction of it (one CRC-32, about 11 bytes of JSON, per block)
STRIP_BLOCKS = 64
#: hex digits of a block's BLAKE3 digest (all 256 bits: a shorter one could be made to collide)
DIGEST_HEX = 64
_HEX_DIGEST = re.compile(rf"[0-9a-f]{{{DIGEST_HEX}}}")
MAX_INDEX_BYTES = 256 << 20
MAX_DONE_BYTES = 64 << 20
#: a JSON object or array costs Python 56-64 bytes however short its text, so an index or a
#: done-record may hold at most one per this many bytes: a piece's entry takes 14 or more, and
#: 63 MB of empty lists parsed into 2 GB before this bound
BYTES_PER_CONTAINER = 8
#: pieces one key may have; the overlap check compares each piece with the ones beside it
MAX_PIECES_PER_KEY = 1 << 14
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


def member_name(rank: int, suffix: str = ".safetensors") -> str:
    return f"rank-{rank:05d}{suffix}"


def _member_names(rank: int, folder: str = "") -> set[str]:
    """The names rank ``rank``'s member may have (in ``folder``), one per member format."""
    return {folder + member_name(rank, suffix) for suffix in MEMBER_SUFFIXES}


def done_name(rank: int) -> str:
    return f"rank-{rank:05d}.done"


def rows_of(shape: Sequence[int]) -> int:
    """Rows along the first axis (a scalar is one row)."""
    return shape[0] if shape else 1


def row_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of one row along the first axis, C order."""
    return math.prod(shape[1:]) * itemsize


def block_rows(shape: Sequence[int], itemsize: int) -> int:
    """Rows a block of a piece of ``shape`` holds: about :data:`BLOCK_BYTES`, at least one row."""
    return max(1, BLOCK_BYTES // max(1, row_bytes(shape, itemsize)))


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


def block_crcs(data: np.ndarray, block_bytes: int) -> list[int]:
    """The CRC-32 of each block of ``block_bytes`` of a piece's stored bytes (``data``: uint8, C order)."""
    return [crc32(data[at : at + block_bytes]) for at in range(0, data.size, block_bytes)] if block_bytes else []


def block_digests(data: np.ndarray, block_bytes: int) -> list[str]:
    """The BLAKE3 digest (hex) of each block of a piece's stored bytes, as :func:`block_crcs`
    cuts them (slices of a memoryview: a strip's blocks are a few KiB, and an array slice per
    block cost half again as much as hashing it)."""
    view = raw_bytes(data)
    return [blake3.blake3(view[at : at + block_bytes]).hexdigest() for at in range(0, data.size, block_bytes)] \
        if block_bytes else []


@dataclass(frozen=True)
class PieceEntry:
    """One piece of a global tensor: its box in the tensor, its bytes in its member, its blocks'
    CRC-32s and BLAKE3 digests (``blocks``: None in an index written before they were recorded)."""

    member: int
    start: tuple[int, ...]
    shape: tuple[int, ...]
    offset: int
    rows: int
    crcs: tuple[int, ...]
    digest: str
    blocks: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        found = {"member": self.member, "start": list(self.start), "shape": list(self.shape), "offset": self.offset,
                 "rows": self.rows, "crcs": list(self.crcs), "digest": self.digest}
        return found if self.blocks is None else found | {"blake3": list(self.blocks)}


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[PieceEntry, ...]

    @property
    def itemsize(self) -> int:
        return logical_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "pieces": [p.to_json() for p in self.pieces]}


@dataclass(frozen=True)
class Member:
    """One rank's file: its name relative to the index's folder, and its size in bytes."""

    file: str
    size: int
    rank: int


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

    def to_json(self) -> bytes:
        return seal({
            "format": INDEX_FORMAT, "version": 1, "step": self.step, "attempt": self.attempt, "world": self.world,
            "created": self.created, "producer": self.producer, "metadata": self.metadata,
            "members": [{"file": m.file, "size": m.size, "rank": m.rank} for m in self.members],
            "tensors": {key: entry.to_json() for key, entry in self.tensors.items()},
        })

    @classmethod
    def parse(cls, data: bytes) -> ShardIndex:
        """An index read from a file, every field checked (see the module docstring)."""
        raw = _document(data, INDEX_FORMAT, MAX_INDEX_BYTES)
        step, attempt, world = (_count(raw.get(name), name) for name in ("step", "attempt", "world"))
        members_raw = raw.get("members")
        if not isinstance(members_raw, list) or len(members_raw) != world:
            raise FormatError(f"the index must name {world} members, one per rank")
        members = []
        for rank, entry in enumerate(members_raw):
            if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or entry.get("rank") != rank:
                raise FormatError(f"member {rank} is not a file entry of rank {rank}")
            expected = f"{attempt_folder(step, attempt)}/{member_name(rank)}"
            if entry["file"] not in _member_names(rank, f"{attempt_folder(step, attempt)}/"):
                raise FormatError(f"member {rank} must be {expected!r} (or another member format's suffix), "
                                  f"not {entry['file'][:200]!r}")
            members.append(Member(entry["file"], _count(entry.get("size"), f"member {rank} size"), rank))
        metadata = raw.get("metadata", {})
        if not isinstance(metadata, dict):
            raise FormatError("metadata is not an object")
        refuse_deep(metadata, "metadata")
        created, producer = text_field(raw, "created", "the index's"), text_field(raw, "producer", "the index's")
        tensors = _tensors(raw.get("tensors"), members, nbytes=len(data))
        check_member_bytes(tensors, members)
        return cls(step, attempt, world, created, members, tensors, metadata, producer)


@dataclass(frozen=True)
class DoneRecord:
    """What one rank says it wrote: its member file (name in the attempt folder, size) and pieces."""

    step: int
    attempt: int
    rank: int
    world: int
    member: Member
    tensors: dict[str, TensorEntry]
    #: which launch of the job wrote it (:data:`INCARNATION`); "" in records of a weightstore
    #: before incarnations, or of a rank that ran outside any cluster
    incarnation: str = ""

    def to_json(self) -> bytes:
        return seal({
            "format": DONE_FORMAT, "version": 1, "step": self.step, "attempt": self.attempt, "rank": self.rank,
            "world": self.world, "member": {"file": self.member.file, "size": self.member.size},
            **({"incarnation": self.incarnation} if self.incarnation else {}),
            "tensors": {key: entry.to_json() for key, entry in self.tensors.items()},
        })


def parse_done(data: bytes) -> DoneRecord:
    """A done-record read from a rank's folder, every field checked; pieces name member 0 (its own)."""
    raw = _document(data, DONE_FORMAT, MAX_DONE_BYTES)
    step, attempt, rank, world = (_count(raw.get(name), name) for name in ("step", "attempt", "rank", "world"))
    member_raw = raw.get("member")
    if not isinstance(member_raw, dict) or not isinstance(member_raw.get("file"), str):
        raise FormatError("member is not a file entry")
    if member_raw["file"] not in _member_names(rank):
        raise FormatError(f"member must be {member_name(rank)!r} (or another member format's suffix)")
    member = Member(member_raw["file"], _count(member_raw.get("size"), "member size"), rank)
    incarnation = raw.get("incarnation", "")
    if not isinstance(incarnation, str) or (incarnation and not INCARNATION.fullmatch(incarnation)):
        raise FormatError(f"incarnation is not a job incarnation ({INCARNATION.pattern})")
    return DoneRecord(step, attempt, rank, world, member, _tensors(raw.get("tensors"), [member], own=True),
                      incarnation)


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


def _document(data: bytes, kind: str, limit: int) -> dict[str, Any]:
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
    if raw.get("version") != 1:
        raise FormatError(f"is {kind} version {raw.get('version')!r}; this weightstore reads version 1")
    return raw


def _count(value: Any, what: str, key: str | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
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
        try:
            validate_key(key)
        except InvalidKeyError as exc:
            raise FormatError(f"names an invalid key ({exc.message})", key=key) from None
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
    """That ``key`` has at most :data:`MAX_PIECES_PER_KEY` pieces (a coordinator merging every
    rank's pieces checks the sum, which no done-record alone bounds: an index over it would be
    committed and then refused by every reader), that they lie in the tensor and their members,
    never overlap, and cover it. ``budget``: the comparisons the whole index may still make."""
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
    _check_no_overlap(key, entry, members, error, OverlapBudget() if budget is None else budget)
    covered = sum(math.prod(p.shape) for p in entry.pieces)
    if covered != math.prod(entry.shape):
        raise error(f"its pieces do not cover it: they hold {covered} of its {math.prod(entry.shape)} elements "
                    f"(shape {list(entry.shape)}); a rank left a gap", key=key)


#: pairs of pieces an index (or a commit) may compare for overlap, at least: pieces split along
#: three axes or more are compared pairwise (pieces split along at most two are checked by a sweep
#: in n log n, whatever their layout), and a 3-D grid of :data:`MAX_PIECES_PER_KEY` pieces asks
#: some 5 million pairs, about 0.5 s
OVERLAP_PAIRS = 1 << 24
#: and per byte of the index: a reader's budget grows with the text it parses, so checking an
#: index costs a bounded time per byte (about 0.3 microseconds a pair, so at most some 0.6 ms per
#: KB on top of the parse's 0.1-0.3). Before, a fixed 2**28 pairs let an 11 MB index of
#: "staircase" tilings, whose pieces interleave along both axes, cost 42 s
OVERLAP_PAIRS_PER_BYTE = 2


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


def _check_no_overlap(key: str, entry: TensorEntry, members: Sequence[Member], error: type[WeightStoreError],
                      budget: OverlapBudget) -> None:
    pieces = [p for p in entry.pieces if math.prod(p.shape)]
    if len(pieces) < 2:
        return
    ndim = max(1, len(entry.shape))
    starts = np.array([p.start or (0,) for p in pieces], np.int64).reshape(len(pieces), ndim)
    ends = starts + np.array([p.shape or (1,) for p in pieces], np.int64).reshape(len(pieces), ndim)
    # two pieces overlap where they overlap along every axis; along an axis every piece spans
    # whole, all do, so only the axes some piece splits decide
    split = np.flatnonzero((starts > 0).any(axis=0) | (ends < np.array(entry.shape or (1,), np.int64)).any(axis=0))
    if len(split) <= 2:
        found = _sweep_overlap(starts[:, split], ends[:, split])
        if found is not None:
            one, other = found
            raise error(f"has pieces that overlap: at {starts[one].tolist()} (rank {members[pieces[one].member].rank}) "
                        f"and {starts[other].tolist()} (rank {members[pieces[other].member].rank})", key=key)
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
            ranks = [members[pieces[order[at]].member].rank for at in (i, j)]
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
