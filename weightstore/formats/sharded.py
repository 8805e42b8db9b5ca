"""Reading a sharded version: its index opened as a store of global keys and global shapes.

``ws.open("step-000000000042.wsindex")`` (or a :class:`~weightstore.sync.Version` naming
one) gives a :class:`~weightstore.store._open.Store` like any other: ``store[key]`` assembles the whole
tensor from its pieces, ``store.read_region(key, region)`` only the part a tuple of slices
names. Either way the reader picks from the index the pieces that hold part of it, fetches the
headers of their members' block tables (once each, whose size and BLAKE3 the index gives) and
the pages of CRC-32s of the blocks it needs (:mod:`weightstore.formats._sharded_index`), then
from each member only the blocks that
intersect what is asked, in one ranged read per run of them, and verifies each block's CRC-32
before a byte of it is used. :meth:`ShardedReader.region_digest` says, from the index and the
block digests of the members that hold a region, whether its blocks changed between two
versions; :meth:`~ShardedReader.read_from` and :meth:`~ShardedReader.read_regions_from` rebuild a
version of delta members, stored run by stored run, onto the tensors or regions a follower holds
of an older one. Members are never opened as stores: the index and tables say where everything
is, so their headers are never fetched. An index of version 1 holds its block tables itself.

A local version holds its members open as files, at most :func:`open_files_limit` files at once
(a quarter of the soft limit on open files; a delta member holds its chain's files too): one
whose members fit is opened whole when it is opened, so pruning cannot pull it away from its
reader; a larger one (1,100 ranks under the default limit of 1,024 files) is checked member by
member at open (each exists, as large as the index says) and its members are opened as they are
read, the least recently read closed to make room, so a member pruned before it is read again is
refused as removed, as on object storage. A member is opened in the files left: a delta member
whose chain does not fit them is refused before a base opens, the idle members closed and it is
opened again in the whole budget; one whose chain alone holds more files than that is refused
when read (``SizeLimitError``), never opened to run out of descriptors.
"""

from __future__ import annotations

import bisect
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import blake3
import numpy as np
from isal import isal_zlib

from weightstore.core import checksums
from weightstore.core._tensortable import TensorInfo
from weightstore.core.limits import MAX_OPEN_MEMBER_FILES, MAX_V1_INDEX_BYTES
from weightstore.core.manifest import from_storage, raw_bytes, storage_dtype
from weightstore.errors import (
    ChecksumError,
    FormatError,
    KeyNotInStoreError,
    SizeLimitError,
    StoreClosedError,
    StoreNotFoundError,
    TargetError,
    WeightStoreError,
    naming,
    shown_key,
)
from weightstore.formats import Format, ReaderDefaults
from weightstore.formats import delta as delta_format
from weightstore.formats._sharded_index import (
    DELTA_MEMBER_SUFFIX,
    BlockTable,
    PieceEntry,
    Placed,
    ShardIndex,
    TensorEntry,
    band_crc64s,
    band_digests,
    crc_band_digests,
    row_bytes,
    rows_of,
)
from weightstore.io._buffer import aligned_array
from weightstore.io._local import check_range
from weightstore.io._ranges import RangedFile
from weightstore.io.location import location_of, on_filesystem
from weightstore.io.remote import RemoteFile
from weightstore.io.source import byte_source, read_whole

__all__ = ["FORMAT", "ShardedReader", "normalized_region", "open_files_limit", "blocks_in"]

Region = tuple[slice, ...]
#: remote members read at once for one region (each request of a member's ranges is itself concurrent)
_MEMBERS_AT_ONCE = 8


