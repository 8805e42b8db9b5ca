"""TF1 graphs in and out of weight dictionaries, through ``tf.compat.v1`` sessions.

Keys are variable names without ``:0``. Variables are found in every collection of the
session's graph (global, local, model, custom), of both kinds (ref and resource).
Partitioned variables (``w/part_0``, ``w/part_1``…) appear as one whole tensor ``w``, cut
and stitched along the slices TF records for its ``Saver``; from a sharded version each part
reads only its own region (:meth:`weightstore.Store.read_region`), never the whole tensor.

Only variables are ever read or written: objects in collections that merely subclass
``tf.Variable`` (the ``_UnreadVariable`` that ``resource_var.assign(...)`` returns, which
training code puts in ``UPDATE_OPS``) are recognised by their op type (``VarHandleOp``,
``VariableV2``, ``Variable``) and skipped, and each variable is read through the read tensor
TF made with it (a resource variable's ``Read/ReadVariableOp``, a ref variable's own output),
so an export runs no update, needs no placeholder fed, and adds no op to the graph.

Keys collapse empty name segments: a nested ``variable_scope("")`` makes names like
``model_001//conv_1/kernel``, which export as ``model_001/conv_1/kernel`` and assign back to
that variable. Two variables whose names collapse to one key (``a//b`` and ``a/b``) are an
error naming both.

Assigning writes by feeding each variable's initializer input and running its initializer, or,
where the graph has a ``Saver``, feeding its restore op for the variable (:func:`_restore_writer`:
it compiles faster, which is most of the first assign's time): those ops already exist, so repeated assigns never grow the graph and work on a graph that
``MonitoredTrainingSession`` has finalized. A naive ``sess.run(v.assign(x))`` adds ops on every
reload until the process runs out of memory. Every value is read and verified first, then the
values go in batches of bounded new memory, one run each, so a restore holds a small part of the
model in extra memory rather than a second copy of it (a value copied in place, or taken over
from the mapped file as below, costs none: an assign from an npz or safetensors file is mostly
one batch, one compile) (see
:func:`weightstore.adapters.skeleton.run_assign` for what a failure in a later batch means). A
resource variable takes over the buffer it is fed, so large values are fed from TensorFlow's own
memory (:func:`weightstore.adapters._tf_staging.staged_feeds`), where numpy copies left the old
buffers in TensorFlow's pool for good (the first assign in a process then held the model twice,
as ``Saver.restore`` does). Where a value is a view of the mapped file, the variable first takes
over the file's pages, so the staged copy reuses the very buffer that frees (:func:`_run_batch`):
an assign, the first in a process or a later one, grows the pool by a few MB rather than by a
batch. A ref variable copies into its own buffer, so it is fed the value as it is.
Each batch runs as a callable the session compiles while the values are verified
(:mod:`weightstore.adapters._tf1_callables`), so the first assign does not wait for TF to compile
its batches one by one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from typing_extensions import Unpack

from weightstore.core._extras import needs

with needs("tf", __name__):
    import tensorflow as tf

from weightstore.adapters import _tf1_callables, _tf1_training
from weightstore.adapters._reload import MEMORY
from weightstore.adapters._report import Plan, TargetInfo
from weightstore.adapters._tf_staging import STAGED_FROM, held_back, lend, reclaim, shares_mapped, staged_feeds, warm
from weightstore.adapters.layout import refuse_keras_file
from weightstore.adapters.plan import (
    AssignOptions,
    AssignWords,
    Report,
    Selection,
    SelectionWords,
    plan_assign,
    training_state,
)
from weightstore.adapters.skeleton import Target, batch_budget, run_assign
from weightstore.core._heap import give_back
from weightstore.core.keys import ends_by_rule, from_tf_name, parse_mapping, plan_inward, validate_key
from weightstore.core.manifest import ML_DTYPES
from weightstore.errors import AssignmentError, FormatError, InvalidKeyError, SelectionError, WeightStoreError
from weightstore.io._buffer import ALIGNMENT
from weightstore.sharded._shards import Piece

__all__ = ["export", "export_pieces", "assign", "variables", "forget"]

_WEIGHT_KINDS = frozenset("biufc")
_ASSIGN_TYPES = frozenset({"Assign", "AssignVariableOp"})
_VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable"})
_ML_TYPES = frozenset(dtype.type for dtype in ML_DTYPES.values())
#: a sharded version's partitioned variables are read part by part (see the module docstring)
ASSIGN_READS_REGIONS = True


@dataclass
class _Part:
    variable: tf.Variable
    index: tuple[slice, ...]  # where this part lies in the whole tensor; () for a whole variable


@dataclass
class _Target:
    """One key: a variable, or every part of a partitioned variable."""

    key: str
    name: str  # TensorFlow's name for it (a partitioned variable's whole name), which errors give
    dtype: np.dtype
    shape: tuple[int, ...]
    trainable: bool
    parts: list[_Part] = field(default_factory=list)
    training: bool = False  # optimizer state or the step counter (_tf1_training), not the model
    #: False for a variable made with ``validate_shape=False``: no static shape (``shape`` is then
    #: ``()``); it is exported, and assigned, with the shape its value has (see :func:`_as_they_are`)
    shaped: bool = True

    @property
    def info(self) -> TargetInfo:
        return TargetInfo(self.key, self.dtype, self.shape, self.trainable)


def export(sess: Any, **selection: Unpack[SelectionWords]) -> dict[str, np.ndarray]:
    """The variables of ``sess``'s graph as a new dict of arrays, read in one ``session.run``.

    Keeps the variables under ``scope`` (keys made relative to it), then those passing
    ``include``/``exclude``, then, with ``trainable_only``, the trainable ones and those whose
    key matches ``also`` (``trainable_only=True, also="*/bn/moving_*"``: weights plus batch-norm
    statistics). Only the variables' own read tensors are fetched: no update runs, nothing
    needs feeding, and the graph gains no op.
    """
    sess = _open_session(sess)
    plan, chosen = _chosen(sess, Selection.of("tf1.export", selection))
    fetched = _fetched(sess, chosen)
    return {key: _stitch(target, fetched) for key, target in zip(plan, chosen, strict=True)}


def export_pieces(sess: Any, **selection: Unpack[SelectionWords]) -> dict[str, list[Piece]]:
    """Like :func:`export`, but a partitioned variable comes part by part, never stitched:
    key -> one :class:`~weightstore.Piece` per part, at the offset TF's save-slice info gives it
    in the whole tensor (a plain variable: one piece holding all of it).

    What :func:`weightstore.publish_shard` takes: each rank publishes the pieces it holds (a
    parameter server's parts, say), and the committed version reads back in any partitioning.
    """
    sess = _open_session(sess)
    plan, chosen = _chosen(sess, Selection.of("tf1.export_pieces", selection))
    fetched = _fetched(sess, chosen)
    return {key: [_piece(target, part, np.asarray(next(fetched))) for part in target.parts]
            for key, target in zip(plan, chosen, strict=True)}


def variables(sess: Any, **selection: Unpack[SelectionWords]) -> dict[str, tf.Variable | list[tf.Variable]]:
    """Key -> the variable of ``sess``'s graph that :func:`export` reads under that key with the
    same words, and :func:`assign` writes: a partitioned variable as the list of its parts
    (``w/part_0``, ``w/part_1``…, each knowing its place through ``_get_save_slice_info``).
    Reads no value, so the variables may hold none yet. Training state (optimizer slots,
    ``global_step``) is among them, as in :func:`export`; :func:`assign` writes it only with
    ``optimizer=True``.
    """
    plan, chosen = _chosen(_open_session(sess), Selection.of("tf1.variables", selection))
    return {key: [part.variable for part in target.parts] if target.parts[0].index else target.parts[0].variable
            for key, target in zip(plan, chosen, strict=True)}


def _piece(target: _Target, part: _Part, value: np.ndarray) -> Piece:
    """A part at its offset in the whole; a variable of no static shape is as large as its value."""
    if part.index:
        return Piece(value, tuple(s.start for s in part.index), target.shape)
    return Piece(value, (0,) * value.ndim, target.shape if target.shaped else value.shape)


#: how TF reports a variable that holds no value: a resource one, and a ref one
#: (a name may hold '.', as in ``block/./w``; the resource message ends its sentence with one)
_UNINITIALIZED = re.compile(r"(?:Could not find variable|Attempting to use uninitialized value) (\S+?)\.?(?=\s|$)")


def _fetched(sess: Any, chosen: list[_Target]) -> Iterator[Any]:
    """The values of every part of ``chosen``, in order, from one ``session.run``."""
    try:
        return iter(sess.run([_read_tensor(part.variable) for target in chosen for part in target.parts]))
    except tf.errors.FailedPreconditionError as exc:
        named = _UNINITIALIZED.search(exc.message)  # TF names the variable in its message
        which = f"variable {named.group(1)!r}" if named else "a variable"
        raise SelectionError(f"{which} of the graph holds no value yet; initialize or restore it before exporting"
                             ) from None


def _chosen(sess: Any, chosen_by: Selection) -> tuple[dict[str, str], list[_Target]]:
    """The selected variables of ``sess``'s graph (an open session): output key -> graph key, and their targets."""
    targets = _targets(sess.graph)
    plan = chosen_by.choose(targets, lambda key: targets[key].trainable, "the graph")
    for key, source in plan.items():
        try:
            validate_key(key)
        except InvalidKeyError as exc:  # a '..' segment, a reserved or over-long one: TF allows them
            why = exc.message.removeprefix("invalid key: ")
            pattern = "/".join("[.][.]" if segment == ".." else segment for segment in key.split("/"))
            raise InvalidKeyError(f"variable {targets[source].name!r} makes no key: {why}; leave it out "
                                  f"(exclude={pattern!r}) or rename its scope") from None
    return plan, [targets[source] for source in plan.values()]


def assign(sess: Any, weights: Any, *, optimizer: bool = False, **words: Unpack[AssignWords]) -> Report:
    """Write ``weights`` into the variables of ``sess``'s graph, planned and verified first, in batches.

    ``weights`` is a dict, a path (a store, a TF1 ``Saver`` checkpoint prefix or its folder),
    an open store or a ``Version``; only what is assigned is read. ``also`` widens
    ``trainable_only`` as in :func:`export`. With ``strict`` (the default) any missing,
    unexpected or mismatched key raises :class:`~weightstore.errors.AssignmentError` and no
    variable changes. ``skip_unchanged`` (default: only for versions) leaves alone tensors
    whose checksum matches what this session last received for that key.

    Training state (optimizer slots such as ``w/Adam``, Adam's ``beta1_power``/``beta2_power``,
    ``global_step``) is left out on both sides unless ``optimizer=True``, as in ``tf2``: a
    training ``Saver`` checkpoint assigns into an inference graph, and the values left out are
    listed in ``report.left_out``. Which variables those are comes from the graph (its training
    ops and ``global_step`` collection; for a checkpoint, its ``.meta``) or, for a checkpoint
    without one, from TF's slot naming.

    That memory only knows what weightstore assigned: after anything else writes the
    variables (``sess.run(init)``, training, ``Saver.restore``), call :func:`forget` (or pass
    ``skip_unchanged=False``), or a version with the old bytes is skipped and the variable keeps
    the other value.
    """
    sess = _open_session(sess)
    graph = sess.graph
    targets = _targets(graph)
    options = AssignOptions.of("tf1.assign", words, assign)
    # The parts hot reload keeps, filled by run_assign for the Target below. The closures hold this
    # dict, not the Target: a Target whose closures hold it is a cycle, which kept a dropped session
    # (and its variables) alive until the next garbage collection.
    kept: dict[str, frozenset[int]] = {}
    # The helper's guess (_guess), settled before this assign looks up its first writer (no helper
    # reads the graph while this thread might add an op to it) and ended before it returns.
    guessed: list[_tf1_callables.Guess] = []

    def writer(variable: tf.Variable) -> tuple[tf.Operation, tf.Tensor]:
        for guess in guessed:
            guess.settle()
        return _writer(graph, variable)

    def prepare(values: Any, key: str, value_key: str) -> np.ndarray | list[np.ndarray | None]:
        """The verified value as the file holds it (a view of a mapped npz costs no memory); of a
        partitioned variable in a sharded version, each part's region alone, so no part reads
        bytes of another. The writers are found now too, so one that cannot exist fails before
        any batch runs."""
        parts = targets[key].parts
        for part in parts:
            writer(part.variable)
        if parts[0].index and values.regional:  # None: a part hot reload found unchanged, left as it is
            unchanged = kept.get(key, frozenset())
            return [None if i in unchanged else values.read_region(value_key, part.index) for i, part in enumerate(parts)]
        return np.asarray(values.read(value_key))

    def cut(value: np.ndarray | list[np.ndarray | None], parts: list[_Part]) -> list[np.ndarray | None]:
        """Each part's array: the regions read, or the whole value cut along the parts' slices."""
        if isinstance(value, list):
            return value
        return [value[part.index] if part.index else value for part in parts]

    def write(batch: list[tuple[str, np.ndarray | list[np.ndarray | None]]], report: Report) -> list[str]:
        """One batch in one run of the session, through ops the graph already has."""
        writers: _tf1_callables.Writers = []
        values: list[tuple[np.ndarray, np.dtype]] = []
        variables: list[tf.Variable] = []
        for key, value in batch:
            target = targets[key]
            for part, array in zip(target.parts, cut(value, target.parts), strict=True):
                if array is not None:
                    writers.append(writer(part.variable))
                    values.append((array, target.dtype))
                    variables.append(part.variable)
        _run_batch(sess, writers, values, variables)
        return [key for key, _ in batch]

    def ahead(batches: list[list[str]]) -> None:
        """Each batch's writers, as :func:`write` will run them (the parts hot reload keeps left out)."""
        _tf1_callables.compile_ahead(sess, [[writer(part.variable) for key in keys
                                            for i, part in enumerate(targets[key].parts)
                                            if i not in kept.get(key, ())] for keys in batches])

    def cost(key: str, value: np.ndarray | list[np.ndarray | None] | None, ops: list[tf.Operation] | None = None) -> int:
        """The new memory writing ``value`` into ``key``'s parts takes (``None``: the least it may,
        were it a view of a mapped file): nothing for a part copied in place or taking over the file's pages.
        ``ops``: the parts' writers where the caller found them (the guess, which makes none)."""
        target = targets[key]
        arrays = [None] * len(target.parts) if value is None else cut(value, target.parts)
        ops = [writer(part.variable)[0] for part in target.parts] if ops is None else ops
        total = 0
        for part, array, op in zip(target.parts, arrays, ops, strict=True):
            size = math.prod(part.variable.shape.as_list() if part.index else target.shape) * target.dtype.itemsize
            if not (array is None and (op.type == "Assign" or (size >= STAGED_FROM and _on_cpu(sess, part.variable)))
                    or array is not None and _free(sess, op, array, target.dtype, part.variable)):
                total += size if array is None else array.size * target.dtype.itemsize
        return total

    infos = {key: target.info for key, target in targets.items() if target.shaped}
    infos.update(_as_they_are(sess, [target for target in targets.values() if not target.shaped]))
    empty = {key: target for key, target in targets.items() if key not in infos and (optimizer or not target.training)}

    def plan(values: Any, options: AssignOptions) -> tuple[Plan, Any]:
        refuse_keras_file(values)  # Keras's own names: no graph names its variables so
        rules = parse_mapping(options.mapping)  # a key a */END rule renames is asked for (see training_state)
        left_out = () if optimizer else {key for key in _tf1_training.in_checkpoint(values.where, values.keys())
                                         if not ends_by_rule(key, rules)} | set(
            training_state(values.keys(), targets, options.scope, options.mapping))
        infos.update(_shaped_as_values(values, options, empty, left_out))  # the Target below reads infos too
        model = infos if optimizer else {key: info for key, info in infos.items() if not targets[key].training}
        return plan_assign(values, model, options, left_out=left_out), values

    if not (options.scope or options.include or options.exclude or options.trainable_only or options.mapping):
        guess = _guess(sess, graph, targets, [key for key in infos if optimizer or not targets[key].training], cost)
        if guess is not None:
            guessed.append(guess)
    job = Target(infos, write, slot=lambda key: (sess, key), prepare=prepare, plan=plan, batched=True, ahead=ahead, kept=kept, cost=cost,
                 regions=lambda key: [part.index for part in targets[key].parts] if targets[key].parts[0].index else None)
    try:
        return run_assign(job, weights, options)
    finally:
        while guessed:  # out of the list: the guess holds closures that hold it (through cost)
            guessed.pop().end()


def _guess(sess: Any, graph: tf.Graph, targets: dict[str, _Target], likely: list[str],
           cost: Callable[[str, None, list[tf.Operation]], int]) -> _tf1_callables.Guess | None:
    """Have the helper find and compile, while the file is opened and verified, the one batch an
    assign of every variable ``likely`` writes, where it is the session's first: where their least
    costs fit one batch's budget, as the batches are cut
    (:func:`weightstore.adapters.skeleton.batch_budget`), the plan most likely keeps them all
    in one batch (see :func:`_tf1_callables.guess`); then have the staging session compile the
    run that batch's staged copies need (:func:`~weightstore.adapters._tf_staging.warm`): the
    first assign stages every resource variable's value. No guess where a variable has no writer
    of its own yet: the op made for it is added only by an assign that writes it. Returns the
    guess, which the assign settles before it looks up a writer itself and ends before it
    returns; its first stage only looks writers up (it makes no op), and remembers them only while
    the graph gains none."""
    parts = [(target, part) for target in map(targets.__getitem__, likely) for part in target.parts]

    def batch() -> _tf1_callables.Writers | None:
        version = graph.version
        known = _known_writers(graph)
        own = [known.get(part.variable.op.name) or _own_writer(graph, part.variable) for _, part in parts]
        writers = [writer for writer in own if writer is not None]
        if not writers or len(writers) < len(own):
            return None
        if graph.version == version:  # as _writer finds them, while the graph is as they were found in
            known.update((part.variable.op.name, writer) for (_, part), writer in zip(parts, writers, strict=True))
        ops = iter(op for op, _ in writers)
        try:
            least = sum(cost(key, None, [next(ops) for _ in targets[key].parts]) for key in likely)
        except WeightStoreError:  # a variable that cannot be written: the assign says so, in its turn
            return None
        if least > batch_budget(sum(math.prod(targets[key].shape) * targets[key].dtype.itemsize for key in likely)):
            return None
        return writers

    def staging(writers: _tf1_callables.Writers) -> None:
        warm([(tuple(part.variable.shape.as_list()) if part.index else target.shape, target.dtype)
              for (target, part), (op, _) in zip(parts, writers, strict=True) if op.type == "AssignVariableOp"])

    return _tf1_callables.guess(sess, batch, staging)


def _run_batch(sess: Any, writers: _tf1_callables.Writers, values: list[tuple[np.ndarray, np.dtype]],
               variables: list[tf.Variable]) -> None:
    """One batch through its writers, in as little new memory as its values allow.

    A ref variable's ``Assign`` copies into the buffer the variable has, so it is fed the value
    as it is. A resource variable's ``AssignVariableOp`` takes over the tensor it is fed and only
    then frees its old buffer, so a new value must exist before the old one goes: staged in
    TensorFlow's memory (:func:`staged_feeds`), the batch grows the pool by its own size. Where a
    value is a view of a mapped file that TensorFlow takes over as it is
    (:func:`~weightstore.adapters._tf_staging.shares_mapped`) and the variable lives in host
    memory, the batch runs twice instead: the variables first take over the file's pages (the
    right values, in no memory of the process's own), which frees their old buffers; the staged
    copies, made only then, reuse those very buffers, and the second run hands them over and lets
    the file go. Where a variable's old buffer was the staged copy of an earlier assign, the new
    value is copied into that very array (:func:`~weightstore.adapters._tf_staging.reclaim`, once
    TensorFlow no longer refers to it): memory already faulted in, where a fresh ``Empty`` buffer
    cost a page fault every 4 KiB (a repeated cold assign of 256 MB: 0.30 CPU-s to 0.12-0.20). Both runs feed the same tensors to the same ops, so one compiled callable serves
    both. An old buffer that was a fed numpy array (a variable keeps an aligned one as it is) goes
    back to the C heap, which keeps its pages for allocations TensorFlow's pool never makes, so
    they are handed back (:func:`weightstore.core._heap.give_back`) before the copies are made. A
    device variable gets the staged copies alone: its old buffer is not host memory.
    """
    in_place = [_in_place(op, array, dtype) for (op, _), (array, dtype) in zip(writers, values, strict=True)]
    mapped = [_mapped(sess, op, array, dtype, variable)
              for (op, _), (array, dtype), variable in zip(writers, values, variables, strict=True)]
    feeds = [array for array, _ in values]  # as they are: for in-place copies and the first run

    def stage(chosen: list[int]) -> None:
        for i, feed in zip(chosen, staged_feeds([values[i] for i in chosen]), strict=True):
            feeds[i] = feed

    stage([i for i in range(len(values)) if not in_place[i] and not mapped[i]])
    if any(mapped):
        chosen = [i for i in range(len(values)) if mapped[i]]
        held = held_back(sess, [variables[i].op.name for i in chosen])
        _tf1_callables.run(sess, writers, feeds)
        reclaimed = reclaim(held, [values[i] for i in chosen])
        del held  # what was not reclaimed is freed now, before the new copies
        for i, feed in zip(chosen, reclaimed, strict=True):
            if feed is not None:
                feeds[i] = feed
        fresh = [i for i, feed in zip(chosen, reclaimed, strict=True) if feed is None]
        if fresh:
            give_back()
            stage(fresh)
    _tf1_callables.run(sess, writers, feeds)
    staged = [i for i in range(len(values)) if feeds[i] is not values[i][0]]
    lend(sess, [variables[i].op.name for i in staged], [feeds[i] for i in staged])


def _in_place(op: tf.Operation, array: np.ndarray, dtype: np.dtype) -> bool:
    """Whether a ref variable's ``Assign`` copies ``array`` into the buffer it has (fed as it is)."""
    return op.type == "Assign" and array.dtype == dtype and array.flags.c_contiguous


def _mapped(sess: Any, op: tf.Operation, array: np.ndarray, dtype: np.dtype, variable: tf.Variable) -> bool:
    """Whether a host resource variable first takes over ``array``, a view of a mapped file, as it is."""
    return op.type == "AssignVariableOp" and shares_mapped(array, dtype) and _on_cpu(sess, variable)


def _free(sess: Any, op: tf.Operation, array: np.ndarray, dtype: np.dtype, variable: tf.Variable) -> bool:
    """Whether :func:`_run_batch` writes ``array`` in no new memory (see its docstring): copied in
    place from where it lies (aligned, or TensorFlow copies the feed first, into its pool for good),
    or taken over from the mapped file."""
    return ((_in_place(op, array, dtype) and array.ctypes.data % ALIGNMENT == 0)
            or _mapped(sess, op, array, dtype, variable))


def _on_cpu(sess: Any, variable: tf.Variable) -> bool:
    """Whether ``variable`` surely lives in host memory: placed on a CPU, or unplaced in a session
    whose only devices are CPUs (a session wrapper that cannot say: no)."""
    try:
        placed = tf.DeviceSpec.from_string(variable.op.device or "").device_type
    except ValueError:
        return False
    if placed:
        return placed.upper() == "CPU"
    host_only = getattr(sess, "_weightstore_host_only", None)
    if host_only is None:
        try:
            host_only = all(device.device_type.upper() == "CPU" for device in sess.list_devices())
        except (AttributeError, tf.errors.OpError):
            return False
        sess._weightstore_host_only = host_only
    return bool(host_only)


def _open_session(sess: Any) -> Any:
    """``sess``, checked before anything is planned: a session (or a wrapper of one), and not
    closed, which TensorFlow would say only at the first write. Of a ``MonitoredSession``, the
    session it wraps: its own ``run`` runs every hook's fetches too (a ``NanTensorHook``'s loss,
    which needs the training step's feeds), and reading or writing variables is no step."""
    if not (hasattr(sess, "graph") and callable(getattr(sess, "run", None))):
        raise TypeError(f"expected a tf.compat.v1.Session (or a session wrapper with .graph and .run), "
                        f"not {type(sess).__name__}")
    if getattr(sess, "_closed", False) or sess.graph is None:  # a closed MonitoredSession has no graph
        raise ValueError("the session is closed: pass an open one (the graph's variables live in a session)")
    if callable(getattr(sess, "run_step_fn", None)):
        sess = sess.run_step_fn(_wrapped)
    return sess


def _wrapped(step_context: Any) -> Any:
    """The session a ``MonitoredSession`` wraps (``run_step_fn`` passes it; TF requires the name)."""
    return step_context.session


def forget(sess: Any) -> None:
    """Forget what ``sess`` last received, so the next assign writes every tensor (no skips).

    Call it after the session's variables were changed outside weightstore (initializers,
    training, ``Saver.restore``): hot reload would otherwise trust the old checksums.
    """
    MEMORY.forget(_open_session(sess))


def _targets(graph: tf.Graph) -> dict[str, _Target]:
    """:func:`_collect_targets`, remembered while the graph's ops and collections stay the same.

    Walking every collection costs milliseconds per assign, which a follower reloading a
    small head every few seconds would pay again and again for an unchanged graph. The cache
    lives on the graph: the targets refer to it, so a cache keyed by the graph elsewhere would
    keep every graph alive.
    """
    fingerprint = (graph.version, tuple((key, tuple(map(id, graph.get_collection_ref(key))))
                                        for key in graph.get_all_collection_keys()))
    cached = getattr(graph, "_weightstore_targets", None)
    if cached is None or cached[0] != fingerprint:
        cached = graph._weightstore_targets = (fingerprint, _collect_targets(graph))
    return cached[1]


def _collect_targets(graph: tf.Graph) -> dict[str, _Target]:
    """Every weight variable of ``graph`` by key, partitioned variables joined into one."""
    trainable = {v.op.name for v in graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)}
    targets: dict[str, _Target] = {}
    named: dict[str, str] = {}  # key -> the TF name it came from, to name both sides of a collision
    for variable in _variables(graph):
        dtype = np.dtype(variable.dtype.base_dtype.as_numpy_dtype)
        if dtype.kind not in _WEIGHT_KINDS and dtype.type not in _ML_TYPES:
            continue  # string and resource variables hold no weights
        name = variable.op.name
        slice_info = variable._get_save_slice_info()
        whole_name = name if slice_info is None else slice_info.full_name
        key = from_tf_name(whole_name)
        if named.setdefault(key, whole_name) != whole_name:
            raise InvalidKeyError(f"variables {named[key]!r} and {whole_name!r} both have key {key!r} "
                                  "(empty and '.' name segments are dropped from keys)")
        if slice_info is None:
            shaped = variable.shape.is_fully_defined()
            shape = tuple(variable.shape.as_list()) if shaped else ()
            targets[key] = _Target(key, name, dtype, shape, name in trainable, [_Part(variable, ())], shaped=shaped)
            continue
        whole = targets.setdefault(key, _Target(key, whole_name, dtype, tuple(slice_info.full_shape), True))
        whole.trainable &= name in trainable
        index = tuple(slice(o, o + s) for o, s in zip(slice_info.var_offset, slice_info.var_shape, strict=True))
        whole.parts.append(_Part(variable, index))
    operations = graph.get_operations()
    types = [op.type for op in operations]
    trained = any(map(_tf1_training.trains, types))  # an inference graph: no op's inputs are followed
    training = _tf1_training.in_graph({op.name: (kind, [t.op.name for t in op.inputs] if trained else [])
                                      for op, kind in zip(operations, types, strict=True)},
                                     [v.op.name for v in graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_STEP)])
    for target in targets.values():
        target.training = any(part.variable.op.name in training for part in target.parts)
        if not target.parts[0].index:
            continue
        covered = sum(math.prod(part.variable.shape.as_list()) for part in target.parts)
        if covered != math.prod(target.shape):
            raise FormatError(f"partitioned variable {target.key!r}: its parts in the graph's collections "
                              f"cover {covered} of {math.prod(target.shape)} elements")
    return targets


