"""Keep a model (a TF1 session, a TF2 model, a torch or Flax NNX module) at the newest version of a folder while it serves.

A background thread follows the folder and assigns each new version in place; the caller
wraps each inference in ``with follower.reading():`` (or calls ``follower.run(fn, ...)``) and
a swap waits for the calls in flight to finish and holds new ones back until it is done, so
no call ever sees half of one version and half of the next. Reloads skip tensors whose
content has not changed since the last assign into the same target (``skip_unchanged``).

**Serving never waits on the network.** A swap first *stages* the version with no lock held:
every tensor that changed since the last swap is fetched (an object store's ranges) and its
checksum verified, into memory (of a local file: copied from its mapping). Only then does
it take the lock, and inside it only writes variables from what was staged, so the longest
wait to enter ``reading()`` is the time to assign the model from memory, not to download
it. A sharded version followed into a target whose adapter reads only the regions of the
parts that changed (``ASSIGN_READS_REGIONS``: a TF1 partitioned variable's parts, a DTensor's
shard, a JAX array's shards) is staged region by region: a rehearsal of the assign
(:func:`~weightstore.adapters.skeleton.rehearsal`) reads nothing but says which regions and
tensors it will read, and only those are fetched (a version that does not fit the target
fails there too). A bad version (a checksum that does
not match, a file pruned mid-read) fails while staging, before serving is held at all.

**Delta versions** (:class:`weightstore.Delta`; a sharded version's delta members alike, for
the tensors written whole and the regions of parts) are staged by applying each delta onto a
copy of the bytes of the version the follower holds (of a region, the copies of the held regions
its writer's piece lies across), so only the deltas published since are fetched (and
opened: a local version is pinned down to the one held, not to its anchor), verified against
the digests their publisher recorded; when that would move more bytes than
reading the newest anchor and the deltas after it (what a fresh reader moves), or the held
version is not in the new one's chain (it missed an anchor), or the chain fails, the tensors are
read from the newest anchor and its chain. The rebuilt tensors are handed to the framework
(no copy while serving waits); after the swap the next base is copied into the buffer the
framework let go of. Once a delta version comes, the follower keeps that copy: **1x the model's
bytes more**, and no more during a swap.

**Memory: the model plus the version being staged** (of a sharded version, its changed
regions). A remote version is read straight into one buffer per tensor or region, and those
buffers become the variables' own (the framework adopts them instead of copying: nothing else
holds them); a local one is copied from its mapped file into such buffers while staging. After
each swap the old variables' memory goes back to the system, so the process does not keep a
freed version's pages around (see :mod:`weightstore.core._heap`).

::

    with Follower(model, "s3://bucket/run", poll=0.5, storage_options=...) as follower:
        follower.wait()                      # the first version is in
        while serving:
            with follower.reading():
                outputs = model(inputs)

The lock is not reentrant: do not nest ``reading()`` in one thread.

**Do not train the target in place.** Skipping unchanged tensors trusts that a variable still
holds what the follower last assigned. If something else writes the target's variables
(an initializer run, training, ``Saver.restore``, ``var.assign``), pass
``skip_unchanged=False``, or call ``tf1.forget(sess)`` / ``tf2.forget(model)`` after such a
write, or a later version whose bytes match the old ones is skipped and the variable keeps the
foreign value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
from typing_extensions import Unpack

import weightstore
from weightstore.adapters import layout as layouts
from weightstore.adapters._registry import adapter_for
from weightstore.adapters._reload import reload_digest, wants_skip
from weightstore.adapters.layout import Layout
from weightstore.adapters.plan import AssignOptions, AssignWords, Report
from weightstore.adapters.skeleton import copy_into, handed_over, rehearsal
from weightstore.core import _parallel as parallel
from weightstore.core._heap import give_back
from weightstore.core.manifest import TensorInfo, logical_dtype
from weightstore.errors import (
    FormatError,
    LayoutError,
    StorageError,
    UnsupportedTargetError,
    VersionGoneError,
    WeightStoreError,
    naming,
)
from weightstore.formats import ReaderDefaults
from weightstore.formats.sharded import normalized_region
from weightstore.io._buffer import aligned_array, memory_owner
from weightstore.store._open import Store
from weightstore.sync._checks import checked_count, checked_seconds
from weightstore.sync._defaults import DEFAULT_POLL
from weightstore.sync._folder import versions_folder
from weightstore.sync._follow import Outage, PointerWatch
from weightstore.sync._pinning import Version

__all__ = ["Follower"]

_log = logging.getLogger(__name__)
T = TypeVar("T")
_Bounds = tuple[tuple[int, int], ...]  # a region as (start, stop) along each axis
_Part = tuple[str, _Bounds]  # a region of a tensor, by key
_Item = str | _Part  # what a follower holds a copy of: a tensor, or a region of one


class _Outcome(enum.Enum):
    """What a swap left to do."""

    DONE = "done"  # assigned, or passed over as not fitting the target
    AGAIN_NOW = "again now"  # pruned mid-read: the newest version is another
    AGAIN_LATER = "again later"  # the storage failed: the same version, once it answers


@dataclass
class _Loop:
    """One run of a follower's loop: its thread, its own stop event (a loop that :meth:`Follower.stop`
    did not wait for never runs on beside a later one), where it is, for ``stop``, and its own
    :class:`Outage` (a restarted follower says an outage afresh)."""

    outage: Outage
    thread: threading.Thread = field(init=False)
    stop: threading.Event = field(default_factory=threading.Event)
    on_storage: bool = False  # waiting on a request: once it returns, the loop ends, assigning and recording nothing
    assigning: bool = False  # inside a swap's writes: waited for
    bug: tuple[type, str] | None = None  # the last look's failure that was no storage's or folder's, said once

    @contextlib.contextmanager
    def storage(self) -> Iterator[None]:
        self.on_storage = True
        try:
            yield
        finally:
            self.on_storage = False


_STOP_LOOK = 0.02  # how often stop() looks whether the loop ended or went to wait on the storage


class _ReadWriteLock:
    """Any number of inference calls at once, or one swap; a waiting swap stops new calls starting."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0
        self._here = threading.local()  # whether this thread is inside reading()

    def refuse_inside_reading(self, call: str) -> None:
        """Raise for ``call`` in a thread inside :meth:`reading`: a swap may be waiting for that very block to end."""
        if getattr(self._here, "reading", False):
            raise RuntimeError(f"{call} inside reading() would wait for a swap that waits for the block to end: "
                               f"call it outside the block")

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        self.refuse_inside_reading("reading()")
        with self._condition:
            while self._writing or self._writers_waiting:
                self._condition.wait()
            self._readers += 1
        self._here.reading = True
        try:
            yield
        finally:
            self._here.reading = False
            with self._condition:
                self._readers -= 1
                if not self._readers:
                    self._condition.notify_all()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        with self._condition:
            self._writers_waiting += 1
            while self._writing or self._readers:
                self._condition.wait()
            self._writers_waiting -= 1
            self._writing = True
        try:
            yield
        finally:
            with self._condition:
                self._writing = False
                self._condition.notify_all()


