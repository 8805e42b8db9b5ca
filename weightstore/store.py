"""``save``, ``load`` and ``open`` over local paths and fsspec URLs, with atomic replace.

How a save becomes visible (rename beside the target locally, one upload to a URL), and which
targets it refuses to replace, is :mod:`weightstore.io`'s business; this module checks the
input, picks the format and streams tensors into the file the commit protocol hands it.
"""

from __future__ import annotations

import builtins
import copy
import functools
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

import numpy as np

from weightstore import __version__, parallel
from weightstore.arrays import as_numpy, declared_dtype
from weightstore.errors import (
    FormatError,
    InvalidKeyError,
    KeyNotInStoreError,
    SizeLimitError,
    StoreExistsError,
    StoreNotFoundError,
    TargetError,
    UnsupportedDTypeError,
    WeightStoreError,
    attach,
    naming,
)
from weightstore.formats import (
    Format,
    Reader,
    RegionReader,
    format_for_suffix,
    format_named,
    hf_sharded,
    known_suffixes,
    sniff,
)
from weightstore.formats.foreign import HEAD_BYTES, open_foreign, refuse_pickle
from weightstore.formats.renamed import RenamedReader, names_by_key
from weightstore.gcpause import paused_gc
from weightstore.io.commit import commit_for
from weightstore.io.files import open_regular
from weightstore.io.location import filesystem, is_url, location_of, service, uncached
from weightstore.io.remote import RemoteFile
from weightstore.io.writeback import Writeback
from weightstore.keys import MappingRules, Patterns, plan_outward, validate_keys
from weightstore.manifest import (
    TensorInfo,
    build_manifest,
    content_digest,
    dtype_name,
    logical_dtype,
    to_storage,
    utc_now,
)
from weightstore.names import (
    FILE,
    KEYS,
    READ_NAMINGS,
    TORCH,
    TORCH_FORMATS,
    WRITE_NAMINGS,
    check_naming,
    key_of_torch_name,
    reads_as_torch,
    torch_name_of_key,
)

_S = TypeVar("_S", bound="Store")
#: tensors of at least this many bytes are hashed beside their write (see :func:`write_file`)
_HASH_BESIDE = 1 << 20


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
        self._key_set = frozenset(self._keys)
        self.path = path
        self.verify = verify
        #: the registered format's name (``"safetensors"``); empty for TF checkpoints and Keras archives
        self.format = format

    @property
    def metadata(self) -> dict[str, Any]:
        """What the writer passed as ``metadata`` (``{}`` for a file without a manifest)."""
        return self._reader.metadata

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

        A sharded version hashes the BLAKE3 digests its index holds for the blocks that hold the
        region, so a follower skips a part of a tensor whose blocks did not change; any other
        store gives the whole tensor's digest (a region is unchanged when its tensor is).
        """
        if not self.reads_regions:
            return self.info(key).digest
        try:
            return cast(RegionReader, self._reader).region_digest(key, region)
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
        names: how a foreign file's tensor names become keys (:mod:`weightstore.names`).
            ``None``: as the file says: a safetensors file written by PyTorch or Hugging Face
            (names with ``.``, none with ``/``) reads ``features.0.weight`` as
            ``features/0/weight``; other names are keys as written. ``"torch"``: read every
            name as PyTorch's (an ``np.savez`` of a ``state_dict``); ``"file"``: as written.

    Returns:
        A :class:`Store`: a read-only mapping of key -> array; use it as a context manager.

    Raises:
        StoreNotFoundError: no such file. FormatError, UnsafeFileError: a damaged or hostile index.

    Example:
        >>> with ws.open("model.npz") as store:
        ...     kernel = store["dense/kernel"] if "dense/kernel" in store else None
    """
    if isinstance(path, OpensItself):  # a Version: its pinned file, or a clear "version gone" if pruned
        return path._weightstore_open(verify=verify)
    with paused_gc():  # an index of 50,000 tensors is some 300,000 containers (weightstore.gcpause)
        store = _open(path, verify=verify, format=format, mmap=mmap)
    return _named(store, check_naming(names, READ_NAMINGS))


