"""The values an assign pairs with variables, read through one view whatever they come from:
a dict, a path, an open store or a published version, under the caller's scope and mapping."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator, Mapping
from typing import Any, Protocol

import numpy as np

import weightstore
from weightstore.adapters._reload import reload_digest
from weightstore.core._arrays import as_numpy
from weightstore.core.manifest import logical_dtype
from weightstore.errors import naming
from weightstore.io.location import refused_path


class ValueSource(Protocol):
    """What a plan pairs and an assign reads values through: :class:`Values`, or a view of it
    under other names (:class:`~weightstore.adapters.layout.LaidOutValues`)."""

    #: the file the values come from, set as the ``path`` of the errors about them; None for a dict
    path: str | None
    #: what warnings and reports call the values: the file, or "the weight dictionary"
    where: str
    #: keys were paired with the model by structure: an error suggests no look-alike keys
    exact_keys: bool

    #: :meth:`read_region` fetches only the region (a sharded version); else it reads the value whole
    regional: bool

    #: why a ``.keras`` archive's values keep the file's own names (``layers/dense/vars/0``), not
    #: its model's keys (:attr:`~weightstore.formats.keras_file.KerasArchiveReader.keys_note`); else empty
    keys_note: str

    def keys(self) -> list[str]: ...
    def dtype(self, key: str) -> np.dtype: ...
    def shape(self, key: str) -> tuple[int, ...]: ...
    def checksum(self, key: str, region: tuple[slice, ...] | None = None) -> str | None:
        """What hot reload compares (:func:`reload_digest`): of the value, or of the part of it
        ``region`` names (a sharded version knows it for each part from its block digests)."""

    def read(self, key: str) -> np.ndarray: ...

    def read_region(self, key: str, region: tuple[slice, ...]) -> np.ndarray:
        """The part of a value that ``region`` names, as a new array."""

    def prefetch(self, keys: list[str]) -> None:
        """Read ``keys`` together now, for the :meth:`read` of each that follows (or do nothing)."""


class Values:
    """A uniform lazy view over what ``assign`` accepts: a dict, a path, a Store or a Version."""

    def __init__(self, weights: Any):
        self._store: weightstore.Store | None = None
        self._owned = False
        if isinstance(weights, weightstore.Store):  # before Mapping: a Store is one, but lazy
            self._store = weights
        elif isinstance(weights, Mapping):
            self._arrays = {k: as_numpy(v, k) for k, v in weights.items()}
        elif isinstance(weights, (str, os.PathLike)) or hasattr(weights, "path"):
            self._store = weightstore.open(weights)  # a .keras archive keyed like its model, where its config allows
            self._owned = True
        else:
            raise refused_path(weights, expected="a dict, a path, a Store or a Version")
        self._ready: dict[str, np.ndarray] = {}  # read by prefetch, not yet handed out
        self.path = self._store.path if self._store is not None else None
        self.where = self.path or "the weight dictionary"
        self.exact_keys = self._store is not None and self._store.exact_keys  # keys paired by structure: no hints
        self.missing_note: str = getattr(self._store, "missing_note", "")  # why a file cannot hold some variables
        self.keys_note: str = getattr(self._store._reader, "keys_note", "") if self._store is not None else ""
        self.regional = self._store is not None and self._store.reads_regions

    def keys(self) -> list[str]:
        return self._store.keys() if self._store is not None else list(self._arrays)

    def dtype(self, key: str) -> np.dtype:
        if self._store is not None:
            with naming(path=self.path):
                return logical_dtype(self._store.info(key).dtype)
        return self._arrays[key].dtype

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._store.info(key).shape) if self._store is not None else self._arrays[key].shape

    def checksum(self, key: str, region: tuple[slice, ...] | None = None) -> str | None:
        if self._store is None:
            return None
        info = self._store.info(key)
        if region is None:
            return reload_digest(info)
        return reload_digest(info._replace(digest=self._store.region_digest(key, region)))

    def prefetch(self, keys: list[str]) -> None:
        """Read ``keys`` from the store together (an npz checks and maps many small tensors in
        one pass, a remote file fetches them at once); :meth:`read` hands each out once."""
        if self._store is not None and len(keys) > 1 and not self.regional:  # regions are read each alone
            self._ready.update(self._store.read(keys))

    def read(self, key: str) -> np.ndarray:
        if self._store is None:
            return self._arrays[key]
        ready = self._ready.pop(key, None)
        return self._store[key] if ready is None else ready

    def read_region(self, key: str, region: tuple[slice, ...]) -> np.ndarray:
        if self._store is None:
            return np.array(self._arrays[key][region])
        return self._store.read_region(key, region)

    def close(self) -> None:
        if self._owned and self._store is not None:
            self._store.close()


class RenamedValues:
    """A view of :class:`Values` with some keys renamed (``renames``: old key -> new key) and,
    with ``keep``, only those of its keys (the others left out, as optimizer state is)."""

    def __init__(self, values: Values, renames: Mapping[str, str], keep: Collection[str] | None = None):
        self._values = values
        names = values.keys()  # a Values, not a dict: it has no __iter__
        self._old = {renames.get(key, key): key for key in names if keep is None or key in keep}
        self.path = values.path
        self.where = values.where
        self.exact_keys = values.exact_keys
        self.regional = values.regional
        self.keys_note = values.keys_note

    def keys(self) -> list[str]:
        return list(self._old)

    def dtype(self, key: str) -> np.dtype:
        return self._values.dtype(self._old[key])

    def shape(self, key: str) -> tuple[int, ...]:
        return self._values.shape(self._old[key])

    def checksum(self, key: str, region: tuple[slice, ...] | None = None) -> str | None:
        return self._values.checksum(self._old[key], region)

    def prefetch(self, keys: list[str]) -> None:
        self._values.prefetch([self._old[key] for key in keys])

    def read(self, key: str) -> np.ndarray:
        return self._values.read(self._old[key])

    def read_region(self, key: str, region: tuple[slice, ...]) -> np.ndarray:
        return self._values.read_region(self._old[key], region)


@contextlib.contextmanager
def open_values(weights: Any) -> Iterator[Values]:
    values = Values(weights)
    try:
        yield values
    finally:
        values.close()
