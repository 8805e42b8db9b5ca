"""Flax in and out: NNX modules, and plain parameter pytrees (Linen's nested dicts).

**NNX modules**: the module's ``nnx.Param`` and ``nnx.BatchStat`` variables (not RNG state),
keyed by their ``nnx.state`` path joined with ``/`` (``conv/kernel``, ``bn/mean``,
``layers/0/bias``). Trainable means ``nnx.Param``. :func:`assign` sets each variable's
value in place, on the device (and with the sharding) its old value had. Variables refuse weak
references, so hot reload remembers checksums per module and key.

**Pytrees** (``{"params": {"Dense_0": {"kernel": …}}, "batch_stats": …}``, a ``FrozenDict``,
lists): keys are the tree paths joined with ``/`` (``params/Dense_0/kernel``); every array
leaf is a target, other leaves are left alone. Trainable means under ``params`` in Linen's
variables dict (``batch_stats`` and other collections are not what an optimizer trains), and
every leaf of any other tree (a bare params tree). :func:`restore` returns a new tree and never
changes the one it was given, since JAX code treats trees as values.

``layout="keras"`` converts Keras/TF names and layouts (``gamma`` ↔ ``scale``,
``moving_mean`` ↔ ``mean``, depthwise kernels ↔ grouped ``Conv`` kernels); see
:mod:`weightstore.adapters.layout`. Scope, mapping and selection speak the Flax names.
"""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from typing_extensions import Unpack

from weightstore.core._extras import needs

with needs("flax", __name__):
    import jax
    from flax import nnx

from weightstore.adapters import layout as layouts
from weightstore.adapters._reload import MEMORY
from weightstore.adapters._report import TargetInfo
from weightstore.adapters._values import ValueSource, open_values
from weightstore.adapters.plan import AssignOptions, AssignWords, Report, Selection, SelectionWords
from weightstore.adapters.skeleton import Target, private_copy, range_checked, run_assign
from weightstore.core.keys import MappingRules, Patterns, validate_key
from weightstore.errors import InvalidKeyError, LayoutError, SelectionError
from weightstore.sharded._shards import Piece, in_background, publish_together, split_rows
from weightstore.sync._defaults import DEFAULT_KEEP
from weightstore.sync._delta import Delta
from weightstore.sync._pinning import Version

__all__ = ["export", "export_pieces", "publish_sharded", "assign", "restore", "variables", "forget"]

_STATE = (nnx.Param, nnx.BatchStat)


#: a sharded version's JAX arrays are read shard by shard (see :func:`_placed`)
ASSIGN_READS_REGIONS = True


def variables(module: nnx.Module, **selection: Unpack[SelectionWords]) -> dict[str, nnx.Variable]:
    """Key -> variable for the parameters and batch statistics :func:`export` reads under that
    key with the same words, and :func:`assign` writes in place; without words, every one.

    Only an NNX module has variables: a pytree's leaves are values, which :func:`restore` puts
    into a new tree (a ``TypeError`` says so).
    """
    if not isinstance(module, nnx.Module):
        raise TypeError(f"expected a flax.nnx.Module, not {type(module).__name__} (a pytree holds values, not "
                        "variables: flax.restore makes a new one)")
    found = _variables(module)
    chosen = Selection.of("flax.variables", selection).choose(found, lambda key: isinstance(found[key], nnx.Param), _describe(module))
    return {key: found[old] for key, old in chosen.items()}


def _variables(module: nnx.Module) -> dict[str, nnx.Variable]:
    return {_key(path): node for path, node in nnx.iter_graph(module) if isinstance(node, _STATE)}