def _named(store: Store, names: str | None) -> Store:
    """``store`` with its keys formed from its file's names as ``names`` says (see :func:`open`)."""
    if names == FILE or names is None and not _torch_named(store):
        return store
    reader = store._reader
    try:
        renamed = RenamedReader(reader, names_by_key(reader, key_of_torch_name))
    except BaseException:
        store.close()
        raise
    return Store(renamed, store.path, store.verify, store.format)


def _torch_named(store: Store) -> bool:
    """Whether what wrote the file named its tensors PyTorch's way: a safetensors file without
    a manifest, or a sharded folder (weightstore names shards so too), whose names read so."""
    written_by_torch = not store.has_checksums or store.format == hf_sharded.FORMAT_NAME
    return store.format in TORCH_FORMATS and written_by_torch and reads_as_torch(store.keys())


def _open(path: Any, *, verify: bool, format: str | None, mmap: bool) -> Store:  # noqa: A002
    where = location_of(path)
    location = where.text
    if where.remote:
        return _open_remote(location, verify, format)
    if format is None:  # TF checkpoints (prefix, file or folder) and .keras archives
        foreign = open_foreign(location, mmap=mmap)
        if foreign is not None:
            return Store(foreign, foreign.name, verify, getattr(foreign, "format", ""))
    if os.path.isdir(location):
        raise StoreNotFoundError("is a folder, not a weight file", path=location)
    try:
        with open_regular(location) as handle:
            head = handle.read(HEAD_BYTES)
    except FileNotFoundError:
        raise StoreNotFoundError("no such file", path=location) from None
    with naming(path=location):
        refuse_pickle(head)
    with naming(path=location):
        fmt = format_named(format) if format else format_for_suffix(location)
        if fmt is None:
            fmt = sniff(head)
    return Store(fmt.open_reader(location, location, mmap=mmap), location, verify, fmt.name)


def _open_remote(location: str, verify: bool, format: str | None) -> Store:  # noqa: A002
    """A URL: ranged GETs of what is read (npz, safetensors), so opening costs one request for
    an index of up to a few hundred tensors; HDF5 goes through an fsspec file object for h5py."""
    fs, remote = filesystem(location)
    if format is None and location.endswith(hf_sharded.INDEX_SUFFIX):
        return _open_remote_sharded(fs, remote, location, verify)
    source = RemoteFile(fs, remote, location)
    try:
        fmt = format_named(format) if format else format_for_suffix(location)
        if fmt is None:  # only then: an npz's index lies at the end, and its first request fetches it
            head = bytes(source.read_at(0, min(HEAD_BYTES, source.size)))
            with naming(path=location):
                refuse_pickle(head)
                fmt = sniff(head)
        if fmt.remote_file_object:
            source.close()
            with service(location):
                handle = fs.open(uncached(fs, remote), "rb")
            try:
                return Store(fmt.open_reader(handle, location), location, verify, fmt.name)
            except BaseException:
                handle.close()
                raise
        return Store(fmt.open_reader(source, location), location, verify, fmt.name)
    except FileNotFoundError:
        # a folder is asked about only now, so opening a file of an unknown suffix stays one request
        if format is None and format_for_suffix(location) is None:
            with service(location):
                folder = fs.isdir(remote)
            if folder:
                return _open_remote_sharded(fs, remote, location, verify)
        raise StoreNotFoundError("no such file", path=location) from None
    except BaseException:
        source.close()
        raise


