"""``save``: a weight dictionary checked whole, then written tensor by tensor into the file a
commit protocol hands it, to a local path, a URL or a Hugging Face sharded folder.

How a save becomes visible (rename beside the target locally, one upload to a URL), and which
targets it refuses to replace, is :mod:`weightstore.io`'s business; this module checks the
input, picks the format and streams tensors into the file.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import functools
import json
import math
import operator
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from weightstore._version import __version__
from weightstore.core import _parallel as parallel
from weightstore.core._arrays import as_numpy, declared_dtype
from weightstore.core._jsontext import too_deep
from weightstore.core._tensortable import TensorInfo
from weightstore.core._words import checks_words
from weightstore.core.keys import validate_keys
from weightstore.core.limits import MAX_HF_INDEX_BYTES, MAX_JSON_DEPTH
from weightstore.core.manifest import build_manifest, content_digest, dtype_name, logical_dtype, to_storage, utc_now
from weightstore.core.names import (
    KEYS,
    NAMES_METADATA,
    TORCH,
    WRITE_NAMINGS,
    check_naming,
    is_state_dict,
    keys_of_torch_names,
    torch_name_of_key,
)
from weightstore.errors import (
    FormatError,
    InvalidKeyError,
    StoreExistsError,
    TargetError,
    UnsupportedDTypeError,
    WeightStoreError,
    attach,
    naming,
)
from weightstore.formats import Format, format_for_suffix, format_named, hf_sharded, known_suffixes
from weightstore.formats._foreign import HF_SINGLE_FILE
from weightstore.io._writeback import Writeback
from weightstore.io.commit import commit_for
from weightstore.io.folders import Folder, folder_for
from weightstore.io.location import is_url, location_of
from weightstore.store._open import Store

#: tensors of at least this many bytes are hashed beside their write (see :func:`write_file`)
_HASH_BESIDE = 1 << 20


@checks_words("ws.save")
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
    digests: bool = False,
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
            gives a ``state_dict`` that ``load_state_dict`` takes as is (``np.load`` gives its
            names as numpy arrays, beside the npz's ``__weightstore__`` manifest member). A
            safetensors file remembers the keys, so weightstore reads them back; in npz and
            HDF5 the manifest's metadata says so (``"weightstore-names": "torch"``, an entry
            of weightstore's own, refused in ``metadata``) and the names are read as keys again. A key with ``.`` inside a segment is refused.
            ``None`` or ``"keys"``: tensors are named by their keys; ``None`` with a PyTorch
            ``state_dict`` itself (torch tensors under ``features.0.weight`` names): as
            ``"torch"`` with the names read as keys, so the file is read by the keys
            ``torch.export`` gives (``features/0/weight``) and ``load_state_dict`` still takes it;
            ``"keys"`` with a ``state_dict`` keeps its names as the keys (``features.0.weight``).
        max_shard_size: write a Hugging Face sharded folder at ``path`` (a folder, or its
            ``model.safetensors.index.json``) instead: ``model-0000N-of-0000M.safetensors``
            shards of at most this many bytes (or ``"5GB"``, ``"500MiB"``; a larger tensor gets
            a shard of its own) and the index, written last (a save that fails or is
            interrupted before the index is in place removes the shards it wrote; a reader
            refuses a shard of another save beside the index, never mixing two models). Tensors are named PyTorch's way
            unless ``names="keys"``, so ``transformers`` and ``safetensors`` load the folder.
            Shards of an earlier save the new index does not name are removed after it, and so
            is a ``model.safetensors`` beside ``model.safetensors.index.json``, which
            ``from_pretrained`` (and ``ws.load``) would read instead.
        digests: also record each tensor's BLAKE3 content digest, so that ``skip_unchanged=True``
            (assigning this file again after it was rewritten) and ``ws diff`` tell unchanged
            tensors without reading them. It costs a second pass over every byte (about 0.24
            CPU-s/GB, next to 0.3 for the durable write itself), so a plain save leaves it out;
            versions (:func:`~weightstore.publish`) always record it. Every read verifies the
            CRC-32 recorded either way.

    Raises:
        InvalidKeyError, UnsupportedDTypeError: a key or dtype that cannot be stored (nothing written).
        TargetError: a suffix that names no format, or a target that is a folder, FIFO or device.
        StoreExistsError: ``overwrite=False`` and the file exists.
        StoreNotFoundError: the folder does not exist.

    Example:
        >>> ws.save("model.npz", {"dense/kernel": np.zeros((3, 4))}, metadata={"step": 10})
    """
    where = location_of(path, reading=False)
    location = where.text
    if names is None and is_state_dict(weights):
        with naming(path=location):
            weights = dict(zip(keys_of_torch_names(list(weights)), weights.values(), strict=True))
        names = TORCH
    if max_shard_size is not None:
        if format not in (None, "safetensors") or compress:
            raise TargetError("a sharded folder holds uncompressed safetensors shards", path=location)
        if (not location.endswith((hf_sharded.INDEX_SUFFIX, "/")) and format_for_suffix(location) is not None
                and not os.path.isdir(location)):  # a folder so named already, or named so with its '/', is a folder
            raise TargetError("max_shard_size writes a folder of safetensors shards and its index, and this name "
                              "is a file's; name the folder (model/) or its index (model.safetensors.index.json)",
                              path=location)
        _save_sharded(location, weights, metadata, max_shard_size, names, overwrite, digests)
        return
    fmt = output_format(location, format)
    if not isinstance(compress, (bool, np.bool_)) and not (isinstance(compress, str) and compress == "shuffle"):
        raise TargetError(f"compress={compress!r}; use False, True or \"shuffle\"", path=location)
    if compress and not fmt.compresses:
        raise FormatError(f"{fmt.name} files are never compressed; save without compress", path=location)
    metadata = checked_metadata(metadata, location)
    arrays = CheckedWeights(weights, location, fmt)
    naming_rule = check_naming(names, WRITE_NAMINGS)
    with naming(path=location):
        stored_names = file_names(arrays, naming_rule)
    commit = commit_for(where, suffix=fmt.suffixes[0])
    if not overwrite and commit.exists():
        raise StoreExistsError("file exists (pass overwrite=True to replace it)", path=location)
    with commit.writing() as local:
        write_file(local, fmt, arrays, metadata, compress, stored_names, digests=digests)