def export(
    obj: Any,
    *,
    layout: str | layouts.Layout | None = None,
    **selection: Unpack[SelectionWords],
) -> dict[str, np.ndarray]:
    """A new weight dictionary of an NNX module's variables or a pytree's array leaves.

    ``trainable_only`` keeps a module's ``nnx.Param`` variables, plus those whose key matches
    ``also`` (``also="*/mean"`` adds batch norm's ``BatchStat``s); of a pytree, Linen's
    ``params`` collection (``also="batch_stats/*"`` adds the statistics), or every leaf of a tree
    without one. With ``layout``, keys and arrays come out in Keras's names and layouts; a
    tensor no rule converts raises :class:`~weightstore.errors.LayoutError` listing every such key.
    """
    values, chosen = _selected(obj, Selection.of("flax.export", selection, export))
    sites = _sites(obj) if isinstance(obj, nnx.Module) else None
    weights = {key: np.array(jax.device_get(values[old]), copy=True) for key, old in chosen.items()}
    if layout is None:
        return weights
    steps, refused = layouts.to_keras(
        layouts.resolve(layout, "flax"), {key: value.shape for key, value in weights.items()},
        None if sites is None else {key: sites.get(old, layouts.Site(None)) for key, old in chosen.items()})
    if refused:
        raise LayoutError(layouts.refusal_message(f"exporting {_describe(obj)}", refused))
    return {new: step.build(weights.__getitem__) for new, step in steps.items()}


def export_pieces(obj: Any, **selection: Unpack[SelectionWords]) -> dict[str, list[Piece]]:
    """What this process writes of an NNX module or pytree to a sharded version: key -> its
    :class:`~weightstore.Piece` s, for :func:`weightstore.publish_shard`.

    A JAX array gives the shards on this process's devices (``addressable_shards``), each at the
    offset its ``index`` names, and of shards holding the same part (a replicated axis) only the
    one JAX numbers replica 0, so each part is written once across the job; a numpy leaf, which
    every process holds whole, is split by rows between ``jax.process_count()`` processes, and
    so is an array on this process's devices alone in a job of several (each process has its
    own, taken to be equal). Nothing crosses the network. Keys and selection are :func:`export`'s.
    """
    values, chosen = _selected(obj, Selection.of("flax.export_pieces", selection))
    pieces: dict[str, list[Piece]] = {}
    for key, old in chosen.items():
        value = values[old]
        shape = tuple(np.shape(value))
        if isinstance(value, jax.Array) and not (value.is_fully_addressable and jax.process_count() > 1):
            found = [Piece(np.asarray(shard.data), tuple(part.start for part in _bounds(shard.index, shape)), shape)
                     for shard in value.addressable_shards if shard.replica_id == 0]
        else:  # every process holds it whole: its replica 0 is on every process
            region = split_rows(shape, jax.process_index(), jax.process_count())
            found = [] if region is None else [Piece(np.array(np.asarray(value)[region]),
                                                     tuple(part.start for part in region), shape)]
        if found:
            pieces[key] = found
    return pieces



def publish_sharded(
    folder: Any,
    obj: Any,
    *,
    step: int,
    timeout: float = 600.0,
    keep: int | None = DEFAULT_KEEP,
    metadata: Mapping[str, Any] | None = None,
    background: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    delta: bool | Delta = False,
    digests: bool = True,
    **selection: Unpack[SelectionWords],
) -> Version | concurrent.futures.Future[Version]:
    """Publish an NNX module or pytree as one sharded version, every process of the
    ``jax.distributed`` job writing what it holds (:func:`export_pieces`); call it alike on every
    process. Process 0 hands out the attempt through ``jax.distributed``'s key-value store, every
    process writes its member, process 0 commits, and every process returns the same committed
    :class:`~weightstore.Version` or raises the same error
    (:func:`weightstore.sharded.publish_together`); no collective runs. A single
    process publishes everything as rank 0 of 1.

    With ``background=True`` this process's pieces are copied to host memory now and a
    ``concurrent.futures.Future`` of the version is returned at once; the writing and the commit
    run in a background thread, one publish after another.

    ``delta``: a :class:`~weightstore.Delta` given to every publish of this rank (or ``True``):
    each rank writes its member as a delta of its member of the version before, where smaller
    (``publish_shard``'s ``delta``).

    ``digests=False``: no BLAKE3 of each block (``publish_shard``'s): for a checkpoint no follower
    reads, whose every block is still verified as it is read.

    Raises:
        ShardTimeoutError, PublishError: see ``publish_together`` (through the future with
            ``background=True``).
    """
    pieces = export_pieces(obj, **Selection.of("flax.publish_sharded", selection, publish_sharded).words())
    if background:  # a CPU shard's numpy view shares the device buffer, which a donating step reuses
        pieces = {key: [Piece(np.array(piece.array), piece.start, piece.shape) for piece in found]
                  for key, found in pieces.items()}
    call = functools.partial(publish_together, folder, pieces, step=step, rank=jax.process_index(),
                             world=jax.process_count(), timeout=timeout, keep=keep, metadata=metadata,
                             storage_options=storage_options, delta=delta, digests=digests)
    return in_background(call) if background else call()


