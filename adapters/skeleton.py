"""The one assign every adapter runs: plan, skip unchanged, read, write, remember.

Frameworks differ in how they list their variables and how they write arrays into them, and
in nothing else; so an adapter describes itself as a :class:`Target` and calls
:func:`run_assign`, the way safetensors' framework modules convert tensors and call one
implementation. What ``strict``, ``scope``, hot reload and the report mean is decided here
and in :mod:`weightstore.adapters.plan`, once for every framework.

A batched target (TF1, TF2) holds the model once: every value is read and verified before the
first variable changes, but what that pass read into memory of its own (an HDF5 tensor, not a
view of a mapped npz) is kept only up to a budget and read again when its batch is written,
and each batch hands the framework at most that budget of new arrays.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from weightstore.adapters._casts import out_of_range
from weightstore.adapters._reload import MEMORY, wants_skip
from weightstore.adapters._report import Plan, TargetInfo
from weightstore.adapters._values import Values, ValueSource, open_values
from weightstore.adapters.plan import AssignOptions, Report, plan_assign
from weightstore.core._forks import Pool
from weightstore.core._gcpause import paused_gc
from weightstore.core._heap import populate
from weightstore.errors import AssignmentError
from weightstore.io._buffer import (  # TF adopts aligned memory (EIGEN_MAX_ALIGN_BYTES)
    ALIGNMENT,
    aligned_array,
    memory_owner,
)

__all__ = ["Target", "ValueSource", "handed_over", "private_copy", "range_checked", "rehearsal", "run_assign"]

_ALIGNED_FROM = 1 << 16  # smaller arrays are copied plainly: aligning them costs more than TF's copy
_PIECE_BYTES = 16 << 20  # larger copies are split across threads: faulting in fresh pages is most of their cost
_COPIERS = max(1, min(4, os.cpu_count() or 1))
_copiers = Pool(_COPIERS - 1, "weightstore-copy") if _COPIERS > 1 else None
_handed_over: dict[int, np.ndarray] = {}  # address -> array, for the arrays of every handed_over block now open
_rehearsing: contextvars.ContextVar[bool] = contextvars.ContextVar("weightstore_rehearsing", default=False)

# A batch costs at most max(BATCH_MIN_BYTES, the assign's bytes / BATCH_SHARE) of new memory
# (Target.cost): 1/16 of a large model, so its extra memory stays near a tenth of it even with a
# tensor over the budget (such a tensor is a batch of its own). Not smaller: a TF1 session compiles
# each batch on its first call (a fixed 20-40 ms, for a copy of the whole graph, and more a
# variable), on the helper thread during the verify pass, and the more batches the less of that
# hides. The first tf1.assign of 256 MB, warm, x Saver.restore and extra memory: 64 MB batches
# 0.74x, 0.31-0.38x; 32 MB 0.81x, 0.25-0.28x; 16 MB 1.1-1.2x, 0.16-0.20x (measured in
# docs/benchmarks.md's git history).
BATCH_MIN_BYTES = 32 << 20
BATCH_SHARE = 16


@dataclass
class Target:
    """What one framework supplies to an assign.

    ``infos``: every variable it can write, by key. ``write``: writes a batch of ``(key, array)``
    (arrays as :attr:`prepare` made them) and returns the keys it wrote; it is called once, after
    every value was read and checked, so raising in it still changes nothing, and it may add
    to the report what it refused to write (``strict=False``). ``slot``: where hot reload
    remembers what a key's variable last received, as an object held weakly and a name in it:
    ``(variable, "")`` where the framework has variable objects, so a variable shared by two
    models (a nested Keras model, tied embeddings) has one memory whichever key wrote it;
    ``(session, name)`` for TF1, whose variables are names in a session.
    ``prepare`` reads one value for a target, by default read and cast to the target's dtype.
    ``plan`` pairs values with targets, by default :func:`plan_assign`; an adapter with a
    layout plans over converted values and returns the view to read them through.
    ``batched``: ``write`` is called once per batch of bounded bytes instead (see the module
    docstring), so it must copy what it keeps; values come as :attr:`prepare` read them.
    ``regions``: the regions a key's variable is written in, part by part (a TF1 partitioned
    variable's parts, a DTensor's local shard), or None for a key written whole. From a source
    that reads regions (a sharded version) hot reload then compares each part's digest: a key
    all of whose parts are unchanged is skipped, and ``kept`` (filled by :func:`run_assign`)
    holds the parts of the others that ``prepare`` and ``write`` may leave as they are.
    ``ahead``: of a batched target, called with each batch's keys before the verify pass, to get
    ready to write them while the values are read (a TF1 session compiles each batch meanwhile).
    ``cost``: of a batched target, the new memory writing a key's value takes, in bytes (default:
    its size): called with the value :attr:`prepare` made, and first with ``None``, for the least
    it may take (a TF1 resource variable takes over a view of a mapped file and frees its old
    buffer before a copy is made: nothing). Batches are cut by the least before the verify pass,
    so that most of an assign from a mapped file compiles as one batch, and any batch whose values
    turned out to cost more is written in pieces within the budget.
    """

    infos: Mapping[str, TargetInfo]
    write: Callable[[list[tuple[str, Any]], Report], list[str]]
    slot: Callable[[str], tuple[object, str]]
    prepare: Callable[[ValueSource, str, str], Any] | None = None
    plan: Callable[[Values, AssignOptions], tuple[Plan, ValueSource]] | None = None
    batched: bool = False
    regions: Callable[[str], list[tuple[slice, ...]] | None] | None = None
    kept: dict[str, frozenset[int]] = field(default_factory=dict)
    ahead: Callable[[list[list[str]]], None] | None = None
    cost: Callable[[str, Any], int] | None = None


def run_assign(target: Target, weights: Any, options: AssignOptions, *, skip_for: Any = None) -> Report:
    """Assign ``weights`` (a dict, path, Store or Version) into ``target`` under ``options``.

    ``skip_for`` is what decides the default of ``skip_unchanged`` when ``weights`` is a view
    made from it (a Keras file paired by structure from the Version the user passed).

    Batched, every value was read and verified (keys, dtypes, shapes, checksums) before the
    first batch is written, so a bad file still changes nothing. A later batch can fail only
    for what that pass could not see: a value read again (one that did not fit the budget)
    whose file was rewritten in place meanwhile, or the framework failing (out of memory).
    Then :class:`~weightstore.errors.AssignmentError` says how many variables were written
    (they keep their new values, the rest their old ones) and hot reload forgets the failed
    batch, so the next assign writes it whatever its checksums.
    """
    skip = wants_skip(weights if skip_for is None else skip_for, options.skip_unchanged)
    prepare = target.prepare or _read_as_target(target.infos)
    if options.cast:
        prepare = range_checked(prepare, target.infos)
    # An assign holds a few objects per variable until it ends; with tens of thousands of
    # variables they set off full collections that walk all of TensorFlow's objects (0.2-0.9 s
    # at 20,000 variables, a third of the assign). It makes no reference cycles of its own.
    with paused_gc(), open_values(weights) as values:
        plan, source = (target.plan or _plain_plan(target.infos))(values, options)
        report = plan.report
        todo: list[tuple[str, str]] = []
        digests: dict[str, str | None] = {}
        unchanged: dict[str, bool] = {}
        slots = {key: target.slot(key) for key in plan.pairs}
        changed_slots: set[tuple[int, str]] = set()  # a variable under two keys is skipped only if both are
        target.kept.clear()
        for key, value_key in plan.pairs.items():
            slot = slots[key]
            regions = target.regions(key) if target.regions is not None and source.regional else None
            if regions is None:
                digests[key] = source.checksum(value_key)
            else:
                digests[key], kept = _part_digests(source, value_key, regions, MEMORY.recall(*slot) if skip else None)
                if kept:
                    target.kept[key] = kept
            unchanged[key] = skip and MEMORY.unchanged(*slot, digests[key])
            if not unchanged[key]:
                changed_slots.add((id(slot[0]), slot[1]))
        for key, value_key in plan.pairs.items():
            slot = slots[key]
            if unchanged[key] and (id(slot[0]), slot[1]) not in changed_slots:
                report.skipped.append(key)
                target.kept.pop(key, None)
                del digests[key]
            else:
                todo.append((key, value_key))
        if _rehearsing.get():  # the source sees each read the assign would make; nothing is written
            for key, value_key in todo:
                prepare(source, key, value_key)
        elif target.batched:
            _write_batches(target, source, prepare, todo, digests, report)
        else:  # every value is held until the write anyway: read them together
            source.prefetch([value_key for _, value_key in todo])
            batch = [(key, prepare(source, key, value_key)) for key, value_key in todo]
            _remember(target, target.write(batch, report) if batch else [], digests, report)
    plan.warn()
    return report


def _part_digests(source: ValueSource, value_key: str, regions: list[tuple[slice, ...]],
                  remembered: str | None) -> tuple[str | None, frozenset[int]]:
    """A key's digest from its parts' (None if any is unknown), and which parts have the
    digest they had in ``remembered`` (what the key last received, made the same way)."""
    parts = [source.checksum(value_key, region) for region in regions]
    before = remembered.split("|") if remembered is not None else []
    if len(before) != len(parts):  # parted otherwise when last received: no part is known
        before = []
    kept = frozenset(i for i, (now, then) in enumerate(zip(parts, before, strict=False)) if now is not None and now == then)
    known = [part for part in parts if part is not None]
    return ("|".join(known) if len(known) == len(parts) else None), kept


def _remember(target: Target, written: list[str], digests: Mapping[str, str | None], report: Report) -> None:
    for key in written:
        MEMORY.remember(*target.slot(key), digests[key])
        report.assigned.append(key)


def _write_batches(target: Target, source: ValueSource, prepare: Callable[[ValueSource, str, str], Any],
                   todo: list[tuple[str, str]], digests: Mapping[str, str | None], report: Report) -> None:
    """Verify every value, then write them batch by batch; see :func:`run_assign` for failures."""
    sizes = {key: _nbytes(target.infos[key]) for key, _ in todo}
    budget = batch_budget(sum(sizes.values()))
    cost = target.cost or (lambda key, value: sizes[key])
    chunks = list(_chunks(todo, {key: cost(key, None) for key, _ in todo}, budget))
    if target.ahead is not None:
        target.ahead([[key for key, _ in chunk] for chunk in chunks])
    kept: dict[str, Any] = {}
    held = 0
    for chunk in chunks:  # the verify pass: any bad value raises here, before any write
        source.prefetch([value_key for _, value_key in chunk])  # a budget's worth, as the write batches will hold
        for key, value_key in chunk:
            value = prepare(source, key, value_key)
            if not _costs_memory(value):
                kept[key] = value
            elif held + sizes[key] <= budget:
                kept[key] = value
                held += sizes[key]
            del value  # one not kept is read again in its batch
    costs = {key: cost(key, kept[key]) if key in kept else sizes[key] for key, _ in todo}  # not kept: read again
    written_before = False
    for chunk in (piece for whole in chunks for piece in _chunks(whole, costs, budget)):
        try:
            batch = [(key, kept.pop(key) if key in kept else prepare(source, key, value_key))
                     for key, value_key in chunk]
            written = target.write(batch, report)
            del batch
        except Exception as exc:
            if not written_before:
                raise
            for key, _ in chunk:  # the variables of this batch may hold anything now
                MEMORY.remember(*target.slot(key), None)
            raise AssignmentError(
                f"cannot assign{'' if source.path else ' ' + source.where}: failed after {len(report.assigned)} "
                f"of {len(todo)} variables were written, which keep their new values ({exc})", path=source.path,
            ) from exc
        _remember(target, written, digests, report)
        written_before = True


def batch_budget(nbytes: int) -> int:
    """The new memory one batch of an assign of ``nbytes`` may take (see :data:`BATCH_MIN_BYTES`)."""
    return max(BATCH_MIN_BYTES, nbytes // BATCH_SHARE)


def _chunks(todo: list[tuple[str, str]], sizes: Mapping[str, int], budget: int) -> Iterator[list[tuple[str, str]]]:
    """``todo`` in order, cut into runs of at most ``budget`` bytes (a larger value alone)."""
    chunk: list[tuple[str, str]] = []
    filled = 0
    for item in todo:
        if chunk and filled + sizes[item[0]] > budget:
            yield chunk
            chunk, filled = [], 0
        chunk.append(item)
        filled += sizes[item[0]]
    if chunk:
        yield chunk


def _nbytes(info: TargetInfo) -> int:
    return math.prod(info.shape) * np.dtype(info.dtype).itemsize


def _costs_memory(value: Any) -> bool:
    """Whether keeping ``value`` holds memory of its own, rather than a view of a mapped file."""
    return not isinstance(memory_owner(value), mmap.mmap)


def _plain_plan(infos: Mapping[str, TargetInfo]) -> Callable[[Values, AssignOptions], tuple[Plan, ValueSource]]:
    return lambda values, options: (plan_assign(values, infos, options), values)


def _read_as_target(infos: Mapping[str, TargetInfo]) -> Callable[[ValueSource, str, str], np.ndarray]:
    return lambda source, key, value_key: np.asarray(source.read(value_key), dtype=infos[key].dtype)


def range_checked(prepare: Callable[[ValueSource, str, str], Any],
              infos: Mapping[str, TargetInfo]) -> Callable[[ValueSource, str, str], Any]:
    """``prepare``, reading a value to be cast through :class:`_RangeChecked`. It runs in the
    verify pass, so a value out of its variable's range changes no variable."""
    def checked(source: ValueSource, key: str, value_key: str) -> Any:
        dtype = np.dtype(infos[key].dtype)
        if source.dtype(value_key) == dtype:
            return prepare(source, key, value_key)
        return prepare(cast(ValueSource, _RangeChecked(source, key, dtype)), key, value_key)
    return checked


