"""keras-hub presets, read without Keras: the folders ``save_to_preset`` writes.

A preset folder holds ``config.json`` (the backbone's config), ``metadata.json`` (the Keras
and keras-hub versions that wrote it), the backbone's weights and, for a task or tokenizer,
more configs and an ``assets/`` folder. The weights are ``model.weights.h5``, or, for a
backbone over ``save_to_preset``'s ``max_shard_size``, Keras sharded weights
(``model.weights.json`` beside its ``model_NNNNN.weights.h5`` shards): the files keras-hub's
``from_preset`` gives ``backbone.load_weights``, read here as a ``.weights.h5`` and a sharded
map are read (keys ``layers/<layer>/vars/<i>``), in keras-hub's order (the single file first).
A task's preset also holds the task's own weights, those not in its backbone (a classifier's
head), in ``task.weights.h5``: not the backbone's, so not read with them by ``ws.open``; a
task is given both (:func:`task_weights`, :class:`WithTaskReader`, the task's under
:data:`TASK_PREFIX`), as ``Task.from_preset`` loads both. Nothing of the configs is read or
executed: they only mark the folder as a preset.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from weightstore.core.manifest import TensorInfo
from weightstore.errors import KeyNotInStoreError, TargetError
from weightstore.formats import Format, Reader, ReaderDefaults, format_named
from weightstore.io.places import Place

CONFIG_FILE = "config.json"
METADATA_FILE = "metadata.json"
#: the backbone's weights, in the order keras-hub's loader looks for them
WEIGHTS_FILES = ("model.weights.h5", "model.weights.json")
FORMAT_NAME = "keras-preset"
#: a task's weights that are not its backbone's (``Task.save_task_weights``)
TASK_WEIGHTS_FILE = "task.weights.h5"
#: where :class:`WithTaskReader` puts the task file's keys (its names repeat the backbone file's)
TASK_PREFIX = "task/"


def is_preset_folder(place: Place) -> bool:
    """Whether ``place`` is a local keras-hub preset folder (:func:`find` finds its weights)."""
    return find(place) is not None


def find(place: Place) -> Place | None:
    """The backbone weights of the keras-hub preset folder at ``place``, or None when it is none.

    Local folders only: their weights are HDF5 files h5py opens by path.
    """
    if place.remote or not place.is_dir():
        return None
    names = set(place.names())
    if CONFIG_FILE not in names or METADATA_FILE not in names:
        return None
    weights = [name for name in WEIGHTS_FILES if name in names]
    for name in weights:
        if place.child(name).is_file():
            return place.child(name)
    for name in weights:  # a link loop, a dangling link, a FIFO: its reader says which, naming the file,
        if not place.child(name).is_dir():  # rather than "holds no TF checkpoint" naming the folder
            return place.child(name)
    return None


def open_reader(location: Any, name: str, *, mmap: bool = True) -> Reader:
    """The reader of what :func:`find` found: a ``.weights.h5`` file, or a Keras sharded map."""
    if name.endswith(".weights.json"):
        return format_named("keras-sharded").open_reader(location, name, mmap=mmap)
    return format_named("hdf5").open_reader(location, name, mmap=mmap)


def task_weights(place: Place) -> Place | None:
    """The task weights file of the preset folder at ``place``, or None when it has none."""
    if find(place) is None:
        return None
    child = place.child(TASK_WEIGHTS_FILE)
    return child if child.is_file() else None


class WithTaskReader(ReaderDefaults):
    """A preset's backbone weights under their own keys and its task weights under
    :data:`TASK_PREFIX`, as one reader (both files' keys are Keras's ``layers/...`` paths)."""

    def __init__(self, folder: str, backbone: Reader, task: Reader):
        self._backbone, self._task = backbone, task
        self._backbone_keys = set(backbone.keys())
        names: list[str] = task.keys()  # a Reader is no mapping
        self._task_keys = [TASK_PREFIX + key for key in names]
        self.name = folder
        self.kind = backbone.kind
        self.metadata: dict[str, Any] = {}
        self.created = ""
        self.has_checksums = False

    def keys(self) -> list[str]:
        return [*self._backbone.keys(), *self._task_keys]

    def _split(self, key: str) -> tuple[Reader, str]:
        if key.startswith(TASK_PREFIX):
            return self._task, key[len(TASK_PREFIX):]
        if key in self._backbone_keys:
            return self._backbone, key
        raise KeyNotInStoreError("is not in the store", path=self.name, key=key)

    def info(self, key: str) -> TensorInfo:
        reader, name = self._split(key)
        return reader.info(name)

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        reader, name = self._split(key)
        return reader.read(name, verify=verify)

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        reader, name = self._split(key)
        return bool(reader.read_into(name, out, verify=verify))

    def close(self) -> None:
        try:
            self._backbone.close()
        finally:
            self._task.close()


def _no_writer(path: str, compress: bool | str) -> Any:
    raise TargetError("a keras-hub preset folder is written by keras-hub's save_to_preset; write its weights "
                      "into a model with tf2.assign, then save_to_preset", path=path)


#: a folder ``save_to_preset`` wrote: recognised by the files it holds
FORMAT = Format(name=FORMAT_NAME, suffixes=(), magic=lambda head: False, open_reader=open_reader,
                open_writer=_no_writer, compresses=False, writes=False, find=find)