def assign(
    module: nnx.Module,
    weights: Any,
    *,
    layout: str | layouts.Layout | None = None,
    **words: Unpack[AssignWords],
) -> Report:
    """Write ``weights`` (a dict, path, open Store or Version) into an NNX module's variables.

    Plans first: a strict failure raises ``AssignmentError`` naming every missing,
    unexpected, mismatched or unconvertible key and changes nothing.
    """
    found = variables(module)  # refuses a pytree, which restore takes
    current = {key: var.get_value() for key, var in found.items()}
    targets = {key: TargetInfo(key, _dtype_of(value), tuple(np.shape(value)), isinstance(found[key], nnx.Param))
               for key, value in current.items()}
    options = AssignOptions.of("flax.assign", words, assign)
    chosen_layout = _resolved(layout)

    def write(batch: list[tuple[str, Any]], report: Report) -> list[str]:
        for key, array in batch:
            found[key].set_value(array)
        return [key for key, _ in batch]

    sites = _sites(module) if chosen_layout is not None else {}

    def plan(values: Any, options: AssignOptions) -> tuple[Any, Any]:
        return layouts.plan_laid_out(values, targets, options, layout=chosen_layout,
                                     unconvertible=lambda key: _TRANSPOSED_KERNEL if sites.get(key) == _TRANSPOSED
                                     and key.rpartition("/")[2] == "kernel" else "")

    def prepare(source: Any, key: str, value_key: str) -> Any:
        return _placed(source, value_key, current[key])

    return run_assign(Target(targets, write, slot=lambda key: (module, key), prepare=prepare, plan=plan), weights, options)


def restore(
    tree: Any,
    weights: Any,
    *,
    scope: str | None = None,
    mapping: MappingRules = None,
    include: Patterns = None,
    exclude: Patterns = None,
    trainable_only: bool = False,
    also: Patterns = None,
    strict: bool = True,
    cast: bool = False,
    layout: str | layouts.Layout | None = None,
) -> Any:
    """A new pytree shaped like ``tree`` whose array leaves hold ``weights``; ``tree`` is unchanged.

    Leaves without a value keep the old one (with ``strict=False``); each new leaf has the
    old leaf's type (a JAX array on the same device and sharding, or a numpy array; for an
    abstract leaf of ``nnx.eval_shape``, a JAX array on the sharding it names).
    ``trainable_only``/``also`` restore what :func:`export` saved with them (a Linen variables
    dict's ``params``, plus ``also="batch_stats/*"``), the other leaves keeping theirs.
    """
    leaves = _leaves(tree)
    trainable = _trainable_leaves(tree, leaves)
    targets = {key: TargetInfo(key, _dtype_of(leaf), tuple(np.shape(leaf)), trainable[key])
               for key, leaf in leaves.items()}
    with open_values(weights) as values:
        options = AssignOptions(scope=scope, mapping=mapping, include=include, exclude=exclude,
                                trainable_only=trainable_only, also=also, strict=strict, cast=cast)
        plan, source = layouts.plan_laid_out(values, targets, options, layout=_resolved(layout),
                                             unconvertible=_linen_transposed_kernel)
        prepare = range_checked(_placed_leaf(leaves), targets) if cast else _placed_leaf(leaves)
        new = {key: prepare(source, key, value_key) for key, value_key in plan.pairs.items()}
    plan.warn()
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(treedef, [new.get(_key(path), leaf) if _is_array(leaf) else leaf
                                                  for path, leaf in flat])


def forget(module: nnx.Module) -> None:
    """Forget what ``module``'s variables last received, so the next assign writes them all."""
    MEMORY.forget(module)