class _RangeChecked:
    """A value source whose reads refuse a value that a cast to ``dtype`` would turn into other
    numbers (:func:`~weightstore.adapters._casts.out_of_range`): each read an adapter makes (the
    whole value, or only the region a variable's part holds) is checked as the file holds it."""

    def __init__(self, source: ValueSource, key: str, dtype: np.dtype):
        self._source, self._key, self._dtype = source, key, dtype

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    def read(self, value_key: str) -> np.ndarray:
        return self._checked(value_key, self._source.read(value_key))

    def read_region(self, value_key: str, region: tuple[slice, ...]) -> np.ndarray:
        return self._checked(value_key, self._source.read_region(value_key, region))

    def _checked(self, value_key: str, value: np.ndarray) -> np.ndarray:
        problem = out_of_range(np.asarray(value), self._dtype)
        if problem:
            into = "" if value_key == self._key else f" to {self._key!r}"
            raise AssignmentError(f"cannot assign {value_key!r}{into} as {self._dtype.name}: the value {problem}",
                                  path=self._source.path)
        return value


@contextlib.contextmanager
def rehearsal() -> Iterator[None]:
    """Inside the block (in this thread), an assign plans, decides what hot reload skips and
    prepares each value it would write, but writes nothing and remembers nothing.

    So a source that records what it is asked for learns exactly which values, and which
    regions of them, the real assign will read: a follower fetches those with no lock held,
    then assigns from memory (see :mod:`weightstore.adapters.serving.follower`).
    """
    token = _rehearsing.set(True)
    try:
        yield
    finally:
        _rehearsing.reset(token)


