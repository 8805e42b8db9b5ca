"""TensorFlow checkpoints (TF1 ``Saver`` and TF2 object-based) read lazily, without TensorFlow.

A checkpoint is a *tensor bundle* (``tensorflow/core/util/tensor_bundle``): ``PREFIX.index``,
an SSTable (:mod:`weightstore.formats._sstable`) mapping each tensor name to a
``BundleEntryProto`` (dtype, shape, data shard, offset, size, masked CRC-32C of the bytes),
with a ``BundleHeaderProto`` under the empty name; and ``PREFIX.data-NNNNN-of-MMMMM``, the
shards holding the raw little-endian bytes. Opening reads and checks the index only; each
tensor is a view of its memory-mapped shard, its CRC-32C verified when read with
``verify=True``. A variable saved in slices (TF1 partitioned variables) has an entry with
the full shape and a list of slices, each stored under the key
``checkpoint::EncodeTensorNameSlice`` makes (TensorFlow's ``OrderedCode``); it is read as
one tensor, joined from its slices, which must tile it exactly.

Keys:
- TF1 ``Saver`` checkpoints: the variable names (``layer/w``, slots as ``layer/w/Adam``), empty segments
  dropped as the TF1 adapter drops them (``model_001//conv/w`` reads ``model_001/conv/w``).
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
  subclassed model or ``tf.Module``), the same whether or not the optimizer was saved too.
  Keys come from structure only, so two checkpoints of one architecture have equal keys even
  when Keras numbered their layers differently (``dense_1`` vs ``dense_7``); layer names are
  deliberately *not* used (the object graph does not record them, and the variables'
  ``full_name`` is neither stable nor unique). The optimizer's own variables stay under it
  (``optimizer/_iterations``, ``optimizer/_momentums/N``), so ``--exclude optimizer`` leaves
  exactly the model. Slot variables the object graph records as such (``tf.compat.v1`` /
  ``tf.keras`` 2 optimizers) go under their variable's key:
  ``<variable>/.OPTIMIZER_SLOT/<optimizer>/<slot>``, TensorFlow's own layout.
  Entries that are not variables (the object graph, Python state, iterator state) and the
  checkpoint's own ``save_counter`` are left out. A checkpoint whose object graph cannot be
  read falls back to the entry names with ``/.ATTRIBUTES/VARIABLE_VALUE`` dropped.
Non-numeric entries (string variables, resources, quantized types) are skipped and listed in
:attr:`CheckpointReader.skipped`.

Every size in the index is hostile until checked: entries must lie inside their data file
and not overlap, shapes must need exactly the bytes an entry says, names must be UTF-8 and
unique; nothing is allocated that the files do not back.
"""

from __future__ import annotations

import codecs
import heapq
import itertools
import math
import os
import re
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightstore.core._tensortable import fits_an_array
from weightstore.core.keys import from_tf_name, validate_key
from weightstore.core.limits import (
    MAX_NDIM,
    MAX_TF_GRID_CELLS_PER_SLICE,
    MAX_TF_INDEX_BYTES,
    MAX_TF_SHARDS,
    MAX_TF_SLICES,
    MAX_TF_STATE_FILE_BYTES,
    TF_PATH_UNITS_PER_BYTE,
    TF_PATH_UNITS_SLACK,
)
from weightstore.core.manifest import ML_DTYPES, TensorInfo, dtype_name
from weightstore.errors import (
    ChecksumError,
    FileAccessError,
    FormatError,
    InvalidKeyError,
    KeyNotInStoreError,
    StoreNotFoundError,
    TargetError,
    UnsafeFileError,
    attach,
    short_repr,
)
from weightstore.formats import Format, ReaderDefaults
from weightstore.formats._pointer import LATEST, local_latest_name, published_folder_message
from weightstore.formats._sstable import Table, crc32c, read_varint, unmask_crc
from weightstore.io._local import MappedFile
from weightstore.io.files import open_regular, unreadable
from weightstore.io.folders import LocalFolder
from weightstore.io.places import Place

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
VARIABLE_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"
STATE_FILE = "checkpoint"
KIND_TF1 = "TF1 checkpoint"
KIND_TF2 = "TF2 object-based checkpoint"

_SAVE_COUNTER = "save_counter" + VARIABLE_SUFFIX
_DATA_FILE = re.compile(r"\.data-[0-9]{5}-of-[0-9]{5}\Z")
_DT_STRING = 7
#: TensorFlow's ``DataType`` numbers (``types.proto``) -> numpy dtype, for every numeric kind
#: numpy or ml_dtypes can hold byte for byte (TF keeps int4 and int2 one per byte, as ml_dtypes
#: does); the rest (strings, resources, variants, quantized types) are skipped. See :func:`_dtype_of`.
_DTYPES: dict[int, np.dtype] = {
    number: np.dtype(kind) for number, kind in {
        1: "<f4", 2: "<f8", 3: "<i4", 4: "u1", 5: "<i2", 6: "i1", 8: "<c8", 9: "<i8", 10: "?",
        17: "<u2", 18: "<c16", 19: "<f2", 22: "<u4", 23: "<u8",
    }.items()
}
#: ... and the ml_dtypes kinds', by name: ml_dtypes is imported only for a checkpoint that holds one
_ML_DTYPE_NAMES = {
    14: "bfloat16", 24: "float8_e5m2", 25: "float8_e4m3fn", 26: "float8_e4m3fnuz",
    27: "float8_e4m3b11fnuz", 28: "float8_e5m2fnuz", 29: "int4", 30: "uint4", 31: "int2", 32: "uint2",
}


