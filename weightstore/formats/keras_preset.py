"""keras-hub presets, read without Keras: the folders ``save_to_preset`` writes.

A preset folder holds ``config.json`` (the backbone's config), ``metadata.json`` (the Keras
and keras-hub versions that wrote it), the backbone's weights and, for a task or tokenizer,
more configs and an ``assets/`` folder. The weights are ``model.weights.h5``, or, for a
backbone over ``save_to_preset``'s ``max_shard_size``, Keras sharded weights
(``model.weights.json`` beside its ``model_NNNNN.weights.h5`` shards): the files keras-hub's
``from_preset`` gives ``backbone.load_weights``, read here as a ``.weights.h5`` and a sharded
map are read (keys ``layers/<layer>/vars/<i>``), in keras-hub's order (the single file first).
A task's own head (``task.weights.h5``) is not the backbone's and is not read with it. Nothing
of the configs is read or executed: they only mark the folder as a preset.
"""

from __future__ import annotations

from typing import Any

from weightstore.errors import TargetError
from weightstore.formats import Format, Reader, format_named
from weightstore.io.places import Place

CONFIG_FILE = "config.json"
METADATA_FILE = "metadata.json"
#: the backbone's weights, in the order keras-hub's loader looks for them
WEIGHTS_FILES = ("model.weights.h5", "model.weights.json")
FORMAT_NAME = "keras-preset"


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
    for name in WEIGHTS_FILES:
        if name in names and place.child(name).is_file():
            return place.child(name)
    return None


def open_reader(location: Any, name: str, *, mmap: bool = True) -> Reader:
    """The reader of what :func:`find` found: a ``.weights.h5`` file, or a Keras sharded map."""
    if name.endswith(".weights.json"):
        return format_named("keras-sharded").open_reader(location, name, mmap=mmap)
    return format_named("hdf5").open_reader(location, name, mmap=mmap)


def _no_writer(path: str, compress: bool | str) -> Any:
    raise TargetError("a keras-hub preset folder is written by keras-hub's save_to_preset; write its weights "
                      "into a model with tf2.assign, then save_to_preset", path=path)


#: a folder ``save_to_preset`` wrote: recognised by the files it holds
FORMAT = Format(name=FORMAT_NAME, suffixes=(), magic=lambda head: False, open_reader=open_reader,
                open_writer=_no_writer, compresses=False, writes=False, find=find)
