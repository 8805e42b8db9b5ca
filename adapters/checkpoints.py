"""TensorFlow checkpoints and Keras weight files, read and written as weight dictionaries.

Every source is wrapped in the core's ``Reader`` protocol and handed out as a
:class:`Source` (a :class:`weightstore.Store`), so the ``ws`` command lists, diffs, exports
and imports a TF checkpoint exactly as it does an npz file and never branches on where
weights came from. TensorFlow is imported only when a TF checkpoint is opened or written:
Keras files are plain HDF5 (a ``.keras`` archive is a zip holding one) and are read by the
core's HDF5 reader without TensorFlow and without ever deserializing a model config.

Keys:
- TF1 ``Saver`` checkpoints: the variable names (``layer/w``, slots as ``layer/w/Adam``).
- TF2 object-based checkpoints: each variable's *best path* in the object graph that the
  checkpoint records (``_CHECKPOINTABLE_OBJECT_GRAPH``), segments being the local names of the
  edges from the root. TensorFlow writes each variable under the first path its own walk
  finds, so a Keras 3 model saved as ``tf.train.Checkpoint(model=m, optimizer=opt)`` keeps its
  kernels at ``optimizer/_trainable_variables/N``; weightstore instead looks at *every* path
  to a variable and picks, in order:
  1. one that passes through no optimizer-like object, where an object is optimizer-like
     when an edge named ``optimizer`` leads to it (at any depth: Keras models track their
     optimizer as ``model/optimizer`` too), when it owns slot variables (``tf.compat.v1`` and
     ``tf.keras`` 2 optimizers), or when it has a step counter child ``iter`` or
     ``_iterations`` (``tf.keras`` 2 and Keras 3 optimizers);
  2. then the shortest; 3. then the one with fewest edges into a catch-all variable list
  (``_variables``, ``variables``, ``_trainable_variables``, ``trainable_variables``), so a
  Keras 3 Adam's velocity reads ``optimizer/_velocities/0``, not ``optimizer/_variables/3``;
  4. then the first by comparing segments as strings.
  So model weights read ``model/_functional/_operations/1/_kernel`` (Sequential),
  ``model/_operations/1/bias`` (functional), ``model/encoder/_kernel`` (attributes of a
  subclassed model or ``tf.Module``), the same whether or not the optimizer was saved too
  (a compiled Keras model tracks it as ``model/optimizer``, so even a model-only checkpoint
  can hold its kernels at ``model/optimizer/_trainable_variables/N``). Keys come from
  structure only, so two checkpoints of one architecture have equal keys even when Keras
  numbered their layers differently (``dense_1`` vs ``dense_7``). Layer names are deliberately *not* used: the
  object graph does not record them, and the variables' recorded ``full_name`` is neither
  stable (auto-numbered ``sequential_1/dense_2/kernel``) nor unique (a subclassed model's
  layers may all record ``<model>/kernel``). The optimizer's own variables stay under it:
  ``optimizer/_iterations``, ``optimizer/_learning_rate``, ``optimizer/_momentums/N`` (Keras
  3 keeps its slots in lists parallel to ``optimizer/_trainable_variables``), so
  ``--exclude optimizer`` leaves exactly the model.
  Slot variables the object graph records as such (``tf.compat.v1`` / ``tf.keras`` 2
  optimizers) go under their variable's key: ``<variable>/.OPTIMIZER_SLOT/<optimizer>/<slot>``
  (``net/w/.OPTIMIZER_SLOT/opt/m``), TensorFlow's own layout, which names the optimizer so two
  never collide and ``--exclude '*/.OPTIMIZER_SLOT/*'`` drops them all.
  Entries that are not variables (the object graph, Python state, iterator state) and the
  checkpoint's own ``save_counter`` are left out. A checkpoint whose object graph cannot be
  read falls back to the entry names with ``/.ATTRIBUTES/VARIABLE_VALUE`` dropped.
- Keras and other plain HDF5 files: the dataset paths (``layers/dense/vars/0``), with the
  ``:0`` output suffix that legacy ``tf.keras`` files carry dropped.
Non-numeric entries (string variables) are skipped and named in :attr:`Source.skipped`.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import re
import shutil
import tempfile
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

import weightstore
from weightstore.errors import (
    FormatError,
    KeyNotInStoreError,
    MissingDependencyError,
    SelectionError,
    StoreNotFoundError,
    UnsafeFileError,
    UnsupportedDTypeError,
    WeightStoreError,
)
from weightstore.formats import format_for_suffix, format_named
from weightstore.keys import OUTPUT_SUFFIX, validate_key
from weightstore.manifest import TensorInfo, dtype_name, shape_nbytes
from weightstore.storage import fsync_folder, fsync_path, is_url, remove_stale_temporaries, temporary_beside
from weightstore.store import Store

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
VARIABLE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
KERAS_WEIGHTS_MEMBER = "model.weights.h5"
_SAVE_COUNTER = "save_counter" + VARIABLE_SUFFIX
_DATA_FILE = re.compile(r"\.data-\d{5}-of-\d{5}$")
_SHARD_COUNT = re.compile(r"\.data-\d{5}-of-(\d{5})$")
_MAX_DEFLATE_RATIO = 1032  # deflate's largest expansion (258-byte matches in 2 bits)
_silent = False


def silence_tensorflow() -> None:
    """Keep TensorFlow's start-up chatter off stderr, where the CLI promises one-line errors.

    Some of it is printed by native code before any logging setting applies, so the import
    itself runs with file descriptor 2 pointed at ``/dev/null``.
    """
    global _silent
    _silent = True
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def _tf():
    try:
        if not _silent:
            import tensorflow as tf
            return tf
        with _stderr_to_devnull():
            import tensorflow as tf
        return tf
    except ImportError:
        raise MissingDependencyError(
            "TensorFlow checkpoints need TensorFlow: pip install 'weightstore[tf]'"
        ) from None


@contextlib.contextmanager
def _stderr_to_devnull() -> Iterator[None]:
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class Source(Store):
    """A :class:`Store` over any weight source, with what the CLI needs to know about it."""

    def __init__(self, reader: Any, path: str, *, kind: str, skipped: list[str] | None = None, meta_graph: str | None = None):
        super().__init__(reader, path, verify=True)
        self.kind = kind
        self.skipped = skipped or []
        self._meta_graph = meta_graph

    def trainable_keys(self) -> set[str]:
        """Keys of the trainable variables, from a TF1 checkpoint's ``.meta`` graph.

        Only that graph records trainability: TF2 checkpoints, Keras files and stores do not.
        """
        if self._meta_graph is None:
            raise FormatError(f"{self.path}: --trainable-only needs a TF1 checkpoint with its .meta graph; "
                              f"a {self.kind} does not record which variables are trainable")
        if not os.path.exists(self._meta_graph):
            raise FormatError(f"{self.path}: --trainable-only needs the graph file {self._meta_graph}, "
                              "which is missing (save with Saver(write_meta_graph=True))")
        return _trainable_from_meta(self._meta_graph)


def open_source(path: str | os.PathLike) -> Source:
    """Open a store, a TF checkpoint (prefix, file of one, or folder) or a Keras weight file."""
    text = os.fspath(path)
    prefix = checkpoint_prefix(text)
    if prefix is not None:
        return _open_checkpoint(prefix)
    if os.path.isdir(text):
        raise StoreNotFoundError(f"{text}: folder holds no 'checkpoint' state file naming a checkpoint")
    if not is_url(text) and not os.path.exists(text):
        raise StoreNotFoundError(f"{text}: no such file or checkpoint")
    if text.endswith(".keras") or (format_for_suffix(text) is None and _is_keras_archive(text)):
        return _open_keras_archive(text)
    store = weightstore.open(text)
    if store.has_checksums:
        return Source(store._reader, store.path, kind="weightstore file")
    return _plain(store._reader, store.path)


def checkpoint_prefix(path: str) -> str | None:
    """The TF checkpoint prefix ``path`` names, or ``None`` when it names none.

    Accepts the prefix itself, one of its ``.index``/``.data-…``/``.meta`` files (what shell
    completion offers), or a folder whose ``checkpoint`` state file names the latest one.
    """
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "checkpoint")):
            return None
        latest = _tf().train.latest_checkpoint(path)
        if latest is None:
            raise StoreNotFoundError(f"{path}: its 'checkpoint' state file names no checkpoint that exists")
        return latest
    for suffix in (".index", ".meta"):
        if path.endswith(suffix) and os.path.exists(path[: -len(suffix)] + ".index"):
            return path[: -len(suffix)]
    data = _DATA_FILE.search(path)
    if data and os.path.exists(path[: data.start()] + ".index"):
        return path[: data.start()]
    return path if os.path.exists(path + ".index") else None


class CheckpointReader:
    """The core's Reader protocol over ``tf.train.load_checkpoint``; tensors read on demand."""

    has_checksums = False
    created = ""

    def __init__(self, prefix: str):
        tf = _tf()
        self.name = prefix
        try:
            self._reader = tf.train.load_checkpoint(prefix)
        except (tf.errors.OpError, ValueError) as exc:
            raise FormatError(f"{prefix}: not a readable TensorFlow checkpoint ({_first_line(exc)})") from None
        shapes = self._reader.get_variable_to_shape_map()
        dtypes = self._reader.get_variable_to_dtype_map()
        self.object_based = OBJECT_GRAPH_KEY in shapes
        self.metadata: dict[str, Any] = {}
        self.skipped: list[str] = []
        self._names: dict[str, str] = {}
        self._infos: dict[str, TensorInfo] = {}
        self._graph_keys = _object_graph_keys(self._reader) if self.object_based else {}
        for name in sorted(shapes):
            key = self._key_for(name)
            if key is None:
                continue
            try:
                validate_key(key)
                numpy_dtype = np.dtype(dtypes[name].as_numpy_dtype)
                logical = dtype_name(numpy_dtype, key)
            except (WeightStoreError, TypeError):
                self.skipped.append(name)
                continue
            shape = tuple(int(d) for d in shapes[name])
            if key in self._names:  # only when the object graph disagrees with itself
                key = name[: -len(VARIABLE_SUFFIX)] if self.object_based else name
                if key in self._names:
                    raise FormatError(f"{prefix}: entries {self._names[key]!r} and {name!r} both read as key {key!r}")
            self._names[key] = name
            self._infos[key] = TensorInfo(key, logical, shape, shape_nbytes(shape, numpy_dtype.itemsize))
        if self.object_based:  # keys, not entry names, in order: layers/2 before layers/10
            self._infos = {key: self._infos[key] for key in sorted(self._infos, key=_natural)}

    def _key_for(self, name: str) -> str | None:
        if not self.object_based:
            return name
        if name == _SAVE_COUNTER or not name.endswith(VARIABLE_SUFFIX):
            return None  # the object graph, Python/iterator state, the checkpoint's own counter
        return self._graph_keys.get(name) or name[: -len(VARIABLE_SUFFIX)]

    def keys(self) -> list[str]:
        return list(self._infos)

    def info(self, key: str) -> TensorInfo:
        try:
            return self._infos[key]
        except KeyError:
            raise KeyNotInStoreError(f"{self.name}: no tensor {key!r}") from None

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        info = self.info(key)
        try:
            array = np.asarray(self._reader.get_tensor(self._names[key]))
        except _tf().errors.OpError as exc:  # a data file missing, short, or failing its CRC-32C
            raise FormatError(f"{self.name}: tensor {key!r} is unreadable ({_first_line(exc)})") from None
        if array.shape != info.shape:
            raise FormatError(f"{self.name}: tensor {key!r} is {array.shape}, index says {info.shape}")
        return array

    def close(self) -> None:
        self._reader = None