def _dtype_of(number: int) -> np.dtype | None:
    """The dtype of TF's ``DataType`` number; ``None`` for a kind weightstore skips (or that the
    installed ml_dtypes lacks)."""
    dtype = _DTYPES.get(number)
    if dtype is None and number in _ML_DTYPE_NAMES:
        return ML_DTYPES.get(_ML_DTYPE_NAMES[number])
    return dtype


# --- finding the checkpoint a path names -------------------------------------------------

SAVED_MODEL_FILE = "saved_model.pb"
SAVED_MODEL_VARIABLES = os.path.join("variables", "variables")


def resolve_prefix(path: str) -> str | None:
    """The checkpoint prefix ``path`` names, or ``None`` when it names no checkpoint.

    Accepts the prefix itself, one of its ``.index``/``.data-…``/``.meta`` files (what shell
    completion offers), or a folder: a SavedModel's variables (:func:`saved_model_prefix`), the
    checkpoint its ``checkpoint`` state file names (in the folder: a name elsewhere is taken as
    the folder's own file of that name, as a moved folder needs, so the file sends no read
    outside the folder),
    or the only one in it. A folder that holds several but no state file is refused with the
    candidates listed, as is one whose state file names a checkpoint that is not there.
    """
    if os.path.isdir(path):
        return _prefix_in_folder(path)
    # lexists: an index that is a link loop or a dangling link is this checkpoint's, and its
    # reader says which, rather than "no such file" for a prefix whose .index is right there
    for suffix in (".index", ".meta"):
        if path.endswith(suffix) and os.path.lexists(path[: -len(suffix)] + ".index"):
            return path[: -len(suffix)]
    data = _DATA_FILE.search(path)
    if data and os.path.lexists(path[: data.start()] + ".index"):
        return path[: data.start()]
    return path if os.path.lexists(path + ".index") else None


def _inside(path: str, folder: str) -> bool:
    """Whether ``path``, symlinks resolved, lies in ``folder``."""
    return os.path.realpath(path).startswith(os.path.join(os.path.realpath(folder), ""))


def _prefix_in_folder(folder: str) -> str:
    saved_model = saved_model_prefix(folder)
    if saved_model is not None:
        return saved_model
    state = os.path.join(folder, STATE_FILE)
    if os.path.isfile(state):
        named = read_state_file(state).latest
        prefix = os.path.join(folder, named)  # an absolute name stays as it is
        if not _inside(prefix, folder) or not os.path.exists(prefix + ".index"):
            # the folder was moved or copied, or the file names one elsewhere: this folder's is read
            prefix = os.path.join(folder, os.path.basename(named))
            if not os.path.exists(prefix + ".index"):
                raise StoreNotFoundError(f"its '{STATE_FILE}' state file names checkpoint {named!r}, which is not "
                                         f"in the folder{_candidates_hint(folder)}", path=folder)
        return prefix
    candidates = checkpoints_in(folder)
    if len(candidates) == 1:
        return os.path.join(folder, candidates[0])
    versions = serving_versions(folder)
    if not candidates and versions:
        raise StoreNotFoundError(f"is a TF Serving model base (SavedModel versions {', '.join(map(str, versions))}), "
                                 f"not one model; name a version's folder, such as {os.path.join(folder, str(versions[-1]))}",
                                 path=folder)
    if not candidates and not versions:
        _refuse_published_folder(folder)
    if not candidates and any(os.path.exists(os.path.join(folder, name)) for name in _ORBAX_MARKS):
        raise StoreNotFoundError("is an Orbax checkpoint (Flax's and JAX's saver), which weightstore does not read: "
                                 "restore it with Orbax into the model (nnx.update(model, restored)), then write "
                                 "ws.save('m.npz', flax.export(model))", path=folder)
    if not candidates and is_empty_folder(folder):
        raise StoreNotFoundError("is an empty folder, not a weight file", path=folder)
    if not candidates:
        raise StoreNotFoundError(f"is a folder, not a weight file, and holds no TF checkpoint (no '{STATE_FILE}' "
                                 "state file, no .index file)", path=folder)
    raise StoreNotFoundError(f"holds {len(candidates)} checkpoints and no '{STATE_FILE}' state file saying which to "
                             f"read; name one of: {', '.join(candidates)}", path=folder)


def is_empty_folder(folder: str) -> bool:
    """Whether ``folder`` is a local folder holding nothing; False where it is none or cannot be
    listed (no permission to read it), which is then refused by what it lacks."""
    try:
        with os.scandir(folder) as entries:
            return next(entries, None) is None
    except OSError:
        return False


#: what an Orbax checkpoint's folder holds (``StandardCheckpointer().save``, a ``CheckpointManager``'s step)
_ORBAX_MARKS = ("_CHECKPOINT_METADATA", "manifest.ocdbt", "_METADATA")


