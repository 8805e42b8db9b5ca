"""Keras/TensorFlow names and tensor layouts against PyTorch's and Flax's, as tables of rules.

Keras (and TF1, and Flax) keep a Dense kernel as ``[in, out]`` and convolution kernels
channels-last (``HWIO``); PyTorch keeps ``Linear.weight`` as ``[out, in]`` and convolutions
as ``OIHW``. Names differ too: Keras's batch norm ``gamma/beta/moving_mean/moving_variance``
is PyTorch's ``weight/bias/running_mean/running_var`` and Flax's ``scale/bias/mean/var``.
Each :class:`Rule` below says, for one kind of layer, how a tensor's *leaf name* (the last
key segment) and axes change; a :class:`Layout` is an ordered table of them. Nothing is
guessed:

- **Keras → other** (assigning Keras weights into a PyTorch or Flax module, or
  ``ws convert --layout keras-to-torch``): the rule is found by the Keras leaf name and the
  tensor's rank (``kernel`` of rank 2 is a Dense kernel, of rank 4 a Conv2D kernel).
- **other → Keras** (exporting a module with a layout, ``--layout torch-to-keras``): names
  alone are ambiguous (PyTorch calls a Linear's and a batch norm's offsets both ``bias``), so
  the rule is found by leaf name, rank *and the layer's kind*. Adapters take the kind from
  the module holding the tensor (``nn.Linear`` is ``dense``; a convolution with
  ``groups == in_channels`` is ``depthwise``); a file records no modules, so
  :func:`kinds_from_names` derives the kind from a scope's tensors (see there), and never
  finds ``depthwise``: a depthwise layer's kernel converts where its module is at hand, or where
  ``kinds=`` says ``depthwise`` (one group per channel: a multiplier of 1; ``depthwise:2`` says a
  multiplier of 2, which a file holds as twice the channels). A kernel that fits
  both (PyTorch's ``[C, 1, kh, kw]``) converts as a Conv's with a :class:`LayoutWarning` naming
  it (``ws convert``'s caution line), since a Conv of one input channel is common too.
  A transposed convolution's kernel (``[*spatial, out, in]`` in Keras, ``[in, out, *spatial]``
  in PyTorch) converts as a convolution's, by the same reversal of axes.

Keras 3 calls a depthwise kernel ``kernel``, as it calls a convolution's (Keras 2 and TF1 say
``depthwise_kernel``), and the two have the same rank. On the way in, the shape of the
variable a tensor goes into decides (a depthwise kernel only fits a grouped convolution).
Converting a *file* has no such variable: its layer's bias decides where it can (a Conv's
has one value per output channel, a DepthwiseConv's one per input channel and multiplier);
elsewhere, a Keras 3 ``kernel`` that may be depthwise (its last
axis 1, or a scope named ``depthwise``) is refused until ``kinds=`` (``ws convert --kind
SCOPE=depthwise``) says which it is; a PyTorch file's rank-2 ``weight`` without a ``bias``
(a bias-free Linear, or an Embedding) likewise. On the way out, depthwise kernels are written
as Keras 3 names them. A value whose layer has no place for it (a convolution's bias into a
PyTorch layer built with ``bias=False``) is refused naming :func:`fold_bias_into_norm`.

Layers whose tensors convert only together (LSTM, GRU, multi-head attention) are
:class:`~weightstore.adapters._layer_rules.LayerRule` s in ``Layout.layers``, tried first, by the
whole set of names a layer's scope holds (see :mod:`weightstore.adapters._layer_rules`).

A tensor no rule covers is refused (listed in the adapter's ``Report``/error, or in a
:class:`~weightstore.errors.LayoutError`), never passed through unconverted. Tensors a
framework keeps that Keras has no place for (PyTorch's ``num_batches_tracked``) are
``dropped`` on the way to Keras, by name.

Extend a table for your own layer with :meth:`Layout.extended`; your rules come first, and
the first matching rule wins. An adapter names a module's kind by the table in the adapter
(``nn.Linear`` → ``dense``…), else by the module's class name, so a rule for your own
``class Scale(nn.Module)`` holding ``alpha`` reads::

    rules = layout.KERAS_TO_TORCH.extended(layout.Rule(("Scale",), "alpha", "alpha"))
    torch.assign(module, weights, layout=rules)
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace

import numpy as np

from weightstore.adapters import _layer_rules
from weightstore.adapters._artifacts import is_legacy_keras_h5, legacy_keras_h5_error
from weightstore.adapters._casts import describe
from weightstore.adapters._layer_rules import LayerRule
from weightstore.adapters._report import Mismatch, Plan, TargetInfo
from weightstore.adapters._values import ValueSource
from weightstore.adapters.plan import AssignOptions, plan_assign, training_state
from weightstore.core.keys import MappingRules, Patterns, join_scope, map_key, normalize_scope, parse_mapping, passes
from weightstore.errors import AssignmentError, LayoutError, named
from weightstore.formats import keras_file, keras_sharded

__all__ = ["Rule", "Layout", "LayoutWarning", "convert", "fold_bias_into_norm"]

DENSE, CONV, DEPTHWISE, NORM, EMBEDDING = "dense", "conv", "depthwise", "norm", "embedding"
#: the kinds a user may give a layer a file cannot tell (``kinds=``, ``ws convert --kind``)
KINDS = (DENSE, CONV, DEPTHWISE, NORM, EMBEDDING)
#: a multi-head attention layer, given with its head count (``attention:8``), which PyTorch's packed
#: ``in_proj_weight`` does not record
ATTENTION = _layer_rules.ATTENTION
_WEIGHTED = (DENSE, CONV, DEPTHWISE)
_EXTEND = " (add a Rule with Layout.extended)"


class LayoutWarning(UserWarning):
    """A file's tensors converted as the likelier kind of layer where their names and shapes fit
    another kind as well (a PyTorch ``[C, 1, kh, kw]`` weight: a Conv's of one input channel, or
    a depthwise Conv's); ``kinds=`` (``ws convert --kind``) says which and silences it."""


@dataclass(frozen=True)
class Rule:
    """One tensor of one kind of layer, as Keras holds it and as the other framework does.

    Args:
        kinds: the layer kinds this rule serves on the way to Keras (``dense``, ``conv``,
            ``depthwise``, ``norm``, or a module class name of your own).
        keras: the tensor's leaf name in Keras/TF (``kernel``, ``gamma``).
        other: its leaf name in the other framework (``weight``, ``scale``).
        rank: the tensor's rank this rule applies to; ``None`` for any (names like ``bias``).
        axes: Keras → other is ``numpy.transpose(value, axes)``; ``None`` keeps the axes.
        fold: for depthwise kernels, ``(merge, unit)``: after ``axes`` the Keras kernel ends in
            ``(in, multiplier)`` at positions ``merge, merge + 1``; they become one axis of
            ``in * multiplier`` channels, and an axis of size 1 (one input channel per group) is
            inserted at ``unit``. Undoing it needs the group count (``in``), which the module knows.
        by_shape: on the way from Keras, apply only where the receiving variable's shape
            confirms this rule (Keras 3 calls a depthwise kernel ``kernel``, as it does a
            convolution's; only the variable it goes into tells them apart).
    """

    kinds: tuple[str, ...]
    keras: str
    other: str
    rank: int | None = None
    axes: tuple[int, ...] | None = None
    fold: tuple[int, int] | None = None
    by_shape: bool = False

    def to_other_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = tuple(shape[a] for a in self.axes) if self.axes else tuple(shape)
        return _folded(shape, *self.fold) if self.fold else shape

    def to_other(self, value: np.ndarray) -> np.ndarray:
        """``value`` converted; a strided view of it where no copy is needed (the consumer copies anyway)."""
        if self.axes:
            value = np.transpose(value, self.axes)
        if self.fold:
            value = np.reshape(value, _folded(value.shape, *self.fold))
        return value

    def to_keras_shape(self, shape: tuple[int, ...], groups: int = 1) -> tuple[int, ...]:
        shape = _unfolded(tuple(shape), *self.fold, groups) if self.fold else tuple(shape)
        return tuple(shape[a] for a in np.argsort(self.axes)) if self.axes else shape

    def to_keras(self, value: np.ndarray, groups: int = 1) -> np.ndarray:
        """``value`` converted; a strided view of it where no copy is needed."""
        if self.fold:
            value = np.reshape(value, _unfolded(value.shape, *self.fold, groups))
        if self.axes:
            value = np.transpose(value, np.argsort(self.axes))
        return value

    def fold_problem(self, shape: tuple[int, ...], groups: int) -> str:
        """Why a depthwise kernel of ``shape`` cannot be split into ``groups`` groups; empty if it can."""
        if not self.fold:
            return ""
        merge, unit = self.fold
        channels = shape[merge + 1 if unit <= merge else merge]
        if shape[unit] != 1 or groups < 1 or channels % groups:
            return (f"a depthwise kernel {list(shape)} needs one input channel per group and channels "
                    f"divisible by its {groups} groups")
        return ""


def _folded(shape: tuple[int, ...], merge: int, unit: int) -> tuple[int, ...]:
    shape = (*shape[:merge], shape[merge] * shape[merge + 1], *shape[merge + 2:])
    return (*shape[:unit], 1, *shape[unit:])


def _unfolded(shape: tuple[int, ...], merge: int, unit: int, groups: int) -> tuple[int, ...]:
    shape = (*shape[:unit], *shape[unit + 1:])
    return (*shape[:merge], groups, shape[merge] // groups, *shape[merge + 1:])


@dataclass(frozen=True)
class Layout:
    """An ordered table of rules between Keras and one other framework.

    ``kernel`` is the other framework's name for a layer's main weight, which
    :func:`kinds_from_names` reads the layer kind from; ``dropped`` are leaf names with no
    Keras counterpart, left out on the way to Keras; ``unported`` (leaf name, why) are those of
    a computation no Keras layer does, refused saying so rather than asking for a rule.
    """

    name: str
    rules: tuple[Rule, ...]
    kernel: str
    dropped: tuple[str, ...] = ()
    unported: tuple[tuple[str, str], ...] = ()
    #: layers whose tensors convert together (LSTM, GRU, attention), tried before ``rules``
    layers: tuple[LayerRule, ...] = ()

    def extended(self, *rules: Rule) -> Layout:
        """This layout with ``rules`` tried first (the first matching rule wins)."""
        return replace(self, rules=(*rules, *self.rules))

    def rule_from_keras(self, leaf: str, shape: tuple[int, ...], target: tuple[int, ...] | None = None,
                        kind: str | None = None) -> Rule | None:
        """The first rule for this Keras leaf and rank (and ``kind``, when the caller knows it);
        given the variable's shape, the first that fits it."""
        candidates = [r for r in self.rules if r.keras == leaf and r.rank in (None, len(shape))
                      and (kind is None or kind in r.kinds)]
        if kind is not None:
            return candidates[0] if candidates else None
        if target is not None:
            fitting = next((r for r in candidates if r.to_other_shape(shape) == tuple(target)), None)
            if fitting is not None:
                return fitting
        return next((r for r in candidates if not r.by_shape), None)

    def rule_to_keras(self, leaf: str, rank: int, kind: str | None) -> Rule | None:
        return next((r for r in self.rules if r.other == leaf and r.rank in (None, rank) and kind in r.kinds), None)


def _kernels(kinds: tuple[str, ...], other: str, axes_by_rank: Mapping[int, tuple[int, ...]]) -> tuple[Rule, ...]:
    return tuple(Rule(kinds, "kernel", other, rank, axes) for rank, axes in axes_by_rank.items())


#: Keras/TF ↔ PyTorch: Linear weights ``[out, in]``, convolutions ``OIHW`` (and 1D/3D alike),
#: depthwise convolutions ``[in * multiplier, 1, *spatial]``, batch norm ``running_*`` buffers.
KERAS_TO_TORCH = Layout(
    "torch",
    rules=(
        Rule((DENSE,), "kernel", "weight", 2, (1, 0)),
        *_kernels((CONV,), "weight", {3: (2, 1, 0), 4: (3, 2, 0, 1), 5: (4, 3, 0, 1, 2)}),
        Rule((DEPTHWISE,), "kernel", "weight", 3, (1, 2, 0), fold=(0, 1), by_shape=True),  # Keras 3
        Rule((DEPTHWISE,), "kernel", "weight", 4, (2, 3, 0, 1), fold=(0, 1), by_shape=True),
        Rule((DEPTHWISE,), "depthwise_kernel", "weight", 3, (1, 2, 0), fold=(0, 1)),  # Keras 2, TF1
        Rule((DEPTHWISE,), "depthwise_kernel", "weight", 4, (2, 3, 0, 1), fold=(0, 1)),
        Rule(_WEIGHTED, "bias", "bias"),
        Rule((NORM,), "gamma", "weight"),
        Rule((NORM,), "beta", "bias"),
        Rule((NORM,), "moving_mean", "running_mean"),
        Rule((NORM,), "moving_variance", "running_var"),
        Rule((EMBEDDING,), "embeddings", "weight", 2),
    ),
    kernel="weight",
    dropped=("num_batches_tracked",),
    unported=tuple((leaf, f"is MultiheadAttention(add_bias_kv=True)'s learned {what}, appended to every sequence's "
                          f"{what}s: Keras's MultiHeadAttention (and Flax's) has no such variable and computes no such "
                          "step, so no layout or Rule ports it exactly; port a module built with add_bias_kv=False")
                   for leaf, what in (("bias_k", "key"), ("bias_v", "value"))),
    layers=_layer_rules.TORCH_LAYERS,
)

#: Keras/TF ↔ Flax: kernels keep Keras's layout; a depthwise kernel is Flax's grouped
#: ``Conv`` kernel ``[*spatial, 1, in * multiplier]``; batch norm is ``scale/bias/mean/var``.
KERAS_TO_FLAX = Layout(
    "flax",
    rules=(
        Rule((DENSE, CONV), "kernel", "kernel"),
        Rule((DEPTHWISE,), "kernel", "kernel", 3, fold=(1, 1), by_shape=True),  # Keras 3
        Rule((DEPTHWISE,), "kernel", "kernel", 4, fold=(2, 2), by_shape=True),
        Rule((DEPTHWISE,), "depthwise_kernel", "kernel", 3, fold=(1, 1)),  # Keras 2, TF1
        Rule((DEPTHWISE,), "depthwise_kernel", "kernel", 4, fold=(2, 2)),
        Rule(_WEIGHTED, "bias", "bias"),
        Rule((NORM,), "gamma", "scale"),
        Rule((NORM,), "beta", "bias"),
        Rule((NORM,), "moving_mean", "mean"),
        Rule((NORM,), "moving_variance", "var"),
        Rule((EMBEDDING,), "embeddings", "embedding", 2),
    ),
    kernel="kernel",
    layers=_layer_rules.FLAX_LAYERS,
)

LAYOUTS = {"torch": KERAS_TO_TORCH, "flax": KERAS_TO_FLAX}
#: what ``ws convert --layout`` accepts: the layout and whether the file is in Keras's names
DIRECTIONS = {"keras-to-torch": ("torch", True), "torch-to-keras": ("torch", False),
              "keras-to-flax": ("flax", True), "flax-to-keras": ("flax", False)}


@dataclass(frozen=True)
class Site:
    """What a tensor's module tells about it: the layer kind and, for depthwise layers, the group count."""

    kind: str | None
    groups: int = 1


@dataclass(frozen=True)
class Step:
    """One tensor's conversion: where it comes from, which rule, and the shape it will have."""

    source: str
    rule: Rule
    shape: tuple[int, ...]
    to_keras: bool
    groups: int = 1

    def apply(self, value: np.ndarray) -> np.ndarray:
        return self.rule.to_keras(value, self.groups) if self.to_keras else self.rule.to_other(value)

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,)

    def build(self, read: Callable[[str], np.ndarray]) -> np.ndarray:
        """The converted tensor, reading what it comes from with ``read(key)``."""
        return self.apply(np.asarray(read(self.source)))


@dataclass(frozen=True)
class LayerStep:
    """One tensor of a layer converted as a set (:class:`LayerRule`): made from all of ``sources``."""

    source: str  # the first of sources: whose dtype the tensor has
    sources: tuple[str, ...]
    rule: LayerRule
    output: str  # the tensor's key relative to the layer's scope
    shape: tuple[int, ...]
    to_keras: bool
    heads: int = 0

    def build(self, read: Callable[[str], np.ndarray]) -> np.ndarray:
        inputs = self.rule.other if self.to_keras else self.rule.keras
        arrays = {rel: np.asarray(read(source)) for rel, source in zip(inputs, self.sources, strict=True)}
        return self.rule.convert(arrays, not self.to_keras, self.heads)[self.output]


AnyStep = Step | LayerStep


def resolve(name: str | Layout, default: str) -> Layout:
    """A layout from its name (``"keras"`` means the adapter's own table) or as given."""
    if isinstance(name, Layout):
        return name
    if name == "keras":
        return LAYOUTS[default]
    raise LayoutError(f"unknown layout {name!r}; use 'keras' or a weightstore.adapters.layout.Layout")


def from_keras(layout: Layout, shapes: Mapping[str, tuple[int, ...]],
               target_shape: Callable[[str], tuple[int, ...] | None] | None = None,
               kinds: Mapping[str, str] | None = None,
               ) -> tuple[dict[str, AnyStep], dict[str, str]]:
    """Plan converting Keras-named tensors: new key -> step, and refused key -> why.

    ``target_shape(new key)`` is the shape of the variable a tensor would go into (``None``
    where there is none), which decides between rules a name and rank leave open. Without
    it (a file), a Keras 3 ``kernel`` that may be a depthwise layer's (its last axis 1, or a
    scope named ``depthwise``) is refused unless ``kinds`` (key -> kind) says which it is.
    """
    layer_steps, refused, used = _plan_layers(layout, shapes, True)
    steps: dict[str, list[AnyStep]] = {new: [step] for new, step in layer_steps.items()}
    for key, shape in shapes.items():
        if key in used:
            continue
        scope, _, leaf = key.rpartition("/")
        kind = (kinds or {}).get(key)
        if kind is None and target_shape is None:  # a file: the layer's bias may tell what its shape does not
            kind = _kind_by_bias(leaf, tuple(shape), shapes.get(join_scope(scope, "bias")))
        names = dict.fromkeys(r.other for r in layout.rules if r.keras == leaf)
        there = {name: target_shape(join_scope(scope, name)) for name in names} if target_shape else {}
        rule = layout.rule_from_keras(leaf, tuple(shape), next(filter(None, there.values()), None), kind)
        if rule is None:
            refused[key] = f"no {layout.name} layout rule for a rank-{len(shape)} {leaf!r}" + (
                f" in a {kind!r} layer" if kind else "") + _EXTEND
            continue
        why = _undecided(layout, key, tuple(shape), rule, kind) if target_shape is None else ""
        if target_shape is not None and there.get(rule.other, ()) is None:
            why = _no_target_why(layout, scope, leaf, target_shape)
        if why:
            refused[key] = why
        else:
            step = Step(key, rule, rule.to_other_shape(shape), False)
            steps.setdefault(join_scope(scope, rule.other), []).append(step)
    return _unique(steps, refused), refused


def _kind_by_bias(leaf: str, shape: tuple[int, ...], bias: tuple[int, ...] | None) -> str | None:
    """``depthwise`` for a Keras 3 ``kernel`` whose layer's bias says so, else ``None``: a Conv's
    bias has one value per output channel (the kernel's last axis), a ConvTranspose's too (its
    second last), a DepthwiseConv's one per input channel and multiplier (its last two), so a
    ``[3, 3, 3, 2]`` kernel with a bias of 6 is depthwise, though its shape alone would pass for
    a Conv's. With either of the last two axes 1 the bias tells nothing apart, and the kernel is
    left to :func:`_undecided`."""
    if leaf != "kernel" or bias is None or len(bias) != 1 or len(shape) < 3 or shape[-2] == 1 or shape[-1] == 1:
        return None  # an EinsumDense's bias may have more axes: nothing here is a depthwise layer's
    return DEPTHWISE if math.prod(bias) == shape[-2] * shape[-1] else None


def _undecided(layout: Layout, key: str, shape: tuple[int, ...], rule: Rule, kind: str | None) -> str:
    """Why a file's Keras 3 ``kernel`` cannot be converted without knowing its layer's kind."""
    if kind is not None or DEPTHWISE in rule.kinds or key.rpartition("/")[2] != "kernel":
        return ""
    if not any(r.by_shape and r.rank == len(shape) for r in layout.rules):
        return ""
    scope = key.rpartition("/")[0]
    if shape[-1] == 1 and shape[-2] > 1 or "depthwise" in scope.rpartition("/")[2].lower():
        return (f"a Keras 3 kernel {list(shape)} may be a DepthwiseConv's or a Conv's, which a file does not "
                f"tell apart; say which: kinds={{{scope!r}: 'depthwise'}} (ws convert --kind '{scope}=depthwise' "
                "or =conv), or assign into the module, whose shapes decide")
    return ""


def _no_target_why(layout: Layout, scope: str, leaf: str, target_shape: Callable[[str], tuple[int, ...] | None]) -> str:
    """Why a value whose layer is there but has no variable for it (a conv bias into ``bias=False``) is refused."""
    if leaf != "bias" or target_shape(join_scope(scope, layout.kernel)) is None:
        return ""
    return (f"the {layout.name} layer {scope!r} has no bias (bias=False); fold this bias into the batch norm "
            "that follows (layout.fold_bias_into_norm), or build the layer with a bias")


def _plan_layers(layout: Layout, shapes: Mapping[str, tuple[int, ...]], from_keras: bool,
                 sites: Mapping[str, Site] | None = None) -> tuple[dict[str, LayerStep], dict[str, str], set[str]]:
    """The layers ``layout.layers`` convert as sets: new key -> step, refused key -> why, and
    every key they took (converted or refused), which the per-tensor rules then leave alone.

    A scope holding a rule's whole set is tried against each such rule in order (a PyTorch
    LSTM's and GRU's names are alike; their shapes tell them apart); if none converts it, it
    is refused with the first rule's reason. ``sites`` give a module's head count.
    """
    steps: dict[str, LayerStep] = {}
    used: set[str] = set()
    problems: dict[str, tuple[list[str], str]] = {}
    for rule in layout.layers:
        inputs = rule.keras if from_keras else rule.other
        for key in shapes:
            if key in used or not (key == inputs[0] or key.endswith("/" + inputs[0])):
                continue
            scope = key[: len(key) - len(inputs[0])].rstrip("/")
            sources = [join_scope(scope, rel) for rel in inputs]
            if any(source not in shapes or source in used for source in sources):
                continue
            local = {rel: tuple(shapes[source]) for rel, source in zip(inputs, sources, strict=True)}
            heads = sites[key].groups if sites is not None and key in sites else 0
            why = rule.problem(local, from_keras, heads)
            if why:
                problems.setdefault(scope, (sources, why))
                continue
            problems.pop(scope, None)
            used.update(sources)
            for rel, shape in rule.shapes(local, from_keras, heads).items():
                steps[join_scope(scope, rel)] = LayerStep(sources[0], tuple(sources), rule, rel, shape,
                                                          not from_keras, heads)
    refused: dict[str, str] = {}
    for sources, why in problems.values():
        if not used.intersection(sources):
            refused.update({source: why for source in sources})
            used.update(sources)
    return steps, refused, used


def to_keras(layout: Layout, shapes: Mapping[str, tuple[int, ...]],
             sites: Mapping[str, Site] | None = None,
             kinds: Mapping[str, str] | None = None) -> tuple[dict[str, AnyStep], dict[str, str]]:
    """Plan converting tensors named the other framework's way into Keras's names and layouts.

    ``sites`` gives each key's layer kind (from its module); without it the kinds come from
    the names (:func:`kinds_from_names`), and ``kinds`` (key -> kind; ``depthwise:M`` for a
    depthwise layer of multiplier ``M``) decides what names leave open. Keys whose leaf is in
    ``layout.dropped`` are left out.
    """
    counted = {key: _counted(given) for key, given in (kinds or {}).items()}
    heads = {key: Site(ATTENTION, count) for key, (kind, count) in counted.items() if kind == ATTENTION}
    layer_steps, refused, used = _plan_layers(layout, shapes, False, heads if sites is None else sites)
    rest = {key: shape for key, shape in shapes.items() if key not in used}
    file_groups = sites is None  # no module says a depthwise layer's group count: a file's
    multipliers: dict[str, int] = {}  # a depthwise layer's, as kinds= says it (depthwise:2)
    if sites is None:
        found = kinds_from_names(layout, rest)
        for key, (kind, count) in counted.items():
            found[key], multipliers[key] = kind, count
        sites = {key: Site(kind) for key, kind in found.items()}
    steps: dict[str, list[AnyStep]] = {new: [step] for new, step in layer_steps.items()}
    guessed: list[str] = []
    for key, shape in rest.items():
        scope, _, leaf = key.rpartition("/")
        if leaf in layout.dropped:
            continue
        site = sites.get(key, Site(None))
        rule = layout.rule_to_keras(leaf, len(shape), site.kind)
        if file_groups and key not in (kinds or {}) and _may_be_depthwise(layout, leaf, tuple(shape), site.kind):
            guessed.append(key)
        if file_groups and rule is not None and rule.fold:
            channels, multiplier = _channels(shape, *rule.fold), multipliers.get(key, 1)
            if channels % multiplier:
                refused[key] = (f"a depthwise kernel {list(shape)} of {channels} channels cannot have a multiplier of "
                                f"{multiplier}, which does not divide them")
                continue
            site = Site(site.kind, channels // multiplier)
        if rule is None and leaf in dict(layout.unported):
            refused[key] = dict(layout.unported)[leaf]
        elif rule is None:
            of = f"in a {site.kind!r} layer" if site.kind else "in a layer of unknown kind"
            refused[key] = f"no {layout.name} layout rule for a rank-{len(shape)} {leaf!r} {of}{_EXTEND}"
            if site.kind is None:
                refused[key] = _kind_unsaid(layout, scope, leaf, shape, rest) or refused[key]
        elif rule.fold_problem(shape, site.groups):
            refused[key] = rule.fold_problem(shape, site.groups)
        else:
            step = Step(key, rule, rule.to_keras_shape(shape, site.groups), True, site.groups)
            steps.setdefault(join_scope(scope, rule.keras), []).append(step)
    if guessed:
        scope = guessed[0].rpartition("/")[0]
        warnings.warn(LayoutWarning(
            f"converted {len(guessed)} kernel{'s' if len(guessed) > 1 else ''} of one input channel as a Conv's, which "
            f"a depthwise Conv's of as many groups as channels would be as well, and a file does not tell apart: "
            f"{named(guessed)}; for a depthwise layer say so: layout.to_keras(..., kinds={{{scope!r}: 'depthwise'}}) (ws convert --kind "
            f"'{scope}=depthwise', '{scope}=depthwise:M' for a depth multiplier M; --kind '{scope}=conv' confirms a Conv), "
            f"or export the module"), stacklevel=3)
    return _unique(steps, refused), refused


def _may_be_depthwise(layout: Layout, leaf: str, shape: tuple[int, ...], kind: str | None) -> bool:
    """Whether a file's kernel that its names make a Conv's fits a depthwise layer's rule as well:
    PyTorch's ``[C, 1, kh, kw]`` (Flax's ``[kh, kw, 1, C]``) is a Conv's with one input channel or a
    depthwise Conv's with ``C`` groups (with a multiplier, ``C`` is channels times it), and its
    bias, one value per output channel either way, tells nothing apart."""
    if kind != CONV:
        return False
    rule = layout.rule_to_keras(leaf, len(shape), DEPTHWISE)
    if rule is None or rule.fold is None:
        return False
    groups = _channels(shape, *rule.fold)
    return groups > 1 and not rule.fold_problem(shape, groups)


def _channels(shape: tuple[int, ...], merge: int, unit: int) -> int:
    """The channels of a depthwise kernel a file holds (``--kind SCOPE=depthwise``) whose module
    is not at hand: its input channels times its multiplier, which the file does not tell apart.
    As many groups as channels is a multiplier of 1 (Keras's default); ``depthwise:M`` divides
    them by ``M``. A kernel converted with another multiplier than its layer's comes out with
    another shape than the layer's, which an assign refuses naming the multiplier."""
    return [size for axis, size in enumerate(shape) if axis != unit][merge]


def _counted(kind: str) -> tuple[str, int]:
    """A kind as ``kinds=`` gives it, and the count it names that a file does not record: a
    depthwise layer's multiplier (``depthwise:2``; 1 unsaid), an attention layer's heads
    (``attention:8``, always said); any other kind has 1."""
    base, colon, count = kind.partition(":")
    counts = {DEPTHWISE: colon == "" or count.isdigit() and int(count) >= 1,
              ATTENTION: count.isdigit() and int(count) >= 1}
    if not (counts.get(base, False) if base in counts else base in KINDS and not colon):
        raise LayoutError(f"unknown layer kind {kind!r}; use one of {', '.join(KINDS)} (depthwise:M for a depthwise "
                          "layer of depth multiplier M, attention:HEADS for a multi-head attention layer)")
    return base, int(count) if colon else 1


def _unique(steps: dict[str, list[AnyStep]], refused: dict[str, str]) -> dict[str, AnyStep]:
    """The steps whose new key is theirs alone; tensors that would share one are all refused."""
    for new, clashing in steps.items():
        if len(clashing) > 1:
            sources = " and ".join(repr(step.source) for step in clashing)
            refused.update({step.source: f"{sources} would both become {new!r}" for step in clashing})
    return {new: only[0] for new, only in steps.items() if len(only) == 1}


def kinds_from_names(layout: Layout, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """Each key's layer kind as a file shows it, scope by scope (a scope holds one layer).

    A scope holding a name only normalization layers use (``running_mean``, ``scale``…) is
    ``norm``; otherwise the rank of its ``layout.kernel`` tensor decides: 1 is ``norm``
    (PyTorch's LayerNorm ``weight``), 2 is ``dense``, 3 to 5 is ``conv``. Other scopes get no
    kind, so their tensors are refused; so do a rank-2 ``weight`` without a bias (a Linear's or
    an Embedding's), one of a layer named as GPT-2 names Hugging Face's ``Conv1D`` (whose
    ``[in, out]`` a Linear's transposing would silently scramble), and a kernel under a Linen
    ``ConvTranspose_N`` (unflipped ``[*spatial, in, out]``; a Linen module named otherwise is
    not told apart).
    """
    norm_only = {r.other for r in layout.rules if r.kinds == (NORM,)}
    norm_only -= {r.other for r in layout.rules if NORM not in r.kinds}
    by_scope: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        scope, _, leaf = key.rpartition("/")
        by_scope.setdefault(scope, {})[leaf] = tuple(shape)
    kinds: dict[str, str] = {}
    for scope, leaves in by_scope.items():
        kernel_rank = len(leaves[layout.kernel]) if layout.kernel in leaves else None
        kind: str | None
        if norm_only & leaves.keys() or kernel_rank == 1:
            kind = NORM
        elif kernel_rank == 2 and "bias" not in leaves and _embedding_named_like_kernel(layout):
            kind = None  # a bias-free Linear's or an Embedding's: the file does not say
        elif kernel_rank == 2 and _embedding_named_like_kernel(layout) and _hf_conv1d_named(scope):
            kind = None  # a Linear's [out, in] or Hugging Face's Conv1D's [in, out]: the file does not say
        elif is_linen_transposed(scope):
            kind = None  # Flax's ConvTranspose: [*spatial, in, out] unflipped, which no rule makes Keras's
        else:
            kind = {2: DENSE, 3: CONV, 4: CONV, 5: CONV}.get(kernel_rank or 0)
        if kind:
            kinds.update({join_scope(scope, leaf): kind for leaf in leaves})
    return kinds


def _kind_unsaid(layout: Layout, scope: str, leaf: str, shape: tuple[int, ...], rest: Collection[str]) -> str:
    """Why a tensor of a layer whose kind the file leaves open converts by no rule, where more
    can be said than that: which kinds it could be, and how to say which ("" where nothing)."""
    conv1d = _hf_conv1d_named(scope)
    if leaf != layout.kernel:
        return (f"belongs to the layer of {join_scope(scope, layout.kernel)!r}, refused as that is"
                if conv1d and join_scope(scope, layout.kernel) in rest else "")
    if len(shape) != 2:
        return ""
    if conv1d:
        return (f"a rank-2 {leaf!r} of a layer named {scope.rpartition('/')[2]!r} is, in GPT-2 and models built on "
                "its code, Hugging Face's Conv1D, stored [in, out] where a Linear is [out, in], which a file does not "
                "tell apart; this layout converts Linear layers only: if it is one, say so (ws convert --kind "
                f"'{scope}=dense', or for every block --kind '{_NUMBERS.sub('/*', scope)}=dense')")
    return (f"a rank-2 {leaf!r} with no 'bias' beside it is a bias-free Linear's or an Embedding's, which a file "
            f"does not tell apart; say which: kinds={{{scope!r}: 'dense'}} (ws convert --kind '{scope}=dense' or "
            "=embedding), or export the module")


#: the layer names GPT-2 and the models built on its code give Hugging Face's ``Conv1D``, a
#: dense layer whose ``weight`` is ``[in, out]`` where a Linear's is ``[out, in]``
_HF_CONV1D_NAMES = frozenset({"c_attn", "c_proj", "c_fc", "q_attn"})


_LINEN_TRANSPOSED = re.compile(r"(?:^|/)ConvTranspose_\d+$")  # Linen names a module by its class and number


def is_linen_transposed(scope: str) -> bool:
    """Whether ``scope`` is a Flax Linen ``ConvTranspose``'s, by the name Linen gives it."""
    return _LINEN_TRANSPOSED.search(scope) is not None
_NUMBERS = re.compile(r"/\d+(?=/|$)")  # a scope's numbered segments (a block's index), for a glob of them all


def _hf_conv1d_named(scope: str) -> bool:
    return scope.rpartition("/")[2] in _HF_CONV1D_NAMES


def _embedding_named_like_kernel(layout: Layout) -> bool:
    return any(EMBEDDING in r.kinds and r.other == layout.kernel for r in layout.rules)


def kinds_by_pattern(shapes: Mapping[str, tuple[int, ...]], patterns: Mapping[str, str] | None) -> dict[str, str]:
    """Key -> kind for every key whose layer scope (the key without its leaf) matches a pattern
    (a scope or glob) of ``patterns`` (pattern -> kind); the first matching pattern wins."""
    if not patterns:
        return {}
    for kind in patterns.values():
        _counted(kind)
    kinds = {}
    for key in shapes:
        scope = key.rpartition("/")[0]
        given = next((kind for pattern, kind in patterns.items() if passes(scope, include=pattern)), None)
        if given is not None:
            kinds[key] = given
    return kinds


def fold_bias_into_norm(weights: Mapping[str, np.ndarray], layer: str, norm: str) -> dict[str, np.ndarray]:
    """Keras-named ``weights`` with ``layer``'s bias folded into the batch norm ``norm`` that
    follows it: a new dict without ``layer/bias`` and with ``norm/moving_mean`` lowered by it.

    ``norm(conv(x) + b)`` is ``norm'(conv(x))`` when the norm's mean is ``mean - b``: how a
    Keras convolution with a bias (``keras.applications.ResNet50``'s) becomes a PyTorch one
    built with ``bias=False`` (torchvision's). Exact but for one rounding per channel.
    """
    bias_key, mean_key = join_scope(layer, "bias"), join_scope(norm, "moving_mean")
    for key in (bias_key, mean_key):
        if key not in weights:
            raise LayoutError(f"fold_bias_into_norm: no tensor {key!r}")
    folded = {key: value for key, value in weights.items() if key != bias_key}
    folded[mean_key] = np.asarray(weights[mean_key]) - np.asarray(weights[bias_key])
    return folded


def selected_refusals(refused: Mapping[str, str], *, scope: str | None, mapping: MappingRules,
                      include: Patterns, exclude: Patterns) -> list[tuple[str, str, str]]:
    """``(key, source key, why)`` for the refused values an assign would have offered.

    Mapped, selected and put under ``scope`` as ``plan_assign`` treats values, so a tensor the
    caller excluded is not reported.
    """
    rules = parse_mapping(mapping)
    norm_scope = normalize_scope(scope)
    kept = []
    for source, why in refused.items():
        mapped = map_key(source, rules)
        if passes(mapped, include, exclude):
            kept.append((join_scope(norm_scope, mapped), source, why))
    return kept


def refuse_keras_file(values: ValueSource) -> None:
    """Refuse values under Keras's own names (``layers/dense/vars/0``), which no layout rule or
    graph can tell apart without the Keras model that wrote them, saying how to key them by that
    model: a ``.weights.h5`` (or sharded ``.weights.json``), and a ``.keras`` archive whose config
    could not key it (``keys_note`` says why). A ``.keras`` keyed like its model holds
    ``tf2.export``'s keys, and pairs as a store that ``tf2.export`` wrote does."""
    path = values.path
    if values.keys_note:
        raise AssignmentError(
            f"is a .keras archive that keeps Keras's own tensor names (layers/<layer>/vars/<i>), not its model's, "
            f"as {values.keys_note}: key it by its Keras model first, in Python with tf2.assign(model, path) then "
            f"tf2.export(model), or with `ws export {path} -o m.npz --model-keys`", path=path)
    if path is not None and path.endswith((keras_file.WEIGHTS_SUFFIX, keras_sharded.SUFFIX)):
        raise AssignmentError(
            "is a Keras weights file, whose tensors Keras names by its save walk (layers/<layer>/vars/<i>), not by "
            "layer: key it by its Keras model first, in Python with tf2.assign(model, path) then tf2.export(model), "
            f"or with `ws export {path} -o m.npz --model m.keras`", path=path)


class LaidOutValues:
    """A view of assign's values (``plan.Values``) under their converted names, shapes and contents."""

    def __init__(self, values: ValueSource, steps: Mapping[str, AnyStep]):
        self._values = values
        self._steps = steps
        self.path = values.path
        self.where = values.where
        self.exact_keys = values.exact_keys
        self.keys_note = values.keys_note
        self.regional = False  # a converted value is built whole from what it comes from

    def keys(self) -> list[str]:
        return list(self._steps)

    def dtype(self, key: str) -> np.dtype:
        return self._values.dtype(self._steps[key].source)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._steps[key].shape

    def checksum(self, key: str, region: tuple[slice, ...] | None = None) -> str | None:
        step = self._steps[key]  # read whole (not regional): the value's digest, whatever the region
        digests = [self._values.checksum(source) for source in step.sources]
        if None in digests:
            return None
        return f"{'+'.join(map(str, digests))}@{step.rule}" + (f":{step.output}" if isinstance(step, LayerStep) else "")

    def read(self, key: str) -> np.ndarray:
        return self._steps[key].build(self._values.read)

    def read_region(self, key: str, region: tuple[slice, ...]) -> np.ndarray:
        return np.array(self.read(key)[region])

    def prefetch(self, keys: list[str]) -> None:
        """Nothing: converted values are read one by one, as each is converted."""


def plan_laid_out(values: ValueSource, targets: Mapping[str, TargetInfo], options: AssignOptions, *,
                  layout: Layout | None, optional: Callable[[str], bool] | None = None,
                  tied: Mapping[str, str] | None = None,
                  unconvertible: Callable[[str], str] | None = None) -> tuple[Plan, ValueSource]:
    """``plan_assign`` over Keras-named ``values`` converted by ``layout`` (as they are when ``None``).

    Returns the plan and the values to read its pairs from. Values no rule converts are
    reported as mismatched, so a strict assign refuses them and changes nothing; so are those
    bound for a target for which ``unconvertible(target key)`` says why no rule fits it, though
    the shapes would pair (a Flax ``ConvTranspose``'s kernel, neither flipped nor swapped as
    Keras's is).
    """
    refuse_keras_file(values)
    left_out = training_state(values.keys(), targets, options.scope, options.mapping)  # no module holds an optimizer's state
    refused: list[Mismatch] = []
    view: ValueSource = values
    scope, mapping = options.scope, options.mapping
    if layout is not None:
        rules, norm_scope = parse_mapping(mapping), normalize_scope(scope)

        def target_shape(key: str) -> tuple[int, ...] | None:
            target = targets.get(join_scope(norm_scope, map_key(key, rules)))
            return None if target is None else target.shape

        state = set(left_out)
        steps, refusals = from_keras(layout, {key: values.shape(key) for key in list(values.keys()) if key not in state},
                                     target_shape)
        if unconvertible is not None:
            for new in list(steps):
                why = unconvertible(join_scope(norm_scope, map_key(new, rules)))
                if why:
                    refusals[steps.pop(new).source] = why
        view = LaidOutValues(values, steps)
        for key, source, why in selected_refusals(refusals, scope=scope, mapping=mapping, include=options.include,
                                                  exclude=options.exclude):
            refused.append(Mismatch(key, "", describe(values.dtype(source), values.shape(source)), why))
    try:
        plan = plan_assign(view, targets, options, optional=optional, refused=refused, left_out=left_out, tied=tied)
    except AssignmentError as error:
        if options.mapping or values.path is None or not is_legacy_keras_h5(values.path):
            raise
        raise legacy_keras_h5_error(error) from error
    plan.report.left_out = left_out  # a layout converts none of them: named as the values name them
    return plan, view


def convert(weights: Mapping[str, np.ndarray], direction: str, *,
            kinds: Mapping[str, str] | None = None) -> dict[str, np.ndarray]:
    """``weights`` in the other naming and layout (``direction`` from :data:`DIRECTIONS`); a new dict.

    ``kinds`` (a layer scope or glob -> ``dense``, ``conv``, ``depthwise``, ``norm`` or
    ``embedding``) decides what a file's names and shapes leave open (a Keras 3 depthwise
    kernel, a bias-free PyTorch Linear or Embedding), which is otherwise refused. A depthwise
    layer of depth multiplier ``M`` is ``depthwise:M`` on the way to Keras: a PyTorch or Flax
    file holds its kernel as ``channels * M`` filters of one input channel each; a PyTorch
    ``MultiheadAttention`` of ``H`` heads is ``attention:H``.

    Raises:
        LayoutError: naming every tensor no rule converts.
    """
    if direction not in DIRECTIONS:
        raise LayoutError(f"unknown layout {direction!r}; use one of {', '.join(DIRECTIONS)}")
    name, from_keras_names = DIRECTIONS[direction]
    shapes = {key: np.shape(value) for key, value in weights.items()}
    given = kinds_by_pattern(shapes, kinds)
    if from_keras_names:  # a Keras kernel holds its multiplier as an axis of its own
        steps, refused = from_keras(LAYOUTS[name], shapes, kinds={key: _counted(kind)[0] for key, kind in given.items()})
    else:
        steps, refused = to_keras(LAYOUTS[name], shapes, kinds=given)
    if refused:
        raise LayoutError(refusal_message(None, refused))
    return {new: step.build(weights.__getitem__) for new, step in steps.items()}


def refusal_message(where: str | None, refused: Mapping[str, str], listed: int = 20) -> str:
    """Every refused tensor and why, one line per reason: a layer refused whole (a PyTorch
    ``MultiheadAttention`` from a file) names its tensors once, with its reason once."""
    plural = "s" if len(refused) != 1 else ""
    head = f"{len(refused)} tensor{plural} the layout cannot convert exactly:"
    lines = [f"{where}: {head}" if where else head]
    by_reason: dict[str, list[str]] = {}
    for key, why in list(refused.items())[:listed]:
        by_reason.setdefault(why, []).append(key)
    lines += [f"  {', '.join(keys)}: {why}" for why, keys in by_reason.items()]
    if len(refused) > listed:
        lines.append(f"  … and {len(refused) - listed} more")
    if any(_KERAS_FILE_NAME.search(key) for key in refused):
        lines.append("  (names like layers/dense/vars/0 are a Keras file's own: read the file keyed like its "
                     "model first, with ws export FILE --model-keys, or --model MODEL.keras for a .weights.h5)")
    return "\n".join(lines)


#: how a Keras 3 file names a variable: by its layer's path and its place in the layer
_KERAS_FILE_NAME = re.compile(r"(^|/)vars/\d+$")
