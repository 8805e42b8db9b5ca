"""``save``, ``load`` and ``open`` over local paths and fsspec URLs, with atomic replace.

Local writes go to a temporary file beside the target, are fsynced, renamed over it, and the
folder is fsynced, so a reader sees the old file or the new one and never a mix. A save
killed outright leaves its temporary file behind; the next save to that target removes
temporaries whose writer is gone. URLs are written locally first and uploaded in one put,
which object stores make visible all at once.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import re
import secrets
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Union

import numpy as np

from weightstore import __version__
from weightstore.errors import (
    InvalidKeyError,
    KeyNotInStoreError,
    MissingDependencyError,
    SizeLimitError,
    StoreExistsError,
    StoreNotFoundError,
    UnsupportedDTypeError,
    WeightStoreError,
)
from weightstore.formats import Format, Reader, format_for_suffix, format_named, sniff
from weightstore.keys import MappingRules, Patterns, plan_outward, validate_key
from weightstore.manifest import TensorInfo, build_manifest, checksum_text, crc32, dtype_name, logical_dtype, to_storage

PathLike = Union[str, "os.PathLike[str]"]
#: marks the temporary file a save writes beside its target (``.NAME.wstmp-PID-RANDOM``)
TEMP_MARK = ".wstmp-"


def is_url(path: object) -> bool:
    text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
    return "://" in text and not text.startswith("file://")


def _fsspec():
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        raise MissingDependencyError("reading URLs needs fsspec: pip install 'weightstore[s3]'") from None
    return fsspec


def _location(path: Any) -> str:
    """The path or URL behind anything :func:`open` accepts (``Version`` has ``.path``)."""
    if hasattr(path, "path") and not isinstance(path, (str, os.PathLike)):
        path = path.path
    text = os.fspath(path)
    return text[len("file://"):] if text.startswith("file://") else text


class Store(Mapping):
    """An open weight file: the index is read, each tensor is read when asked for.

    A read-only mapping of key to array, so it can be passed wherever a weight dictionary
    goes. ``ws.save(other, store)`` streams tensor by tensor: keys and dtypes are checked
    from the index first, then each tensor is read just before it is written, so a copy holds
    about one tensor in memory, not the whole file. Tensors from uncompressed local
    npz files are read-only views of the mapped file; copy one (``np.array(store[key])``) to
    change it.
    """

    def __init__(self, reader: Reader, path: str, verify: bool):
        self._reader = reader
        self._keys = reader.keys()
        self._key_set = frozenset(self._keys)
        self.path = path
        self.verify = verify

    @property
    def metadata(self) -> dict[str, Any]:
        return self._reader.metadata

    @property
    def created(self) -> str:
        return self._reader.created

    @property
    def has_checksums(self) -> bool:
        return self._reader.has_checksums

    def keys(self) -> list[str]:  # type: ignore[override]  # a list keeps the file's order
        return list(self._keys)

    def info(self, key: str) -> TensorInfo:
        return self._reader.info(key)

    def __getitem__(self, key: str) -> np.ndarray:
        return self._reader.read(key, verify=self.verify)

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
        if out.dtype != logical_dtype(info.dtype, self.path) or not self._reader.read_into(key, out, verify=self.verify):
            np.copyto(out, self[key], casting="unsafe")
        return out

    def read(self, keys: Iterable[str] | None = None, *, max_bytes: int | None = None) -> dict[str, np.ndarray]:
        """Several tensors at once, refusing before reading if they exceed ``max_bytes``."""
        wanted = self.keys() if keys is None else list(keys)
        for key in wanted:
            if key not in self:
                raise KeyNotInStoreError(f"{self.path}: no tensor {key!r}")
        check_budget(self, wanted, max_bytes)
        return {key: self[key] for key in wanted}

    def __contains__(self, key: object) -> bool:
        return key in self._key_set

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def nbytes(self) -> int:
        return sum(self.info(k).nbytes for k in self.keys())

    def close(self) -> None:
        self._reader.close()

    def __enter__(self) -> "Store":
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
        raise SizeLimitError(f"{store.path}: reading {len(keys)} tensors needs {total} bytes, over max_bytes={max_bytes}")


def open(path: Any, *, verify: bool = True, format: str | None = None) -> Store:  # noqa: A001
    """Open a weight file lazily: only its index is read until a tensor is asked for."""
    opener = getattr(path, "_weightstore_open", None)
    if opener is not None:  # a Version: its pinned file, or a clear "version gone" if pruned
        return opener(verify=verify)
    location = _location(path)
    if is_url(location):
        fs, remote = _fsspec().core.url_to_fs(location)
        try:
            handle = fs.open(remote, "rb")
        except FileNotFoundError:
            raise StoreNotFoundError(f"{location}: no such file") from None
        try:
            fmt = format_named(format) if format else format_for_suffix(location) or sniff(handle.read(8), location)
            return Store(fmt.open_reader(handle, location), location, verify)
        except BaseException:
            handle.close()
            raise
    try:
        with builtins.open(location, "rb") as handle:
            head = handle.read(8)
    except FileNotFoundError:
        raise StoreNotFoundError(f"{location}: no such file") from None
    except IsADirectoryError:
        raise StoreNotFoundError(f"{location}: is a folder, not a weight file") from None
    fmt = format_named(format) if format else format_for_suffix(location) or sniff(head, location)
    return Store(fmt.open_reader(location, location), location, verify)


def load(
    path: Any,
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    scope: str | None = None,
    mapping: MappingRules = None,
    verify: bool = True,
    max_bytes: int | None = None,
) -> dict[str, np.ndarray]:
    """Read a weight file into a dict, reading only the selected tensors' bytes."""
    with open(path, verify=verify) as store:
        plan = plan_outward(store.keys(), scope=scope, mapping=mapping, include=include, exclude=exclude, where=store.path)
        check_budget(store, plan.values(), max_bytes)
        return {new: store[old] for new, old in plan.items()}


