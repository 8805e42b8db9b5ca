"""Files TensorFlow and Keras wrote, seen with the keys of the model they are assigned into.

A Keras ``.weights.h5`` or ``.keras`` file names tensors by where Keras's saver walked
(``layers/dense/vars/0``), a TF2 object checkpoint by object-graph edges
(``model/_operations/1/_kernel``); a model's keys are layer paths (``dense/kernel``). Neither
side's names say which tensor is which variable, so nothing here guesses from names: the
model itself is walked the way the writer walked it, and the file keys it reaches are paired
with the variables it reaches them through.

- **Keras files**: Keras's own walk (``saving_lib._save_state``) runs over the model with a
  store that records each ``(path, variable)`` instead of writing anything. The walk is the
  one ``save_weights`` and ``model.save`` run, so the paths are exactly the file's.
- **TF2 object checkpoints**: TensorFlow's trackable children walk of the model runs in step
  with the checkpoint's object graph, edge name by edge name, from the node where the model
  sits (the root for ``tf.train.Checkpoint(root)``-style saves, ``model`` for
  ``Checkpoint(model=m)``: the node matching the most variables wins). A file key reaches
  its node by following its segments from the root.

File keys the walk pairs with a model variable become that variable's key; those it pairs
with something else (the optimizer's slots, its step counter) are left out, so optimizer state
is never assigned into a model by accident; file keys under the model's part of the file that
the walk never reached, other than optimizer state (anything under an ``optimizer`` edge,
which a model built without its optimizer never reaches), keep their names, so an assign
reports them as unexpected (a different architecture) instead of pairing them with some
look-alike. Where the caller asked for the optimizer state too, the file's optimizer entries
the model's optimizer does not reach keep their names as well: an optimizer of another kind
(or fewer slots) is then reported, not left with half of its state.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import weightstore
from weightstore.errors import AssignmentError, FormatError, WeightStoreError
from weightstore.formats import keras_file
from weightstore.formats._renamed import RenamedReader
from weightstore.formats.keras_preset import TASK_PREFIX, WithTaskReader, is_preset_folder, task_weights
from weightstore.formats.tf_checkpoint import CheckpointReader, resolve_prefix, saved_model_prefix
from weightstore.io.places import place_of

__all__ = ["ModelKeyedStore", "open_artifact", "is_model_file", "for_model", "keras_file_names", "is_keras_file",
           "lora_factors", "is_lora_file", "lora_file_names", "is_legacy_keras_h5", "legacy_keras_h5_error"]

_KERAS_SUFFIXES = (".keras", ".weights.h5", ".weights.json")
#: what keras-hub's ``save_lora_weights`` requires a file's name to end with
LORA_SUFFIX = ".lora.h5"
_LORA_KEY = re.compile(r"lora/([0-9]{1,9})/vars/(lora_kernel_a|lora_kernel_b)")
_LORA_RANK_KEY = "lora/vars/rank"
_NEAR_ROOT = 2  # edges from the checkpoint's root within which the model's own node is looked for
_MAX_NODES_LOOKED_AT = 10_000  # a failed pairing looks for the whole model deeper in this many nodes at most


def open_artifact(path: Any) -> weightstore.Store:
    """Any file ``ws`` reads (store, TF checkpoint, Keras file) with the file's own keys: a
    ``.keras`` archive's too (``layers/dense/vars/0``, which Keras's save walk over a model pairs
    with its variables), not the model keys :func:`weightstore.open` gives it from its config."""
    place = place_of(path) if isinstance(path, (str, os.PathLike)) else None
    if place is not None and keras_file.is_keras_archive(place.text):  # a URL: by its suffix
        # the save walk pairs the file's names with the model: a config that cannot be keyed never stops it
        reader = keras_file.KerasArchiveReader(place.source(), own_names=True)
        return weightstore.Store(reader, place.text, True, keras_file.FORMAT.name)
    store = weightstore.open(path)
    file_named = getattr(store._reader, "file_named", None)
    return store if file_named is None else weightstore.Store(file_named(), store.path, store.verify, store.format)


def is_model_file(path: Any) -> bool:
    """Whether ``path`` is a Keras file, a keras-hub LoRA file or a TF2 object checkpoint, whose
    keys need the model's structure."""
    return is_keras_file(path) or is_lora_file(path) or (isinstance(path, (str, os.PathLike)) and _object_graph(path) is not None)


