"""One version written by many workers: each rank publishes its shard, one coordinator commits.

Every rank calls :func:`publish_shard` with the pieces it holds; it writes one member file
(``step-000000000042.attempt-1/rank-00003.safetensors``, an ordinary safetensors file that
``ws.open`` and ``safetensors.numpy.load_file`` read alone; or an npz or HDF5 file), then its
block table (``rank-00003.blocks``: where each piece's bytes lie in the member, a CRC-32 and a
change digest per block) and, last, a small done-record (``rank-00003.done``) saying what the
member holds: for every piece its global key and its box in the global tensor, and the size
and BLAKE3 of the table. Before it writes anything, the rank checks that its share keeps the
version's index within its bounds (:func:`~weightstore.formats._sharded_index.check_share`).
Nothing a reader sees changes. One coordinator calls :func:`commit_shards`: it waits
for every rank's done-record (reading them alone, never a tensor byte), checks that the pieces
of every key agree on dtype and shape, never overlap and cover it, writes the index
``step-000000000042.wsindex`` create-only and then replaces ``LATEST`` as a plain publish
does (:func:`weightstore.sync._publish.commit_version`). No collective, no barrier: the ranks and
the coordinator meet only in the folder. The crash argument is in ``docs/sharded.md``.

**How a member holds its pieces.** A key the rank holds one piece of is stored under the key
itself. A key it holds several pieces of, or a piece of long rows stored as column strips
(:func:`~weightstore.formats._sharded_index.strip_columns`, so that readers of columns fetch only theirs),
is stored once per piece or strip, as ``KEY@i,j`` (its start); the member's metadata (``weightstore-shard``) maps every stored name to its key, start
and shape, and is what decides: a global key that happens to look like ``KEY@i,j`` is refused
rather than misread.

**Attempts.** A job that restarts writes the same step again with ``attempt`` one higher; each
attempt has its own folder, so a dead attempt's members never mix with a live one's, and the
commit of a step removes every other attempt of it, and every attempt of an older step no
index names. ``ws clean`` does the same for a folder at rest.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import blake3
import numpy as np

from weightstore._version import __version__
from weightstore.core import _parallel as parallel
from weightstore.core import checksums
from weightstore.core._exiting import finish_before_exit
from weightstore.core._forks import Pool
from weightstore.core.keys import validate_key
from weightstore.core.limits import (
    KEY_BYTES,
    MAX_CLAIMS,
    MAX_DONE_BYTES,
    MAX_INDEX_BYTES,
    MAX_PIECES_PER_KEY,
    MAX_V1_INDEX_BYTES,
)
from weightstore.core.manifest import c_copy, crc32, from_storage, logical_dtype, to_storage
from weightstore.errors import (
    FormatError,
    PieceError,
    PublishError,
    ShardTimeoutError,
    SizeLimitError,
    WeightStoreError,
    named,
    naming,
)
from weightstore.formats import Format, format_named
from weightstore.formats import _sharded_index as shardindex
from weightstore.formats import delta as delta_format
from weightstore.formats._pointer import VERSION_NAME
from weightstore.formats._sharded_index import (
    CLAIM,
    CRC_DIGESTS,
    DELTA_MEMBER_SUFFIX,
    INDEX_FORMAT,
    INDEX_VERSION,
    MEMBER_SUFFIXES,
    RANK_FILE,
    SHARD_METADATA,
    BlockTable,
    Box,
    DoneRecord,
    DoneTensor,
    Layout,
    Member,
    OverlapBudget,
    Placed,
    ShardIndex,
    TableRef,
    TensorEntry,
    attempt_folder,
    attempt_of,
    band_crc64s,
    band_digests,
    block_crcs,
    check_boxes,
    check_parsable,
    check_share,
    crc_band_digests,
    done_name,
    index_name,
    key_entry_bytes,
    member_name,
    parse_done,
    piece_cut,
    row_bytes,
    table_name,
    written_in_attempt,
)
from weightstore.io.folders import Folder, folder_for
from weightstore.sharded import _agree as agree
from weightstore.sharded import _cluster as cluster
from weightstore.sharded import _delta as member_delta
from weightstore.store._save import CheckedWeights, write_file
from weightstore.sync import _stages as stages
from weightstore.sync._checks import (
    checked_count,
    checked_keep,
    checked_pointer_metadata,
    checked_seconds,
    checked_step,
)
from weightstore.sync._defaults import DEFAULT_KEEP
from weightstore.sync._delta import Delta, Stored, as_delta
from weightstore.sync._folder import SHARDED_SUFFIX, names_step, remove_attempt, require_folder, version_files
from weightstore.sync._pinning import Version, read_latest
from weightstore.sync._publish import _BaseMoved, commit_version

__all__ = ["Piece", "publish_shard", "commit_shards", "publish_together", "in_background", "next_attempt",
           "claimed_attempt", "clean_folder"]

_log = logging.getLogger(__name__)

#: how often the coordinator looks for done-records, at most (it backs off from 50 ms)
_POLL = 0.5
#: how often a waiting coordinator reads ``LATEST`` to see whether its commit can still succeed
_DOOMED_EVERY = 2.0


@dataclass(frozen=True)
class Piece:
    """``array`` sits at index ``start`` of a tensor of global ``shape``."""

    array: Any
    start: Sequence[int]
    shape: Sequence[int]


@dataclass(frozen=True)
class _Listed:
    """One stored tensor of a member: a piece, or one column strip of it."""

    key: str
    stored: str
    dtype: str
    data: np.ndarray  # in storage form
    start: tuple[int, ...]  # of this strip
    shape: tuple[int, ...]  # the global tensor's
    rows: int  # rows per checksummed block
    piece: int  # which piece of the rank's it is (of), in order
    piece_start: tuple[int, ...]
    piece_shape: tuple[int, ...]
    columns: int  # the piece's strip width (0: stored whole)
    whole: np.ndarray  # the piece's stored bytes, whole (a strip's ``data`` is a view of them)


def publish_shard(
    folder: Any,
    pieces: Mapping[str, Any],
    *,
    step: int,
    rank: int | None = None,
    world: int | None = None,
    attempt: int | None = None,
    format: str = "safetensors",  # noqa: A002
    storage_options: Mapping[str, Any] | None = None,
    incarnation: str | None = None,
    delta: bool | Delta = False,
    digests: bool = True,
) -> None:
    """Write what this rank holds of version ``step``; nothing is visible until :func:`commit_shards`.

    Args:
        folder: the versioned folder (local path or fsspec URL) the version will be part of.
        pieces: key -> the whole tensor (an array), a :class:`Piece`, or a list of them.
        step: the version's step; above the step ``LATEST`` names.
        rank, world: this rank (``0 <= rank < world``) and how many ranks write the version;
            by default from the job's cluster (``torch.distributed``,
            ``jax.distributed``, ``TF_CONFIG``).
        attempt: which try at this step, so a dead attempt's members never mix with this one's;
            by default agreed through the job's store (``torch.distributed``'s c10d store,
            ``jax.distributed``'s key-value store): rank 0 hands out one above every attempt the
            folder holds of the step, and every rank waits for it. Elsewhere it must be given.
        format: the member's format: ``"safetensors"`` (default), ``"npz"`` or ``"hdf5"``,
            each an ordinary file of that format (uncompressed: readers fetch byte ranges of it).
        storage_options: for URLs, given to fsspec.
        incarnation: which launch of the job writes (recorded in the done-record; a commit
            refuses members of two); by default drawn once per launch by rank 0 and agreed
            through the job's store, the first time a rank publishes (every rank's first publish
            waits for the others'). Outside a job with a store, none.
        delta: ``True``, or a :class:`~weightstore.Delta` this rank gives to each of its
            publishes: write this rank's member as a delta of its member in the version
            ``LATEST`` names (``rank-00003.wsdelta``: what changed in its own pieces, no byte
            sent to another rank) when that is smaller; a full version is written every
            ``anchor_every`` versions, once the chain adds up to a full version, or when the
            number of ranks changed, alike by every rank (:mod:`weightstore.sharded._delta`). A
            ``Delta`` keeps a copy of this rank's pieces (1x its share of the model); ``True``
            reads its base member back.
        digests: record each block's change digest in the block table (its band's CRC-64
            and its blocks' CRC-32s, hashed: trusted against accidents, not against the
            version's author, docs/sharded.md), which a follower compares to skip the regions
            that did not change (:meth:`Store.region_digest`). ``False`` for a folder no
            follower reads (a checkpoint a job resumes from): the save skips a CRC-64 pass over
            the rank's bytes (0.04 CPU-s/GB), every region of this member reads
            again on each version, replicas of a piece are told alike by their blocks' CRC-32s,
            and a weightstore older than this one refuses the member's block table
            (FormatError), never misreads it. Reads verify every block's CRC-32 either way.

    Raises:
        PublishError: the step is not above the one ``LATEST`` names; the attempt holds this
            rank's done-record of a launch of another world (attempts must increase: nothing
            written).
        SizeLimitError: this rank's pieces or keys would take the version's index past its bounds
            (``docs/sharded.md``, Bounds; nothing written).
        InvalidKeyError, UnsupportedDTypeError, PieceError: a bad key, dtype, or piece (a start or
            shape that is no sequence of non-negative ints or does not fit its tensor, a list mixing
            Pieces and arrays, two pieces of a key at one index), naming the member and the key
            (nothing written). ``PieceError`` is a ``PublishError`` and a ``ValueError``.
        WeightStoreError: ``rank``, ``world`` or ``attempt`` not given and the cluster does not say it.
        ShardTimeoutError: agreeing the attempt or the incarnation, rank 0 or another rank did not
            take part within 600 seconds.
    """
    rank, world = cluster.place(rank=rank, world=world)
    _check_ids(step=step, world=world)
    checked_count("rank", rank)
    if rank >= world:
        raise ValueError(f"rank {rank} is not below world {world}")
    fmt = _member_format(format)
    if attempt is not None:
        _check_ids(step=step, attempt=attempt)  # before meeting anyone
    target = folder_for(folder, storage_options)
    meeting = None
    if attempt is None or incarnation is None:
        channel = cluster.channel()
        if channel is not None:
            incarnation = agree.incarnation(channel, rank, world) if incarnation is None else incarnation
            if attempt is None:
                meeting = agree.Meeting(channel, incarnation, target.where, step, rank, world)
                attempt = meeting.attempt(lambda least: claimed_attempt(target, step, incarnation, least,
                                                                        storage_options=storage_options),
                                          agree.AGREE_TIMEOUT)
    _, _, attempt = cluster.filled(rank=rank, world=world, attempt=attempt)
    try:
        _write_shard(target, pieces, step=step, rank=rank, world=world, attempt=attempt, fmt=fmt,
                     incarnation=incarnation or "", storage_options=storage_options, delta=as_delta(delta),
                     digests=digests)
    except Exception as exc:  # rank 0's commit would otherwise wait out its timeout for this member
        if meeting is not None and rank:
            meeting.give_up(f"{type(exc).__name__}: {exc}")
        raise


def _member_format(format: str) -> Format:  # noqa: A002
    """The format named ``format``, refused (``ValueError``) unless members are written in it: a
    format with no suffix (``tf-checkpoint``) failed on an ``IndexError``, and ``publish_together``
    took any format, a delta's too."""
    fmt = format_named(format)
    if not fmt.suffixes or fmt.suffixes[0] not in MEMBER_SUFFIXES:
        raise ValueError(f"a sharded version's members are safetensors, npz or hdf5 files; format={format!r} is not "
                         "supported")
    return fmt


