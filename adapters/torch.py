"""PyTorch in and out: an ``nn.Module``'s parameters and buffers as a weight dictionary.

Keys are ``state_dict`` names with ``.`` read as ``/`` (``features.0.weight`` is
``features/0/weight``, :mod:`weightstore.core.names`), so persistent buffers (batch norm's
``running_mean``/``running_var``) are included and non-persistent ones are not. Trainable
means ``requires_grad``; buffers never are. ``export(..., names="torch")`` returns the
``state_dict`` names themselves, and ``assign`` takes weights keyed either way: a
``safetensors.torch.save_file`` file, a Hugging Face ``model.safetensors``, or the dict
``safetensors.torch.load_file`` returns goes into the module that wrote it as it is.

``num_batches_tracked`` (batch norm's step counter) is exported like any buffer, but on assign
it is *optional*: written when the weights hold it, never reported missing when they do not
(Keras and Flax keep no such counter), never unexpected when the module has none. With a
layout it has no Keras counterpart and is left out of the export.

Values are written in place under ``torch.no_grad()`` with ``tensor.copy_``: no new
``Parameter`` is made, so optimizers and hooks holding the module's tensors keep working, and
``copy_`` moves the value onto the tensor's own device (CPU, CUDA, MPS) itself.

A wrapper that only runs a model is read as the model it holds: ``torch.compile``'s
(``_orig_mod.``), ``DistributedDataParallel``'s and ``DataParallel``'s (``module.``). Their
``state_dict`` names carry the wrapper's prefix, so a trainer publishing its compiled or DDP
module would write keys that the same model unwrapped (a serving copy, a Keras model by
layout) does not have; unwrapped, every verb gives and takes the model's own keys, as
``model.state_dict()`` before wrapping names them.

``layout="keras"`` (or a :class:`~weightstore.adapters.layout.Layout`) converts Keras/TF names
and layouts on the way in and out: see :mod:`weightstore.adapters.layout`. Scope, mapping and
selection then speak the module's names (``conv/weight``, not ``conv/kernel``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import itertools
import sys
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any

import ml_dtypes
import numpy as np
from typing_extensions import Unpack

from weightstore.core._extras import needs

with needs("torch", __name__):
    import torch
    from torch import nn
    from torch.nn.parameter import is_lazy

from weightstore.adapters import _torch_shards
from weightstore.adapters import layout as layouts
from weightstore.adapters._casts import describe
from weightstore.adapters._reload import MEMORY
from weightstore.adapters._report import Mismatch, TargetInfo
from weightstore.adapters._values import RenamedValues
from weightstore.adapters.plan import AssignOptions, AssignWords, Report, Selection, SelectionWords, refuse_before_write
from weightstore.adapters.skeleton import Target, run_assign
from weightstore.core.keys import in_scope, join_scope, normalize_scope, parse_mapping, passes, strip_scope
from weightstore.core.names import TORCH, WRITE_NAMINGS, check_naming, key_of_torch_name, torch_keys, torch_name_of_key
from weightstore.errors import AssignmentError, InvalidKeyError, LayoutError, SelectionError, UnsupportedDTypeError
from weightstore.sharded._shards import Piece, in_background, publish_together, split_rows
from weightstore.sync._defaults import DEFAULT_KEEP
from weightstore.sync._delta import Delta
from weightstore.sync._pinning import Version

__all__ = ["export", "export_pieces", "publish_sharded", "assign", "variables", "tensors", "forget", "to_numpy"]

OPTIONAL_LEAF = "num_batches_tracked"
#: the name PyTorch gives ``get_extra_state()``'s object in a ``state_dict``
EXTRA_STATE = "_extra_state"
#: torch dtypes numpy lacks, by the name torch and ml_dtypes share -> a torch integer of the
#: same width: the bytes cross between the two as that integer
_VIEWED_NAMES = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8", "float8_e4m3fnuz": "uint8",
                 "float8_e5m2fnuz": "uint8", "float8_e8m0fnu": "uint8"}
#: torch dtype -> (its ml_dtypes kind, that integer), for those this torch and ml_dtypes both have
_VIEWED = {getattr(torch, name): (np.dtype(getattr(ml_dtypes, name)), getattr(torch, integer))
           for name, integer in _VIEWED_NAMES.items() if hasattr(torch, name) and hasattr(ml_dtypes, name)}
_FROM_NUMPY = {kind: (dtype, integer) for dtype, (kind, integer) in _VIEWED.items()}


#: a DTensor is read by the region of its local shard (see :func:`assign`)
ASSIGN_READS_REGIONS = True


def variables(module: nn.Module, **selection: Unpack[SelectionWords]) -> dict[str, torch.Tensor]:
    """Key -> the module's own tensor (parameter or persistent buffer) that :func:`export` reads
    under that key with the same words, and :func:`assign` writes in place; without words,
    every one. Tied weights (one tensor under two names) are here under both keys, as in
    ``state_dict``.

    ``get_extra_state()``'s object is left out even where it is a tensor: only
    ``set_extra_state`` takes it, so a value written into it would change nothing (a buffer a
    module without that method named ``_extra_state`` is a tensor like any other). Any other
    entry that is no tensor (a quantized module's dtype and packed parameters) is refused: its
    weights are inside it, and leaving it out would export a model without them.
    """
    found, chosen = _chosen(module, Selection.of("torch.variables", selection))
    return {key: found[old] for key, old in chosen.items()}


def tensors(module: nn.Module, **selection: Unpack[SelectionWords]) -> dict[str, torch.Tensor]:
    """Alias of :func:`variables`, the name earlier releases gave it (the verb is ``variables``
    in every adapter)."""
    return variables(module, **Selection.of("torch.tensors", selection).words())


def _unwrapped(module: nn.Module) -> nn.Module:
    """The model inside ``torch.compile``'s, DDP's and DataParallel's wrappers (nested too): the
    module whose ``state_dict`` names are the model's own (see the module docstring)."""
    wrappers: list[tuple[type, str]] = [(nn.parallel.DistributedDataParallel, "module"), (nn.DataParallel, "module")]
    compiled = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled (an import costs ~1 s)
    if compiled is not None:
        wrappers.append((compiled.OptimizedModule, "_orig_mod"))
    while True:
        inner = next((getattr(module, name) for kind, name in wrappers if isinstance(module, kind)), None)
        if not isinstance(inner, nn.Module):
            return module
        module = inner


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Key -> every tensor of ``module``'s ``state_dict`` but ``get_extra_state()``'s, packed
    parameters refused: what :func:`variables` selects from (its docstring says why)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, not {type(module).__name__}")
    module = _unwrapped(module)
    extra = {f"{prefix}.{EXTRA_STATE}".lstrip(".") for prefix, owner in module.named_modules()
             if type(owner).get_extra_state is not nn.Module.get_extra_state}
    state = {name: value for name, value in module.state_dict(keep_vars=True).items() if name not in extra}
    packed = [name for name, value in state.items() if not isinstance(value, torch.Tensor)]
    if packed:
        raise UnsupportedDTypeError(f"{_describe(module)}: {len(packed)} state_dict entries are no tensor (first "
                                    f"{packed[0]!r}, a {type(state[packed[0]]).__name__}): packed parameters, such "
                                    "as a quantized module keeps its weights in, which weightstore does not read; "
                                    "export the module before quantizing it")
    try:
        return {key_of_torch_name(name): tensor for name, tensor in state.items()}
    except InvalidKeyError as exc:
        raise InvalidKeyError(f"{_describe(module)}: {exc}") from None


def export(
    module: nn.Module,
    *,
    layout: str | layouts.Layout | None = None,
    names: str | None = None,
    **selection: Unpack[SelectionWords],
) -> dict[str, np.ndarray]:
    """A new weight dictionary of ``module``'s tensors under ``scope`` (keys relative to it).

    ``trainable_only`` keeps the parameters that require grad, plus the tensors whose key
    matches ``also`` (``also="*/running_*"`` adds batch norm's statistics, which are buffers).
    With ``layout``, keys and arrays come out in Keras's names and layouts; a tensor no rule
    converts raises :class:`~weightstore.errors.LayoutError` listing every such key. With
    ``names="torch"`` the keys are ``state_dict`` names (``features.0.weight``), so
    ``safetensors.numpy.save_file`` or ``ws.save`` of the result is a file that
    ``load_state_dict(safetensors.torch.load_file(f))`` takes as is (``ws.save(f, export(m),
    names="torch")`` writes the same file and keeps weightstore's keys).
    """
    if check_naming(names, WRITE_NAMINGS) == TORCH and layout is not None:
        raise ValueError("names='torch' and layout= do not combine: a layout writes Keras's names")
    found, chosen = _selected(module, Selection.of("torch.export", selection, export))
    weights = {key: to_numpy(found[old], key) for key, old in chosen.items()}
    if names == TORCH:
        return {torch_name_of_key(key): value for key, value in weights.items()}
    if layout is None:
        return weights
    sites, chosen_layout = _sites(module), layouts.resolve(layout, "torch")
    steps, refused = layouts.to_keras(chosen_layout, {k: v.shape for k, v in weights.items()},
                                      {key: sites.get(old, layouts.Site(None)) for key, old in chosen.items()})
    unported = {key: why for layer in _unported(module, chosen_layout).values() for key, why in layer.items()}
    refused.update({key: unported[old] for key, old in chosen.items() if old in unported})
    if refused:
        raise LayoutError(layouts.refusal_message(f"exporting {_describe(module)}", refused))
    return {new: step.build(weights.__getitem__) for new, step in steps.items()}


def export_pieces(module: nn.Module, *, rank: int | None = None, world: int | None = None,
                  **selection: Unpack[SelectionWords]) -> dict[str, list[Piece]]:
    """What this rank writes of ``module`` to a sharded version: key -> its
    :class:`~weightstore.Piece` s, for :func:`weightstore.publish_shard`.

    A ``DTensor`` (FSDP2's ``fully_shard`` parameters, tensor-parallel plans, ``distribute_tensor``)
    gives its local shard at its global offset, written once (of ranks holding the same shard,
    the first); a plain tensor, which every rank holds whole, is split by rows between the
    ranks. No tensor crosses the network. ``rank`` and ``world`` (for plain tensors) default to
    ``torch.distributed``'s. Keys and selection are :func:`export`'s; a rank may hold no piece
    of some keys, which other ranks write.
    """
    found, chosen = _selected(module, Selection.of("torch.export_pieces", selection, export_pieces))
    if rank is None or world is None:
        grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = (torch.distributed.get_rank() if grouped else 0) if rank is None else rank
        world = (torch.distributed.get_world_size() if grouped else 1) if world is None else world
    pieces: dict[str, list[Piece]] = {}
    for key, old in chosen.items():
        tensor = found[old]
        _refuse_without_values(tensor, key)
        shape = tuple(tensor.shape)
        sharded = _torch_shards.is_sharded(tensor)
        region = _torch_shards.local_region(tensor, key) if sharded else split_rows(shape, rank, world)
        if region is None or (sharded and not _torch_shards.writes_local(tensor)):
            continue
        array = to_numpy(_torch_shards.local_tensor(tensor) if sharded else tensor[region], key)
        pieces[key] = [Piece(array, tuple(part.start for part in region), shape)]
    return pieces


def publish_sharded(
    folder: Any,
    module: nn.Module,
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
    """Publish ``module`` as one sharded version, every rank of the ``torch.distributed`` job
    writing what it holds (:func:`export_pieces`); call it alike on every rank.

    Rank 0 hands out the attempt through the process group's c10d store, every rank writes its
    member, rank 0 commits, and every rank returns the same committed
    :class:`~weightstore.Version` or raises the same error
    (:func:`weightstore.sharded.publish_together`). No collective runs: the ranks meet
    in the store, so the training step's collectives are never queued behind a publish. Without
    a process group the module is published whole as rank 0 of 1.

    With ``background=True`` the values are copied now (this rank's pieces, into host memory)
    and the call returns a ``concurrent.futures.Future`` of the version at once; the members
    are written and committed in a background thread, one publish after another in the order
    they were made, while the step goes on.

    ``delta``: a :class:`~weightstore.Delta` given to every publish of this rank (or ``True``):
    each rank writes its member as a delta of its member of the version before, where smaller
    (``publish_shard``'s ``delta``).

    ``digests=False``: no BLAKE3 of each block (``publish_shard``'s): for a checkpoint no follower
    reads, whose every block is still verified as it is read.

    Raises:
        ShardTimeoutError, PublishError: see ``publish_together`` (through the future with
            ``background=True``).
    """
    pieces = export_pieces(module, **Selection.of("torch.publish_sharded", selection, publish_sharded).words())  # the snapshot: copies in host memory
    grouped = torch.distributed.is_available() and torch.distributed.is_initialized()
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if grouped else (0, 1)
    call = functools.partial(publish_together, folder, pieces, step=step, rank=rank, world=world, timeout=timeout,
                             keep=keep, metadata=metadata, storage_options=storage_options, delta=delta, digests=digests)
    return in_background(call) if background else call()


def assign(
    module: nn.Module,
    weights: Any,
    *,
    layout: str | layouts.Layout | None = None,
    **words: Unpack[AssignWords],
) -> Report:
    """Write ``weights`` (a dict, path, open Store or Version) into ``module``'s tensors, in place.

    Keys may be keys (``features/0/weight``) or ``state_dict`` names (``features.0.weight``):
    a value key with ``.`` and no ``/`` is read as a torch name (no module key holds ``.``,
    so nothing that would have matched is lost), unless a ``layout`` makes them Keras's.

    Plans first, as the TF adapters do: a strict failure raises ``AssignmentError`` naming
    every missing, unexpected and mismatched key (with a layout, also every value no rule
    converts) and changes nothing. Every value is read, and its checksum verified, before
    the first tensor changes. ``skip_unchanged`` works as in ``tf2.assign``; call
    :func:`forget` after the module's tensors changed outside weightstore.
    """
    found = _tensors(module)
    without_data = [key for key, tensor in found.items() if tensor.is_meta]
    if without_data:
        raise AssignmentError(f"cannot assign {_describe(module)}: {len(without_data)} tensors are on the meta device "
                              f"and hold no data (first {without_data[0]!r}); call module.to_empty(device=...) first",
                              missing=without_data)
    uninitialized = [key for key, tensor in found.items() if is_lazy(tensor)]
    if uninitialized:
        raise AssignmentError(f"cannot assign {_describe(module)}: {len(uninitialized)} tensors are a lazy module's "
                              f"uninitialized parameters and have no shape yet (first {uninitialized[0]!r}); "
                              "run one forward pass first", missing=uninitialized)
    targets = {key: TargetInfo(key, numpy_dtype(tensor, key), tuple(tensor.shape), tensor.requires_grad)
               for key, tensor in found.items()}
    options = AssignOptions.of("torch.assign", words, assign)
    chosen_layout = None if layout is None else layouts.resolve(layout, "torch")
    unported = {} if chosen_layout is None else _unported(module, chosen_layout)
    if options.strict:  # a layer selected would be refused as missing its values all the same: say why
        _refuse_unported(module, _unported_selected(unported, options))
    local = {key: _torch_shards.local_tensor(tensor) for key, tensor in found.items()}

    def prepare(source: Any, key: str, value_key: str) -> np.ndarray:
        """The value, or of a DTensor only its local shard's region (all a sharded version fetches)."""
        region = _torch_shards.local_region(found[key], key)
        value = source.read(value_key) if region is None else source.read_region(value_key, region)
        return np.asarray(value, dtype=targets[key].dtype)

    def write(batch: list[tuple[str, np.ndarray]], report: Report) -> list[str]:
        batch = _refuse_unwritable(batch, local, report, strict=options.strict, where=_describe(module))
        with torch.no_grad():
            for key, array in batch:
                local[key].copy_(_as_tensor(array))
        return [key for key, _ in batch]

    def plan(values: Any, options: AssignOptions) -> tuple[Any, Any]:
        if chosen_layout is None:
            values = _keyed(values, targets, options)
        laid = layouts.plan_laid_out(values, targets, options, layout=chosen_layout, optional=_optional,
                                     tied=_tied(local))
        _refuse_unported(module, _unported_paired(unported, laid[0].pairs))
        return laid

    def regions(key: str) -> list[tuple[slice, ...]] | None:
        """A DTensor's local shard: hot reload compares the digest of its region alone."""
        region = _torch_shards.local_region(found[key], key)
        return None if region is None else [region]

    return run_assign(Target(targets, write, slot=lambda key: (found[key], ""), prepare=prepare, plan=plan,
                             regions=regions), weights, options)


def _tied(found: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Key -> the first key that is the very same tensor (one storage, offset, shape, strides and
    dtype: tied weights), for each key that has such an earlier one; ``found`` holds plain
    tensors (a DTensor's local shard: a DTensor has no storage of its own)."""
    first: dict[tuple[Any, ...], str] = {}
    tied = {}
    for key, tensor in found.items():
        if tensor.is_meta or not tensor.untyped_storage().nbytes():
            continue
        identity = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                    tuple(tensor.shape), tensor.stride(), tensor.dtype)
        if identity in first:
            tied[key] = first[identity]
        else:
            first[identity] = key
    return tied


def _selected(module: nn.Module, chosen_by: Selection) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's tensors by key, and the selected ones (output key -> key), of which an
    export needs at least one."""
    found, chosen = _chosen(module, chosen_by)
    if not chosen:
        why = "no tensors" if not found else "no tensor passing the selection"
        raise SelectionError(f"{_describe(module)} has {why}")
    return found, chosen


def _chosen(module: nn.Module, chosen_by: Selection) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's tensors by key, and what ``chosen_by`` keeps of them: output key -> key."""
    found = _tensors(module)
    return found, chosen_by.choose(found, lambda key: found[key].requires_grad, _describe(module))


#: the first name torch.compile's (``_orig_mod``) and DDP's or DataParallel's (``module``) wrappers
#: put before their model's ``state_dict`` names
_WRAPPER_NAMES = ("_orig_mod", "module")


def _keyed(values: Any, targets: Collection[str], options: AssignOptions) -> Any:
    """``values`` with each ``state_dict`` name read as its key (:func:`~weightstore.core.names.torch_keys`),
    and a wrapper's name taken off the front of every key where all of them carry it and more of
    them then pair with a target: a file a user saved from a compiled or DDP module's own
    ``state_dict`` (``_orig_mod.fc.weight``, ``module.fc.weight``) assigns into the model, as
    :func:`export` of a wrapper now names its tensors (nested wrappers: each name in turn), while
    a model whose own child is named ``module`` keeps its keys. A ``mapping`` rule from a wrapper's
    name (``{"module": ""}``) is the user's own word on what it means: that name stays for it."""
    keys = {name: key for key, name in torch_keys(values.keys()).items()}
    scope = normalize_scope(options.scope)

    def paired(candidate: Mapping[str, str]) -> int:
        return sum(join_scope(scope, key) in targets for key in candidate.values())

    sources = [source.split("/") for source, _ in parse_mapping(options.mapping)]
    spoken = {parts[0] for parts in sources}
    best, unwrapped = paired(keys), keys
    while unwrapped:
        wrapper = next((name for name in _WRAPPER_NAMES if name not in spoken
                        and all(key.startswith(name + "/") for key in unwrapped.values())), None)
        if wrapper is None:
            break
        unwrapped = {name: key[len(wrapper) + 1 :] for name, key in unwrapped.items()}
        if paired(unwrapped) > best:
            best, keys = paired(unwrapped), unwrapped
    keys = _unwrapped_under_scopes(keys, lambda key: join_scope(scope, key) in targets,
                                   {part for parts in sources for part in parts})
    renames = {name: key for name, key in keys.items() if key != name}
    return RenamedValues(values, renames) if renames else values


def _unwrapped_under_scopes(keys: dict[str, str], pairs: Callable[[str], bool], spoken: Collection[str]) -> dict[str, str]:
    """``keys`` (name -> key) with a wrapper's name taken out after a scope, key by key, where the
    key pairs no variable and the key without it does (and no other value has it): a store of
    wrappers' files each under a scope, as ``ws import ddp.safetensors --into ens.safetensors
    --scope members/0`` writes them (``members/0/module/0/weight``). A wrapper's name that a
    ``mapping`` rule names anywhere (``{"members/0/module": "members/0"}``) stays for that rule."""
    taken = set(keys.values())
    unwrapped = dict(keys)
    for name, key in keys.items():
        parts = key.split("/")
        at = next((i for i, part in enumerate(parts[1:-1], 1) if part in _WRAPPER_NAMES and part not in spoken), None)
        if at is None or pairs(key):
            continue
        inner = "/".join(parts[:at] + parts[at + 1 :])
        if pairs(inner) and inner not in taken:
            unwrapped[name] = inner
            taken.add(inner)
    return unwrapped


def _refuse_unwritable(pending: list, found: dict[str, torch.Tensor], report: Report, *, strict: bool,
                      where: str) -> list:
    """Everything a write can still fail on, checked before the first write, so a strict
    assign that fails changes nothing: each tensor must take an in-place write (not an
    inference tensor, not expanded so that elements share memory), and tensors that share
    memory (tied weights, one possibly a transposed view of the other) must get values that
    agree where they overlap; else whichever came last would win, for both.
    """
    conflicts = {key: Mismatch(key, describe(array.dtype, array.shape), describe(array.dtype, array.shape), why)
                 for key, array in pending if (why := _why_not_writable(found[key])) is not None}
    conflicts.update(_shared_memory_conflicts([entry for entry in pending if entry[0] not in conflicts], found))
    refuse_before_write(list(conflicts.values()), report, strict=strict, where=where)
    return [entry for entry in pending if entry[0] not in conflicts]


def _why_not_writable(tensor: torch.Tensor) -> str | None:
    """Why ``copy_`` into ``tensor`` would fail, found without writing a byte of it."""
    if any(size > 1 and stride == 0 for size, stride in zip(tensor.shape, tensor.stride(), strict=True)):
        return "cannot be written in place: it is expanded, several of its elements are one in memory"
    try:
        with torch.no_grad():  # what copy_ checks (inference tensors, version counters), on no element
            tensor.as_strided((0,), (1,)).copy_(torch.empty(0, dtype=tensor.dtype))
    except RuntimeError as error:
        return f"cannot be written in place ({str(error).split('.')[0]})"
    return None


def _shared_memory_conflicts(pending: list, found: dict[str, torch.Tensor]) -> dict[str, Mismatch]:
    """Tensors over one storage, written into a scratch copy of it, last key first: each must
    then read back its own value, or its value and an earlier key's disagree on an element
    they share (the earlier key, whose value is what the storage would end up holding, is
    the one named)."""
    groups: dict[tuple[Any, int], list[tuple[str, np.ndarray]]] = {}
    for key, array in pending:
        storage = found[key].untyped_storage()
        if storage.nbytes():
            groups.setdefault((found[key].device, storage.data_ptr()), []).append((key, array))
    conflicts: dict[str, Mismatch] = {}
    for members in groups.values():
        if len(members) < 2 or not _spans_overlap([found[key] for key, _ in members]):
            continue  # one flat buffer of many parameters (FSDP): disjoint, nothing to prove
        scratch = torch.empty(found[members[0][0]].untyped_storage().nbytes(), dtype=torch.uint8)
        for key, array in reversed(members):
            _view_in(scratch, found[key]).copy_(_as_tensor(array))
        for key, array in members:
            if not torch.equal(_bytes_of(_view_in(scratch, found[key])), _bytes_of(_as_tensor(array))):
                others = [other for other, _ in members if other != key]
                shape = describe(array.dtype, array.shape)
                conflicts[key] = Mismatch(key, shape, shape, f"the same tensor as {others[0]!r} or a view of it "
                                          "(tied), which gets a different value")
    return conflicts


def _spans_overlap(tensors: list[torch.Tensor]) -> bool:
    """Whether any two of ``tensors`` (over one storage) reach a common byte of it."""
    spans = []
    for tensor in tensors:
        start = tensor.storage_offset() * tensor.element_size()
        last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
        spans.append((start, start + (last + 1) * tensor.element_size()))
    spans.sort()
    return any(next_start < end for (_, end), (next_start, _) in itertools.pairwise(spans))


def _view_in(scratch: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s elements as they lie in ``scratch``, a byte copy of its storage."""
    return scratch.view(tensor.dtype).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor``'s elements in order: equal values compare equal, NaNs included."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def forget(module: nn.Module) -> None:
    """Forget what ``module``'s tensors last received, so the next assign writes them all."""
    for tensor in _tensors(module).values():
        MEMORY.forget(tensor)


def numpy_dtype(tensor: torch.Tensor, key: str) -> np.dtype:
    if tensor.dtype in _VIEWED:
        return _VIEWED[tensor.dtype][0]
    try:
        return torch.empty(0, dtype=tensor.dtype).numpy().dtype
    except TypeError as error:
        raise UnsupportedDTypeError(f"torch dtype {tensor.dtype} has no numpy counterpart", key=key) from error


def _optional(key: str) -> bool:
    return key.rpartition("/")[2] == OPTIONAL_LEAF


def to_numpy(tensor: torch.Tensor, key: str, *, copy: bool = True) -> np.ndarray:
    """An array of ``tensor``'s values, whatever device it lives on and whether it requires grad:
    a new one, or with ``copy=False`` a view of a CPU tensor's own memory (for a save, which only
    reads it)."""
    dtype = numpy_dtype(tensor, key)
    _refuse_without_values(tensor, key)
    # a conjugate or negative view is a flag on shared memory, which numpy() will not read
    values = tensor.detach().to("cpu", copy=copy).resolve_conj().resolve_neg()
    if tensor.dtype in _VIEWED:
        return values.view(_VIEWED[tensor.dtype][1]).numpy().view(dtype)
    return values.numpy()


def _refuse_without_values(tensor: torch.Tensor, key: str) -> None:
    """Raise :class:`SelectionError` where ``tensor`` holds no values to export (torch's own
    errors for them name neither the key nor the fix)."""
    if tensor.is_meta:
        raise SelectionError("is on the meta device and holds no values", key=key)
    if tensor.is_nested or tensor.layout != torch.strided:
        what, fix = (("a nested tensor", "each of tensor.unbind()") if tensor.is_nested
                     else (f"a {tensor.layout} tensor", "tensor.to_dense()"))
        raise UnsupportedDTypeError(f"is {what}, not one dense array; store {fix} instead", key=key)
    if is_lazy(tensor):
        raise SelectionError("is a lazy module's uninitialized parameter and holds no values yet; "
                             "run one forward pass first", key=key)


def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``array``'s memory; ``copy_`` reads it, so a read-only array is fine.

    A layout's transposed view stays strided: ``copy_`` transposes about five times faster
    than numpy making it contiguous first.
    """
    if any(stride < 0 for stride in array.strides):  # torch.from_numpy refuses negative strides
        array = array.copy()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        if array.dtype in _FROM_NUMPY:
            dtype, integer = _FROM_NUMPY[array.dtype]
            return torch.from_numpy(array.view(torch.empty(0, dtype=integer).numpy().dtype)).view(dtype)
        return torch.from_numpy(array)


def _sites(module: nn.Module) -> dict[str, layouts.Site]:
    """Key -> the layer kind of the module holding that tensor, for converting to Keras."""
    sites = {}
    for name, owner in _unwrapped(module).named_modules(remove_duplicate=False):
        site = _site(owner)
        own = [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]
        sites.update({f"{name}.{leaf}".lstrip(".").replace(".", "/"): site for leaf, _ in own})
    return sites


def _unported(module: nn.Module, layout: layouts.Layout) -> dict[str, dict[str, str]]:
    """Layer key -> {key: why}, for the tensors of layers that compute what their Keras
    counterpart does not, so that no values, to Keras or from it, make the two predict alike:
    ``MultiheadAttention`` with ``add_bias_kv=True`` (its ``bias_k``/``bias_v``, in
    ``layout.unported``'s words) or ``add_zero_attn=True`` (every tensor of the layer: it appends
    a zero key and value, which Keras's ``MultiHeadAttention`` does not, and converted alone they
    would predict otherwise)."""
    said = dict(layout.unported)
    refused: dict[str, dict[str, str]] = {}
    for name, owner in _unwrapped(module).named_modules():
        if not isinstance(owner, nn.MultiheadAttention):
            continue
        own = {f"{name}.{leaf}".lstrip(".").replace(".", "/"): leaf for leaf, _ in owner.named_parameters()}
        for key, leaf in own.items():
            if owner.add_zero_attn:
                why = ("is of a MultiheadAttention(add_zero_attn=True), which appends a zero key and value to every "
                       "sequence: Keras's MultiHeadAttention does not, so converted it would predict otherwise; "
                       "port a module built with add_zero_attn=False")
            elif leaf in said:
                why = said[leaf]
            else:
                continue
            refused.setdefault(name.replace(".", "/"), {})[key] = why
    return refused


def _unported_selected(unported: Mapping[str, Mapping[str, str]], options: AssignOptions) -> dict[str, str]:
    """Key -> why, of the tensors of :func:`_unported`'s layers that ``options`` selects."""
    at = normalize_scope(options.scope)
    return {key: why for keys in unported.values() for key, why in keys.items()
            if in_scope(key, at) and passes(strip_scope(key, at), options.include, options.exclude)}


def _unported_paired(unported: Mapping[str, Mapping[str, str]], paired: Collection[str]) -> dict[str, str]:
    """Key -> why, of :func:`_unported`'s layers any of whose tensors a plan gives a value: with
    ``strict=False`` a layer no value goes into stays as it was, as any variable without a value
    does (a Keras model's Dense layers into a module that has such attention beside them)."""
    return {key: why for layer, keys in unported.items()
            if any(not layer or key.startswith(layer + "/") for key in paired) for key, why in keys.items()}


def _refuse_unported(module: nn.Module, refused: Mapping[str, str]) -> None:
    if refused:
        raise LayoutError(layouts.refusal_message(f"assigning into {_describe(module)}", refused))


def _site(module: nn.Module) -> layouts.Site:
    if isinstance(module, nn.Linear):
        return layouts.Site(layouts.DENSE)
    if isinstance(module, nn.modules.conv._ConvNd):
        if module.groups == module.in_channels and module.groups > 1 and not module.transposed:
            return layouts.Site(layouts.DEPTHWISE, module.groups)
        # a transposed one too: [in, out, *spatial] is Keras's [*spatial, out, in] reversed; and a
        # grouped one, [out, in/groups, *spatial], Keras's grouped [*spatial, in/groups, out] reversed
        if module.groups == 1 or not module.transposed:
            return layouts.Site(layouts.CONV)
    if isinstance(module, (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm)):
        return layouts.Site(layouts.NORM)
    if isinstance(module, nn.Embedding):
        return layouts.Site(layouts.EMBEDDING)
    if isinstance(module, nn.MultiheadAttention):  # the head count splits in_proj_weight for Keras
        return layouts.Site(type(module).__name__, module.num_heads)
    return layouts.Site(type(module).__name__)


def _describe(module: Any) -> str:
    return f"torch module {type(module).__name__}"