def is_keras_file(path: Any) -> bool:
    """Whether ``path`` names a Keras file (``.keras``, ``.weights.h5``, a sharded ``.weights.json``,
    a keras-hub preset folder, whose weights are one of those)."""
    return isinstance(path, (str, os.PathLike)) and _is_keras(os.fspath(path))


def is_legacy_keras_h5(weights: Any) -> bool:
    """Whether ``weights`` (a path or an open Store) is a legacy Keras HDF5 file: ``model.save("m.h5")``,
    or Keras 2's ``save_weights``, whose tensors Keras pairs with layers by their order. Never raises."""
    if isinstance(weights, weightstore.Store):
        return bool(getattr(weights._reader, "legacy_keras", False))
    if not isinstance(weights, (str, os.PathLike)) or not os.fspath(weights).endswith((".h5", ".hdf5")):
        return False
    try:
        with weightstore.open(weights) as store:
            return is_legacy_keras_h5(store)
    except (OSError, WeightStoreError):
        return False


def legacy_keras_h5_error(refused: AssignmentError) -> AssignmentError:
    """Why a legacy Keras HDF5 file (:func:`is_legacy_keras_h5`) pairs with no model by its names, and what to do:
    said of an assign without ``mapping`` only; one that maps its names pairs by them, and its refusal names
    what did not pair (``b/bias`` missing), as any file's does. ``refused``'s keys are carried for callers."""
    return AssignmentError(
        "is a legacy Keras HDF5 file (model.save('m.h5'), or Keras 2's save_weights), whose tensors Keras pairs with "
        "the model's layers by their order, not by these names: load it with Keras, model.load_weights(path), then "
        "save it as weightstore pairs it: ws.save('m.npz', tf2.export(model)) or model.save_weights('m.weights.h5')",
        missing=refused.missing, unexpected=refused.unexpected, mismatched=refused.mismatched, path=refused.path)


def is_lora_file(path: Any) -> bool:
    """Whether ``path`` names a keras-hub LoRA file (``backbone.save_lora_weights``: ``.lora.h5``)."""
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(LORA_SUFFIX)


def for_model(model: Any, path: Any, model_keys: Mapping[str, Any], *, optimizer: bool = False) -> weightstore.Store:
    """The file at ``path`` as a store keyed like ``model_keys`` (key -> variable of ``model``);
    ``optimizer``: whether ``model_keys`` hold the model's optimizer state, which the file's must then match."""
    import keras

    text = os.fspath(path)
    source = open_artifact(text)
    try:
        by_variable: dict[int, str] = {}
        for key, var in model_keys.items():
            by_variable.setdefault(id(var), key)  # a variable under two keys pairs by its first
        if _is_keras(text) and not isinstance(model, keras.layers.Layer):
            raise AssignmentError(f"a Keras file pairs with the Keras model or layer that saved it, not a "
                                  f"{type(model).__name__}", path=text)
        note = ""
        if is_lora_file(text):
            if not isinstance(model, keras.layers.Layer):
                raise AssignmentError(f"a keras-hub LoRA file pairs with a keras-hub backbone, not a "
                                      f"{type(model).__name__}", path=text)
            names = lora_file_names(model, text, source, by_variable)
        elif _is_keras(text) and (backbone := _task_backbone(model, text)) is not None:
            source, names = _task_preset_names(model, backbone, text, source, by_variable, optimizer=optimizer)
        elif _is_keras(text):
            names = keras_file_names(model, source.keys(), by_variable, optimizer=optimizer)
        else:
            names = _checkpoint_names(model, text, source.keys(), by_variable, optimizer=optimizer)
            note = "" if _is_saved_model(text) else _untracked_note(model, model_keys)
    except BaseException:
        source.close()
        raise
    walk_order = {key: i for i, key in enumerate(model_keys)}  # the model's order, as tf2.export gives it
    names = dict(sorted(names.items(), key=lambda item: walk_order.get(item[0], len(walk_order))))
    store = ModelKeyedStore(RenamedReader(source._reader, names), source.path, verify=True)
    store.missing_note = note
    return store