def _write_shard(target: Folder, pieces: Mapping[str, Any], *, step: int, rank: int, world: int, attempt: int,
                 fmt: Format, incarnation: str, storage_options: Mapping[str, Any] | None,
                 delta: Delta | None = None, digests: bool = True) -> None:
    _check_ids(step=step, attempt=attempt)
    if incarnation and not shardindex.INCARNATION.fullmatch(incarnation):
        raise ValueError(f"incarnation {incarnation!r} is not a job incarnation ({shardindex.INCARNATION.pattern})")
    suffix = fmt.suffixes[0]
    target.require_compare_and_swap(f"committing step {step}")  # refused by every rank, before its upload
    members = folder_for(target.url(attempt_folder(step, attempt)), storage_options)
    where = members.url(member_name(rank, suffix))
    listed = _listed(pieces, where, world)
    _check_index_share(listed, world, member_name(rank, suffix), where)
    try:
        current = read_latest(target)
    except FormatError:
        current = None  # a damaged LATEST: the commit reports it
    if current is not None and current.step >= step:
        raise PublishError(f"step {step} is not after step {current.step}, which LATEST names; steps must increase",
                           path=target.where)
    _refuse_another_worlds_attempt(members, step, attempt, rank, world)
    record_of = {item.stored: {"key": item.key, "start": list(item.start), "shape": list(item.shape)} for item in listed}
    metadata = {SHARD_METADATA: {"step": step, "attempt": attempt, "rank": rank, "world": world, "pieces": record_of}}
    # a delta's bytes of each stored tensor (a strip's copy, contiguous), made only for a delta:
    # a full member's strips are copied as they are written
    stored = {} if delta is None else {
        item.stored: Stored(item.dtype, item.data.shape, c_copy(item.data).reshape(-1).view(np.uint8)
                            if item.data.size else np.empty(0, np.uint8)) for item in listed}
    base = None if delta is None else member_delta.base_version(delta, target, step, world)
    plan = None if delta is None or base is None else member_delta.plan_member(delta, target, base, rank, step,
                                                                                   stored, record_of)
    if plan is not None:
        suffix = DELTA_MEMBER_SUFFIX
        where = members.url(member_name(rank, suffix))
    target.create()
    members.create(inner=True)
    with members.commit(member_name(rank, suffix), suffix).writing() as local:
        digested = _Digested(listed, digests)
        virtual = None
        if plan is None:
            arrays = {item.stored: from_storage(item.data, item.dtype) for item in listed}
            write_file(local, fmt, CheckedWeights(arrays, where, fmt), metadata, False, digests=False, before=digested)
        else:
            with open(local, "wb") as handle:
                delta_format.write(handle, plan.head, plan.rows, plan.digests, plan.encoded, metadata,
                                   f"weightstore {__version__}", "", path=local)
            virtual, at = {}, 0
            for name, *_ in plan.rows:
                virtual[name] = at
                at += len(stored[name].data)
            for item in listed:  # the block table describes the bytes a reader rebuilds: these
                digested(item.stored, stored[item.stored].data.view(item.data.dtype).reshape(item.data.shape))
        size = os.path.getsize(local)
        table, tensors = _described(local, where, fmt, listed, digested, step=step, attempt=attempt, rank=rank,
                                    member=member_name(rank, suffix), size=size, virtual=virtual)
        stages.reached("member-temporary")
    stages.reached("member-written")
    if delta is not None:
        member_delta.remember(delta, target, step, f"{attempt_folder(step, attempt)}/{member_name(rank, suffix)}",
                              stored, plan, record_of)
    ref = table.ref()
    with members.commit(table_name(rank)).writing() as local, open(local, "wb") as handle:
        handle.write(table.head_bytes())
        handle.write(table.body_bytes())
    record = DoneRecord(step, attempt, rank, world, Member(member_name(rank, suffix), size, rank, ref), tensors,
                        incarnation, None if plan is None or base is None else base.step)
    with members.commit(done_name(rank)).writing() as local, open(local, "wb") as handle:
        handle.write(record.to_json())
    stages.reached("done-written")