@contextlib.contextmanager
def handed_over(arrays: Iterable[np.ndarray]) -> Iterator[None]:
    """Inside the block, :func:`private_copy` gives the framework ``arrays`` (or views of them)
    themselves, to keep as its variables' buffers, instead of copying them.

    For arrays read into memory of their own that nothing else holds or will write (a
    follower's staged version): an assign from them then needs no second copy of the model.
    Only an aligned array already of the target's dtype that is nearly all of the allocation
    behind it is given (keeping a view of a larger buffer would keep all of that buffer alive),
    and only once.

    Once given, the variable is the memory's only user, so training it in place changes no one
    else's data. That rests on the follower: its staged store is its own (opened for the swap,
    closed when the block ends, dropping every reference to the arrays); a remote read gives
    each tensor a buffer of its own; a local file's tensors are views of a read-only map, whose
    owner is no array, so they are never given but copied; ``ws.load(follower.version)`` opens
    the file anew and reads fresh memory. The table of handed-over addresses is process-wide,
    but an assign on another thread meets one of its addresses only with a view of one of
    these arrays, which only the follower holds.
    """
    given = {array.ctypes.data: array for array in arrays if isinstance(array, np.ndarray) and array.nbytes}
    _handed_over.update(given)
    try:
        yield
    finally:
        for address in given:
            _handed_over.pop(address, None)