def _as_they_are(sess: Any, unshaped: list[_Target]) -> dict[str, TargetInfo]:
    """Variables of no static shape (``validate_shape=False``) as their values are now: a value
    of that shape assigns, another is refused as a mismatch (a shape change is not something an
    assign should make silently). One that holds no value yet has no shape to pair with: it
    takes the shape of the value paired with it (:func:`_shaped_as_values`), and without one
    it is left out, as a variable the graph does not have."""
    infos = {}
    for target in unshaped:
        try:
            shape = np.shape(sess.run(_read_tensor(target.parts[0].variable)))
        except tf.errors.FailedPreconditionError:
            continue
        infos[target.key] = TargetInfo(target.key, target.dtype, shape, target.trainable)
    return infos


def _shaped_as_values(values: Any, options: AssignOptions, empty: dict[str, _Target],
                      left_out: Collection[str]) -> dict[str, TargetInfo]:
    """Variables of no static shape that hold no value yet, each as the value paired with it
    would make it: any shape is theirs to take, as ``Saver.restore`` gives them one."""
    if not empty:
        return {}
    keys = values.keys()  # a ValueSource: keys(), not iteration
    try:
        paired = plan_inward([key for key in keys if key not in left_out], scope=options.scope,
                             mapping=options.mapping, include=options.include, exclude=options.exclude)
    except WeightStoreError:  # words that fit no key: the plan says what is wrong with them
        return {}
    return {key: TargetInfo(key, target.dtype, _as_declared(target, paired[key], values), target.trainable)
            for key, target in empty.items() if key in paired}