class Follower:
    """Follow ``folder`` in a background thread, assigning each new version into ``target``.

    ``target`` is anything whose adapter (:func:`~weightstore.adapters.adapter_for`) assigns
    into it in place: a ``tf.compat.v1.Session`` (``tf1.assign``), a Keras model, ``tf.Module``
    or TF variables (``tf2.assign``), a ``torch.nn.Module`` (``torch.assign``), a Flax NNX
    module (``flax.assign``); the assign options mean what they mean there. Anything else is
    refused here with :class:`~weightstore.errors.UnsupportedTargetError`: an object of no
    known framework, or a Flax parameter tree, a value that ``flax.restore`` makes anew rather
    than a model a version can be written into (follow it with ``ws.follow`` and ``restore``).
    ``version`` and ``report`` describe the last swap; ``error`` holds the last failure (a
    version that does not fit the target is logged, recorded and passed over, not retried; one
    whose download the storage failed is fetched again every ``poll`` until it is in) until the
    next swap succeeds, and makes :meth:`wait` raise. ``poll`` and ``max_poll`` pace
    the looks at ``LATEST`` as in :func:`~weightstore.sync.follow` (conditional on an object
    store's ETag, backing off from ``poll`` to ``max_poll`` while nothing is published), and
    ``notifications`` (an SQS queue URL) wakes it when ``LATEST`` is written.

    ``layout`` (torch and Flax targets): versions in another framework's names and layouts,
    converted as ``torch.assign(..., layout=)`` converts them (``"keras"``: a Keras trainer's
    versions served by a torch module).

    ``deltas``: of delta versions, apply each onto a copy of the version held, which costs 1x
    the model's memory (see the module). ``None`` (the default) keeps the copy once a delta
    version arrives (that first one is read from its anchor); ``True`` from the first version;
    ``False`` never (each delta version is read from its anchor and chain).

    Hot reload skips tensors whose bytes equal what this follower last assigned, so the target
    must not be changed in place by anything else (training, initializers, restores); if it
    is, pass ``skip_unchanged=False`` (see the module docstring).
    """

    def __init__(self, target: Any, folder: Any, *, poll: float = DEFAULT_POLL, after: int | None = None,
                 storage_options: Mapping[str, Any] | None = None, max_poll: float | None = None,
                 notifications: str | None = None, deltas: bool | None = None,
                 layout: str | Layout | None = None, **words: Unpack[AssignWords]):
        self.target = target
        self.folder = folder
        # checked here, as follow() checks them, not on the thread that start() begins, whose
        # error would only show at the first wait
        self.poll = checked_seconds("poll", poll)
        self.max_poll = None if max_poll is None else checked_seconds("max_poll", max_poll)
        self.notifications = notifications
        self.storage_options = storage_options
        self.options = AssignOptions.of("Follower", words, Follower)
        self.version: Version | None = None
        self.report: Report | None = None
        self.error: BaseException | None = None
        self._following_failed = False  # whether ``error`` came from reading the folder, not assigning
        self._failed_step: int | None = None  # the step that could not be read or assigned, passed over
        self._after = None if after is None else checked_count("after", after)
        self._lock = _ReadWriteLock()
        self._swapped = threading.Condition()
        self._loop_now: _Loop | None = None
        adapter = _adapter(target, self.options)
        self._assign: Callable[..., Report] = adapter.assign
        if layout is not None:
            if "layout" not in inspect.signature(adapter.assign).parameters:
                raise UnsupportedTargetError(f"layout= converts versions for torch and Flax targets; "
                                             f"{adapter.__name__}.assign takes versions in its own layout: have "
                                             "the trainer publish in it (a PyTorch or Flax trainer for a Keras "
                                             "follower: publish export(module, layout='keras'))")
            chosen: str | Layout = layout
            if adapter.__name__.startswith("weightstore.adapters."):  # a registered adapter's layouts are its own
                try:  # an unknown one fails here, not on every version
                    chosen = layouts.resolve(layout, adapter.__name__.rsplit(".", 1)[-1])
                except LayoutError as exc:
                    raise LayoutError(exc.message, path=str(self.folder)) from None
            self._assign = functools.partial(adapter.assign, layout=chosen)
        self._reads_parts: bool = getattr(adapter, "ASSIGN_READS_REGIONS", False)
        #: key (or region) -> content digest in the version of the last swap
        self._digests: dict[_Item, str | None] = {}
        #: key (or region the target writes) -> (digest, bytes) of the version held, kept once a
        #: delta version came: the next delta is applied onto them (:meth:`_onto_held`, :meth:`_parts_onto_held`)
        self._held: dict[_Item, tuple[str | None, np.ndarray]] = {}
        #: key (or region) -> the buffer handed to the framework at the last swap, the next base copy's once it lets go
        self._spares: dict[_Item, np.ndarray] = {}
        self._keeping = False  # whether swaps keep copies (see ``deltas``)
        self.deltas = deltas

    def start(self) -> Follower:
        """Start following (``with Follower(...)`` does); a folder that is a file is refused here."""
        if self._loop_now is None:
            watch = PointerWatch(versions_folder(self.folder, self.storage_options), self.poll, self.max_poll,
                                 self.notifications)
            loop = _Loop(Outage(str(self.folder), "weightstore follower:"))  # said when it starts and ends
            loop.thread = threading.Thread(target=self._loop, args=(watch, loop),
                                           name=f"weightstore-follower {self.folder}", daemon=True)
            self._loop_now = loop
            loop.thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop following; the current version stays readable until the follower is garbage.

        Returns once the loop has ended, or is waiting on the storage (a download an outage
        stalls may take minutes to fail): such a loop ends when the storage answers, assigning
        nothing more. A swap under way is waited for, never cut off (up to ``timeout``)."""
        self._lock.refuse_inside_reading("stop()")
        loop, self._loop_now = self._loop_now, None
        if loop is None:
            return
        with self._swapped:
            loop.stop.set()  # under the lock a swap checks it with: none starts after this
        deadline = None if timeout is None else time.monotonic() + timeout
        while loop.thread.is_alive() and not (loop.on_storage and not loop.assigning):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            loop.thread.join(_STOP_LOOK if left is None else min(_STOP_LOOK, left))

    def __enter__(self) -> Follower:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reading(self) -> contextlib.AbstractContextManager:
        """Hold around one inference call: no swap happens while any such block runs.

        Not reentrant: a waiting swap holds back new blocks (so serving cannot starve it), so a
        block opened inside another in the same thread would wait for a swap that waits for it;
        that, and :meth:`wait` or :meth:`stop` inside a block, raise ``RuntimeError`` instead.
        In asyncio, coroutines share a thread: do not ``await`` inside a block."""
        return self._lock.reading()

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` between swaps."""
        with self._lock.reading():
            return fn(*args, **kwargs)

    def wait(self, step: int | None = None, timeout: float | None = None) -> Version | None:
        """Block until a version (with at least ``step``) is assigned; the version, or None on timeout.

        Raises the follower's :attr:`error` at once if there is one (already, or while waiting)
        and the wanted version is not in: a first version that does not fit the target, or a
        damaged folder, ends the wait instead of blocking it forever; a version that did not fit
        but is below ``step`` does not end a wait for ``step`` (publish a version that fits, then
        wait for its step). A storage outage (a :class:`StorageError` that is ``transient``) is
        waited out instead, as :func:`weightstore.follow` waits it out, and raised only when
        ``timeout`` passes while the storage still fails: a serving process started during an
        outage gets its version once the storage answers. A storage failure that stays (refused
        credentials, a host name that names no host) is raised at once while no version is in,
        and waited out like an outage once one is (see :func:`weightstore.follow`). The follower
        keeps following; an assign failure clears when a later version is assigned, a failure to
        read the folder as soon as the folder reads cleanly again.
        """
        def arrived() -> bool:
            return self.version is not None and (step is None or self.version.step >= step)

        def failed() -> bool:  # a version below ``step`` that did not fit says nothing of ``step`` itself
            return self.error is not None and not (step is not None and self._failed_step is not None
                                                   and self._failed_step < step)

        def ended() -> bool:  # an outage passes: only a failure that stays ends the wait early
            return arrived() or (failed() and not (isinstance(self.error, StorageError)
                                                   and (self.error.transient or self.version is not None)))

        self._lock.refuse_inside_reading("wait()")
        if self._loop_now is None and not arrived():  # nothing would ever arrive
            raise RuntimeError("this Follower is not following: start it (with Follower(...) as f, or f.start()) "
                               "before waiting")
        with self._swapped:
            self._swapped.wait_for(ended, timeout)
            if arrived():
                return self.version
            if failed():
                raise self.error  # type: ignore[misc]  # failed() saw it set
            return None

    def _loop(self, watch: PointerWatch, loop: _Loop) -> None:
        last, followed = self._after, False
        while not loop.stop.is_set():
            try:
                with loop.storage():
                    version = watch.newer(last, followed=followed, holding=self._holding())
            except FormatError as exc:
                if watch.unreadable is None:  # LATEST itself: the folder is damaged until it reads cleanly
                    self._failed(loop, exc, "following")
                else:  # a damaged version: passed over once as follow passes it, not opened at every look
                    last = watch.unreadable
                    self._failed(loop, exc, f"reading step {last}", step=last)
                version = None
            except Exception as exc:  # a damaged folder: keep serving the current weights, look again
                self._failed(loop, exc, "following")
                version = None
            else:
                self._folder_healthy(loop)
                if version is None:
                    loop.outage.over()
            if version is not None and loop.stop.is_set():  # stopped during the look: fetch nothing more
                version.release()
                break
            if version is not None:
                try:
                    outcome = self._swap(version, loop)
                finally:
                    version.release()
                if outcome is _Outcome.DONE:
                    loop.outage.over()
                    last, followed = version.step, True
                    continue  # look again at once: a newer version may have landed meanwhile
                watch.forget()  # read LATEST again, whatever its tag: this version, or a newer one
                if outcome is _Outcome.AGAIN_NOW:
                    continue
            watch.sleep(watch.interval, loop.stop)

    def _swap(self, version: Version, loop: _Loop) -> _Outcome:
        """Stage ``version``, then assign it; whether that is done (or the version passed over as
        not fitting), or ``LATEST`` is to be read again: at once when the version was pruned
        mid-read, after a pause when the storage failed (an outage retried as ``follow``
        retries one, never a reason to stay at the old weights).

        Staging (:meth:`_stage`) runs with no lock held; the lock covers only the writes into
        the target and the bookkeeping readers see. The follower keeps its own share of the
        pin ``follow`` took on the version's file, so ``ws.load(follower.version)`` keeps
        working while that version is current; the previous version's share is let go once
        the swap is done (reading it afterwards opens its file anew, or raises
        :class:`VersionGoneError` if it was pruned).
        """
        held = version.held()
        skip = wants_skip(held, self.options.skip_unchanged)
        words = dataclasses.replace(self.options, skip_unchanged=skip).assign_words()
        try:
            with loop.storage():
                staged = self._stage(held, skip, words)
            with self._swapped:
                if loop.stop.is_set():  # stopped while it downloaded: a loop started since may be assigning
                    staged.close()
                    held.release()
                    return _Outcome.AGAIN_NOW
                loop.assigning = True
            # the staged arrays are the follower's alone: the variables may keep them as they are
            try:
                with staged, handed_over(staged.arrays), self._lock.writing():
                    report = self._assign(self.target, staged, **words)
                    # still inside the swap: a reader never sees new weights under the old version
                    previous, self.version, self.report, self.error = self.version, held, report, None
            finally:
                loop.assigning = False
        except VersionGoneError:
            held.release()
            return _Outcome.AGAIN_NOW
        except StorageError as exc:
            held.release()
            self._failed(loop, exc, "following")  # cleared, like a failed look at LATEST, once the storage answers
            return _Outcome.AGAIN_LATER
        except Exception as exc:
            held.release()
            self._failed(loop, exc, f"assigning step {version.step}", step=version.step)
            return _Outcome.DONE
        self._digests, copies = staged.digests, staged.copies
        del staged  # its arrays: the framework's now, or ours again (see _keep)
        # the swap is done and serving runs again: what follows a swap goes here
        if previous is not None:
            previous.release()
        give_back()  # the old variables' buffers, freed as the new ones replaced them
        with self._swapped:
            self._swapped.notify_all()
        if copies is not None:
            try:
                self._keep(copies, self._digests)
            except MemoryError as exc:  # the tensors it kept no copy of are read from the anchor next time
                _log.warning("weightstore follower of %s: keeping a copy of step %d failed (%s)", self.folder,
                             version.step, exc)
        return _Outcome.DONE

    def _stage(self, version: Version, skip: bool, words: AssignWords) -> _StagedStore:
        """``version`` opened with every tensor that changed since the last swap read and verified.

        With ``skip``, a tensor whose content digest equals the one the last swap staged is
        left unread: the assign skips it, as the target already holds those bytes (should the
        target have forgotten them, the assign reads it from the pinned file instead). A
        sharded version followed into a target that writes parts of tensors (a TF1 session's
        partitioned variables, a torch module's DTensors) stages what a rehearsal of the assign
        (:func:`~weightstore.adapters.skeleton.rehearsal`, no byte read) asks for: the regions
        of the parts whose blocks changed, and the tensors it writes whole. Of a delta version,
        tensors and regions are rebuilt onto the copies held where they can be
        (:meth:`_onto_held`, :meth:`_parts_onto_held`), the rest read.
        """
        store = weightstore.open(version)
        try:
            tensors = {key: reload_digest(store.info(key)) for key in store}
            digests: dict[_Item, str | None] = dict(tensors.items())
            parts: dict[_Part, np.ndarray] | None = None
            onto: dict[_Part, np.ndarray] = {}
            if self._reads_parts and store.reads_regions:
                # a held region its tensor's shape no longer holds is a copy of no part of it
                self._held = {item: found for item, found in self._held.items() if not isinstance(item, tuple)
                              or item[0] not in tensors or _inside(item[1], store.info(item[0]).shape)}
                recorder = _Rehearsal(store)
                with rehearsal():
                    self._assign(self.target, Store(recorder, store.path, verify=False), **words)
                onto = self._parts_onto_held(store, list(recorder.regions), version) if skip else {}
                parts = dict(onto)  # handed to the framework as they are, as rebuilt tensors
                parts.update((part, store.read_region(part[0], region)) for part, region in recorder.regions.items()
                             if part not in parts)
                changed = list(recorder.wanted)  # the tensors it writes whole (a sharded delta's, onto the held copy)
            else:
                changed = [key for key, digest in tensors.items()
                           if not skip or digest is None or self._digests.get(key) != digest]
            rebuilt = self._onto_held(store, changed, version) if skip else {}
            arrays = dict(rebuilt)  # handed to the framework as they are: no copy while serving waits
            arrays.update((key, _adoptable(array))
                          for key, array in store.read([key for key in changed if key not in arrays]).items())
            keeping = self.deltas or (self.deltas is None and (self._keeping or _is_delta(store)))
            if keeping and parts is not None:  # each region's digest here, staged or held: what a held copy must match
                held = [item for item in self._held if isinstance(item, tuple) and item[0] in tensors]
                digests.update((part, store.region_digest(part[0], tuple(slice(lo, hi) for lo, hi in part[1])))
                               for part in dict.fromkeys([*parts, *held]))
            staged = _StagedStore(store, arrays, digests, parts)
            if keeping:
                self._keeping = True
                made: dict[_Item, np.ndarray] = dict([*rebuilt.items(), *onto.items()])
                staging: list[tuple[_Item, np.ndarray]] = [*arrays.items(), *(parts or {}).items()]
                staged.copies = {item: (digests[item], made[item].reshape(-1).view(np.uint8) if item in made else
                                        _aligned_copy(array)) for item, array in staging}
            return staged
        except BaseException:
            store.close()
            raise

    def _holding(self) -> Version | None:
        """The version whose copies this follower holds (the next delta version is pinned down
        to it, and rests on its pin: :meth:`weightstore.sync.Version.pin`); ``None`` while it
        keeps none."""
        if self.version is None or not self._held or self.deltas is False:
            return None
        return self.version

    def _held_version(self, store: Store) -> str | None:
        """The file name of the version held, where ``store`` may be rebuilt onto its held
        copies (a delta version, a copy kept, deltas not turned off); else ``None``."""
        if self.version is None or not self._held or self.deltas is False or not _is_delta(store):
            return None
        return self.version.path.rsplit("/", 1)[-1]

    def _onto_held(self, store: Store, changed: list[str], version: Version) -> dict[str, np.ndarray]:
        """The tensors of ``changed`` rebuilt onto the copies of the version held, reading only the
        deltas published since (when ``version`` is a delta whose chain passes through it, and
        that moves fewer bytes than reading them from the newest anchor and the deltas after
        it); ``{}`` otherwise. A chain that fails (corrupt, missing, not
        the recorded digest) is logged, and all of ``changed`` is read from the anchor.

        Each copy is rebuilt in place, the tensors on all cores at once, and the result (a view
        of it) is handed to the framework: no copy is made before the swap. Those copies are no
        longer held until the swap is done (:meth:`_keep`): a failure on the way leaves them
        unused, never misread."""
        held = self._held_version(store)
        if held is None:
            return {}
        keys = [key for key in changed if key in self._held and self._held[key][0] is not None
                and self._held[key][0] == self._digests.get(key)]
        chain = store.chain_payload(keys, held)
        fresh = store.chain_payload(keys, None)  # from the newest anchor, as a reader holding nothing
        if chain is None or fresh is None or chain >= fresh:
            return {}
        buffers = [self._held.pop(key)[1] for key in keys]  # rebuilt in place: no longer the held version's bytes
        found: list[np.ndarray | None] = [None] * len(keys)

        def rebuild(index: int) -> None:
            found[index] = store.read_from(keys[index], held, buffers[index], in_place=True)

        if not self._rebuilt_all(len(keys), rebuild, version):
            return {}
        return {key: array for key, array in zip(keys, found, strict=True) if array is not None}

    def _parts_onto_held(self, store: Store, wanted: list[_Part], version: Version) -> dict[_Part, np.ndarray]:
        """The regions ``wanted`` (of a target that writes parts of tensors) rebuilt onto the
        copies of the regions held, reading only the deltas published since, as
        :meth:`_onto_held` for tensors (:meth:`weightstore.Store.read_regions_from`): each stored
        run of a wanted region is assembled from the held regions it lies across (the writers'
        pieces need not be the target's parts), its rank's deltas since the version held are
        applied and the digest its rank recorded is checked. A region with a run the held copies
        do not cover, or whose member is full, is left out (read from the anchor); a chain that
        fails is logged, and all are read from the anchor. The held copies stay as they were.

        The held version is in this one's chain, so no anchor lies between them: its deltas
        since move fewer bytes than that anchor and its deltas would."""
        held = self._held_version(store)
        if held is None:
            return {}
        have: dict[str, list[tuple[_Bounds, np.ndarray]]] = {}
        for item, (digest, buffer) in self._held.items():
            if isinstance(item, tuple) and digest is not None and digest == self._digests.get(item):
                have.setdefault(item[0], []).append((item[1], buffer))
        regions: dict[str, list[_Bounds]] = {}
        for key, bounds in wanted:
            if key in have:
                regions.setdefault(key, []).append(bounds)
        keys = list(regions)
        found: list[list[np.ndarray | None]] = [[] for _ in keys]

        def rebuild(index: int) -> None:
            key = keys[index]
            found[index] = store.read_regions_from(key, held, list(have[key]), list(regions[key]))

        if not self._rebuilt_all(len(keys), rebuild, version):
            return {}
        return {(key, bounds): array for key, arrays in zip(keys, found, strict=True)
                for bounds, array in zip(regions[key], arrays, strict=True) if array is not None}

    def _rebuilt_all(self, count: int, rebuild: Callable[[int], None], version: Version) -> bool:
        """Run ``rebuild`` on each of ``count`` tensors, on all cores at once; ``False`` (logged)
        when one failed, so that all are read from the anchor instead (the rest are not begun).
        Any error counts, not only a ``WeightStoreError``: the anchor's bytes are right
        whatever went wrong here, and one that escaped would fail every later delta version."""
        failures: list[Exception] = []

        def one(index: int) -> None:
            if not failures:
                try:
                    rebuild(index)
                except Exception as exc:  # any: see the docstring
                    failures.append(exc)

        parallel.for_each(count, one)
        if failures:
            assert self.version is not None
            _log.warning("weightstore follower of %s: applying step %d onto step %d failed (%s); reading the rest "
                         "from its anchor", self.folder, version.step, self.version.step, failures[0])
        return not failures

    def _keep(self, copies: dict[_Item, tuple[str | None, np.ndarray]], digests: dict[_Item, str | None]) -> None:
        """Keep ``copies`` (a swap's staged bytes, by key) as the next delta's base.

        A copy the framework adopted as a variable's buffer (a rebuilt tensor, handed over) is
        the framework's now: the base becomes a copy of it, made into the buffer the framework
        held before this swap when it has let go of that (double buffering: the two swap roles
        each version, so no fresh memory faults in), else into fresh memory. A copy the framework
        did not adopt stays the base itself. Memory: the held bytes (1x the model) beside the
        framework's own, never more than one buffer of each per tensor."""
        spares = self._spares
        self._spares = {key: spare for key, spare in spares.items() if key in digests and key not in copies}
        kept = {item: found for item, found in self._held.items()  # those still this version's bytes
                if found[0] is not None and found[0] == digests.get(item)}
        for key, (digest, buffer) in copies.items():
            spare = spares.pop(key, None)
            if not _shared(buffer):
                kept[key] = (digest, buffer)
                continue
            if spare is None or len(spare) != len(buffer) or _shared(spare):
                spare = aligned_array(len(buffer))
            copy_into(spare, buffer)
            kept[key] = (digest, spare)
            self._spares[key] = buffer
        self._held = kept

    def _failed(self, loop: _Loop, exc: BaseException, doing: str, *, step: int | None = None) -> None:
        """Record a failure, unless ``loop`` was stopped meanwhile (its news is no longer the follower's)."""
        with self._swapped:
            if loop.stop.is_set():
                return
            if doing == "following" and isinstance(exc, (WeightStoreError, OSError)):  # an outage, or a LATEST
                loop.outage.failed(exc)  # that stays unreadable (a loop, damage): said once per cause, and at its end
            elif doing == "following":  # a bug, not the folder: said with its traceback, once per cause
                if loop.bug != (type(exc), str(exc)):
                    loop.bug = (type(exc), str(exc))
                    _log.warning("weightstore follower of %s: following failed: %s", self.folder, exc, exc_info=exc)
            else:
                _log.warning("weightstore follower of %s: %s failed: %s", self.folder, doing, exc)
            self.error, self._failed_step = exc, step
            self._following_failed = doing == "following"
            self._swapped.notify_all()

    def _folder_healthy(self, loop: _Loop) -> None:
        """A look at the folder went through: a failure to read it earlier is over."""
        if self._following_failed:
            with self._swapped:
                if not loop.stop.is_set():
                    self.error, self._following_failed = None, False