def _task_backbone(model: Any, folder: str) -> Any:
    """The backbone of a keras-hub task ``model`` when ``folder`` is a preset, else None: a
    preset's ``model.weights.h5`` is its backbone's, which ``from_preset`` loads into the backbone."""
    import keras

    backbone = getattr(model, "backbone", None)
    if backbone is model or not isinstance(backbone, keras.layers.Layer) or not os.path.isdir(folder):
        return None
    return backbone if is_preset_folder(place_of(folder)) else None


def _task_preset_names(model: Any, backbone: Any, folder: str, source: weightstore.Store,
                       by_variable: Mapping[int, str], *, optimizer: bool) -> tuple[weightstore.Store, dict[str, str]]:
    """A task's preset as ``Task.from_preset`` loads it: the backbone's file paired by the
    backbone's save walk, and the task's own file (when there is one, under ``task/``) by the
    task's walk with the backbone's layers skipped (``load_task_weights``'s ``objects_to_skip``)."""
    names = keras_file_names(backbone, source.keys(), by_variable, optimizer=optimizer)
    task_file = task_weights(place_of(folder))
    if task_file is None:
        return source, names
    task = open_artifact(task_file.text)
    try:
        skip = {id(layer) for layer in backbone._flatten_layers()}
        own = keras_file_names(model, task.keys(), by_variable, optimizer=optimizer, skip=skip)
        joined = weightstore.Store(WithTaskReader(folder, source._reader, task._reader), folder, True)
    except BaseException:
        task.close()
        raise
    model_keys = set(by_variable.values())
    for model_key, file_key in own.items():
        # a tensor the task has no variable for keeps its (now task/) file key: reported as unexpected
        key = TASK_PREFIX + model_key if model_key == file_key and model_key not in model_keys else model_key
        names.setdefault(key, TASK_PREFIX + file_key)
    return joined, names


def _untracked_note(model: Any, model_keys: Mapping[str, Any]) -> str:
    """Why a TF2 checkpoint of ``model`` cannot hold some of its variables, or "".

    TF's object checkpoint saves what TF's trackable walk reaches; a subclassed Keras model
    that keeps layers in a plain Python list or dict attribute reaches them through Keras's
    own tracking only, so no TF2 checkpoint of the model has a node for them (Keras's own
    files do), and their variables are missing from every such checkpoint.
    """
    import tensorflow as tf

    reached = {id(obj) for obj in tf.train.TrackableView(model).descendants()}
    unreached = [key for key, var in model_keys.items() if id(var) not in reached]
    if not unreached:
        return ""
    return (f"{len(unreached)} of the model's variables ({unreached[0]!r}, …) are held where TF's checkpoint walk "
            "never looks (layers in a plain Python list or dict attribute of a subclassed model: Keras tracks them, "
            "tf.train.Checkpoint does not), so no TF2 checkpoint of this model has a node for them; save it with "
            "model.save_weights, whose file holds them, or keep those layers in attributes of their own")


def _is_keras(text: str) -> bool:
    if text.endswith(_KERAS_SUFFIXES):
        return True
    return os.path.isdir(text) and is_preset_folder(place_of(text))