def _as_declared(target: _Target, value_key: str, values: Any) -> tuple[int, ...]:
    """The shape the value gives a variable declared with a partly known shape (``[None, 3]``):
    the value's where the declaration leaves it open, the declared one elsewhere, so a value of
    another width is a mismatch now rather than an error inside TF when the variable is used."""
    shape = tuple(values.shape(value_key))
    declared = target.parts[0].variable.shape
    if declared.rank is None:
        return shape
    if declared.rank != len(shape):
        raise AssignmentError(f"cannot assign {value_key!r} of shape {list(shape)} to variable {target.key!r}, "
                              f"declared of shape {declared} (it holds no value yet): nothing was changed",
                              path=values.path)
    return tuple(value if size is None else size for size, value in zip(declared.as_list(), shape, strict=True))


def _is_variable(item: Any) -> bool:
    """A variable itself, not an update op dressed as one (``_UnreadVariable`` subclasses ``tf.Variable``)."""
    op = getattr(item, "op", None) if isinstance(item, tf.Variable) else None
    return op is not None and op.type in _VARIABLE_OPS


def _variables(graph: tf.Graph) -> list[tf.Variable]:
    """Variables of every collection, each once, global ones first in creation order."""
    seen: dict[str, tf.Variable] = {}
    keys = [tf.compat.v1.GraphKeys.GLOBAL_VARIABLES, tf.compat.v1.GraphKeys.LOCAL_VARIABLES,
            *sorted(graph.get_all_collection_keys())]
    for collection in keys:
        for item in graph.get_collection(collection):
            if _is_variable(item):
                seen.setdefault(item.op.name, item)
    return list(seen.values())


