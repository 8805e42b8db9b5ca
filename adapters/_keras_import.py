"""``ws import`` into a Keras file: replace the tensors Keras reads, or refuse saying why.

Keras's ``load_weights`` reads a ``.weights.h5`` (or a ``.keras`` archive's ``model.weights.h5``)
by the paths its save walk gives each layer (``layers/dense/vars/0``), and nothing else: a
weight store merged into that file under other names (``dense/kernel``) would be a second,
unread copy. So an import into a Keras file replaces datasets in place of the same path, shape
and a dtype that holds the value exactly, and refuses any other name, listing the file's own.
A ``.keras`` archive keyed like its model (``dense/kernel``, as ``ws ls`` lists it) takes those
keys too, each written at the path Keras reads it from.
The new file replaces the old by rename (:class:`~weightstore.io.commit.RenameCommit`): a
reader sees the old file or the new one.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator, Mapping

import numpy as np

import weightstore
from weightstore.adapters._casts import describe, widens
from weightstore.adapters.plan import OPTIMIZER_SCOPE, OPTIMIZER_STATE
from weightstore.core.keys import in_scope, join_scope, normalize_scope, strip_scope, suggest, unmatched_scope
from weightstore.core.manifest import logical_dtype
from weightstore.errors import FormatError, KeyNotInStoreError, SelectionError, naming, shown_key
from weightstore.formats import keras_file
from weightstore.formats._keras_naming import as_own_root, pairs
from weightstore.io.commit import RenameCommit

__all__ = ["is_keras_target", "replace_in_keras_file"]



def is_keras_target(path: str) -> bool:
    """Whether ``path`` is an existing Keras file (``.weights.h5`` or ``.keras``)."""
    return os.path.isfile(path) and (path.endswith(keras_file.WEIGHTS_SUFFIX) or keras_file.is_keras_archive(path))


def replace_in_keras_file(target: str, weights: Mapping[str, np.ndarray], *, scope: str | None = None) -> None:
    """Replace the tensors ``weights`` names in the Keras file ``target``, all or none.

    ``scope``: the one the import put the keys under. A part's own file (one member of an
    ensemble, numbered from itself: ``sequential/dense``) goes where the archive's model numbers
    that part (``sequential_1/dense_3``), where all its keys pair so and not all as they are."""
    converted = _checked(target, _as_the_whole_numbers(target, weights, scope))
    with RenameCommit(target).writing() as temporary:
        if target.endswith(keras_file.WEIGHTS_SUFFIX):
            shutil.copyfile(target, temporary)
            _write_datasets(temporary, converted)
        else:
            _rewrite_archive(target, temporary, converted)


def _as_the_whole_numbers(target: str, weights: Mapping[str, np.ndarray], scope: str | None) -> Mapping[str, np.ndarray]:
    """``weights`` keyed under ``scope`` as the archive's model keys that part, where every key
    pairs so, by name and shape, and not every one as it is (see :func:`replace_in_keras_file`);
    else as they are. The renumbering ranks the archive's own keys of the part, all of them, so
    some of the part's keys pair one by one (:func:`pairs`, not whole). Where both readings pair
    and differ, the import is refused naming both: the member's own ``dense_1`` is the archive's
    ``dense_1`` as it is and its ``dense_2`` renumbered, and which was meant is not ours to guess."""
    at = normalize_scope(scope)
    if not at:
        return weights
    with weightstore.open(target) as store:
        if not store.stored_names():  # the file's own names (layers/dense/vars/0): never renumbered
            return weights
        shapes = {key: tuple(store.info(key).shape) for key in store}
    if not any(in_scope(key, at) and key != at for key in shapes):  # a typo: say so, not which tensor is nearest
        with naming(path=target):
            raise unmatched_scope(at, list(shapes))
    own = {join_scope(at, part): join_scope(at, whole) for whole, part in
           as_own_root(strip_scope(key, at) for key in shapes if in_scope(key, at) and key != at).items()}
    layers = [key for key in weights if not OPTIMIZER_STATE.search(key)]  # state: refused by _checked, saying why
    as_is = pairs(((key, np.shape(weights[key])) for key in layers), shapes, whole=False)
    renumbered = pairs(((own.get(key, key), np.shape(weights[key])) for key in layers), shapes, whole=False)
    moved = next((key for key in layers if key in own), None)
    if moved is None or not renumbered:
        return weights
    if as_is:
        raise SelectionError(
            f"the import's keys pair both as they are and as {shown_key(at)} numbers its own layers, where this "
            f"key is {shown_key(own[moved])}: which tensor is meant is ambiguous; import all of the part's "
            f"tensors, which pair one way only, or without --scope under the archive's keys (`ws ls {target}`)",
            path=target, key=moved)
    return {own.get(key, key): value for key, value in weights.items()}


def _checked(target: str, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every value as the dtype its dataset has, after checking name, shape and dtype; nothing written yet."""
    with weightstore.open(target) as store:
        names = store.keys()
        stored = store.stored_names()  # a .keras archive's model keys (dense/kernel) -> the names Keras reads
        model_key_of = {name: key for key, name in stored.items()}
        converted = {}
        given_as: dict[str, str] = {}  # the file's own name -> the import's key for it
        for given, value in weights.items():
            key = given if given in names else model_key_of.get(given, given)  # layers/dense/vars/0 -> dense/kernel
            if key not in names:
                also = f", or the model keys `ws ls {target}` lists" if stored else ""
                hint = ("; it is a source's optimizer state, which has no place there: leave it out with --exclude "
                        f"'{OPTIMIZER_SCOPE}/*'" if OPTIMIZER_STATE.search(key) else suggest(key, names))
                raise KeyNotInStoreError(
                    f"is a Keras file, which Keras reads by its own tensor names only (layers/<layer>/vars/<i>{also}), "
                    f"and has no such tensor{hint}; import a store with the file's names "
                    f"(`ws export {target} -o names.npz` writes them), or assign in Python and save again: "
                    f"tf2.assign(model, weights); model.save_weights(...)", path=target, key=key)
            info = store.info(key)
            with naming(path=target):
                dtype = logical_dtype(info.dtype)
            array = np.asarray(value)
            if tuple(array.shape) != tuple(info.shape) or not widens(array.dtype, dtype):
                raise FormatError(f"holds {describe(dtype, tuple(info.shape))}; the import gives "
                                  f"{describe(array.dtype, array.shape)}, which Keras could not load in its place",
                                  path=target, key=key)
            name = stored.get(key, key)
            if name in given_as:  # both spellings of one tensor: which the import meant is not ours to guess
                raise SelectionError(f"the import gives this tensor twice, as {shown_key(given_as[name])} and as "
                                     f"{shown_key(given)}; keep one", path=target, key=key)
            given_as[name] = given
            converted[name] = array.astype(dtype, copy=False)
    return converted


def _write_datasets(path: str, weights: Mapping[str, np.ndarray]) -> None:
    import h5py

    with h5py.File(path, "r+") as file:
        for key, value in weights.items():
            file[key][...] = value


def _rewrite_archive(target: str, temporary: str, weights: Mapping[str, np.ndarray]) -> None:
    """A copy of the ``.keras`` archive with its weights member rewritten, every other member as it was."""
    with _scratch() as scratch, zipfile.ZipFile(target) as old, zipfile.ZipFile(temporary, "w") as new:
        size = os.path.getsize(target)
        for info in old.infolist():
            keras_file.refuse_bomb(target, info, size)
            if info.filename != keras_file.WEIGHTS_MEMBER:
                with old.open(info) as source, new.open(info, "w") as sink:
                    shutil.copyfileobj(source, sink)
                continue
            local = os.path.join(scratch, keras_file.WEIGHTS_MEMBER)
            with old.open(info) as source, open(local, "wb") as sink:
                shutil.copyfileobj(source, sink)
            _write_datasets(local, weights)
            new.write(local, info.filename, compress_type=info.compress_type)


@contextlib.contextmanager
def _scratch() -> Iterator[str]:
    folder = tempfile.mkdtemp(prefix="weightstore-keras-import-")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