def lora_file_names(model: Any, path: str, source: weightstore.Store, by_variable: Mapping[int, str]) -> dict[str, str]:
    """Model key -> file key for a keras-hub LoRA file, as ``load_lora_weights`` pairs them.

    ``save_lora_weights`` writes the rank (``lora/vars/rank``) and, for the ``i``-th layer with
    weights of the backbone's layers (``_flatten_layers``, the model left out), its factors
    ``lora/<i>/vars/lora_kernel_a`` and ``lora_kernel_b``: names repeat across a backbone, so
    layers go by that index. The model must have LoRA enabled at the file's rank (an assign
    changes no model's structure; ``load_lora_weights`` enables it where it is off). A factor
    for a layer with no LoRA keeps its file key, so the assign reports it as unexpected.
    """
    if _LORA_RANK_KEY not in source:
        raise FormatError(f"holds no {_LORA_RANK_KEY}: not a LoRA file keras-hub's save_lora_weights wrote",
                          path=path)
    rank_value = source[_LORA_RANK_KEY]
    if getattr(rank_value, "size", 0) != 1 or rank_value.dtype.kind not in "iu":
        raise FormatError(f"its LoRA rank is not one integer ({rank_value.dtype}, shape {rank_value.shape})",
                          path=path, key=_LORA_RANK_KEY)
    rank = int(rank_value.reshape(()))
    layers = [layer for layer in model._flatten_layers(include_self=False) if layer.weights]
    enabled = [layer for layer in layers if getattr(layer, "lora_enabled", False)]
    if not enabled:
        raise AssignmentError(f"holds LoRA factors of rank {rank}, and {type(model).__name__} has no LoRA-enabled "
                              f"layer to take them: call its enable_lora({rank}) first (load_lora_weights does)",
                              path=path)
    ranks = sorted({layer.lora_rank for layer in enabled})
    if ranks != [rank]:
        raise AssignmentError(f"holds LoRA factors of rank {rank}, and {type(model).__name__}'s LoRA is of rank "
                              f"{', '.join(map(str, ranks))}: call its enable_lora({rank}) on a fresh instance",
                              path=path)
    names: dict[str, str] = {}
    for file_key in source:
        if file_key == _LORA_RANK_KEY:
            continue
        hit = _LORA_KEY.fullmatch(file_key)
        index = int(hit.group(1)) if hit else len(layers)
        layer = layers[index] if index < len(layers) else None
        variable = getattr(layer, hit.group(2), None) if hit and getattr(layer, "lora_enabled", False) else None
        if variable is not None and id(variable) in by_variable:
            names[by_variable[id(variable)]] = file_key
        else:
            names.setdefault(file_key, file_key)  # a factor this model has no place for: reported as unexpected
    return names


def keras_file_names(model: Any, file_keys: list[str], by_variable: Mapping[int, str], *,
                     optimizer: bool = False, skip: set[int] | None = None) -> dict[str, str]:
    """Model key -> file key, from Keras's own save walk over ``model``.

    A file key the walk reaches through a variable of the model that is not a target (state
    ``tf2`` does not export, such as a metric's) is left out, like the optimizer's entries;
    Keras's optimizer saves copies (``variable.numpy()``), not its variables, so its
    ``optimizer/vars/<i>`` pair by key, which is how the TF2 adapter keys optimizer state.
    Anything else keeps its file key (optimizer state too, with ``optimizer``). ``skip``: ids of
    objects the walk passes over, as Keras's ``objects_to_skip`` does.
    """
    import keras

    paths = _keras_paths(model, skip)
    model_keys = set(by_variable.values())
    names: dict[str, str] = {}
    for file_key in file_keys:
        recorded = paths.get(file_key)
        if recorded is not None and id(recorded) in by_variable:
            names[by_variable[id(recorded)]] = file_key
        elif file_key in model_keys:
            names.setdefault(file_key, file_key)
        elif not isinstance(recorded, keras.Variable) and (optimizer or not _optimizer_state(file_key)):
            names.setdefault(file_key, file_key)  # a tensor this model does not have: reported as unexpected
    return names


def keras_file_keys(model: Any, variables: Iterable[Any]) -> dict[str, Any]:
    """The keys Keras's own save walk gives ``variables`` of ``model`` in its files
    (``layers/dense/vars/0``: how a ``.weights.h5`` names them), each with its variable."""
    ids = {id(var) for var in variables}
    return {path: var for path, var in _keras_paths(model).items() if id(var) in ids}