def _read_tensor(variable: tf.Variable) -> tf.Tensor:
    """The tensor TF made to read ``variable`` along with it (``Read/ReadVariableOp``, or a ref
    variable's own output): it depends on nothing else, so fetching it runs no other op."""
    return variable._as_graph_element()


def _stitch(target: _Target, fetched) -> np.ndarray:
    if not target.parts[0].index:
        return np.asarray(next(fetched))
    whole = np.empty(target.shape, target.dtype)
    for part in target.parts:
        whole[part.index] = next(fetched)
    return whole


def _writer(graph: tf.Graph, variable: tf.Variable) -> tuple[tf.Operation, tf.Tensor]:
    """:func:`_find_writer`, remembered on the graph while it gains no op.

    Finding it lists the consumers of the initializer's input, tens of microseconds a variable,
    which a follower re-assigning 50,000 variables would pay twice (verify, then write) on
    every assign. A new op may consume an initial value and change the answer, so any new op
    forgets them all.
    """
    writers = _known_writers(graph)
    name = variable.op.name
    if name not in writers:
        writers[name] = _find_writer(graph, variable)
    return writers[name]


def _known_writers(graph: tf.Graph) -> dict[str, tuple[tf.Operation, tf.Tensor]]:
    """The writers :func:`_writer` remembers, by variable name, for the graph as it is."""
    known: tuple[int, dict[str, tuple[tf.Operation, tf.Tensor]]] | None = getattr(graph, "_weightstore_writers", None)
    if known is None or known[0] != graph.version:
        known = graph._weightstore_writers = (graph.version, {})
    return known[1]


