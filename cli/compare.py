"""``ws diff`` and ``ws verify``: what differs between two weight sources, and what is corrupt
(in one file, or in every version of a folder ``ws.publish`` writes).

Both read one tensor at a time and ``diff`` compares a pair in slices, so memory holds about
two tensors whatever the file size.
``diff`` skips reading a pair whose content digests (BLAKE3, manifest version 3) agree: equal
bytes are equal values. The digests are what the writers recorded, so a copy damaged since
reads as unchanged; those pairs are counted apart (``by_digest``), and ``read=True`` reads
them too (each read checks the tensor's checksum, which a damaged copy fails). CRC-32s never
decide it (a collision is four chosen bytes away), so pairs without digests are read and
compared, and at ``atol=0`` equal values whose bytes differ (``-0.0`` and ``0.0``, NaNs of
other payloads) are a change too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from weightstore.cli.render import tensor_type, track
from weightstore.core._tensortable import DIGEST_PREFIX
from weightstore.core.manifest import TensorInfo, to_storage
from weightstore.errors import FormatError, StoreNotFoundError, named
from weightstore.store._open import Store, open_onto_base

if TYPE_CHECKING:
    from weightstore.sync._folder import FolderState
    from weightstore.sync._listing import VersionEntry
    from weightstore.sync._pinning import Version

_CHUNK = 2 << 20  # elements: 16 MB of float64


@dataclass
class Change:
    key: str
    reason: str  # "dtype", "shape", "values" or "bytes" (equal values, other bytes: -0.0 and 0.0)
    a: str  # float32[3, 4]
    b: str
    max_abs: float | None = None
    max_rel: float | None = None
    #: of the elements, the fraction whose bytes differ (what a delta version stores)
    changed_fraction: float | None = None


@dataclass
class Diff:
    added: list[str] = field(default_factory=list)  # only in B
    removed: list[str] = field(default_factory=list)  # only in A
    changed: list[Change] = field(default_factory=list)
    unchanged: int = 0
    by_digest: int = 0  # of the unchanged: by the digests the writers recorded, not read
    metadata_equal: bool = True

    @property
    def equal(self) -> bool:
        """Tensors only: metadata is reported but does not make two files different."""
        return not (self.added or self.removed or self.changed)

    def to_json(self) -> dict:
        return {
            "equal": self.equal,
            "added": self.added,
            "removed": self.removed,
            "changed": [{k: _finite(v) for k, v in asdict(c).items()} for c in self.changed],
            "unchanged": self.unchanged,
            "unchanged_by_digest": self.by_digest,
            "metadata_equal": self.metadata_equal,
        }


def _finite(value):
    """JSON has no infinity or NaN: name them as strings."""
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return value


def diff(a: Store, b: Store, *, atol: float = 0.0, read: bool = False) -> Diff:
    a_keys, b_keys = a.keys(), b.keys()
    b_set, a_set = set(b_keys), set(a_keys)
    result = Diff(
        added=[k for k in b_keys if k not in a_set],
        removed=[k for k in a_keys if k not in b_set],
        metadata_equal=a.metadata == b.metadata,
    )
    common = [k for k in a_keys if k in b_set]
    total = sum(a.info(k).nbytes for k in common)
    # a sharded version's region digests hash its block tables' digests, which no read or verify
    # checks against its bytes: its author's word, of either kind, read instead (docs/sharded.md)
    read = read or "sharded" in (a.format, b.format)
    for key in track(((k, a.info(k).nbytes) for k in common), "comparing", total):
        if not read and _same_digest(a.info(key), b.info(key)):
            result.unchanged += 1
            result.by_digest += 1
            continue
        change = _compare(a, b, key, atol)
        if change is None:
            result.unchanged += 1
        else:
            result.changed.append(change)
    return result


def _same_digest(left: TensorInfo, right: TensorInfo) -> bool:
    """Equal by their recorded content digests (BLAKE3 of each tensor's bytes, which ``ws verify``
    checks), where those cannot be made equal by choosing bytes (the two sides may have
    different authors)."""
    return (left.digest is not None and left.digest == right.digest and left.digest.startswith(DIGEST_PREFIX)
            and left.dtype == right.dtype and left.shape == right.shape)


def _compare(a: Store, b: Store, key: str, atol: float) -> Change | None:
    left, right = a.info(key), b.info(key)
    if left.dtype != right.dtype:
        return Change(key, "dtype", tensor_type(left), tensor_type(right))
    if left.shape != right.shape:
        return Change(key, "shape", tensor_type(left), tensor_type(right))
    x, y = a[key], b[key]
    max_abs, max_rel = difference(x, y)
    if max_abs > atol:
        return Change(key, "values", tensor_type(left), tensor_type(right), max_abs, max_rel, changed_fraction(x, y))
    if atol == 0 and not _same_bytes(x, y):
        return Change(key, "bytes", tensor_type(left), tensor_type(right), 0.0, 0.0, changed_fraction(x, y))
    return None


def changed_fraction(x: np.ndarray, y: np.ndarray, *, chunk: int = _CHUNK) -> float:
    """Of the elements of two arrays of one dtype and shape, the fraction whose bytes differ, a slice at a time."""
    if not x.size:
        return 0.0
    itemsize = x.dtype.itemsize
    flat_x = np.ascontiguousarray(x).reshape(-1).view(np.uint8).reshape(-1, itemsize)
    flat_y = np.ascontiguousarray(y).reshape(-1).view(np.uint8).reshape(-1, itemsize)
    changed = 0
    for start in range(0, len(flat_x), chunk):
        changed += int(np.count_nonzero((flat_x[start:start + chunk] != flat_y[start:start + chunk]).any(axis=1)))
    return changed / len(flat_x)


def _same_bytes(x: np.ndarray, y: np.ndarray, *, chunk: int = _CHUNK) -> bool:
    """Whether two arrays of one dtype and shape hold the same bytes, a slice at a time."""
    flat_x = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    flat_y = np.ascontiguousarray(y).reshape(-1).view(np.uint8)
    step = chunk * 8
    return all(np.array_equal(flat_x[start:start + step], flat_y[start:start + step])
               for start in range(0, flat_x.size, step))


def _integer_difference(flat_x: np.ndarray, flat_y: np.ndarray, chunk: int) -> tuple[float, float]:
    """:func:`difference` of integers, exact: in float64 two integers past 2**53 apart by one
    are one number. Each is mapped, order kept, onto uint64 (a signed one with its sign bit
    flipped), where the larger minus the smaller is the exact gap."""
    signed = flat_x.dtype.kind == "i"
    max_gap, scale = 0, 0
    for start in range(0, flat_x.size, chunk):
        part_x, part_y = (np.asarray(flat[start:start + chunk]) for flat in (flat_x, flat_y))
        scale = max(scale, abs(int(part_x.max())), abs(int(part_x.min())))
        if signed:
            ordered = [part.astype(np.int64).view(np.uint64) ^ np.uint64(1 << 63) for part in (part_x, part_y)]
        else:
            ordered = [part.astype(np.uint64) for part in (part_x, part_y)]
        gap = np.maximum(*ordered) - np.minimum(*ordered)
        max_gap = max(max_gap, int(gap.max()))
    if not max_gap:
        return 0.0, 0.0
    return float(max_gap), (max_gap / scale if scale else float("inf"))


def difference(x: np.ndarray, y: np.ndarray, *, chunk: int = _CHUNK) -> tuple[float, float]:
    """``(max |x - y|, that divided by max |x|)``; NaN equals NaN, equal infinities are equal.

    Compared ``chunk`` elements at a time in float64 (complex128 for complex tensors), so
    beyond the two tensors memory holds a few 16 MB slices, never float64 copies of both.
    """
    if x.size == 0:
        return 0.0, 0.0
    if x.dtype.kind in "iu":
        return _integer_difference(np.ravel(x), np.ravel(y), chunk)
    wide = np.complex128 if np.iscomplexobj(x) else np.float64
    flat_x, flat_y = np.ravel(x), np.ravel(y)
    max_abs, scale = 0.0, 0.0
    with np.errstate(invalid="ignore", over="ignore"):
        for start in range(0, flat_x.size, chunk):
            xs = np.asarray(flat_x[start:start + chunk], dtype=wide)
            ys = np.asarray(flat_y[start:start + chunk], dtype=wide)
            gap = np.abs(xs - ys)
            gap[xs == ys] = 0.0
            x_nan = np.isnan(xs)
            gap[x_nan & np.isnan(ys)] = 0.0
            gap[np.isnan(gap)] = np.inf
            max_abs = max(max_abs, float(gap.max()))
            if not x_nan.all():
                scale = max(scale, float(np.nanmax(np.abs(xs))))
    if max_abs == 0.0:
        return 0.0, 0.0
    return max_abs, (max_abs / scale if scale and np.isfinite(scale) else float("inf"))


@dataclass
class Problem:
    """A tensor that failed to read back whole: its key, and what is wrong without the file or key."""

    key: str
    message: str


def said_once(problems: list[Problem]) -> str:
    """``problems`` as one line, each fault said once with the tensors it failed: a file of a
    remote delta's chain that is missing (its bases are opened as tensors are read, where a local
    chain fails once, as it opens) fails every tensor alike, and was said again for each."""
    failed: dict[str, list[str]] = {}
    for problem in problems:
        failed.setdefault(problem.message, []).append(problem.key)
    return "; ".join(f"tensor{'s' if len(keys) > 1 else ''} {named(keys)}: {message}" for message, keys in failed.items())


def verify(store: Store, held: Held | None = None, keep: Held | None = None) -> list[Problem]:
    """Read every tensor with its checksum checked; one problem per failing tensor, empty when sound.

    ``held``: the version before, whole, where ``store`` is a delta of it: each tensor is
    rebuilt onto its bytes there (taken, changed in place; where it held a tensor of the same
    dtype and shape, as a reader requires) and checked against the digest its
    publisher recorded, as a follower does, rather than rebuilt from the anchor again; one that
    cannot be (a tensor it has not, a failure) is read whole, whose error names the file of the
    chain at fault. A tensor that did not read whole in ``held`` and is stored here as a change
    of it is reported with that fault, naming the file, not rebuilt from the anchor again (which made a
    chain damaged low down cost time quadratic in its depth). ``keep``: filled with each
    tensor's stored bytes that read whole, and each fault, for the next version."""
    problems = []
    keys = store.keys()
    total = sum(store.info(k).nbytes for k in keys)
    for key in track(((k, store.info(k).nbytes) for k in keys), "verifying", total):
        fault = None if held is None else held.faults.get(key)
        if fault is not None and held is not None and store.changes_base(key):
            problems.append(Problem(key, fault))
            if keep is not None:
                keep.faults[key] = fault
            continue
        try:
            kept = _read_checked(store, key, held, keep is not None)
            if keep is not None and kept is not None:
                info = store.info(key)
                keep.tensors[key], keep.kinds[key] = kept, (info.dtype, tuple(info.shape))
        except FormatError as exc:
            elsewhere = exc.path if exc.path != store.path else None  # a sharded version's member
            problems.append(Problem(key, f"{elsewhere}: {exc.message}" if elsewhere else exc.message))
            if keep is not None:  # said as a file of its chain says it (once: a fault found lower down already is)
                said = problems[-1].message
                keep.faults[key] = said if said.startswith("in its chain, ") else f"in its chain, {keep.name}: {said}"
    return problems