def _open_remote_sharded(fs: Any, remote: str, location: str, verify: bool) -> Store:
    """A Hugging Face sharded model on object storage: its index file, or a folder holding one."""
    with service(location):
        index = hf_sharded.index_location(remote, is_dir=lambda _: True, exists=fs.exists)
    if index is None:
        raise StoreNotFoundError("is a folder holding no model.safetensors.index.json", path=location)
    url = location if location.endswith(hf_sharded.INDEX_SUFFIX) else location.rstrip("/") + "/" + hf_sharded.INDEX_NAME
    return Store(hf_sharded.open_remote(fs, index, url), url, verify, hf_sharded.FORMAT_NAME)


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
            safetensors file (local or URL), or a :class:`~weightstore.versions.Version`.
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
        safetensors tensors are read-only views of the mapped file (see the README).

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


def save(
    path: Any,
    weights: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    compress: bool | str = False,
    overwrite: bool = True,
    format: str | None = None,
    names: str | None = None,
    max_shard_size: int | str | None = None,
) -> None:
    """Write ``weights`` atomically; the suffix (or ``format``) picks npz, HDF5 or safetensors.

    Every key and dtype, and the metadata, are checked before the first byte is written, so
    a bad input changes nothing on disk. Tensors are then converted to their stored form (and,
    from a :class:`Store`, read) one at a time as they are written, so copying a store holds
    about one tensor in memory.

    Args:
        path: a local path or fsspec URL; its suffix (``.npz``, ``.h5``/``.hdf5``,
            ``.safetensors``) picks the format unless ``format`` is given.
        weights: key -> array (anything ``np.asarray`` takes), or an open :class:`Store`.
        metadata: JSON-serializable, stored in the manifest and returned as ``store.metadata``.
        compress: ``True``: deflate (npz) or gzip (HDF5) the tensors; plain numpy and h5py read
            such files. ``"shuffle"``: byte shuffle, then zstd (npz) or gzip (HDF5). On trained
            weights npz shrinks 1.18x (float32) / 1.45x (bfloat16) against deflate's 1.08x / 1.29x
            and loads 3x faster, but ``np.load`` cannot decode those members; HDF5 reaches
            1.13x / 1.30x and h5py still reads it. safetensors files are never compressed.
        overwrite: with ``False``, an existing file is an error.
        format: ``"npz"``, ``"hdf5"`` or ``"safetensors"``, whatever the suffix says.
        names: ``"torch"`` names each tensor in the file as PyTorch does (key
            ``features/0/weight`` is ``features.0.weight``), so ``safetensors.torch.load_file``
            (or ``np.load``) gives a ``state_dict`` that ``load_state_dict`` takes as is. A
            safetensors file remembers the keys, so weightstore reads them back; in npz and
            HDF5 the torch names are the keys. A key with ``.`` inside a segment is refused.
            ``None`` or ``"keys"``: tensors are named by their keys.
        max_shard_size: write a Hugging Face sharded folder at ``path`` (a folder, or its
            ``model.safetensors.index.json``) instead: ``model-0000N-of-0000M.safetensors``
            shards of at most this many bytes (or ``"5GB"``, ``"500MiB"``; a larger tensor gets
            a shard of its own) and the index, written last. Tensors are named PyTorch's way
            unless ``names="keys"``, so ``transformers`` and ``safetensors`` load the folder.

    Raises:
        InvalidKeyError, UnsupportedDTypeError: a key or dtype that cannot be stored (nothing written).
        TargetError: a suffix that names no format, or a target that is a folder, FIFO or device.
        StoreExistsError: ``overwrite=False`` and the file exists.
        StoreNotFoundError: the folder does not exist.

    Example:
        >>> ws.save("model.npz", {"dense/kernel": np.zeros((3, 4))}, metadata={"step": 10})
    """
    where = location_of(path)
    location = where.text
    if max_shard_size is not None:
        if format not in (None, "safetensors") or compress:
            raise TargetError("a sharded folder holds uncompressed safetensors shards", path=location)
        _save_sharded(location, weights, metadata, max_shard_size, names, overwrite)
        return
    fmt = output_format(location, format)
    if not isinstance(compress, (bool, np.bool_)) and not (isinstance(compress, str) and compress == "shuffle"):
        raise TargetError(f"compress={compress!r}; use False, True or \"shuffle\"", path=location)
    if compress and not fmt.compresses:
        raise FormatError(f"{fmt.name} files are never compressed; save without compress", path=location)
    metadata = checked_metadata(metadata, location)
    arrays = _checked(weights, location, fmt)
    naming_rule = check_naming(names, WRITE_NAMINGS)
    with naming(path=location):
        stored_names = file_names(arrays, naming_rule)
    commit = commit_for(where, suffix=fmt.suffixes[0])
    if not overwrite and commit.exists():
        raise StoreExistsError("file exists (pass overwrite=True to replace it)", path=location)
    with commit.writing() as local:
        write_file(local, fmt, arrays, metadata, compress, stored_names)


