"""What a refused assign says: every missing, unexpected and mismatched key, with close
matches offered and the scope that would have paired them."""

from __future__ import annotations

import difflib
import os
import re
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from weightstore.adapters._casts import castable, widens
from weightstore.adapters._report import LISTED, TYPO, Mismatch, Report, TargetInfo
from weightstore.core.keys import suggest as keys_suggest

_KERAS_NUMBER = re.compile(r"_[0-9]+$")  # what Keras puts after an automatic name taken before (dense_3)

#: key -> its tensor's shape, or None where the caller does not know it
Shapes = Callable[[str], "tuple[int, ...] | None"]


def _unknown(key: str) -> None:
    """No shape known (a caller with keys alone): scopes are told apart by their keys."""
    return None


def _shape(shape_of: Shapes, key: str) -> tuple[int, ...] | None:
    shape = shape_of(key)
    return None if shape is None else tuple(shape)


def few_assigned(where: str, paired: int, targets: Mapping[str, TargetInfo], values: Mapping[str, str],
                  renamed: bool, mismatched: Sequence[Mismatch]) -> str:
    """Why most variables stayed as they were, saying so when file and model barely fit each
    other: their keys do not pair, or (most of them shapes alike) their dtypes differ."""
    common = sum(1 for key in values if key in targets)
    text = (f"assigning {where} (strict=False) left {len(targets) - paired} of {len(targets)} variables as they "
            f"were; {paired} of {len(values)} values fit a variable ({common} share a key with one)")
    if paired * 2 < min(len(targets), len(values)):
        dtypes_only = sum(1 for mismatch in mismatched if "cast=True" in mismatch.reason)
        text += (": most keys pair, but their dtypes differ (report.mismatched lists each; cast=True converts them)"
                 if dtypes_only * 2 >= min(len(targets), len(values)) else f": {_apart(values, targets, renamed)}")
    return text


def _apart(values: Iterable[str], targets: Iterable[str], renamed: bool, value_shape: Shapes = _unknown,
           target_shape: Shapes = _unknown) -> str:
    """Why few keys pair: one scope between them, or a different architecture."""
    fix = _scope_fix(values, targets, renamed, value_shape, target_shape)
    return (f"the keys differ by a scope: {fix}" if fix else _layout_fix(values, targets) or
            "the weights and the model look like different architectures (or differ by a scope: scope= puts "
            "the values under one, mapping={'FROM': 'TO'} renames one)")


def _layout_fix(values: Iterable[str], targets: Iterable[str]) -> str:
    """What converts the values when they are the model's layers named as another framework
    names them (``fc/weight`` for Keras's ``fc/kernel``, ``bn/gamma`` for PyTorch's
    ``bn/weight``): at least half of the unpaired values pair by a layout rule's leaf name
    (one that renames it: a value whose key is a variable's is paired). "" otherwise."""
    from weightstore.adapters import layout  # here: layout plans its assigns through this module

    target_set = set(targets)
    unpaired = [key.rpartition("/") for key in set(values) - target_set]
    for name, table in layout.LAYOUTS.items():
        framework = {"torch": "PyTorch", "flax": "Flax"}[name]
        for to_keras in (True, False):
            leaves = {(r.other, r.keras) if to_keras else (r.keras, r.other) for r in table.rules}
            pairs = {(scope, leaf, new) for scope, _, leaf in unpaired for old, new in leaves
                     if leaf == old and f"{scope}/{new}" in target_set}
            if not pairs or len({(scope, leaf) for scope, leaf, _ in pairs}) * 2 < len(unpaired):
                continue
            scope, leaf, new = min(pairs)
            if to_keras:
                return (f"the values are {framework}'s names and layouts of the model's layers ({scope}/{leaf} for "
                        f"{scope}/{new}): convert them first, `ws convert SRC OUT.npz --layout {name}-to-keras`, or "
                        f"export the module with {name}.export(module, layout='keras')")
            return (f"the values are Keras's names and layouts of the model's layers ({scope}/{leaf} for "
                    f"{scope}/{new}): pass layout='keras'")
    return ""


