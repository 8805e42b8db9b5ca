"""What an assign will do, decided before any variable changes.

Adapters differ only in how they list variables and write values; the options, the pairing
of values with targets, the dtype rules, the error message and the hot-reload memory live
here so every adapter means exactly the same thing by ``scope``, ``mapping``, ``strict`` and
``cast`` (:mod:`weightstore.adapters.skeleton` runs the plan).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import math
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Protocol, TypedDict

import ml_dtypes
import numpy as np

import weightstore
from weightstore.adapters.artifacts import open_artifact
from weightstore.core._arrays import as_numpy
from weightstore.core.keys import (
    MappingRules,
    Patterns,
    in_scope,
    join_scope,
    normalize_scope,
    passes,
    plan_inward,
    plan_outward,
    require_matches,
    strip_scope,
)
from weightstore.core.keys import suggest as keys_suggest
from weightstore.core.manifest import TensorInfo, logical_dtype
from weightstore.errors import AssignmentError, SelectionError, named, naming

__all__ = ["Report", "SelectionWords", "AssignWords", "Selection", "AssignOptions", "AssignWarning"]

_LISTED = 20  # names shown per category in an error; the rest are counted
_SHOWN = 3  # names shown per category in a report's one-paragraph summary
_TYPO = 0.8  # how alike two variable names must be for one to be offered as the other misspelt


class AssignWarning(UserWarning):
    """A non-strict assign left most of the selected variables as they were."""


class SelectionWords(TypedDict, total=False):
    """The keyword arguments every export takes (``tf2.export(model, scope=..., include=...)``).

    Each adapter's ``export`` declares ``**selection: Unpack[SelectionWords]`` and makes a
    :class:`Selection` of them, so the words, their types and their defaults are the same in
    every adapter, the hooks and the CLI; mypy checks every call. The fields of
    :class:`Selection` are these words (a test holds the two to one list).
    """

    scope: str | None
    include: Patterns
    exclude: Patterns
    trainable_only: bool
    also: Patterns


class AssignWords(SelectionWords, total=False):
    """The keyword arguments every assign takes: :class:`SelectionWords` plus :class:`AssignOptions`'s own."""

    mapping: MappingRules
    strict: bool
    cast: bool
    skip_unchanged: bool | None


@dataclass(frozen=True)
class Selection:
    """Which variables an export or assign sees; the same words in every adapter.

    ``scope``: only variables under it (keys relative to it); ``include``/``exclude``: patterns
    on those relative keys; ``trainable_only``: only trainable ones, plus those matching ``also``.
    """

    scope: str | None = None
    include: Patterns = None
    exclude: Patterns = None
    trainable_only: bool = False
    also: Patterns = None

    def keeps(self, key: str, trainable: bool) -> bool:
        """The ``trainable_only`` rule for a variable with scope-relative ``key``."""
        return keeps(key, trainable, self.trainable_only, self.also)

    def choose(self, keys: Iterable[str], trainable: Callable[[str], bool], where: str = "", *,
               mapping: MappingRules = None, command_line: bool = False) -> dict[str, str]:
        """Output key -> key of what these words keep of ``keys``, the one rule every export follows.

        ``scope``, ``mapping``, ``include`` and ``exclude`` first (:func:`plan_outward`), then
        ``trainable_only`` with ``also`` on the output keys (``trainable`` is asked of a key of
        ``keys``). Each word must do something: an ``also`` that matches no key is refused, as
        is a ``trainable_only`` that keeps nothing of what the other words kept. ``where``
        describes what is not a file (``"the graph"``); ``command_line`` names the words as the
        ``ws`` command spells them (``--also``).
        """
        plan = plan_outward(keys, scope=self.scope, mapping=mapping, include=self.include, exclude=self.exclude,
                            where=where)
        if self.also:
            require_also_use(self.trainable_only)
            require_matches(plan.keys(), self.also, "--also" if command_line else "also", where)
        if not self.trainable_only:
            return plan
        chosen = {new: old for new, old in plan.items() if self.keeps(new, trainable(old))}
        if plan and not chosen:
            word = "--trainable-only" if command_line else "trainable_only"
            raise SelectionError(f"{word} keeps nothing{' of ' + where if where else ''}: "
                                 "every selected variable is non-trainable")
        return chosen

    def words(self) -> SelectionWords:
        """These options as the keyword arguments that make them, to pass on to an export."""
        return SelectionWords(scope=self.scope, include=self.include, exclude=self.exclude,
                              trainable_only=self.trainable_only, also=self.also)