def _own_writer(graph: tf.Graph, variable: tf.Variable) -> tuple[tf.Operation, tf.Tensor] | None:
    """An op of the graph that writes ``variable`` alone, and the tensor to feed it: a ``Saver``'s
    restore op for it where the graph has one (:func:`_restore_writer`), else its initializer
    when it may; ``None`` where neither does."""
    restore = _restore_writer(graph, variable)
    if restore is not None:
        return restore
    initializer = variable.initializer
    if initializer is not None and not initializer.control_inputs and len(initializer.inputs) == 2:
        tensor = initializer.inputs[1]
        writers = [op for op in tensor.consumers() if op.type in _ASSIGN_TYPES]
        if graph.is_feedable(tensor) and writers == [initializer]:
            return initializer, tensor
    return None


def _find_writer(graph: tf.Graph, variable: tf.Variable) -> tuple[tf.Operation, tf.Tensor]:
    """The op that writes ``variable`` and the tensor to feed it: :func:`_own_writer`, else one
    assign op made for it."""
    own = _own_writer(graph, variable)
    if own is not None:
        return own
    # The initial value is shared with other ops (tf.Variable(t) twice): feeding it would write
    # one value into every variable made from it. Such a variable gets one assign op, made once.
    if not hasattr(graph, "_weightstore_assign_ops"):  # on the graph, for the reason _targets says
        graph._weightstore_assign_ops = {}
    cached = graph._weightstore_assign_ops
    name = variable.op.name
    if name not in cached:
        if graph.finalized:
            raise AssignmentError(
                f"cannot assign: variable {name!r} shares its initial value with other ops, so weightstore needs one "
                "assign op for it, and the graph is finalized; give the variable its own initial value, "
                "or assign once before the graph is finalized"
            )
        with graph.as_default(), tf.control_dependencies(None), tf.name_scope(f"{name}/weightstore_assign"):
            placeholder = tf.compat.v1.placeholder(variable.dtype.base_dtype, variable.shape)
            op = variable.assign(placeholder, read_value=False)
        cached[name] = (op if isinstance(op, tf.Operation) else op.op, placeholder)
    return cached[name]