def _refuse_another_worlds_attempt(members: Folder, step: int, attempt: int, rank: int, world: int) -> None:
    """Refuse, before writing, an attempt a launch of another world wrote: this rank's own
    done-record there says another world. Its commit would otherwise succeed or fail by timing
    (whether the coordinator read a rank's old record before that rank replaced it); so every
    rank that finds its old record refuses, and the commit then reads an old record for certain."""
    data = members.read_small(done_name(rank), MAX_DONE_BYTES + 1)
    if data is None:
        return
    try:
        earlier = parse_done(data)
    except FormatError:  # damaged: nothing says another world wrote it, and this rank's record replaces it
        return
    if earlier.world != world:
        raise PublishError(f"attempt {attempt} of step {step} holds this rank's done-record of a launch of "
                           f"{earlier.world} ranks, and this rank is {rank} of {world}; {_HIGHER_ATTEMPT}",
                           path=members.url(done_name(rank)))


#: what to do about an attempt a launch of another world wrote
_HIGHER_ATTEMPT = "attempts must increase: publish the step again with a higher attempt= (every rank)"


def commit_shards(
    folder: Any,
    *,
    step: int,
    world: int | None = None,
    attempt: int | None = None,
    timeout: float,
    keep: int | None = DEFAULT_KEEP,
    metadata: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    failures: Callable[[], Mapping[int, str]] | None = None,
    incarnation: str | None = None,
) -> Version:
    """Wait for every rank's done-record, check their pieces, and publish the sharded version.

    Reads only the done-records (never a block table or a tensor byte), then commits as :func:`weightstore.publish`
    does: the index ``step-…wsindex`` is created only if absent, then ``LATEST`` is replaced
    (compare-and-swap on object storage), then old versions are pruned (``keep``) and dead
    attempts removed. Steps increase across plain and sharded versions of one folder.
    ``world`` defaults as in :func:`publish_shard`; ``attempt`` and ``incarnation`` to those
    this process handed out as rank 0 of the job (its :func:`publish_shard` of this step agreed
    them through the job's store), so rank 0 of a ``torchrun`` or ``jax.distributed`` job
    commits with no more words. Every done-record must be of one job incarnation (``incarnation``
    where given): members two launches of the job wrote (a preempted job's zombie and its
    replacement, each at attempt 0) are refused, naming both. A commit that cannot succeed
    fails at once: its step is not above ``LATEST``'s (checked first, and again while it
    waits), or a rank gave up. Run again with the same
    step and attempt after a coordinator died between the index and ``LATEST``, it finds that
    index to be the one it would write and finishes the commit (see ``docs/sharded.md``).

    ``failures``, if given, is asked at each look for done-records which ranks gave up and why,
    through whatever channel the job has besides the folder (``tf2.publish_sharded`` passes
    TensorFlow's coordination service): a rank that will never write its member then ends the
    wait at once instead of at ``timeout``, and the error says why. By default, rank 0's
    commit hears the ranks of its job through the job's store.

    Raises:
        ShardTimeoutError: some rank did not finish within ``timeout`` seconds (``.missing``
            names them); nothing is published.
        PublishError: the step is not above the one ``LATEST`` names (at once); a rank without
            a done-record gave up (``failures``: naming the rank and its reason); a done-record of
            another step, attempt or world (at once, naming it: ranks launched with another world
            size, or a launch of another world that wrote this attempt: use a higher one); done-records of two job incarnations (naming both); pieces that overlap, leave a gap ("cover") or disagree on dtype or shape
            (naming the key); two ranks' pieces of one part whose bytes differ (replicas that
            diverged: one of a part written alike is kept); a step that does not go forward;
            another coordinator committed this step or a later one first; the keys of every rank together
            would take the index past its bounds.
        WeightStoreError: ``world`` or ``attempt`` not given and the cluster does not say it.
    """
    timeout = checked_seconds("timeout", timeout)
    _check_ids(step=step)
    target = folder_for(folder, storage_options)
    meeting = agree.handed_out(target.where, step)
    if meeting is not None and attempt in (None, meeting.chosen) and incarnation in (None, meeting.incarnation):
        attempt, incarnation = meeting.chosen, meeting.incarnation
        failures = meeting.failures if failures is None else failures
    _, world, attempt = cluster.filled(rank=0, world=world, attempt=attempt)
    _check_ids(step=step, attempt=attempt, world=world)
    if not world:
        raise ValueError("world must be at least 1")
    keep = checked_keep(keep)
    members = folder_for(target.url(attempt_folder(step, attempt)), storage_options)
    name = index_name(step)
    metadata = checked_pointer_metadata(metadata, step, name, target.url(name))

    def doomed() -> None:
        """Raise now if the commit cannot succeed: ``LATEST`` already names this step or a later one."""
        try:
            current = read_latest(target)
        except FormatError:
            return  # a damaged LATEST: the commit reports it
        if current is not None and current.step >= step:
            raise PublishError(f"step {step} is not after step {current.step}, which LATEST names; steps must "
                               "increase (another launch of the job, or another coordinator, committed it); nothing "
                               "was published", path=target.where)

    doomed()
    found, sizes = _wait_for_ranks(members, step, attempt, world, timeout, failures, doomed)
    if meeting is not None and meeting.chosen == attempt and meeting.incarnation == incarnation:
        meeting.sweep()  # every rank wrote its member: none reads this call's attempt, or news before, again
    records = [record for _, record in sorted(found.items())]
    # each rank's member and its block table (written before its done-record), as readers will find them: a
    # table cut, missing or not a file would make every reader refuse the version this commit publishes
    # (a table without digests has as many CRC-32s as its header says: at least its head, then)
    files = [(record.rank, "member", record.member.file, record.member.size, True) for record in records] + [
        (record.rank, "block table", table_name(record.rank), record.member.table.size or record.member.table.head,
         record.member.table.size is not None) for record in records if record.member.table is not None]

    def wrong(size: int | None, expected: int, exact: bool) -> bool:
        return size is None or size < expected or (exact and size != expected)

    if any(wrong(sizes.get(file), size, exact) for _, _, file, size, exact in files):
        sizes = {entry.name: entry.size for entry in members.files()}  # a listing made while one was renamed in
    for rank, what, file, expected, exact in files:  # from the listing that found the last done-record: no request more
        size = sizes.get(file)
        if wrong(size, expected, exact):
            state = "is missing" if size is None else f"is {size} bytes"
            says = f"{expected} bytes" if exact else f"at least {expected} bytes"
            raise PublishError(f"rank {rank}'s {what} {file} {state}; its done-record says {says}",
                               path=members.where)
    with naming(path=target.url(name)):
        index = _merged(records, step, attempt, world, metadata, incarnation)
    index.delta = member_delta.index_delta(target, records, sum(entry.nbytes for entry in index.tensors.values()))
    written: list[bytes] = []  # the index, if this commit created it
    adopted: list[bytes] = []  # the index, if an identical one was there

    def write_index(created: str) -> str:
        index.created = created
        data = index.to_json()
        with naming(path=target.url(name)):  # what every reader would refuse is never committed
            check_parsable(data, INDEX_FORMAT, MAX_INDEX_BYTES, PublishError)
        if target.put_if(name, data, create=True):
            written.append(data)
        elif (there := _same_index(target, name, index)) is not None:
            index.created = there.created  # LATEST records the time of the index it names, as readers check
            adopted.append(index.to_json())
        else:
            raise PublishError(f"an index for step {step} exists that LATEST does not name and that is not this "
                               f"commit's (attempt {attempt}, these members and metadata): another coordinator is "
                               "committing this step, or one died after writing it (commit a later step, or run "
                               "ws clean)", path=target.url(name))
        stages.reached("index-written")
        return index.created

    try:
        try:  # delta members build on the version LATEST named when they were encoded: it must still
            version = commit_version(target, step, name, write_index, metadata, keep,
                                     base=None if index.delta is None else index.delta.chain[0])
        except _BaseMoved as moved:  # unlike a plain delta, written already: not rewritten whole here
            raise PublishError(f"{moved.message}; its members are written as deltas of a version off the line "
                               f"LATEST now follows, so it was not committed: publish step {step} again (every "
                               "rank)", path=target.where) from None
    except PublishError:
        if written and not names_step(target, step):  # ours, and LATEST names another: never published
            target.remove(name)
        raise
    if adopted and target.read_small(name, 1) is None:  # removed as dead between the look and the swap
        target.put_if(name, adopted[0], create=True)
    try:  # LATEST names the step now: tidying that fails (an object lock, an outage) is no failed commit
        clean_attempts(target, index, members, sizes)
    except (OSError, WeightStoreError) as error:
        warnings.warn(f"{target.where}: step {step} is published, but removing what other attempts left failed "
                      f"({error}); the next commit or `ws clean` removes it", stacklevel=2)
    return version


