"""Delta publishing: a version written as what changed since the one before it, when that is smaller.

:func:`weightstore.publish` with ``delta=`` asks a :class:`Delta` for a plan before it writes: the
base is the version ``LATEST`` names; each tensor is encoded against the base's
(:func:`weightstore.formats.delta.encode`), and the version is written as a delta
(``step-….wsdelta``, :mod:`weightstore.formats.delta`) unless a full one is due:

- nothing was published yet, or ``LATEST`` names a sharded version or cannot be read;
- the base is ``anchor_every - 1`` deltas from its anchor already (so any version is one
  anchor and at most ``anchor_every - 1`` deltas away);
- the deltas since the anchor, this one included, add up to a full version's bytes (a chain
  longer than that costs a fresh reader more than an anchor would), or would with one more
  delta the size of the last (a publisher that remembers its base then writes the anchor
  without encoding or estimating anything);
- or the delta is no smaller than the full version.

**Memory.** A :class:`Delta` keeps a copy of the last version it published (``remember=True``,
the default): 1x the model's bytes, copied into the same memory each publish (none is copied
after a delta that an anchor follows: the anchor reads no base). A delta's XOR-ed payload is
made in that copy's memory as each block of it is read (:meth:`Delta._claim`): no fresh pages
per delta; a publish that fails once its delta was made there (XOR-ed: a dense step's) is
followed by a full version, one whose delta was not (a sparse step's) by a delta.
Without that copy (a restarted trainer, or ``delta=True`` given to single ``publish`` calls) the
base is read back from the folder, anchor and chain, verified.

**A base changed on disk.** Each file of the remembered version's chain (its anchor and the
deltas since) is looked at before the next delta is encoded from memory: where one is no longer
the file this publisher wrote (locally: its inode, size, modification or change time differ;
removed, replaced, or written over), the base is read back from the folder, verified, instead.
A chain that fails (a damaged anchor, which every follower would refuse) is logged naming the
file, and that step is written full: the next deltas build on it. A look costs one ``lstat`` a
file; bytes that rot under the file system are seen only by a read (``ws verify FOLDER``).
On an object store, where a look at each file would be a request, the look is the listing of
the folder every publish makes anyway (:meth:`~weightstore.io.folders.RemoteFolder.fingerprint`),
compared with the listing after each file was published once the commit has listed the folder:
a file changed since costs that step a full version, logged naming the file.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from weightstore.core.limits import MAX_DELTA_CHAIN
from weightstore.core.manifest import content_digest, crc32, from_storage, storage_dtype
from weightstore.errors import WeightStoreError
from weightstore.formats import delta as delta_format
from weightstore.formats._pointer import VERSION_NAME
from weightstore.io.folders import UNSEEN, Folder, unchanged
from weightstore.store._save import CheckedWeights
from weightstore.sync._folder import SHARDED_SUFFIX
from weightstore.sync._pinning import Version, read_latest

_log = logging.getLogger("weightstore")

#: a full version at least every this many versions: a fresh reader reads one anchor and at most
#: nine deltas, and retention keeps at most one chain more than ``keep`` asks
DEFAULT_ANCHOR_EVERY = 10

#: a tensor whose last delta XOR took at least this share of its bytes is XOR-ed straight away
#: the next step: it changed densely (fp32 Adam kernels: 0.55; bf16 steps are sparse, 0.01-0.03)
DENSE_SHARE = 0.25


@dataclass
class Stored:
    """One tensor as a publisher holds it: logical dtype, shape, and its bytes (uint8, owned)."""

    dtype: str
    shape: tuple[int, ...]
    data: np.ndarray

    def array(self) -> np.ndarray:
        """The tensor in its logical dtype (a view of :attr:`data`)."""
        return from_storage(self.data.view(storage_dtype(self.dtype)).reshape(self.shape), self.dtype)


@dataclass
class _Held:
    """The version a :class:`Delta` published last: where, which, and its tensors."""

    where: str
    step: int
    name: str
    created: str
    tensors: dict[str, Stored]
    #: its head, when it is a delta (so the next plan need not read it back)
    head: delta_format.Head | None = None
    #: a sharded version's member: what its member metadata says of its pieces
    layout: Any = None
    #: whether :attr:`tensors` hold this version's bytes; ``False`` after a delta whose successor
    #: is an anchor (:meth:`Delta._anchor_due`): they are the version before's, kept only as the
    #: memory the anchor's copy goes into
    current: bool = True
    #: each file of its chain (itself down to its anchor) as it was when published
    #: (:meth:`~weightstore.io.folders.Folder.fingerprint`): a file changed since is read back
    files: dict[str, object] = field(default_factory=dict)


@dataclass
class Plan:
    """What a delta publish writes: the head and each tensor's encoding, digest and checksum."""

    head: delta_format.Head
    encoded: list[delta_format.Encoded]
    rows: list[tuple[str, str, tuple[int, ...], int]]
    digests: list[bytes]
    #: each file of its base's chain as published, or as the plan read it back; the commit
    #: compares the folder's listing with it (:func:`~weightstore.sync._publish.commit_version`)
    files: dict[str, object] = field(default_factory=dict)
    #: the remembered version's tensors whose memory the payload was made in (:meth:`Delta._claim`):
    #: the :class:`Delta`'s again once this plan is written
    spent: dict[str, Stored] | None = None

    @property
    def payload_bytes(self) -> int:
        return sum(item.nbytes for item in self.encoded)