def _keras_paths(model: Any, skip: set[int] | None = None) -> dict[str, Any]:
    """File key -> variable for what ``model.save_weights`` would write, without writing anything."""
    from keras.src.saving import saving_lib

    class Recorder(saving_lib.NpzIOStore):  # ``_save_state`` accepts only Keras's own store types
        def __init__(self) -> None:
            self.entries: dict[str, dict[str, Any]] = {}
            self.names: dict[str, str] = {}  # path -> the name of the layer saved there

        def make(self, path: str, metadata: Any = None) -> dict[str, Any]:
            if metadata:
                self.names[path] = metadata.get("name")
            return self.entries.setdefault(path, {})

    recorder = Recorder()
    layers = list(model._flatten_layers(include_self=True, recursive=True))
    with _noting_lora_layers(layers) as lora_at:  # id of a store -> the LoRA layer that filled it
        saving_lib._save_state(model, weights_store=recorder, assets_store=None, inner_path="",
                               visited_saveables=set(skip or ()))
    paths = {f"{path}/vars/{name}".lstrip("/"): variable for path, entry in recorder.entries.items()
             for name, variable in (entry | _merged_into(lora_at[id(entry)], entry) if id(entry) in lora_at
                                    else entry).items()}
    # a variable outside the weights is saved as a copy of its value: found again by its layer's
    # name (which the walk passes along), where that name is the model's only layer of it
    counts = Counter(layer.name for layer in layers)
    outside = {layer.name: saved for layer in layers if counts[layer.name] == 1 and (saved := _saved_at(layer))}
    for path, name in recorder.names.items():
        for attribute, variable in outside.get(name, {}).items():
            key = f"{path}/vars/{attribute}".lstrip("/")
            if key in paths:  # where Keras saved one of that name
                paths[key] = variable
    return paths


@contextlib.contextmanager
def _noting_lora_layers(layers: list[Any]) -> Iterator[dict[int, Any]]:
    """While Keras's save walk runs, which store each LoRA-enabled layer of ``layers`` fills (by
    the store's id): the walk names a store by path only, and names repeat across an ensemble."""
    filled: dict[int, Any] = {}
    noted = [layer for layer in layers if _lora_base(layer) is not None]
    for layer in noted:
        def save_own_variables(store: Any, layer: Any = layer, own: Any = layer.save_own_variables) -> None:
            own(store)
            filled[id(store)] = layer

        object.__setattr__(layer, "save_own_variables", save_own_variables)  # past Keras's attribute tracking
    try:
        yield filled
    finally:
        for layer in noted:
            object.__delattr__(layer, "save_own_variables")


def _merged_into(layer: Any, saved: dict[str, Any]) -> dict[str, Any]:
    """The variables a LoRA layer's saved tensors go into, by the tensors' names.

    A LoRA layer saves its merged kernel (and a quantized one its merged scale), tensors
    computed at save time, where those variables go; Keras's loader writes them there (and
    zeroes the factors: :func:`lora_factors`). Each is the one variable of its shape and dtype
    that the layer saves no other way.
    """
    import keras

    factors = _own_lora_factors(layer)
    saved_ids = {id(value) for value in saved.values()}
    free = [var for var in layer.weights if id(var) not in factors and id(var) not in saved_ids]
    merged = {}
    for name, value in saved.items():
        if isinstance(value, keras.Variable):
            continue
        alike = [var for var in free if tuple(var.shape) == tuple(value.shape) and var.dtype == value.dtype]
        if len(alike) == 1:
            merged[name] = alike[0]
    return merged


def _lora_base(layer: Any) -> Any:
    """The variable a LoRA-enabled layer's factors add to (Dense's, EinsumDense's and a
    convolution's ``_kernel``, Embedding's ``_embeddings``), or None."""
    if not getattr(layer, "lora_enabled", False):
        return None
    base = getattr(layer, "_kernel", None)
    return base if base is not None else getattr(layer, "_embeddings", None)


