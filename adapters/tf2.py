"""Eager TensorFlow in and out: Keras 3 models and layers, ``tf.Module``s, lists and dicts of variables.

How keys are formed (the object you pass is the root; its own name is never part of a key):

- **Keras layers and models**: the path of layer names from the root down, then the
  variable's name: ``dense/kernel``, ``conv_1/bn/moving_mean``. A name the user chose is kept
  as is. A name Keras made up (``dense_7``: the snake-cased class name, optionally with
  ``_<n>`` from Keras's one counter per process; ``forward_``/``backward_`` before it for a
  ``Bidirectional``'s copies) is renumbered over the whole root in Keras's own order (see
  :class:`_Naming`): the names Keras would have given had the root been the first model of
  its process. So the first model built in a process has the keys ``model.summary()``
  shows, and every later instance of its architecture the same keys. (A name the user typed
  that looks automatic, like ``dense_5``, is renumbered too.) Variables come from
  ``layer.weights``: trainable and non-trainable weights such as batch-norm statistics,
  never optimizer, metric or random-seed state (pass ``model.optimizer.variables``, a list,
  to export those). Keys of earlier releases (automatic names renumbered per parent, in layer order) and, under
  ``scope``, the keys a part has as its own root still assign: a value whose key names no
  variable pairs with the one that key named then, if that one has no value of its own.
- **tf.Module**: the attribute path, as ``tf.train.Checkpoint`` walks it: ``encoder/w``,
  ``layers/0/b``. Keras layers found on the way continue with the Keras rule. A variable
  reachable along several paths gets the first in ``tf.Module``'s traversal order.
- **A loaded SavedModel** (``tf.saved_model.load``): the keys its folder's variables
  checkpoint has (``ws ls dir``); a variable both the model and its optimizer hold is keyed
  by the model (:mod:`weightstore.formats.tf_checkpoint`).
- **A list of variables**: each variable's own name (``dense/kernel:0`` becomes
  ``dense/kernel``; a Keras variable's ``path``); two with the same name are refused.
  **A dict**: its own keys.

- **Optimizer state** (``optimizer=True`` on ``export``/``assign``/``load``): a compiled
  model's optimizer variables as ``optimizer/vars/<i>``, in ``optimizer.variables`` order,
  the names Keras's own files give them. A mixed-precision model's ``LossScaleOptimizer``
  lists the slots of the optimizer it wraps among its own, and Keras saves them again as
  ``optimizer/inner_optimizer/vars/<i>``: an assign takes either key (or both) as the
  variable's value, an export writes each variable once. Left out otherwise.

Keras files and TF2 object checkpoints given to ``assign`` or :func:`load` are paired with the
model by its own structure, not by names (:mod:`weightstore.adapters._artifacts`), and come
out under these keys.

Distributed variables are one key each: a ``MirroredVariable`` exports its value once and an
assign reaches every replica; a ``ShardedVariable`` exports as one whole tensor and is
assigned back across its shards.

A plain resource variable gets each value the way ``tf.train.Checkpoint`` restores it: one
copy into a fresh tensor, which ``AssignVariableOp`` adopts as the variable's buffer (the old
one is freed), rather than ``variable.assign(ndarray)``, which copies the value into a
temporary tensor and that into the variable. The fresh tensor comes from TensorFlow's own
allocator (:mod:`weightstore.adapters._tf_staging`), so the freed buffers are reused for the
next values instead of staying in its pool: the process does not end up holding the model
twice (values of 1 MiB or more; smaller ones are copied into fresh aligned numpy memory, which
costs less for them). The copy is skipped only for arrays nothing else holds (a follower's
staged version, :func:`~weightstore.adapters.skeleton.handed_over`): an adopted read-only map
of the file would crash the next in-place update, an adopted caller's array would change with
it. Values under 64 KiB go in groups of one dtype and shape instead: stacked into one new
array, converted once and split by one ``Unpack`` into tensors TF owns (per-op overhead, not
bytes, is what a small tensor costs). Distributed variables, and subclasses with an ``assign``
of their own, get ``assign``.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple, Union

import numpy as np
from typing_extensions import Unpack

from weightstore.core._extras import needs

with needs("tf", __name__):
    import keras
    import tensorflow as tf
    from keras.src.backend.common.stateless_scope import in_stateless_scope
    from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable

import weightstore
from weightstore.adapters._artifacts import (
    for_model,
    is_keras_file,
    is_legacy_keras_h5,
    is_lora_file,
    is_model_file,
    keras_file_keys,
    keras_file_names,
    legacy_keras_h5_error,
    lora_factors,
    saved_outside_weights,
)
from weightstore.adapters._reload import MEMORY
from weightstore.adapters._report import Plan, TargetInfo
from weightstore.adapters._tf_staging import staged_copy
from weightstore.adapters._values import RenamedValues
from weightstore.adapters._wording import member_scopes, of_those
from weightstore.adapters.plan import (
    INNER_OPTIMIZER,
    OPTIMIZER_KEY,
    OPTIMIZER_SCOPE,
    AssignOptions,
    AssignWords,
    Report,
    Selection,
    SelectionWords,
    plan_assign,
    settle_tied,
    training_state,
)
from weightstore.adapters.skeleton import Target, private_copy, run_assign
from weightstore.core.keys import (
    OUTPUT_SUFFIX,
    Patterns,
    in_scope,
    join_scope,
    normalize_scope,
    passes,
    strip_scope,
    validate_key,
)
from weightstore.errors import AssignmentError, InvalidKeyError, SelectionError, WeightStoreError
from weightstore.formats._keras_naming import Ranking, as_own_root, automatic, deduplicated, pairs, snake_case
from weightstore.formats.tf_checkpoint import best_paths
from weightstore.sharded._shards import Piece

__all__ = ["export", "export_pieces", "assign", "load", "keys", "variables", "forget", "publish_sharded"]

Variable = Union[tf.Variable, keras.Variable, "tf.__internal__.distribute.ShardedVariable"]
_SHARDED = tf.__internal__.distribute.ShardedVariable
_VARIABLE_TYPES = (tf.Variable, keras.Variable, _SHARDED)
_TRACKABLE = tf.__internal__.tracking.AutoTrackable
_KERAS_LAYOUT = re.compile(r"(?:.+/)?vars/[^/]+")  # Keras's file names: layers/dense/vars/0, optimizer/vars/3
_MEMBER_OF_KERAS_NAME = re.compile(r"(.+?)/(?:layers|optimizer|vars)/")  # model_001 of model_001/layers/dense/vars/0
_PART_SUFFIX = re.compile(r"/part_\d+$")
_GROUPED_BELOW = 1 << 16  # values under this many bytes are written in groups (see _write_batch)
_GROUP = 64  # most values per group: as fast per variable as larger groups, and a cheap kernel to build


def variables(obj: Any, *, optimizer: bool = False, **selection: Unpack[SelectionWords]) -> dict[str, Variable]:
    """Key -> variable for what :func:`export` and :func:`assign` see in ``obj`` under the same
    words (keys relative to ``scope``); without words, every variable.

    A variable under two keys (a ``LossScaleOptimizer``'s slots, as its inner optimizer's too)
    is here under both, as :func:`assign` takes a value under either; :func:`export` writes it
    under the first. An unbuilt Keras model has none yet (an empty dict).
    """
    found, plan = _chosen(obj, optimizer, Selection.of("tf2.variables", selection, variables))
    return {new: found[old][0] for new, old in plan.items()}


def keys(obj: Any, *, optimizer: bool = False) -> list[str]:
    """The keys :func:`export` and :func:`assign` give ``obj``'s variables, in walk order.

    List them before writing ``include``, ``also`` or ``mapping``: for a model built first in
    its process they are the layer names ``model.summary()`` shows, joined by ``/``.
    """
    return list(_collect(obj, optimizer))


def export(obj: Any, *, optimizer: bool = False, **selection: Unpack[SelectionWords]) -> dict[str, np.ndarray]:
    """A new weight dictionary of ``obj``'s variables under ``scope`` (keys relative to it, as
    the layer or module there keys its own: ``export(ensemble, scope="member_2")`` is
    ``export(member_2)``, whose automatic names are numbered from itself).

    With ``trainable_only``, keeps the trainable variables plus those whose key matches
    ``also`` (``also="*/bn/moving_*"`` adds batch-norm statistics). With ``optimizer``, a
    Keras model's optimizer state comes too, as ``optimizer/vars/<i>`` (the order and names
    Keras's own files use).
    """
    return {key: _read(var) for key, var in _selected(obj, optimizer, Selection.of("tf2.export", selection, export)).items()}


def export_pieces(obj: Any, *, rank: int = 0, world: int = 1, optimizer: bool = False,
                  **selection: Unpack[SelectionWords]) -> dict[str, list[Piece]]:
    """What this worker writes of ``obj`` to a sharded version: key -> its
    :class:`~weightstore.Piece` s, for :func:`weightstore.publish_shard`. Keys and words are
    :func:`export`'s.

    Alone (``rank=0, world=1``, the default) every variable is one piece holding all of it, but
    a ``ShardedVariable`` (``ParameterServerStrategy``'s), which comes shard by shard, each at
    its offset, never joined; a ``MirroredVariable`` is read from this replica. Under
    ``MultiWorkerMirroredStrategy``, where every worker holds every value, pass the worker's
    ``rank`` and ``world``: each gets the share the plan
    cuts for it (about ``1/world`` of the bytes), read from its own replica, so no tensor
    crosses the network. :func:`publish_sharded` does all of that on every worker, agreeing
    the attempt through TensorFlow's coordination service too.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of world {world}'s ranks (0 to {world - 1})")
    return share(_selected(obj, optimizer, Selection.of("tf2.export_pieces", selection, export_pieces)), rank, world)


def selected(obj: Any, *, optimizer: bool = False, **selection: Unpack[SelectionWords]) -> dict[str, Variable]:
    """Key -> variable for exactly what :func:`export` reads with the same words (for snapshots)."""
    return _selected(obj, optimizer, Selection.of("tf2.selected", selection, selected))


def _selected(obj: Any, optimizer: bool, selection: Selection) -> dict[str, Variable]:
    found, plan = _chosen(obj, optimizer, selection)
    once = _tied(found)  # a variable under two keys (a wrapped optimizer's slots) is exported under its first
    chosen = {new: found[old][0] for new, old in plan.items() if old not in once}
    if not chosen:
        why = "no variables (build a Keras model before exporting it)" if not found else "no variable passes the selection"
        raise SelectionError(f"{_describe(obj)} has {why}")
    return chosen


def _chosen(obj: Any, optimizer: bool, chosen_by: Selection) -> tuple[dict[str, tuple[Variable, bool]], dict[str, str]]:
    """``obj``'s variables by key (under a scope, keyed as that part keys its own: what
    ``tf2.export(part)`` gives, and what assigns into any instance of it) and what ``chosen_by``
    keeps of them: output key -> key."""
    found = _collect(obj, optimizer)
    found, _, _ = _keyed_as_part(obj, normalize_scope(chosen_by.scope), found, {})
    return found, chosen_by.choose(found, lambda key: found[key][1], _describe(obj))


def assign(obj: Any, weights: Any, *, optimizer: bool = False, **words: Unpack[AssignWords]) -> Report:
    """Write ``weights`` (a dict, path, open Store or Version) into ``obj``'s variables.

    Plans first (see :mod:`weightstore.adapters.plan`): a strict failure raises ``AssignmentError`` with every
    problem and changes nothing. Every value is read, and its checksum verified, before the
    first variable changes (then they are written in batches of bounded memory, see
    :func:`weightstore.adapters.skeleton.run_assign`). With ``skip_unchanged`` (default: only
    for Versions), variables that last received the very same bytes are left alone and listed
    in ``report.skipped``.

    A Keras file (``save_weights``'s ``.weights.h5``, ``model.save``'s ``.keras``) or a TF2
    object checkpoint (``tf.train.Checkpoint``, a prefix or its folder) is paired with
    ``obj``'s variables by ``obj``'s own structure,
    so it assigns into any instance of the architecture. With ``scope``, the file is one of
    the part of ``obj`` at that scope (one member of an ensemble). Optimizer state in the file
    is left out unless ``optimizer=True`` (then the model's optimizer must be built:
    ``model.optimizer.build(model.trainable_variables)``).

    That memory only knows what weightstore assigned: after anything else writes the
    variables (training, ``var.assign``, ``model.load_weights``, a checkpoint restore), call
    :func:`forget` (or pass ``skip_unchanged=False``), or a version with the old bytes is skipped
    and the variable keeps the other value.
    """
    found, aliases = _collect_with_aliases(obj, optimizer)
    if not found and isinstance(obj, keras.layers.Layer) and not obj.built:
        raise AssignmentError(f"cannot assign into {_describe(obj)}: it is not built, so it has no variables yet; "
                              "build it first (call it on a batch of inputs, or model.build(input_shape))")
    options = AssignOptions.of("tf2.assign", words, assign)
    at = normalize_scope(options.scope)
    found, aliases, rekey = _keyed_as_part(obj, at, found, aliases)
    targets = {
        key: TargetInfo(key, _numpy_dtype(var), _shape(var), trainable) for key, (var, trainable) in found.items()
    }

    written: set[int] = set()

    def write(batch: list[tuple[str, np.ndarray]], report: Report) -> list[str]:
        _write_batch([(found[key][0], array) for key, array in batch])
        written.update(id(found[key][0]) for key, _ in batch)
        return [key for key, _ in batch]

    tied = _tied(found)  # a value under either key of a variable is its value: a file may hold one or both
    # a Keras file (or a store keyed as one) holds a LoRA layer's merged kernel and no factors,
    # which its loader zeroes
    lora = _lora_keys(obj, found)
    keras_keyed = is_keras_file(weights)  # or found so by the plan
    # a keras-hub LoRA file holds the LoRA factors alone: the model's other variables keep theirs
    adapter_only = is_lora_file(weights)

    def plan(values: Any, options: AssignOptions) -> tuple[Plan, Any]:
        nonlocal keras_keyed
        keras_view = _keras_layout_renamed(values, obj, found, options, optimizer)
        keras_keyed = keras_keyed or keras_view is not None
        view = (keras_view
                or _whole_keys_renamed(values, rekey, targets, options)
                or _own_root_renamed(values, obj, targets, options)
                or _old_keys_renamed(values, aliases, targets, options))
        left_out = () if optimizer else training_state(view.keys(), targets, options.scope, options.mapping)
        planned = plan_assign(view, targets, options, left_out=left_out, tied=tied,
                              optional=(lambda key: key not in lora) if adapter_only
                              else lora.__contains__ if keras_keyed else None)
        settle_tied(planned, view, targets, tied, strict=options.strict)
        return planned, view

    target = Target(targets, write, slot=lambda key: (found[key][0], ""), plan=plan, batched=True)
    try:
        if not _structured(obj, weights):
            try:
                report = run_assign(target, weights, options)
            except AssignmentError as error:
                if options.mapping or not is_legacy_keras_h5(weights):  # a mapping of its names: as any file's
                    raise
                raise legacy_keras_h5_error(error) from error
        else:
            try:
                with for_model(_part_at(obj, at), weights, {strip_scope(key, at): var for key, (var, _) in found.items()
                                                             if in_scope(key, at) and key != at},
                               optimizer=optimizer) as paired:
                    report = run_assign(target, paired, options, skip_for=weights)
            except AssignmentError as error:
                members, fitting, own_names = ([], [], False) if at else _ensemble_file_members(obj, weights, found,
                                                                                                 targets)
                if len(members) < 2:
                    raise
                fix = (f"assign one member, ws.load(path, scope={fitting[0]!r}) (`ws export --scope` writes its file)"
                       if fitting else "none of them has the model's shapes: the model is none of the members")
                notes = "; ".join(filter(None, ["Keras names the members by their class, in layer order" if own_names
                                                else "", of_those(members, fitting, "model")]))
                raise AssignmentError(
                    f"holds an ensemble, the model's variables under each of {', '.join(map(repr, members[:3]))}"
                    f"{' and more' if len(members) > 3 else ''}{f' ({notes})' if notes else ''}: {fix}",
                    missing=error.missing, unexpected=error.unexpected, mismatched=error.mismatched,
                    path=error.path) from error
        if keras_keyed:
            _zero_lora_factors(lora, found, written, report, options)
        return report
    finally:  # after a partial failure too: the layers hold what their variables now hold
        _finalize(obj, written)


def load(obj: Any, path: Any, *, include: Patterns = None, exclude: Patterns = None,
         optimizer: bool = False) -> dict[str, np.ndarray]:
    """The weights in ``path`` keyed as ``export(obj)`` keys ``obj``'s variables: ``ws.load`` with a model at hand.

    For a Keras file or TF2 object checkpoint the keys come from ``obj``'s structure, as
    :func:`assign` pairs them (tensors the model has no variable for keep their file keys;
    optimizer state is left out unless ``optimizer``); any other file is read with its own keys.
    """
    if not _structured(obj, path):
        return weightstore.load(path, include=include, exclude=exclude)
    with for_model(obj, path, variables(obj, optimizer=optimizer), optimizer=optimizer) as store:
        return {key: np.array(store[key]) for key in store if passes(key, include, exclude)}


def forget(obj: Any) -> None:
    """Forget what ``obj``'s variables last received, so the next assign writes them all (no skips).

    Call it after they were changed outside weightstore (training, ``var.assign``, restores):
    hot reload would otherwise trust the old checksums. Accepts what :func:`assign` accepts. A
    Keras model's optimizer state is forgotten too: training changed it with the weights.
    """
    found = variables(obj)
    with contextlib.suppress(SelectionError):  # no built optimizer: nothing of it was remembered
        found.update(_optimizer_variables(obj))
    for var in found.values():
        MEMORY.forget(var)


def _ensemble_file_members(obj: Any, weights: Any, found: Mapping[str, tuple[Any, bool]],
                           targets: Mapping[str, TargetInfo]) -> tuple[list[str], list[str], bool]:
    """The scopes of a Keras file that each hold a copy of the model's variables by key (its save
    walk pairs none of them with a lone member), those of them that hold each variable's shape
    too (members of other widths share every key), and whether they are Keras's own names: a
    ``.keras`` archive is read by its config's keys (``model_002/dense/kernel``), a
    ``.weights.h5`` by Keras's (``layers/sequential_1/layers/dense/vars/0``); ([], [], False) for
    any other file."""
    if not is_keras_file(weights):
        return [], [], False
    try:
        with weightstore.open(weights) as store:
            shapes = {key: store.info(key).shape for key in store}
    except (OSError, WeightStoreError):
        return [], [], False
    keys = set(shapes)
    members = member_scopes(keys - set(targets), set(targets))
    if len(members) > 1 or not isinstance(obj, keras.layers.Layer):
        fitting = member_scopes(keys - set(targets), set(targets), shapes.get, lambda key: targets[key].shape)
        return members, fitting, False
    own = keras_file_keys(obj, (var for var, _ in found.values()))
    fitting = member_scopes(keys - own.keys(), own.keys(), shapes.get, lambda key: tuple(own[key].shape))
    return member_scopes(keys - own.keys(), own.keys()), fitting, True


def _structured(obj: Any, weights: Any) -> bool:
    """Whether ``weights`` names a file whose keys must come from ``obj``'s structure."""
    return isinstance(obj, (keras.layers.Layer, tf.Module)) and is_model_file(weights)


def _part_at(obj: Any, scope: str) -> Any:
    """The layer or module of ``obj`` whose variables' keys are those under ``scope``."""
    part = obj
    naming = _Naming(obj)
    for segment in scope.split("/") if scope else []:
        if isinstance(part, keras.layers.Layer):
            children = list(part._flatten_layers(include_self=False, recursive=False))
            named = dict(zip(naming.segments(children), children, strict=True))
        else:
            named = {segment: getattr(part, segment)} if isinstance(getattr(part, segment, None), tf.Module) else {}
        if segment not in named:
            raise SelectionError(f"{_describe(obj)} has no layer or module at scope {scope!r} to pair a file with")
        part = named[segment]
    return part


def _part_keys(obj: Any, scope: str, found: Mapping[str, tuple[Variable, bool]]) -> dict[str, str]:
    """For an assign under ``scope``: the key each variable there has when its part is the root
    (``tf2.export(member)``), under the scope -> its key in ``obj``, where the two differ.

    Automatic names are numbered from the root, so one member of an ensemble is ``dense_3`` in
    the ensemble but ``dense`` on its own; its own file assigns into any member by ``scope``.
    """
    if not scope or not isinstance(obj, (keras.layers.Layer, tf.Module)):
        return {}
    try:
        part = _part_at(obj, scope)
    except SelectionError:  # no layer or module there: the plan says what is wrong with the scope
        return {}
    if not isinstance(part, (keras.layers.Layer, tf.Module)):
        return {}
    full = {id(var): key for key, (var, _) in found.items()}
    return {join_scope(scope, key): full[id(var)] for key, (var, _) in _collect(part).items()
            if id(var) in full and join_scope(scope, key) != full[id(var)]}


def _keyed_as_part(obj: Any, scope: str, found: dict[str, tuple[Variable, bool]], aliases: dict[str, str]
                   ) -> tuple[dict[str, tuple[Variable, bool]], dict[str, str], dict[str, str]]:
    """For an assign under ``scope``: the part's variables keyed as the part keys its own (under
    the scope), as :func:`export` with ``scope`` keys them, so ``include``, ``exclude`` and
    ``also`` pick the same variables in both; the aliases then name the keyed variables; and
    the whole model's key -> the part's own, where they differ (see :func:`_whole_keys_renamed`)."""
    own = _part_keys(obj, scope, found)  # the part's own key -> the whole model's, where they differ
    if not own:
        return found, aliases, {}
    rekey = {whole: part for part, whole in own.items()}
    aliases = {old: rekey.get(new, new) for old, new in aliases.items()}
    aliases.update(rekey)
    return {rekey.get(key, key): entry for key, entry in found.items()}, aliases, rekey


def _whole_keys_renamed(values: Any, rekey: Mapping[str, str], targets: Mapping[str, TargetInfo],
                        options: AssignOptions) -> Any:
    """``values`` named by the whole model's keys (``tf2.export(ensemble)`` with the scope cut
    off) renamed to the part's own, where more of them pair so than as they are; None otherwise.

    Both namings are one key apart in a member whose layers the ensemble numbers on: the
    member's own ``dense_1`` is its second Dense, the ensemble's ``dense_1`` its first. A file
    pairs whole in the one it was written in, and only partly, and with the wrong layers, in
    the other. Not with ``mapping``, which renames keys on purpose.
    """
    if not rekey or options.mapping:
        return None
    return _renamed_where_more_pair(values, normalize_scope(options.scope), rekey, targets)


def _renamed_where_more_pair(values: Any, at: str, renames: Mapping[str, str],
                             targets: Mapping[str, TargetInfo]) -> Any:
    """``values`` with every key (under ``at``) that ``renames`` names (full key -> full key)
    renamed, where more of them pair with ``targets`` so than as they are and no two meet;
    None otherwise: the naming a file was written in is the one it pairs whole in."""
    keys = values.keys()  # a ValueSource: keys(), not iteration
    full = [join_scope(at, key) for key in keys]
    renamed = [renames.get(name, name) for name in full]
    if len(set(renamed)) < len(renamed) or sum(name in targets for name in renamed) <= sum(
            name in targets for name in full):
        return None
    return RenamedValues(values, {key: strip_scope(renames[name], at) for key, name in zip(keys, full, strict=True)
                                  if name in renames})


def _own_root_renamed(values: Any, obj: Any, targets: Mapping[str, TargetInfo], options: AssignOptions) -> Any:
    """``values`` keyed as a larger model numbers a part of it (``ws.load("ensemble.keras",
    scope="member_1")``: ``sequential_1/dense_3``, the ensemble's numbering with the scope cut off)
    renamed as the part numbers its own (``sequential/dense``); None unless the keys so renamed
    pair with every variable of the part one to one, each of its shape (:func:`pairs`), where
    they do not all name variables as they are. Optimizer state (``optimizer/vars/<i>``, numbered
    by the optimizer, not by layers) is neither ranked nor counted on either side: a lone model
    assigned with ``optimizer=True`` has slots that a member read out of its ensemble's file
    never holds (the ensemble's optimizer state is the ensemble's), and the plan names them.

    Renamed by :func:`~weightstore.formats._keras_naming.as_own_root`, which ranks the values'
    own keys: a subset ranks as if it were all the part had, and chosen names (``layer_2``
    beside ``layer_10``) rank too, so only a renaming that pairs whole is taken, never one that
    pairs a value with another layer's variable. Only for a Keras model, and not with
    ``mapping``, which renames keys on purpose.
    """
    keys = values.keys()  # a ValueSource: keys(), not iteration
    at = normalize_scope(options.scope)
    if options.mapping or not isinstance(obj, keras.layers.Layer):
        return None
    if all(map(targets.__contains__, [join_scope(at, key) for key in keys] if at else keys)):  # the usual case
        return None
    layers = [key for key in keys if not OPTIMIZER_KEY.fullmatch(key)]  # optimizer state has no layer to rank
    renames = as_own_root(layers)
    part = {key: info.shape for key, info in targets.items()
            if in_scope(key, at) and key != at and not OPTIMIZER_KEY.fullmatch(strip_scope(key, at))}
    if not renames or not pairs(((join_scope(at, renames.get(key, key)), tuple(values.shape(key))) for key in layers),
                                part, whole=True):
        return None
    return RenamedValues(values, renames)


def _keras_layout_renamed(values: Any, obj: Any, found: Mapping[str, tuple[Variable, bool]],
                          options: AssignOptions, optimizer: bool) -> Any:
    """``values`` keyed as a Keras file keys its tensors (``layers/dense/vars/0``: what ``ws export
    x.weights.h5`` writes without a model), renamed to the model's keys by Keras's own save walk
    over the model (or its part at ``scope``), as the Keras file itself would be; None for other keys.

    Keys the walk does not reach keep their names, so a store of another architecture is
    reported as such rather than paired by position; optimizer state is listed as left out
    unless ``optimizer``.
    """
    keys = values.keys()
    if (not isinstance(obj, keras.layers.Layer) or options.mapping or not keys
            or not all(_KERAS_LAYOUT.fullmatch(key) for key in keys)
            or any(key in found and not OPTIMIZER_KEY.fullmatch(key) for key in keys)):
        return None
    at = normalize_scope(options.scope)
    try:
        part = _part_at(obj, at)
    except SelectionError:
        return None
    by_variable = {id(var): strip_scope(key, at) for key, (var, _) in found.items() if in_scope(key, at) and key != at}
    names = keras_file_names(part, keys, by_variable, optimizer=optimizer)  # model key -> file key
    renames = {file_key: model_key for model_key, file_key in names.items() if model_key != file_key}
    state = {key for key in keys if OPTIMIZER_KEY.fullmatch(key)}  # kept, for the plan to list as left out
    if not renames:
        names, state = _members_keras_named(part, keys, by_variable, optimizer)
        renames = {file_key: model_key for model_key, file_key in names.items() if model_key != file_key}
    return RenamedValues(values, renames, keep=set(names.values()) | state)


def _members_keras_named(part: Any, keys: list[str], by_variable: Mapping[int, str],
                         optimizer: bool) -> tuple[dict[str, str], set[str]]:
    """Model key -> value key for values keyed as Keras files key their tensors, each member's under
    its scope (``model_001/layers/dense/vars/0``: what ``ws import m.weights.h5 --into ens.npz
    --scope model_001`` writes), paired by Keras's save walk over the member at that scope, as the
    member's own file would be; and the members' optimizer state, kept for the plan to list as
    left out. A scope that names no layer of ``part`` keeps its keys as they are."""
    by_scope: dict[str, list[str]] = {}
    for key in keys:
        found = _MEMBER_OF_KERAS_NAME.match(key)
        by_scope.setdefault(found.group(1) if found else "", []).append(key)
    names: dict[str, str] = {}
    state: set[str] = set()
    model_keys = set(by_variable.values())
    for scope, under in by_scope.items():
        try:
            member = _part_at(part, scope) if scope else None
        except SelectionError:
            member = None
        if member is None:
            names.update({key: key for key in under})
            continue
        own = [strip_scope(key, scope) for key in under]
        for model_key, file_key in keras_file_names(member, own, by_variable, optimizer=optimizer).items():
            names[model_key if model_key in model_keys else join_scope(scope, model_key)] = join_scope(scope, file_key)
        state.update(join_scope(scope, key) for key in own if OPTIMIZER_KEY.fullmatch(key))
    return names, state


def _old_keys_renamed(values: Any, aliases: Mapping[str, str], targets: Mapping[str, TargetInfo],
                      options: AssignOptions) -> Any:
    """``values`` with the keys earlier releases gave the model's variables renamed to today's.

    Where more values pair under the old keys than as they are, the file was written with them,
    and every value with an old key is renamed: a key valid in both namings may name another
    layer in each (a nested model's old ``dense_1`` is today's ``dense_2``, and today's
    ``dense_1`` its old ``dense``). Otherwise a value pairs by its old key only where it names
    no variable as it is and the variable it names the old way has no value of today's key: a
    file exported from one part of a model (a member of an ensemble) and assigned into
    another with ``scope=``, whose keys the part had when keyed on its own. Not with
    ``mapping``, which renames keys on purpose.
    """
    if options.mapping:
        return values
    at = normalize_scope(options.scope)
    within = {old: new for old, new in aliases.items() if in_scope(new, at) and new != at}
    whole = _renamed_where_more_pair(values, at, within, targets)
    if whole is not None:
        return whole
    keys = values.keys()
    present = {join_scope(at, key) for key in keys}
    renames = {}
    for key in keys:
        full = join_scope(at, key)
        new = within.get(full)
        if full not in targets and new is not None and new not in present:
            renames[key] = strip_scope(new, at)
    return RenamedValues(values, renames) if renames else values


def _lora_keys(obj: Any, found: Mapping[str, tuple[Variable, bool]]) -> dict[str, Variable]:
    """Key of each LoRA factor among ``found`` -> the base variable it adds to."""
    if not isinstance(obj, keras.layers.Layer):
        return {}
    factors = lora_factors(obj)
    return {key: factors[id(var)] for key, (var, _) in found.items() if id(var) in factors}


def _zero_lora_factors(lora: Mapping[str, Variable], found: Mapping[str, tuple[Variable, bool]],
                       written: set[int], report: Report, options: AssignOptions) -> None:
    """Zero the LoRA factors a Keras file left without values, where it paired their base kernel,
    as Keras's loader does: the kernel it holds is the merged one, so the factors must add
    nothing. Only factors the assign selected (``exclude="*/lora_*"`` keeps an adapter's); each
    is listed as assigned, and hot reload's memory of it forgotten."""
    at = normalize_scope(options.scope)
    key_of = {id(var): key for key, (var, _) in found.items()}
    paired = {*report.assigned, *report.skipped}
    for key, base in lora.items():
        selected = in_scope(key, at) and passes(strip_scope(key, at), options.include, options.exclude)
        if selected and key_of.get(id(base)) in paired and key not in paired:
            factor = found[key][0]
            factor.assign(tf.zeros(factor.shape, factor.dtype))
            MEMORY.forget(factor)
            written.add(id(factor))
            report.assigned.append(key)


def _finalize(obj: Any, written: set[int]) -> None:
    """Let each Keras layer that derives state from variables just written recompute it.

    An adapted ``Normalization`` divides by constants made from its ``mean`` and ``variance``
    variables when it was adapted or built, not by the variables: writing them changes nothing
    it computes until ``finalize_state()`` runs again. Keras's loaders run it after loading a
    layer's variables (``saving_lib`` through the layer's own ``load_own_variables``, the
    legacy HDF5 loader for every layer that has the method and received weights), which is
    the rule here: any layer with a ``finalize_state`` one of whose variables was written.
    Among Keras's own layers that is ``Normalization``, and a lookup layer in ``tf_idf`` mode,
    whose ``idf_weights`` (a variable outside its weights that Keras saves) it reads as a
    constant; ``Discretization`` keeps its bins and the lookup layers their vocabulary outside
    their variables (config, assets), so an assign leaves those as the target has them, as
    ``load_weights`` does. A dict or list of
    variables names no layers, so nothing is finalized for it.
    """
    if not written:
        return
    for layer in _keras_layers(obj):
        finalize = getattr(layer, "finalize_state", None)
        if callable(finalize) and any(id(var) in written
                                      for var in (*layer.weights, *saved_outside_weights(layer).values())):
            finalize()


def _keras_layers(obj: Any) -> list[keras.layers.Layer]:
    """Every Keras layer in ``obj`` (a layer and all below it, or those a ``tf.Module`` holds)."""
    if isinstance(obj, keras.layers.Layer):
        return list(obj._flatten_layers(include_self=True, recursive=True))
    if isinstance(obj, tf.Module):
        tops = obj._flatten(predicate=lambda x: isinstance(x, keras.layers.Layer))
        return [layer for top in tops for layer in top._flatten_layers(include_self=True, recursive=True)]
    return []


def _optimizer_variables(obj: Any) -> Iterator[tuple[str, Variable]]:
    """A compiled Keras model's optimizer variables under the keys Keras's own files give them.

    Keras saves an optimizer's ``variables`` as ``optimizer/vars/<i>``, then each optimizer it
    wraps again below its own edge: a ``LossScaleOptimizer`` (mixed precision) lists the inner
    optimizer's slots among its own and saves them a second time as
    ``optimizer/inner_optimizer/vars/<i>``. Both keys name the same variable, so a Keras file
    pairs whole and a store exported here reads back into Keras's layout.
    """
    optimizer = getattr(obj, "optimizer", None)
    variables = list(getattr(optimizer, "variables", None) or [])
    if not variables or not getattr(optimizer, "built", True):  # unbuilt: its step and rate, none of its slots
        raise SelectionError(f"{_describe(obj)} has no built optimizer: compile it and build its optimizer "
                             "(model.optimizer.build(model.trainable_variables)) before asking for optimizer=True")
    for i, var in enumerate(variables):
        yield f"{OPTIMIZER_SCOPE}/vars/{i}", var
    inner = getattr(optimizer, INNER_OPTIMIZER, None)
    for i, var in enumerate(getattr(inner, "variables", None) or []):
        yield f"{OPTIMIZER_SCOPE}/{INNER_OPTIMIZER}/vars/{i}", var


def _collect(obj: Any, optimizer: bool = False) -> dict[str, tuple[Variable, bool]]:
    """Key -> (variable, trainable), by the rules in the module docstring."""
    return _collect_with_aliases(obj, optimizer)[0]


def _collect_with_aliases(obj: Any, optimizer: bool = False) -> tuple[dict[str, tuple[Variable, bool]], dict[str, str]]:
    """:func:`_collect`, and the keys earlier releases gave the same variables (old key -> key, where they differ)."""
    found: dict[str, tuple[Variable, bool]] = {}
    aliases: dict[str, str] = {}
    if isinstance(obj, Mapping):
        for key, var in obj.items():
            _add(found, validate_key(key), _checked_variable(var, key), set())
    elif isinstance(obj, (list, tuple)):
        for var in obj:
            _add(found, _own_name(_checked_variable(var, "")), var, set(), refuse_duplicates=True)
    elif isinstance(obj, (keras.layers.Layer, tf.Module)):
        _Walk(obj, found, aliases).walk(obj, "", "", None)
    elif isinstance(obj, _TRACKABLE):
        _walk_trackable(obj, found)
    else:
        raise TypeError(
            f"expected a Keras model or layer, a tf.Module, a loaded SavedModel, or a list or dict of variables, "
            f"not {type(obj).__name__}"
        )
    if not isinstance(obj, (Mapping, list, tuple)):  # found by walking: only what holds weights, as in tf1
        found = {key: entry for key, entry in found.items() if _holds_weights(entry[0])}
    if optimizer:
        for key, var in _optimizer_variables(obj):
            _add(found, key, var, set(), trainable=False)
    return found, aliases


def _tied(found: Mapping[str, tuple[Variable, bool]]) -> dict[str, str]:
    """Key -> the first key of the same variable, for each key that has such an earlier one: a
    mixed-precision model's inner optimizer slots, which Keras's files name twice
    (``optimizer/vars/<i>`` and ``optimizer/inner_optimizer/vars/<j>``), or a dict naming one
    variable twice."""
    first: dict[int, str] = {}
    return {key: first[id(var)] for key, (var, _) in found.items() if first.setdefault(id(var), key) != key}


def _walk_trackable(root: Any, found: dict[str, tuple[Variable, bool]]) -> None:
    """A trackable that is no ``tf.Module`` (what ``tf.saved_model.load`` returns): each variable
    under the key the SavedModel's variables checkpoint gives it (``ws ls``'s names for the
    folder), by the core's rule for picking among its paths (:func:`best_paths`). A first-found
    path would key a compiled model's kernel by its optimizer's list
    (``optimizer/_trainable_variables/0``), which the folder keys by the model
    (``_operations/1/_kernel``), and an export of the loaded object would not pair with it."""
    view = tf.train.TrackableView(root)
    objects, node_of, nodes = [root], {id(root): 0}, []
    for obj in objects:  # grows as the walk finds objects: each one's node is its place in the list
        edges = []
        if not isinstance(obj, _VARIABLE_TYPES):
            for name, child in view.children(obj).items():
                if id(child) not in node_of:
                    node_of[id(child)] = len(objects)
                    objects.append(child)
                edges.append(_Edge(name, node_of[id(child)]))
        nodes.append(_Node(edges))
    for node, path in best_paths(nodes, budget=sys.maxsize).items():  # in memory: no hostile file to bound
        if path and isinstance(objects[node], _VARIABLE_TYPES):
            _add(found, "/".join(path), objects[node], set())


class _Edge(NamedTuple):
    """An edge of :func:`_walk_trackable`'s graph, spelled as ``best_paths`` reads a checkpoint's."""

    local_name: str
    node_id: int


class _Node(NamedTuple):
    children: list[_Edge]
    slot_variables: tuple[()] = ()  # a loaded object lists no slots; its optimizer is found by its edge


class _Walk:
    """One walk of a root's variables: keys by :class:`_Naming`, old keys by :func:`~weightstore.formats._keras_naming.deduplicated`."""

    def __init__(self, root: Any, found: dict[str, tuple[Variable, bool]], aliases: dict[str, str]):
        self.naming = _Naming(root)
        self.found = found
        self.aliases = aliases
        self.seen: set[int] = set()

    def walk(self, obj: Any, path: str, old: str, trainable_ids: set[int] | None) -> None:
        if isinstance(obj, _VARIABLE_TYPES):
            if id(obj) not in self.seen and old != path:
                self.aliases[old] = path
            _add(self.found, path, obj, self.seen,
                 trainable=id(obj) in trainable_ids if trainable_ids is not None else None)
        elif isinstance(obj, keras.layers.Layer):
            if trainable_ids is None:  # the outermost Keras layer decides: a frozen layer's weights are not trainable
                trainable_ids = {id(w) for w in obj.trainable_weights}
            self._walk_layer(obj, path, old, trainable_ids)
        else:
            leaves = obj._flatten(predicate=lambda x: isinstance(x, (*_VARIABLE_TYPES, keras.layers.Layer)),
                                  with_path=True)
            for attribute_path, leaf in leaves:
                segment = "/".join(map(str, attribute_path))
                self.walk(leaf, join_scope(path, segment), join_scope(old, segment), trainable_ids)

    def _walk_layer(self, layer: keras.layers.Layer, path: str, old: str, trainable_ids: set[int]) -> None:
        children = list(layer._flatten_layers(include_self=False, recursive=False))
        below = {id(w) for child in children for w in child.weights}
        own = [w for w in layer.weights if id(w) not in below]
        for var, name in zip(own, deduplicated((w.name, "variable") for w in own), strict=True):
            self.walk(var, join_scope(path, name), join_scope(old, name), trainable_ids)
        for name, var in saved_outside_weights(layer).items():
            self.walk(var, join_scope(path, name), join_scope(old, name), trainable_ids)
        olds = deduplicated((c.name, snake_case(type(c).__name__)) for c in children)
        for child, name, old_name in zip(children, self.naming.segments(children), olds, strict=True):
            self.walk(child, join_scope(path, name), join_scope(old, old_name), trainable_ids)


class _Naming:
    """Key segments for a root's Keras layers: :class:`~weightstore.formats._keras_naming.Ranking`
    over every layer under the root, the root's own included (``Bidirectional`` copies by ``id``)."""

    def __init__(self, root: Any):
        layers = _keras_layers(root)
        copies = {id(copy) for layer in layers if isinstance(layer, keras.layers.Bidirectional)
                  for copy in (layer.forward_layer, layer.backward_layer)}
        self._parsed = {id(layer): automatic(layer.name, type(layer).__name__, copy=id(layer) in copies)
                        for layer in layers}
        self._ranking = Ranking(self._parsed.values())

    def segments(self, children: list[keras.layers.Layer]) -> list[str]:
        return self._ranking.segments((child.name, self._parsed.get(id(child))) for child in children)


def _add(found: dict, key: str, var: Variable, seen: set[int], *, trainable: bool | None = None,
         refuse_duplicates: bool = False) -> None:
    if id(var) in seen:
        return
    seen.add(id(var))
    if key in found:
        if refuse_duplicates:
            raise InvalidKeyError(f"two variables are both named {key!r}; pass a dict {{key: variable}} to choose keys")
        raise InvalidKeyError(f"two variables both have key {key!r}")
    found[validate_key(key)] = (var, _trainable(var) if trainable is None else trainable)


def _checked_variable(var: Any, key: str) -> Variable:
    if not isinstance(var, _VARIABLE_TYPES):
        where = f" at {key!r}" if key else ""
        raise TypeError(f"expected a variable{where}, not {type(var).__name__}")
    return var


def _own_name(var: Variable) -> str:
    if isinstance(var, keras.Variable):
        return var.path
    if isinstance(var, _SHARDED):
        return _PART_SUFFIX.sub("", OUTPUT_SUFFIX.sub("", var.variables[0].name))
    return OUTPUT_SUFFIX.sub("", var.name)


def _trainable(var: Variable) -> bool:
    # isinstance against ShardedVariable takes microseconds (an ABC); a plain variable skips it
    sharded = not isinstance(var, (BaseResourceVariable, keras.Variable)) and isinstance(var, _SHARDED)
    return bool(var.variables[0].trainable if sharded else var.trainable)


def _holds_weights(var: Variable) -> bool:
    """Not a string, variant or resource variable (a module's vocabulary path, a dataset's state):
    no file format holds those, so an export of them could not be saved."""
    return tf.as_dtype(var.dtype) not in _NOT_WEIGHTS


_NOT_WEIGHTS = frozenset({tf.string, tf.variant, tf.resource})


def _numpy_dtype(var: Variable) -> np.dtype:
    return _as_numpy(var.dtype)


@functools.cache
def _as_numpy(dtype: Any) -> np.dtype:
    """A TF or Keras dtype as numpy's, remembered: 50,000 variables share a few dtypes."""
    return np.dtype(tf.as_dtype(dtype).as_numpy_dtype)


def _shape(var: Variable) -> tuple[int, ...]:
    """The variable's shape; one made with unknown dimensions (``tf.Variable(x, shape=[None, 2])``)
    has its value's, so a value of that shape assigns and another is refused as a mismatch."""
    shape = var.shape
    if not isinstance(shape, tf.TensorShape):
        return tuple(int(d) for d in shape)
    return tuple(shape.as_list()) if shape.is_fully_defined() else tuple(tf.shape(var).numpy().tolist())


def _read(var: Variable) -> np.ndarray:
    """A new array (``numpy()`` copies); a sharded variable is joined into one tensor."""
    if isinstance(var, _SHARDED):
        return np.concatenate([shard.numpy() for shard in var.variables], axis=0)
    return np.asarray(var.numpy())


def _write_batch(pairs: list[tuple[Variable, np.ndarray]]) -> None:
    """Write every pair; small values into plain resource variables go in groups of one shape.

    An eager op costs about 10 µs of fixed overhead here, and converting a numpy array to a
    tensor about as much again, which for a 1 KB tensor is nearly all of its assign. A group
    of values with one dtype and shape is stacked into one array (the copy the variable needs
    anyway), converted once and split by one ``Unpack`` into tensors TF owns, so each variable
    costs one ``AssignVariableOp``: about 12 µs instead of 20. Groups have at most
    ``_GROUP`` members, since TF builds a kernel per distinct ``num`` and a large one costs
    milliseconds to build.
    """
    groups: dict[tuple[np.dtype, tuple[int, ...]], list[tuple[BaseResourceVariable, np.ndarray]]] = {}
    for var, array in pairs:
        resource = _plain_resource(var)
        if resource is not None and array.nbytes < _GROUPED_BELOW:
            groups.setdefault((array.dtype, array.shape), []).append((resource, array))
        else:
            _write(var, array)
    for members in groups.values():
        for start in range(0, len(members), _GROUP):
            group = members[start:start + _GROUP]
            if len(group) == 1:
                resource, array = group[0]
                tf.raw_ops.AssignVariableOp(resource=resource.handle, value=private_copy(array, array.dtype))
                continue
            parts = tf.raw_ops.Unpack(value=np.stack([array for _, array in group]), num=len(group), axis=0)
            for (resource, _), part in zip(group, parts, strict=True):
                tf.raw_ops.AssignVariableOp(resource=resource.handle, value=part)


def _write(var: Variable, array: np.ndarray) -> None:
    resource = _plain_resource(var)
    if resource is not None:  # in TF's own memory: the old buffer it frees is reused, not kept (see _tf_staging)
        tf.raw_ops.AssignVariableOp(resource=resource.handle, value=staged_copy(array, array.dtype))
    elif isinstance(var, _SHARDED):
        start = 0
        for shard in var.variables:
            stop = start + int(shard.shape[0])
            shard.assign(array[start:stop], read_value=False)
            start = stop
    elif isinstance(var, keras.Variable):
        var.assign(array)
    else:
        var.assign(array, read_value=False)


def _plain_resource(var: Variable) -> BaseResourceVariable | None:
    """The resource variable whose buffer an assign may replace, or None where ``assign`` must run.

    That is a Keras variable's own TF variable (outside a ``StatelessScope``, where Keras records
    assigns instead), or a TF one, unless distributed or with an ``assign`` of its own.
    """
    if isinstance(var, keras.Variable):
        if in_stateless_scope():
            return None
        var = var._value
    if not isinstance(var, BaseResourceVariable) or isinstance(var, tf.distribute.DistributedValues):
        return None
    assign = type(var).assign  # TF wraps it per class (weak tensors), so compare where it was written
    own = (assign.__module__, assign.__qualname__) == (BaseResourceVariable.__module__, "BaseResourceVariable.assign")
    return var if own else None


def _describe(obj: Any) -> str:
    name = getattr(obj, "name", None)
    return f"{type(obj).__name__} {name!r}" if isinstance(name, str) else type(obj).__name__
from weightstore.adapters._tf2_sharded import publish_sharded, share  # noqa: E402 - its own module: a feed for clusters