def is_handed_over(array: np.ndarray) -> bool:
    """Whether ``array`` lies where an array of an open :func:`handed_over` block does, so
    :func:`private_copy` decides whether to give it instead of copying it."""
    return bool(_handed_over) and array.ctypes.data in _handed_over


def _given(array: np.ndarray, dtype: np.dtype) -> bool:
    """Whether :func:`private_copy` may hand the framework ``array`` itself (see :func:`handed_over`).

    An array is known by its address: conversions make new views of a handed-over array (numpy
    links a view to the memory's owner, not to the array it was made from), and while that
    array lives no other memory can lie at its address."""
    handed = _handed_over.get(array.ctypes.data) if _handed_over else None
    if (handed is None or array.dtype != dtype or array.nbytes < _ALIGNED_FROM or array.nbytes > handed.nbytes
            or not array.flags.c_contiguous or array.ctypes.data % ALIGNMENT):
        return False
    owner = memory_owner(array)
    if not isinstance(owner, np.ndarray) or owner.nbytes > array.nbytes + _ALIGNED_FROM:
        return False
    # given once: two variables fed the same value must not share a buffer, or an in-place
    # write into one (TF copies into a buffer it holds alone) would change the other
    return _handed_over.pop(array.ctypes.data, None) is not None


def private_copy(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``array`` as ``dtype`` in fresh 64-byte-aligned memory that only the framework will hold
    (or ``array`` itself, inside :func:`handed_over` for it).

    TensorFlow adopts aligned fed memory as a resource variable's buffer instead of copying it
    (as its own restore adopts what it read), so this is the one copy an assign needs. Handing
    it the caller's array would make the variable change whenever the caller's array does; a
    view of a mapped file would pin that file (even once pruned) for as long as the variable
    lives, and leave in-place updates a read-only map to write into. A small array is copied
    without aligning it: TF may copy it again, which costs less than aligning it did.
    """
    dtype = np.dtype(dtype)
    if _given(array, dtype):
        return array
    size = math.prod(array.shape) * dtype.itemsize
    if size < _ALIGNED_FROM:  # the framework's own copy of a small array costs less than aligning it
        return np.array(array, dtype, order="C")
    out = aligned_array(size).view(dtype).reshape(array.shape)
    copy_into(out, array)
    return out


def copy_into(out: np.ndarray, array: np.ndarray) -> None:
    """``np.copyto`` in pieces along the first axis on several threads (:func:`copy_all`)."""
    copy_all([(out, array)])


def copy_all(pairs: list[tuple[np.ndarray, np.ndarray]], *, fresh: bool = False) -> None:
    """Each ``np.copyto(out, array)``, in pieces of about 16 MB along first axes, the pieces of
    every pair shared out among several threads (numpy releases the GIL): faulting in fresh pages
    is most of a copy's cost, and a batch of values of a few megabytes each, copied one after
    another, left the other cores idle (the first ``tf1.assign`` of a 256 MB model copies 73).
    ``fresh``: the outs are new memory, whose pages each piece faults in first in one system call
    (:func:`~weightstore.core._heap.populate`)."""
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    for out, array in pairs:
        count = min(out.nbytes // _PIECE_BYTES, out.shape[0] if out.ndim else 1)
        if count < 2:
            pieces.append((out, array))
            continue
        bounds = [out.shape[0] * i // count for i in range(count + 1)]
        pieces += [(out[a:b], array[a:b]) for a, b in itertools.pairwise(bounds)]
    helpers = min(_COPIERS, len(pieces)) - 1
    if _copiers is None or helpers < 1 or sum(out.nbytes for out, _ in pieces) < 2 * _PIECE_BYTES:
        for piece in pieces:
            _copy(piece, fresh)
        return
    claims, claiming = iter(pieces), threading.Lock()  # each piece copied once, by whichever thread is free

    def copy() -> None:
        while True:
            with claiming:
                piece = next(claims, None)
            if piece is None:
                return
            _copy(piece, fresh)

    others = [_copiers.submit(copy) for _ in range(helpers)]
    try:
        copy()
    finally:
        for other in others:
            other.result()


def _copy(piece: tuple[np.ndarray, np.ndarray], fresh: bool) -> None:
    out, array = piece
    if fresh and out.flags.c_contiguous:
        populate(out.ctypes.data, out.nbytes)
    np.copyto(out, array, casting="unsafe")