def lora_factors(model: Any) -> dict[int, Any]:
    """id of each LoRA factor variable of ``model``'s LoRA-enabled layers -> the base variable
    it adds to. A Keras file holds the merged kernel and no factors; loading it, Keras writes the
    kernel and zeroes the factors, so the model computes what the file holds."""
    factors = {}
    for layer in model._flatten_layers(include_self=True, recursive=True):
        factors.update(_own_lora_factors(layer))
    return factors


def _own_lora_factors(layer: Any) -> dict[int, Any]:
    """:func:`lora_factors` of ``layer`` itself, not the layers below it."""
    import keras

    base = _lora_base(layer)
    if base is None:
        return {}
    return {id(value): base for name, value in vars(layer).items()
            if name.startswith("lora_") and isinstance(value, keras.Variable)}


def _saved_at(layer: Any) -> dict[str, Any]:
    """:func:`saved_outside_weights` of ``layer``, and of the layers below it under names it
    has not: a layer may save a sublayer's state as its own too (``TextVectorization`` its
    lookup layer's ``idf_weights``)."""
    found = dict(saved_outside_weights(layer))
    for child in layer._flatten_layers(include_self=False, recursive=False):
        for name, variable in _saved_at(child).items():
            found.setdefault(name, variable)
    return found


def saved_outside_weights(layer: Any) -> dict[str, Any]:
    """The TensorFlow variables ``layer`` holds outside ``layer.weights`` that Keras's files save
    (``save_own_variables`` records them under their attribute's name), by that name.

    A lookup layer in ``tf_idf`` mode keeps its ``idf_weights`` so: left out, an exported file
    lacked them and an assign kept the target's own, with other predictions. An attribute Keras
    does not save (the same layer's ``num_documents``, a count for ``adapt``) is no weight.
    """
    import tensorflow as tf

    held = {name: value for name, value in vars(layer).items() if isinstance(value, tf.Variable)}
    if not held:
        return {}
    weights = {id(w) for w in layer.weights}
    saved: dict[str, Any] = {}
    layer.save_own_variables(saved)
    return {name: var for name, var in held.items() if name in saved and id(var) not in weights}


def _object_graph(path: Any) -> Any:
    """The object graph of the TF2 checkpoint at ``path``, or None when it is not one.

    A damaged checkpoint is None too: :func:`open_artifact` then opens it with its own keys
    and its reader says what is wrong with which file. Which checkpoint a path or folder
    names is the core's rule (:func:`resolve_prefix`), the one ``ws.open`` follows, so a folder
    ``Checkpoint.write`` filled (the only checkpoint in it, no ``checkpoint`` state file) pairs
    with the model as its prefix does.
    """
    try:
        prefix = resolve_prefix(os.fspath(path))
        if prefix is None:
            return None
        reader = CheckpointReader(prefix)  # the core's parser, as ws.open reads the checkpoint's keys
    except WeightStoreError:
        return None
    reader.close()  # only the index is needed
    return reader.object_graph


