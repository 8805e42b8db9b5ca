"""Every source the ``ws`` command reads, opened once, with what its messages say about it.

:func:`open_source` opens anything :func:`weightstore.open` reads and labels its kind (a TF1
checkpoint, a Keras file, a weightstore file); :func:`open_keyed_like_model` keys a Keras file or
TF2 checkpoint as ``tf2.export`` keys the model of a ``.keras`` archive; a TF1 checkpoint's
``.meta`` graph, or the model a source is keyed like, says which variables are trainable for
``--trainable-only`` (:meth:`Source.trainable_keys`). TensorFlow is imported only for those
last two.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import weightstore
from weightstore.adapters import _checkpoints
from weightstore.core.keys import OUTPUT_SUFFIX
from weightstore.errors import FormatError, StoreNotFoundError, named
from weightstore.formats import keras_file, keras_sharded
from weightstore.formats.tf_checkpoint import KIND_TF2, resolve_prefix
from weightstore.io.location import is_url
from weightstore.store._open import Store

__all__ = ["Source", "open_keyed_like_model", "open_source"]


class Source(Store):
    """A :class:`Store` over any weight source, with what the CLI needs to know about it."""

    def __init__(self, store: Store):
        super().__init__(store._reader, store.path, verify=store.verify, format=store.format)
        reader = store._reader
        self.kind: str = reader.kind or _store_kind(store)
        #: entries that are not numeric tensors (string variables), left out of the keys
        self.skipped: list[str] = list(reader.skipped)
        #: why a .keras archive keeps its own names (``layers/dense/vars/0``), not its model's keys
        self.keys_note: str = getattr(reader, "keys_note", "")
        self._meta_graph: str | None = reader.meta_graph
        #: keys of the trainable variables of the model the keys come from, else None
        self.model_trainable: set[str] | None = None
        #: the .keras file whose model gave the keys (:func:`open_keyed_like_model`), else None
        self.keyed_like: str | None = None
        #: that model's layer kinds a file's names and shapes leave open (scope -> ``depthwise``
        #: or ``conv``), for a layout conversion (``ws convert --kind`` says the same by hand)
        self.kinds: dict[str, str] = {}

    def trainable_keys(self) -> set[str]:
        """Keys of the trainable variables: those of the model the source is keyed like, or
        those a TF1 checkpoint's ``.meta`` graph lists.

        No file records trainability but that graph: TF2 checkpoints, Keras files and stores
        do not, but a model built to key a TF2 checkpoint or Keras file knows its own.
        """
        if self.model_trainable is not None:
            return self.model_trainable
        if self._meta_graph is None:
            keras_kind = self.kind in (KIND_TF2, keras_file.KIND)
            fix = "pass --model model.keras, whose model knows, or " if keras_kind else ""
            # a store may be any framework's: PyTorch's and Flax's exports take the word too
            others = "" if keras_kind else " (torch.export, flax.export alike)"
            raise FormatError(f"--trainable-only needs a TF1 checkpoint's .meta graph or a model; a {self.kind} does "
                              f"not record which variables are trainable: {fix}in Python export from the model, "
                              f"tf2.export(model, trainable_only=True){others}", path=self.path)
        if not os.path.exists(self._meta_graph):
            raise FormatError(f"--trainable-only needs the graph file {self._meta_graph}, which is missing "
                              "(save with Saver(write_meta_graph=True))", path=self.path)
        return _trainable_from_meta(self._meta_graph)


def open_source(path: str | os.PathLike, names: str | None = None) -> Source:
    """Open anything :func:`weightstore.open` reads (``names`` as it takes them), labelled with
    its kind for the CLI's messages."""
    text = os.fspath(path)
    if not is_url(text) and not os.path.lexists(text) and resolve_prefix(text) is None:
        raise StoreNotFoundError("no such file or checkpoint", path=text)
    return Source(weightstore.open(text, names=names))


