"""Eager TensorFlow in and out: Keras 3 models and layers, ``tf.Module``s, lists and dicts of variables.

How keys are formed (the object you pass is the root; its own name is never part of a key):

- **Keras layers and models**: the path of layer names from the root down, then the
  variable's name: ``dense/kernel``, ``conv_1/bn/moving_mean``. A name the user chose is kept
  as is. A name Keras made up (``dense_7``: the snake-cased class name, optionally with
  ``_<n>``) is renumbered *within its parent*, in the parent's layer order: the first
  automatic ``Dense`` child is ``dense``, the next ``dense_1``, skipping names siblings
  already use. Keras numbers automatic names process-wide, so the same architecture built
  twice gets ``dense``/``dense_1`` and then ``dense_2``/``dense_3``; renumbering per parent
  gives both the same keys. (A name the user typed that looks automatic, like ``dense_5``,
  is renumbered too.) Variables come from ``layer.weights``: trainable and non-trainable
  weights such as batch-norm statistics, never optimizer, metric or random-seed state.
  Pass ``model.optimizer.variables`` (a list) to export those.
- **tf.Module**: the attribute path, as ``tf.train.Checkpoint`` walks it: ``encoder/w``,
  ``layers/0/b``. Keras layers found on the way continue with the Keras rule. A variable
  reachable along several paths gets the first in ``tf.Module``'s traversal order.
- **A list of variables**: each variable's own name (``dense/kernel:0`` becomes
  ``dense/kernel``; a Keras variable's ``path``); two with the same name are refused.
  **A dict**: its own keys.

Distributed variables are one key each: a ``MirroredVariable`` exports its value once and an
assign reaches every replica; a ``ShardedVariable`` exports as one whole tensor and is
assigned back across its shards. Values go to TensorFlow with ``variable.assign(ndarray)``,
which copies: DLPack would hand TF the numpy buffer itself (the variable adopts it), which is
unsafe for read-only memory maps and for the caller's arrays and was no faster once the copy
that makes it safe is paid (see the README).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Union

import keras
import numpy as np
import tensorflow as tf

from weightstore.adapters.plan import MEMORY, Report, TargetInfo, open_values, plan_assign, wants_skip
from weightstore.errors import InvalidKeyError, SelectionError
from weightstore.keys import OUTPUT_SUFFIX, MappingRules, Patterns, join_scope, plan_outward, validate_key

Variable = Union[tf.Variable, keras.Variable, "tf.__internal__.distribute.ShardedVariable"]
_SHARDED = tf.__internal__.distribute.ShardedVariable
_VARIABLE_TYPES = (tf.Variable, keras.Variable, _SHARDED)
_PART_SUFFIX = re.compile(r"/part_\d+$")


def variables(obj: Any) -> dict[str, Variable]:
    """Key -> variable for everything ``export`` and ``assign`` see in ``obj``."""
    return {key: var for key, (var, _) in _collect(obj).items()}


def export(
    obj: Any,
    *,
    scope: str | None = None,
    include: Patterns = None,
    exclude: Patterns = None,
    trainable_only: bool = False,
) -> dict[str, np.ndarray]:
    """A new weight dictionary of ``obj``'s variables under ``scope`` (keys relative to it)."""
    chosen = selected(obj, scope=scope, include=include, exclude=exclude, trainable_only=trainable_only)
    return {key: _read(var) for key, var in chosen.items()}


def selected(
    obj: Any,
    *,
    scope: str | None = None,
    include: Patterns = None,
    exclude: Patterns = None,
    trainable_only: bool = False,
) -> dict[str, Variable]:
    """Key -> variable for exactly what :func:`export` reads with the same words (for snapshots)."""
    found = _collect(obj)
    plan = plan_outward(found, scope=scope, include=include, exclude=exclude, where=_describe(obj))
    chosen = {new: found[old][0] for new, old in plan.items() if found[old][1] or not trainable_only}
    if not chosen:
        why = "no variables (build a Keras model before exporting it)" if not found else "no variable passes the selection"
        raise SelectionError(f"{_describe(obj)} has {why}")
    return chosen


def assign(
    obj: Any,
    weights: Any,
    *,
    scope: str | None = None,
    mapping: MappingRules = None,
    include: Patterns = None,
    exclude: Patterns = None,
    trainable_only: bool = False,
    strict: bool = True,
    cast: bool = False,
    skip_unchanged: bool | None = None,
) -> Report:
    """Write ``weights`` (a dict, path, open Store or Version) into ``obj``'s variables.

    Plans first (see DESIGN.md): a strict failure raises ``AssignmentError`` with every
    problem and changes nothing. Every value is read, and its checksum verified, before the
    first variable changes. With ``skip_unchanged`` (default: only for Versions), variables
    that last received the very same bytes are left alone and listed in ``report.skipped``.

    That memory only knows what weightstore assigned: after anything else writes the
    variables (training, ``var.assign``, ``model.load_weights``, a checkpoint restore), call
    :func:`forget` (or pass ``skip_unchanged=False``), or a version with the old bytes is skipped
    and the variable keeps the other value.
    """
    found = _collect(obj)
    targets = {
        key: TargetInfo(key, _numpy_dtype(var), _shape(var), trainable) for key, (var, trainable) in found.items()
    }
    skip = wants_skip(weights, skip_unchanged)
    with open_values(weights) as values:
        plan = plan_assign(values, targets, scope=scope, mapping=mapping, include=include, exclude=exclude,
                           trainable_only=trainable_only, strict=strict, cast=cast)
        report = plan.report
        pending = []
        for key, source in plan.pairs.items():
            digest = values.checksum(source)
            if skip and MEMORY.unchanged(found[key][0], key, digest):
                report.skipped.append(key)
            else:
                pending.append((key, values.read(source), digest))
        for key, array, digest in pending:
            var = found[key][0]
            _write(var, np.asarray(array, dtype=targets[key].dtype))
            MEMORY.remember(var, key, digest)
            report.assigned.append(key)
    return report