def _is_delta(store: Store) -> bool:
    """Whether ``store`` is a delta version (a plain one, or a sharded one with delta members):
    one that tells what rebuilding from its anchor fetches."""
    return store.chain_payload([], None) is not None


def _inside(bounds: _Bounds, shape: tuple[int, ...]) -> bool:
    """Whether the region ``bounds`` lies within a tensor of ``shape``."""
    return len(bounds) == len(shape) and all(0 <= lo <= hi <= size for (lo, hi), size in zip(bounds, shape, strict=True))


def _aligned_copy(array: np.ndarray) -> np.ndarray:
    """``array``'s bytes (uint8, flat) in an :func:`_own_copy`: a base copy that a later delta is
    rebuilt onto and handed to the framework, which adopts only aligned memory."""
    return _own_copy(array).reshape(-1).view(np.uint8)


def _shared(buffer: np.ndarray) -> bool:
    """Whether anything but ``buffer`` (a view of an :func:`aligned_array` allocation) keeps its
    memory alive: a variable that adopted it, a tensor a caller still holds. Whatever uses the
    memory holds a reference to its owner (or a view of it), or would use freed memory once we
    let go; so with no other reference, writing into it changes nobody's data."""
    owner = buffer.base
    # the references: ``buffer``'s base, ``owner`` here, and getrefcount's argument
    return not (isinstance(owner, np.ndarray) and owner.base is None and sys.getrefcount(owner) <= 3)


