"""A model published as one sharded version by every worker of a ``MultiWorkerMirroredStrategy``.

Every worker calls :func:`publish_sharded` alike (same folder, step and selection; ``tf2``
re-exports it). Under ``MultiWorkerMirroredStrategy`` every worker holds the same value of
each mirrored variable, so no tensor needs to cross the network: each worker writes only its
share, cut by :func:`plan`, which every worker computes alike from the variables' keys, shapes
and dtypes. The plan lays the selected tensors end to end in key order (a ``ShardedVariable``
as its shards, each its own stretch, never concatenated) and cuts that line into ``world``
equal stretches of bytes: a tensor under one block (256 KiB) goes whole to the worker holding
its middle byte, a larger one is cut between rows (its first axis) where the stretches end.
So each member holds ``1/world`` of the bytes, give or take half a small tensor or one row at
each cut. Each worker reads only the rows it writes, from its own replica.

The workers agree on two things through TensorFlow's own coordination service (its key-value
store, which ``MultiWorkerMirroredStrategy`` starts), not through collectives, so a publish
never waits in line behind the training step's all-reduces and may run in a background
thread: rank 0 (the chief, else worker 0) announces the attempt (one after every attempt
the folder holds of this step, which it claims: :func:`weightstore.sharded._shards.claimed_attempt`),
with a digest of its plan's outline, which a worker that would cut another plan refuses, and
the launch's incarnation, drawn once by the chief's process and recorded in every
done-record, so a commit refuses members another launch wrote; then, after
:func:`weightstore.commit_shards`, the committed version or what went wrong. A worker whose
own write fails says so (the first to fail is heard), so the chief's commit stops at once
instead of waiting out ``timeout`` for that member. Keys are
``weightstore/<folder digest>/step-<n>/call-<i>/…``, where ``i`` counts this process's calls
for that folder and step that met the chief, as every worker does alike: a worker's call that
timed out before the chief's announcement, or that the chief never made, does not count, so
the next call meets the chief's next one. (A chief that makes that call later still leaves its
news: the worker's next call reads it and fails once more, and the two are in step after. A
worker that gives up counts its call, which the chief is taken to make.)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import json
import math
import secrets
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from typing_extensions import Unpack

from weightstore.core._extras import needs

with needs("tf", __name__):
    import tensorflow as tf
    from tensorflow.python.eager import context

from weightstore.adapters.plan import Selection, SelectionWords
from weightstore.errors import PublishError, ShardTimeoutError, WeightStoreError
from weightstore.formats._sharded_index import BLOCK_BYTES
from weightstore.io.folders import Folder, folder_for
from weightstore.sharded import _cluster as cluster
from weightstore.sharded._shards import Piece, claimed_attempt, commit_shards, in_background, publish_shard
from weightstore.store._save import checked_metadata
from weightstore.sync._defaults import DEFAULT_KEEP
from weightstore.sync._delta import Delta, as_delta
from weightstore.sync._pinning import Version

__all__ = ["publish_sharded", "share", "plan", "Segment"]

#: how much longer than ``timeout`` a worker waits for the chief's news: for the attempt, as the
#: chief may reach the call later than the worker; for the commit, as the commit's own work
#: (the index, ``LATEST``, pruning) comes after the chief's wait for the members
_NEWS_GRACE = 60.0
_SHARDED = tf.__internal__.distribute.ShardedVariable
#: per (folder, step): how many of this process's calls met the chief (naming the next call's
#: keys), and the last attempt its chief handed out (a retry goes above it even if that try left
#: nothing yet)
_calls: dict[tuple[str, int], int] = {}
_handed_out: dict[tuple[str, int], int] = {}
#: the key prefixes of this chief's calls whose keys are not all deleted yet, oldest first (:meth:`_Channel.sweep`)
_unswept: list[str] = []
_lock = threading.Lock()
#: the chief's incarnation (:func:`_incarnation`), announced with each attempt
_drawn: str | None = None


@dataclass(frozen=True)
class Segment:
    """One stretch of the plan's line: a whole variable, or one shard of a ``ShardedVariable``,
    lying at ``start`` of the tensor ``key`` of shape ``whole``."""

    key: str
    shape: tuple[int, ...]
    itemsize: int
    start: tuple[int, ...]
    whole: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def plan(segments: list[Segment], world: int) -> list[list[tuple[Segment, int, int]]]:
    """Per rank, ``(segment, first row, end row)`` of what it writes (a 0-d tensor: ``0, 1``).

    Deterministic in ``segments`` (their order, shapes and dtypes) and ``world`` alone, so that
    every worker computes the same plan; together the ranks cover every segment exactly once.
    """
    total = sum(segment.nbytes for segment in segments)
    cuts = [rank * total // world for rank in range(world + 1)]

    def owner(byte: int) -> int:  # the rank whose stretch holds ``byte``
        return min(world - 1, max(rank for rank in range(world) if cuts[rank] <= byte))

    shares: list[list[tuple[Segment, int, int]]] = [[] for _ in range(world)]
    offset = 0
    for segment in segments:
        rows = segment.shape[0] if segment.shape else 1
        if segment.nbytes < BLOCK_BYTES or not segment.shape:
            shares[owner(offset + segment.nbytes // 2)].append((segment, 0, rows))
        else:  # row i goes to the rank whose stretch holds its first byte
            firsts = [min(rows, max(0, -(-(cut - offset) // segment.row_bytes))) for cut in cuts[:-1]] + [rows]
            for rank in range(world):
                if firsts[rank] < firsts[rank + 1]:
                    shares[rank].append((segment, firsts[rank], firsts[rank + 1]))
        offset += segment.nbytes
    return shares


def share(variables: Mapping[str, Any], rank: int, world: int) -> dict[str, list[Piece]]:
    """Rank ``rank``'s pieces of ``variables`` (key -> variable) of a version ``world`` workers
    write alike: the rows :func:`plan` gives it, read from its own replica. Each worker calls it
    with the same variables (the same keys, shapes and dtypes), or the shares do not tile."""
    sources = _segments(variables)
    return _read(sources, plan(list(sources), world)[rank])


def publish_sharded(
    folder: Any,
    model: Any,
    *,
    step: int,
    strategy: Any,
    timeout: float = 600.0,
    keep: int | None = DEFAULT_KEEP,
    metadata: Mapping[str, Any] | None = None,
    optimizer: bool = False,
    background: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    delta: bool | Delta = False,
    digests: bool = True,
    **selection: Unpack[SelectionWords],
) -> Version | concurrent.futures.Future[Version]:
    """Publish ``model``'s variables as one sharded version, each worker writing its share.

    Call it on every worker of ``strategy``'s cluster with the same arguments; each returns the
    same :class:`~weightstore.Version`. ``model`` and the selection words are those of
    ``tf2.export``; the keys are the same. Values are read when each worker reaches the call,
    so call it between training steps (from a background thread: while no step runs).
    A strategy without a cluster (one process) writes everything as rank 0 of 1.

    With ``background=True`` each worker reads its share now (into host memory) and the call
    returns a ``concurrent.futures.Future`` of the version at once; meeting the chief, writing
    and committing run in one publishing thread per process, in the order of the calls.

    ``timeout`` bounds the wait for the slowest worker, counted from the chief's announcing the
    attempt; a worker waits that long and a minute more for the chief's news.

    ``delta``: a :class:`~weightstore.Delta` given to every publish of this worker (or ``True``):
    each worker writes its member as a delta of its member of the version before, where smaller
    (``publish_shard``'s ``delta``). Every worker cuts the same plan each time, so its share
    stays its own while the model's keys, shapes and the cluster do.

    ``digests=False``: no BLAKE3 of each block (``publish_shard``'s): for a checkpoint no follower
    reads, whose every block is still verified as it is read.

    Raises:
        ShardTimeoutError: a worker did not write its share within ``timeout`` (``.missing``
            names it), or a worker heard nothing from the chief; nothing is published.
        PublishError: the step does not go forward, another coordinator committed it, the
            chief failed (its message is given), a worker's write failed (naming it and its
            error), or a worker's plan differs from the chief's (naming the keys that differ).
        WeightStoreError: the strategy is not one whose workers all run this call, or its
            cluster has no coordination service.
    """
    from weightstore.adapters import tf2  # here: tf2 re-exports this module's function

    variables = tf2.selected(model, optimizer=optimizer, **Selection.of("tf2.publish_sharded", selection, publish_sharded).words())
    metadata = checked_metadata(metadata)  # on every worker, so that all of them refuse it alike
    planner = as_delta(delta)
    rank, world = _place(strategy)
    outline = _outline(_segments(variables))
    target = folder_for(folder, storage_options)
    channel = _Channel(target, step, world)
    try:  # now, where the caller put the call (between training steps), not once the chief is heard
        pieces = share(variables, rank, world)
    except Exception as exc:  # the others would wait out their timeouts for this rank
        if rank == 0:
            channel.tell("attempt", {"error": f"{type(exc).__name__}: {exc}"})
        else:
            channel.give_up(rank, f"{type(exc).__name__}: {exc}")
        raise
    if rank == 0:
        call = functools.partial(_as_chief, channel, target, pieces, outline, world, timeout, keep, metadata,
                                 storage_options, planner, digests)
    else:
        call = functools.partial(_as_worker, channel, target, pieces, outline, rank, world, timeout, storage_options,
                                 planner, digests)
    return in_background(call) if background else call()


def _as_chief(channel: _Channel, target: Folder, pieces: dict[str, list[Piece]], outline: dict[str, list[Any]],
              world: int, timeout: float, keep: int | None, metadata: Mapping[str, Any] | None,
              storage_options: Mapping[str, Any] | None, delta: Delta | None, digests: bool) -> Version:
    step = channel.step
    try:
        attempt = claimed_attempt(target, step, _incarnation(), _handed_out.get(channel.place, -1) + 1,
                                  storage_options=storage_options)
    except Exception as exc:
        channel.tell("attempt", {"error": str(exc)})
        raise
    channel.tell("attempt", {"attempt": attempt, "world": world, "plan": _digest(outline),
                             "incarnation": _incarnation()})
    _handed_out[channel.place] = attempt
    announced = time.monotonic()
    try:
        publish_shard(target.where, pieces, step=step, rank=0, world=world, attempt=attempt,
                      storage_options=storage_options, incarnation=_incarnation(), delta=delta or False,
                      digests=digests)
        version = commit_shards(target.where, step=step, world=world, attempt=attempt, keep=keep, metadata=metadata,
                                timeout=round(max(0.0, timeout - (time.monotonic() - announced)), 1),
                                storage_options=storage_options, incarnation=_incarnation(),
                                failures=lambda: channel.failures(outline))
    except ShardTimeoutError as exc:
        channel.tell("committed", {"error": str(exc), "missing": exc.missing})
        channel.swept_later()
        raise
    except Exception as exc:
        channel.tell("committed", {"error": str(exc)})
        channel.swept_later()
        raise
    channel.tell("committed", {"step": version.step, "file": version.path.rsplit("/", 1)[-1],
                               "created": version.created, "metadata": version.metadata})
    channel.sweep()
    return version


def _as_worker(channel: _Channel, target: Folder, pieces: dict[str, list[Piece]], outline: dict[str, list[Any]],
               rank: int, world: int, timeout: float, storage_options: Mapping[str, Any] | None,
               delta: Delta | None, digests: bool) -> Version:
    news = channel.hear("attempt", timeout + _NEWS_GRACE, "the attempt")
    heard = time.monotonic()
    if news.get("world") != world:
        channel.give_up(rank, f"it writes for {world} ranks, the chief for {news.get('world')}")
        raise PublishError(f"the chief writes for {news.get('world')} ranks, this worker for {world}",
                           path=target.where)
    if news.get("plan") != _digest(outline):  # its share would not be the one the chief counts on
        channel.give_up(rank, "its plan differs from the chief's", outline)
        channel.hear("committed", timeout - (time.monotonic() - heard) + _NEWS_GRACE, "the commit")  # names the keys
        raise PublishError("this worker's plan (the keys, dtypes and shapes it publishes) differs from the chief's",
                           path=target.where)
    try:
        publish_shard(target.where, pieces, step=channel.step, rank=rank, world=world,
                      attempt=int(news["attempt"]), storage_options=storage_options,
                      incarnation=str(news.get("incarnation", "")), delta=delta or False, digests=digests)
    except Exception as exc:  # the chief would otherwise wait out its timeout for this member
        channel.give_up(rank, f"{type(exc).__name__}: {exc}")
        raise
    news = channel.hear("committed", timeout - (time.monotonic() - heard) + _NEWS_GRACE, "the commit")
    return Version(int(news["step"]), target.url(str(news["file"])), str(news["created"]), dict(news["metadata"]),
                   target)


def _incarnation() -> str:
    """This chief process's incarnation, drawn the first time: the coordination service is the
    chief's (a new launch starts a new one), so what it announces is this launch's."""
    global _drawn
    with _lock:
        if _drawn is None:
            _drawn = secrets.token_hex(8)
        return _drawn


class _Channel:
    """The keys one call's workers meet at in TF's coordination service (one worker alone
    tells no one, and needs no service)."""

    def __init__(self, target: Folder, step: int, world: int) -> None:
        self.alone = world == 1
        if not self.alone and context.context().coordination_service is None:
            raise WeightStoreError("the strategy's cluster runs no coordination service, which publish_sharded "
                                   "meets the other workers through (MultiWorkerMirroredStrategy starts one)")
        self.step, self.where = step, target.where
        self.place = (target.where, step)
        with _lock:
            self.call = _calls.get(self.place, 0)
        digest = hashlib.sha256(target.where.encode()).hexdigest()[:16]
        self.prefix = f"weightstore/{digest}/step-{step}/call-{self.call}"

    def met(self) -> None:
        """Count this call as one that met the chief. A worker's call that never heard it (it
        timed out, or the chief never made that call) is not counted, so its next call waits at
        the same keys as the chief's next call."""
        with _lock:
            _calls[self.place] = max(_calls.get(self.place, 0), self.call + 1)

    def tell(self, what: str, news: Mapping[str, Any]) -> None:
        self.met()
        if self.alone:
            return
        try:
            context.context().set_config_key_value(f"{self.prefix}/{what}", json.dumps(news))
        except tf.errors.AlreadyExistsError:
            raise PublishError(f"another publish_sharded of step {self.step} to this folder is running in this "
                               "process; publish each step once, from one thread", path=self.where) from None
        except tf.errors.OpError as exc:
            raise PublishError(f"lost TensorFlow's coordination service telling the workers: {exc.message}",
                               path=self.where) from None

    def swept_later(self) -> None:
        """The chief, after a call that committed nothing: its keys go at the next commit's :meth:`sweep`."""
        with _lock:
            _unswept.append(self.prefix)

    def sweep(self) -> None:
        """The chief, once this call committed (so every worker wrote its member): delete the keys
        no worker reads again, as :meth:`weightstore.sharded._agree.Meeting.sweep` does in c10d's
        and JAX's stores. Every worker has read this call's attempt, and, as a process makes its
        calls one after another, the news of each call before: so this call's attempt and word of
        giving up go, and every key of the calls to this folder before it; its news of the
        commit stays until the next. A service that refuses leaves them, never failing the publish."""
        if self.alone:
            return
        folder = self.prefix.split("/step-")[0] + "/"  # another folder's calls are its own commits' to sweep
        with _lock:
            before = [prefix for prefix in _unswept if prefix != self.prefix and prefix.startswith(folder)]
            _unswept[:] = [prefix for prefix in _unswept if not prefix.startswith(folder)] + [self.prefix]
        keys = [f"{prefix}/{what}" for prefix in before for what in ("attempt", "gave-up", "committed")]
        for key in [*keys, f"{self.prefix}/attempt", f"{self.prefix}/gave-up"]:
            with contextlib.suppress(tf.errors.OpError):  # not there (no worker gave up), or the service failing
                context.context().delete_config_key_value(key)

    def give_up(self, rank: int, why: str, outline: dict[str, list[Any]] | None = None) -> None:
        """Tell the chief that ``rank`` writes nothing, and why (with its plan's outline, if that
        is why); the first worker to say so is heard. The chief makes this call, so it counts as
        one that met it."""
        self.met()
        news = {"rank": rank, "why": why, **({} if outline is None else {"outline": outline})}
        with contextlib.suppress(tf.errors.OpError):  # another worker's word is there already
            context.context().set_config_key_value(f"{self.prefix}/gave-up", json.dumps(news))

    def failures(self, outline: dict[str, list[Any]]) -> dict[int, str]:
        """The worker that gave up, with why (``commit_shards`` asks at each look for members); a
        plan that differs from the chief's ``outline`` is told key by key."""
        if self.alone:
            return {}
        try:  # a look of a millisecond: a word missed now is read at the next look
            news = json.loads(context.context().get_config_key_value(f"{self.prefix}/gave-up", 1))
        except tf.errors.OpError:  # none yet, or the service is failing: the members' timeout decides
            return {}
        rank = int(news["rank"])
        if "outline" in news:
            return {rank: f"its plan differs from the chief's (every worker passes the same model and selection): "
                          f"{_differences(outline, news['outline'], rank)}"}
        return {rank: str(news["why"])}

    def hear(self, what: str, timeout: float, waited_for: str) -> dict[str, Any]:
        """The chief's news; its failure raised here as this worker's."""
        try:
            text = context.context().get_config_key_value(f"{self.prefix}/{what}", max(1, int(timeout * 1000)))
        except tf.errors.DeadlineExceededError:
            raise ShardTimeoutError(f"no word of {waited_for} from the chief (rank 0) within {timeout:g}s; "
                                    "nothing was published", path=self.where, missing=[0]) from None
        except tf.errors.OpError as exc:
            raise PublishError(f"lost TensorFlow's coordination service waiting for {waited_for}: {exc.message}",
                               path=self.where) from None
        self.met()
        news = json.loads(text)
        if "error" not in news:
            return dict(news)
        if "missing" in news:
            raise ShardTimeoutError(f"the chief: {news['error']}", path=self.where, missing=news["missing"])
        raise PublishError(f"the chief: {news['error']}", path=self.where)