def open_files_limit() -> int:
    """The files one local sharded reader's members hold open at once (a delta member's chain
    counted): a quarter of this process's soft limit on open files (``RLIMIT_NOFILE``; 1,024 by
    default, so 256), leaving the rest to the process and to other readers, at least 4 and at
    most 1,024."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no such limit to ask (Windows)
        return 256
    if soft == resource.RLIM_INFINITY or soft < 0:
        return MAX_OPEN_MEMBER_FILES
    return max(4, min(MAX_OPEN_MEMBER_FILES, soft // 4))


def normalized_region(region: Any, shape: Sequence[int], key: str) -> list[tuple[int, int]]:
    """``(start, stop)`` along each axis for a tuple of slices (fewer than the axes: the rest whole).

    Every region reader goes through here, so all refuse alike what numpy would quietly clamp: a
    bound past the tensor's edge (``slice(20, 30)`` of 8 rows is a caller's mistake, not 0 rows).
    """
    if isinstance(region, slice):
        region = (region,)
    if not isinstance(region, tuple) or len(region) > len(shape) or not all(isinstance(s, slice) for s in region):
        raise TargetError(f"a region is a tuple of at most {len(shape)} slices, not {region!r}", key=key)
    bounds = []
    for axis, size in enumerate(shape):
        part = region[axis] if axis < len(region) else slice(None)
        try:
            start, stop, step = part.indices(size)
        except TypeError:
            raise TargetError(f"region {region!r} has bounds that are not integers", key=key) from None
        if step != 1:
            raise TargetError(f"region {region!r} has a step; regions are contiguous", key=key)
        if any(bound is not None and not -size <= bound <= size for bound in (part.start, part.stop)):
            raise TargetError(f"region {region!r} reaches outside the tensor's shape {list(shape)} (axis {axis} has "
                              f"{size})", key=key)
        bounds.append((start, max(start, stop)))
    return bounds


class ShardedReader(ReaderDefaults):
    """The :class:`~weightstore.formats.Reader` of a ``.wsindex`` file (see the module docstring)."""

    def __init__(self, index: ShardIndex, name: str, fs: Any = None):
        self.name = name
        self._index = index
        base = name.rsplit("/", 1)[0] if "/" in name else "."
        self._base, self._fs = base, fs
        self._remote = location_of(name).remote
        # the folder change digests are bound to: where it is, whatever name reached it (a
        # relative name means another folder from another working folder; a link, its target)
        self._folder = base if self._remote else os.path.realpath(location_of(base).text)
        self._digests: dict[str, str | None] = {}  # key -> its whole tensor's region_digest
        self._tables: list[BlockTable | None] = [None] * len(index.members)  # fetched once each, as needed
        self._tables_lock = threading.Lock()
        # open members, least recently read first, and how many reads use each (never closed while used)
        self._files: OrderedDict[int, RangedFile | _Rebuilt] = OrderedDict()
        self._users: dict[int, int] = {}
        self._lock = threading.Lock()
        self._closed = False  # a closed reader opens no member again (a plain reader's file is gone too)
        #: the files the open members hold, and how many they may (a remote member holds none)
        self._open_files = 0
        self._most_files = None if self._remote else open_files_limit()
        if self._remote:  # described now, asked its size when read
            return
        try:
            if not self._opened_whole():
                for position in range(len(index.members)):
                    self._check_size(position, self._stat_size(position))
        except BaseException:
            self.close()
            raise

    def _opened_whole(self) -> bool:
        """Every member opened now, where their files fit :func:`open_files_limit` (a version
        pruned while read keeps them); else none is left open."""
        assert self._most_files is not None
        if len(self._index.members) > self._most_files:
            return False
        for position in range(len(self._index.members)):
            room = self._most_files - self._open_files
            if room < 1:
                break
            try:  # a chain over the files left is refused before a base opens (read later, or refused then)
                found = self._files[position] = self._opened(position, room)
            except SizeLimitError:
                break
            self._open_files += found.files
        else:
            return True
        for found in self._files.values():
            found.close()
        self._files.clear()
        self._open_files = 0
        return False

    @property
    def index(self) -> ShardIndex:
        return self._index

    @property
    def metadata(self) -> dict[str, Any]:
        return self._index.metadata

    @property
    def created(self) -> str:
        return self._index.created

    @property
    def has_checksums(self) -> bool:
        return True

    def keys(self) -> list[str]:
        return list(self._index.tensors)

    def _entry(self, key: str) -> TensorEntry:
        entry = self._index.tensors.get(key)
        if entry is None:
            raise KeyNotInStoreError("no such tensor", path=self.name, key=key)
        return entry

    def info(self, key: str) -> TensorInfo:
        entry = self._entry(key)
        digest = self._digests.get(key, "")
        if digest == "":
            digest = self._digests[key] = self.region_digest(key, ())
        return TensorInfo(key, entry.dtype, entry.shape, entry.nbytes, None, digest)

    def region_digest(self, key: str, region: Any) -> str | None:
        """The content digest of the part of ``key`` that ``region`` names, for hot reload:
        BLAKE3 over the digests and boxes of the blocks that hold it, so it is equal while those
        blocks' bytes are, and reads no tensor byte (a version 2 index: the block digests of the
        members that hold the region, once each). ``change:`` where a block's digest is a change
        digest (:func:`~weightstore.formats._sharded_index.crc_band_digests`: equal bytes short of
        a change chosen to collide, which only the version's author could make), hashed with the
        versions' folder (where it is: a relative name resolved, a link followed), so it equals
        only the digests of versions of the same folder;
        ``blake3:`` where every one is BLAKE3 of bytes. None from an index written without block
        digests: such a region is always read again, never trusted to a CRC-32."""
        with naming(path=self.name):
            entry = self._entry(key)
            bounds = normalized_region(region, entry.shape, key)
            pieces = self._pieces(key, entry, bounds, digests=True)
        hasher = blake3.blake3(f"sharded|{entry.dtype}{list(entry.shape)}{bounds}".encode())
        kind = "blake3:"
        for piece in sorted(pieces, key=lambda piece: piece.start):
            read = _PieceRead.of(piece, entry, bounds)
            if read is None:
                continue
            if piece.blocks is None:
                return None
            blocks = piece.blocks[read.first : read.first + -(-read.rows // piece.rows)]
            hasher.update(f"|{list(piece.start)}{list(piece.shape)}{piece.rows}@{read.first}:".encode())
            hasher.update(",".join(blocks).encode())
            kind = "change:" if piece.crc_digests else kind
        if kind == "change:":  # trusted between versions of one folder only: another folder's never matches
            hasher.update(f"|folder {self._folder}".encode())
        return kind + hasher.hexdigest()

    def check_digests(self, key: str, stored: np.ndarray) -> None:
        """That every block digest recorded for ``key`` (what :meth:`region_digest` hashes, so
        what a follower's skip-unchanged trusts) is its band's, computed from ``stored``: the
        tensor's bytes in storage dtype, as a read just verified them block by block. A digest
        that lies would let a follower skip a region whose bytes changed; it is a
        :class:`ChecksumError` naming the member, the piece and the band. Checked where the
        digests can be made again: change digests (where ISA-L has CRC-64, as they were made)
        and BLAKE3 of bytes, in an index of version 2; a table without digests has none to lie."""
        with naming(path=self.name, key=key):
            entry = self._entry(key)
            if entry.layout is None:
                return
            bounds = [(0, n) for n in entry.shape]
            self._pieces(key, entry, bounds, digests=True)  # every table's digests and block CRC-32s fetched
            for box in entry.layout.boxes_in(bounds):
                table = self._table(box.member, digests=True)
                placed = table.find(key, box.start)
                assert placed is not None  # _pieces refused a table without it
                strips = table.placed(placed, box.member, digests=True)
                if not strips or strips[0].blocks is None or not math.prod(placed.shape):
                    continue
                piece = np.ascontiguousarray(stored[tuple(slice(at, at + n) for at, n in zip(placed.start, placed.shape,
                                                                                           strict=True))])
                if strips[0].crc_digests:
                    crc64s = band_crc64s(piece, placed.rows)
                    if crc64s is None:  # no CRC-64 here to make them again with
                        return
                    made = crc_band_digests(crc64s, [strip.crcs for strip in strips])
                else:
                    made = band_digests(piece, placed.rows)
                for band, digest in enumerate(made):
                    if any(strip.blocks is None or strip.blocks[band] != digest.hex() for strip in strips):
                        raise ChecksumError(f"the block digest of band {band} (rows {band * placed.rows} on) of its "
                                            f"piece at {list(placed.start)} in member "
                                            f"{self._index.members[box.member].file} is not its bytes': a follower "
                                            "would take that band for unchanged when it changed")

    def member_path(self, position: int) -> str:
        return f"{self._base}/{self._index.members[position].file}"

    def chain_payload(self, keys: list[str], held: str | None) -> int | None:
        """Bytes :meth:`read_from` fetches to rebuild ``keys`` onto version ``held`` (an index
        name in this version's delta chain): each stored run's deltas after its rank's member of
        ``held``; a tensor with a run that cannot be rebuilt so counts whole. ``held=None``: what
        a reader holding nothing fetches, ``keys``' bytes and their share of the chain's, told by
        the index alone. ``None`` when this version is not a delta of ``held``."""
        delta = self._index.delta
        if delta is None or (held is not None and held not in delta.chain):
            return None
        if held is None:
            nbytes = sum(self._entry(key).nbytes for key in keys)
            return nbytes + delta.chain_bytes * nbytes // max(1, delta.full_bytes)
        total = 0
        for key in keys:
            runs = []
            with naming(path=self.name, key=key):
                for piece in self._whole_pieces(key):
                    with self._member(piece.member) as member:
                        runs.append(member.chain_payload(piece.offset, _held_step(held))
                                    if isinstance(member, _Rebuilt) else None)
                total += self._entry(key).nbytes if None in runs else sum(run or 0 for run in runs)
        return total

    def read_from(self, key: str, held: str, data: np.ndarray, *, verify: bool,
                  in_place: bool = False) -> np.ndarray | None:
        """``key`` rebuilt onto ``data``, its bytes in version ``held`` (an index name in this
        version's delta chain), reading only the deltas after it: each stored run (a piece, or a
        column strip) is cut from ``data``, rebuilt by its delta member onto its rank's member of
        ``held`` (:meth:`weightstore.formats.delta.DeltaReader.read_from`, which checks the digest
        its rank recorded) and put back. ``None`` when a run cannot be rebuilt so (its member is
        full, or its chain does not pass through ``held``): read ``key`` whole then.
        ``in_place``: as the delta reader's (a failure, or ``None``, leaves ``data`` half changed)."""
        entry = self._open_entry(key)
        flat = np.asarray(data).reshape(-1).view(np.uint8)
        if len(flat) != entry.nbytes:
            return None
        out = flat if in_place else aligned_array(len(flat))
        if not in_place:
            out[:] = flat
        whole = _boxed(out, entry, [(0, size) for size in entry.shape])
        done = self._rebuild_runs(key, held, [whole], [whole], verify=verify, in_place=True)
        return from_storage(out.view(storage_dtype(entry.dtype)).reshape(entry.shape), entry.dtype) if done[0] else None

    def read_regions_from(self, key: str, held: str, have: Sequence[tuple[Sequence[tuple[int, int]], np.ndarray]],
                          wanted: Sequence[Sequence[tuple[int, int]]], *, verify: bool) -> list[np.ndarray | None]:
        """The regions ``wanted`` of ``key`` (``(start, stop)`` per axis), rebuilt from ``have``:
        regions of ``key`` (bounds, and their bytes in version ``held``, an index name in this
        version's delta chain) that a reader of parts holds, reading only the deltas after
        ``held``. Each stored run that holds part of a wanted region is assembled from the held
        regions that cover it (a run across two of them from both), rebuilt as :meth:`read_from`
        rebuilds one (its digest checked), and copied into the wanted regions it holds part of.
        A region is ``None`` where one of its runs cannot be rebuilt so (the held regions do not
        cover it, its member is full, its chain does not pass through ``held``): read it then.
        Bounds outside the tensor, or held bytes not of their region's size, are a ``TargetError``."""
        with naming(path=self.name):
            entry = self._open_entry(key)
            held_boxes = []
            for bounds, data in have:
                flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
                box = _bounds_of(bounds, entry, key)
                if len(flat) != math.prod(hi - lo for lo, hi in box) * entry.itemsize:
                    raise TargetError(f"a held region at {box} has {len(flat)} bytes, not its "
                                      f"{math.prod(hi - lo for lo, hi in box) * entry.itemsize}", key=key)
                held_boxes.append(_boxed(flat, entry, box))
            outs = [_boxed(aligned_array(math.prod(hi - lo for lo, hi in box) * entry.itemsize), entry, box)
                    for box in (_bounds_of(bounds, entry, key) for bounds in wanted)]
        done = self._rebuild_runs(key, held, held_boxes, outs, verify=verify)
        stored = storage_dtype(entry.dtype)
        return [from_storage(out.data.view(stored), entry.dtype) if ok else None
                for out, ok in zip(outs, done, strict=True)]

    def _rebuild_runs(self, key: str, held: str, have: list[_Boxed], outs: list[_Boxed], *, verify: bool,
                      in_place: bool = False) -> list[bool]:
        """Fill ``outs`` (regions of ``key``) with their bytes in this version, rebuilt run by run
        onto the bytes of version ``held`` that ``have`` hold (regions that do not overlap), and
        whether each out was wholly rebuilt. Each run is rebuilt in a buffer of its own, assembled
        from the held regions it lies across, so ``have`` is left as it was; ``in_place`` (``have``
        is ``outs``): where it lies whole in one of them. Runs only failed outs need are skipped."""
        delta, entry = self._index.delta, self._entry(key)
        done = [delta is not None and held in delta.chain and entry.layout is not None for _ in outs]
        if not any(done):
            return done
        with naming(path=self.name):
            runs = {(piece.member, piece.offset): piece for out in outs
                    for piece in self._pieces(key, entry, out.bounds) if math.prod(piece.shape)}
        for piece in runs.values():
            box = [(start, start + size) for start, size in zip(piece.start, piece.shape, strict=True)]
            needing = [at for at, out in enumerate(outs) if done[at] and _overlap(out.bounds, box) is not None]
            if not needing:
                continue
            run = _assembled(have, box, entry, in_place=in_place)
            with self._member(piece.member) as member, naming(path=self.name, key=key):
                if run is None or not isinstance(member, _Rebuilt) or \
                        not member.read_from(piece.offset, _held_step(held), run.flat, verify=verify):
                    for at in needing:
                        done[at] = False
                    continue
            for at in needing:
                outs[at].put(run)
        return done

    def _whole_pieces(self, key: str) -> list[PieceEntry]:
        """The stored runs of all of ``key`` that hold a byte (placed; none of an index of version 1)."""
        with naming(path=self.name):
            entry = self._entry(key)
            if entry.layout is None:
                return []
            pieces = self._pieces(key, entry, normalized_region((), entry.shape, key))
        return [piece for piece in pieces if math.prod(piece.shape)]

    def placed(self, key: str, region: Any = ()) -> list[PieceEntry]:
        """The stored runs (pieces, or their column strips) of ``key`` that hold part of
        ``region``, placed in their members, with their blocks' CRC-32s and digests."""
        with naming(path=self.name):
            entry = self._entry(key)
            return self._pieces(key, entry, normalized_region(region, entry.shape, key), digests=True)

    def _pieces(self, key: str, entry: TensorEntry, bounds: list[tuple[int, int]], *,
                digests: bool = False) -> list[PieceEntry]:
        """The stored runs (pieces, or their column strips) that may hold part of the region
        ``bounds``, placed: an index of version 1 holds them; a later index names the boxes,
        and their members' block tables (fetched once, ``digests`` too if asked) place them,
        with the CRC-32s of the blocks that hold the region (their pages fetched as needed)."""
        if entry.layout is None:
            return list(entry.pieces)
        boxes = []
        wanted: dict[int, list[int]] = {}  # member -> the blocks whose CRC-32s the region needs
        for box in entry.layout.boxes_in(bounds):
            with naming(key=key):
                table = self._table(box.member, digests=digests)
            placed = table.find(key, box.start)
            if placed is None or placed.shape != box.shape or placed.dtype != entry.dtype:
                raise FormatError(f"the block table of {self._index.members[box.member].file} has no {entry.dtype} "
                                  f"piece at {list(box.start)} of shape {list(box.shape)}, which the index names",
                                  key=key)
            boxes.append((box.member, table, placed))
            wanted.setdefault(box.member, []).extend(blocks_in(placed, entry, bounds))
        for position, blocks in wanted.items():
            with naming(key=key):
                self._crcs(position, np.array(blocks, np.int64))
        return [piece for position, table, placed in boxes for piece in table.placed(placed, position, digests)]

    def _table(self, position: int, *, digests: bool = False) -> BlockTable:
        """Member ``position``'s block table: its head fetched once (one ranged read), its
        digests once asked for (another). A delta member's extent is asked before the table's
        file opens, so that file (not counted in :func:`open_files_limit`) is never open while
        the member's chain is being opened."""
        with self._tables_lock:
            table = self._tables[position]
            member = self._index.members[position]
            ref = member.table
            assert ref is not None  # a version 2 index's members all have one
            digests = digests and bool(ref.digests)  # a table of no digests: no region of its member has one
            if table is None or (digests and table.digests is None):
                extent = self._extent(position) if table is None else None
                with self._table_file(position) as source:
                    if table is None:
                        head = np.empty(ref.head, np.uint8)
                        source.fill([(0, head.data.cast("B"))])
                        table = BlockTable.parse_head(head.tobytes(), ref, member, self._index.step,
                                                      self._index.attempt, extent)
                    if digests and table.digests is None:
                        data = np.empty(ref.digests, np.uint8)
                        source.fill([(ref.digests_at, data.data.cast("B"))])
                        table.take_digests(data.tobytes())
                self._tables[position] = table
            return table

    def _crcs(self, position: int, blocks: np.ndarray) -> None:
        """The pages of member ``position``'s table that hold the CRC-32s of ``blocks``, fetched
        (those not yet fetched: one ranged read per run of them)."""
        with self._tables_lock:
            table = self._tables[position]
            ref = self._index.members[position].table
            assert table is not None and ref is not None
            runs = table.pages_of(blocks)
            if not runs:
                return
            buffers = [(first, np.empty(table.page_span(first, count, ref.head)[1], np.uint8)) for first, count in runs]
            with self._table_file(position) as source:
                source.fill([(table.page_span(first, count, ref.head)[0], buffer.data.cast("B"))
                             for (first, count), (_, buffer) in zip(runs, buffers, strict=True)])
                for first, buffer in buffers:
                    table.take_pages(first, buffer.tobytes())

    @contextmanager
    def _table_file(self, position: int) -> Iterator[RangedFile]:
        """Member ``position``'s block table, open for ranged reads; errors name it."""
        member = self._index.members[position]
        if self._closed:
            raise StoreClosedError(f"store is closed; cannot read the block table of {member.file}", path=self.name)
        path = f"{self._base}/{member.table_file()}"
        try:
            source = RangedFile(path, fs=self._fs)
        except FileNotFoundError:
            raise StoreNotFoundError(f"block table {member.table_file()} that the index names is missing",
                                     path=self.name) from None
        try:
            with naming(path=path):
                yield source
        finally:
            source.close()

    def _missing(self, position: int) -> StoreNotFoundError:
        return StoreNotFoundError(f"member {self._index.members[position].file} that the index names is missing",
                                  path=self.name)

    def _check_size(self, position: int, size: int) -> None:
        if size < self._index.members[position].size:
            raise ChecksumError(f"member {self._index.members[position].file} has {size} bytes; the index "
                                f"says {self._index.members[position].size}", path=self.name)

    def _stat_size(self, position: int) -> int:
        """A local member's size, asked without opening it (a version of more members than may be open)."""
        try:
            return os.stat(self.member_path(position)).st_size
        except FileNotFoundError:
            raise self._missing(position) from None
        except OSError as exc:
            raise StoreNotFoundError(f"member {self._index.members[position].file} cannot be read "
                                     f"({exc.strerror or exc})", path=self.name) from None

    def _extent(self, position: int) -> int | None:
        """The bytes a delta member rebuilds, proven by its chain (``None`` for a full member)."""
        if not self._index.members[position].file.endswith(DELTA_MEMBER_SUFFIX):
            return None
        with self._member(position) as member:
            assert isinstance(member, _Rebuilt)
            return member.extent

    def _opened(self, position: int, most_files: int | None) -> RangedFile | _Rebuilt:
        """Member ``position`` opened, a delta member's chain in at most ``most_files`` files
        (else ``SizeLimitError`` before a base opens), its size checked against the index's."""
        try:
            path = self.member_path(position)
            found: RangedFile | _Rebuilt = (_Rebuilt(path, self._fs, self.name, most_files)
                                            if path.endswith(DELTA_MEMBER_SUFFIX) else RangedFile(path, fs=self._fs))
            size = found.size
        except FileNotFoundError:
            raise self._missing(position) from None
        try:
            self._check_size(position, size)
        except BaseException:
            found.close()
            raise
        return found

    @contextmanager
    def _member(self, position: int) -> Iterator[RangedFile | _Rebuilt]:
        """Member ``position``, open while the block is read: opened if it is not, in the files
        :func:`open_files_limit` leaves, the least recently read members no read is using closed
        to make room. Room for its own file is made first; a delta member whose chain needs more
        than is left is refused before a base opens, every idle member closed and it is opened
        again in the whole budget (over it only by members other reads are using meanwhile)."""
        with self._lock:
            found = self._files.get(position)
            if found is None:
                found = self._files[position] = self._opened_in_room(position)
                self._open_files += found.files
            self._files.move_to_end(position)
            self._users[position] = self._users.get(position, 0) + 1
        try:
            yield found
        finally:
            with self._lock:
                self._users[position] -= 1
                self._close_idle()

    def _opened_in_room(self, position: int) -> RangedFile | _Rebuilt:
        """Member ``position`` opened as :meth:`_member` says (under the lock)."""
        if self._most_files is None:  # remote: holds no file
            return self._opened(position, None)
        self._close_idle(room=1)
        left = max(1, self._most_files - self._open_files)
        try:
            return self._opened(position, left)
        except SizeLimitError:
            if left >= self._most_files:  # its chain alone is over the budget
                raise
            self._close_idle(room=self._most_files)  # every idle member
        return self._opened(position, self._most_files)

    def _close_idle(self, room: int = 0) -> None:
        """Close the least recently read members no read is using until the files the rest hold,
        and ``room`` more, fit :func:`open_files_limit` (under the lock)."""
        if self._most_files is None or self._open_files + room <= self._most_files:
            return
        for at in [at for at in self._files if not self._users.get(at)]:
            if self._open_files + room <= self._most_files:
                return
            self._open_files -= self._files[at].files
            self._files.pop(at).close()

    def _open_entry(self, key: str) -> TensorEntry:
        """``key``'s entry, for a read that opens members: refused on a closed store before one
        is opened again (it would stay open)."""
        entry = self._entry(key)
        if self._closed:
            raise StoreClosedError(f"store is closed; cannot read tensor {key!r}", path=self.name)
        return entry

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        return self.read_region(key, (), verify=verify)

    def read_region(self, key: str, region: Any, *, verify: bool) -> np.ndarray:
        """The part of ``key`` that ``region`` names, from the blocks that hold it, each verified."""
        with naming(path=self.name):
            return self._read_region(key, region, verify=verify)

    def _read_region(self, key: str, region: Any, *, verify: bool) -> np.ndarray:
        entry = self._open_entry(key)
        bounds = normalized_region(region, entry.shape, key)
        stored = storage_dtype(entry.dtype)
        reads = [read for piece in self._pieces(key, entry, bounds)
                 if (read := _PieceRead.of(piece, entry, bounds)) is not None]
        # allocated once the block tables hold every box, each inside its member: an index whose
        # shape and boxes a damaged (resealed) index made huge allocated them first (MemoryError)
        out = np.empty([stop - start for start, stop in bounds], stored)
        by_member: dict[int, list[_PieceRead]] = {}
        for read in reads:
            by_member.setdefault(read.piece.member, []).append(read)
        runs = {position: _runs(found) for position, found in by_member.items()}

        def fill(position: int) -> None:
            with self._member(position) as member:
                member.fill([(offset, buffer.data.cast("B")) for offset, buffer in runs[position]])

        try:
            if self._remote and len(by_member) > 1:  # members fetched at once: each is a round trip
                with ThreadPoolExecutor(min(len(by_member), _MEMBERS_AT_ONCE)) as pool:
                    list(pool.map(fill, by_member))
            else:
                for position in by_member:
                    fill(position)
        except WeightStoreError as exc:
            exc.key = exc.key or key
            raise
        for read in reads:
            if verify:
                read.verify(self._index.members[read.piece.member].file, key)
            read.place(out, bounds, stored)
        return from_storage(out, entry.dtype)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for found in self._files.values():
                found.close()
            self._files.clear()
            self._open_files = 0


class _Rebuilt:
    """A delta member (:func:`weightstore.formats.delta.open_member`) read like a full one: its
    stored tensors, rebuilt from its chain and checked against their digests, lie end to end in
    its manifest's order, where its block table places its pieces; a range is filled from them
    (the last one rebuilt kept for the ranges after it, until one reaches its end). Reads in
    several threads rebuild different tensors in parallel, and one tensor once for all the reads
    that want it meanwhile. The CRC-32s of the blocks are then checked as for any member."""

    def __init__(self, path: str, fs: Any, index: str, most_files: int | None):
        self.name, self._index = path, index
        location: Any = path
        if location_of(path).remote:
            location = RemoteFile(*on_filesystem(path, fs), path)
        try:
            self._reader = delta_format.open_member(location, path, mmap=False, most_files=most_files)
        except WeightStoreError as exc:
            raise delta_format.named_here(exc, index, None) from None
        self.size = self._reader.file_bytes
        self.files = self._reader.open_files
        self._starts: list[int] = []
        self._keys = self._reader.keys()
        at = 0
        for key in self._keys:
            self._starts.append(at)
            at += self._reader.info(key).nbytes
        #: what its manifest claims; proven by its chain (:meth:`_prove`) before a byte is rebuilt
        #: from its anchor, so a follower that rebuilds onto its held copy opens no file below it
        self.extent = at
        self._proven = False
        #: its stored tensors (by position) that reads hold or are rebuilding, and the last one
        #: left before its end by a read, kept for the ranges after it
        self._wanted: dict[int, _Wanted] = {}
        self._lock = threading.Lock()

    def _prove(self) -> None:
        """The sizes its tensors claim, proven down to its anchor before memory is given them."""
        if self._proven:
            return
        try:
            self._reader.proven_bytes()
        except WeightStoreError as exc:
            raise delta_format.named_here(exc, self._index, exc.key) from None
        self._proven = True

    def _want(self, at: int) -> _Wanted:
        """Stored tensor ``at`` for one more read: rebuilt here if no read holds it, else the
        rebuild another read made or is making (waited for at ``.rebuilt.result()``). So a tensor
        is rebuilt once however many reads want it at a time, and other tensors meanwhile."""
        with self._lock:
            wanted = self._wanted.get(at)
            mine = wanted is None
            if wanted is None:
                wanted = self._wanted[at] = _Wanted()
            wanted.reads += 1
        if mine:
            try:
                wanted.rebuilt.set_result(self._reader.stored_bytes(self._keys[at]))
            except BaseException as exc:  # every read waiting for it raises it, and lets it go
                wanted.rebuilt.set_exception(self._named(exc) if isinstance(exc, WeightStoreError) else exc)
        return wanted

    def _let_go(self, at: int, wanted: _Wanted, *, ended: bool) -> None:
        """One read done with stored tensor ``at``. Once none holds it, it is forgotten where
        that read reached its end (a whole read keeps none) or it failed; else it is kept as the
        last one, the one kept before forgotten."""
        with self._lock:
            wanted.reads -= 1
            if wanted.reads or self._wanted.get(at) is not wanted:
                return
            if ended or wanted.rebuilt.exception() is not None:
                del self._wanted[at]
                return
            for other in [other for other, found in self._wanted.items() if other != at and not found.reads]:
                del self._wanted[other]

    def fill(self, ranges: list[tuple[int, memoryview]]) -> None:
        with self._lock:
            self._prove()
        held: dict[int, _Wanted] = {}
        try:
            for offset, view in ranges:
                check_range(offset, len(view), self.extent, self.name)
                target, done = np.frombuffer(view, np.uint8), 0
                while done < len(target):
                    at = bisect.bisect_right(self._starts, offset + done) - 1
                    if at not in held:
                        held[at] = self._want(at)
                    data = held[at].rebuilt.result()
                    begin = offset + done - self._starts[at]
                    part = data[begin : begin + len(target) - done]
                    target[done : done + len(part)] = part
                    done += len(part)
                    if begin + len(part) == len(data):  # read to its end
                        self._let_go(at, held.pop(at), ended=True)
        finally:
            for at, wanted in held.items():
                self._let_go(at, wanted, ended=False)

    def _run(self, offset: int, step: int) -> tuple[str, str] | None:
        """The stored name of the run at ``offset``, and this rank's member of ``step`` in its chain (or ``None``)."""
        at = bisect.bisect_right(self._starts, offset) - 1
        if at < 0 or self._starts[at] != offset:
            return None
        base = next((name for name in self._reader.head.chain
                     if (found := delta_format.MEMBER_BASE.match(name)) and int(found.group(1)) == step), None)
        return None if base is None else (self._keys[at], base)

    def chain_payload(self, offset: int, step: int) -> int | None:
        """Bytes of the deltas that rebuild the run at ``offset`` onto its bytes in step ``step`` (``None``: cannot)."""
        run = self._run(offset, step)
        return None if run is None else self._reader.chain_payload([run[0]], run[1])

    def read_from(self, offset: int, step: int, data: np.ndarray, *, verify: bool) -> bool:
        """The run at ``offset`` rebuilt in place onto ``data``, its bytes in step ``step``,
        checked against its digest (``verify``); ``False`` where it cannot be so."""
        run = self._run(offset, step)
        if run is None:
            return False
        try:
            found = self._reader.read_from(run[0], run[1], data, verify=verify, in_place=True)
        except WeightStoreError as exc:
            raise self._named(exc) from None
        return found is not None

    def _named(self, exc: WeightStoreError) -> WeightStoreError:
        """``exc``, raised by this member's chain, naming the index; named by its global key (the
        reader's), its stored name said."""
        error = delta_format.named_here(exc, self._index, None)
        if error.key is not None:
            error.message, error.key = f"{error.message} (stored as {shown_key(error.key)})", None
        return error

    def close(self) -> None:
        self._reader.close()


class _Wanted:
    """A delta member's stored tensor that reads want: its bytes, rebuilt once, and how many
    reads hold it."""

    __slots__ = ("rebuilt", "reads")

    def __init__(self) -> None:
        self.rebuilt: Future[np.ndarray] = Future()
        self.reads = 0


class _Boxed:
    """A region of a tensor in memory: its bounds (``(start, stop)`` per axis) and its bytes,
    an array of the region's shape whose items are the tensor's stored items, of any dtype alike
    (``V<itemsize>``), as :meth:`ShardedReader._rebuild_runs` cuts and fills them."""

    def __init__(self, bounds: Sequence[tuple[int, int]], data: np.ndarray):
        self.bounds: list[tuple[int, int]] = [(lo, hi) for lo, hi in bounds]
        self.data = data

    def view(self, bounds: Sequence[tuple[int, int]]) -> np.ndarray:
        """The part of it that ``bounds`` (inside its own) names."""
        index: tuple[Any, ...] = tuple(slice(lo - at, hi - at) for (lo, hi), (at, _) in zip(bounds, self.bounds, strict=True))
        return self.data[index + (Ellipsis,)]  # the Ellipsis: a 0-d region is a view too, not a numpy.void scalar

    @property
    def flat(self) -> np.ndarray:
        """Its bytes, uint8 (a view: it is contiguous)."""
        return self.data.reshape(-1).view(np.uint8)

    def put(self, other: _Boxed) -> None:
        """Copy into it the part of ``other`` that lies inside it (none where that is itself)."""
        common = _overlap(self.bounds, other.bounds)
        if common is None:
            return
        target, source = self.view(common), other.view(common)
        if (target.ctypes.data, target.strides) != (source.ctypes.data, source.strides):
            target[...] = source


def _boxed(flat: np.ndarray, entry: TensorEntry, bounds: Sequence[tuple[int, int]]) -> _Boxed:
    """``flat`` (uint8, the region's bytes in C order) as the region ``bounds`` of ``entry``'s tensor."""
    return _Boxed(bounds, flat.view(f"V{entry.itemsize}").reshape([hi - lo for lo, hi in bounds]))


def _bounds_of(bounds: Sequence[tuple[int, int]], entry: TensorEntry, key: str) -> list[tuple[int, int]]:
    """``bounds`` (``(start, stop)`` per axis) checked as a region of ``entry``'s tensor: integers
    with ``0 <= start <= stop <= size``, as a follower records its parts; what a slice would
    count from the end or clamp to empty is refused, not read as another region."""
    shape = entry.shape
    if isinstance(bounds, (tuple, list)) and len(bounds) == len(shape) and all(
            isinstance(axis, (tuple, list)) and len(axis) == 2 and all(isinstance(at, (int, np.integer)) and not isinstance(at, bool) for at in axis)
            and 0 <= axis[0] <= axis[1] <= size for axis, size in zip(bounds, shape, strict=True)):
        return [(int(lo), int(hi)) for lo, hi in bounds]
    raise TargetError(f"a region's bounds are (start, stop) for each of the {len(shape)} axes of {list(shape)}, "
                      f"integers with 0 <= start <= stop <= the axis's size, not {bounds!r}"[:300], key=key)


def _overlap(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """The bounds both regions hold, or ``None`` when they share no item."""
    common = [(max(alo, blo), min(ahi, bhi)) for (alo, ahi), (blo, bhi) in zip(a, b, strict=True)]
    return None if any(lo >= hi for lo, hi in common) else common


def _assembled(have: list[_Boxed], box: list[tuple[int, int]], entry: TensorEntry, *, in_place: bool) -> _Boxed | None:
    """The bytes of the run ``box`` from the regions ``have`` (which do not overlap): a view of
    the one that holds it all where ``in_place`` and it is contiguous there, else a buffer of its
    own filled from every region it lies across; ``None`` when they do not cover it."""
    touching = [(region, common) for region in have if (common := _overlap(region.bounds, box)) is not None]
    if in_place and len(touching) == 1 and touching[0][1] == box:
        part = touching[0][0].view(box)
        if part.flags.c_contiguous:
            return _Boxed(box, part)
    parts = [common for _, common in touching]
    if sum(math.prod(hi - lo for lo, hi in common) for common in parts) != math.prod(hi - lo for lo, hi in box) or any(
            _overlap(a, b) is not None for at, a in enumerate(parts) for b in parts[at + 1 :]):
        return None
    run = _boxed(aligned_array(math.prod(hi - lo for lo, hi in box) * entry.itemsize), entry, box)
    for region, _ in touching:
        run.put(region)
    return run


def _held_step(held: str) -> int:
    """The step of ``held``, an index name of a delta chain (checked as such when the index was parsed)."""
    return int(held[len("step-") : -len(".wsindex")])


class _PieceRead:
    """The blocks of one piece that hold part of a region: one byte range of its member."""

    def __init__(self, piece: PieceEntry, entry: TensorEntry, box: list[tuple[int, int]], first: int, last: int):
        self.piece, self.box, self.first = piece, box, first
        self.row_bytes = row_bytes(piece.shape, entry.itemsize)
        self.block_bytes = piece.rows * self.row_bytes
        self.rows = min(last * piece.rows, rows_of(piece.shape)) - first * piece.rows
        self.offset = piece.offset + first * self.block_bytes
        self.nbytes = self.rows * self.row_bytes
        self.buffer = np.empty(0, np.uint8)  # a part of its run's buffer (_runs)

    @classmethod
    def of(cls, piece: PieceEntry, entry: TensorEntry, bounds: list[tuple[int, int]]) -> _PieceRead | None:
        box = [(max(lo, s), min(hi, s + n)) for (lo, hi), s, n in zip(bounds, piece.start, piece.shape, strict=True)]
        if any(lo >= hi for lo, hi in box) or not math.prod(piece.shape):
            return None
        top, bottom = (box[0][0] - piece.start[0], box[0][1] - piece.start[0]) if box else (0, 1)
        return cls(piece, entry, box, top // piece.rows, -(-bottom // piece.rows))

    def verify(self, member: str, key: str) -> None:
        """Every block's CRC-32 against its table's: slices of one byte view, each checksummed
        (a block of a strip holds a few KiB, where an array slice and the general checksum
        call per block cost more than the checksum), then all compared at once."""
        view, size = raw_bytes(self.buffer), self.block_bytes
        checksum = checksums.crc32 if size >= checksums.RELEASE_GIL_BYTES else isal_zlib.crc32  # large: GIL let go
        found = [checksum(view[at : at + size]) for at in range(0, len(view), size)]  # both unsigned
        expected = self.piece.crcs[self.first : self.first + len(found)]
        if found != list(expected):
            block = next(at for at, (crc, want) in enumerate(zip(found, expected, strict=True)) if crc != want)
            raise ChecksumError(f"block {self.first + block} of its piece at {list(self.piece.start)} in member "
                                f"{member} is corrupt (CRC-32 {found[block]:08x}, index {expected[block]:08x})",
                                key=key)

    def place(self, out: np.ndarray, bounds: list[tuple[int, int]], stored: np.dtype) -> None:
        shape = (self.rows, *self.piece.shape[1:]) if self.piece.shape else ()
        data = self.buffer.view(stored).reshape(shape)
        top = self.piece.start[0] + self.first * self.piece.rows if self.piece.shape else 0
        source = tuple(slice(lo - (top if axis == 0 else s), hi - (top if axis == 0 else s))
                       for axis, ((lo, hi), s) in enumerate(zip(self.box, self.piece.start, strict=True)))
        target = tuple(slice(lo - b, hi - b) for (lo, hi), (b, _) in zip(self.box, bounds, strict=True))
        out[target] = data[source]


def blocks_in(placed: Placed, entry: TensorEntry, bounds: list[tuple[int, int]]) -> list[int]:
    """The blocks of ``placed`` (a piece in its member's table) that hold part of the region
    ``bounds``: those :class:`_PieceRead` reads, whose CRC-32s a reader needs."""
    found: list[int] = []
    count = placed.blocks_per_strip
    for strip in range(placed.strips):
        start, shape = placed.strip_box(strip)
        read = _PieceRead.of(PieceEntry(0, start, shape, 0, placed.rows, (), ""), entry, bounds)
        if read is not None:
            first = placed.first + strip * count + read.first
            found.extend(range(first, first + -(-read.rows // placed.rows)))
    return found


def _runs(reads: list[_PieceRead]) -> list[tuple[int, np.ndarray]]:
    """``(offset, buffer)`` of each run of byte ranges that follow one another in a member
    (the column strips of a piece lie side by side), one read each; every read's buffer
    becomes its part of its run's."""
    reads = sorted(reads, key=lambda read: read.offset)
    runs: list[list[_PieceRead]] = []
    for read in reads:
        if runs and runs[-1][-1].offset + runs[-1][-1].nbytes == read.offset:
            runs[-1].append(read)
        else:
            runs.append([read])
    filled = []
    for run in runs:
        buffer = aligned_array(sum(read.nbytes for read in run), run[0].offset)
        for read in run:
            read.buffer = buffer[read.offset - run[0].offset : read.offset - run[0].offset + read.nbytes]
        filled.append((run[0].offset, buffer))
    return filled


def _open_reader(location: Any, name: str, *, mmap: bool = True) -> ShardedReader:
    fs = getattr(location, "fs", None)
    data = read_whole(byte_source(location, name), MAX_V1_INDEX_BYTES, "sharded index")
    with naming(path=name):
        index = ShardIndex.parse(data)
    return ShardedReader(index, name, fs)


def _no_writer(path: str, compress: bool | str) -> Any:
    raise TargetError("a sharded index is written by ws.commit_shards, not saved", path=path)


FORMAT = Format(name="sharded", suffixes=(".wsindex",), magic=lambda head: False, open_reader=_open_reader,
                open_writer=_no_writer, compresses=False, writes=False)