def _adoptable(array: np.ndarray) -> np.ndarray:
    """A staged tensor the framework can adopt: a remote read's own buffer as it is; a view of
    a local file's map copied now (:func:`_own_copy`), while serving runs, not in the swap: an
    assign copies it into fresh memory anyway, and that copy's page faults under the lock made
    a local swap 1.6x an assign from memory at 32 MB. A small one the assign copies cheaply."""
    return array if array.nbytes < _OWN_FROM or isinstance(memory_owner(array), np.ndarray) else _own_copy(array)


def _own_copy(array: np.ndarray) -> np.ndarray:
    """``array`` copied into 64-byte-aligned memory of its own, which an assign hands to the
    framework as the variable's buffer instead of copying it while serving waits."""
    out = aligned_array(array.nbytes).view(array.dtype).reshape(array.shape)
    copy_into(out, array)  # on several threads: the fresh pages' faults are most of its cost
    return out


#: smaller tensors are left as views: an assign copies them without aligning them (skeleton's ``_ALIGNED_FROM``)
_OWN_FROM = 1 << 16


class _Staged(ReaderDefaults):
    """A version's reader with some tensors already read and verified: a swap writes from memory.

    Tensors not staged (the unchanged ones a swap expects to skip) are read from the version's
    own store if the assign asks for them after all (:meth:`read_many` fetches them together,
    so :meth:`prefetch` has nothing to do).
    """

    def __init__(self, store: Store, arrays: dict[str, np.ndarray]):
        self._store = store
        self._arrays = arrays
        self.name = store.path

    @property
    def metadata(self) -> dict[str, Any]:
        return self._store.metadata

    @property
    def created(self) -> str:
        return self._store.created

    @property
    def has_checksums(self) -> bool:
        return self._store.has_checksums

    def keys(self) -> list[str]:
        return self._store.keys()

    def info(self, key: str) -> TensorInfo:
        return self._store.info(key)

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        staged = self._arrays.get(key)
        return self._store[key] if staged is None else staged

    def read_many(self, keys: list[str], *, verify: bool) -> list[np.ndarray]:
        unstaged = [key for key in keys if key not in self._arrays]
        fetched = self._store.read(unstaged) if unstaged else {}
        return [fetched[key] if key in fetched else self._arrays[key] for key in keys]

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        staged = self._arrays.get(key)
        if staged is None:
            self._store.read_into(key, out)
        else:
            np.copyto(out, staged)
        return True

    def close(self) -> None:
        self._arrays = {}
        self._store.close()