def no_such_scope(scope: str, targets: Iterable[str], values: Iterable[str] = ()) -> str:
    """What to say of a ``scope`` no variable is under: the model's scopes at its depth, the
    nearest first (``model_02`` for ``model_002``); for ``members.1`` (or the prefix
    ``members.1.``), written as torch names its modules, the ``members/1`` that pairs (nearer by
    letters is ``members``, which does not). Where the ``values`` (scoped) were under ``scope``
    already, the caller meant to take that part out of the file, which ``ws.load`` does."""
    targets = list(targets)
    if any(key.startswith(f"{scope}/{scope}/") for key in values):
        return (f"no variable is under scope {scope!r}, which scope= puts the values under; they are under it "
                f"already: to take that part of the file out, assign ws.load(path, scope={scope!r})")
    slashed = scope.replace(".", "/").rstrip("/")
    if slashed != scope and any(key.startswith(slashed + "/") for key in targets):
        return (f"no variable is under scope {scope!r}; did you mean {slashed!r}? (keys join names with '/' "
                "where torch's state_dict names use '.')")
    depth = scope.count("/") + 1
    scopes = sorted({"/".join(key.split("/")[:depth]) for key in targets if key.count("/") >= depth})
    near = keys_suggest(scope, scopes)
    shown = f" (the model's: {', '.join(map(repr, scopes[:5]))}{', …' if len(scopes) > 5 else ''})" if scopes else ""
    return f"no variable is under scope {scope!r}{near or shown}"


def _scope_fix(values: Iterable[str], targets: Iterable[str], renamed: bool, value_shape: Shapes = _unknown,
               target_shape: Shapes = _unknown) -> str:
    """What would pair the keys when one scope is all that keeps them apart: values saved
    under ``model_002/`` going into unscoped variables need that scope taken off (``mapping``),
    unscoped values going into variables under it need it put on (``scope``), and an ensemble's
    file given to one member needs one member taken out (``ws.load(path, scope=)``); "" when no
    one scope explains most of the keys. ``renamed``: the values' keys are as the caller's
    ``scope``/``mapping`` made them, so those are what to change. Of an ensemble's members, the
    one proposed has the shapes too (``value_shape``, ``target_shape``, where known): members of
    other widths share every key."""
    value_set, target_set = set(values), set(targets)
    unpaired = value_set - target_set
    members = member_scopes(unpaired, target_set)
    if len(members) > 1:
        fitting = member_scopes(unpaired, target_set, value_shape, target_shape)
        fix = ("change scope= or mapping=, which put them there" if renamed else
               f"assign one of them, ws.load(path, scope={fitting[0]!r}) (`ws export --scope` writes one's file)"
               if fitting else "but none holds the variables' shapes: the model is none of the members")
        narrowed = of_those(members, fitting, "variables")
        return (f"the values are under {_listed(members)} (an ensemble, each holding the variables' keys"
                f"{'; ' + narrowed if narrowed else ''}) and the variables are not: {fix}")
    extra = _extra_scopes(unpaired, target_set, len(unpaired))
    if extra:
        fix = "change scope= or mapping=, which put them there" if renamed else f"pass mapping={{{extra[0]!r}: ''}}"
        return f"the values are under {extra[0]!r} and the variables are not: {fix}"
    # each scope under which half of the values find their variable: an ensemble's members all do;
    # by shape, the members the values are (Keras numbers each member's automatic names on)
    missing = _extra_scopes(target_set - value_set, value_set, len(value_set))
    if missing:
        fitting = member_scopes(target_set - value_set, value_set, target_shape, value_shape)
        missing = sorted({*missing, *fitting})
        if renamed:
            fix = "put them under " + ("it" if len(missing) == 1 else "one of them") + " with scope= or mapping="
        elif not fitting:
            fix = "but none of them has the values' shapes: the values are of another model"
        else:
            fix = f"pass scope={fitting[0]!r}" + (" (or another of them)" if len(fitting) > 1 else "")
        narrowed = of_those(missing, fitting, "values")
        return (f"the variables are under {_listed(missing)}{f' ({narrowed})' if narrowed else ''} and the values "
                f"are not: {fix}")
    return ""