def _refuse_published_folder(folder: str) -> None:
    """A folder ``ws.publish`` writes holds versions, not one file: name one, rather than "no TF checkpoint".

    A ``LATEST`` that is no file (a FIFO, a socket) still marks such a folder; it is never
    opened (a FIFO would block the read), and the message then names no version. Nor is the
    version it names suggested where that is no file (a symbolic link): what holds it is said."""
    pointer = os.path.join(folder, LATEST)
    if not os.path.lexists(pointer) or os.path.isdir(pointer):
        return
    latest = local_latest_name(folder) if os.path.isfile(pointer) else None  # None for a damaged LATEST too
    if latest is not None and not os.path.lexists(os.path.join(folder, latest)):
        latest = None  # removed since it was published: suggested, it would send the user to "no such file"
    held_by = None if latest is None else LocalFolder(folder).not_files().get(latest)
    raise StoreNotFoundError(published_folder_message(folder, latest, held_by), path=folder)


def saved_model_prefix(folder: str) -> str | None:
    """The variables checkpoint of the SavedModel in ``folder``, or None when it is not one.

    ``tf.saved_model.save`` and Keras's ``model.export`` write ``saved_model.pb`` beside a
    ``variables/`` folder holding a TF2 object checkpoint with the prefix ``variables``: the
    weights are that checkpoint, read like any other (without TensorFlow).
    """
    prefix = os.path.join(folder, SAVED_MODEL_VARIABLES)
    if os.path.isfile(os.path.join(folder, SAVED_MODEL_FILE)) and os.path.exists(prefix + ".index"):
        return prefix
    return None


#: a TF Serving version folder's name: ASCII digits that fit its int64 version numbers (``str.isdigit``
#: takes ``²``, which ``int`` refuses, and ``int`` refuses names past 4,300 digits); others it skips, as here
_SERVING_VERSION = re.compile(r"[0-9]{1,18}")


def serving_versions(folder: str) -> list[int]:
    """The versions of a TF Serving model base (``base/1/``, ``base/2/``: numbered SavedModel folders), oldest first."""
    try:
        entries = [entry for entry in os.scandir(folder) if _SERVING_VERSION.fullmatch(entry.name) and entry.is_dir()]
    except OSError:
        return []
    return sorted(int(entry.name) for entry in entries if saved_model_prefix(entry.path) is not None)


def checkpoints_in(folder: str) -> list[str]:
    """Names of the checkpoint prefixes in ``folder`` (those with an ``.index``), oldest step first."""
    try:
        names = [entry.name[: -len(".index")] for entry in os.scandir(folder)
                 if entry.name.endswith(".index") and not entry.name.startswith(".")]
    except OSError:
        return []
    return sorted(names, key=natural_order)


def _candidates_hint(folder: str) -> str:
    candidates = checkpoints_in(folder)
    return f"; the folder holds: {', '.join(candidates)}" if candidates else ""


@dataclass(frozen=True)
class CheckpointState:
    """A ``checkpoint`` state file: the latest checkpoint's path, and every path it lists."""

    latest: str
    listed: tuple[str, ...]

    def text(self) -> str:
        """The file as TensorFlow writes it (``CheckpointState`` text proto), paths escaped."""
        lines = [f'model_checkpoint_path: "{_escaped(self.latest)}"']
        lines += [f'all_model_checkpoint_paths: "{_escaped(path)}"' for path in self.listed]
        return "\n".join(lines) + "\n"


_STATE_FIELD = r'^\s*{}\s*:\s*"((?:[^"\\\n]|\\.)*)"\s*$'
_LATEST = re.compile(_STATE_FIELD.format("model_checkpoint_path"), re.MULTILINE)
_LISTED = re.compile(_STATE_FIELD.format("all_model_checkpoint_paths"), re.MULTILINE)