class Delta:
    """How a publisher writes delta versions, and its memory of the last version it published.

    Give one object to every publish of one trainer (``ws.publish(..., delta=d)``); ``delta=True``
    makes a fresh one per call (which then reads its base back from the folder), and
    :class:`~weightstore.BackgroundPublisher` makes one for its whole life.

    Args:
        anchor_every: a full version at least every this many versions (1: always full; at
            most 1,001, as a reader follows at most 1,000 deltas to their anchor); one is written
            sooner once the deltas since the last add up to a full version.
        remember: keep a copy of the last published version's tensors (1x the model's memory),
            so the next delta needs no read of the folder.

    Example:
        >>> d = ws.Delta(anchor_every=20)
        >>> for step in range(1, 101):
        ...     ws.publish("runs/a", weights(), step=step, delta=d)
    """

    def __init__(self, *, anchor_every: int = DEFAULT_ANCHOR_EVERY, remember: bool = True):
        if isinstance(anchor_every, bool) or not isinstance(anchor_every, int) or not (
                1 <= anchor_every <= MAX_DELTA_CHAIN + 1):
            raise ValueError(f"anchor_every must be an int from 1 to {MAX_DELTA_CHAIN + 1}, not {anchor_every!r}")
        self.anchor_every = anchor_every
        self.remember = remember
        self._held: _Held | None = None
        #: taken to hand the remembered tensors' memory from one owner to the next (a plan that
        #: spends it, a copy into it): two publishes given this object may overlap
        self._memory_lock = threading.Lock()
        #: payload bytes of the last delta this object published, as a share of its version's
        #: (``None``: none yet); kept across anchors, as it predicts the next delta's
        self._last_share: float | None = None
        #: how the last delta stored each tensor: its codec and payload as a share of its bytes
        #: (kept across anchors: a tensor changes alike step after step)
        self._last_codecs: dict[str, tuple[str, float]] = {}
        self.last_kind: str | None = None
        """``"delta"`` or ``"full"``: how the last version this object planned was written."""

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a ``Delta`` handed to a spawned process) or deep-copied without its lock,
        which neither can copy: the copy's memory is its own, and so is its new lock."""
        state = self.__dict__.copy()
        del state["_memory_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._memory_lock = threading.Lock()

    def stored(self, arrays: CheckedWeights) -> dict[str, Stored]:
        """Every tensor's bytes, converted once (views of the caller's arrays where they are
        already in storage form: :meth:`published` copies what it remembers)."""
        tensors = {}
        for key, name, data in arrays.stored():
            flat = data.reshape(-1).view(np.uint8) if data.size else np.empty(0, np.uint8)
            tensors[key] = Stored(name, tuple(data.shape), flat)
        return tensors

    def plan(self, target: Folder, step: int, tensors: dict[str, Stored]) -> Plan | None:
        """A delta against the version ``LATEST`` names, or ``None`` when a full version is due
        (see the module); a base that cannot be read back is logged and costs a full version."""
        pointer = self._base_pointer(target, step)
        if pointer is None:
            return None
        base = pointer.file_name
        if base.endswith(SHARDED_SUFFIX) or not VERSION_NAME.match(base):
            return None
        held = self._held
        try:
            if not base.endswith(delta_format.SUFFIX):
                head = None
            elif held is not None and held.head is not None and self._holds(held, target, pointer, base):
                head = held.head
            else:
                head = delta_format.read_head(target.open_binary(base), target.url(base))
            if head is not None:
                depth, chain_bytes, chain = head.depth, head.chain_bytes, [base, *head.chain]
            else:
                depth, chain_bytes, chain = 0, 0, [base]
            if depth + 1 >= self.anchor_every or len(chain) > MAX_DELTA_CHAIN:
                return None
            files = {name: target.fingerprint(name) for name in chain}
            plan = self._encode(target, pointer, base, chain, chain_bytes, step, tensors, files)
            if plan is not None and not plan.files:
                plan.files = files
            return plan
        except (WeightStoreError, FileNotFoundError) as exc:
            _log.warning("weightstore: publishing step %d to %s: base %s cannot be read back (%s); writing a full "
                         "version", step, target.where, base, exc)
            return None

    def _base_pointer(self, target: Folder, step: int) -> Version | None:
        """The version ``LATEST`` names where a delta of ``step`` may be based on it (readable,
        older than ``step``, and deltas not turned off by ``anchor_every=1``), else ``None``."""
        try:
            pointer = read_latest(target)
        except WeightStoreError:
            return None
        if pointer is None or pointer.step >= step or self.anchor_every <= 1:
            return None
        return pointer

    def _encode(self, target: Folder, pointer: Version, base: str, chain: list[str], chain_bytes: int, step: int,
                tensors: dict[str, Stored], files: dict[str, object]) -> Plan | None:
        """The plan against the remembered version where it is the base and every file of its
        chain is as published (``files``: as they are now), else against the base read back."""
        held = self._held
        if held is not None and self._holds(held, target, pointer, base) and unchanged(held.files, files):
            plan = self._from_memory(held, step, base, chain, chain_bytes, tensors)
            if plan is not None:  # as published: what an object store's listing is compared with at the commit
                plan.files = dict(held.files)
            return plan
        with pointer._weightstore_open(verify=True) as store:  # read back: anchor and chain, verified
            def read_back(key: str, item: Stored) -> np.ndarray | None:
                if key not in store:
                    return None
                info = store.info(key)
                if info.dtype != item.dtype or tuple(info.shape) != item.shape:
                    return None
                array = np.ascontiguousarray(store[key])
                return array.reshape(-1).view(np.uint8) if array.size else np.empty(0, np.uint8)

            return plan_against(step, base, chain, chain_bytes, tensors, read_back)

    def _from_memory(self, held: _Held, step: int, base: str, chain: list[str], chain_bytes: int,
                     tensors: dict[str, Stored]) -> Plan | None:
        """The plan against ``held``, the remembered version (:func:`_plan`); ``None`` where an
        anchor is due, or ``held`` kept no bytes of its version (as it expected one)."""
        full_bytes = sum(len(item.data) for item in tensors.values())

        if self._anchor_due(chain_bytes, full_bytes):
            return None
        claimed = self._claim(held)
        if claimed is None:
            return None
        spent = held.tensors

        def remembered(key: str, item: Stored) -> np.ndarray | None:
            return _same_kind(spent.get(key), item)

        # estimated first only while no delta's size is known: a delta larger than the last
        # is then found by encoding, which stops once the chain passes a full version
        plan = _plan(step, base, chain, chain_bytes, full_bytes, tensors, remembered, self._last_share is None,
                     self._last_codecs, spend=True)
        if plan is not None and any(one.spent for one in plan.encoded):
            plan.spent = spent
            return plan
        with self._memory_lock:
            if self._held is claimed:
                if plan is None:  # the version is written full, and copied into this memory after
                    claimed.tensors = spent
                else:  # nothing made in the copy (a sparse step's delta): still its version's, should this fail
                    self._held = held
        return plan

    def _claim(self, held: _Held) -> _Held | None:
        """Take the remembered version's tensors (``held``'s) for one plan to encode against and
        then spend (its payload is made in their memory: no fresh pages per delta): what is
        remembered meanwhile, with no tensors and not current; or ``None`` where they hold no
        version's bytes: written over by a plan before (``current`` is false from then on, so
        a publish that failed after its delta was made there is followed by a full version),
        or taken by an overlapping publish given this object."""
        with self._memory_lock:
            if self._held is not held or not held.current:
                return None
            self._held = replace(held, tensors={}, current=False)
            return self._held

    def _memory(self, plan: Plan | None) -> dict[str, Stored]:
        """Memory for the next remembered version: what ``plan`` spent, else the remembered
        version's (taken: whoever holds the tensors is their only user)."""
        if plan is not None and plan.spent is not None:
            return plan.spent
        with self._memory_lock:
            held, self._held = self._held, None
        return held.tensors if held is not None else {}

    def _anchor_due(self, chain_bytes: int, full_bytes: int) -> bool:
        """Whether the next version is written full unencoded: the size of the last delta this
        object published (a share of its version) predicts the next, and one more would take
        the chain (``chain_bytes``) past a full version's (fp32 Adam steps, 0.6x a version
        each, alternate with anchors: an estimate cost 0.5 s/GB to say so every other step)."""
        return self._last_share is not None and chain_bytes + int(self._last_share * full_bytes) >= full_bytes

    @staticmethod
    def _holds(held: _Held, target: Folder, pointer: Version, base: str) -> bool:
        """Whether the remembered version is the one ``LATEST`` names (same folder, step, file, time)."""
        return (held.where, held.step, held.name, held.created) == (target.where, pointer.step, base, pointer.created)

    def published(self, target: Folder, version: Version, tensors: dict[str, Stored], plan: Plan | None) -> None:
        """Remember ``version``, just published with ``tensors`` (as ``plan``, or full), as the next
        delta's base, with each file of its chain as the folder lists it (:func:`_seen`)."""
        name = version.file_name
        files = {**({} if plan is None else plan.files), name: target.fingerprint(name)}
        if self.remember:  # what nothing compares is not listed
            files = _seen(target, files)
        self._remember(_Held(target.where, version.step, name, version.created, tensors,
                             None if plan is None else plan.head, files=files), plan)

    def _remember(self, held: _Held, plan: Plan | None) -> None:
        """Remember ``held`` (its tensors copied), just published as ``plan`` (or full). After
        a delta whose successor is an anchor (:meth:`_anchor_due`), no base is read for that
        anchor, so its bytes are not copied (an fp32 publisher saves a copy of the model every
        other step): the memory of the copy before is kept for the anchor's."""
        self.last_kind = "full" if plan is None else "delta"
        if plan is not None:
            self._last_share = plan.payload_bytes / max(1, plan.head.full_bytes)
            self._last_codecs = {row[0]: (item.codec, item.nbytes / max(1, held.tensors[row[0]].data.nbytes))
                                 for row, item in zip(plan.rows, plan.encoded, strict=True)}
        if not self.remember:
            return
        memory = self._memory(plan)
        if plan is not None and self._anchor_due(plan.head.chain_bytes, plan.head.full_bytes):
            held.tensors, held.current = memory, False
        else:
            held.tensors = _copies(held.tensors, memory)
        self._held = held

    def forget(self) -> None:
        """Let go of the remembered version (its memory); the next delta reads its base back."""
        self._held = None


def _seen(target: Folder, files: dict[str, object]) -> dict[str, object]:
    """``files`` (name -> :meth:`~weightstore.io.folders.Folder.fingerprint`) with each
    :data:`~weightstore.io.folders.UNSEEN` one as the folder lists it now, once a version is
    published: a file of the chain a plan read back (not compared at the commit: it was read,
    verified) and the version just written, which a listing after it gives only where
    retention listed the folder. Kept unseen, a file would never be compared again, and an
    anchor replaced under the publisher would get deltas no reader rebuilds. The folder is
    listed once more only where it has not listed the version (``keep=None``); a listing that
    fails leaves them unseen: the version is published."""
    if all(was is not UNSEEN for was in files.values()):
        return files
    try:
        if any(target.fingerprint(name) is UNSEEN for name, was in files.items() if was is UNSEEN and "/" not in name):
            target.files()
    except (WeightStoreError, OSError):
        return files
    return {name: target.fingerprint(name) if was is UNSEEN else was for name, was in files.items()}


def _copies(tensors: dict[str, Stored], old: dict[str, Stored]) -> dict[str, Stored]:
    """Copies of ``tensors`` to remember (the caller may change its arrays once the publish
    returns), written into the buffers of ``old`` (the version remembered before) where they
    fit: the same memory each time, so no fresh pages to fault in (a copy into new memory
    cost as much CPU as the XOR and zstd together)."""
    copies = {}
    for key, item in tensors.items():
        reuse = old.get(key)
        if reuse is not None and len(reuse.data) == len(item.data):
            np.copyto(reuse.data, item.data)
            copies[key] = Stored(item.dtype, item.shape, reuse.data)
        else:
            copies[key] = Stored(item.dtype, item.shape, item.data.copy())
    return copies


def _same_kind(held: Stored | None, item: Stored) -> np.ndarray | None:
    if held is None or held.dtype != item.dtype or held.shape != item.shape:
        return None
    return held.data


def plan_against(step: int, base: str, chain: list[str], chain_bytes: int, tensors: dict[str, Stored],
                 base_of: Callable[[str, Stored], np.ndarray | None]) -> Plan | None:
    """A plan against bases read back (``base_of``), not estimated first: :func:`_plan`."""
    return _plan(step, base, chain, chain_bytes, sum(len(item.data) for item in tensors.values()), tensors, base_of,
                 False, {})


def _plan(step: int, base: str, chain: list[str], chain_bytes: int, full_bytes: int, tensors: dict[str, Stored],
          base_of: Callable[[str, Stored], np.ndarray | None], estimate: bool,
          last: Mapping[str, tuple[str, float]], *, spend: bool = False) -> Plan | None:
    """Encode every tensor against ``base_of``'s bytes; ``None`` once the delta (or the chain
    with it) is no smaller than a full version.

    With ``estimate`` (the base's bytes at hand, nothing to read), every tensor's delta is
    first estimated (:func:`~weightstore.formats.delta.estimate`, 1/32 of an encode): a step
    whose estimate overflows is written full without encoding any tensor, a tensor whose delta
    would not pay is stored ``raw`` without encoding it, and one whose sample changed densely
    goes straight to XOR + zstd. Without, ``last`` (how the last delta stored each tensor) does
    that: a tensor it XOR-ed is XOR-ed again, straight away (no comparison first) where that
    XOR took a quarter of its bytes or more (fp32 Adam kernels: 0.55); a tensor that stopped
    changing so much is compared first again the step after. ``spend``: ``base_of``'s bytes are
    the publisher's own copy, which each tensor's payload is made in once it is encoded
    (:func:`~weightstore.formats.delta.encode`)."""
    estimates: dict[str, delta_format.Estimate] = {}
    if estimate:
        for key, item in tensors.items():
            estimates[key] = delta_format.estimate(item.data, base_of(key, item), storage_dtype(item.dtype).itemsize)
        if chain_bytes + sum(found.nbytes for found in estimates.values()) >= full_bytes:
            return None
    encoded, rows, digests, total = [], [], [], 0
    for key, item in tensors.items():
        found = estimates.get(key)
        if found is not None and found.encoded is not None:
            one = found.encoded
        elif found is not None and found.nbytes >= len(item.data):
            one = delta_format.Encoded(delta_format.RAW, [item.data])
        else:
            codec, share = last.get(key, (None, 0.0))
            xored = codec in _XORED
            dense = (found.codec in (*_XORED, delta_format.RAW) if found is not None else xored and share >= DENSE_SHARE)
            one = delta_format.encode(item.data, base_of(key, item), storage_dtype(item.dtype).itemsize, dense=dense,
                                      sparse=found is not None or not xored, spend=spend)
        total += one.nbytes
        if total >= full_bytes or chain_bytes + total >= full_bytes:
            return None
        encoded.append(one)
        rows.append((key, item.dtype, item.shape, crc32(item.data) if one.crc is None else one.crc))
        digests.append(content_digest(item.data))
    head = delta_format.Head(step, base, chain, chain_bytes + total, full_bytes)
    return Plan(head, encoded, rows, digests)


#: the codecs of a tensor XOR-ed whole (the second: a dense one)
_XORED = (delta_format.XOR_ZSTD, delta_format.XOR_TOP)


def as_delta(delta: Any) -> Delta | None:
    """``publish``'s ``delta=``: ``False``/``None`` none, ``True`` a fresh :class:`Delta`, or the one given."""
    if delta is None or delta is False:
        return None
    if delta is True:
        return Delta(remember=False)
    if isinstance(delta, Delta):
        return delta
    raise TypeError(f"delta must be True, False or a ws.Delta, not {type(delta).__name__}")


def full_weights(tensors: Mapping[str, Stored]) -> dict[str, np.ndarray]:
    """The tensors as a weight dictionary, for writing a full version."""
    return {key: item.array() for key, item in tensors.items()}