#: how much longer than ``timeout`` a rank waits for rank 0's news: for the attempt, as rank 0
#: may reach the call later; for the commit, as its own work (the index, ``LATEST``, pruning)
#: comes after its wait for the members
NEWS_GRACE = 60.0


def publish_together(
    folder: Any,
    pieces: Mapping[str, Any],
    *,
    step: int,
    rank: int | None = None,
    world: int | None = None,
    timeout: float = 600.0,
    keep: int | None = DEFAULT_KEEP,
    metadata: Mapping[str, Any] | None = None,
    format: str = "safetensors",  # noqa: A002
    storage_options: Mapping[str, Any] | None = None,
    delta: bool | Delta = False,
    digests: bool = True,
) -> Version:
    """One call on every rank of a job: write this rank's ``pieces``, rank 0 commits, and every
    rank returns the committed :class:`~weightstore.Version` or raises the same error.

    What the adapters' ``publish_sharded`` (``torch``, ``flax``) run once they have this rank's
    pieces. The ranks meet only through the job's store,
    never in a collective, so a call may run in a background thread while the training step's
    collectives go on: rank 0 hands out the attempt; every rank writes its member; a rank whose
    write fails tells rank 0, whose commit then stops at once; rank 0 tells the committed
    version, or its error, which every rank raises (the same class, message and path). A job of
    one process needs no store.

    ``timeout`` bounds rank 0's wait for the members, counted from its handing out the attempt;
    the other ranks wait that long and :data:`NEWS_GRACE` more for rank 0's news. ``delta`` and
    ``digests``: as :func:`publish_shard`'s.

    Raises:
        ShardTimeoutError: a rank did not write within ``timeout`` (``.missing``), or rank 0
            said nothing; nothing is published.
        PublishError: as :func:`commit_shards` (a step not above ``LATEST``, a rank that gave
            up, pieces that do not tile, two job incarnations), or a rank's own write failed.
        WeightStoreError: a job of several ranks with no store (no ``torch.distributed`` process
            group, no ``jax.distributed``).
    """
    timeout = checked_seconds("timeout", timeout)
    rank, world = cluster.place(rank=rank, world=world)
    _check_ids(step=step, world=world)
    checked_count("rank", rank)
    if rank >= world:
        raise ValueError(f"rank {rank} is not below world {world}")
    fmt = _member_format(format)
    planner = as_delta(delta)
    target = folder_for(folder, storage_options)
    channel = cluster.channel()
    if channel is None and world > 1:
        raise WeightStoreError(f"rank {rank} of {world}: the ranks meet through the job's store, and there is none "
                               "(initialize torch.distributed's process group or jax.distributed first)",
                               path=target.where)
    incarnation = "" if channel is None else agree.incarnation(channel, rank, world, timeout + NEWS_GRACE)
    meeting = agree.Meeting(channel, incarnation, target.where, step, rank, world)
    attempt = meeting.attempt(lambda least: claimed_attempt(target, step, incarnation, least,
                                                            storage_options=storage_options), timeout + NEWS_GRACE)
    started = time.monotonic()
    if rank == 0:
        try:
            _write_shard(target, pieces, step=step, rank=0, world=world, attempt=attempt, fmt=fmt,
                         incarnation=incarnation, storage_options=storage_options, delta=planner,
                         digests=digests)
            version = commit_shards(target.where, step=step, world=world, attempt=attempt, incarnation=incarnation,
                                    timeout=round(max(0.0, timeout - (time.monotonic() - started)), 1), keep=keep,
                                    metadata=metadata, storage_options=storage_options, failures=meeting.failures)
        except Exception as exc:
            meeting.tell("committed", agree.news_of(exc))
            raise
        meeting.tell("committed", {"step": version.step, "file": version.path.rsplit("/", 1)[-1],
                                   "created": version.created, "metadata": version.metadata})
        return version
    try:
        _write_shard(target, pieces, step=step, rank=rank, world=world, attempt=attempt, fmt=fmt,
                     incarnation=incarnation, storage_options=storage_options, delta=planner,
                     digests=digests)
    except Exception as exc:  # rank 0's commit would otherwise wait out its timeout for this member
        meeting.give_up(f"{type(exc).__name__}: {exc}")
        raise
    news = meeting.hear("committed", timeout - (time.monotonic() - started) + NEWS_GRACE, "the commit")
    return Version(int(news["step"]), target.url(str(news["file"])), str(news["created"]), dict(news["metadata"]),
                   target)



_background = Pool(1, "weightstore-sharded")


def in_background(call: Callable[[], Version]) -> concurrent.futures.Future[Version]:
    """Run ``call`` (a :func:`publish_together` of a snapshot already taken) in this process's one
    publishing thread, after the calls before it: so every rank makes its calls in the order it
    made them, and the step goes on while the members are written. The future holds the
    committed version, or the error every rank raises."""
    future = _background.submit(call)
    finish_before_exit(future)  # a process exiting meanwhile finishes the publish: see core._exiting
    return future


def split_rows(shape: Sequence[int], rank: int, world: int) -> tuple[slice, ...] | None:
    """The box (a slice per axis: a range of its rows) of a tensor every rank holds whole that
    ``rank`` of ``world`` writes, so the ranks share the writing and none sends a byte to
    another (None: this rank writes none of it); a scalar or an empty tensor is rank 0's. The
    framework feeds use it for replicated tensors."""
    if not shape or not math.prod(shape):
        return tuple(slice(0, size) for size in shape) if rank == 0 else None
    start, stop = shape[0] * rank // world, shape[0] * (rank + 1) // world
    return (slice(start, stop), *(slice(0, size) for size in shape[1:])) if stop > start else None


def _same_index(target: Folder, name: str, index: ShardIndex) -> ShardIndex | None:
    """The index at ``name`` where it is the one this commit would write (but for its time): one a
    coordinator of this step and attempt wrote before it died between the index and ``LATEST``,
    or one racing this commit. Either way committing it is committing these very members.
    Compared as written, not as objects: metadata read back holds lists where the caller's had
    tuples."""
    found, _ = _read_index(target, name)
    same = found is not None and dataclasses.replace(found, created=index.created).to_json() == index.to_json()
    return found if same else None