@dataclass
class Held:
    """A version ``ws verify FOLDER`` found whole (file name), and its tensors' stored bytes,
    each its own writable copy: what the delta after it is rebuilt onto."""

    name: str
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    #: what keeps each tensor that did not read whole from reading, naming the file at fault
    faults: dict[str, str] = field(default_factory=dict)
    #: the chain a delta of it lists: its name, then its own chain (``None``: the listing did not tell)
    chain: list[str] | None = None
    #: each tensor's dtype and shape: a delta is rebuilt onto one only where it is a change of a
    #: tensor of its own dtype and shape, which a reader checks (of the same bytes, it refuses it)
    kinds: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)


def _read_checked(store: Store, key: str, held: Held | None, keep: bool) -> np.ndarray | None:
    """``key`` read with its checksum (or digest) checked: rebuilt onto ``held``'s bytes where
    it can be, else read whole; where ``keep``, its stored bytes (uint8), writable and its own."""
    data = None if held is None else held.tensors.pop(key, None)
    info = store.info(key)
    if data is not None and held is not None and held.kinds.get(key) == (info.dtype, tuple(info.shape)):
        try:
            if store.read_from(key, held.name, data, in_place=True) is not None:
                return data
        except FormatError:  # read whole below: its error names the file of the chain at fault
            pass
    array = store[key]
    store.check_digests(key, array)  # a sharded version's block digests, which followers trust unread
    if not keep:
        return None
    stored = np.ascontiguousarray(to_storage(array, key)[1])
    return stored.reshape(-1).view(np.uint8).copy() if stored.size else np.empty(0, np.uint8)