def _save_sharded(location: str, weights: Mapping[str, Any], metadata: Mapping[str, Any] | None,
                  max_shard_size: int | str, names: str | None, overwrite: bool, digests: bool) -> None:
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
    arrays = CheckedWeights(weights, location, safetensors.FORMAT)
    naming_rule = check_naming(names, WRITE_NAMINGS) or TORCH
    with naming(path=location):
        stored_names = file_names(arrays, naming_rule)
    index_commit = commit_for(location_of(index), suffix=".json")
    standard = index.rpartition("/")[2] == hf_sharded.INDEX_NAME  # the index from_pretrained reads
    target = folder_for(folder)
    if not overwrite and (index_commit.exists() or standard and target.tag(HF_SINGLE_FILE) is not None):
        raise StoreExistsError("sharded folder exists (pass overwrite=True to replace it)", path=index)
    made_folder = not is_url(folder) and not os.path.isdir(folder)
    if made_folder:
        os.makedirs(folder, exist_ok=True)
    # an index that records no save time goes as the first shard takes its place, not before: a
    # save failing sooner (disk full, file too large at that shard) leaves the folder as it was
    foreign = not made_folder and overwrite and _without_save_time(target, index.rpartition("/")[2])
    sizes = {key: arrays.info(key).nbytes for key in arrays}
    plan = hf_sharded.plan_shards(sizes, limit)
    shards = dict(zip(hf_sharded.shard_names(len(plan)), plan, strict=True))
    created = utc_now()  # one time for the index and its shards: a reader refuses a shard of another save
    placed: list[str] = []
    try:
        for shard, keys in shards.items():
            with commit_for(location_of(f"{folder}/{shard}"), suffix=".safetensors").writing() as local:
                write_file(local, safetensors.FORMAT, arrays.only(keys), metadata, False,
                           {key: stored_names[key] for key in keys if key in stored_names}, created, digests=digests)
                if foreign:
                    target.remove(index.rpartition("/")[2])
                    foreign = False
            placed.append(shard)
        document = hf_sharded.index_document({shard: [stored_names.get(k, k) for k in keys]
                                              for shard, keys in shards.items()}, sum(sizes.values()), metadata,
                                             {"producer": f"weightstore {__version__}", "created": created})
        with index_commit.writing() as local, builtins.open(local, "wb") as handle:
            handle.write(document)
    except BaseException:  # a failed or interrupted save (disk full, Ctrl-C) leaves no half of a model
        if not index_commit.landed:  # else the index in place names them: the whole model is there
            _remove_placed_shards(target, placed, folder if made_folder else None)
        raise
    _remove_stale_shards(target, set(shards), standard)