def claimed_attempt(target: Folder, step: int, incarnation: str, least: int = 0, *,
                    storage_options: Mapping[str, Any] | None = None) -> int:
    """The attempt rank 0 of a job hands out: the first at or above ``least`` and above every
    attempt ``target`` holds of ``step`` (:func:`next_attempt`) whose folder this launch claims,
    by creating its :data:`CLAIM` file (create-only, holding ``incarnation``). Two launches whose
    rank 0s read the folder at the same moment (a preempted job's zombie and its replacement)
    so never hand out the same attempt: the second's creation fails and it takes the next.

    Raises:
        PublishError: storage without conditional writes (as :func:`publish_shard`), or
            :data:`MAX_CLAIMS` attempts in a row claimed by others.
    """
    target.require_compare_and_swap(f"claiming an attempt of step {step}")
    attempt = max(least, next_attempt(target.where, step, storage_options=storage_options))
    for _ in range(MAX_CLAIMS):
        members = folder_for(target.url(attempt_folder(step, attempt)), storage_options)
        target.create()
        members.create()
        if members.put_if(CLAIM, (incarnation or "none").encode(), create=True):
            return attempt
        attempt += 1
    raise PublishError(f"{MAX_CLAIMS} attempts of step {step} in a row were claimed by other launches of the job",
                       path=target.where)


def next_attempt(folder: Any, step: int, *, storage_options: Mapping[str, Any] | None = None) -> int:
    """The attempt after every one ``folder`` holds of ``step`` (0 if none): what a coordinator
    that announces the attempt to its ranks (``tf2.publish_sharded``) hands out, so a retry never
    writes into a dead try's folder. A try whose ranks wrote nothing leaves no folder on object
    storage; reusing its number is harmless, as nothing of it exists."""
    _check_ids(step=step)
    return 1 + max((attempt for _, held, attempt in _attempts(folder_for(folder, storage_options)) if held == step),
                   default=-1)


def clean_attempts(target: Folder, index: ShardIndex, members: Folder, listed: Iterable[str]) -> list[str]:
    """After committing ``index``: remove its step's other attempts, and attempts of older steps no
    index names (no commit of an older step can succeed any more); attempts of later steps may
    be in flight and stay. In its own attempt folder (``members``, whose files the commit's last
    listing, ``listed``, names) remove what :func:`_remove_unnamed` does. Returns the names removed."""
    indexed = {step for step, entry in version_files(target) if entry.name.endswith(SHARDED_SUFFIX)}
    removed = []
    for sub, step, attempt in _attempts(target):
        if ((step == index.step and attempt != index.attempt) or (
                step < index.step and step not in indexed and not _unlisted_index(target, step))) and (
                remove_attempt(target, sub)):  # what a user put in it stays, with it
            removed.append(sub)
    aborted = _abort_uploads(target, lambda step, attempt: (step == index.step and attempt != index.attempt) or (
        step < index.step and step not in indexed))
    for name in aborted:
        _log.warning("%s: aborted %s, which a killed rank left", target.where, name)
    return removed + aborted + _remove_unnamed(index, members, listed)


def _abort_uploads(target: Folder, dead: Callable[[int, int], bool], *, versions: bool = False) -> list[str]:
    """Abort the unfinished uploads of rank files in the attempts ``dead`` takes (by step and
    attempt), and of version files (``versions``, a folder at rest): a writer killed mid-upload
    leaves one on S3, its parts kept unseen and billed until aborted, in an attempt folder no
    listing shows where it was the only file. One request (S3's ``ListMultipartUploads``) where
    nothing is left; the names aborted, each marked so."""

    def killed(name: str) -> bool:
        if versions and VERSION_NAME.match(name):
            return True
        sub, _, file = name.partition("/")
        held = attempt_of(sub)
        return held is not None and written_in_attempt(file) and dead(*held)

    return [f"the unfinished upload of {name}" for name in target.abort_uploads(killed)]


def _remove_unnamed(index: ShardIndex, members: Folder, listed: Iterable[str]) -> list[str]:
    """Remove from ``index``'s attempt folder (``members``, whose files ``listed`` names) the rank
    files the index does not name: a member a rank wrote before in another form (a delta refused
    as ``LATEST`` moved off its base, then written whole into the same attempt) and every file of
    ranks past its world (a launch of a larger world whose lower ranks never wrote this attempt:
    a rank that finds its own record of another world refuses it). Readers go by the index and never take them; no commit can any more, its step
    being committed. Returns the names removed. A file that cannot be removed (no permission to
    delete, an object lock) is warned of and left, as a folder's removal leaves what it cannot:
    the commit that runs this has already moved ``LATEST`` and must not report a published step
    as failed."""
    named = {done_name(rank) for rank in range(index.world)} | {
        name for member in index.members
        for name in (member.file.rsplit("/", 1)[-1], *([table_name(member.rank)] if member.table else []))}
    removed = []
    for name in sorted(set(listed) - named):
        if RANK_FILE.match(name):
            try:
                members.remove(name)
            except (OSError, WeightStoreError) as error:
                warnings.warn(f"{members.url(name)}: left: it cannot be removed ({error})", stacklevel=2)
                continue
            removed.append(f"{attempt_folder(index.step, index.attempt)}/{name}")
    return removed