_OPTIMIZER_EDGE = "optimizer"
_STEP_COUNTERS = frozenset({"iter", "_iterations"})
_CATCH_ALL_LISTS = frozenset({"_variables", "variables", "_trainable_variables", "trainable_variables"})


def _object_graph_keys(reader: Any) -> dict[str, str]:
    """Checkpoint entry name -> key for every variable the object graph names (module docstring).

    Empty when the graph cannot be read, so the caller falls back to the entry names.
    """
    _tf()
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    try:
        graph.ParseFromString(reader.get_tensor(OBJECT_GRAPH_KEY))
    except Exception:  # protobuf's DecodeError has no stable import path; TF raises its own errors
        return {}
    nodes = graph.nodes
    if not nodes:
        return {}
    best = _best_paths(nodes)
    node_keys = {node: "/".join(path) for node, path in best.items() if path}
    for optimizer_id, node in enumerate(nodes):  # slots go under their variable
        optimizer_key = node_keys.get(optimizer_id)
        for slot in node.slot_variables:
            variable_key = node_keys.get(slot.original_variable_node_id)
            if optimizer_key and variable_key and slot.slot_variable_node_id < len(nodes):
                node_keys.setdefault(slot.slot_variable_node_id,
                                     f"{variable_key}/.OPTIMIZER_SLOT/{optimizer_key}/{slot.slot_name}")
    keys: dict[str, str] = {}
    for node_id, key in node_keys.items():
        for attribute in nodes[node_id].attributes:
            if attribute.name == "VARIABLE_VALUE" and attribute.checkpoint_key.endswith(VARIABLE_SUFFIX):
                keys[attribute.checkpoint_key] = key
    return keys