def _without_save_time(folder: Folder, name: str) -> bool:
    """Whether ``folder`` holds an index ``name`` that records no save time (``save_pretrained``'s),
    which must go before this save puts its first shard in place (possibly of one it maps): left,
    a save cut short would leave that shard beside it, read with the old ones as one model. Cut
    short after that shard, the save then leaves no model, as an overwrite of weightstore's own
    leaves one every reader refuses; failed before it, the folder keeps its model."""
    text = folder.read_small(name, MAX_HF_INDEX_BYTES)
    return text is not None and not hf_sharded.save_time(text)


def _remove_placed_shards(folder: Folder, placed: list[str], made: str | None) -> None:
    """Undo a sharded save that failed before its index landed: the shards it placed go, and
    the folder it made (``made``) once empty. An earlier save's index left in the folder reads
    none of them: it refuses a shard gone, or one of another save (see ``ShardedReader``)."""
    for shard in placed:
        with contextlib.suppress(OSError, WeightStoreError):  # never hides why the save failed
            folder.remove(shard)
    if made is not None:
        with contextlib.suppress(OSError):
            os.rmdir(made)


def _remove_stale_shards(folder: Folder, kept: set[str], standard: bool) -> None:
    """Shards an earlier save of the folder wrote that the new index does not name, named as
    weightstore names them: left, the folder holds two models' files, whose sizes add up (as
    ``save_pretrained``, this runs once the new index is in place). Beside the ``standard``
    index, a ``model.safetensors`` an earlier unsharded save left goes too (a link to one as
    well): ``from_pretrained`` (and so ``ws.load``) reads it before that index, so the new
    weights would never be read."""
    for entry in folder.files():
        if hf_sharded.OWN_SHARD.fullmatch(entry.name) and entry.name not in kept:
            folder.remove(entry.name)
    if standard:
        folder.remove(HF_SINGLE_FILE)


def file_names(keys: Iterable[str], names: str | None) -> dict[str, str]:
    """Key -> the tensor's name in the file, where ``names`` makes it differ from the key.

    Checked before anything is written: a key no torch name reads back as is refused (naming
    the key; the caller names the file).
    """
    if names in (None, KEYS):
        return {}
    return {key: torch_name_of_key(key) for key in keys}


def _naming_recorded(metadata: Mapping[str, Any] | None, fmt: Format, torch_named: bool) -> Mapping[str, Any] | None:
    """``metadata`` saying that the file's tensor names are PyTorch's where the format keeps no
    key beside a name (npz, HDF5: :data:`~weightstore.core.names.NAMES_METADATA`), so readers read
    them as keys; a caller's metadata never holds the entry (:func:`checked_metadata`)."""
    if not torch_named or fmt.torch_names:
        return metadata
    return {**(metadata or {}), NAMES_METADATA: TORCH}