@dataclass(frozen=True)
class AssignOptions(Selection):
    """A :class:`Selection` plus how values become variables' contents.

    ``mapping`` renames the dictionary's keys before pairing; ``strict`` refuses any missing,
    unexpected or mismatched key without changing a variable; ``cast`` allows dtype conversions
    that round, never one out of the target's range (:func:`out_of_range`); ``skip_unchanged``
    (``None``: only for versions) leaves alone variables that last received the very same bytes.
    """

    mapping: MappingRules = None
    strict: bool = True
    cast: bool = False
    skip_unchanged: bool | None = None

    def assign_words(self) -> AssignWords:
        """These options as the keyword arguments that make them, to pass on to an assign."""
        return AssignWords(**self.words(), mapping=self.mapping, strict=self.strict, cast=self.cast,
                           skip_unchanged=self.skip_unchanged)


@dataclass(frozen=True)
class Mismatch:
    key: str
    target: str  # "float32[3, 4]"
    value: str
    reason: str

    def __str__(self) -> str:
        if not self.target:  # refused before pairing (no layout rule converts it): no variable to name
            return f"{self.key}: value is {self.value} ({self.reason})"
        return f"{self.key}: variable is {self.target}, value is {self.value} ({self.reason})"


@dataclass(repr=False)
class Report:
    """What an assign did. ``skipped`` holds keys left alone because their bytes had not changed.

    ``str(report)`` is a one-paragraph summary (counts and the first few keys of each kind)
    and ``repr`` only counts, so printing the report of a 500-variable model stays readable;
    the lists themselves hold everything.
    """

    assigned: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[Mismatch] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # values not assigned as training state (optimizer slots, step)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        parts = [f"assigned {len(self.assigned)} variable{'s' * (len(self.assigned) != 1)}"]
        for title, items in (("skipped as unchanged", self.skipped),
                             ("left out as training state (optimizer=True assigns them)", self.left_out),
                             ("missing (no value)", self.missing),
                             ("unexpected (no variable)", self.unexpected),
                             ("mismatched", [m.key for m in self.mismatched])):
            if items:
                parts.append(f"{len(items)} {title}: {named(items, shown=_SHOWN)}")
        return "; ".join(parts) + "."

    def __repr__(self) -> str:
        counts = ", ".join(f"{name}={len(getattr(self, name))}"
                           for name in ("assigned", "missing", "unexpected", "mismatched", "skipped", "left_out"))
        return f"Report({counts})"


@dataclass(frozen=True)
class TargetInfo:
    """A variable as the planner sees it: its key, numpy dtype, shape and trainability."""

    key: str
    dtype: np.dtype
    shape: tuple[int, ...]
    trainable: bool = True


@dataclass
class Plan:
    pairs: dict[str, str]  # target key -> value (source) key
    report: Report
    #: why most variables stay as they were (``strict=False``): warned by :meth:`warn` once the
    #: assign has succeeded, not before an error that changes nothing
    warning: str = ""

    def warn(self) -> None:
        """Issue :attr:`warning`, if any, as an :class:`AssignWarning` at the user's call."""
        if self.warning:
            warnings.warn(self.warning, AssignWarning, stacklevel=_callers_level())