def of_those(scopes: Sequence[str], fitting: Sequence[str], whose: str) -> str:
    """``of those, only 'b' has the values' shapes`` (``whose``: ``values``) where shapes leave
    fewer ``scopes`` than keys; "" otherwise."""
    if not fitting or len(fitting) == len(scopes):
        return ""
    owner = f"the {whose}'" if whose.endswith("s") else f"the {whose}'s"
    return f"of those, only {_listed(fitting)} {'has' if len(fitting) == 1 else 'have'} {owner} shapes"


def member_scopes(values: Collection[str], targets: Collection[str], value_shape: Shapes = _unknown,
                  target_shape: Shapes = _unknown) -> list[str]:
    """The scopes (up to three segments) under which ``values`` hold a copy of the variables, an
    ensemble's file given to one member: half of them by key, or every variable by its key with
    Keras's numbering taken off each name (an ensemble's Keras file numbers its members' automatic
    names on, ``model_002/dense_2/kernel`` for ``dense/kernel``); the last segments alone would
    call any scope of as many weights and biases a copy (a transformer layer's ``mlp/fc1``, ``mlp/fc2``).
    With ``value_shape`` and ``target_shape`` a copy holds each of its variables' shape too: of
    members of different widths, which share every key, only the one the variables are."""
    unnumbered = Counter((_unnumbered(key), _shape(target_shape, key)) for key in targets)
    under: dict[str, list[tuple[str, str]]] = {}
    for key in values:
        parts = key.split("/")
        for depth in range(1, min(len(parts), 4)):
            under.setdefault("/".join(parts[:depth]), []).append(("/".join(parts[depth:]), key))

    def fits(inner: str, key: str) -> bool:
        return inner in targets and _shape(value_shape, key) == _shape(target_shape, inner)

    copies = {scope for scope, keys in under.items() if sum(fits(inner, key) for inner, key in keys) * 2 >= len(targets)
              or Counter((_unnumbered(inner), _shape(value_shape, key)) for inner, key in keys) == unnumbered}
    # the innermost: model_002/tower_0 holds the copy that model_002 holds, and is no second member
    return sorted(scope for scope in copies if not any(other.startswith(scope + "/") for other in copies))


def _unnumbered(key: str) -> str:
    """``key`` with Keras's numbering of automatic names taken off each name: ``sequential/dense``
    for ``sequential_1/dense_3``."""
    return "/".join(_KERAS_NUMBER.sub("", name) for name in key.split("/"))


def _listed(scopes: Sequence[str]) -> str:
    """``'a', 'b' and 'c'``, or ``'a', 'b', 'c' and 2 more``."""
    named = [*map(repr, scopes[:3]), *([f"{len(scopes) - 3} more"] if len(scopes) > 3 else [])]
    return " and ".join(filter(None, [", ".join(named[:-1]), named[-1]]))


def _extra_scopes(keys: Collection[str], others: Collection[str], needed: int, key_shape: Shapes = _unknown,
                  other_shape: Shapes = _unknown) -> list[str]:
    """The scopes (up to three segments) that, taken off, turn at least half of ``needed`` of
    ``keys`` into keys of ``others`` (of the same shape, where ``key_shape`` and ``other_shape``
    know them), the most such keys first (ties in name order)."""
    counts: dict[str, int] = {}
    for key in keys:
        parts = key.split("/")
        for depth in range(1, min(len(parts), 4)):
            inner = "/".join(parts[depth:])
            if inner in others and _shape(key_shape, key) == _shape(other_shape, inner):
                scope = "/".join(parts[:depth])
                counts[scope] = counts.get(scope, 0) + 1
    return sorted((scope for scope, count in counts.items() if count * 2 >= needed), key=lambda s: (-counts[s], s))


def pair_problem(dtype: np.dtype, shape: tuple[int, ...], target: TargetInfo, cast: bool) -> str:
    if tuple(shape) != tuple(target.shape):
        return "shapes differ" + _depthwise_as_conv(tuple(shape), tuple(target.shape))
    if widens(dtype, target.dtype):
        return ""
    if cast and castable(dtype, target.dtype):
        return ""
    return "dtype does not widen losslessly; pass cast=True to convert" if castable(dtype, target.dtype) else "dtypes are incompatible"