def _resolved(layout: str | layouts.Layout | None) -> layouts.Layout | None:
    return None if layout is None else layouts.resolve(layout, "flax")


def _selected(obj: Any, chosen_by: Selection) -> tuple[dict[str, Any], dict[str, str]]:
    """An NNX module's variable values or a pytree's array leaves by key, and the selected
    ones: output key -> key."""
    if isinstance(obj, nnx.Module):
        found = _variables(obj)
        values = {key: var.get_value() for key, var in found.items()}
        trainable = {key: isinstance(var, nnx.Param) for key, var in found.items()}
    else:
        values = _leaves(obj)
        trainable = _trainable_leaves(obj, values)
    abstract = next((key for key, value in values.items() if isinstance(value, jax.ShapeDtypeStruct)), None)
    if abstract is not None:
        raise SelectionError(f"{_describe(obj)} is abstract (nnx.eval_shape): it has shapes but no values to export",
                             key=abstract)
    chosen = chosen_by.choose(values, trainable.__getitem__, _describe(obj))
    if not chosen:
        raise SelectionError(f"{_describe(obj)} has {'no arrays' if not values else 'no array passing the selection'}")
    return values, chosen


#: what a Flax ``ConvTranspose`` without ``transpose_kernel`` is, as :func:`_site` names it
_TRANSPOSED = layouts.Site("ConvTranspose")
_TRANSPOSED_KERNEL = ("is a Flax ConvTranspose's kernel, [*spatial, in, out] and not flipped (transpose_kernel=False), "
                      "where Keras's is [*spatial, out, in] and flipped: the shapes may pair, but no layout rule converts "
                      "one into the other (with transpose_kernel=True the kernel is Keras's as it is)")


def _linen_transposed_kernel(key: str) -> str:
    """Why a Linen tree's ``ConvTranspose_N/kernel`` takes no Keras kernel (a plain pytree names no modules)."""
    scope, _, leaf = key.rpartition("/")
    return _TRANSPOSED_KERNEL if leaf == "kernel" and layouts.is_linen_transposed(scope) else ""


def _placed_leaf(leaves: dict[str, Any]) -> Callable[[ValueSource, str, str], Any]:
    return lambda source, key, value_key: _placed(source, value_key, leaves[key])


def _placed(source: ValueSource, value_key: str, old: Any) -> Any:
    """The value as the kind of array ``old`` is: same dtype, and for JAX the same sharding, in
    memory of its own (:func:`~weightstore.adapters.skeleton.private_copy`): a view of a mapped
    file, kept as a variable's buffer, would change when another tool rewrote the file, pin it
    once pruned, and kill the process (SIGBUS) once truncated.

    From a sharded version each of this process's devices gets only its part, read by region
    (``jax.make_array_from_callback`` asks only for the parts this process holds, each part
    read once however many devices replicate it); from anything else the value is read whole.
    """
    abstract = isinstance(old, jax.ShapeDtypeStruct)  # nnx.eval_shape's: where the value is to go, and how sharded
    sharding = getattr(old, "sharding", None) if isinstance(old, jax.Array) or abstract else None
    if sharding is not None and source.regional:
        parts: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

        def part(index: tuple[slice, ...] | None) -> np.ndarray:
            region = _bounds(index or (), old.shape)
            box = tuple((bound.start, bound.stop) for bound in region)
            if box not in parts:
                parts[box] = private_copy(np.asarray(source.read_region(value_key, region)), np.dtype(old.dtype))
            return parts[box]

        return jax.make_array_from_callback(old.shape, sharding, part)
    if sharding is not None or abstract:  # a copy first: on the CPU, JAX keeps a host array's memory as its own
        return jax.device_put(private_copy(np.asarray(source.read(value_key)), np.dtype(old.dtype)), sharding)
    return np.array(source.read(value_key), dtype=_dtype_of(old), copy=True)