def open_keyed_like_model(path: str | os.PathLike, model_file: str | os.PathLike) -> Source:
    """A Keras file or TF2 object checkpoint keyed as ``tf2.export`` keys the model of ``model_file``.

    ``model_file`` is a ``.keras`` archive (``path`` itself, or another one whose architecture
    the weights fit); its model is rebuilt from its config in Keras's safe mode
    (:mod:`weightstore.adapters._keras_config`) and paired with ``path`` as ``tf2.load(model,
    path)`` pairs them: tensors the model has no variable for keep their file keys, optimizer
    state is left out.
    """
    text, model_text = os.fspath(path), os.fspath(model_file)
    if not model_text.endswith(".keras"):
        raise FormatError("is not a .keras file; the model's architecture comes from the config.json of one",
                          path=model_text)
    with open_source(text) as plain:
        kind = plain.kind
    prefix = resolve_prefix(text) if kind == KIND_TF2 else None
    if prefix is None and not text.endswith((".keras", keras_file.WEIGHTS_SUFFIX, keras_sharded.SUFFIX)):
        raise FormatError(f"is a {kind}; only Keras files and TF2 object-based checkpoints can be keyed like a model",
                          path=text)
    _checkpoints.tensorflow("keying weights like a model (Keras builds it from the .keras config)", model_text)
    with _checkpoints.quietly():
        from weightstore.adapters import _artifacts, _keras_config, tf2
    model = _keras_config.model_from_archive(model_text)
    variables = tf2.variables(model)
    keyed = Source(_artifacts.for_model(model, prefix or text, variables))
    try:
        _refuse_misfit(keyed, {key: tuple(var.shape) for key, var in variables.items()}, model_text)
    except BaseException:
        keyed.close()
        raise
    keyed.kind, keyed.keyed_like, keyed.kinds = kind, model_text, _conv_kinds(model, variables)
    keyed.model_trainable = set(tf2.selected(model, trainable_only=True))
    return keyed


def _conv_kinds(model: Any, variables: dict[str, Any]) -> dict[str, str]:
    """Scope -> ``depthwise`` or ``conv`` for the model's convolutions: Keras 3 names both
    kernels ``kernel``, of one rank, and a bias-free one's shape passes for either."""
    import keras

    key_of = {id(var): key for key, var in variables.items()}
    kinds = {}
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)):
            kind = "depthwise"
        elif isinstance(layer, (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D, keras.layers.Conv1DTranspose,
                                keras.layers.Conv2DTranspose, keras.layers.Conv3DTranspose)):
            kind = "conv"  # a transposed one's kernel [*spatial, out, in] moves as a Conv's does
        else:
            continue
        for weight in layer.weights:
            if id(weight) in key_of:
                kinds[key_of[id(weight)].rpartition("/")[0]] = kind
    return kinds


def _refuse_misfit(keyed: Store, shapes: dict[str, tuple[int, ...]], model_text: str) -> None:
    """Weights of another architecture come out half renamed and of other shapes: what a file
    keyed like a model holds must be that model's variables, each of its shape (``tf2.assign``
    refuses the same, naming each key)."""
    stray = [key for key in keyed if key not in shapes]
    reshaped = [key for key in keyed if key in shapes and tuple(keyed.info(key).shape) != shapes[key]]
    if stray or reshaped:
        problems = ([f"{len(stray)} tensors the model has no variable for ({named(stray)})"] if stray else []) + (
            [f"{len(reshaped)} of another shape than the model's ({named(reshaped)})"] if reshaped else [])
        raise FormatError(f"does not fit the model of {model_text}: {'; '.join(problems)}", path=keyed.path)


def _store_kind(store: Store) -> str:
    if store.has_checksums:
        return "weightstore file"
    if store.path.endswith(keras_file.WEIGHTS_SUFFIX):
        return keras_file.KIND
    if store.path.endswith(keras_sharded.SUFFIX):
        return keras_sharded.KIND
    return "file without a weightstore manifest"


def _trainable_from_meta(meta_path: str) -> set[str]:
    """Checkpoint names of the variables in a MetaGraphDef's trainable collection.

    A partitioned variable lists each part (``w/part_0:0``); the checkpoint holds it whole
    under ``save_slice_info_def.full_name``.
    """
    _checkpoints.tensorflow("--trainable-only (reading the .meta graph)", meta_path)
    from tensorflow.core.framework import variable_pb2
    from tensorflow.core.protobuf import meta_graph_pb2

    graph = meta_graph_pb2.MetaGraphDef()
    try:
        graph.ParseFromString(Path(meta_path).read_bytes())
    except Exception as exc:  # protobuf's DecodeError has no stable import path
        raise FormatError(f"not a readable MetaGraphDef ({exc})", path=meta_path) from None
    names = set()
    for raw in graph.collection_def["trainable_variables"].bytes_list.value:
        variable = variable_pb2.VariableDef.FromString(raw)
        full = variable.save_slice_info_def.full_name
        names.add(full or OUTPUT_SUFFIX.sub("", variable.variable_name))
    return names