@dataclass
class VersionCheck:
    """What ``ws verify FOLDER`` found of one version: ``state`` is ``"ok"``, ``"corrupt"`` (its
    ``problems``, or ``fault`` where it does not open at all) or ``"skipped"`` (``fault`` says why)."""

    step: int
    path: str
    kind: str  # as ``ws versions`` says it: full, delta, sharded, sharded-delta
    state: str = "ok"
    count: int = 0
    problems: list[Problem] = field(default_factory=list)
    fault: str = ""


def holds_versions(store: str) -> bool:
    """Whether ``store`` is a folder ``ws.publish`` writes: it holds ``LATEST`` or a version file
    (one with ``LATEST`` lost, too). Asked once it is known to be no weight file."""
    from weightstore.formats._pointer import LATEST
    from weightstore.sync._folder import not_file_versions, require_folder, version_files

    try:
        folder = require_folder(store)
    except StoreNotFoundError:  # no such folder, or a file
        return False
    return any(entry.name == LATEST for entry in folder.files()) or bool(version_files(folder)) or \
        bool(not_file_versions(folder))


def verify_versions(folder: str, checked: Callable[[VersionCheck], None] | None = None,
                    ) -> tuple[list[VersionCheck], FormatError | None]:
    """:func:`verify` of every version ``ws versions FOLDER`` lists, oldest first, and what is
    wrong with ``LATEST`` (``None`` when it reads and names a version the folder holds);
    ``checked`` is given each version's check as soon as it is done.

    Opening a version is what checks it whole: a delta is rebuilt and checked against the
    digests its publisher recorded (so a damaged anchor shows in every delta built on it), a
    sharded version reads every block of its members. Along a chain each delta is applied once,
    onto the version before it as just verified (:class:`Held`: one version's tensors in
    memory), not rebuilt from its anchor for every version, and opened without its chain (each
    file of a chain is opened once, not by every version above it); where none of the version
    before read whole, with its chain, as a reader opens it (a fault there named once, not once
    a tensor). A version being written (the
    step a publish under way recorded, above ``LATEST``'s) or removed while this runs (a prune)
    is skipped, not corrupt; a storage outage is raised, since nothing can be told then.
    ``LATEST`` is read again at the end (:func:`_latest_damage`). A version whose name is held
    by no file (a FIFO, a folder, a link) is corrupt, never opened."""
    from weightstore.sync._listing import version_listing

    entries, damage = version_listing(folder)
    before = _state(folder)  # read after the listing: a publish records its intent before its version
    pointer = before.pointer if damage is None else None
    checks = []
    held: Held | None = None
    chain: list[str] | None = None  # the chain a delta of the version before lists, as the listing tells
    for at, entry in enumerate(entries):
        check = VersionCheck(entry.step, entry.path, entry.kind)
        checks.append(check)
        following = entries[at + 1] if at + 1 < len(entries) else None
        own = [] if entry.kind == "full" else chain if entry.kind == "delta" and chain and chain[0] == entry.base \
            else None
        chain = None if own is None else [entry.name, *own]
        keep = Held(entry.name, chain=chain) if following is not None and following.kind == "delta" and \
            following.base == entry.name else None
        _check_version(folder, entry, check, before, pointer,
                       held if held is not None and entry.kind == "delta" and entry.base == held.name else None, keep)
        held = keep  # what read whole: a tensor that did not is read from the anchor again, naming the fault
        if checked is not None:
            checked(check)
    if damage is None and (pointer is not None or entries):
        damage = _latest_damage(folder, pointer)
    return checks, damage


