"""One small reader/writer protocol for every file format, registered by suffix.

The rest of weightstore never branches on the format: it asks :func:`format_for` for the
module and speaks :class:`Reader` and :class:`Writer`. Readers treat the file as hostile:
every size is checked against the bytes that really exist before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Protocol

import numpy as np

from weightstore.errors import FormatError, InvalidKeyError
from weightstore.keys import OUTPUT_SUFFIX, validate_key
from weightstore.manifest import TensorInfo


class Reader(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def metadata(self) -> dict[str, Any]: ...
    @property
    def created(self) -> str: ...
    @property
    def has_checksums(self) -> bool: ...

    def keys(self) -> list[str]: ...
    def info(self, key: str) -> TensorInfo: ...
    def read(self, key: str, *, verify: bool) -> np.ndarray: ...
    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool: ...
    def close(self) -> None: ...


class Writer(Protocol):
    #: tensors stored somewhere other than their key (HDF5 reserved datasets), for the manifest
    locations: dict[str, str]
    #: tensors whose bytes a codec encodes (npz ``compress="shuffle"``), for the manifest
    codecs: dict[str, str]

    def add(self, key: str, dtype_name: str, data: np.ndarray) -> int: ...  # the CRC-32 of data, from the write pass
    def commit(self, manifest_text: str) -> None: ...
    def abort(self) -> None: ...


@dataclass(frozen=True)
class Format:
    name: str
    suffixes: tuple[str, ...]
    magic: Callable[[bytes], bool]
    open_reader: Callable[..., Reader]  # (location, name, *, mmap=True)
    open_writer: Callable[[str, bool | str], Writer]  # (path, compress: False, True or "shuffle")
    #: the logical dtypes the format can hold; ``None``: every dtype weightstore stores
    dtypes: frozenset[str] | None = None
    compresses: bool = True
    #: whether tensors can be named in the file other than by their keys (``names="torch"``)
    torch_names: bool = False


def _registry() -> list[Format]:
    from weightstore.formats import hdf5, npz, safetensors

    return [npz.FORMAT, hdf5.FORMAT, safetensors.FORMAT]


def format_named(name: str) -> Format:
    for fmt in _registry():
        if fmt.name == name:
            return fmt
    raise ValueError(f"unknown format {name!r}; known: {', '.join(f.name for f in _registry())}")


def format_for_suffix(path: str) -> Format | None:
    """The format a file name asks for, by suffix; ``None`` when the suffix says nothing."""
    suffix = PurePosixPath(str(path)).suffix.lower()
    for fmt in _registry():
        if suffix in fmt.suffixes:
            return fmt
    return None


def known_suffixes() -> list[str]:
    """Every suffix a save can write, in registry order."""
    return [suffix for fmt in _registry() for suffix in fmt.suffixes]


def sniff(head: bytes, where: str) -> Format:
    """The format of a file by its first bytes, for names whose suffix says nothing."""
    for fmt in _registry():
        if fmt.magic(head):
            return fmt
    if not head:
        raise FormatError("file is empty", path=where)
    raise FormatError("not a weightstore file (not npz, HDF5 or safetensors)", path=where)


def foreign_keys(names: Iterable[tuple[str, str]], where: str, what: str) -> dict[str, str]:
    """Key -> member (npz member, HDF5 dataset path) of a file without a manifest.

    Such names were chosen by whatever wrote the file, so each must become a valid key: a
    trailing TensorFlow output suffix is dropped (old tf.keras HDF5 files name datasets
    ``dense/kernel:0``); any other name that is not a valid key (``c//d``, ``a/./b``, a
    control character, a reserved ``__weightstore`` segment) refuses the file with a
    :class:`FormatError` naming it, as do two names that drop to the same key.
    """
    keys: dict[str, str] = {}
    for name, member in names:
        key = OUTPUT_SUFFIX.sub("", name)
        try:
            validate_key(key)
        except InvalidKeyError as exc:
            raise FormatError(f"{what} {member!r} does not name a valid key ({exc.message})", path=where) from None
        if key in keys:
            raise FormatError(f"{what}s {keys[key]!r} and {member!r} both read as key {key!r}", path=where)
        keys[key] = member
    return keys