def _place(strategy: Any) -> tuple[int, int]:
    """``(rank, world)`` of this worker in ``strategy``'s cluster; ``(0, 1)`` without one."""
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise WeightStoreError("under ParameterServerStrategy only the coordinator runs the program; publish from "
                               "it with tf2.export and weightstore.publish")
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return 0, 1
    return cluster.rank_in_tf_cluster(resolver.cluster_spec().as_dict(), resolver.task_type, int(resolver.task_id))


def _segments(variables: Mapping[str, Any]) -> dict[Segment, Any]:
    """The plan's line in key order, each segment with the variable its rows are read from."""
    sources = {}
    for key in sorted(variables):
        var = variables[key]
        # a Keras variable says "on_read", a TF one VariableSynchronization.ON_READ
        if str(getattr(var, "synchronization", "")).lower().endswith("on_read"):
            raise WeightStoreError(f"{key!r} is synchronized on read (a metric's total, say): each replica holds its "
                                   "own part and reading the sum is a collective; leave it out (exclude=)")
        whole, itemsize = tuple(var.shape), np.dtype(tf.as_dtype(var.dtype).as_numpy_dtype).itemsize
        row = 0
        for shard in var.variables if isinstance(var, _SHARDED) else [var]:
            shape = tuple(shard.shape)
            sources[Segment(key, shape, itemsize, (row,) + (0,) * (len(whole) - 1) if whole else (), whole)] = shard
            row += shape[0] if shape else 0
    return sources