def _checkpoint_names(model: Any, path: str, file_keys: list[str], by_variable: Mapping[int, str], *,
                      optimizer: bool = False) -> dict[str, str]:
    """Model key -> file key, walking ``model``'s trackable children in step with the object graph."""
    graph = _object_graph(path)
    if graph is None:
        raise FormatError("not a TF2 object checkpoint (no object graph)", path=path)
    children = [{child.local_name: child.node_id for child in node.children} for node in graph.nodes]
    saved_model = _is_saved_model(path)
    best: tuple[int, int, dict[int, Any], set[int]] | None = None
    for node in _near_root(children):
        found, reached = _match(model, node, children, saved_model=saved_model)
        score = _score(found, by_variable)
        if best is None or score > best[0]:
            best = (score, node, found, reached)
    exported = _export_archive_match(model, children)
    if exported is not None and (best is None or _score(exported[1], by_variable) > best[0]):
        home, found, reached = exported
        best = (_score(found, by_variable), home, found, reached)
    if best is None or not best[0]:
        deeper = _whole_model_deeper(model, children, by_variable, saved_model=saved_model)
        if deeper:
            where = (f"{len(deeper)} times, at {_listed_paths(deeper)} (an ensemble's members)" if len(deeper) > 1
                     else f"at {deeper[0]!r}")
            raise FormatError(
                f"the model ({type(model).__name__}) is not the checkpoint's, nor a part near its root: the checkpoint "
                f"holds it deeper, {where}; assign the checkpoint into the model that saved it, or take the part out "
                "of tf2.load(that_model, path) by its scope", path=path)
        raise FormatError(f"no part of this checkpoint has the structure of the model ({type(model).__name__}): "
                          "no variable of the model is in it", path=path)
    _, home, found, reached = best
    below_home = _descendants(home, children)
    names: dict[str, str] = {}
    for file_key in file_keys:
        leaf = _follow(file_key, children)
        variable = found.get(leaf) if leaf is not None else None
        if variable is not None and id(variable) in by_variable:
            names[by_variable[id(variable)]] = file_key
        elif (leaf is not None and leaf in below_home and leaf not in reached
              and (optimizer or not _optimizer_state(file_key))):
            names.setdefault(file_key, file_key)  # the model has nothing here: reported as unexpected
    return names


def _whole_model_deeper(model: Any, children: list[dict[str, int]], by_variable: Mapping[int, str], *,
                        saved_model: bool) -> list[str]:
    """The paths of the nodes beyond :data:`_NEAR_ROOT` that hold every variable of ``model``: a
    checkpoint of a model that holds several of it (an ensemble's), given to one member. Only
    looked for once a checkpoint has failed to pair: it walks the model from every such node."""
    near = set(_near_root(children))
    paths = {0: ""}
    order = [0]
    for node in order:  # breadth first: each node's shortest path names it
        for name, child in children[node].items():
            if child not in paths:
                paths[child] = f"{paths[node]}/{name}".lstrip("/")
                order.append(child)
    import tensorflow as tf

    edges = set(_trackable_children(tf.train.TrackableView(model), model, saved_model=saved_model))
    whole = len(set(by_variable))
    return [paths[node] for node in order[:_MAX_NODES_LOOKED_AT] if node not in near and edges <= children[node].keys()
            and _score(_match(model, node, children, saved_model=saved_model)[0], by_variable) == whole]


def _listed_paths(paths: list[str]) -> str:
    shown = ", ".join(map(repr, paths[:3]))
    return shown + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _score(found: Mapping[int, Any], by_variable: Mapping[int, str]) -> int:
    return sum(1 for variable in found.values() if id(variable) in by_variable)


def _export_archive_match(model: Any, children: list[dict[str, int]]) -> tuple[int, dict[int, Any], set[int]] | None:
    """Node -> variable for a SavedModel that Keras's ``model.export()`` wrote, or None.

    Its root is an ``ExportArchive``, not the model: ``track(model)`` lists the model's
    ``variables`` under the edge ``variables``, in the model's own order, so the ``i``-th child
    of that list is ``model.variables[i]`` (the writer's own walk, as for the other files).
    The archive's ``_all_variables`` are the serving functions' copies of those variables,
    saved with the same values: reached, but not paired a second time.
    """
    listed = children[0].get("variables") if children else None
    variables = list(getattr(model, "variables", None) or [])
    if listed is None or len(children[listed]) != len(variables) or not variables:
        return None
    if any(str(i) not in children[listed] for i in range(len(variables))):
        return None
    nodes = [children[listed][str(i)] for i in range(len(variables))]
    copies = children[0].get("_all_variables")
    reached = {0, listed, *nodes, *([copies, *children[copies].values()] if copies is not None else [])}
    return 0, {node: variable for node, variable in zip(nodes, variables, strict=True)}, reached