def _save_sharded(location: str, weights: Mapping[str, Any], metadata: Mapping[str, Any] | None,
                  max_shard_size: int | str, names: str | None, overwrite: bool) -> None:
    """A Hugging Face sharded folder (see :func:`save`): every key, dtype and name checked first;
    each shard written atomically, then the index, which is what readers go by."""
    from weightstore.formats import safetensors

    index = location if location.endswith(hf_sharded.INDEX_SUFFIX) else location.rstrip("/") + "/" + hf_sharded.INDEX_NAME
    folder = index.rpartition("/")[0] or "."
    with naming(path=location):
        limit = hf_sharded.parse_size(max_shard_size)
    metadata = checked_metadata(metadata, location)
    if "total_size" in metadata:
        raise TargetError("metadata 'total_size' is the index's own (the shards' bytes); rename it", path=location)
    arrays = _checked(weights, location, safetensors.FORMAT)
    naming_rule = check_naming(names, WRITE_NAMINGS) or TORCH
    with naming(path=location):
        stored_names = file_names(arrays, naming_rule)
    index_commit = commit_for(location_of(index), suffix=".json")
    if not overwrite and index_commit.exists():
        raise StoreExistsError("sharded folder exists (pass overwrite=True to replace it)", path=index)
    if not is_url(folder):
        os.makedirs(folder, exist_ok=True)
    sizes = {key: arrays.nbytes(key) for key in arrays}
    plan = hf_sharded.plan_shards(sizes, limit)
    shards = dict(zip(hf_sharded.shard_names(len(plan)), plan, strict=True))
    created = utc_now()  # one time for the index and its shards, as for a version and its file
    for shard, keys in shards.items():
        with commit_for(location_of(f"{folder}/{shard}"), suffix=".safetensors").writing() as local:
            write_file(local, safetensors.FORMAT, arrays.only(keys), metadata, False,
                       {key: stored_names[key] for key in keys if key in stored_names}, created)
    document = hf_sharded.index_document({shard: [stored_names.get(k, k) for k in keys] for shard, keys in shards.items()},
                                         sum(sizes.values()), metadata,
                                         {"producer": f"weightstore {__version__}", "created": created})
    with index_commit.writing() as local, builtins.open(local, "wb") as handle:
        handle.write(document)


def file_names(keys: Iterable[str], names: str | None) -> dict[str, str]:
    """Key -> the tensor's name in the file, where ``names`` makes it differ from the key.

    Checked before anything is written: a key no torch name reads back as is refused (naming
    the key; the caller names the file).
    """
    if names in (None, KEYS):
        return {}
    return {key: torch_name_of_key(key) for key in keys}


def output_format(location: str, format: str | None = None) -> Format:  # noqa: A002
    """The format a save writes: ``format`` if given, else the suffix's; any other suffix is refused.

    Refused before anything is written: a silent npz under ``model.safetensors`` or ``m.xyz``
    would be a file that its own name misdescribes to every other tool.
    """
    if format:
        with naming(path=location):
            return format_named(format)
    fmt = format_for_suffix(location)
    if fmt is None:
        raise TargetError(f"cannot tell which format to write from the file name; name it with one of "
                          f"{', '.join(known_suffixes())} (or, from Python, pass format= to write any name)",
                          path=location)
    return fmt


