"""``ws export``, ``ws import`` and ``ws convert``: move tensors between sources and targets.

Every source opens through :func:`weightstore.cli.sources.open_source`, so each
command accepts a store, a TF checkpoint or a Keras file alike. Selection follows
the README everywhere: scope and mapping first, then include/exclude on the resulting keys.
Targets are written whole and atomically: a failed or interrupted command leaves them as
they were.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

import weightstore
from weightstore.adapters import _checkpoints, _keras_import
from weightstore.adapters import layout as layouts
from weightstore.adapters.plan import Selection, training_state
from weightstore.cli.render import counted, track, working
from weightstore.cli.sources import Source
from weightstore.core.keys import MappingRules, Patterns, plan_inward, validate_key
from weightstore.core.names import TORCH, WRITE_NAMINGS, check_naming, torch_keys, torch_name_of_key
from weightstore.errors import (
    FormatError,
    InvalidKeyError,
    LayoutError,
    SelectionError,
    StoreExistsError,
    StoreNotFoundError,
    TargetError,
    WeightStoreError,
    named,
    naming,
)
from weightstore.formats import format_for_suffix, hf_sharded, known_suffixes, sniff
from weightstore.formats._foreign import HF_SINGLE_FILE
from weightstore.formats.tf_checkpoint import resolve_prefix
from weightstore.io.location import is_url
from weightstore.store._save import output_format

_SHOWN = 5  # colliding keys named in an error; the rest are counted
NAME_BASED_CAUTION = (
    "note: {target} is a name-based checkpoint: tf.compat.v1.train.Saver, tf.train.load_checkpoint and ws read "
    "it, tf.train.Checkpoint.restore does not (it would silently restore nothing); to load it into a Keras "
    "model use weightstore.adapters.tf2.assign(model, store)"
)


@dataclass(frozen=True)
class Written:
    """What a command wrote, for its one-line summary."""

    path: str
    kind: str
    count: int
    nbytes: int
    #: what the user should know about the result (one line), or None
    caution: str | None = None


def read(source: Source, plan: Mapping[str, str], description: str) -> dict[str, np.ndarray]:
    """New key -> array for every ``plan`` entry (new key -> source key), with progress."""
    total = sum(source.info(old).nbytes for old in plan.values())
    items = ((new, source.info(old).nbytes) for new, old in plan.items())
    return {new: source[plan[new]] for new in track(items, description, total)}


def export(source: Source, out: str, *, selection: Selection, mapping: MappingRules, compress: bool | str,
           names: str | None = None) -> Written:
    """The tensors ``selection`` keeps, as an adapter's export keeps them; ``also`` matches the
    keys after scope and mapping (``--also '*/bn/moving_*'``: batch-norm statistics beside the
    trainable weights). ``names`` is :func:`weightstore.save`'s; by default, as the source names them."""
    output_format(out)  # a name no format writes is refused before anything is read
    check_naming(names, WRITE_NAMINGS)
    # first: a source that cannot say what is trainable is the error, not an --also that misses its keys
    trainable = source.trainable_keys() if selection.trainable_only else set()
    with naming(path=source.path):
        plan = selection.choose(source.keys(), trainable.__contains__, mapping=mapping, command_line=True)
    if not plan:
        raise SelectionError("selects no tensor", path=source.path)
    if names is None:
        names = _names_kept(source, plan)
    weights = read(source, plan, "reading")
    with counted(weights, f"writing {out}") as values:
        weightstore.save(out, values, metadata=provenance(source), compress=compress, names=names)
    return Written(out, "store", len(weights), sum(a.nbytes for a in weights.values()))


def provenance(source: Source) -> dict:
    """The metadata a store written from ``source`` carries: a store's own; for a foreign file,
    where it came from, and its own metadata (a safetensors ``__metadata__``) under its own names."""
    if source.has_checksums:
        return source.metadata
    return {"source": source.path, "source_kind": source.kind, **source.metadata}