def _depthwise_as_conv(shape: tuple[int, ...], target: tuple[int, ...]) -> str:
    """Why a Keras 3 depthwise kernel ``[*spatial, C, M]`` got a Conv's kernel of one input
    channel ``[*spatial, 1, C * M]``, or (``M`` > 1) a depthwise kernel of multiplier 1
    ``[*spatial, C * M, 1]``: a file converted to Keras holds it so without ``--kind``, or with
    ``--kind SCOPE=depthwise``, as no file tells them apart (the conversion's caution said the first,
    perhaps in another process)."""
    if len(target) < 3:
        return ""
    # out of Keras: [*spatial, C, M] read as a Conv's kernel is PyTorch's [M, C, *spatial] (Flax keeps it)
    # where the depthwise layer's is [C * M, 1, *spatial] (Flax's [*spatial, 1, C * M])
    torch_like = target[1] == 1 and shape[2:] == target[2:] and shape[0] * shape[1] == target[0] > shape[1] > 1
    flax_like = target[-2] == 1 and shape[:-2] == target[:-2] and shape[-2] * shape[-1] == target[-1] > shape[-2] > 1
    if len(shape) == len(target) and (torch_like or flax_like):
        return ("; the value is a Keras depthwise kernel converted as a Conv's: convert the file again with "
                "--kind SCOPE=depthwise")
    kind = "depthwise" if target[-1] == 1 else f"depthwise:{target[-1]}"
    if target[-2] > 1 and shape == (*target[:-2], 1, target[-2] * target[-1]):
        return (f"; the value is a depthwise kernel converted as a Conv's of one input channel: convert the file "
                f"again with --kind SCOPE={kind}")
    if target[-1] > 1 and shape == (*target[:-2], target[-2] * target[-1], 1):
        return (f"; the value is a depthwise kernel of multiplier {target[-1]} converted as one of multiplier 1, "
                f"which a file does not tell apart: convert the file again with --kind SCOPE={kind}")
    return ""


def assign_message(report: Report, where: str, targets: Mapping[str, Any], values: Mapping[str, str], pairs,
             every: Mapping[str, Any], value_shape: Callable[[str], tuple[int, ...]], *, trainable_only: bool = False,
             hints: bool = True, note: str = "", renamed: bool = False, scope_problem: str = "") -> str:
    """``targets`` are the selected variables; ``every`` also suggests those a typo left out.

    A value whose variable exists but was left out as not trainable says so, rather than
    suggesting a trainable neighbour (``did you mean 'model_10/w'?`` for ``model_10/b``).
    A name already paired is never suggested: it has its value (``w/Adam`` is not ``w``).
    A suggestion of the key's own shape comes first: ``layer_10/kernel`` is nearer ``layer_1/kernel``
    in spelling, but only ``layer_2/kernel`` could be its value. Without ``hints`` (keys paired by
    structure) nothing is suggested.
    """

    def suggest(key: str, shape: tuple[int, ...], candidates: Any, shape_of: Callable[[str], tuple[int, ...]]) -> str:
        if not hints:
            return ""
        alike = [c for c in candidates if _same_leaf(key, c)]
        return keys_suggest(key, [c for c in alike if tuple(shape_of(c)) == tuple(shape)]) or keys_suggest(key, alike)

    def target_shape(key: str) -> tuple[int, ...]:
        return every[key].shape

    free_targets = [key for key in targets if key not in pairs]  # a paired variable already has its value
    free_every = [key for key in every if key not in pairs]
    free_values = [key for key in values if key not in pairs]

    def unexpected(key: str) -> str:
        if trainable_only and key in every and not every[key].trainable:
            return f"{key!r} is a variable but not trainable (trainable_only=True)"
        shape = value_shape(key)
        return (f"no variable {key!r}"
                f"{suggest(key, shape, free_targets, target_shape) or suggest(key, shape, free_every, target_shape)}")

    lines = [f"cannot assign{f' {where}' if where else ''}: nothing was changed"]
    if scope_problem:
        lines.append(f"  {scope_problem}")
    common = sum(1 for key in values if key in every)
    apart = (_apart(values, every, renamed, value_shape, target_shape) if min(len(targets), len(values)) >= 2
             and common * 2 < min(len(targets), len(values)) else _layout_fix(values, every))
    if apart:
        lines.append(f"  {common} of {len(values)} values share a key with one of {len(targets)} variables: {apart}")
    if not pairs and report.ok:
        lines.append("  no value pairs with a variable" + (" (no variables selected)" if not targets else ""))
    sections: list[tuple[str, list[Any], Callable[[Any], str]]] = [
        ("missing (variables with no value)", report.missing,
         lambda k: f"no value for variable {k!r}{suggest(k, every[k].shape, free_values, value_shape)}"),
        ("unexpected (values with no variable)", report.unexpected, unexpected),
        ("mismatched", report.mismatched, str),
    ]
    for title, items, render in sections:
        if items:
            lines.append(f"  {len(items)} {title}:")
            lines.extend(f"    {render(item)}" for item in items[:LISTED])
            if len(items) > LISTED:
                lines.append(f"    … and {len(items) - LISTED} more")
            if items is report.missing and note:
                lines.append(f"  why: {note}")
    stacked = _stacked_members(report.mismatched, every, value_shape)
    if stacked:
        lines.append(f"  every mismatched variable holds {stacked} members stacked on axis 0 (an nnx.vmap-ed "
                     f"ensemble) and the values are one member's: assign all with each value np.stack-ed from "
                     f"{stacked} members' files, or one by writing it into row i of export(model)'s values and "
                     "assigning those")
    left_out = _statistics_left_out(report.missing, every) if not trainable_only else ""
    if report.missing and pairs and not report.unexpected and not report.mismatched and left_out:
        lines.append(f"  every value paired; the file holds none of the model's non-trainable variables (batch "
                     f"statistics, frozen layers), as an export with trainable_only=True writes it: assign with "
                     f"trainable_only=True (or strict=False) to keep the model's own, or include them on export "
                     f"with trainable_only=True, {left_out}")
    elif report.missing and pairs and not report.unexpected and not report.mismatched:  # a selective save, likely
        lines.append("  every value paired; if the file holds part of the model on purpose, strict=False assigns it "
                     "and the variables it lacks keep theirs (or select as its export did: trainable_only=, also=)")
    return "\n".join(lines)