def save(
    path: Any,
    weights: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    compress: bool = False,
    overwrite: bool = True,
    format: str | None = None,
) -> None:
    """Write ``weights`` atomically; the suffix (or ``format``) picks npz or HDF5.

    Every key and dtype, and the metadata, are checked before the first byte is written, so
    a bad input changes nothing on disk. Tensors are then converted to their stored form (and,
    from a :class:`Store`, read) one at a time as they are written.
    """
    location = _location(path)
    fmt = format_named(format) if format else format_for_suffix(location) or format_named("npz")
    metadata = checked_metadata(metadata, location)
    arrays = _checked(weights, location)
    if is_url(location):
        _save_remote(location, fmt, arrays, metadata, compress, overwrite)
        return
    target = Path(location)
    if not target.parent.is_dir():
        raise StoreNotFoundError(f"{location}: folder {str(target.parent)!r} does not exist")
    if not overwrite and target.exists():
        raise StoreExistsError(f"{location}: file exists (pass overwrite=True to replace it)")
    remove_stale_temporaries(target)
    with atomic_target(target) as temporary:
        write_file(temporary, fmt, arrays, metadata, compress)


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

    def __init__(self, weights: Mapping[str, Any], where: str):
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must be a mapping of key to array, not {type(weights).__name__}")
        self._weights = weights
        self._where = where
        self._values: dict[str, Any] = {}  # None: read from ``weights`` when written
        lazy = isinstance(weights, Store)
        for key in weights.keys():
            with self._naming_the_file():
                validate_key(key)
                if lazy:
                    name = weights.info(key).dtype
                    try:
                        logical_dtype(name)
                    except WeightStoreError:
                        raise UnsupportedDTypeError(
                            f"tensor {key!r} has dtype {name}: only numeric, bool and ml_dtypes arrays are weights"
                        ) from None
                    self._values[key] = None
                    continue
                value = weights[key]
                dtype = _declared_dtype(value)
                if dtype is None:
                    value = np.asarray(value)
                    dtype = value.dtype
                dtype_name(dtype, key)
                self._values[key] = value

    @contextlib.contextmanager
    def _naming_the_file(self) -> Iterator[None]:
        try:
            yield
        except (InvalidKeyError, UnsupportedDTypeError) as exc:
            if not self._where:
                raise
            raise type(exc)(f"{self._where}: {exc}") from None

    def __getitem__(self, key: str) -> tuple[str, np.ndarray]:
        value = self._values[key]
        if value is None:
            value = self._weights[key]
        with self._naming_the_file():
            return to_storage(np.asarray(value), key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def _declared_dtype(value: Any) -> np.dtype | None:
    """The numpy dtype an array-like states without being converted, or ``None``.

    A TF tensor (``dtype.as_numpy_dtype``) or any ``__array__`` object with a numpy ``dtype``
    is checked now and converted only when written, on whatever thread writes it: a trainer's
    snapshot is not copied to numpy all at once (see ``weightstore.background``).
    """
    if isinstance(value, np.ndarray):
        return value.dtype
    dtype = getattr(value, "dtype", None)
    if dtype is None or not hasattr(value, "__array__"):
        return None
    try:
        return np.dtype(getattr(dtype, "as_numpy_dtype", dtype))
    except (TypeError, ValueError):
        return None


def _checked(weights: Mapping[str, Any], where: str = "") -> Mapping[str, tuple[str, np.ndarray]]:
    """Every key and dtype checked before anything is written; errors name ``where`` (the file).

    The tensors themselves are read and converted lazily, one at a time, as they are written.
    """
    return _Checked(weights, where)


def write_file(path: str, fmt: Format, arrays: Mapping[str, tuple[str, np.ndarray]],
               metadata: Mapping[str, Any] | None, compress: bool) -> None:
    """Write a file tensor by tensor; the caller makes it atomic and durable."""
    metadata = checked_metadata(metadata, path)  # before the file exists (callers check earlier, naming theirs)
    writer = fmt.open_writer(path, compress)
    try:
        infos = {}
        for key in arrays:
            name, data = arrays[key]  # read/converted now: one tensor in memory at a time
            crc = crc32(data)
            writer.add(key, name, data, crc)
            infos[key] = TensorInfo(key, name, data.shape, data.nbytes, checksum_text(crc))
            del data
        writer.commit(build_manifest(infos, metadata, f"weightstore {__version__}", writer.locations))
    except BaseException:
        writer.abort()
        raise


@contextlib.contextmanager
def atomic_target(target: Path) -> Iterator[str]:
    """A temporary path beside ``target`` that replaces it, durably, when the block succeeds."""
    temporary = target.with_name(f".{target.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        yield str(temporary)
        fsync_path(temporary)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    fsync_folder(target.parent)


def fsync_path(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temporaries(target: Path, suffix: str = "") -> None:
    """Remove temporaries of earlier saves to ``target`` whose process has died (SIGKILL).

    ``suffix`` is a pattern for what a writer appends after the temporary's name (the file
    endings of a TF checkpoint written under a temporary prefix).
    """
    pattern = re.compile(re.escape(f".{target.name}{TEMP_MARK}") + r"(\d+)-[0-9a-f]+" + suffix + "$")
    with contextlib.suppress(OSError):
        for entry in os.scandir(target.parent):
            match = pattern.match(entry.name)
            if match and not _process_alive(int(match.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _save_remote(url: str, fmt: Format, arrays, metadata, compress: bool, overwrite: bool) -> None:
    fs, remote = _fsspec().core.url_to_fs(url)
    if not overwrite and fs.exists(remote):
        raise StoreExistsError(f"{url}: file exists (pass overwrite=True to replace it)")
    with tempfile.TemporaryDirectory(prefix="weightstore-") as scratch:
        local = os.path.join(scratch, "upload" + (fmt.suffixes[0]))
        write_file(local, fmt, arrays, metadata, compress)
        fs.put_file(local, remote)