def convert(source: Source, out: str, *, compress: bool | str, layout: str | None = None,
            names: str | None = None, max_shard_size: str | None = None,
            kinds: Mapping[str, str] | None = None) -> Written:
    """``source`` rewritten as ``out``; with ``layout``, in the other framework's names and
    layouts, named (``names``, :func:`weightstore.save`'s) as ``load_state_dict`` takes them
    when the other framework is PyTorch; without, as :func:`_names_kept` says. A torch-to-keras
    source may be keyed by torch names. ``max_shard_size`` writes a Hugging Face sharded folder
    at ``out``; ``kinds`` (scope or glob -> layer kind) decides what the file's names leave open
    (:func:`layouts.convert`)."""
    if check_naming(names, WRITE_NAMINGS) is None and layout == "keras-to-torch":
        names = TORCH
    if max_shard_size is None:
        output_format(out)  # a name no format writes is refused before anything is read
    if names is None and layout is None:  # the same tensors in another file
        names = _names_kept(source, source.keys())
    plan = torch_keys(source.keys()) if layout == "torch-to-keras" else {k: k for k in source}
    # an optimizer's state (a TF1 Saver checkpoint's slots and step, a Keras model's
    # optimizer/vars/<i>) has no place in another framework's module, as in an assign
    left_out = training_state(plan, (), None) if layout is not None and layout.startswith("keras-to-") else []
    for key in left_out:
        del plan[key]
    weights = read(source, plan, "converting")
    cautions = [f"left out {len(left_out)} tensors of training state: {named(left_out)}"] if left_out else []
    if layout is not None:
        with naming(path=source.path), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always", layouts.LayoutWarning)
            try:
                weights = layouts.convert(weights, layout, kinds=kinds)
            except LayoutError as exc:
                if layout == "keras-to-torch" and naming_of(source) == TORCH:  # it is PyTorch's already
                    raise LayoutError(f"{exc.message}\nThe file names its tensors as a PyTorch state_dict does: "
                                      "to convert it into Keras's layouts, use --layout torch-to-keras") from None
                raise
        for warning in said:  # a layout's guess is the caution line; any other warning is shown as it was
            if issubclass(warning.category, layouts.LayoutWarning):
                cautions.append(str(warning.message))
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    with counted(weights, f"writing {out}") as values:
        weightstore.save(out, values, metadata=source.metadata, compress=compress, names=names,
                         max_shard_size=max_shard_size)
    return Written(out, "store", len(weights), sum(a.nbytes for a in weights.values()), "; ".join(cautions) or None)


def is_checkpoint_target(target: str) -> bool:
    """Whether ``--into`` names a TF checkpoint prefix rather than a store.

    A store suffix (``.npz``, ``.h5``) or an existing store file means a store; an existing
    checkpoint at the prefix, or any other new name (``model.ckpt``), means a checkpoint.
    """
    if is_url(target):
        if format_for_suffix(target) is None and not target.endswith(".keras"):
            _refuse_other_file(target)  # the answer a local name gets: ws never writes such a file
            # else the store's write refused it asking for a suffix, as if a checkpoint were no choice
            raise TargetError("a TF checkpoint is written only to a local prefix (model.ckpt); into object "
                              f"storage, import into a store named with one of {', '.join(known_suffixes())}",
                              path=target)
        return False
    _refuse_hugging_face_folder(target)  # before the suffix: its index's name ends as a format's does
    if format_for_suffix(target) is not None:
        return False
    if os.path.exists(target + ".index"):
        return True
    if os.path.isdir(target):
        example = os.path.join(target, "model.ckpt")
        try:  # the checkpoint it holds, by the rule every reader follows (a new name would start another)
            held = resolve_prefix(target)
        except WeightStoreError:  # none, or several and no state file saying which
            raise FormatError(f"is a folder; give a checkpoint prefix such as {example}", path=target) from None
        raise FormatError(f"is a folder; give the prefix of the checkpoint it holds: --into {held}", path=target)
    if target.endswith(".keras") and not os.path.isfile(target):
        raise FormatError("no such .keras archive, and ws does not make new ones (Keras's model.save does); "
                          "import into an existing one, or a .weights.h5 or .npz file", path=target)
    if _keras_import.is_keras_target(target):
        return False
    if os.path.isfile(target):
        with open(target, "rb") as handle, naming(path=target):
            sniff(handle.read(8))  # refuses files that are neither npz nor HDF5
        return False
    _refuse_near_store_suffix(target)
    _refuse_unusable_prefix(target)
    return True