class _StagedRegions(_Staged):
    """A staged sharded version: also the regions staged of its tensors (by key and bounds);
    a region not staged is read (only its blocks) from the version's own store."""

    def __init__(self, store: Store, arrays: dict[str, np.ndarray], parts: dict[_Part, np.ndarray]):
        super().__init__(store, arrays)
        self._parts = parts

    def read_region(self, key: str, region: Any, *, verify: bool) -> np.ndarray:
        staged = self._parts.get((key, self._bounds(key, region)))
        return self._store.read_region(key, region) if staged is None else staged

    def region_digest(self, key: str, region: Any) -> str | None:
        return self._store.region_digest(key, region)

    def _bounds(self, key: str, region: Any) -> _Bounds:
        with naming(path=self.name):
            return tuple(normalized_region(region, self._store.info(key).shape, key))

    def close(self) -> None:
        self._parts = {}
        super().close()


class _Rehearsal(_StagedRegions):
    """What a rehearsed assign (:func:`~weightstore.adapters.skeleton.rehearsal`) reads from:
    it records the tensors and regions asked for and answers with read-only placeholders of
    their shape that hold no memory, so working out what to stage reads no byte of the version."""

    def __init__(self, store: Store):
        super().__init__(store, {}, {})
        self.wanted: dict[str, None] = {}  # tensors read whole, in the order asked
        self.regions: dict[_Part, Any] = {}  # (key, bounds) -> the region as asked

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        self.wanted[key] = None
        return self._placeholder(key)

    def read_many(self, keys: list[str], *, verify: bool) -> list[np.ndarray]:
        return [self.read(key, verify=verify) for key in keys]

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        self.wanted[key] = None
        return True

    def read_region(self, key: str, region: Any, *, verify: bool) -> np.ndarray:
        self.regions.setdefault((key, self._bounds(key, region)), region)
        return self._placeholder(key)[region]

    def _placeholder(self, key: str) -> np.ndarray:
        info = self._store.info(key)
        with naming(path=self.name, key=key):
            return np.broadcast_to(np.zeros((), logical_dtype(info.dtype)), tuple(info.shape))

    def close(self) -> None:
        """The version's store is the stage's, which goes on to read what was recorded."""