def checked_metadata(metadata: Mapping[str, Any] | None, where: str = "") -> dict[str, Any]:
    """``metadata`` as a dict, refused with a ``TypeError`` naming ``where`` unless it is JSON."""
    prefix = f"{where}: " if where else ""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"{prefix}metadata must be a mapping, not {type(metadata).__name__}")
    try:
        json.dumps(dict(metadata), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise TypeError(f"{prefix}metadata must be JSON-serializable: {exc}") from None
    return dict(metadata)


class _Checked(Mapping):
    """Key -> ``(logical dtype name, array in storage form)``, produced when asked for.

    Keys and dtypes are checked when this is built, without reading any tensor of a
    :class:`Store` (its index has them) and without converting any array that states its
    dtype (``ndarray``, TF tensors); the conversion (a copy for big-endian or non-contiguous
    input) and the read of a stored tensor happen per tensor in :func:`write_file`, so only
    one is held at a time.
    """

    def __init__(self, weights: Mapping[str, Any], where: str, fmt: Format | None = None):
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must be a mapping of key to array, not {type(weights).__name__}")
        self._weights = weights
        self._where = where
        self._values: dict[str, Any] = {}  # None: read from ``weights`` when written
        store = weights if isinstance(weights, Store) else None
        with naming(path=where):  # once around the loop: 50,000 small tensors
            keys = validate_keys(weights)
            if store is not None:
                names = [store.info(key).dtype for key in keys]
                values: list[Any] = [None] * len(keys)
            else:
                values = [weights[key] for key in keys]
                dtypes = [value.dtype if type(value) is np.ndarray else None for value in values]
                for i in [i for i, dtype in enumerate(dtypes) if dtype is None]:
                    dtypes[i] = declared_dtype(values[i])
                    if dtypes[i] is None:
                        values[i] = as_numpy(values[i], keys[i])
                        dtypes[i] = values[i].dtype
                names = self._names_of(keys, dtypes)
            for name in dict.fromkeys(names):  # a file holds a handful of dtypes: each checked once, in order
                self._check_dtype(name, keys[names.index(name)], fmt, stored=store is not None)
            self._values = dict(zip(keys, values, strict=True))
            self._dtype_names = dict(zip(keys, names, strict=True))
        if fmt is not None:
            self._refuse_reserved(fmt)

    def _refuse_reserved(self, fmt: Format) -> None:
        """A key the format keeps for itself would make a file no reader opens (not even ours)."""
        for key in sorted(fmt.reserved_keys & self._values.keys()):
            raise InvalidKeyError(f"{fmt.name} keeps this name for itself (no reader could open the file); "
                                  "rename the tensor or save as .npz or .h5", path=self._where or None, key=key)

    @staticmethod
    def _names_of(keys: list[str], dtypes: list[Any]) -> list[str]:
        """Each dtype's logical name, worked out once per distinct dtype."""
        name_of = {dtype: dtype_name(dtype, keys[dtypes.index(dtype)]) for dtype in dict.fromkeys(dtypes)}
        return [name_of[dtype] for dtype in dtypes]

    @staticmethod
    def _check_dtype(name: str, key: str, fmt: Format | None, *, stored: bool) -> None:
        """That ``fmt`` can hold ``name`` (``key`` is the first tensor of that dtype), and, for a
        store's tensor, that the name it gives is one weightstore writes."""
        if stored:
            try:
                logical_dtype(name)
            except WeightStoreError:
                raise UnsupportedDTypeError(
                    f"has dtype {name}: only numeric, bool and ml_dtypes arrays are weights", key=key
                ) from None
        if fmt is not None and fmt.dtypes is not None and name not in fmt.dtypes:
            raise UnsupportedDTypeError(f"has dtype {name}, which {fmt.name} cannot hold; save it as .npz or .h5",
                                        key=key)

    def nbytes(self, key: str) -> int:
        """The bytes ``key`` will take in the file, from its index or shape; nothing is read."""
        value = self._values[key]
        if value is None:  # a store's tensor, read when written
            assert isinstance(self._weights, Store)
            return self._weights.info(key).nbytes
        shape = value.shape if hasattr(value, "shape") else np.shape(value)
        return math.prod(int(d) for d in shape) * logical_dtype(self._dtype_names[key]).itemsize

    def only(self, keys: Iterable[str]) -> _Checked:
        """These checked tensors, in this order (one shard of a sharded save)."""
        part = copy.copy(self)
        part._values = {key: self._values[key] for key in keys}
        return part

    def __getitem__(self, key: str) -> tuple[str, np.ndarray]:
        return self._stored_form(key, self._values[key])

    def stored(self) -> Iterator[tuple[str, str, np.ndarray]]:
        """``(key, logical dtype name, array in storage form)`` in order, each converted (or read
        from a store) only when the one before it has been written."""
        for key, value in self._values.items():
            yield (key, *self._stored_form(key, value))

    def _stored_form(self, key: str, value: Any) -> tuple[str, np.ndarray]:
        if value is None:
            value = self._weights[key]
        try:  # not naming(): a context manager per tensor costs more than a small tensor's write
            return to_storage(as_numpy(value, key), key)
        except WeightStoreError as exc:  # a value whose dtype changed since it was checked, a meta tensor
            raise attach(exc, path=self._where, key=key) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def _checked(weights: Mapping[str, Any], where: str = "", fmt: Format | None = None) -> _Checked:
    """Every key and dtype (against ``fmt``'s, when given) checked before anything is
    written; errors name ``where`` (the file).

    The tensors themselves are read and converted lazily, one at a time, as they are written.
    """
    return _Checked(weights, where, fmt)


def write_file(path: str, fmt: Format, arrays: _Checked, metadata: Mapping[str, Any] | None,
               compress: bool | str, stored_names: Mapping[str, str] | None = None, created: str | None = None) -> None:
    """Write a file tensor by tensor; the caller makes it atomic and durable.

    ``stored_names`` (from :func:`file_names`) names tensors in the file other than by their
    keys: where the format can (:attr:`Format.torch_names`), the manifest records each such
    name as the tensor's location, so the keys read back; elsewhere the name is the key.
    ``created``: the time of the version the file is (its manifest records it), else now.
    """
    metadata = checked_metadata(metadata, path)  # before the file exists (callers check earlier, naming theirs)
    stored_names = stored_names or {}
    located = stored_names if fmt.torch_names else {}
    writer = fmt.open_writer(path, compress)
    mark_torch_names = getattr(writer, "mark_torch_names", None)
    if stored_names and mark_torch_names is not None:
        mark_torch_names()
    writeback = Writeback(path)  # the disk starts on what is written while the rest is (see its module)
    try:
        tensors, digests = [], []
        for key, name, data in arrays.stored():  # read/converted now: one tensor in memory at a time
            # a large tensor is hashed on the helper thread while the writer writes it (both release
            # the GIL); a small one after, still in cache, as a hand-off costs more than its hash
            hashing = parallel.beside(functools.partial(content_digest, data)) if data.nbytes >= _HASH_BESIDE else None
            stored = stored_names.get(key, key)
            tensors.append((key if located else stored, name, data.shape, writer.add(stored, name, data)))
            digests.append(content_digest(data) if hashing is None else hashing.result())
            writeback.advance(data.nbytes)
            del data
        locations = {**writer.locations, **located}
        writer.commit(build_manifest(tensors, metadata, f"weightstore {__version__}", locations, writer.codecs,
                                     digests, created))
    except BaseException:
        writer.abort()
        raise
    finally:
        writeback.close()