def _callers_level() -> int:
    """The ``stacklevel`` of the first frame outside weightstore: the user's call of ``assign``,
    however many adapter frames lie between."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_globals.get("__name__", "").startswith("weightstore."):
        frame, level = frame.f_back, level + 1
    return level


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
        elif isinstance(weights, (str, os.PathLike)):
            self._store = open_artifact(weights)
            self._owned = True
        elif hasattr(weights, "path"):
            self._store = weightstore.open(weights)
            self._owned = True
        else:
            raise TypeError(f"weights must be a dict, a path, a Store or a Version, not {type(weights).__name__}")
        self._ready: dict[str, np.ndarray] = {}  # read by prefetch, not yet handed out
        self.path = self._store.path if self._store is not None else None
        self.where = self.path or "the weight dictionary"
        self.exact_keys = self._store is not None and self._store.exact_keys  # keys paired by structure: no hints
        self.missing_note: str = getattr(self._store, "missing_note", "")  # why a file cannot hold some variables
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


def widens(source: np.dtype, target: np.dtype) -> bool:
    """Whether every value of ``source`` is exactly representable in ``target``."""
    source, target = np.dtype(source), np.dtype(target)
    return source == target or _widens(source, target)


@functools.lru_cache(maxsize=1024)  # asked once per tensor of a plan; a model has a handful of dtype pairs
def _widens(source: np.dtype, target: np.dtype) -> bool:
    try:
        if not np.can_cast(source, target, "safe"):
            return False
    except TypeError:
        return False
    integers = _integer_bits(source)
    if integers is not None:
        return _holds_integers(target, *integers)
    return not _loses_negative_zero(source, target)


def _loses_negative_zero(source: np.dtype, target: np.dtype) -> bool:
    """Whether ``source`` has a negative zero that ``target`` makes positive (the ``fnuz``
    float8 types have one zero, so float4_e2m1fn's -0 comes out +0 though numpy calls it safe)."""
    if _complex_part(source) is not None:
        return False  # a safe complex cast keeps both parts' types
    target = _complex_part(target) or target  # a real value becomes the real part
    with np.errstate(all="ignore"):
        negative_zero = np.array(-0.0).astype(source)
        return bool(np.signbit(negative_zero)) and not np.signbit(negative_zero.astype(target))


def _integer_bits(dtype: np.dtype) -> tuple[int, bool] | None:
    """Magnitude bits and signedness of a bool or integer dtype (numpy's or ml_dtypes', such as
    int4), ``None`` for any other: numpy calls every integer -> float cast safe."""
    if dtype.kind == "b":
        return 1, False
    try:
        info = ml_dtypes.iinfo(dtype)
    except ValueError:
        return None
    signed = info.min < 0
    return info.bits - signed, signed


def _holds_integers(target: np.dtype, bits: int, signed: bool) -> bool:
    """Whether ``target`` holds every integer of ``bits`` magnitude bits: a float needs that many
    significand bits (int64 does not fit float64, nor int8 float8_e4m3fn), the range for the
    largest, a sign for negatives and a zero (float8_e8m0fnu has neither). ml_dtypes' floats
    are numpy kind ``V`` (some ``f``), so ``ml_dtypes.finfo`` tells what a float is."""
    try:
        info = ml_dtypes.finfo(target)
    except ValueError:
        return True  # an integer: np.can_cast judged its range
    return (bits <= info.nmant + 1 and bits < info.maxexp and (info.min < 0 or not signed)
            and target.type(0) == 0)


def _castable(source: np.dtype, target: np.dtype) -> bool:
    try:
        return np.can_cast(source, target, "unsafe") and source.kind in "biufcV" and target.kind in "biufcV"
    except TypeError:
        return False


def out_of_range(array: np.ndarray, dtype: np.dtype) -> str:
    """What of ``array`` a cast to ``dtype`` cannot hold ("" if nothing).

    ``cast=True`` accepts rounding (float64 to float32, float to int), but numpy's cast turns
    a value beyond the target's range into inf, or wraps an integer around, without a word: the
    variable would silently hold other numbers than the file. A complex value may lose its
    imaginary part only where that is zero. A bool takes 0 and 1 alone: numpy's cast makes any
    other number True, NaN and 0.3 included.
    """
    target = np.dtype(dtype)
    if array.size == 0 or widens(array.dtype, target):
        return ""
    if _complex_part(array.dtype) is not None:
        array = np.ascontiguousarray(array, np.complex128)  # ml_dtypes' complex32, bcomplex32 too; viewed below
        part = _complex_part(target)
        if part is None:
            return (f"holds complex values with an imaginary part, which {target.name} cannot hold"
                    if np.any(array.imag) else out_of_range(array.real, target))
        return out_of_range(array.view(np.float64), part)  # both parts
    if (real_part := _complex_part(target)) is not None:  # a real value becomes the real part
        return out_of_range(array, real_part)
    if array.dtype.kind == "V":  # an ml_dtypes type (bfloat16, float8, int4), reduced as a numpy one
        array = array.astype(np.int64 if _is_integer(array.dtype) else np.float64)
    if target.kind == "b":
        other = array[(array != 0) & (array != 1)]
        return f"holds {other.flat[0].item():g}, which bool cannot hold (only 0 and 1)" if other.size else ""
    integer = _is_integer(target)
    smallest, largest = np.min(array).item(), np.max(array).item()  # NaN, if any, comes out as NaN
    if array.dtype.kind == "f" and not (math.isfinite(smallest) and math.isfinite(largest)):
        if integer:
            return f"holds {'NaN' if np.isnan(array).any() else 'inf'}, which {target.name} cannot hold"
        special = _special_lost(array, target)
        if special:
            return f"holds {special}, which {target.name} cannot hold (a cast would not keep it)"
        finite = np.isfinite(array)
        if not finite.any():
            return ""
        smallest = np.min(array, where=finite, initial=np.inf).item()
        largest = np.max(array, where=finite, initial=-np.inf).item()
    limits = ml_dtypes.iinfo(target) if integer else None  # numpy's types too
    kept = None if integer else _largest_rounded_in(target)
    for extreme in (smallest, largest):
        if limits is not None:  # a cast to an integer truncates toward zero
            fits = int(limits.min) <= math.trunc(extreme) <= int(limits.max)
        else:  # rounds to nearest: past the largest value by half a step it becomes inf (float8: NaN), or
            # the largest value itself in a type without inf or NaN (float4_e2m1fn: 1e10 becomes 6)
            with np.errstate(over="ignore", invalid="ignore"):
                cast = np.array(extreme, array.dtype).astype(target).astype(np.float64)
            fits = bool(np.isfinite(cast)) and abs(extreme) <= (kept or 0.0)
        if not fits:
            shown = f"{extreme:g}" if isinstance(extreme, float) else str(extreme)
            return f"holds {shown}, beyond {target.name}'s range (cast=True converts values as numpy does, it does not clip them)"
    return ""


@functools.lru_cache(maxsize=256)
def _largest_rounded_in(target: np.dtype) -> float:
    """The largest magnitude a cast to the float ``target`` rounds rather than overflows: its
    largest value and half the step below it."""
    largest = np.array(ml_dtypes.finfo(target).max, target)
    below = largest.view(f"u{target.itemsize}") - 1  # the next smaller positive float's bits
    step = float(largest.astype(np.float64)) - float(below.view(target).astype(np.float64))
    return float(largest.astype(np.float64)) + step / 2


def _special_lost(array: np.ndarray, target: np.dtype) -> str:
    """The first of NaN, inf and -inf that ``array`` holds and a cast to the float ``target``
    does not keep ("" if none): float8_e4m3fn has no inf (it becomes NaN), float4_e2m1fn
    neither NaN nor inf, float8_e8m0fnu no sign."""
    for value, present in ((math.nan, np.isnan(array).any()), (math.inf, np.isposinf(array).any()),
                           (-math.inf, np.isneginf(array).any())):
        if present:
            with np.errstate(all="ignore"):
                cast = float(np.array(value).astype(target).astype(np.float64))
            if not (cast == value or (math.isnan(value) and math.isnan(cast))):
                return str(value)
    return ""


def _complex_part(dtype: np.dtype) -> np.dtype | None:
    """The dtype of each part of a complex ``dtype`` (numpy's, or ml_dtypes' ``complex32`` of
    float16 parts and ``bcomplex32`` of bfloat16 ones); ``None`` for any other."""
    if dtype.name == "bcomplex32":
        return np.dtype(ml_dtypes.bfloat16)
    if dtype.kind == "c":
        return np.dtype(f"f{dtype.itemsize // 2}")
    return None


def _is_integer(dtype: np.dtype) -> bool:
    return dtype.kind in "iu" or (dtype.kind == "V" and not dtype.name.startswith(("float", "bfloat", "bcomplex")))


def describe(dtype: np.dtype, shape: tuple[int, ...]) -> str:
    return f"{np.dtype(dtype).name}{list(shape)}"


def plan_assign(
    values: ValueSource,
    targets: Mapping[str, TargetInfo],
    options: AssignOptions,
    *,
    optional: Callable[[str], bool] | None = None,
    refused: Sequence[Mismatch] = (),
    left_out: Collection[str] = (),
    tied: Mapping[str, str] | None = None,
) -> Plan:
    """Pair values with variables by key and check every pair; raise before writing if strict.

    Values are the dictionary's keys after ``mapping`` and ``scope`` that pass
    ``include``/``exclude`` (scope-relative). Targets are the variables under ``scope`` whose
    scope-relative key passes the same selection, and, with ``trainable_only``, are trainable
    or match ``also``. Not strict, a plan that leaves most targets as they were carries a
    warning (:attr:`Plan.warning`, issued by :meth:`Plan.warn` once the assign succeeded):
    that is nearly always the wrong file, scope or mapping.
    ``optional`` keys are state one framework keeps and others lack (PyTorch's
    ``num_batches_tracked``): assigned when both sides have them, never missing or unexpected.
    ``refused`` are values the adapter could not offer at all (no layout rule converts them);
    they count as mismatched. ``left_out`` are value keys (as the values name them) that are
    training state the caller did not ask for (a TF1 checkpoint's optimizer slots): never
    paired, listed in ``report.left_out``. ``tied`` maps a target to the first of the targets
    that are one tensor with it (PyTorch's tied weights): a value for any of them is a value
    for all, so a file that holds one of them (as ``safetensors.torch.save_model`` and Hugging
    Face write tied weights) leaves none missing.
    """
    norm_scope = normalize_scope(options.scope)
    include, exclude, cast = options.include, options.exclude, options.cast
    every_key = values.keys()
    described = "" if values.path else values.where  # a file is the errors' path, not in their text
    with naming(path=values.path):
        value_keys = plan_inward([key for key in every_key if key not in left_out] if left_out else every_key,
                                 scope=norm_scope, mapping=options.mapping, include=include, exclude=exclude,
                                 where=described)
    selectable = {
        strip_scope(key, norm_scope): info
        for key, info in targets.items()
        if in_scope(key, norm_scope) and key != norm_scope and passes(strip_scope(key, norm_scope), include, exclude)
    }
    if options.also:
        require_also_use(options.trainable_only)
        require_matches(selectable.keys(), options.also, "also", "the model's variables")
    chosen = {join_scope(norm_scope, relative): info for relative, info in selectable.items()
              if keeps(relative, info.trainable, options.trainable_only, options.also)}
    report = Report(left_out=[key for key in every_key if key in left_out] if left_out else [])
    tied = tied or {}
    valued_groups = {tied.get(key, key) for key in value_keys if key in chosen}
    report.missing = [k for k in chosen if k not in value_keys and not (optional and optional(k))
                      and tied.get(k, k) not in valued_groups]
    report.unexpected = [k for k in value_keys if k not in chosen and not (optional and optional(k))]
    report.mismatched.extend(refused)
    pairs: dict[str, str] = {}
    for key, source in value_keys.items():
        target = chosen.get(key)
        if target is None:
            continue
        problem = _pair_problem(values.dtype(source), values.shape(source), target, cast)
        if problem:
            report.mismatched.append(
                Mismatch(key, describe(target.dtype, target.shape), describe(values.dtype(source), values.shape(source)), problem)
            )
        else:
            pairs[key] = source
    renamed = bool(options.scope or options.mapping)  # value keys are as the caller's words made them
    if (options.strict and not report.ok) or not pairs:
        empty = norm_scope and not any(in_scope(key, norm_scope) and key != norm_scope for key in targets)
        raise AssignmentError(
            _message(report, described, chosen, value_keys, pairs, targets, lambda key: values.shape(value_keys[key]),
                     trainable_only=options.trainable_only, hints=not values.exact_keys,
                     note=getattr(values, "missing_note", ""), renamed=renamed,
                     scope_problem=_no_such_scope(norm_scope, targets) if empty else ""),
            missing=report.missing, unexpected=report.unexpected, mismatched=report.mismatched, path=values.path,
        )
    required = {key: info for key, info in chosen.items() if not (optional and optional(key) and key not in pairs)}
    warning = (_few_assigned(values.where, len(pairs), required, value_keys, renamed, report.mismatched)
               if len(pairs) * 2 < len(required)
               else "")
    return Plan(pairs, report, warning)


def settle_tied(plan: Plan, values: ValueSource, targets: Mapping[str, TargetInfo], tied: Mapping[str, str], *,
                strict: bool) -> None:
    """Keys that name one variable (``tied``, as :func:`plan_assign` takes it: a dict naming a
    variable twice, a wrapped optimizer's slots that Keras files name twice) are written once.
    Where several of them have a value, the values must be one value, or whichever came last
    would win for all: equal ones are written under the first key alone, and a different one
    is mismatched (strict: refused, nothing changed). Equal means the same bytes once cast to
    the target's dtype; content digests decide without a read where both values have one."""
    if not tied:
        return
    groups: dict[str, list[str]] = {}
    for key in plan.pairs:
        groups.setdefault(tied.get(key, key), []).append(key)
    conflicts = []
    for first, *others in (keys for keys in groups.values() if len(keys) > 1):
        for key in others:
            source = plan.pairs.pop(key)
            if not _same_value(values, plan.pairs[first], source, targets[key].dtype):
                shape = describe(values.dtype(source), values.shape(source))
                conflicts.append(Mismatch(key, describe(targets[key].dtype, targets[key].shape), shape,
                                          f"the same variable as {first!r}, whose value differs"))
    refuse_before_write(conflicts, plan.report, strict=strict, where="" if values.path else values.where,
                        path=values.path)


def _same_value(values: ValueSource, one: str, other: str, dtype: np.dtype) -> bool:
    if tuple(values.shape(one)) != tuple(values.shape(other)):
        return False
    digests = values.checksum(one), values.checksum(other)
    if None not in digests and (digests[0] == digests[1] or values.dtype(one) == values.dtype(other)):
        return digests[0] == digests[1]  # else two dtypes: equal once cast, maybe
    with np.errstate(all="ignore"):  # a value beyond the dtype is refused later, by the range check
        read = [np.ascontiguousarray(values.read(key), dtype) for key in (one, other)]
    return bool(np.array_equal(read[0].reshape(-1).view(np.uint8), read[1].reshape(-1).view(np.uint8)))


def refuse_before_write(conflicts: Sequence[Mismatch], report: Report, *, strict: bool, where: str,
                        path: str | None = None) -> None:
    """Mismatches found after planning, before any write: strict, an :class:`AssignmentError`
    that changes nothing; else listed in ``report.mismatched``, the rest written."""
    if conflicts and strict:
        lines = "\n".join(f"    {mismatch}" for mismatch in conflicts)
        on = f" {where}" if where else ""
        raise AssignmentError(f"cannot assign{on}: nothing was changed\n  {len(conflicts)} mismatched:\n{lines}",
                              mismatched=list(conflicts), path=path)
    report.mismatched.extend(conflicts)


def require_also_use(trainable_only: bool) -> None:
    """``also`` adds to what ``trainable_only`` keeps; without it every variable is kept, and an
    ``also`` that does nothing would hide a forgotten ``trainable_only`` (the ``ws`` command
    refuses ``--also`` alone as a usage error before this)."""
    if not trainable_only:
        raise SelectionError("also= adds non-trainable variables to what trainable_only=True keeps; pass "
                             "trainable_only=True too (without it every variable is kept already)")


def keeps(key: str, trainable: bool, trainable_only: bool, also: Patterns) -> bool:
    """The ``trainable_only`` rule: trainable variables, plus those whose key matches ``also``."""
    return trainable or not trainable_only or (bool(also) and passes(key, also))


def _few_assigned(where: str, paired: int, targets: Mapping[str, TargetInfo], values: Mapping[str, str],
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


def _apart(values: Iterable[str], targets: Iterable[str], renamed: bool) -> str:
    """Why few keys pair: one scope between them, or a different architecture."""
    fix = _scope_fix(values, targets, renamed)
    return (f"the keys differ by a scope: {fix}" if fix else
            "the weights and the model look like different architectures (or differ by a scope: scope= puts "
            "the values under one, mapping={'FROM': 'TO'} renames one)")


def _no_such_scope(scope: str, targets: Iterable[str]) -> str:
    """What to say of a ``scope`` no variable is under: the model's scopes at its depth, the
    nearest first (``model_02`` for ``model_002``)."""
    depth = scope.count("/") + 1
    scopes = sorted({"/".join(key.split("/")[:depth]) for key in targets if key.count("/") >= depth})
    near = keys_suggest(scope, scopes)
    shown = f" (the model's: {', '.join(map(repr, scopes[:5]))}{', …' if len(scopes) > 5 else ''})" if scopes else ""
    return f"no variable is under scope {scope!r}{near or shown}"


def _scope_fix(values: Iterable[str], targets: Iterable[str], renamed: bool) -> str:
    """What would pair the keys when one scope is all that keeps them apart: values saved
    under ``model_002/`` going into unscoped variables need that scope taken off (``mapping``),
    unscoped values going into variables under it need it put on (``scope``); "" when no one
    scope explains most of the keys. ``renamed``: the values' keys are as the caller's
    ``scope``/``mapping`` made them, so those are what to change."""
    value_set, target_set = set(values), set(targets)
    extra = _extra_scope(value_set - target_set, target_set)
    if extra:
        fix = "change scope= or mapping=, which put them there" if renamed else f"pass mapping={{{extra!r}: ''}}"
        return f"the values are under {extra!r} and the variables are not: {fix}"
    missing = _extra_scope(target_set - value_set, value_set)
    if missing:
        fix = "put them under it with scope= or mapping=" if renamed else f"pass scope={missing!r}"
        return f"the variables are under {missing!r} and the values are not: {fix}"
    return ""


def _extra_scope(keys: Collection[str], others: Collection[str]) -> str:
    """The scope (up to three segments) that, taken off, turns at least half of ``keys`` into
    keys of ``others``; "" if none does."""
    counts: dict[str, int] = {}
    for key in keys:
        parts = key.split("/")
        for depth in range(1, min(len(parts), 4)):
            if "/".join(parts[depth:]) in others:
                scope = "/".join(parts[:depth])
                counts[scope] = counts.get(scope, 0) + 1
    best = max(sorted(counts), key=counts.__getitem__, default="")  # ties (an ensemble's members): the first
    return best if best and counts[best] * 2 >= len(keys) else ""


def _pair_problem(dtype: np.dtype, shape: tuple[int, ...], target: TargetInfo, cast: bool) -> str:
    if tuple(shape) != tuple(target.shape):
        return "shapes differ"
    if widens(dtype, target.dtype):
        return ""
    if cast and _castable(dtype, target.dtype):
        return ""
    return "dtype does not widen losslessly; pass cast=True to convert" if _castable(dtype, target.dtype) else "dtypes are incompatible"


def _message(report: Report, where: str, targets: Mapping[str, Any], values: Mapping[str, str], pairs,
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
    if min(len(targets), len(values)) >= 2 and common * 2 < min(len(targets), len(values)):
        lines.append(f"  {common} of {len(values)} values share a key with one of {len(targets)} variables: "
                     f"{_apart(values, every, renamed)}")
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
            lines.extend(f"    {render(item)}" for item in items[:_LISTED])
            if len(items) > _LISTED:
                lines.append(f"    … and {len(items) - _LISTED} more")
            if items is report.missing and note:
                lines.append(f"  why: {note}")
    if report.missing and pairs and not report.unexpected and not report.mismatched:  # a selective save, likely
        lines.append("  every value paired; if the file holds part of the model on purpose, strict=False assigns it "
                     "and the variables it lacks keep theirs (or select as its export did: trainable_only=, also=)")
    return "\n".join(lines)


def _same_leaf(key: str, candidate: str) -> bool:
    """Whether ``candidate`` could be ``key`` misspelt: the same variable name, or one a typo away
    (``kernal``), never another variable of the same layer (``gamma`` for ``beta``, ``b`` for ``w``)."""
    leaf, other = key.rsplit("/", 1)[-1], candidate.rsplit("/", 1)[-1]
    return leaf == other or difflib.SequenceMatcher(None, leaf, other).ratio() >= _TYPO


class ChecksumMemory:
    """Which bytes each variable last received, so a newer version can skip unchanged tensors.

    Keyed weakly by an owner and a name in it (a TF1 session and a variable's name; a TF2
    variable or PyTorch tensor itself, with ""; a Flax module and a path), so forgetting a
    session or a model forgets its entries too. Owners are held by identity, not hash: TF2
    variables refuse ``hash()``, so a ``WeakKeyDictionary`` cannot hold them.
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[weakref.ref, dict[str, str]]] = {}

    def _entries(self, owner: object) -> dict[str, str] | None:
        held = self._seen.get(id(owner))
        return held[1] if held is not None and held[0]() is owner else None

    def unchanged(self, owner: object, key: str, digest: str | None) -> bool:
        return digest is not None and self.recall(owner, key) == digest

    def recall(self, owner: object, key: str) -> str | None:
        """The digest ``owner``'s ``key`` last received, if known."""
        return (self._entries(owner) or {}).get(key)

    def remember(self, owner: object, key: str, digest: str | None) -> None:
        entries = self._entries(owner)
        if entries is None:
            entries = {}
            ident = id(owner)
            self._seen[ident] = (weakref.ref(owner, lambda _: self._seen.pop(ident, None)), entries)
        if digest is None:
            entries.pop(key, None)
        else:
            entries[key] = digest

    def forget(self, owner: object) -> None:
        if self._entries(owner) is not None:
            del self._seen[id(owner)]


MEMORY = ChecksumMemory()


def reload_digest(info: TensorInfo) -> str | None:
    """What hot reload compares to decide a tensor is unchanged: its content digest, dtype and
    shape (equal bytes of another dtype are other values). None where the file has no digest
    (written before manifest version 3): such a tensor is always written, never trusted to a
    CRC-32, which a changed tensor can match."""
    return None if info.digest is None else f"{info.digest} {info.dtype}{list(info.shape)}"


def wants_skip(weights: Any, skip_unchanged: bool | None) -> bool:
    """By default only versions (from ``publish``/``follow``) skip unchanged tensors.

    A plain path may be re-assigned on purpose to undo training, so it is always written.
    """
    if skip_unchanged is not None:
        return skip_unchanged
    return isinstance(weights, weightstore.sync.Version)