def clean_folder(folder: Any, *, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """``ws clean``: remove what dead writers and coordinators left in a folder *at rest* (no job
    publishing to it): indexes above the step ``LATEST`` names (a coordinator killed before
    ``LATEST``), indexes whose members are gone, every attempt folder no remaining index
    names, and in the attempt folder of each one kept the rank files it does not name
    (:func:`_remove_unnamed`). Returns the names removed; a folder that does not exist (a typo)
    is refused.

    With ``LATEST`` missing (deleted, or lost with a backup), the newest version counts as
    current, as it does for the next publish: nothing committed is taken for a dead attempt."""
    target = require_folder(folder, storage_options=storage_options)
    found = version_files(target)
    latest = read_latest(target)
    current = latest.step if latest is not None else max((step for step, _ in found), default=None)
    removed: list[str] = []
    live: set[tuple[int, int | None]] = set()
    kept: list[tuple[ShardIndex, Folder, dict[str, int]]] = []  # with its attempt folder, listed
    for step, entry in found:
        if not entry.name.endswith(SHARDED_SUFFIX):
            continue
        index, error = _read_index(target, entry.name)
        if error is not None:  # a newer weightstore's, or damaged: nothing proves it dead
            warnings.warn(f"{target.url(entry.name)}: kept: it cannot be read ({error}), so nothing proves it dead",
                          UserWarning, stacklevel=2)
            live.add((step, None))
            continue
        named = step == current  # never removed, whatever its state
        listing = (_attempt_listing(target, index, storage_options)
                   if index is not None and (named or (current is not None and step < current)) else None)
        if named or (index is not None and listing is not None and _members_present(index, *listing)):
            if index is not None and listing is not None:
                live.add((step, index.attempt))
                kept.append((index, *listing))
        else:
            target.remove(entry.name)
            removed.append(entry.name)
    listed = {step for step, entry in found if entry.name.endswith(SHARDED_SUFFIX)}
    for sub, step, attempt in _attempts(target):
        # an unreadable index may name any attempt
        if (step, attempt) not in live and (step, None) not in live and (
                step in listed or not _unlisted_index(target, step)) and (
                remove_attempt(target, sub)):  # what a user put in it stays, with it
            removed.append(sub)
    removed += _abort_uploads(target, lambda step, attempt: True, versions=True)  # at rest: none is under way
    for index, members, present in kept:
        removed += _remove_unnamed(index, members, present)
    return removed


def _unlisted_index(target: Folder, step: int) -> bool:
    """Whether something the listing of plain files leaves out is at ``step``'s index name: a
    symbolic link, which readers follow (a version linked in from elsewhere), a FIFO or a folder.
    Nothing proves that step's attempts dead, as for an index that cannot be read. One request,
    asked only of a step that has attempts and no listed index."""
    return target.tag(index_name(step)) is not None


def _attempt_listing(target: Folder, index: ShardIndex,
                     storage_options: Mapping[str, Any] | None) -> tuple[Folder, dict[str, int]]:
    """``index``'s attempt folder and its plain files' sizes by name: one listing, which both
    :func:`_members_present` and :func:`_remove_unnamed` read."""
    members = folder_for(target.url(attempt_folder(index.step, index.attempt)), storage_options)
    return members, {entry.name: entry.size for entry in members.files()}


def _members_present(index: ShardIndex, members: Folder, present: Mapping[str, int]) -> bool:
    """Whether every member and block table ``index`` names is there in its attempt folder
    (``members``, listed as ``present``), at least as long as the commit found it (a table:
    :attr:`TableRef.size`, or its head where the index cannot say more). One the listing of
    plain files misses is asked for by name (a request each, up to the first missing): a
    symbolic link, which readers follow, is no missing member."""

    def there(name: str, size: int) -> bool:
        listed = present.get(name)
        return listed >= size if listed is not None else members.tag(name) is not None

    return all(there(member.file.rsplit("/", 1)[-1], member.size) and (
        member.table is None or there(table_name(member.rank), member.table.size or member.table.head))
        for member in index.members)


def _attempts(target: Folder) -> list[tuple[str, int, int]]:
    """``(name, step, attempt)`` of every attempt folder in ``target``."""
    return [(sub, *held) for sub in target.subfolders() if (held := attempt_of(sub)) is not None]


def _read_index(target: Folder, name: str) -> tuple[ShardIndex | None, WeightStoreError | None]:
    """The index ``name`` (``None`` when it is gone), or why it cannot be read."""
    data = target.read_small(name, MAX_V1_INDEX_BYTES + 1)
    try:
        return (None if data is None else ShardIndex.parse(data)), None
    except WeightStoreError as error:
        return None, error


# -- the rank's side ---------------------------------------------------------------------------

def _listed(pieces: Mapping[str, Any], where: str, world: int) -> list[_Listed]:
    """Every piece, checked (key, dtype, box) and in storage form, with the name it is stored under."""
    if not isinstance(pieces, Mapping):
        raise TypeError(f"pieces must map a key to an array, a Piece or a list of them, not {type(pieces).__name__}")
    found: list[tuple[str, Piece]] = []
    for key, value in pieces.items():
        with naming(path=where, key=key if isinstance(key, str) else None):
            validate_key(key)
        for piece in _pieces_of(key, value, where):
            if not isinstance(piece, Piece):
                array = np.asarray(piece)
                piece = Piece(array, (0,) * array.ndim, array.shape)
            found.append((key, piece))
    boxes: list[tuple[str, str, np.ndarray, tuple[int, ...], tuple[int, ...], int, int, tuple[int, ...],
                      tuple[int, ...], int, np.ndarray]] = []
    pieces_of: dict[str, int] = {}
    converted: list[tuple[str, str, np.ndarray, tuple[int, ...], tuple[int, ...]]] = []
    for key, piece in found:
        array = np.asarray(piece.array)
        with naming(path=where, key=key):
            dtype, data = to_storage(array, key)
        data = np.ascontiguousarray(data).reshape(array.shape)
        converted.append((key, dtype, data, *_box(piece, array.shape, key, where)))
        pieces_of[key] = pieces_of.get(key, 0) + 1
    tile = shardindex.tile_bytes(sum(data.nbytes for _, _, data, _, _ in converted))
    for number, (key, dtype, data, start, shape) in enumerate(converted):
        columns, strips = _strips(data, start, dtype, tile)
        boxes.extend((key, dtype, part, at, shape, rows, number, start, data.shape, columns, data)
                     for part, at, rows in strips)
    for key, count in pieces_of.items():
        if count > MAX_PIECES_PER_KEY:  # a done-record readers would refuse: refused before writing
            raise SizeLimitError(f"has {count} pieces, over {MAX_PIECES_PER_KEY}", path=where, key=key)
    counts: dict[str, int] = {}
    for key, *_ in boxes:
        counts[key] = counts.get(key, 0) + 1
    listed = []
    for key, dtype, data, start, shape, rows, number, piece_start, piece_shape, columns, whole in boxes:
        stored = key if counts[key] == 1 else f"{key}@{','.join(map(str, start))}"
        listed.append(_Listed(key, stored, dtype, data, start, shape, rows, number, piece_start, tuple(piece_shape),
                              columns, whole))
    stored_names = [item.stored for item in listed]
    if len(set(stored_names)) != len(stored_names):
        clashes = sorted({name for name in stored_names if stored_names.count(name) > 1})
        keys = {item.key for item in listed if item.stored in clashes}
        raise PieceError(f"pieces of one key start at the same index, or a key looks like a piece's stored name: "
                         f"{named(clashes)}", path=where, key=next(iter(keys)) if len(keys) == 1 else None)
    return listed


def _strips(data: np.ndarray, start: tuple[int, ...], dtype: str, tile: int
            ) -> tuple[int, list[tuple[np.ndarray, tuple[int, ...], int]]]:
    """A piece as it is stored (:func:`~weightstore.formats._sharded_index.piece_cut`): the
    width of its column strips (0: stored whole) and ``(data, start, rows per block)`` of each
    strip, or of the piece whole (``tile``: the bytes a tile holds at least, for the rank's
    member). Strips are no pieces of the index: it names the piece, and its member's block
    table the strips."""
    columns, rows = piece_cut(data.shape, logical_dtype(dtype).itemsize, tile)
    if not columns:
        return 0, [(data, start, rows)]
    return columns, [(data[:, at : at + columns], (start[0], start[1] + at, *start[2:]), rows)  # copied as written
                     for at in range(0, data.shape[1], columns)]


def _check_index_share(listed: list[_Listed], world: int, member: str, where: str) -> None:
    """That this rank's pieces keep the version's index within its bounds
    (:func:`~weightstore.formats._sharded_index.check_share`), before anything is written. The
    member's size and table are not known yet: they count as the longest they can be."""
    keys = {item.key: (item.dtype, item.shape) for item in listed}
    boxes = list({item.piece: Box(0, item.piece_start, item.piece_shape) for item in listed}.values())
    check_share(world=world, keys=keys, boxes=boxes, member=(member, 10 ** 15, TableRef(10 ** 12, 10 ** 12, "0" * 64)),
                where=where)


def _pieces_of(key: str, value: Any, where: str) -> list[Any]:
    """A key's value as a list of pieces: a list or tuple of :class:`Piece` is one, anything else
    one array (``[1.0, 2.0]`` too, as everywhere else in weightstore)."""
    if isinstance(value, (list, tuple)) and value and any(isinstance(item, Piece) for item in value):
        if not all(isinstance(item, Piece) for item in value):
            raise PieceError("a list holds Pieces only, not Pieces and arrays (an array is the whole tensor: pass it "
                             "alone)", path=where, key=key)
        return list(value)
    return [value]


def _box(piece: Piece, array_shape: tuple[int, ...], key: str, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    try:
        start = tuple(checked_count("a start", s) for s in piece.start)
        shape = tuple(checked_count("a dimension of the shape", s) for s in piece.shape)
    except (TypeError, ValueError) as exc:
        why = str(exc) if isinstance(exc, ValueError) else "start and shape must be sequences of ints"
        raise PieceError(f"a piece's start {piece.start!r} and shape {piece.shape!r}: {why}", path=where,
                         key=key) from None
    if len(start) != len(shape) or len(array_shape) != len(shape) or any(
            s + n > d for s, n, d in zip(start, array_shape, shape, strict=True)):
        raise PieceError(f"a piece's array of shape {list(array_shape)} at {list(start)} does not fit the tensor's "
                         f"shape {list(shape)}", path=where, key=key)
    return start, shape


class _Digested:
    """``write_file``'s ``before`` work for a member, on each stored tensor (a piece, or a column
    strip of one) before it is written: its blocks' CRC-32s, of the bytes as stored (a strip's
    copy is in cache), joined into the tensor's CRC-32 for the write (which so makes no pass of
    its own for it), and, from a piece's first, the CRC-64 of each of the piece's bands of rows,
    from the piece in memory (:func:`~weightstore.formats._sharded_index.band_crc64s`), on the
    helper thread while its strips are copied and written (none where ``digests`` is false:
    ``publish_shard(digests=False)``); kept for its block table, whose change digests
    (:func:`~weightstore.formats._sharded_index.crc_band_digests`) are made of both. Where ISA-L
    has no CRC-64, the bands are hashed with BLAKE3 instead, as before (``kind`` None)."""

    def __init__(self, listed: list[_Listed], digests: bool = True):
        self._listed = {item.stored: item for item in listed}
        self.digests = digests
        self.kind = CRC_DIGESTS if digests and checksums.crc64(memoryview(b"")) is not None else None
        self.crcs: dict[str, list[int]] = {}
        # piece -> its bands' CRC-64s (or BLAKE3 digests, kind None), coming
        self._bands: dict[int, parallel.Beside[Any]] = {}

    def __call__(self, stored: str, data: np.ndarray) -> int:
        """Its blocks' CRC-32s kept, and their join returned: ``data``'s CRC-32."""
        item = self._listed[stored]
        if self.digests and item.piece not in self._bands:  # on the helper thread meanwhile
            bands = band_crc64s if self.kind == CRC_DIGESTS else band_digests
            self._bands[item.piece] = parallel.beside(functools.partial(bands, item.whole, item.rows))
        block = item.rows * row_bytes(data.shape, data.itemsize)
        crcs = self.crcs[stored] = block_crcs(data, block)
        return checksums.joined(crcs, block, data.nbytes)

    def bands(self, piece: int, strips: list[str]) -> list[bytes]:
        """The block digest of each band of ``piece``, whose stored tensors are ``strips``."""
        found = self._bands.get(piece)
        if found is None:
            return []
        if self.kind != CRC_DIGESTS:
            return cast(list[bytes], found.result())
        return crc_band_digests(found.result(), [self.crcs[stored] for stored in strips])


def _described(local: str, where: str, fmt: Format, listed: list[_Listed], digested: _Digested, *, step: int,
               attempt: int, rank: int, member: str, size: int, virtual: dict[str, int] | None = None
               ) -> tuple[BlockTable, dict[str, DoneTensor]]:
    """The member just written (``local``, published as ``where``, which errors name), described:
    its block table (where each piece's strips landed, the CRC-32 of each block and the change
    digest of the band of rows that holds it, from the work before the write: ``digested``)
    and the done-record's tensors (each piece's box and digest: the BLAKE3 of its bands'
    digests, which replicas written alike share). Where a format other than safetensors put
    the bytes is checked against the file: readers will take that range for the piece.
    ``virtual``: a delta member's offset of each stored tensor, where a reader places its
    rebuilt bytes (:class:`weightstore.formats.sharded._Rebuilt`)."""
    placed: list[Placed] = []
    crcs: list[int] = []
    digests: list[bytes] = []
    done: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], str]]] = {}
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    with contextlib.ExitStack() as stack:
        reader: Any = None
        if virtual is None:
            reader = fmt.open_reader(local, where, mmap=False)
            stack.callback(reader.close)
        opened = None if fmt.name == "safetensors" or reader is None else stack.enter_context(open(local, "rb"))
        by_piece: dict[int, list[_Listed]] = {}
        for item in listed:
            by_piece.setdefault(item.piece, []).append(item)
        for number, strips in by_piece.items():
            first, offsets = len(crcs), []
            bands = digested.bands(number, [item.stored for item in strips])
            for item in strips:
                offset = virtual[item.stored] if virtual is not None else reader.extent(item.stored)[0]
                if opened is not None:
                    _check_placed(opened, where, offset, item, digested.crcs[item.stored])
                crcs.extend(digested.crcs[item.stored])
                digests.extend(bands)  # a strip's blocks are its bands' tiles, in order
                offsets.append(offset)
            head = strips[0]
            placed.append(Placed(head.key, head.dtype, head.piece_start, head.piece_shape, head.columns, head.rows,
                                 first, tuple(offsets)))
            digest = _piece_digest(head, bands, kind=digested.kind) if digested.digests else _piece_digest(
                head, crcs=crcs[first:])
            done.setdefault(head.key, []).append((head.piece_start, head.piece_shape, digest))
            shapes.setdefault(head.key, (head.dtype, head.shape))
    joined = b"".join(digests)  # empty without digests: a table of none (docs/sharded.md)
    table = BlockTable(step=step, attempt=attempt, rank=rank, member=member, size=size, pieces=placed,
                       crcs=np.array(crcs, np.uint32), digests=joined, digests_blake3=blake3.blake3(joined).hexdigest(),
                       digest_kind=digested.kind if joined else None)
    return table, {key: DoneTensor(shapes[key][0], shapes[key][1], tuple(found)) for key, found in done.items()}