def _best_paths(nodes: Any) -> dict[int, tuple[str, ...]]:
    """Node id -> its best path from the root, the least by (through an optimizer-like node,
    length, edges into catch-all lists, segments).

    A Dijkstra walk: extending two paths by one edge keeps their order, so the first time a
    node is taken off the heap its path is the best of all paths to it.
    """
    optimizer_like = {
        node_id for node_id, node in enumerate(nodes)
        if node.slot_variables or any(child.local_name in _STEP_COUNTERS for child in node.children)
    }
    optimizer_like.update(child.node_id for node in nodes for child in node.children
                          if child.local_name == _OPTIMIZER_EDGE)
    optimizer_like.discard(0)
    best: dict[int, tuple[str, ...]] = {}
    heap: list[tuple[bool, int, int, tuple[str, ...], int]] = [(False, 0, 0, (), 0)]
    while heap:
        through_optimizer, length, catch_all, path, node_id = heapq.heappop(heap)
        if node_id in best:
            continue
        best[node_id] = path
        for child in nodes[node_id].children:
            if child.node_id not in best and 0 <= child.node_id < len(nodes):
                flag = through_optimizer or child.node_id in optimizer_like
                lists = catch_all + (child.local_name in _CATCH_ALL_LISTS)
                heapq.heappush(heap, (flag, length + 1, lists, (*path, child.local_name), child.node_id))
    return best