class _StagedStore(Store):
    """What a swap assigns from: a :class:`Store` over :class:`_Staged`, with the content digests
    of the version's tensors (the follower's memory of what the target holds once it is in)."""

    def __init__(self, store: Store, arrays: dict[str, np.ndarray], digests: dict[_Item, str | None],
                 parts: dict[_Part, np.ndarray] | None = None):
        staged = _StagedRegions(store, arrays, parts or {}) if store.reads_regions else _Staged(store, arrays)
        super().__init__(staged, store.path, verify=False)  # staging verified what it read
        self.arrays = [*arrays.values(), *(parts or {}).values()]
        self.digests = digests
        #: copies of the staged tensors' (and regions') bytes, kept as the next delta's base once the swap is done
        self.copies: dict[_Item, tuple[str | None, np.ndarray]] | None = None

    def close(self) -> None:
        self.arrays = []
        super().close()


def _adapter(target: Any, options: AssignOptions) -> ModuleType:
    """The adapter of ``target``, once its ``variables`` (with the follower's selection) found
    what ``assign`` writes into: on a target it cannot write (a pytree's leaves are values), or
    with words that keep nothing, every version would fail."""
    adapter = adapter_for(target)
    try:
        adapter.variables(target, **options.words())
    except TypeError as exc:
        raise UnsupportedTargetError(f"a Follower assigns each version into its target in place, which "
                                     f"{adapter.__name__}.assign cannot do for a {type(target).__name__}: {exc}"
                                     ) from None
    return adapter