def _outline(sources: Mapping[Segment, Any]) -> dict[str, list[Any]]:
    """What the plan is cut from, key by key: ``[dtype, shape, rows of each shard]`` (one shard
    but for a ``ShardedVariable``). Workers whose outlines agree compute the same plan."""
    outline: dict[str, list[Any]] = {}
    for segment, var in sources.items():
        entry = outline.setdefault(segment.key, [tf.as_dtype(var.dtype).name, list(segment.whole), []])
        entry[2].append(segment.shape[0] if segment.shape else 1)
    return outline


def _digest(outline: dict[str, list[Any]]) -> str:
    return hashlib.sha256(json.dumps(outline).encode()).hexdigest()


def _differences(chief: dict[str, list[Any]], worker: dict[str, list[Any]], rank: int) -> str:
    """Where ``rank``'s outline departs from the chief's, the first few keys."""
    def shown(entry: list[Any]) -> str:
        dtype, shape, shards = entry
        return f"{dtype} {shape}" + (f" in shards of {shards} rows" if len(shards) > 1 else "")

    found = []
    for key in sorted(chief.keys() | worker.keys()):
        ours, theirs = chief.get(key), worker.get(key)
        if theirs is None:
            found.append(f"{key!r} ({shown(chief[key])}) is in the chief's, not in rank {rank}'s")
        elif ours is None:
            found.append(f"{key!r} ({shown(theirs)}) is in rank {rank}'s, not in the chief's")
        elif ours != theirs:
            found.append(f"{key!r} is {shown(ours)} in the chief's, {shown(theirs)} in rank {rank}'s")
    return "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")


def _read(sources: dict[Segment, Any], share: list[tuple[Segment, int, int]]) -> dict[str, list[Piece]]:
    """This worker's pieces: the rows of its share, read from its own replica."""
    pieces: dict[str, list[Piece]] = {}
    for segment, first, end in share:
        pieces.setdefault(segment.key, []).append(_piece(sources[segment], segment, first, end))
    return pieces


def _piece(var: Any, segment: Segment, first: int, end: int) -> Piece:
    """Rows ``first:end`` of ``var`` (this replica's copy), at their place in the whole tensor."""
    value = tf.convert_to_tensor(var)
    if not segment.shape:
        return Piece(np.asarray(value.numpy()), (), ())
    start = (segment.start[0] + first, *segment.start[1:])
    rows = value if (first, end) == (0, segment.shape[0]) else value[first:end]
    return Piece(np.asarray(rows.numpy()), start, segment.whole)
