"""``open`` and ``load`` over local paths and fsspec URLs: the :class:`Store` over a file's
reader, whatever wrote the file (weightstore, a TF checkpoint, Keras, safetensors, a Hugging
Face sharded folder); :mod:`weightstore.store._save` writes."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import numpy as np

from weightstore.core._gcpause import paused_gc
from weightstore.core._words import checks_words
from weightstore.core.keys import MappingRules, Patterns, plan_outward
from weightstore.core.limits import MAX_POINTER_BYTES
from weightstore.core.manifest import TensorInfo, logical_dtype, to_storage
from weightstore.core.names import (
    FILE,
    NAMES_METADATA,
    READ_NAMINGS,
    TORCH_FORMATS,
    check_naming,
    keys_of_torch_names,
    reads_as_torch,
)
from weightstore.errors import (
    KeyNotInStoreError,
    SizeLimitError,
    StorageError,
    StoreNotFoundError,
    WeightStoreError,
    attach,
    naming,
)
from weightstore.formats import (
    Format,
    Reader,
    RegionReader,
    finders,
    format_for_suffix,
    format_named,
    hf_sharded,
    refuse_misnamed,
    sniff,
)
from weightstore.formats._foreign import HEAD_BYTES, refuse_pickle
from weightstore.formats._pointer import LATEST, latest_name, published_folder_message, refuse_pointer
from weightstore.formats._renamed import RenamedReader, names_by_key, said_torch
from weightstore.io.files import open_regular, unreadable
from weightstore.io.location import service
from weightstore.io.places import Place, place_of
from weightstore.io.remote import RemoteFile

_S = TypeVar("_S", bound="Store")


@runtime_checkable
class OpensItself(Protocol):
    """Something :func:`open` accepts that knows how to open its own file (a ``Version``: its
    pinned reader, or a clear "version gone" once pruned)."""

    def _weightstore_open(self, *, verify: bool = True) -> Store: ...


class Store(Mapping):
    """An open weight file: the index is read, each tensor is read when asked for.

    A read-only mapping of key to array, so it can be passed wherever a weight dictionary
    goes. ``ws.save(other, store)`` streams tensor by tensor: keys and dtypes are checked
    from the index first, then each tensor is read just before it is written, so a copy holds
    about one tensor in memory, not the whole file. Tensors from uncompressed local
    npz files are read-only views of the mapped file; copy one (``np.array(store[key])``) to
    change it.
    """

    #: keys paired with a model by structure (``artifacts``), so an assign error offers no
    #: "did you mean" hints between keys that merely look alike
    exact_keys = False

    def __init__(self, reader: Reader, path: str, verify: bool, format: str = ""):  # noqa: A002
        self._reader = reader
        self._keys = reader.keys()
        self.path = path
        self.verify = verify
        #: the name of the format in the table that read it (``"safetensors"``, ``"tf-checkpoint"``)
        self.format = format

    @property
    def metadata(self) -> dict[str, Any]:
        """What the writer passed as ``metadata`` (``{}`` for a file without a manifest); the
        entry an npz or HDF5 file of PyTorch's names carries for readers is weightstore's own
        (:meth:`stored_names` tells those names)."""
        metadata = self._reader.metadata
        return {k: v for k, v in metadata.items() if k != NAMES_METADATA} if NAMES_METADATA in metadata else metadata

    @property
    def created(self) -> str:
        """When the file was written (ISO 8601, UTC), as its manifest says; empty without one."""
        return self._reader.created

    @property
    def has_checksums(self) -> bool:
        """Whether the file has weightstore's manifest, with a checksum per tensor (what hot reload
        compares); False for files other tools wrote and for TF checkpoints."""
        return self._reader.has_checksums

    def keys(self) -> list[str]:  # type: ignore[override]  # a list keeps the file's order
        """Every key, in the file's order."""
        return list(self._keys)

    def stored_names(self) -> dict[str, str]:
        """Key -> the name the file stores it under, where the two differ: a safetensors file
        named as a PyTorch ``state_dict`` is (``features/0/weight`` stored as ``features.0.weight``).
        Rewriting the file keeps its names with ``save(..., names="torch")``."""
        return dict(getattr(self._reader, "stored_names", {}))

    def info(self, key: str) -> TensorInfo:
        """A tensor's dtype, shape, size and checksum, from the index: no tensor bytes are read."""
        try:
            return self._reader.info(key)
        except WeightStoreError as exc:  # a reader's check that knows the tensor, not the file
            attach(exc, path=self.path)
            raise

    def __getitem__(self, key: str) -> np.ndarray:
        try:
            return self._reader.read(key, verify=self.verify)
        except WeightStoreError as exc:
            attach(exc, path=self.path)
            raise

    def read_into(self, key: str, out: np.ndarray) -> np.ndarray:
        """Read ``key`` into ``out`` (its shape, C-contiguous, writable; converted to its dtype) and return it.

        For callers that need the tensor in memory they own, such as the TF1 adapter, which
        hands TF aligned buffers it adopts without a copy: an uncompressed npz tensor goes
        from the file straight into ``out``, never mapped into this process as well, so a
        restore holds the model's bytes once rather than twice.
        """
        info = self.info(key)
        if out.shape != tuple(info.shape) or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"{self.path}: read_into {key!r} needs a writable C-contiguous array of shape {info.shape}")
        with naming(path=self.path):
            dtype = logical_dtype(info.dtype)
        if out.dtype != dtype or not self._reader.read_into(key, out, verify=self.verify):
            np.copyto(out, self[key], casting="unsafe")
        return out

    @property
    def reads_regions(self) -> bool:
        """Whether :meth:`read_region` fetches only the region's bytes (a sharded version), so a
        caller that needs several parts of a tensor reads each part rather than the whole once."""
        # asked of the attribute, not isinstance(RegionReader): a version's reader is wrapped
        # (pinned, or told apart when pruned) by proxies answering through __getattr__, which
        # Python 3.12's protocol check (inspect.getattr_static) no longer asks
        return callable(getattr(self._reader, "read_region", None))

    def read_region(self, key: str, region: Any) -> np.ndarray:
        """The part of ``key`` a tuple of slices names (``(slice(0, 128), slice(None))``), as a new array.

        A sharded version (:func:`weightstore.commit_shards`) reads and verifies only the blocks
        of its members that hold the region; any other store reads the tensor and copies the part.
        Slices have no step; fewer slices than axes leave the remaining axes whole.
        """
        if not self.reads_regions:
            from weightstore.formats.sharded import normalized_region

            with naming(path=self.path):
                bounds = normalized_region(region, self.info(key).shape, key)
            return np.array(self[key][tuple(slice(lo, hi) for lo, hi in bounds)])
        try:
            return cast(RegionReader, self._reader).read_region(key, region, verify=self.verify)
        except WeightStoreError as exc:
            attach(exc, path=self.path)
            raise

    def region_digest(self, key: str, region: Any) -> str | None:
        """A digest that stays equal while the bytes :meth:`read_region` would return for
        ``region`` do, known without reading them (None: not known, so assume they changed).

        A sharded version hashes the digests its index holds for the blocks that hold the
        region (``change:`` where they are change digests, trusted against accidents only:
        docs/sharded.md), so a follower skips a part of a tensor whose blocks did not change;
        any other store gives the whole tensor's digest (a region is unchanged when its tensor is).
        """
        if not self.reads_regions:
            return self.info(key).digest
        try:
            return cast(RegionReader, self._reader).region_digest(key, region)
        except WeightStoreError as exc:
            attach(exc, path=self.path)
            raise

    def check_digests(self, key: str, array: np.ndarray) -> None:
        """That the digests recorded for ``key``'s parts, which a follower's skip-unchanged
        trusts (:meth:`region_digest`) without reading them, are those of ``array``: ``key`` as
        just read, its checksums checked (``ws verify``). A sharded version's block digests; a
        format that records none has none to check. :class:`ChecksumError` where one lies."""
        method = getattr(self._reader, "check_digests", None)
        if not callable(method):
            return
        try:
            method(key, to_storage(array, key)[1])
        except WeightStoreError as exc:
            attach(exc, path=self.path)
            raise

    def changes_base(self, key: str) -> bool:
        """Whether ``key`` is stored here as a change of its base's bytes (a delta version's
        tensor not stored whole), so that whatever keeps it from reading whole in the base keeps
        it from reading here too; False for every other format."""
        method = getattr(self._reader, "codec", None)
        return callable(method) and method(key) != "raw"

    def read_from(self, key: str, held: str, data: np.ndarray, *, in_place: bool = False) -> np.ndarray | None:
        """``key`` rebuilt onto ``data`` (its bytes in version file ``held``, which the caller
        holds), reading only what changed since: a delta version whose chain passes through
        ``held`` (see :mod:`weightstore.formats.delta`). ``None`` where this store cannot (any
        other format, or ``held`` not in the chain): read ``key`` as usual then. ``in_place``:
        rebuilt where ``data`` (uint8, writable) lies, which a failure leaves half changed."""
        method = getattr(self._reader, "read_from", None)
        if not callable(method):
            return None
        try:
            return cast("np.ndarray | None", method(key, held, data, verify=self.verify, in_place=in_place))
        except WeightStoreError as exc:
            attach(exc, path=self.path)
            raise

    def read_regions_from(self, key: str, held: str, have: list[tuple[Any, np.ndarray]],
                          wanted: list[Any]) -> list[np.ndarray | None]:
        """The regions ``wanted`` of ``key`` (each as ``(start, stop)`` per axis), rebuilt onto
        ``have`` (regions of ``key`` the caller holds: bounds, and their bytes in version file
        ``held``), reading only what changed since, as :meth:`read_from` for regions; each
        ``None`` where this store cannot (not a sharded delta version, ``held`` not in its
        chain, a stored run of it outside ``have``): read that region as usual then."""
        method = getattr(self._reader, "read_regions_from", None)
        if not callable(method):
            return [None for _ in wanted]
        try:
            return cast("list[np.ndarray | None]", method(key, held, have, wanted, verify=self.verify))
        except WeightStoreError as exc:
            attach(exc, path=self.path)
            raise

    def chain_payload(self, keys: list[str], held: str | None) -> int | None:
        """Bytes :meth:`read_from` fetches for ``keys`` from version file ``held`` (``None``: what
        reading them from a delta version's anchor fetches); ``None`` where it cannot."""
        method = getattr(self._reader, "chain_payload", None)
        if not callable(method):
            return None
        try:
            return cast("int | None", method(keys, held))
        except WeightStoreError as exc:
            attach(exc, path=self.path)
            raise

    def read(self, keys: Iterable[str] | None = None, *, max_bytes: int | None = None) -> dict[str, np.ndarray]:
        """Several tensors at once, refusing before reading if they exceed ``max_bytes``."""
        if isinstance(keys, str):  # iterated, it would name one tensor per character
            raise TypeError(f"read() takes a list of keys, not one key: store.read([{keys!r}]), or store[{keys!r}]")
        wanted = self.keys() if keys is None else list(keys)
        for key in wanted:
            if key not in self:
                raise KeyNotInStoreError("no such tensor", path=self.path, key=key)
        check_budget(self, wanted, max_bytes)
        return dict(zip(wanted, self._read_many(wanted), strict=True))

    def _read_many(self, keys: list[str]) -> list[np.ndarray]:
        """Several tensors, in order: a remote file fetches them at once rather than one by one,
        and a reader that can read many in one pass (npz) does."""
        if len(keys) > 1:
            self._reader.prefetch(keys)
        if not keys:
            return []
        with naming(path=self.path):
            return self._reader.read_many(keys, verify=self.verify)

    @functools.cached_property
    def _key_set(self) -> frozenset[str]:
        """Made on the first ``in``: an open that lists the keys, or reads them all, needs none."""
        return frozenset(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._key_set

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        """The bytes of every tensor, as arrays in memory (not as stored, which compression shrinks)."""
        return sum(self.info(k).nbytes for k in self.keys())

    def close(self) -> None:
        """Release the file (its map or handle); ``with ws.open(...)`` calls it. Read no tensor after it."""
        self._reader.close()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<weightstore.Store {self.path!r} ({len(self)} tensors)>"


def check_budget(store: Store, keys: Iterable[str], max_bytes: int | None) -> None:
    """Refuse, with :class:`SizeLimitError`, reading ``keys`` if their bytes exceed ``max_bytes``.

    The sizes come from the index (the manifest, or each npy/HDF5 header); readers refuse a
    tensor whose stored bytes exceed what its index entry says, so the index cannot lie small.
    """
    if max_bytes is None:
        return
    keys = list(keys)
    total = sum(store.info(k).nbytes for k in keys)
    if total > max_bytes:
        raise SizeLimitError(f"reading {len(keys)} tensors needs {total} bytes, over max_bytes={max_bytes}", path=store.path)


@checks_words("ws.open")
def open(path: Any, *, verify: bool = True, format: str | None = None, mmap: bool = True,  # noqa: A001
         names: str | None = None) -> Store:
    """Open a weight file lazily: only its index is read until a tensor is asked for.

    Args:
        path: anything :func:`load` accepts.
        verify: check each tensor's checksum when it is read.
        format: read as this format whatever the name says (``"npz"``, ``"hdf5"``, ``"safetensors"``).
        mmap: ``False`` reads the tensors of a local npz into memory of their own (``preadv``,
            64-byte aligned; small tensors read together share one buffer) instead of returning
            views of the mapped file, which a file truncated or rewritten in place by another
            tool would change, or (SIGBUS) make fatal to touch.
        names: how a foreign file's tensor names become keys (:mod:`weightstore.core.names`).
            ``None``: as the file says: a safetensors file written by PyTorch or Hugging Face
            (names with ``.``, none with ``/``) reads ``features.0.weight`` as
            ``features/0/weight``, as is an npz or HDF5 file saved with ``names="torch"``
            (its manifest says so); other names are keys as written. ``"torch"``: read every
            name as PyTorch's (an ``np.savez`` of a ``state_dict``); ``"file"``: as written.

    Returns:
        A :class:`Store`: a read-only mapping of key -> array; use it as a context manager.

    Raises:
        StoreNotFoundError: no such file. FormatError, UnsafeFileError: a damaged or hostile index.

    Example:
        >>> with ws.open("model.npz") as store:
        ...     kernel = store["dense/kernel"] if "dense/kernel" in store else None
    """
    # a Version: its pinned file, or a clear "version gone" if pruned (a name is asked first: a
    # protocol's isinstance costs 0.05 ms, a tenth of opening a small file)
    if not isinstance(path, (str, os.PathLike)) and isinstance(path, OpensItself):
        return path._weightstore_open(verify=verify)
    with paused_gc():  # an index of 50,000 tensors is some 300,000 containers (weightstore.core._gcpause)
        store = _open(path, verify=verify, format=format, mmap=mmap)
    return _named(store, check_naming(names, READ_NAMINGS))


def open_onto_base(path: Any, chain: list[str] | None = None, *, held: str | None = None) -> Store:
    """:func:`open` of the delta version ``path`` for a reader that holds the tensors of a
    version of its chain, proven, and rebuilds onto them: its chain is opened down to ``held``
    (that version's file name; none: not at all), and each base below it when a tensor is first
    read whole. So what such a reader costs grows with the deltas after the version it holds,
    not with the chain's depth: opened whole, each version of a chain 1,000 deep opened every
    file below it (``ws verify FOLDER`` took time quadratic in its depth; a follower holding
    step 999 of it opened 999 files to read one). ``chain``: the chain its head should list
    (its base, then the base's chain), taken as checked where the head lists just that."""
    import dataclasses

    from weightstore.formats import delta

    fmt = dataclasses.replace(delta.FORMAT, open_reader=functools.partial(
        delta.open_reader, chain=False if held is None else held, checked=chain))
    with paused_gc():
        store = _open_file(place_of(path), fmt, True, True)
    return _named(store, None)


def _named(store: Store, names: str | None) -> Store:
    """``store`` with its keys formed from its file's names as ``names`` says (see :func:`open`)."""
    if names == FILE or names is None and not _torch_named(store):
        return store
    reader = store._reader
    try:
        renamed = RenamedReader(reader, names_by_key(reader, keys_of_torch_names))
    except BaseException:
        store.close()
        raise
    return Store(renamed, store.path, store.verify, store.format)


def _torch_named(store: Store) -> bool:
    """Whether what wrote the file named its tensors PyTorch's way: a safetensors file without
    a manifest, a sharded folder (weightstore names shards so too), or a file whose manifest's
    metadata says so (an npz or HDF5 file saved with ``names="torch"``), whose names read so."""
    written_by_torch = not store.has_checksums or store.format == hf_sharded.FORMAT_NAME
    return said_torch(store._reader) or store.format in TORCH_FORMATS and written_by_torch and reads_as_torch(
        store.keys())


def _open(path: Any, *, verify: bool, format: str | None, mmap: bool) -> Store:  # noqa: A002
    """The one dispatch over the format table, for a local path and a URL alike.

    A format recognised by where it lies (:attr:`~weightstore.formats.Format.find`: a model
    folder, a checkpoint prefix, an archive a sniff would call a zip) is asked first locally,
    where asking costs a ``stat``; of a URL only once no file is there, so opening a remote file
    stays one request. Anything else is a file, of the format asked for, its suffix's, or its
    first bytes'.
    """
    place = place_of(path)
    with naming(path=place.text):
        asked = format_named(format) if format else None
    named = asked or format_for_suffix(place.text)
    if named is not None and named.find is not None:  # asked for, or named by suffix (an index file)
        found = _open_found(place, [named], verify, mmap)
        if found is None:
            raise StoreNotFoundError(f"holds nothing the {named.name} format reads", path=place.text)
        return found
    is_file = named is not None and not place.remote and place.is_file()
    if asked is None and not place.remote and not is_file:
        found = _open_found(place, finders(), verify, mmap)  # a store file never asks: nor loads their readers
        if found is not None:
            return found
    try:
        return _open_file(place, asked or named, verify, mmap, is_file=is_file, asked=asked is not None)
    except FileNotFoundError as exc:
        if isinstance(exc, WeightStoreError):  # a reader's own word on what is missing
            raise
        if named is None and place.remote:
            found = _open_found(place, finders(), verify, mmap)
            if found is not None:
                return found
            if place.is_dir():
                _refuse_published_folder(place)
                raise StoreNotFoundError("is a folder that no format reads", path=place.text) from None
        raise StoreNotFoundError("no such file", path=place.text) from None


def _open_found(place: Place, formats: list[Format], verify: bool, mmap: bool) -> Store | None:
    """The first of ``formats`` that finds something at ``place``, opened; ``None`` if none does."""
    for fmt in formats:
        assert fmt.find is not None
        target = fmt.find(place)
        if target is not None:
            try:
                reader = fmt.open_reader(target.source(), target.text, mmap=mmap)
            except FileNotFoundError as exc:
                if isinstance(exc, WeightStoreError):
                    raise
                raise StoreNotFoundError("no such file", path=target.text) from None
            return Store(reader, reader.name, verify, getattr(reader, "format", fmt.name))
    return None


def _open_file(place: Place, fmt: Format | None, verify: bool, mmap: bool, *, is_file: bool = False,
               asked: bool = False) -> Store:
    """A file of format ``fmt`` (asked for, or its suffix's), else of its first bytes' (sniffed
    from the first request of a URL: an npz's index lies at the end, so that costs one more).
    ``is_file``: a regular file was found there already (so it is no folder); ``asked``: ``fmt``
    is the one ``format=`` asked for."""
    location = place.text
    if not place.remote and not is_file and os.path.isdir(location):
        raise StoreNotFoundError("is a folder, not a weight file", path=location)
    source = place.source()
    try:
        sniffed = _head(source, location) if fmt is None else None
        if sniffed is not None:
            with naming(path=location):
                fmt = _sniffed(sniffed, location)

        def head() -> bytes:
            """The first bytes, for the pickle and misnamed checks of a file its reader refused:
            read only then (a local file opens once more, a URL one more request; one whose read
            fails, or whose reader closed it, leaves the reader's refusal as it was)."""
            if sniffed is not None:
                return sniffed
            if not place.remote:
                return _head(source, location)
            with contextlib.suppress(WeightStoreError, OSError):
                return _head(source, location)
            return b""

        assert fmt is not None
        if isinstance(source, RemoteFile) and fmt.remote_file_object:  # h5py's reads, through an fsspec file
            source.close()
            with service(location):
                handle = place.open_file()
            try:
                with _pickle_named(head, location, fmt, asked):
                    return Store(fmt.open_reader(handle, location), location, verify, fmt.name)
            except BaseException:
                handle.close()
                raise
        with _pickle_named(head, location, fmt, asked):
            return Store(fmt.open_reader(source, location, mmap=mmap), location, verify, fmt.name)
    except BaseException:
        if isinstance(source, RemoteFile):
            source.close()
        raise


def _sniffed(head: bytes, location: str) -> Format:
    """The format whose magic ``head`` matches, for a name whose suffix says nothing; a pickle
    no format's magic matches is refused as one (:func:`refuse_pickle`), a versioned folder's
    ``LATEST`` as the pointer it is (:func:`refuse_pointer`)."""
    try:
        return sniff(head)
    except WeightStoreError:
        refuse_pickle(head)
        refuse_pointer(head, location)
        raise


class _pickle_named(AbstractContextManager):  # noqa: N801 - used as the function it was
    """Format detection never overrides a file's own valid structure: the reader of the format the
    name (or the magic) chose reads the file first, and only a file it refuses is refused as a
    pickle where its first bytes start one, which says more than the reader's refusal. (A valid
    safetensors file whose header is 640, 896, 1,152 or 1,408 bytes long starts with pickle's
    magic: its length's first two bytes are ``80 02`` to ``80 05``.) A file whose first bytes
    are another format's is refused as misnamed (:func:`~weightstore.formats.refuse_misnamed`),
    the same way. A plain class: every open enters one, and a generator's context costs four
    times as much."""

    __slots__ = ("_asked", "_format", "_head", "_location")

    def __init__(self, head: Callable[[], bytes], location: str, fmt: Format, asked: bool):
        self._head, self._location, self._format, self._asked = head, location, fmt, asked

    def __exit__(self, kind: object, exc: BaseException | None, traceback: object) -> None:
        if isinstance(exc, WeightStoreError) and not isinstance(exc, StorageError):  # the bytes, not the storage
            with naming(path=self._location):
                head = self._head()
                refuse_pickle(head)
                refuse_misnamed(head, self._format, asked=self._asked)


def _refuse_published_folder(place: Place) -> None:
    """A folder of ``ws.publish`` versions on object storage is refused as a local one is
    (:func:`~weightstore.formats.tf_checkpoint.resolve_prefix`): naming the version its ``LATEST``
    names, rather than "no format reads it". Asked only once the folder is known to be no
    model, so opening a file costs no request more."""
    pointer = place.child(LATEST)
    if not pointer.is_file():
        return
    source = pointer.source()
    assert isinstance(source, RemoteFile)
    try:
        data = bytes(source.read_at(0, min(source.size, MAX_POINTER_BYTES + 1)))
    finally:
        source.close()
    latest = latest_name(data)
    if latest is not None and not place.child(latest).is_file():
        latest = None  # removed since it was published: suggested, it would send the user to "no such file"
    raise StoreNotFoundError(published_folder_message(place.text, latest), path=place.text)


def _head(source: str | RemoteFile, location: str) -> bytes:
    """The first :data:`HEAD_BYTES` of the file, for the pickle check and a sniff."""
    if isinstance(source, RemoteFile):
        return bytes(source.read_at(0, min(HEAD_BYTES, source.size)))
    with open_regular(source) as handle:
        try:
            return handle.read(HEAD_BYTES)
        except OSError as exc:
            raise unreadable(exc, location) from None


@checks_words("ws.load")
def load(
    path: Any,
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    scope: str | None = None,
    mapping: MappingRules = None,
    verify: bool = True,
    max_bytes: int | None = None,
    mmap: bool = True,
    names: str | None = None,
    regions: Mapping[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Read a weight file into a dict, reading only the selected tensors' bytes.

    Args:
        path: a store, TF checkpoint (prefix, file or folder), Keras file, plain npz/HDF5/
            safetensors file (local or URL), or a :class:`~weightstore.sync.Version`.
        scope: keep only keys under it, made relative to it.
        mapping: ``FROM=TO`` rules (a dict or list of strings) applied after ``scope``.
        include, exclude: patterns (scopes or globs) on the resulting keys.
        verify: check each tensor's checksum as it is read.
        max_bytes: refuse, before reading, a selection larger than this.
        mmap: ``False`` for arrays that own their memory (see :func:`open`).
        names: how a foreign file's names become keys (see :func:`open`).
        regions: key (as the file names it) -> tuple of slices: only that part of the tensor
            is read (see :meth:`Store.read_region`; a sharded version fetches only its blocks).

    Returns:
        A new dict of key -> array, in the file's order. Uncompressed local npz and
        safetensors tensors are read-only views of the mapped file (see docs/formats.md).

    Raises:
        StoreNotFoundError: no such file. SelectionError: the selection keeps nothing.
        FormatError, ChecksumError, UnsafeFileError: a damaged or hostile file, naming the key.
        SizeLimitError: the selection exceeds ``max_bytes``.

    Example:
        >>> head = ws.load("model.npz", scope="head", exclude="*/Adam*")
    """
    with open(path, verify=verify, mmap=mmap, names=names) as store:
        with naming(path=store.path):
            plan = plan_outward(store.keys(), scope=scope, mapping=mapping, include=include, exclude=exclude)
        if regions:
            for key in regions:
                if key not in store:
                    raise KeyNotInStoreError("no such tensor to read a region of", path=store.path, key=key)
            whole = [key for key in plan.values() if key not in regions]
            check_budget(store, whole, max_bytes)
            read = dict(zip(whole, store._read_many(whole), strict=True))
            return {name: read[key] if key in read else store.read_region(key, regions[key])
                    for name, key in plan.items()}
        check_budget(store, plan.values(), max_bytes)
        return dict(zip(plan, store._read_many(list(plan.values())), strict=True))