def _refuse_hugging_face_folder(target: str) -> None:
    """A ``save_pretrained`` folder (or its index) is refused saying what to do: a checkpoint
    prefix made inside it, as a plain folder's refusal suggests, is nothing transformers reads."""
    single = os.path.join(target, HF_SINGLE_FILE)
    if os.path.isdir(target) and os.path.isfile(single):
        raise FormatError(f"is a Hugging Face folder; import into its weights file: --into {single}", path=target)
    index = target if target.endswith(hf_sharded.INDEX_SUFFIX) else os.path.join(target, hf_sharded.INDEX_NAME)
    if index == target or os.path.isfile(index):
        folder = os.path.dirname(index) or "."
        raise FormatError(f"is a sharded Hugging Face folder, which ws import does not rewrite: ws convert {folder} "
                          "one.safetensors, import into that, then ws convert it back with --max-shard-size",
                          path=target)


def _refuse_near_store_suffix(target: str) -> None:
    """A new name whose suffix is a store's misspelt (``w.npzz``, ``w.safetensor``) would become
    a TF checkpoint prefix without a word; it is refused, naming the store suffix meant."""
    stem, suffix = os.path.splitext(target)
    near = difflib.get_close_matches(suffix.lower(), known_suffixes(), n=1, cutoff=0.75) if suffix else []
    if near:
        raise TargetError(f"{suffix!r} is no store suffix, and a new name without one would become a TF "
                          f"checkpoint prefix; did you mean {stem + near[0]!r}? (for a new checkpoint, name "
                          "it like model.ckpt)", path=target)


#: suffixes of files that are not TF checkpoints: a new name ending in one is a mistake, not a prefix
_OTHER_FILE_SUFFIXES = frozenset({
    ".pt", ".pth", ".bin", ".pkl", ".pickle", ".joblib", ".onnx", ".pb", ".tflite", ".gguf", ".msgpack",
    ".npy", ".json", ".yaml", ".yml", ".txt", ".csv", ".zip", ".tar", ".gz", ".index", ".meta",
})


def _refuse_unusable_prefix(target: str) -> None:
    """A new checkpoint prefix names the files ``PREFIX.index`` and ``PREFIX.data-*``: a name
    ending in ``/`` would make hidden files ``.index`` and ``.data-*`` that nothing reads back,
    and a suffix of another kind of file (``.pt``, ``.txt``) is a mistake that would otherwise
    become a checkpoint without a word."""
    if not os.path.basename(target):
        raise TargetError(f"ends in {target[-1]!r}, so it names no checkpoint; give a prefix such as "
                          f"{os.path.join(target, 'model.ckpt')}", path=target)
    _refuse_other_file(target)


def _refuse_other_file(target: str) -> None:
    """A name with the suffix of a kind of file ws never writes (``.pt``, ``.txt``) is refused
    saying so, locally and as a URL alike."""
    suffix = os.path.splitext(target.rsplit("/", 1)[-1])[1].lower()
    if suffix in _OTHER_FILE_SUFFIXES:
        raise TargetError(f"ws import writes stores ({', '.join(known_suffixes())}), Keras files and TF "
                          f"checkpoints, not {suffix} files; a new checkpoint is named like model.ckpt",
                          path=target)