def _piece_digest(head: _Listed, bands: list[bytes] | None = None, crcs: list[int] | None = None,
                  kind: str | None = None) -> str:
    """A piece's digest in the done-record, which tells replicas written alike (:func:`_once`):
    the BLAKE3 of its bands' digests, which replicas share, ``change:`` where those are change
    digests (``kind``) and ``blake3:`` where they are BLAKE3 of the bands' bytes (a rank whose
    ISA-L has no CRC-64), so that equal replicas hashed the two ways are told as of two kinds,
    not as diverged; of a member without digests, the BLAKE3 of its blocks' CRC-32s
    (``crc32s:``), equal for equal bytes, and telling replicas that diverged apart short of a
    collision of every block's CRC-32 (replicas are no adversary)."""
    shape = f"{head.dtype}{list(head.piece_shape)}|".encode()
    if crcs is not None:
        return "crc32s:" + blake3.blake3(shape + np.array(crcs, "<u4").tobytes()).hexdigest()
    prefix = "change:" if kind == CRC_DIGESTS else "blake3:"
    return prefix + blake3.blake3(shape + b"".join(bands or [])).hexdigest()


def _check_placed(member: BinaryIO, where: str, offset: int, item: _Listed, crcs: list[int]) -> None:
    """That the member holds the piece's bytes at ``offset`` as they were written, judged by
    its first and last blocks against their CRC-32s (``crcs``, taken of the bytes as written):
    what goes wrong there is the whole layout (a format that converts the bytes, an extent off
    by a header), and the block CRC-32s catch any other difference when the piece is read."""
    size = item.data.nbytes
    block = item.rows * row_bytes(item.data.shape, item.data.itemsize)
    for index in sorted({0, len(crcs) - 1}) if crcs else ():
        member.seek(offset + index * block)
        if crc32(member.read(min(block, size - index * block))) != crcs[index]:
            raise WeightStoreError(f"the bytes of {item.stored!r} are not where the format says, as they are in "
                                   "memory; this member format cannot hold it", path=where, key=item.key)


# -- the coordinator's side --------------------------------------------------------------------