def _statistics_left_out(missing: list[str], every: Mapping[str, Any]) -> str:
    """The ``also=`` that adds ``missing`` to an export with ``trainable_only=True``, where every
    one is non-trainable (a Linen dict's ``batch_stats/*``, Keras's ``*/moving_*``); "" otherwise."""
    if not missing or any(key not in every or every[key].trainable for key in missing):
        return ""
    heads = {key.split("/", 1)[0] for key in missing}
    if len(heads) == 1 and all("/" in key for key in missing):
        return f"also={heads.pop() + '/*'!r}"
    ending = os.path.commonprefix([key.rsplit("/", 1)[-1] for key in missing])
    return f"also={'*/' + ending + '*'!r}" if ending else "also= naming them"


def _stacked_members(mismatched: list[Any], every: Mapping[str, Any],
                     value_shape: Callable[[str], tuple[int, ...]]) -> int:
    """N where every mismatch is a variable of shape (N, *its value's shape), N at least 2: one
    member's values against a vmap-ed ensemble's stacked ones; 0 otherwise (a variable with a
    leading 1, a ViT's position embedding, is no ensemble)."""
    counts = set()
    for item in mismatched:
        if item.reason != "shapes differ" or item.key not in every:
            return 0
        target, value = tuple(every[item.key].shape), tuple(value_shape(item.key))
        if len(target) != len(value) + 1 or target[1:] != value:
            return 0
        counts.add(target[0])
    return counts.pop() if len(counts) == 1 and min(counts) >= 2 else 0


def _same_leaf(key: str, candidate: str) -> bool:
    """Whether ``candidate`` could be ``key`` misspelt: the same variable name, or one a typo away
    (``kernal``), never another variable of the same layer (``gamma`` for ``beta``, ``b`` for ``w``)."""
    leaf, other = key.rsplit("/", 1)[-1], candidate.rsplit("/", 1)[-1]
    return leaf == other or difflib.SequenceMatcher(None, leaf, other).ratio() >= TYPO
