"""TensorFlow checkpoints written from weight dictionaries, and TensorFlow imported quietly for the CLI.

Reading needs no TensorFlow: :func:`weightstore.open` reads TF checkpoints
(:mod:`weightstore.formats.tf_checkpoint`, whose docstring defines their keys) and Keras files
(:mod:`weightstore.formats.keras_file`) in the core. This module adds what does need
TensorFlow: writing name-based checkpoints (:func:`write_checkpoint`) and the ``checkpoint``
state file that makes them findable (:func:`state_file_text`), and replacing values in TF2
object-based ones (:func:`replace_in_object_checkpoint`). TensorFlow is imported only then
(:func:`tensorflow`), and under the CLI without its start-up chatter (:mod:`._tf_quiet`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from weightstore.adapters._tf_quiet import quietly
from weightstore.core._extras import install_hint
from weightstore.errors import (
    FormatError,
    MissingDependencyError,
    SelectionError,
    UnsupportedDTypeError,
    named,
)
from weightstore.formats.tf_checkpoint import (
    STATE_FILE,
    CheckpointReader,
    CheckpointState,
    read_state_file,
)
from weightstore.io.commit import IndexLastCommit, RenameCommit

_SHOWN = 5  # keys named in an error; the rest are counted


def tensorflow(needed_for: str, path: str):
    """TensorFlow, or the error saying what ``needed_for`` it (the core reads TF checkpoints without it)."""
    try:
        with quietly():
            import tensorflow as tf
        return tf
    except ImportError:
        raise MissingDependencyError(f"{needed_for} needs TensorFlow: {install_hint('tf')}", path=path) from None


def entry_changed(prefix: str, key: str, was: tuple[str, Any], now: tuple[str, Any]) -> SelectionError:
    """The refusal of an import that would change an entry's ``(dtype, shape)``: whatever restores
    the checkpoint (its graph's ``Saver``, its object graph) expects the old one."""
    return SelectionError(f"is {was[0]} {list(was[1])} in the checkpoint, the imported tensor is {now[0]} "
                          f"{list(now[1])}; what restores the checkpoint expects the first", path=prefix, key=key)


def checkpoint_names(prefix: str) -> list[str]:
    """The entries of the name-based checkpoint at ``prefix``; empty when there is none.

    Refuses a TF2 object-based checkpoint: entries merged into one would be invisible to
    ``tf.train.Checkpoint.restore``, which finds variables through the object graph.
    """
    if not os.path.exists(prefix + ".index"):
        return []
    reader = CheckpointReader(prefix)
    reader.close()  # only the index is needed
    if reader.object_based:
        raise FormatError("is a TF2 object-based checkpoint; ws writes name-based (TF1 Saver) "
                          "entries, which tf.train.Checkpoint.restore would not see: replace its values "
                          "(replace_in_object_checkpoint, or ws import) or choose another prefix", path=prefix)
    return list(reader.entry_names)


def write_checkpoint(prefix: str, weights: Mapping[str, np.ndarray]) -> None:
    """Write ``weights`` as a name-based checkpoint at ``prefix``, merged with the one there.

    Entries already at ``prefix`` that ``weights`` does not name are kept byte for byte, even
    non-numeric ones.

    The write is crash-safe by the *index last* protocol
    (:class:`weightstore.io.commit.IndexLastCommit`, whose module holds the crash argument): data
    files under names the old index never reads, then ``.index`` renamed over the old one as
    the single commit point. A reader that opened the old ``.index`` just before the swap may
    find its data file gone: TensorFlow opens data files lazily.
    """
    tf = tensorflow("writing a TensorFlow checkpoint", prefix)
    tensors: dict[str, Any] = {}
    if os.path.exists(prefix + ".index"):
        checkpoint_names(prefix)  # refuses object-based checkpoints
        tensors = _old_entries(tf, prefix, keep=lambda name: name not in weights)
    for key, value in weights.items():
        tensors[key] = _as_tensor(tf, prefix, key, value)
    if not tensors:
        raise SelectionError("nothing to write", path=prefix)
    _commit(tf, prefix, tensors)


def replace_in_object_checkpoint(prefix: str, weights: Mapping[str, np.ndarray]) -> None:
    """Replace the values of variables of the TF2 object-based checkpoint at ``prefix``, in place.

    ``weights`` is keyed as ``ws ls`` lists the checkpoint (object-graph keys). Each value goes
    into the very entry its key reads (``.../.ATTRIBUTES/VARIABLE_VALUE``); the object graph
    and every other entry are kept byte for byte, so ``tf.train.Checkpoint.restore`` finds the
    new values where it looks. A key the checkpoint does not have is refused rather than
    added: the object graph would not reference it, and TF2 readers would silently ignore it.
    Everything is checked before anything is written; the write is :func:`write_checkpoint`'s
    crash-safe commit.
    """
    tf = tensorflow("writing a TensorFlow checkpoint", prefix)
    reader = CheckpointReader(prefix)
    reader.close()  # only the index is needed
    if not reader.object_based:
        raise FormatError("is a name-based (TF1 Saver) checkpoint, not a TF2 object-based one", path=prefix)
    present = set(reader.keys())
    unknown = [key for key in weights if key not in present]
    if unknown:
        lone = unknown[0] if len(unknown) == 1 else None  # the error's key, so not named again
        which = "such variable" if lone is not None else f"variable {named(unknown, shown=_SHOWN)}"
        raise SelectionError(f"the TF2 object-based checkpoint has no {which}; "
                             "tf.train.Checkpoint.restore ignores entries its object graph does not name, "
                             "so ws only replaces existing ones, under the names ws ls lists; model keys "
                             "(dense/kernel) go into a live model instead: tf2.assign, then the model's own "
                             "Checkpoint.write", path=prefix, key=lone)
    replaced: dict[str, np.ndarray] = {}
    for key, value in weights.items():
        array, info = np.asarray(value), reader.info(key)
        if tuple(array.shape) != tuple(info.shape) or str(array.dtype) != info.dtype:
            raise entry_changed(prefix, key, (info.dtype, info.shape), (str(array.dtype), array.shape))
        replaced[reader.entry_name(key)] = array
    tensors = _old_entries(tf, prefix, keep=lambda name: name not in replaced)
    for name, array in replaced.items():
        tensors[name] = _as_tensor(tf, prefix, name, array)
    _commit(tf, prefix, tensors)


def is_object_based(prefix: str) -> bool:
    """Whether the checkpoint at ``prefix`` is TF2 object-based (it records an object graph)."""
    reader = CheckpointReader(prefix)
    reader.close()  # only the index is needed
    return reader.object_based


def state_file_text(prefix: str) -> str:
    """The folder's ``checkpoint`` state file once ``prefix`` is recorded in it as the latest checkpoint.

    That file is how ``tf.train.latest_checkpoint`` and ``ws export folder/`` find a checkpoint
    in a folder. Paths already listed are kept and ``prefix`` moves to the end, as TF1's
    ``Saver`` does. A state file that is there but unreadable is refused here, before the
    caller writes anything.
    """
    folder, name = os.path.split(prefix)
    state = os.path.join(folder or ".", STATE_FILE)
    listed: tuple[str, ...] = ()
    if os.path.exists(state):  # refused here if oversized, not text, malformed or not a regular file
        listed = read_state_file(state).listed
    kept = [path for path in listed if path not in (name, prefix)]
    return CheckpointState(name, (*kept, name)).text()


def write_state_file(prefix: str, text: str) -> None:
    """Replace the ``checkpoint`` state file beside ``prefix`` with ``text``, atomically."""
    with RenameCommit(Path(os.path.dirname(prefix) or ".") / STATE_FILE).writing() as temporary:
        Path(temporary).write_text(text, encoding="utf-8")


def _old_entries(tf: Any, prefix: str, keep: Callable[[str], bool]) -> dict[str, Any]:
    """The entries of the checkpoint at ``prefix`` that ``keep`` accepts, as tensors of their own dtype."""
    old = tf.train.load_checkpoint(prefix)
    dtypes = old.get_variable_to_dtype_map()
    return {name: tf.constant(old.get_tensor(name), dtype=dtypes[name])
            for name in old.get_variable_to_shape_map() if keep(name)}


def _commit(tf: Any, prefix: str, tensors: Mapping[str, Any]) -> None:
    """Write ``tensors`` as the whole checkpoint at ``prefix``, index last (see :func:`write_checkpoint`)."""
    commit = IndexLastCommit(prefix, entries=len(tensors))
    try:
        with commit.writing() as temporary, tf.device("/cpu:0"):
            _save(tf, temporary, tensors, commit.shards)
    except tf.errors.OpError as exc:
        raise FormatError(f"TensorFlow could not write the checkpoint: {_write_cause(exc)}", path=prefix) from None


def _save(tf: Any, prefix: str, tensors: Mapping[str, Any], shards: int) -> None:
    """``SaveV2`` the tensors at ``prefix`` as ``shards`` data files (merged as a sharded Saver does)."""
    if shards == 1:
        tf.raw_ops.SaveV2(prefix=prefix, tensor_names=list(tensors), shape_and_slices=[""] * len(tensors),
                          tensors=list(tensors.values()))
        return
    names = list(tensors)
    parts = [f"{prefix}-part{i}" for i in range(shards)]
    for i, part in enumerate(parts):
        group = names[i::shards]
        tf.raw_ops.SaveV2(prefix=part, tensor_names=group, shape_and_slices=[""] * len(group),
                          tensors=[tensors[name] for name in group])
    tf.raw_ops.MergeV2Checkpoints(checkpoint_prefixes=parts, destination_prefix=prefix, delete_old_dirs=False)


def _as_tensor(tf: Any, prefix: str, key: str, value: Any) -> Any:
    array = np.asarray(value)
    try:
        return tf.constant(array)
    except (TypeError, ValueError):
        raise UnsupportedDTypeError(f"has dtype {array.dtype}, which TensorFlow checkpoints cannot hold",
                                    path=prefix, key=key) from None


def _write_cause(exc: BaseException) -> str:
    """What the file system said, of TensorFlow's ``{{function_node ...}} TEMPORARY; File too
    large [Op:SaveV2]``: the temporary it names is gone, and the op is TensorFlow's business."""
    line = re.sub(r"^\{\{.*?\}\}\s*|\s*\[Op:\w+\]$", "", _first_line(exc))
    return line.rpartition("; ")[2] or line


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