def _check_version(folder: str, entry: VersionEntry, check: VersionCheck, before: FolderState,
                   pointer: Version | None, held: Held | None, keep: Held | None) -> None:
    """Fill in ``check`` of version ``entry`` (see :func:`verify_versions`)."""
    import weightstore

    if pointer is not None and entry.step > pointer.step and entry.step == before.intent:
        check.state, check.fault = "skipped", f"above LATEST's step {pointer.step}: being written"
        return
    if entry.not_file is not None:  # never opened: a FIFO would block, a link lead out of the folder
        check.state, check.fault = "corrupt", f"is {entry.not_file}, not a file: no reader opens it"
        return
    if held is not None and not held.tensors:  # none read whole: opened as a reader opens it, its chain's fault named once
        held = None
    try:
        with weightstore.open(entry.path) if held is None else open_onto_base(entry.path, held.chain) as opened:
            check.count, check.problems = len(opened), verify(opened, held, keep)
    except StoreNotFoundError as exc:  # gone: this version (pruned meanwhile), or a file of its chain
        if entry.name not in _version_names(folder):
            check.state, check.fault = "skipped", "removed while verifying (pruned)"
            return
        check.fault = _fault(exc, entry.path)
    except FormatError as exc:  # its structure, or a file of its chain
        check.fault = _fault(exc, entry.path)
    if check.problems or check.fault:
        check.state = "corrupt"