def output_format(location: str, format: str | None = None) -> Format:  # noqa: A002
    """The format a save writes: ``format`` if given, else the suffix's; any other suffix is refused.

    Refused before anything is written: a silent npz under ``model.safetensors`` or ``m.xyz``
    would be a file that its own name misdescribes to every other tool.
    """
    if format:
        with naming(path=location):
            fmt = format_named(format)
    else:
        found = format_for_suffix(location)
        if found is None:
            # a folder is what a sharded save writes: say so, where the name is a folder's
            folder = location.endswith("/") or os.path.isdir(location)
            raise TargetError(f"cannot tell which format to write from the file name; name it with one of "
                              f"{', '.join(known_suffixes())} (or, from Python, pass format= to write any name)"
                              + ("; a folder of safetensors shards is written with max_shard_size= "
                                 "(ws convert --max-shard-size)" if folder else ""), path=location)
        fmt = found
    if not fmt.writes:  # a format only read (a sharded index, a checkpoint) refuses in its own words what writes it
        fmt.open_writer(location, False)
        raise TargetError(f"{fmt.name} files are not written by ws.save", path=location)
    return fmt


def checked_metadata(metadata: Mapping[str, Any] | None, where: str = "") -> dict[str, Any]:
    """``metadata`` as a dict, refused with a ``TypeError`` naming ``where`` unless it is JSON."""
    if metadata is None or type(metadata) is dict and not metadata:  # nothing to check (every plain save)
        return {}
    prefix = f"{where}: " if where else ""
    if not isinstance(metadata, Mapping):
        raise TypeError(f"{prefix}metadata must be a mapping, not {type(metadata).__name__}")
    try:
        json.dumps(dict(metadata), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise TypeError(f"{prefix}metadata must be JSON-serializable: {exc}") from None
    if NAMES_METADATA in metadata:  # kept, it would be dropped on writing, or misread a file's names as PyTorch's
        raise TypeError(f"{prefix}metadata {NAMES_METADATA!r} is weightstore's own word of whether the file's "
                        "tensor names are PyTorch's; name the entry otherwise")
    if too_deep(metadata):
        raise TypeError(f"{prefix}metadata must nest at most {MAX_JSON_DEPTH} levels deep, as readers read it")
    try:
        clash = _colliding_keys(metadata)
    except RecursionError:
        raise TypeError(f"{prefix}metadata must be JSON-serializable: nested too deep") from None
    if clash:  # JSON writes 1 as "1": {1: "a", "1": "b"} would come back as {"1": "b"}
        raise TypeError(f"{prefix}metadata keys {clash[0]!r} and {clash[1]!r} are both {_json_key(clash[1])!r} "
                        "in JSON; one would be lost")
    return dict(metadata)


def _colliding_keys(value: Any) -> tuple[Any, ...]:
    """``(first, second)``: two keys of one mapping in ``value`` (nested in mappings and lists,
    as JSON nests them) that JSON writes alike (``1`` and ``"1"``); ``()`` when there are none.
    Keys that are not strings but unique (an ``id2label`` map's ints) are kept: JSON makes them
    strings, as every JSON writer does."""
    if isinstance(value, Mapping):
        seen: dict[str, Any] = {}
        for key, item in value.items():
            text = key if isinstance(key, str) else _json_key(key)
            if text in seen:
                return seen[text], key
            seen[text] = key
            found = _colliding_keys(item)
            if found:
                return found
    elif isinstance(value, (list, tuple)):
        for item in value:
            found = _colliding_keys(item)
            if found:
                return found
    return ()


def _json_key(key: Any) -> str:
    """The string JSON writes for a mapping key (``1`` -> ``"1"``, ``None`` -> ``"null"``)."""
    return key if isinstance(key, str) else next(iter(json.loads(json.dumps({key: 0}))))


#: x86's 80-bit long double in 16 bytes (elsewhere another format of that name; where it is
#: float64 it is named so)
_LONG_DOUBLES = frozenset({"float96", "float128", "complex192", "complex256"})


def _axes(shape: Any) -> int | None:
    """How many axes a stated shape has; ``None`` where it says none (no shape, or a TF
    variable's of unknown rank, whose ``len`` raises)."""
    try:
        return len(shape)
    except (TypeError, ValueError):
        return None


class CheckedWeights(Mapping):
    """Key -> ``(logical dtype name, array in storage form)``, produced when asked for.

    Every key and dtype (against ``fmt``'s, when given) is checked when this is built, before
    anything is written; errors name ``where`` (the file). Checking reads no tensor of a
    :class:`Store` (its index has them) and converts no array that states its dtype
    (``ndarray``, TF tensors); the conversion (a copy for big-endian or non-contiguous input)
    and the read of a stored tensor happen per tensor in :func:`write_file`, so only one is
    held at a time.
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
                    dtypes[i] = declared_dtype(values[i], keys[i])
                    if dtypes[i] is None:
                        values[i] = as_numpy(values[i], keys[i])
                        dtypes[i] = values[i].dtype
                names = self._names_of(keys, dtypes)
            for name in dict.fromkeys(names):  # a file holds a handful of dtypes: each checked once, in order
                self._check_dtype(name, keys[names.index(name)], fmt, stored=store is not None)
            self._values = dict(zip(keys, values, strict=True))
            self._dtype_names = dict(zip(keys, names, strict=True))
        if fmt is not None:
            self._refuse_unreadable(fmt)
            if fmt.max_ndim is not None:
                self._refuse_too_many_axes(fmt, fmt.max_ndim, store)

    def _refuse_too_many_axes(self, fmt: Format, most: int, store: Store | None) -> None:
        """A tensor of more axes than the format holds, refused before the file is begun (its
        library would fail halfway, naming the temporary file)."""
        for key, value in self._values.items():
            axes = _axes(store.info(key).shape if store is not None else getattr(value, "shape", None))
            if axes is not None and axes > most:  # unknown before converting: the writer's check
                raise UnsupportedDTypeError(f"has {axes} axes; {fmt.name} files hold at most {most}: save it "
                                            "as .npz or .safetensors", path=self._where or None, key=key)

    def _refuse_unreadable(self, fmt: Format) -> None:
        """A key the format keeps for itself, or one nested deeper than its readers go, would
        make a file no reader opens (not even ours)."""
        for key in sorted(fmt.reserved_keys & self._values.keys()):
            raise InvalidKeyError(f"{fmt.name} keeps this name for itself (no reader could open the file); "
                                  "rename the tensor or save as .npz or .h5", path=self._where or None, key=key)
        most = fmt.max_key_segments
        if most is None:
            return
        for key in self._values:
            if key.count("/") >= most:
                raise InvalidKeyError(f"has {key.count('/') + 1} segments; {fmt.name} files are read only "
                                      f"{most} deep: save it as .npz or .safetensors", path=self._where or None,
                                      key=key)

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
        if name in _LONG_DOUBLES:  # read where a file holds them, never written
            raise UnsupportedDTypeError(
                f"has dtype {name}, the platform's long double: its bits differ between machines and its padding "
                "is uninitialised memory; convert it to float64 (complex128) first", key=key)
        if fmt is not None and fmt.dtypes is not None and name not in fmt.dtypes:
            raise UnsupportedDTypeError(f"has dtype {name}, which {fmt.name} cannot hold; save it as .npz or .h5",
                                        key=key)

    def info(self, key: str) -> TensorInfo:
        """``key`` as the file will describe it (dtype, shape, bytes), from its index or shape;
        nothing is read. A value that states no full shape (a wrapper with only a dtype, a TF
        variable of unknown dimensions) is converted to learn it, and that array is the one
        written (a sharded save must know every size before it writes)."""
        value = self._values[key]
        if value is None:  # a store's tensor, read when written
            assert isinstance(self._weights, Store)
            return self._weights.info(key)
        shape = _stated_shape(value)
        if shape is None:
            try:
                value = self._values[key] = as_numpy(value, key)
            except WeightStoreError as exc:
                raise attach(exc, path=self._where, key=key) from None
            shape = value.shape
        name = self._dtype_names[key]
        return TensorInfo(key, name, shape, math.prod(shape) * logical_dtype(name).itemsize)

    def planned(self, stored_names: Mapping[str, str]) -> list[TensorInfo]:
        """Every tensor as :meth:`info` describes it, in order, named as stored, for a writer
        that lays the file out before the data comes; none (``[]``: no plan) if any value would
        have to be converted to say its shape, since that would hold every such value at once
        (a background publisher's snapshot is let go tensor by tensor as it is written).
        50,000 small arrays take 0.05 s."""
        names, planned = self._dtype_names, []
        for key, value in self._values.items():
            if type(value) is np.ndarray:
                planned.append(TensorInfo(stored_names.get(key, key), names[key], value.shape, value.nbytes))
                continue
            shape = None if value is None else _stated_shape(value)
            if value is not None and shape is None:
                return []
            planned.append(self.info(key)._replace(key=stored_names.get(key, key)))
        return planned

    def known_bytes(self) -> int:
        """About the bytes these tensors' stored forms hold, from what each states without being
        converted or read (an array's ``nbytes``, a store's index): what an uncompressed file of
        them holds at least, unless a value misstates it (what
        :class:`~weightstore.io._writeback.Writeback` reserves, and gives back if the file comes
        out shorter; asked only where it reserves). A value that states nothing (a TF tensor) counts
        nothing."""
        total = 0
        for key, value in self._values.items():
            if type(value) is np.ndarray:
                total += value.nbytes
            elif value is None:  # a store's tensor
                assert isinstance(self._weights, Store)
                total += self._weights.info(key).nbytes
            else:  # a torch or JAX array states it; a value whose nbytes fails is left to its conversion
                try:  # noqa: SIM105  # not suppress(): a context manager per tensor costs more than this
                    total += operator.index(value.nbytes)
                except Exception:
                    pass
        return total

    def only(self, keys: Iterable[str]) -> CheckedWeights:
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
            return to_storage(value if type(value) is np.ndarray else as_numpy(value, key), key)
        except WeightStoreError as exc:  # a value whose dtype changed since it was checked, a meta tensor
            raise attach(exc, path=self._where, key=key) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def _stated_shape(value: Any) -> tuple[int, ...] | None:
    """The shape a value states without being converted, or None: it has none, or not every
    dimension is known (TF's ``TensorShape(None)`` refuses even to be iterated)."""
    try:
        dims = tuple(value.shape)
    except (AttributeError, TypeError, ValueError):
        return None
    if any(dim is None for dim in dims):
        return None
    return tuple(int(dim) for dim in dims)


class DigestsSince:
    """Which versions of one publisher need content digests: those where a tensor may be unchanged.

    A digest is only ever compared, to find a tensor unchanged (hot reload, a follower's skip,
    ``ws diff``); a file without digests is compared by its bytes, never wrongly. A tensor whose
    CRC-32 (or dtype, or shape) differs from the last version's is certainly changed, so where
    every tensor's does (a trainer's versions: every weight moves each step) no digest would
    ever match, and the version is written without them: BLAKE3 was a third of a background
    publish's CPU (272 MB, every tensor changed, the best of 6 publishes on the 2-core benchmark
    VM: 0.35-0.47 CPU-s/GB without, 0.52-0.55 with).
    Known only once the tensors are written, so each version guesses from the last: after one
    whose tensors all changed it hashes none while writing, and where the guess was wrong (a
    tensor's CRC-32 the same) hashes them all in a second pass; otherwise it hashes as it writes.
    Not shared between threads: one publisher's versions are written one at a time.
    """

    def __init__(self) -> None:
        #: each tensor's (dtype, shape, CRC-32) in the last version written, by key
        self._last: dict[str, tuple[str, tuple[int, ...], int]] | None = None
        self._changed = False  # whether every tensor of the last version changed since the one before

    def expects_change(self) -> bool:
        """Whether the next version's tensors are guessed to have all changed (hashed only if not)."""
        return self._changed

    def all_changed(self, tensors: list[Any]) -> bool:
        """Whether every tensor written (``(key, dtype, shape, CRC-32)`` rows) differs from the last
        version's of its key, the same keys there; remembered as the last version for the next."""
        now = {key: (dtype, tuple(shape), crc) for key, dtype, shape, crc in tensors}
        last, self._last = self._last, now
        self._changed = last is not None and last.keys() == now.keys() and all(
            last[key] != row for key, row in now.items())
        return self._changed


def write_file(path: str, fmt: Format, arrays: CheckedWeights, metadata: Mapping[str, Any] | None,
               compress: bool | str, stored_names: Mapping[str, str] | None = None, created: str | None = None,
               *, digests: bool | DigestsSince = True,
               before: Callable[[str, np.ndarray], int | None] | None = None) -> None:
    """Write a file tensor by tensor; the caller makes it atomic and durable, and has checked
    ``metadata`` (:func:`checked_metadata`, naming its target) before the file was begun.

    ``stored_names`` (from :func:`file_names`) names tensors in the file other than by their
    keys: where the format can (:attr:`Format.torch_names`), the manifest records each such
    name as the tensor's location, so the keys read back; elsewhere the name is the key.
    ``created``: the time of the version the file is (its manifest records it), else now.
    ``digests``: record each tensor's BLAKE3 content digest beside its CRC-32. Versions
    (published files, which followers and hot reload compare) do; a plain :func:`save` does
    not, as the digest costs a second pass over every byte (0.24 CPU-s/GB, more than the write
    itself at 0.3) for an answer only a comparison asks; whoever compares a file without
    digests reads its bytes (docs/design.md, Content digests). The CRC-32 that every read
    verifies is recorded either way, from the pass that writes the bytes (or ``before``'s).
    A :class:`DigestsSince` (one publisher's versions, in turn) records them unless every
    tensor's CRC-32 shows it changed since the last file written with it (see there).
    ``before(name, data)``: more work on each tensor's stored bytes (``data``, in the file under
    ``name``) for a caller that needs more of them than the file records (a sharded member's
    block CRC-32s), done on this thread just before the write, while a tensor made for it (a
    column strip's copy) is in cache. It returns the CRC-32 of ``data`` where its work yields
    it (joined from the block CRC-32s), which the write records instead of making a pass of
    its own for it (``writer.add(..., crc=)``: a format registered from outside that takes no
    ``crc`` is only ever called without it), or None.
    """
    stored_names = stored_names or {}
    located = stored_names if fmt.torch_names else {}
    metadata = _naming_recorded(metadata, fmt, bool(stored_names))
    writer = (fmt.open_writer(path, compress, functools.partial(arrays.planned, stored_names)) if fmt.planned_writer
              else fmt.open_writer(path, compress))
    mark_torch_names = getattr(writer, "mark_torch_names", None)
    if stored_names and mark_torch_names is not None:
        mark_torch_names()
    writeback: Writeback | None = None
    try:
        # the disk starts on what is written while the rest is, into blocks reserved at once (see its module)
        writeback = Writeback(path, None if compress else arrays.known_bytes)
        tensors: list[Any] = []
        hashed: list[bytes] = []
        since = digests if isinstance(digests, DigestsSince) else None
        hash_now = bool(digests) and (since is None or not since.expects_change())
        for key, name, data in arrays.stored():  # read/converted now: one tensor in memory at a time
            # a large tensor is hashed on the helper thread while the writer writes it (both release
            # the GIL); a small one after, still in cache, as a hand-off costs more than its hash
            stored = stored_names.get(key, key)
            crc = None if before is None else before(stored, data)
            hashing = (parallel.beside(functools.partial(content_digest, data))
                       if hash_now and data.nbytes >= _HASH_BESIDE else None)
            added = writer.add(stored, name, data) if crc is None else writer.add(stored, name, data, crc=crc)
            tensors.append((key if located else stored, name, data.shape, added))
            if hash_now:
                hashed.append(content_digest(data) if hashing is None else hashing.result())
            writeback.advance(data.nbytes)
            del data
        recorded = bool(digests)
        if since is not None and since.all_changed(tensors):
            recorded = hash_now  # none would ever match; kept where already paid for
        elif since is not None and not hash_now:  # guessed wrong: a tensor may be unchanged
            hashed = [content_digest(data) for _, _, data in arrays.stored()]
        locations = {**writer.locations, **located}
        writer.commit(build_manifest(tensors, metadata, f"weightstore {__version__}", locations, writer.codecs,
                                     hashed if recorded else None, created))
    except BaseException:
        writer.abort()
        raise
    finally:
        if writeback is not None:
            writeback.close()