def forget(obj: Any) -> None:
    """Forget what ``obj``'s variables last received, so the next assign writes them all (no skips).

    Call it after they were changed outside weightstore (training, ``var.assign``, restores):
    hot reload would otherwise trust the old checksums. Accepts what :func:`assign` accepts.
    """
    for var in variables(obj).values():
        MEMORY.forget(var)


def _collect(obj: Any) -> dict[str, tuple[Variable, bool]]:
    """Key -> (variable, trainable), by the rules in the module docstring."""
    found: dict[str, tuple[Variable, bool]] = {}
    if isinstance(obj, Mapping):
        for key, var in obj.items():
            _add(found, validate_key(key), _checked_variable(var, key), set())
    elif isinstance(obj, (list, tuple)):
        for var in obj:
            _add(found, _own_name(_checked_variable(var, "")), var, set(), refuse_duplicates=True)
    elif isinstance(obj, (keras.layers.Layer, tf.Module)):
        _walk(obj, "", found, set(), None)
    else:
        raise TypeError(
            f"expected a Keras model or layer, a tf.Module, or a list or dict of variables, not {type(obj).__name__}"
        )
    return found


def _walk(obj: Any, path: str, found: dict, seen: set[int], trainable_ids: set[int] | None) -> None:
    if isinstance(obj, _VARIABLE_TYPES):
        _add(found, path, obj, seen, trainable=id(obj) in trainable_ids if trainable_ids is not None else None)
    elif isinstance(obj, keras.layers.Layer):
        if trainable_ids is None:  # the outermost Keras layer decides: a frozen layer's weights are not trainable
            trainable_ids = {id(w) for w in obj.trainable_weights}
        _walk_layer(obj, path, found, seen, trainable_ids)
    else:
        leaves = obj._flatten(predicate=lambda x: isinstance(x, (*_VARIABLE_TYPES, keras.layers.Layer)), with_path=True)
        for attribute_path, leaf in leaves:
            _walk(leaf, join_scope(path, "/".join(map(str, attribute_path))), found, seen, trainable_ids)


def _walk_layer(layer: keras.layers.Layer, path: str, found: dict, seen: set[int], trainable_ids: set[int]) -> None:
    children = list(layer._flatten_layers(include_self=False, recursive=False))
    below = {id(w) for child in children for w in child.weights}
    own = [w for w in layer.weights if id(w) not in below]
    for var, name in zip(own, _segments((w.name, "variable") for w in own)):
        _walk(var, join_scope(path, name), found, seen, trainable_ids)
    for child, name in zip(children, _segments((c.name, _snake_case(type(c).__name__)) for c in children)):
        _walk(child, join_scope(path, name), found, seen, trainable_ids)


def _segments(items: Iterable[tuple[str, str]]) -> list[str]:
    """Sibling names: chosen names kept, automatic ones (``base`` or ``base_<n>``) renumbered in order."""
    items = [(name, base, name == base or re.fullmatch(re.escape(base) + r"_\d+", name) is not None)
             for name, base in items]
    taken = {name for name, _, automatic in items if not automatic}
    used: set[str] = set()
    segments = []
    for name, base, automatic in items:
        segment = _unused(base, taken) if automatic else _unused(name, taken) if name in used else name
        taken.add(segment)
        used.add(segment)
        segments.append(segment)
    return segments


def _unused(base: str, taken: set[str]) -> str:
    if base not in taken:
        return base
    n = 1
    while f"{base}_{n}" in taken:
        n += 1
    return f"{base}_{n}"


def _snake_case(name: str) -> str:
    """Keras's own ``naming.to_snake_case``, the stem of its automatic layer names."""
    name = re.sub(r"\W+", "", name)
    name = re.sub("(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub("([a-z])([A-Z])", r"\1_\2", name).lower()


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
    return bool(var.variables[0].trainable if isinstance(var, _SHARDED) else var.trainable)


def _numpy_dtype(var: Variable) -> np.dtype:
    return np.dtype(tf.as_dtype(var.dtype).as_numpy_dtype)


def _shape(var: Variable) -> tuple[int, ...]:
    return tuple(int(d) for d in var.shape)


def _read(var: Variable) -> np.ndarray:
    """A new array (``numpy()`` copies); a sharded variable is joined into one tensor."""
    if isinstance(var, _SHARDED):
        return np.concatenate([shard.numpy() for shard in var.variables], axis=0)
    return np.asarray(var.numpy())


def _write(var: Variable, array: np.ndarray) -> None:
    if isinstance(var, _SHARDED):
        start = 0
        for shard in var.variables:
            stop = start + int(shard.shape[0])
            shard.assign(array[start:stop], read_value=False)
            start = stop
    elif isinstance(var, keras.Variable):
        var.assign(array)
    else:
        var.assign(array, read_value=False)


def _describe(obj: Any) -> str:
    name = getattr(obj, "name", None)
    return f"{type(obj).__name__} {name!r}" if isinstance(name, str) else type(obj).__name__