def _natural(key: str) -> list[tuple[int, Any]]:
    return [(0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", key)]


def _open_checkpoint(prefix: str) -> Source:
    reader = CheckpointReader(prefix)
    kind = "TF2 object-based checkpoint" if reader.object_based else "TF1 checkpoint"
    meta = None if reader.object_based else prefix + ".meta"
    return Source(reader, prefix, kind=kind, skipped=reader.skipped, meta_graph=meta)


def _trainable_from_meta(meta_path: str) -> set[str]:
    """Checkpoint names of the variables in a MetaGraphDef's trainable collection.

    A partitioned variable lists each part (``w/part_0:0``); the checkpoint holds it whole
    under ``save_slice_info_def.full_name``.
    """
    _tf()
    from tensorflow.core.framework import variable_pb2
    from tensorflow.core.protobuf import meta_graph_pb2

    graph = meta_graph_pb2.MetaGraphDef()
    try:
        graph.ParseFromString(Path(meta_path).read_bytes())
    except Exception as exc:  # protobuf's DecodeError has no stable import path
        raise FormatError(f"{meta_path}: not a readable MetaGraphDef ({exc})") from None
    names = set()
    for raw in graph.collection_def["trainable_variables"].bytes_list.value:
        variable = variable_pb2.VariableDef.FromString(raw)
        full = variable.save_slice_info_def.full_name
        names.add(full or OUTPUT_SUFFIX.sub("", variable.variable_name))
    return names


class _RenamedReader:
    """A reader seen through new key names (``dense/kernel:0`` read as ``dense/kernel``)."""

    def __init__(self, reader: Any, names: dict[str, str], cleanup=None):
        self._reader = reader
        self._names = names
        self._cleanup = cleanup
        self.metadata = reader.metadata
        self.created = reader.created
        self.has_checksums = reader.has_checksums

    def keys(self) -> list[str]:
        return list(self._names)

    def _old(self, key: str) -> str:
        try:
            return self._names[key]
        except KeyError:
            raise KeyNotInStoreError(f"no tensor {key!r}") from None

    def info(self, key: str) -> TensorInfo:
        info = self._reader.info(self._old(key))
        return TensorInfo(key, info.dtype, info.shape, info.nbytes, info.checksum)

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        return self._reader.read(self._old(key), verify=verify)

    def close(self) -> None:
        try:
            self._reader.close()
        finally:
            if self._cleanup is not None:
                self._cleanup()


def _plain(reader: Any, path: str, cleanup=None) -> Source:
    """A file without a manifest (Keras ``.weights.h5``, ``np.savez``) with ``:0`` suffixes dropped."""
    names: dict[str, str] = {}
    skipped = []
    for old in reader.keys():
        new = OUTPUT_SUFFIX.sub("", old)
        try:
            validate_key(new)
        except WeightStoreError:
            skipped.append(old)
            continue
        if new in names:
            raise FormatError(f"{path}: datasets {names[new]!r} and {old!r} both read as key {new!r}")
        names[new] = old
    keras = path.endswith((".weights.h5", ".keras"))
    kind = "Keras weights file" if keras else "file without a weightstore manifest"
    return Source(_RenamedReader(reader, names, cleanup), path, kind=kind, skipped=skipped)


def _is_keras_archive(path: str) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return KERAS_WEIGHTS_MEMBER in archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def _open_keras_archive(path: str) -> Source:
    """The weights of a ``.keras`` zip: its ``model.weights.h5`` copied out and read as HDF5.

    The config is never read, let alone deserialized: only the weights file is touched.
    """
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise StoreNotFoundError(f"{path}: no such file") from None
    except zipfile.BadZipFile:
        raise FormatError(f"{path}: not a .keras archive (not a zip file)") from None
    scratch = tempfile.mkdtemp(prefix="weightstore-keras-")
    try:
        with archive:
            if KERAS_WEIGHTS_MEMBER not in archive.namelist():
                raise FormatError(f"{path}: .keras archive holds no {KERAS_WEIGHTS_MEMBER}")
            info = archive.getinfo(KERAS_WEIGHTS_MEMBER)
            _refuse_bomb(path, info, os.path.getsize(path))
            local = os.path.join(scratch, KERAS_WEIGHTS_MEMBER)
            with archive.open(info) as member, open(local, "wb") as out:
                left = info.file_size
                while chunk := member.read(min(16 << 20, left + 1)):
                    if len(chunk) > left:
                        raise UnsafeFileError(f"{path}: {KERAS_WEIGHTS_MEMBER} inflates past its declared "
                                              f"{info.file_size} bytes")
                    out.write(chunk)
                    left -= len(chunk)
                if left:
                    raise FormatError(f"{path}: corrupt .keras archive ({KERAS_WEIGHTS_MEMBER} ends "
                                      f"{left} bytes short of its declared size)")
        reader = format_named("hdf5").open_reader(local, f"{path}:{KERAS_WEIGHTS_MEMBER}")
    except (zipfile.BadZipFile, EOFError, zlib.error) as exc:
        shutil.rmtree(scratch, ignore_errors=True)
        raise FormatError(f"{path}: corrupt .keras archive ({exc})") from None
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return _plain(reader, path, cleanup=lambda: shutil.rmtree(scratch, ignore_errors=True))


def _refuse_bomb(path: str, info: zipfile.ZipInfo, archive_size: int) -> None:
    """Refuse, before inflating a byte, a weights member that could not honestly be that big.

    Deflate expands at most about 1032 to 1, so a larger declared size is a zip bomb (or a
    lie about the size); stored members must declare equal sizes. Members other than stored
    or deflated (bzip2, lzma reach far higher ratios) and encrypted ones are refused too.
    """
    where = f"{path}: {KERAS_WEIGHTS_MEMBER}"
    if info.flag_bits & 0x1:
        raise UnsafeFileError(f"{where} is encrypted")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise UnsafeFileError(f"{where} uses compression method {info.compress_type}; only stored and deflate are read")
    if info.compress_size > archive_size:
        raise FormatError(f"{where} declares {info.compress_size} compressed bytes in a {archive_size}-byte archive")
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        raise UnsafeFileError(f"{where} is stored but declares {info.file_size} bytes in {info.compress_size}")
    if info.file_size > _MAX_DEFLATE_RATIO * info.compress_size or info.file_size > _MAX_DEFLATE_RATIO * archive_size:
        raise UnsafeFileError(f"{where} declares {info.file_size} bytes from {info.compress_size} compressed, "
                              f"more than deflate can expand ({_MAX_DEFLATE_RATIO}x): a zip bomb")


def checkpoint_names(prefix: str) -> list[str]:
    """The entries of the name-based checkpoint at ``prefix``; empty when there is none.

    Refuses a TF2 object-based checkpoint: entries merged into one would be invisible to
    ``tf.train.Checkpoint.restore``, which finds variables through the object graph.
    """
    if not os.path.exists(prefix + ".index"):
        return []
    reader = CheckpointReader(prefix)
    if reader.object_based:
        raise FormatError(f"{prefix}: is a TF2 object-based checkpoint; ws writes name-based (TF1 Saver) "
                          "checkpoints, so choose another prefix")
    return list(reader._reader.get_variable_to_shape_map())


def write_checkpoint(prefix: str, weights: Mapping[str, np.ndarray]) -> None:
    """Write ``weights`` as a name-based checkpoint at ``prefix``, merged with the one there.

    Entries already at ``prefix`` that ``weights`` does not name are kept byte for byte, even
    non-numeric ones.

    A TF checkpoint is two kinds of file whose names TensorFlow fixes: ``PREFIX.index`` and
    ``PREFIX.data-NNNNN-of-MMMMM``, where ``MMMMM`` is the shard count the index records. So
    the new checkpoint is written with a shard count that no data file at ``prefix`` has
    (one shard, or two when the old checkpoint has one): its data files then take names the
    old index never reads. Everything is written under a temporary prefix beside the target
    and fsynced, the data files are renamed in beside the old ones, and renaming ``.index``
    over the old one is the single commit point. A crash before it leaves the old checkpoint
    whole (plus unreferenced data files); a crash after it leaves the new one whole (plus
    the old data files). Either leftover, and temporaries of writers that were killed
    (``.NAME.wstmp-PID-…``), are removed by the next write to ``prefix``.

    The one exception: when no unused shard count is small enough for the entries (a single
    entry replacing a one-shard checkpoint, or a checkpoint of a few entries while a crashed
    write's data files are still beside the live ones), the data is written as one shard and
    renamed over the old one before ``.index``;
    a crash between those two renames leaves the old index over the new data, which
    TensorFlow refuses to read (each entry's CRC-32C no longer matches) rather than returning
    wrong values. A reader that opened the old ``.index`` just before the swap may find its
    data file gone: TensorFlow opens data files lazily.
    """
    tf = _tf()
    target = Path(prefix)
    if not target.parent.is_dir():
        raise StoreNotFoundError(f"{prefix}: folder {str(target.parent)!r} does not exist")
    remove_stale_temporaries(target, r"(?:-part\d+)?(?:\.index|\.data-\d{5}-of-\d{5})?")
    tensors: dict[str, Any] = {}
    if os.path.exists(prefix + ".index"):
        checkpoint_names(prefix)  # refuses object-based checkpoints
        old = tf.train.load_checkpoint(prefix)
        for name in old.get_variable_to_shape_map():
            if name not in weights:
                tensors[name] = tf.constant(old.get_tensor(name), dtype=old.get_variable_to_dtype_map()[name])
    for key, value in weights.items():
        tensors[key] = _as_tensor(tf, prefix, key, value)
    if not tensors:
        raise SelectionError(f"{prefix}: nothing to write")
    taken = {int(match.group(1)) for path in _files_of(prefix) if (match := _SHARD_COUNT.search(path))}
    shards = next(n for n in range(1, len(taken) + 2) if n not in taken)
    fresh_names = shards <= len(tensors)
    if not fresh_names:
        shards = 1  # the single-entry case of the docstring: data renamed over the old data
    temporary = str(temporary_beside(target))
    moved: list[str] = []
    try:
        with tf.device("/cpu:0"):
            _save(tf, temporary, tensors, shards)
        written = _files_of(temporary)
        for path in written:
            fsync_path(path)
        for path in written:
            if not path.endswith(".index"):
                os.replace(path, prefix + path[len(temporary):])
                moved.append(prefix + path[len(temporary):])
        fsync_folder(target.parent)
        os.replace(temporary + ".index", prefix + ".index")  # the commit point
    except BaseException as exc:
        for path in _files_of(temporary) + [p for i in range(shards) for p in _files_of(f"{temporary}-part{i}")]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if fresh_names:  # data files the old index never names
            for path in moved:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        if isinstance(exc, tf.errors.OpError):
            raise FormatError(f"{prefix}: TensorFlow could not write the checkpoint ({_first_line(exc)})") from None
        raise
    kept = {prefix + path[len(temporary):] for path in written}
    for stale in _files_of(prefix):
        if _DATA_FILE.search(stale) and stale not in kept:
            os.unlink(stale)
    fsync_folder(target.parent)


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
        raise UnsupportedDTypeError(
            f"{prefix}: tensor {key!r} has dtype {array.dtype}, which TensorFlow checkpoints cannot hold"
        ) from None


def _files_of(prefix: str) -> list[str]:
    folder, base = os.path.split(prefix)
    with contextlib.suppress(FileNotFoundError):
        return [os.path.join(folder, name) for name in os.listdir(folder or ".")
                if name == base + ".index" or (name.startswith(base + ".data-") and _DATA_FILE.search(name))]
    return []




def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