#: ops a ``Saver`` reads a checkpoint with; the tensors they give a restore op are fed instead
_RESTORE_TYPES = frozenset({"RestoreV2", "Restore", "RestoreSlice"})


def _restore_writer(graph: tf.Graph, variable: tf.Variable) -> tuple[tf.Operation, tf.Tensor] | None:
    """The assign op of the graph's ``Saver`` for ``variable``, and the tensor to feed it: the
    restore op's output it is given, directly or through an ``Identity`` (a resource variable's),
    where nothing else reads either.

    Fed, it writes the variable as the initializer does, but compiles in about half the time:
    a session runs Grappler over the fan-in of every fed tensor, which for an initializer is its
    whole initializer (``random_normal``: six ops a variable), and for a restore op one op shared
    by every variable. The first assign in a process compiles each of its batches, so that fan-in
    was most of its time. The restore op's output is fed rather than its ``Identity``: Grappler
    then drops the ``Identity`` (which passes the fed buffer on as it is) as it does for the
    ``Saver``, 512 nodes for 256 variables where feeding it kept 774, and compiles in about a fifth
    less CPU time."""
    handle = variable.op.outputs[0]
    for op in handle.consumers():
        if op.type not in _ASSIGN_TYPES or op.control_inputs:
            continue
        inputs = op.inputs  # a new list each time it is asked for
        if len(inputs) != 2 or inputs[0] is not handle or inputs[1].consumers() != [op]:
            continue
        tensor = inputs[1]
        identity = tensor.op
        if identity.type == "Identity" and not identity.control_inputs:
            passed = identity.inputs
            if len(passed) != 1 or passed[0].consumers() != [identity]:
                continue
            tensor = passed[0]
        if tensor.op.type in _RESTORE_TYPES and graph.is_feedable(tensor):
            return op, tensor
    return None