def _optimizer_state(file_key: str) -> bool:
    """Whether a key the model's walk did not reach lies under an optimizer (``optimizer/vars/3``).

    Keras and TF both save a model's optimizer under the edge ``optimizer``; a model built
    fresh, without that optimizer, reaches none of it, and none of it is a model weight.
    """
    return "optimizer" in file_key.split("/")


def _near_root(children: list[dict[str, int]]) -> Iterator[int]:
    frontier, seen = [0], {0}
    for _ in range(_NEAR_ROOT + 1):
        yield from frontier
        following: list[int] = []
        for node in frontier:
            following.extend(c for c in children[node].values() if c not in seen)
            seen.update(following)
        frontier = following


def _is_saved_model(path: str) -> bool:
    """Whether ``path`` names a SavedModel's folder (its checkpoint is ``variables/variables``)."""
    return os.path.isdir(path) and saved_model_prefix(path) is not None


def _match(model: Any, home: int, children: list[dict[str, int]], *,
           saved_model: bool = False) -> tuple[dict[int, Any], set[int]]:
    """Node -> variable for every variable reached walking ``model`` and the graph together from
    ``home``; ``saved_model``: the graph is a SavedModel's, whose writer also walks the layers
    Keras holds in Python lists and dicts (:func:`_trackable_children`)."""
    import keras
    import tensorflow as tf

    view = tf.train.TrackableView(model)
    found: dict[int, Any] = {}
    reached: set[int] = set()
    stack = [(model, home)]
    seen: set[int] = set()
    while stack:
        obj, node = stack.pop()
        if id(obj) in seen or node in reached:
            continue
        seen.add(id(obj))
        reached.add(node)
        edges = _trackable_children(view, obj, saved_model=saved_model)
        if isinstance(obj, (tf.Variable, keras.Variable, tf.__internal__.distribute.ShardedVariable)):
            found[node] = obj  # a ShardedVariable is one node holding the whole tensor, restored across its shards
        for name, child in edges.items():
            if name in children[node]:
                stack.append((child, children[node][name]))
    return found, reached


def _trackable_children(view: Any, obj: Any, *, saved_model: bool) -> dict[str, Any]:
    """The children TF's writer walks from ``obj``: a checkpoint's, or a SavedModel's.

    Keras 3 turns TF's attribute tracking off, so a layer's layers held in a Python list or
    dict (``self.blocks = [Dense(4), Dense(2)]``) are no checkpoint children of it.
    ``tf.saved_model.save`` asks for its children with ``save_type="savedmodel"``, and Keras's
    layer then adds those collections as plain lists and dicts (``_convert_tracked_collections``),
    which TF wraps as trackable lists (edges ``blocks/0``, ``blocks/1``). The same conversion is
    run here, without the rest of that call, which traces every ``tf.function`` of the model
    (functions hold no variables of their own).
    """
    import tensorflow as tf

    edges = dict(view.children(obj))
    convert = getattr(obj, "_convert_tracked_collections", None) if saved_model else None
    if convert is not None:
        collections: dict[str, Any] = {}
        convert(collections)
        for name, value in collections.items():
            if name not in edges:
                edges[name] = tf.__internal__.tracking.wrap(value)
    return edges


def _descendants(home: int, children: list[dict[str, int]]) -> set[int]:
    found, stack = {home}, [home]
    while stack:
        for child in children[stack.pop()].values():
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _follow(file_key: str, children: list[dict[str, int]]) -> int | None:
    node: int | None = 0
    for segment in file_key.split("/"):
        node = children[node].get(segment)  # type: ignore[index]  # None ends the loop below
        if node is None:
            return None
    return node


class ModelKeyedStore(weightstore.Store):
    """A file's tensors under the keys of the model they were paired with by structure.

    Such keys match exactly or not at all, so an assign error offers no "did you mean" hints
    between a model key and a file key that merely looks alike (``gamma`` and ``vars/3``).
    """

    exact_keys = True
    missing_note = ""  # why some of the model's variables cannot be in the file (see _untracked_note)