def _fault(exc: Exception, path: str) -> str:
    """What is wrong with the version at ``path``, without its name where the line says it already."""
    text = str(exc)
    return text[len(path) + 2:] if text.startswith(f"{path}: ") else text


def _state(folder: str) -> FolderState:
    from weightstore.sync._folder import FolderState, require_folder

    return FolderState.read(require_folder(folder))


def _latest_damage(folder: str, pointer: Version | None) -> FormatError | None:
    """What is wrong with ``LATEST``, which named ``pointer`` before the versions were verified,
    read again now (a publish and its prune may have moved it on meanwhile); ``None`` when
    nothing is. It names a version the folder does not hold; versions no publish under way
    accounts for lie above its step (restored from an older copy: followers stay behind, and the
    next publish refuses a step not above them); or it is missing while versions, other than a
    killed first publish's own, are there."""
    state = _state(folder)
    now = state.pointer
    if pointer is None:
        if now is not None or state.pointer_error is not None:
            return state.pointer_error
        published = [step for step, _ in state.versions if step != state.intent]
        return FormatError(f"holds versions up to step {published[-1]} but no LATEST: followers see none; "
                           "publish again to repair it", path=folder) if published else None
    if now is None or now.path != pointer.path:
        return None
    name = pointer.path.rsplit("/", 1)[-1]
    if name not in {file for _, file in state.versions}:
        held = "is no file" if name in state.folder.not_files() else "the folder does not hold"
        return FormatError(f"LATEST names {name}, which {held}: followers cannot read it; publish again to repair it",
                           path=folder)
    above = state.above_latest()
    if above:
        return FormatError(f"LATEST names step {pointer.step}, but step {above[-1]} above it was published before "
                           "(was LATEST restored from an older copy?): followers miss it, and a publish refuses "
                           "steps up to it; publish a later step, or move those files away", path=folder)
    return None


def _version_names(folder: str) -> set[str]:
    from weightstore.sync._folder import require_folder, version_files

    return {entry.name for _, entry in version_files(require_folder(folder))}
