"""A reader whose keys are another naming of its file's names (PyTorch's ``a.b.c`` as ``a/b/c``).

Wrapping rather than teaching every reader a naming keeps the naming in one place
(:mod:`weightstore.core.names`): npz, HDF5, safetensors and sharded readers all answer to the
file's own names, and this maps keys onto them and back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from weightstore.core.manifest import TensorInfo
from weightstore.core.names import NAMES_METADATA, TORCH, keys_of_torch_names, reads_as_torch
from weightstore.errors import FormatError, InvalidKeyError, KeyNotInStoreError
from weightstore.formats import Reader


def names_by_key(reader: Reader, keys_of: Callable[[list[str]], list[str]]) -> dict[str, str]:
    """Key -> ``reader``'s name, the names read as keys by ``keys_of`` (all at once, in order);
    refused with a :class:`FormatError` naming the file if a name makes no key or two make one."""
    names = reader.keys()
    try:
        keys = keys_of(names)
    except InvalidKeyError as exc:
        raise FormatError(str(exc), path=reader.name) from None
    name_of = dict(zip(keys, names, strict=True))
    if len(name_of) != len(names):
        first: dict[str, str] = {}
        for key, name in zip(keys, names, strict=True):
            if key in first:
                raise FormatError(f"tensors {first[key]!r} and {name!r} both read as key {key!r}", path=reader.name)
            first[key] = name
    return name_of


def said_torch(reader: Reader) -> bool:
    """Whether ``reader``'s manifest says its names are PyTorch's (:data:`NAMES_METADATA`: an npz
    or HDF5 file saved with ``names="torch"``, or a version published from a ``state_dict``) and
    they read so: such a file is read by its keys."""
    return reader.metadata.get(NAMES_METADATA) == TORCH and reads_as_torch(reader.keys())


def by_saved_keys(reader: Reader) -> Reader:
    """``reader`` read by the keys its file was saved with, where :func:`said_torch`: what
    ``ws.open`` does, for whatever opens a file's reader itself (a delta version's base, a version
    on object storage), so that every reader of the file sees the same keys."""
    if not said_torch(reader):
        return reader
    try:
        return cast(Reader, RenamedReader(reader, names_by_key(reader, keys_of_torch_names)))
    except BaseException:
        reader.close()
        raise


class RenamedReader:
    """``reader`` seen through new keys: ``names`` maps each key to the reader's own name."""

    def __init__(self, reader: Reader, names: Mapping[str, str]):
        self._reader = reader
        self.name = reader.name
        self._name_of = dict(names)

    def _name(self, key: str) -> str:
        name = self._name_of.get(key)
        if name is None:
            raise KeyNotInStoreError("no such tensor", path=self.name, key=key)
        return name

    @property
    def metadata(self) -> dict[str, Any]:
        return self._reader.metadata

    @property
    def kind(self) -> str | None:
        return self._reader.kind

    @property
    def skipped(self) -> list[str]:
        return self._reader.skipped

    @property
    def meta_graph(self) -> str | None:
        return self._reader.meta_graph

    @property
    def created(self) -> str:
        return self._reader.created

    @property
    def has_checksums(self) -> bool:
        return self._reader.has_checksums

    def keys(self) -> list[str]:
        return list(self._name_of)

    @property
    def stored_names(self) -> dict[str, str]:
        """Key -> the file's name for it, where the two differ."""
        inner = getattr(self._reader, "stored_names", {})
        return {key: stored for key, name in self._name_of.items() if (stored := inner.get(name, name)) != key}

    def info(self, key: str) -> TensorInfo:
        return self._reader.info(self._name(key))._replace(key=key)

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        return self._reader.read(self._name(key), verify=verify)

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        return self._reader.read_into(self._name(key), out, verify=verify)

    def read_many(self, keys: list[str], *, verify: bool) -> list[np.ndarray]:
        return self._reader.read_many([self._name(key) for key in keys], verify=verify)

    def prefetch(self, keys: list[str]) -> None:
        self._reader.prefetch([self._name(key) for key in keys])

    def close(self) -> None:
        self._reader.close()
