"""Keras 3 sharded weights, read without Keras: ``save_weights("m.weights.json", max_shard_size=...)``.

Keras writes a JSON map (``{"metadata": {"total_size": N}, "weight_map": {"/layers/dense/vars":
["m_00000.weights.h5", ...]}}``) beside shards ``m_00000.weights.h5``, ``m_00001.weights.h5``…,
each an HDF5 file laid out as an unsharded ``.weights.h5`` is (``layers/dense/vars/0``). Read
here as one store with the keys the unsharded file would have, so ``tf2.assign`` resolves them
against a model as it does a ``.weights.h5``. The map is hostile input: bounded JSON, shard names
that stay in its folder, every shard named by the map and each key in one shard only.
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

from weightstore.core import _jsontext as jsontext
from weightstore.core.limits import KERAS_MAP_BYTES_PER_CONTAINER, MAX_KERAS_MAP_BYTES, MAX_KERAS_SHARDS
from weightstore.core.manifest import TensorInfo
from weightstore.errors import FormatError, KeyNotInStoreError, TargetError, naming
from weightstore.formats import Format, ReaderDefaults, format_named
from weightstore.io.files import open_regular, unreadable

SUFFIX = ".weights.json"
KIND = "Keras sharded weights"
#: what Keras names a shard: ``BASE_NNNNN.weights.h5``, a plain name in the map's folder
_SHARD_NAME = re.compile(r"[^/\\\x00]+\.weights\.h5")


class KerasShardedReader(ReaderDefaults):
    """The Reader protocol over a sharded Keras weights map and its shards, opened once each."""

    kind = KIND

    def __init__(self, path: str):
        self.name = path
        self.metadata: dict[str, Any] = {}
        self.created = ""
        self.has_checksums = False
        self._shards: list[Any] = []
        self._where: dict[str, Any] = {}
        try:
            folder = os.path.dirname(path) or "."
            for name in _shard_names(path):
                shard_path = os.path.join(folder, name)
                if not os.path.isfile(shard_path):
                    raise FormatError(f"names shard {name}, which is not in its folder", path=path)
                shard = format_named("hdf5").open_reader(shard_path, shard_path)
                self._shards.append(shard)
                held: list[str] = shard.keys()
                for key in held:
                    if key in self._where:
                        raise FormatError(f"its shards {os.path.basename(self._where[key].name)} and {name} both "
                                          "hold this tensor", path=path, key=key)
                    self._where[key] = shard
        except BaseException:
            self.close()
            raise

    def keys(self) -> list[str]:
        return list(self._where)

    def _shard(self, key: str) -> Any:
        try:
            return self._where[key]
        except KeyError:
            raise KeyNotInStoreError("is not in the store", path=self.name, key=key) from None

    def info(self, key: str) -> TensorInfo:
        return self._shard(key).info(key)

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        return self._shard(key).read(key, verify=verify)

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        return bool(self._shard(key).read_into(key, out, verify=verify))

    def close(self) -> None:
        shards, self._shards = self._shards, []
        for shard in shards:
            shard.close()


def _shard_names(path: str) -> list[str]:
    """The shard files the map at ``path`` names, in first-named order, each checked."""
    with open_regular(path) as handle:
        try:
            data = handle.read(MAX_KERAS_MAP_BYTES + 1)
        except OSError as exc:
            raise unreadable(exc, path) from None
    with naming(path=path):
        if len(data) > MAX_KERAS_MAP_BYTES:
            raise FormatError(f"is over {MAX_KERAS_MAP_BYTES} bytes; not a Keras sharded weights map")
        document = jsontext.loads(data, what="the sharded weights map", min_bytes=KERAS_MAP_BYTES_PER_CONTAINER)
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict):
            raise FormatError("holds no weight_map; not a Keras sharded weights map")
        names: dict[str, None] = {}
        for group, files in weight_map.items():
            for name in files if isinstance(files, list) else [files]:
                if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name) or name.startswith(".."):
                    raise FormatError(f"weight_map names {name!r} for {group!r}, which is not a shard in its folder "
                                      "(BASE_NNNNN.weights.h5)")
                names[name] = None
        if len(names) > MAX_KERAS_SHARDS:
            raise FormatError(f"names {len(names)} shards, more than {MAX_KERAS_SHARDS}")
    return list(names)


def _open_reader(location: Any, name: str, *, mmap: bool = True) -> KerasShardedReader:
    if not isinstance(location, str):
        raise FormatError("a Keras sharded weights map is read from a local folder (its shards are HDF5 files "
                          "h5py opens by path); copy the folder first", path=name)
    return KerasShardedReader(location)


def _no_writer(path: str, compress: bool | str) -> Any:
    raise TargetError("Keras sharded weights are written by Keras's save_weights(..., max_shard_size=...); "
                      "write .weights.h5, .npz, .h5 or .safetensors", path=path)


#: ``save_weights("m.weights.json", max_shard_size=...)``: by its suffix
FORMAT = Format(name="keras-sharded", suffixes=(SUFFIX,), magic=lambda head: False, open_reader=_open_reader,
                open_writer=_no_writer, compresses=False, writes=False)