def _dtype_of(value: Any) -> np.dtype:
    """An array's dtype, or a Python number's as numpy holds it (``nnx.Param(1.0)``)."""
    return np.dtype(value.dtype) if hasattr(value, "dtype") else np.asarray(value).dtype


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    """A shard's ``index`` (slices that may be open) as explicit ``start:stop`` slices on every axis."""
    return tuple(slice(*(index[axis] if axis < len(index) else slice(None)).indices(size)[:2])
                 for axis, size in enumerate(shape))


#: the collection of Linen's variables dict an optimizer trains (``{"params": …, "batch_stats": …}``)
_LINEN_PARAMS = "params"


def _trainable_leaves(tree: Any, leaves: Mapping[str, Any]) -> dict[str, bool]:
    """Key -> whether the leaf is trainable: under ``params`` in a Linen variables dict (a
    mapping with that collection), every leaf of any other tree."""
    if isinstance(tree, Mapping) and _LINEN_PARAMS in tree:
        return {key: key.startswith(_LINEN_PARAMS + "/") for key in leaves}
    return dict.fromkeys(leaves, True)


def _leaves(tree: Any) -> dict[str, Any]:
    """Key -> array leaf, but for an ``nnx.Rngs`` stream's state: its typed key and the count
    beside it (``dropout/rngs/key``, ``dropout/rngs/count``), which ``export`` of the module
    leaves out too."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    leaves = {}
    streams = {_key(path).rpartition("/")[0] for path, leaf in flat if _is_key(leaf)}
    for path, leaf in flat:
        if _is_array(leaf):
            key = _key(path)
            if key in leaves:
                raise InvalidKeyError("two leaves of the tree both have this key", key=key)
            scope, _, name = key.rpartition("/")
            if name != "count" or scope not in streams:
                leaves[key] = leaf
    return leaves


def _is_array(leaf: Any) -> bool:
    """Whether ``leaf`` may hold weights: a JAX or numpy array (or an abstract one, as
    ``nnx.eval_shape`` leaves them), but no typed PRNG key (an array of JAX's own key dtype,
    which no file holds: left alone, as leaves that are no arrays are)."""
    return isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)) and not _is_key(leaf)


def _is_key(leaf: Any) -> bool:
    """Whether ``leaf`` is a typed PRNG key (``jax.random.key``; an ``nnx.Rngs`` stream's)."""
    return isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _key(path: tuple) -> str:
    """``('params', 'Dense_0', 'kernel')`` or JAX's path entries, joined with ``/``; an NNX
    variable's own ``.value`` entry (a leaf of ``nnx.state(model)``) is not a segment, so a
    ``State`` and its pure dict key their leaves alike (``l/kernel``)."""
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    return validate_key("/".join(str(_entry(part)) for part in path))


def _entry(part: Any) -> Any:
    for attribute in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(part, attribute):
            return getattr(part, attribute)
    return part


def _sites(module: nnx.Module) -> dict[str, layouts.Site]:
    """Key -> the layer kind of the module holding that variable, for converting to Keras."""
    sites = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Module):
            site = _site(node)
            for name, child in vars(node).items():
                if isinstance(child, _STATE):
                    sites[_key((*path, name))] = site
    return sites


def _site(module: nnx.Module) -> layouts.Site:
    if isinstance(module, nnx.ConvTranspose):  # with transpose_kernel, its kernel is Keras's as it is, as a conv's
        return layouts.Site(layouts.CONV) if module.transpose_kernel else _TRANSPOSED
    if isinstance(module, nnx.Linear):
        return layouts.Site(layouts.DENSE)
    if type(module) is nnx.Conv:
        if module.feature_group_count == module.in_features and module.feature_group_count > 1:
            return layouts.Site(layouts.DEPTHWISE, module.feature_group_count)
        return layouts.Site(layouts.CONV)  # grouped too: [*spatial, in/groups, out], as Keras's grouped kernel
    if isinstance(module, (nnx.BatchNorm, nnx.LayerNorm, nnx.GroupNorm)):
        return layouts.Site(layouts.NORM)
    if isinstance(module, nnx.Embed):
        return layouts.Site(layouts.EMBEDDING)
    return layouts.Site(type(module).__name__)


def _describe(obj: Any) -> str:
    return f"flax module {type(obj).__name__}" if isinstance(obj, nnx.Module) else f"pytree {type(obj).__name__}"