def import_(source: Source, target: str, *, scope: str | None, mapping: MappingRules, include: Patterns,
            exclude: Patterns, overwrite: bool) -> Written:
    with naming(path=source.path):
        plan = plan_inward(source.keys(), scope=scope, mapping=mapping, include=include, exclude=exclude)
    if not plan:
        raise SelectionError("holds no tensor to import", path=source.path)
    with naming(path=target):  # keys the scope made, refused as the target's
        for key in plan:
            validate_key(key)
    if is_checkpoint_target(target):
        return _import_into_checkpoint(source, target, plan, overwrite)
    if _keras_import.is_keras_target(target):
        return _import_into_keras(source, target, plan, overwrite, scope)
    try:
        old = weightstore.open(target)
    except StoreNotFoundError:
        weights = read(source, plan, "importing")
        with counted(weights, f"writing {target}") as values:
            weightstore.save(target, values, metadata=provenance(source))
        return Written(target, "store", len(weights), sum(a.nbytes for a in weights.values()))
    with old:
        _refuse_clashes(target, old.keys(), plan, overwrite)
        names = naming_of(old)
        if names == TORCH:
            _refuse_unnameable(target, plan)
        merged = {key: old[key] for key in old if key not in plan}
        weights = read(source, plan, "importing")
        with counted({**merged, **weights}, f"writing {target}") as values:
            weightstore.save(target, values, metadata=old.metadata, names=names)
    return Written(target, "store", len(weights), sum(a.nbytes for a in weights.values()))


def _refuse_unnameable(target: str, plan: Mapping[str, str]) -> None:
    """Keys a file named as a ``state_dict`` cannot take: one with ``.`` inside a segment would
    read back as another key (``block.1/w`` as ``block/1/w``). The ``--map`` proposed renames the
    source's key up to its first such segment, as a mapping sees keys before ``--scope`` adds its
    own (``0.bias`` imported under ``old``: ``--map '0.bias=NEW'``)."""
    key = _without_torch_name(plan)
    if key is not None:
        segments = plan[key].split("/")
        dotted = next((i for i, segment in enumerate(segments) if "." in segment), None)
        # no dotted segment in the source: the user's own --map put the '.' there, no source rule to propose
        example = f" (--map '{'/'.join(segments[:dotted + 1])}=NEW')" if dotted is not None else ""
        raise TargetError(f"names its tensors as a PyTorch state_dict does, and the imported key {key!r} has a "
                          f"'.' inside a segment, which no such name keeps apart; rename it with --map{example}",
                          path=target)


def _without_torch_name(keys: Iterable[str]) -> str | None:
    """The first of ``keys`` that no ``state_dict`` name spells (a ``.`` inside a segment), if any."""
    for key in keys:
        try:
            torch_name_of_key(key)
        except InvalidKeyError:
            return key
    return None


def _names_kept(source: Source, keys: Iterable[str]) -> str | None:
    """``torch`` where a source whose file names its tensors as a ``state_dict`` does is written
    again, and every key written has such a name (a ``--map`` may have put a ``.`` in a segment);
    else None, the keys. Every format keeps the keys beside such names (safetensors each key, npz
    and HDF5 a word in the manifest), so ``load_state_dict`` takes the copy as it took the source."""
    if naming_of(source) != TORCH or _without_torch_name(keys) is not None:
        return None
    return TORCH


def naming_of(store: weightstore.Store) -> str | None:
    """``torch`` for a store whose file names its tensors as a ``state_dict`` does
    (``features.0.weight``, read as the key ``features/0/weight``): merged into, it keeps them
    so, or ``load_state_dict`` would no longer find them."""
    stored = store.stored_names()
    try:
        return TORCH if stored and all(stored.get(key, key) == torch_name_of_key(key) for key in store) else None
    except InvalidKeyError:  # a key no torch name spells: the file did not name them all so
        return None