def read_state_file(path: str) -> CheckpointState:
    """A ``checkpoint`` state file, read as text (never through TensorFlow), its size bounded
    first and every path in it checked, so a hostile one is refused before anything uses it."""
    try:
        with open_regular(path) as handle:
            raw = handle.read(MAX_TF_STATE_FILE_BYTES + 1)
    except FileAccessError:
        raise
    except OSError as exc:
        raise FormatError(f"unreadable checkpoint state file ({exc.strerror or exc})", path=path) from None
    if len(raw) > MAX_TF_STATE_FILE_BYTES:
        raise UnsafeFileError(f"checkpoint state file is over {MAX_TF_STATE_FILE_BYTES} bytes", path=path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError("checkpoint state file is not UTF-8 text", path=path) from None
    match = _LATEST.search(text)
    if match is None:
        raise FormatError("checkpoint state file names no model_checkpoint_path", path=path)
    latest = _unescaped(match.group(1), "model_checkpoint_path", path)
    listed = tuple(_unescaped(found, "all_model_checkpoint_paths", path) for found in _LISTED.findall(text))
    return CheckpointState(latest, listed)


def _unescaped(quoted: str, name: str, path: str) -> str:
    try:
        named = codecs.escape_decode(quoted.encode("utf-8"))[0].decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        named = ""
    if not named or "\0" in named:
        raise FormatError(f"checkpoint state file has an empty or malformed {name}", path=path)
    return named


def _escaped(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


_DIGIT_RUNS = re.compile(r"([0-9]+)")


def natural_order(text: str) -> list[tuple[Any, ...]]:
    """Sort key reading ASCII digit runs as numbers: ``layers/2`` before ``layers/10``.

    Runs are compared by length, then digits, never converted: a name of 5,000 digits (past
    Python's ``int`` limit) or a digit like ``²`` (which ``str.isdigit`` accepts and ``int``
    refuses) sorts like any other.
    """
    runs = _DIGIT_RUNS.split(text)  # text, digits, text, ...
    return [(0, len(run.lstrip("0")), run.lstrip("0")) if index % 2 else (1, run) for index, run in enumerate(runs)]


# --- the slice keys of partitioned variables ---------------------------------------------

def _escape(text: bytes) -> bytes:
    """``OrderedCode::WriteString`` without its terminator: 0x00 and 0xff escaped as 00 ff and ff 00."""
    out = bytearray()
    for byte in text:
        if byte == 0:
            out += b"\x00\xff"
        elif byte == 0xFF:
            out += b"\xff\x00"
        else:
            out.append(byte)
    return bytes(out)


def _ordered_unsigned(value: int) -> bytes:
    """``OrderedCode::WriteNumIncreasing``: a length byte, then big-endian bytes without leading zeros."""
    body = value.to_bytes((value.bit_length() + 7) // 8, "big")
    return bytes([len(body)]) + body


_SIGNED_HEADER = {1: (0x80, 0), 2: (0xC0, 0), 3: (0xE0, 0), 4: (0xF0, 0), 5: (0xF8, 0), 6: (0xFC, 0),
                  7: (0xFE, 0), 8: (0xFF, 0), 9: (0xFF, 0x80), 10: (0xFF, 0xC0)}


def _ordered_signed(value: int) -> bytes:
    """``OrderedCode::WriteSignedNumIncreasing``: n bytes hold [-2^(7n-1), 2^(7n-1)), length in the leading bits."""
    magnitude = ~value if value < 0 else value
    if magnitude < 64:
        return bytes([(0x80 ^ value) & 0xFF])
    length = -(-(magnitude.bit_length() + 1) // 7)
    body = bytearray(value.to_bytes(10, "big", signed=True)[10 - length :])
    first, second = _SIGNED_HEADER[length]
    body[0] ^= first
    body[1] ^= second
    return bytes(body)


def slice_key(name: bytes, extents: list[tuple[int, int]]) -> bytes:
    """``checkpoint::EncodeTensorNameSlice``: where one slice of a partitioned variable is stored."""
    parts = [_ordered_unsigned(0), _escape(name) + b"\x00\x01", _ordered_unsigned(len(extents))]
    for start, length in extents:
        parts += [_ordered_signed(start), _ordered_signed(length)]
    return b"".join(parts)


# --- the TF2 object graph -----------------------------------------------------------------

_OPTIMIZER_EDGE = "optimizer"
_STEP_COUNTERS = frozenset({"iter", "_iterations"})
_CATCH_ALL_LISTS = frozenset({"_variables", "variables", "_trainable_variables", "trainable_variables"})




class _GraphTooLarge(Exception):
    pass


def parse_object_graph(serialized: bytes) -> Any:
    """The ``TrackableObjectGraph`` message in ``serialized``; ``None`` when it cannot be read."""
    from google.protobuf.message import DecodeError  # here, as every protobuf import: see _parse

    from weightstore.formats._tf_protos import TrackableObjectGraph

    graph = TrackableObjectGraph()
    try:
        graph.ParseFromString(serialized)
    except (DecodeError, RecursionError):
        return None
    return graph


def object_graph_keys(graph: Any) -> dict[str, str]:
    """Checkpoint entry name -> key for every variable the object graph names (module docstring).

    Empty when there is no readable graph, or when its paths would take more memory than
    :data:`TF_PATH_UNITS_PER_BYTE` allows (a graph nested far deeper than any model), so the
    caller falls back to the entry names.
    """
    nodes = graph.nodes if graph is not None else []
    if not nodes:
        return {}
    try:
        best = best_paths(nodes, budget=TF_PATH_UNITS_PER_BYTE * graph.ByteSize() + TF_PATH_UNITS_SLACK)
    except _GraphTooLarge:
        return {}
    node_keys = {node: "/".join(path) for node, path in best.items() if path}
    for optimizer_id, node in enumerate(nodes):  # slots go under their variable
        optimizer_key = node_keys.get(optimizer_id)
        for slot in node.slot_variables:
            variable_key = node_keys.get(slot.original_variable_node_id)
            if optimizer_key and variable_key and 0 <= slot.slot_variable_node_id < len(nodes):
                node_keys.setdefault(slot.slot_variable_node_id,
                                     f"{variable_key}/.OPTIMIZER_SLOT/{optimizer_key}/{slot.slot_name}")
    keys: dict[str, str] = {}
    for node_id, key in node_keys.items():
        for attribute in nodes[node_id].attributes:
            if attribute.name == "VARIABLE_VALUE" and attribute.checkpoint_key.endswith(VARIABLE_SUFFIX):
                keys[attribute.checkpoint_key] = key
    return keys


def best_paths(nodes: Any, *, budget: int) -> dict[int, tuple[str, ...]]:
    """Node id -> its best path from the root, the least by (through an optimizer-like node,
    length, edges into catch-all lists, segments).

    A Dijkstra walk: extending two paths by one edge keeps their order, so the first time a
    node is taken off the heap its path is the best of all paths to it. Every path made
    costs its segments and characters out of ``budget``; :class:`_GraphTooLarge` when spent.
    """
    optimizer_like = {
        node_id for node_id, node in enumerate(nodes)
        if node.slot_variables or any(child.local_name in _STEP_COUNTERS for child in node.children)
    }
    optimizer_like.update(child.node_id for node in nodes for child in node.children
                          if child.local_name == _OPTIMIZER_EDGE)
    optimizer_like.discard(0)
    best: dict[int, tuple[str, ...]] = {}
    heap: list[tuple[bool, int, int, tuple[str, ...], int, int]] = [(False, 0, 0, (), 0, 0)]
    while heap:
        through_optimizer, length, catch_all, path, node_id, chars = heapq.heappop(heap)
        if node_id in best:
            continue
        best[node_id] = path
        for child in nodes[node_id].children:
            if child.node_id not in best and 0 <= child.node_id < len(nodes):
                flag = through_optimizer or child.node_id in optimizer_like
                lists = catch_all + (child.local_name in _CATCH_ALL_LISTS)
                name = child.local_name
                budget -= length + 1 + chars + len(name) + 1
                if budget < 0:
                    raise _GraphTooLarge
                heapq.heappush(heap, (flag, length + 1, lists, (*path, name), child.node_id, chars + len(name) + 1))
    return best


# --- the reader ---------------------------------------------------------------------------

@dataclass
class _Stored:
    """Where one tensor's bytes lie: a shard, a range, and the CRC-32C TensorFlow recorded."""

    shard: int
    offset: int
    size: int
    crc: int


@dataclass
class _Tensor:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    stored: _Stored | None = None
    #: a partitioned variable: ``(index into the full tensor, slice shape, where it lies)`` per slice
    slices: list[tuple[tuple[slice, ...], tuple[int, ...], _Stored]] = field(default_factory=list)


class CheckpointReader(ReaderDefaults):
    """The core's Reader protocol over a TF checkpoint; only the index is read at open."""

    has_checksums = False
    created = ""

    def __init__(self, prefix: str):
        self.name = prefix
        self.prefix = prefix
        self.metadata: dict[str, Any] = {}
        self.skipped: list[str] = []
        self._maps: dict[int, MappedFile] = {}
        self._closed = False
        self._lock = threading.Lock()
        table = Table(self._read_index(), prefix + ".index")
        header, entries, slice_entries = self._parse(table)
        self._num_shards = header.num_shards
        self.entry_names = list(entries)
        self.object_based = OBJECT_GRAPH_KEY in entries
        self.kind = KIND_TF2 if self.object_based else KIND_TF1
        #: the graph a TF1 ``Saver`` wrote beside the checkpoint: the only record of trainability
        self.meta_graph = None if self.object_based else prefix + ".meta"
        #: the TF2 object graph (a ``TrackableObjectGraph`` message); ``None`` when there is no readable one
        self.object_graph: Any = None
        try:
            tensors = self._tensors(entries, slice_entries)
            graph_keys = self._graph_keys(entries) if self.object_based else {}
        except BaseException:
            self.close()
            raise
        self._tensors_by_key: dict[str, _Tensor] = {}
        self._infos: dict[str, TensorInfo] = {}
        for name in entries:
            key = self._key_for(name, graph_keys)
            if key is None:
                continue
            tensor = tensors.get(name)
            if tensor is None or not _is_key(key):  # not numeric, or a name no key can spell
                self.skipped.append(name)
                continue
            if key in self._tensors_by_key and not self.object_based:  # a//b and a/b
                raise FormatError(f"variables {self._tensors_by_key[key].name!r} and {name!r} both read as this key "
                                  "(empty and '.' name segments are dropped)", path=prefix, key=key)
            if key in self._tensors_by_key:  # only when the object graph disagrees with itself
                key = name[: -len(VARIABLE_SUFFIX)]
                if key in self._tensors_by_key:
                    raise FormatError(f"entries {self._tensors_by_key[key].name!r} and {name!r} both read as this key",
                                      path=prefix, key=key)
            self._tensors_by_key[key] = tensor
            nbytes = math.prod(tensor.shape) * tensor.dtype.itemsize
            self._infos[key] = TensorInfo(key, dtype_name(tensor.dtype), tensor.shape, nbytes)
        if self.object_based:  # keys, not entry names, in order: layers/2 before layers/10
            self._infos = {key: self._infos[key] for key in sorted(self._infos, key=natural_order)}

    def _read_index(self) -> bytes:
        path = self.prefix + ".index"
        try:
            handle = open_regular(path)
        except FileNotFoundError:
            try:
                missing = f"is a link to {os.readlink(path)!r}, which is missing"
            except OSError:  # no link (or removed since): plainly missing
                missing = "is missing"
            raise StoreNotFoundError(f"no such checkpoint ({path} {missing})", path=self.prefix) from None
        with handle:
            size = os.fstat(handle.fileno()).st_size
            if size > MAX_TF_INDEX_BYTES:
                raise UnsafeFileError(f"checkpoint index is {size} bytes, over the {MAX_TF_INDEX_BYTES}-byte limit",
                                      path=path)
            try:
                return handle.read(size + 1)  # what the file holds: a buffer of the limit is 256 MB
            except OSError as exc:  # the read the system failed (an I/O error): the storage's, named
                raise unreadable(exc, path) from None

    def _parse(self, table: Table) -> tuple[Any, dict[str, Any], dict[bytes, Any]]:
        # protobuf is imported only once a checkpoint is read: this module is in the format
        # table, which every open consults, and opening an npz need not build TF's messages
        from weightstore.formats._tf_protos import BundleEntryProto, BundleHeaderProto

        index_path = table.path
        header = None
        entries: dict[str, Any] = {}
        slice_entries: dict[bytes, Any] = {}
        for raw_key, value in table.items():
            if raw_key == b"":
                header = BundleHeaderProto()
                _parse_proto(header, value, index_path, "the bundle header")
                continue
            entry = BundleEntryProto()
            if raw_key.startswith(b"\x00"):  # a slice of a partitioned variable (see slice_key)
                _parse_proto(entry, value, index_path, f"slice entry {raw_key!r}")
                slice_entries[raw_key] = entry
                continue
            try:
                name = raw_key.decode("utf-8")
            except UnicodeDecodeError:
                raise FormatError(f"entry name {raw_key!r} is not valid UTF-8", path=index_path) from None
            _parse_proto(entry, value, index_path, f"entry {name!r}")
            entries[name] = entry
        if header is None:
            raise FormatError("not a TensorFlow checkpoint index (no bundle header)", path=index_path)
        if header.endianness != 0:
            raise FormatError("big-endian checkpoints are not read", path=index_path)
        if not 0 < header.num_shards <= MAX_TF_SHARDS:
            raise FormatError(f"bundle header declares {header.num_shards} data shards", path=index_path)
        return header, entries, slice_entries

    def _tensors(self, entries: dict[str, Any], slice_entries: dict[bytes, Any]) -> dict[str, _Tensor]:
        """Every numeric entry checked against the index's own rules; data ranges checked for overlap."""
        index_path = self.prefix + ".index"
        tensors: dict[str, _Tensor] = {}
        ranges: list[tuple[int, int, int, str]] = []  # shard, start, end, entry
        for name, entry in entries.items():
            dtype = _dtype_of(entry.dtype)
            if not entry.slices:
                stored = self._stored(entry, name)
                ranges.append((stored.shard, stored.offset, stored.offset + stored.size, name))
                if dtype is None:
                    continue  # strings and others: skipped, but their bytes still may not overlap
                shape = _shape(entry, index_path, name, dtype)
                needed = math.prod(shape) * dtype.itemsize
                if needed != stored.size:
                    raise FormatError(f"has shape {shape} {dtype}, which needs {needed} bytes; its entry says "
                                      f"{stored.size}", path=index_path, key=name)
                tensors[name] = _Tensor(name, dtype, shape, stored=stored)
                continue
            if dtype is None:
                continue
            shape = _shape(entry, index_path, name, dtype)
            tensor = _Tensor(name, dtype, shape)
            tensor.slices = self._slices(entry, name, shape, dtype, slice_entries)
            for _, _, stored in tensor.slices:
                ranges.append((stored.shard, stored.offset, stored.offset + stored.size, name))
            tensors[name] = tensor
        ranges = sorted(r for r in ranges if r[2] > r[1])  # empty tensors occupy no bytes
        for (shard, _, end, first), (other, start, _, second) in itertools.pairwise(ranges):
            if shard == other and start < end:
                raise FormatError(f"tensors {first!r} and {second!r} overlap in data shard {shard}", path=index_path)
        return tensors

    def _stored(self, entry: Any, name: str) -> _Stored:
        index_path = self.prefix + ".index"
        if not 0 <= entry.shard_id < self._num_shards:
            raise FormatError(f"lies in data shard {entry.shard_id}, of {self._num_shards}", path=index_path, key=name)
        if entry.offset < 0 or entry.size < 0:
            raise FormatError("has a negative offset or size", path=index_path, key=name)
        return _Stored(entry.shard_id, entry.offset, entry.size, unmask_crc(entry.crc32c))

    def _slices(self, entry: Any, name: str, shape: tuple[int, ...], dtype: np.dtype,
                slice_entries: dict[bytes, Any]) -> list[tuple[tuple[slice, ...], tuple[int, ...], _Stored]]:
        """The slices of a partitioned variable, proved to tile its full shape exactly."""
        index_path = self.prefix + ".index"
        if len(entry.slices) > MAX_TF_SLICES:
            raise UnsafeFileError(f"is split into {len(entry.slices)} slices (limit {MAX_TF_SLICES})",
                                  path=index_path, key=name)
        if entry.size:
            raise FormatError("lists slices and data of its own", path=index_path, key=name)
        if not shape:
            raise FormatError(f"is a scalar but lists {len(entry.slices)} slices (only tensors are partitioned)",
                              path=index_path, key=name)
        pieces = []
        for proto in entry.slices:
            if len(proto.extent) != len(shape):
                raise FormatError(f"a slice has {len(proto.extent)} dimensions, the tensor {len(shape)}",
                                  path=index_path, key=name)
            extents, index = [], []
            for extent, dim in zip(proto.extent, shape, strict=True):
                length = extent.length if extent.HasField("length") else -1
                start, stop = (extent.start, extent.start + length) if length >= 0 else (extent.start, dim)
                if length < -1 or not 0 <= start <= stop <= dim or (length == -1 and start != 0):
                    raise FormatError(f"a slice reaches outside its shape {shape}", path=index_path, key=name)
                extents.append((start, length))
                index.append(slice(start, stop))
            piece = slice_entries.get(slice_key(name.encode("utf-8"), extents))
            if piece is None:
                raise FormatError(f"lists a slice {extents} that the index does not hold", path=index_path, key=name)
            piece_shape = tuple(s.stop - s.start for s in index)
            stored = self._stored(piece, name)
            needed = math.prod(piece_shape) * dtype.itemsize
            if piece.dtype != entry.dtype or _shape(piece, index_path, name) != piece_shape or stored.size != needed:
                raise FormatError(f"a slice does not match its place {piece_shape} {dtype} ({stored.size} bytes)",
                                  path=index_path, key=name)
            pieces.append((tuple(index), piece_shape, stored))
        _check_tiling(index_path, name, shape, pieces)
        return pieces

    def _graph_keys(self, entries: dict[str, Any]) -> dict[str, str]:
        entry = entries[OBJECT_GRAPH_KEY]
        if entry.dtype != _DT_STRING or entry.slices or _shape(entry, self.prefix, OBJECT_GRAPH_KEY) != ():
            return {}
        stored = self._stored(entry, OBJECT_GRAPH_KEY)
        self.object_graph = parse_object_graph(self._string_scalar(stored))
        return object_graph_keys(self.object_graph)

    def _string_scalar(self, stored: _Stored) -> bytes:
        """One DT_STRING element: ``varint64 length, masked CRC-32C of the length, bytes``."""
        data = bytes(self._bytes(stored, OBJECT_GRAPH_KEY))
        length, pos = read_varint(data, 0, len(data), 64, path=self.name, what="its string length",
                                  key=OBJECT_GRAPH_KEY)
        if pos + 4 + length != len(data):
            raise FormatError("its string length disagrees with its entry's size", path=self.name, key=OBJECT_GRAPH_KEY)
        width = "<I" if length <= 0xFFFFFFFF else "<Q"
        crc = crc32c(data[pos : pos + 4], crc32c(struct.pack(width, length)))
        crc = crc32c(memoryview(data)[pos + 4 :], crc)
        if crc != stored.crc:
            raise ChecksumError(f"is corrupt (CRC-32C {crc:08x}, index says {stored.crc:08x})",
                                path=self.name, key=OBJECT_GRAPH_KEY)
        return data[pos + 4 :]

    def _key_for(self, name: str, graph_keys: dict[str, str]) -> str | None:
        if not self.object_based:
            return from_tf_name(name)
        if name == _SAVE_COUNTER or not name.endswith(VARIABLE_SUFFIX):
            return None  # the object graph, Python/iterator state, the checkpoint's own counter
        return graph_keys.get(name) or name[: -len(VARIABLE_SUFFIX)]

    def _shard_file(self, shard: int) -> str:
        return f"{self.prefix}.data-{shard:05d}-of-{self._num_shards:05d}"

    def _map(self, shard: int, key: str) -> MappedFile:
        """The data file, mapped at its first read (once, however many threads read at a time)."""
        mapped = self._maps.get(shard)
        if mapped is not None:
            return mapped
        with self._lock:
            if self._closed:
                raise FormatError("the checkpoint is closed; open it again to read it", path=self.name, key=key)
            if shard not in self._maps:
                path = self._shard_file(shard)
                try:
                    self._maps[shard] = MappedFile(path)
                except FileNotFoundError:
                    raise FormatError("its data file is missing", path=path, key=key) from None
                except FileAccessError as exc:  # the system's refusal (a link loop, no permission), in its words
                    raise attach(exc, key=key) from None
                except OSError as exc:
                    raise FormatError(f"its data file is unreadable ({exc.strerror})", path=path, key=key) from None
            return self._maps[shard]

    def _backed(self, stored: _Stored, key: str) -> MappedFile:
        """The mapped data file holding ``stored``, refused when the file is too short for it, or
        changed size since it was mapped (truncated in place: touching the map would be SIGBUS)."""
        mapped = self._map(stored.shard, key)
        mapped.check_unchanged(f"tensor {key!r}")
        if stored.offset + stored.size > mapped.size:
            raise FormatError(f"data file is short: needs bytes {stored.offset}..{stored.offset + stored.size}, "
                              f"the file has {mapped.size}", path=mapped.name, key=key)
        return mapped

    def _bytes(self, stored: _Stored, key: str) -> memoryview:
        return self._backed(stored, key).read_at(stored.offset, stored.size)

    def _verified(self, stored: _Stored, data, key: str) -> None:
        actual = crc32c(data)
        if actual != stored.crc:
            raise ChecksumError(f"is corrupt (CRC-32C {actual:08x}, index says {stored.crc:08x})",
                                path=self._shard_file(stored.shard), key=key)

    def keys(self) -> list[str]:
        return list(self._infos)

    def info(self, key: str) -> TensorInfo:
        try:
            return self._infos[key]
        except KeyError:
            raise KeyNotInStoreError("no such tensor", path=self.name, key=key) from None

    def entry_name(self, key: str) -> str:
        """The checkpoint entry a key reads (``net/w/.ATTRIBUTES/VARIABLE_VALUE`` for ``net/w``)."""
        return self._tensor(key).name

    def _tensor(self, key: str) -> _Tensor:
        if key not in self._infos:
            raise KeyNotInStoreError("no such tensor", path=self.name, key=key)
        return self._tensors_by_key[key]

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        """A read-only view of the mapped data file; a partitioned variable is joined into new memory."""
        tensor = self._tensor(key)
        if tensor.stored is None:
            for _, _, stored in tensor.slices:  # every slice backed by its file before the whole is allocated
                self._backed(stored, key)
            out = np.empty(tensor.shape, tensor.dtype)
            for index, shape, stored in tensor.slices:
                out[index] = self._array(stored, tensor.dtype, shape, key, verify)
            return out
        return self._array(tensor.stored, tensor.dtype, tensor.shape, key, verify)

    def _array(self, stored: _Stored, dtype: np.dtype, shape: tuple[int, ...], key: str, verify: bool) -> np.ndarray:
        data = self._bytes(stored, key)
        if verify:
            self._verified(stored, data, key)
        array = np.frombuffer(data, dtype=dtype).reshape(shape)
        return array if stored.offset % dtype.alignment == 0 else array.copy()

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        """Copy a whole tensor's bytes straight from the file into ``out`` (never mapped here)."""
        tensor = self._tensor(key)
        if tensor.stored is None or out.dtype != tensor.dtype.newbyteorder("="):
            return False
        buffer = out.reshape(-1).view(np.uint8).data
        self._backed(tensor.stored, key).read_into(tensor.stored.offset, buffer)
        if verify:
            self._verified(tensor.stored, buffer, key)
        return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            maps, self._maps = self._maps, {}
        for mapped in maps.values():
            mapped.close()


def _is_key(name: str) -> bool:
    try:
        validate_key(name)
    except InvalidKeyError:
        return False
    return True


def _parse_proto(message: Any, value: bytes, path: str, what: str) -> None:
    from google.protobuf.message import DecodeError

    try:
        message.ParseFromString(value)
    except (DecodeError, RecursionError):
        raise FormatError(f"{what} is not a readable protocol buffer", path=path) from None


def _shape(entry: Any, path: str, name: str, dtype: np.dtype | None = None) -> tuple[int, ...]:
    """The entry's shape; an empty one refused unless numpy can make it (of ``dtype``, where known):
    ``(0, 2**62)`` needs no bytes, but numpy counts the zero as one and refuses it. (A shape
    that needs more bytes than any file holds is refused by its entry's size.)"""
    proto = entry.shape
    if proto.unknown_rank:
        raise FormatError("has no known rank", path=path, key=name)
    if len(proto.dim) > MAX_NDIM:
        raise FormatError(f"has {len(proto.dim)} dimensions (at most {MAX_NDIM})", path=path, key=name)
    shape = tuple([dim.size for dim in proto.dim])
    if (shape and min(shape) < 0) or (0 in shape and not fits_an_array(shape, 1 if dtype is None else dtype.itemsize)):
        raise FormatError(f"has an impossible shape {short_repr(shape)}", path=path, key=name)
    return shape


def _check_tiling(path: str, name: str, shape: tuple[int, ...], pieces: list) -> None:
    """That the slices tile ``shape`` exactly: every element in one slice, none in two (two that
    share one would make the joined value depend on their order).

    On the grid that the slices' own boundaries cut, each slice covers whole cells; marking
    them proves the tiling in time linear in the cells, and a partition along any axes (all
    TensorFlow writes) has as many cells as slices. Boundaries so irregular that the grid has
    far more cells than slices are refused: comparing slices pairwise instead was quadratic,
    and 4,096 slices took 10-20 seconds.
    """
    boxes = [index for index, piece_shape, _ in pieces if math.prod(piece_shape)]
    cuts = [sorted({0, dim, *(box[axis].start for box in boxes), *(box[axis].stop for box in boxes)})
            for axis, dim in enumerate(shape)]
    cells = math.prod(len(axis_cuts) - 1 for axis_cuts in cuts)
    if cells > MAX_TF_GRID_CELLS_PER_SLICE * max(len(boxes), 1):
        raise UnsafeFileError(f"its {len(boxes)} slices cut it into a grid of {cells} cells; weightstore reads "
                              "slices that partition it along its axes", path=path, key=name)
    position = [{cut: at for at, cut in enumerate(axis_cuts)} for axis_cuts in cuts]
    covered = np.zeros([len(axis_cuts) - 1 for axis_cuts in cuts], dtype=bool)
    for box in boxes:
        region = covered[tuple(slice(where[s.start], where[s.stop]) for where, s in zip(position, box, strict=True))]
        if region.any():
            raise FormatError("two of its slices overlap", path=path, key=name)
        region[...] = True
    if not covered.all():
        raise FormatError(f"its slices do not cover its shape {short_repr(shape)}", path=path, key=name)


def _find(place: Place) -> Place | None:
    """The checkpoint ``place`` names (:func:`resolve_prefix`); local only: the bundle's files are
    opened by path (so a checkpoint on object storage is copied down first: ``ws convert``)."""
    prefix = None if place.remote else resolve_prefix(place.text)
    return None if prefix is None else Place(prefix, remote=False)


def _no_writer(path: str, compress: bool | str) -> Any:
    raise TargetError("a TF checkpoint is written by ws import --into PREFIX, not saved", path=path)


#: a TF checkpoint: recognised by its prefix, one of its files or its folder, never by a suffix
FORMAT = Format(name="tf-checkpoint", suffixes=(), magic=lambda head: False,
                open_reader=lambda location, name, *, mmap=True: CheckpointReader(location),
                open_writer=_no_writer, compresses=False, writes=False, find=_find)