def _wait_for_ranks(members: Folder, step: int, attempt: int, world: int, timeout: float,
                    failures: Callable[[], Mapping[int, str]] | None,
                    doomed: Callable[[], None] = lambda: None) -> tuple[dict[int, DoneRecord], dict[str, int]]:
    """Every rank's done-record, parsed as it appears (one listing per look, each record read
    once, in rank order: a bad record the commit names is the lowest rank's, not whichever one
    the file system lists first), and the sizes of the files in the last listing (each member
    is whole before its record). A record of another step, attempt, rank or world fails the commit at once, as
    nothing can make it succeed (ranks launched with another world size would leave it waiting
    out its timeout for ranks that never come). A rank's done-record outweighs its word that it
    gave up: its member is whole. ``doomed`` is asked every :data:`_DOOMED_EVERY` seconds
    whether the commit can still succeed (it raises if not)."""
    deadline = time.monotonic() + timeout
    asked = time.monotonic()
    found: dict[int, DoneRecord] = {}
    wanted = {done_name(rank): rank for rank in range(world)}
    pause = 0.05
    while True:
        listing = members.files()
        for rank in sorted({wanted[entry.name] for entry in listing if entry.name in wanted} - found.keys()):
            data = members.read_small(done_name(rank), MAX_DONE_BYTES + 1)
            if data is not None:
                with naming(path=members.url(done_name(rank))):
                    found[rank] = _belonging(parse_done(data), step, attempt, rank, world)
        if len(found) == world:
            return found, {entry.name: entry.size for entry in listing}
        for rank, why in sorted((failures() if failures is not None else {}).items()):
            if rank not in found:
                raise PublishError(f"rank {rank} of {world} gave up: {why}; nothing was published",
                                   path=members.where)
        if time.monotonic() - asked >= _DOOMED_EVERY:
            doomed()
            asked = time.monotonic()
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = [rank for rank in range(world) if rank not in found]
            shown = ", ".join(map(str, missing[:20])) + (" …" if len(missing) > 20 else "")
            raise ShardTimeoutError(f"rank{'s' if len(missing) > 1 else ''} {shown} of {world} did not finish "
                                    f"within {timeout:g}s; nothing was published", path=members.where, missing=missing)
        time.sleep(min(pause, remaining))
        pause = min(pause * 2, _POLL)


def _belonging(record: DoneRecord, step: int, attempt: int, rank: int, world: int) -> DoneRecord:
    """``record``, found as rank ``rank``'s, if it is of this commit's step, attempt and world."""
    if (record.step, record.attempt, record.rank, record.world) != (step, attempt, rank, world):
        why = "" if record.world == world else f" (ranks or a launch of another world wrote it; {_HIGHER_ATTEMPT})"
        raise PublishError(f"rank {rank}'s done-record is for step {record.step} attempt {record.attempt} rank "
                           f"{record.rank} of {record.world}, not step {step} attempt {attempt} of {world}{why}; "
                           "nothing was published")
    return record


_Part = tuple[int, tuple[int, ...], tuple[int, ...], str]  # member, start, shape, digest


def _once(key: str, part: _Part, boxes: dict[tuple[str, tuple[int, ...], tuple[int, ...]], _Part]) -> bool:
    """Whether ``part`` (member, start, shape, digest) goes into the index: not where a rank
    before wrote the same part with the same bytes.

    Replicas that cannot tell which of them writes (a DTensor on a submesh, held alike by each
    copy of it along the mesh's other axes: FSDP2 over a layer tensor parallelism leaves
    alone) each write it; the index keeps the first. The same part with other bytes is a
    replica that diverged, refused rather than either copy taken. Digests of two kinds (one
    replica written with block digests, one without; or one with change digests, one with
    BLAKE3 ones: :func:`_piece_digest`) cannot tell: refused, naming what to make alike.
    """
    box = (key, part[1], part[2])
    first = boxes.setdefault(box, part)
    if first is part or not (first[3] and part[3]):
        return True  # no digest to tell: the overlap check refuses it
    kinds = {first[3].split(":")[0], part[3].split(":")[0]}
    if len(kinds) > 1:
        why = ("one with block digests and one without, so whether they hold the same values cannot be told: give "
               "every rank the same publish_shard(digests=...)") if "crc32s" in kinds else (
               "one with change digests and one with BLAKE3 ones (a rank whose isal package has no CRC-64, or an older "
               "weightstore), so whether they hold the same values cannot be told: give every rank the same isal and "
               "weightstore, or publish_shard(digests=False)")
        raise PublishError(f"ranks {first[0]} and {part[0]} wrote the part at {list(part[1])}, {why}", key=key)
    if first[3] != part[3]:
        raise PublishError(f"ranks {first[0]} and {part[0]} wrote the part at {list(part[1])} with "
                           "different values: replicas of it diverged (a buffer DDP does not broadcast, a value "
                           "set on one rank)", key=key)
    return False


def _merged(records: list[DoneRecord], step: int, attempt: int, world: int, metadata: dict[str, Any],
            incarnation: str | None = None) -> ShardIndex:
    """The index of the version the done-records describe; pieces checked key by key, and every
    record of one job incarnation (``incarnation``, or rank 0's record's); keys cut alike share
    one layout."""
    expected = records[0].incarnation if incarnation is None else incarnation
    whose = "rank 0's" if incarnation is None else "this commit's"
    for rank, record in enumerate(records):
        if record.incarnation != expected:
            raise PublishError(f"rank {rank}'s done-record is of job incarnation {record.incarnation or '(none)'}, "
                               f"{whose} of {expected or '(none)'}: two launches of the job (a preempted job's "
                               f"zombie and its replacement?) wrote step {step} attempt {attempt}; nothing was "
                               "published (commit a later step)")
    members = []
    for rank, record in enumerate(records):  # each of this step, attempt, rank and world (_belonging)
        members.append(Member(f"{attempt_folder(step, attempt)}/{record.member.file}", record.member.size, rank,
                              record.member.table))
        if record.member.table is not None and records[0].member.table is not None and \
                record.member.table.paged != records[0].member.table.paged:
            raise PublishError(f"rank {rank}'s done-record and rank 0's are of two weightstore versions (block tables "
                               f"paged and not): step {step} attempt {attempt} cannot be one index; publish it again")
    shapes: dict[str, tuple[str, tuple[int, ...]]] = {}
    parts: dict[str, list[Box]] = {}
    owners: dict[str, int] = {}
    boxes: dict[tuple[str, tuple[int, ...], tuple[int, ...]], _Part] = {}
    for rank, record in enumerate(records):
        for key, entry in record.tensors.items():
            known = shapes.get(key)
            if known is not None and known != (entry.dtype, entry.shape):
                raise PublishError(f"ranks disagree on it: rank {owners[key]} has {known[0]} {list(known[1])}, "
                                   f"rank {rank} {entry.dtype} {list(entry.shape)}", key=key)
            if known is None:
                shapes[key], owners[key], parts[key] = (entry.dtype, entry.shape), rank, []
            for start, shape, digest in entry.pieces:
                if any(len(axes) != len(entry.shape) for axes in (start, shape)):
                    raise PublishError(f"rank {rank} has a piece of {len(start)} axes of a tensor of "
                                       f"{len(entry.shape)}", key=key)
                if _once(key, (rank, start, shape, digest), boxes):
                    parts[key].append(Box(rank, start, shape))
    keyed = sum(key_entry_bytes(key, dtype, shape, len(shapes)) + 1 for key, (dtype, shape) in shapes.items())
    if keyed > KEY_BYTES:
        raise PublishError(f"the version's {len(shapes)} keys would take {keyed} bytes of its index, over the "
                           f"{KEY_BYTES} its keys may take (docs/sharded.md, Bounds)")
    budget = OverlapBudget()
    layouts: dict[tuple[int, ...], Layout] = {}
    tensors: dict[str, TensorEntry] = {}
    for key, (dtype, shape) in shapes.items():
        layout = Layout.of(parts[key], len(shape))
        layout = layouts.setdefault(tuple(layout.to_json()), layout)
        check_boxes(key, shape, layout, members, error=PublishError, budget=budget)
        tensors[key] = TensorEntry(dtype, shape, (), layout)
    return ShardIndex(step, attempt, world, "", members, tensors, metadata, f"weightstore {__version__}",
                      INDEX_VERSION if members[0].table is None or members[0].table.paged else 2,
                      list(layouts.values()))


def _check_ids(step: int, **counts: int) -> None:
    checked_step(step)
    for name, value in counts.items():
        checked_count(name, value)