def _import_into_checkpoint(source: Source, target: str, plan: Mapping[str, str], overwrite: bool) -> Written:
    """An existing TF2 object-based checkpoint has its variables replaced in place (nothing else can be
    restored from it, so no ``--overwrite`` is asked for); an existing name-based one is merged into;
    a new prefix becomes a name-based checkpoint recorded in its folder's state file."""
    if os.path.exists(target + ".index") and _checkpoints.is_object_based(target):
        weights = read(source, plan, "importing")
        with working(f"writing {target}"):
            _checkpoints.replace_in_object_checkpoint(target, weights)
        return Written(target, "TF2 object-based checkpoint", len(weights), sum(a.nbytes for a in weights.values()))
    new = not os.path.exists(target + ".index")
    _refuse_clashes(target, _checkpoints.checkpoint_names(target), plan, overwrite)
    if not new:
        _refuse_reshaped(source, target, plan)
    state = _checkpoints.state_file_text(target) if new else None
    weights = read(source, plan, "importing")
    missing = _missing_folders(os.path.dirname(target)) if state is not None else []
    made: list[str] = []  # by this import, outermost first
    with working(f"writing {target}"):
        try:
            for folder in reversed(missing):
                try:
                    os.mkdir(folder)
                except FileExistsError:  # another import into it made it meanwhile: not this one's to remove
                    continue
                made.append(folder)
            _checkpoints.write_checkpoint(target, weights)
            if state is not None:
                _checkpoints.write_state_file(target, state)
        except BaseException:  # a write that failed leaves nothing, not even the folders it made
            for folder in reversed(made):
                with contextlib.suppress(OSError):  # one that holds something now is not the import's alone
                    os.rmdir(folder)
            raise
    caution = NAME_BASED_CAUTION.format(target=target) if new else None
    return Written(target, "TF checkpoint", len(weights), sum(a.nbytes for a in weights.values()), caution)


def _missing_folders(folder: str) -> list[str]:
    """The folders up to ``folder`` that do not exist yet, deepest first: those an import makes.
    A ``.`` or ``..`` step (``out/./m.ckpt``, ``new/../run/m.ckpt``) is no folder to make: it is
    there once the folder before it is, as ``os.makedirs`` takes it."""
    missing = []
    while folder and not os.path.exists(folder):
        if os.path.basename(folder) not in (os.curdir, os.pardir):
            missing.append(folder)
        folder = os.path.dirname(folder)
    return missing


def _import_into_keras(source: Source, target: str, plan: Mapping[str, str], overwrite: bool,
                       scope: str | None) -> Written:
    """Tensors of a Keras file replaced where Keras reads them (see :mod:`weightstore.adapters._keras_import`)."""
    if not overwrite:
        raise StoreExistsError(f"is a Keras file: an import replaces tensors Keras reads ({len(plan)} of them); "
                               "pass --overwrite to replace them", path=target)
    weights = read(source, plan, "importing")
    with working(f"writing {target}"):
        _keras_import.replace_in_keras_file(target, weights, scope=scope)
    return Written(target, "Keras file", len(weights), sum(a.nbytes for a in weights.values()))


def _refuse_reshaped(source: Source, target: str, plan: Mapping[str, str]) -> None:
    """An entry of a TF1 checkpoint replaced only by a tensor of its dtype and shape: the graph
    it was saved from restores nothing else (``Saver.restore`` fails on the whole checkpoint),
    as TF2 checkpoints and Keras files refuse it too."""
    with weightstore.open(target) as old:
        for key, source_key in plan.items():
            if key in old:
                was, now = old.info(key), source.info(source_key)
                if (was.dtype, was.shape) != (now.dtype, now.shape):
                    raise _checkpoints.entry_changed(target, key, (was.dtype, was.shape), (now.dtype, now.shape))


def _refuse_clashes(target: str, existing: list[str], plan: Mapping[str, str], overwrite: bool) -> None:
    if overwrite:
        return
    present = set(existing)
    clash = [key for key in plan if key in present]
    if clash:
        raise StoreExistsError(f"already holds {len(clash)} of the imported keys ({named(clash, shown=_SHOWN)}); "
                               "pass --overwrite to replace them, or --scope to import beside them", path=target)
