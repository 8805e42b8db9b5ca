"""The manifest: what a file holds, tensor by tensor, and how to check it.

Both formats carry the same JSON manifest, so a file's logical dtypes (``bfloat16`` that npy
can only store as raw void), shapes and checksums survive any reader. A manifest read from a
file is untrusted input: :func:`parse_manifest` checks every field before anything uses it.
"""

from __future__ import annotations

import datetime as _dt
import functools
import itertools
import json
import math
import operator
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import numpy as np
import orjson
from isal import isal_zlib

from weightstore.core import checksums as _crc
from weightstore.core._jsontext import refuse_deep, refuse_dense, text_field
from weightstore.core._tensortable import (
    CHECKSUM_ALGORITHM,
    CHECKSUM_PREFIX,
    TensorInfo,
    TensorRow,
    TensorTable,
    columns_text,
    fits_an_array,
    parse_columns,
    short_repr,
)
from weightstore.core.keys import validate_keys
from weightstore.core.limits import MANIFEST_BYTES_PER_CONTAINER, MAX_MANIFEST_BYTES, MAX_NDIM
from weightstore.errors import ChecksumError, FormatError, InvalidKeyError, UnsupportedDTypeError, naming

FORMAT_NAME = "weightstore"
#: 3: a BLAKE3 digest per tensor (the ``blake3`` column); 2: tensors as columns
#: (:mod:`weightstore.core._tensortable`); 1: an object per tensor. All three are read. A reader of
#: version 2 refuses any column it does not know (a damaged name must not read as one left
#: out), so the digest came with a new version: such a reader then says the file is newer
#: than it reads, rather than that its columns are wrong.
FORMAT_VERSION = 3
#: the version a manifest without digests is written as: it holds nothing version 2 lacks, so
#: the readers of version 2 read it (a plain ``ws.save`` records no digests)
_UNDIGESTED_VERSION = 2
_FIELDS = frozenset({"format", "version", "producer", "created", "metadata", "tensors"})
#: a version 1 entry's fields: ``location`` and ``codec`` optional, the others always (``checksum`` may be null)
_ENTRY_FIELDS = frozenset({"dtype", "shape", "checksum", "location", "codec"})
_PLAIN_ENTRY_FIELDS = frozenset({"dtype", "shape", "checksum"})
#: a version 1 checksum, as its writer wrote it
_CHECKSUM_TEXT = re.compile(CHECKSUM_PREFIX + "[0-9a-f]{8}")
#: how a tensor's bytes may be encoded beyond what the format itself says (npz ``compress="shuffle"``)
CODECS = frozenset({"shuffle-zstd"})
#: bytes checksummed at a time: small enough to stay in cache for the write that follows
CRC_CHUNK = 1 << 20
#: bytes handed to one write, checksummed :data:`CRC_CHUNK` at a time just before (still in the
#: last-level cache). Larger writes cost the kernel less per byte: it puts them in larger page
#: cache folios (256 MB + fsync on ext4, Linux 6.18: 0.50 CPU-s/GB in 256 KB writes, 0.42 in
#: 1 MB, 0.37 in 4 MB, as whole tensors)
WRITE_CHUNK = 4 << 20

_NUMERIC_KINDS = frozenset("biufc")
#: numpy's own names for what weightstore stores: never ml_dtypes kinds, so asked about without it
_NUMPY_NAMES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                          "float16", "float32", "float64", "complex64", "complex128",
                          np.dtype(np.longdouble).name, np.dtype(np.clongdouble).name})


class _MlDtypes(Mapping[str, np.dtype]):
    """ml_dtypes kinds (bfloat16, float8_*, int4, ...) that npy and HDF5 store as raw void bytes;
    the manifest names them. Taken from the installed ml_dtypes, which adds kinds in minor
    releases, when first needed: importing ml_dtypes costs about a CPU-second, which a process
    that only meets numpy's dtypes (most ``ws`` commands) should not pay. Asking about one of
    numpy's names (:data:`_NUMPY_NAMES`) never imports it."""

    def __getitem__(self, name: str) -> np.dtype:
        return _ml_table()[name]

    def __contains__(self, name: object) -> bool:
        return name not in _NUMPY_NAMES and name in _ml_table()

    def get(self, name: str, default: Any = None) -> Any:
        return default if name in _NUMPY_NAMES else _ml_table().get(name, default)

    def __iter__(self) -> Iterator[str]:
        return iter(_ml_table())

    def __len__(self) -> int:
        return len(_ml_table())


@functools.cache
def _ml_table() -> dict[str, np.dtype]:
    import ml_dtypes  # here: see _MlDtypes

    return {
        name: np.dtype(kind)
        for name, kind in sorted(vars(ml_dtypes).items())
        if not name.startswith("_") and isinstance(kind, type) and issubclass(kind, np.generic)
    }


@functools.cache
def _ml_names() -> dict[type, str]:
    return {dtype.type: name for name, dtype in _ml_table().items()}


ML_DTYPES: Mapping[str, np.dtype] = _MlDtypes()


@dataclass
class Manifest:
    tensors: TensorTable
    metadata: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    producer: str = ""
    #: where a tensor lives in the file when that differs from its key (HDF5 reserved datasets)
    locations: dict[str, str] = field(default_factory=dict)
    #: how a tensor's stored bytes are encoded, when the format alone does not say (see :data:`CODECS`)
    codecs: dict[str, str] = field(default_factory=dict)


def dtype_name(dtype: np.dtype, key: str = "") -> str:
    """The logical name of a storable dtype; refuse objects, strings, records and dates."""
    name = _STORABLE_NAMES.get(dtype) if isinstance(dtype, np.dtype) else None
    if name is not None:  # numpy's ``dtype.name`` costs microseconds: 50,000 small tensors ask
        return name
    dtype = np.dtype(dtype)
    name = _storable_name(dtype, key)
    if len(_STORABLE_NAMES) < 1024:
        _STORABLE_NAMES[dtype] = name
    return name


#: dtype -> logical name, for the dtypes seen so far (a handful per process)
_STORABLE_NAMES: dict[np.dtype, str] = {}


def _storable_name(dtype: np.dtype, key: str) -> str:
    # An array of an ml_dtypes kind exists only once ml_dtypes is imported (their numpy kinds
    # vary: ``V``, ``f``, ``c``), so a process that has not imported it is not made to.
    ml_name = _ml_names().get(dtype.type) if "ml_dtypes" in sys.modules else None
    if ml_name is not None:
        return ml_name
    if dtype.kind not in _NUMERIC_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        what = "object arrays are never stored (they would need pickle)" if dtype.kind == "O" else (
            "only numeric, bool and ml_dtypes arrays are weights"
        )
        raise UnsupportedDTypeError(f"has dtype {dtype}: {what}", key=key or None)
    return dtype.newbyteorder("=").name


def logical_dtype(name: str) -> np.dtype:
    """The numpy dtype a manifest names; only names :func:`dtype_name` can produce (callers
    that know the file name it: :func:`~weightstore.errors.naming`)."""
    dtype = _known_dtype(name) if isinstance(name, str) else None
    if dtype is None:
        raise FormatError(f"unknown dtype {name!r}")
    return dtype


@functools.lru_cache(maxsize=256)  # a manifest names a handful of dtypes many times over
def _known_dtype(name: str) -> np.dtype | None:
    if name in ML_DTYPES:
        return ML_DTYPES[name]
    try:
        dtype = np.dtype(name)
    except Exception:  # numpy's dtype parser raises TypeError, ValueError or SyntaxError on junk
        return None
    if dtype.kind not in _NUMERIC_KINDS or dtype.name != name or dtype.subdtype is not None:
        return None
    return dtype.newbyteorder("<")


def storage_dtype(name: str) -> np.dtype:
    """How a logical dtype is laid out on disk: little-endian, ml_dtypes as raw void."""
    logical = logical_dtype(name)
    if name in ML_DTYPES:
        return np.dtype(f"V{logical.itemsize}")
    return logical.newbyteorder("<")


def to_storage(array: np.ndarray, key: str = "") -> tuple[str, np.ndarray]:
    """``(logical dtype name, C-contiguous little-endian array in storage dtype)``."""
    array = np.asarray(array)
    name = _STORED_AS_IS.get(array.dtype)
    if name is not None:
        return name, array if array.flags.c_contiguous else c_copy(array)  # as it is, or a copy of its bytes
    name = dtype_name(array.dtype, key)
    target = storage_dtype(name)
    if name in ML_DTYPES:
        return name, c_copy(array).view(target)
    return name, np.asarray(array, dtype=target, order="C")


#: runs of at least this many contiguous bytes are copied whole (:func:`c_copy`); below, numpy's
#: typed copy is as fast
_RUN_COPY_BYTES = 32
#: the longest run copied as one element: numpy's void type holds less than 2 GiB (a longer one
#: raised a bare ValueError, "invalid itemsize")
_MOST_RUN_BYTES = (1 << 31) - 1


def c_copy(array: np.ndarray) -> np.ndarray:
    """``array`` C-contiguous (itself if it is), its bytes copied as they are.

    An array whose trailing axes are contiguous (a column strip of a piece, a slice of rows
    and columns) is copied as one run of bytes per index of its leading axes, numpy copying
    each run as one void element: its typed copy loops over every row of the innermost axis,
    which made a sharded member's copy of its 256-byte-wide column strips 0.19 CPU-s/GB where
    the runs take 0.12 (a contiguous copy: 0.06). Anything else (a transposed array) goes
    through numpy's typed copy."""
    if array.flags.c_contiguous:
        return array
    axis, run = array.ndim, array.itemsize
    while axis and array.strides[axis - 1] == run and run * array.shape[axis - 1] <= _MOST_RUN_BYTES:
        run *= array.shape[axis - 1]
        axis -= 1
    if axis == array.ndim or run < _RUN_COPY_BYTES:
        return np.ascontiguousarray(array)
    runs = array.view(np.uint8).reshape(*array.shape[:axis], run).view(np.dtype((np.void, run)))
    return np.ascontiguousarray(runs).view(array.dtype).reshape(array.shape)


#: numeric dtypes already in storage form (little-endian, not ml_dtypes) -> their names
_STORED_AS_IS = {dtype: dtype.name for dtype in map(np.dtype, ["<b1", "<i1", "<i2", "<i4", "<i8", "<u1", "<u2", "<u4",
                                                                  "<u8", "<f2", "<f4", "<f8", "<c8", "<c16"])}


def from_storage(array: np.ndarray, name: str) -> np.ndarray:
    """The logical view of a storage array; native byte order (no copy on little-endian hosts)."""
    logical = logical_dtype(name)
    if name in ML_DTYPES:
        return array.view(logical)
    return array.view(logical.newbyteorder("="))


def raw_bytes(buffer) -> memoryview:
    """A flat read-only byte view of contiguous memory, whatever its shape (0-d, empty)."""
    if isinstance(buffer, np.ndarray):
        # As bytes first: the buffer protocol refuses long double in explicit '<' order.
        if not buffer.flags.c_contiguous:
            raise ValueError("raw_bytes needs contiguous memory")
        buffer = buffer.reshape(-1).view(np.uint8)
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("raw_bytes needs contiguous memory")
    if view.ndim == 1 and view.format == "B":
        return view.toreadonly()
    if view.nbytes == 0:
        return memoryview(b"")
    return view.cast("B", (view.nbytes,)).toreadonly() if view.ndim <= 1 else view.cast("B").toreadonly()


def crc32(buffer) -> int:
    """CRC-32 of a tensor's stored bytes, by ISA-L; a large tensor on two cores (see :mod:`weightstore.core.checksums`).

    A small C-contiguous array goes to ISA-L as it is: making a byte view of it first costs
    more than checksumming its kilobyte, and files hold 50,000 such tensors.
    """
    if isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous and buffer.nbytes < _crc.RELEASE_GIL_BYTES:
        return isal_zlib.crc32(buffer) & 0xFFFFFFFF
    return _crc.crc32(raw_bytes(buffer))


def write_checksummed(payload: memoryview, write: Callable[[memoryview], object], crc: int = 0) -> int:
    """Hand ``payload`` to ``write`` chunk by chunk and return its CRC-32 (continuing ``crc``).

    Each chunk is checksummed just before it is written, while it is in cache: saving reads
    the tensor from memory once, not once for the checksum and again for the write. The
    checksum releases the GIL, so a save in the background does not stall the trainer.
    """
    for start in range(0, len(payload), WRITE_CHUNK):
        piece = payload[start : start + WRITE_CHUNK]
        crc = crc32_before_write(piece, crc)
        write(piece)
    return crc & 0xFFFFFFFF


def crc32_before_write(block: memoryview, crc: int = 0) -> int:
    """CRC-32 of a block about to be written (continuing ``crc``), :data:`CRC_CHUNK` at a time
    on this thread: read once from memory, it is still in cache for the write, and no piece
    waits on a hand-off to the helper thread."""
    for at in range(0, len(block), CRC_CHUNK):
        crc = _crc.crc32(block[at : at + CRC_CHUNK], crc)
    return crc & 0xFFFFFFFF


def content_digest(buffer) -> bytes:
    """BLAKE3 of a tensor's stored bytes (32 bytes): what decides two tensors hold the same bytes.

    Collision-resistant, unlike CRC-32 (and unlike xxh3, which is fast but forgeable); BLAKE3
    over BLAKE2b or SHA-256 because it hashes 3-5 GB/s on one core with SIMD, next to a write
    of 1-2 GB/s, where those reach 0.5-1 GB/s. It releases the GIL on large buffers.
    """
    view: Any = buffer.reshape(-1).view(np.uint8) if isinstance(buffer, np.ndarray) and buffer.flags.c_contiguous else (
        raw_bytes(buffer))  # an array is a buffer too, without a memoryview's cost per small tensor
    return blake3.blake3(view).digest()


def content_hasher() -> Any:
    """:func:`content_digest` fed a piece at a time (``update(buffer)`` in order, then
    ``digest()``): what lets a reader hash each piece of a tensor it rebuilds while the piece
    is still in cache."""
    return blake3.blake3()


def checksum_text(crc: int) -> str:
    """How the manifest writes a CRC-32."""
    return f"{CHECKSUM_ALGORITHM}:{crc:08x}"


def checksum(buffer) -> str:
    return checksum_text(crc32(buffer))


def check_recorded(buffer, recorded: object, what: str, where: str) -> None:
    """Refuse ``buffer`` (the bytes of ``what``: a manifest, an index, which no tensor's checksum
    covers) unless its CRC-32 is ``recorded``: a :class:`ChecksumError` naming ``where``."""
    actual = checksum(buffer)
    if actual != recorded:
        shown = repr(recorded)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ChecksumError(f"{what} is corrupt or was changed (checksum {actual}, recorded {shown})", path=where)


def shape_nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    return math.prod(shape) * itemsize


def utc_now() -> str:
    """Now, in UTC to the millisecond (``2026-12-02T16:50:16.791Z``): the one form of the
    ``created`` time that files, versions and indexes record, so a version and its file agree."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def build_manifest(
    tensors: Sequence[TensorRow], metadata: Mapping[str, Any] | None, producer: str,
    locations: Mapping[str, str] | None = None, codecs: Mapping[str, str] | None = None,
    digests: Sequence[bytes] | None = None, created: str | None = None,
) -> str:
    """The manifest's JSON text: the document's fields, then the tensors (``(key, dtype name,
    shape, CRC-32)`` each, as a writer learns them, and their :func:`content_digest` in the
    same order, if any: version 3; else version 2, which is the same without them) as columns.
    ``created``: the time the file's version records, else now."""
    document = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION if digests is not None else _UNDIGESTED_VERSION,
        "producer": producer,
        "created": created or utc_now(),
        "metadata": dict(metadata or {}),
    }
    try:
        head = json.dumps(document, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metadata must be JSON-serializable: {exc}") from None
    columns = columns_text(tensors, digests)
    sparse = "".join(f', "{field}": {json.dumps(dict(values), ensure_ascii=False)}'
                     for field, values in (("location", locations), ("codec", codecs)) if values)
    return f'{head[:-1]}, "tensors": {columns[:-1]}{sparse}}}}}'


#: a sealed manifest's last field: the CRC-32 of the manifest without it (the text up to it, then ``}``)
_SEAL = re.compile(r', "checksum": "(crc32:[0-9a-f]{8})"\}\Z')


def seal_manifest(text: str) -> str:
    """``text`` (a manifest that no checksum of its container covers: a safetensors header's)
    ending in its own CRC-32, so that a changed byte of its metadata, which no tensor's checksum
    covers, is found at open as an npz manifest member's zip CRC finds it. (A delta version
    keeps its manifest's CRC-32 in its head, a field older readers ignore.)"""
    return f'{text[:-1]}, "checksum": "{checksum(text.encode("utf-8", "surrogatepass"))}"}}'


def parse_manifest(text: str, where: str, *, sealed: bool = False) -> Manifest:
    """Check an untrusted manifest field by field; any surprise is a :class:`FormatError` naming ``where``.

    ``sealed``: the manifest may end in its CRC-32 (:func:`seal_manifest`), checked first (a
    :class:`ChecksumError`); a file written before the seal has none and reads as before, and
    a damaged seal is a field no manifest has."""
    seal = _SEAL.search(text) if sealed else None
    if seal is not None:
        text = text[: seal.start()] + "}"
        check_recorded(text.encode("utf-8", "surrogatepass"), seal.group(1), "manifest", where)
    with naming(path=where):  # the checks below name the key, not the file
        return _parsed_manifest(text)


def _parsed_manifest(text: str) -> Manifest:
    if len(text) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes")
    refuse_dense(text, MANIFEST_BYTES_PER_CONTAINER, "manifest")
    try:
        document = _parse_json(text)
    except _NonFiniteNumber as exc:
        raise FormatError(f"manifest holds {exc}, which no JSON number is (writers refuse it too)") from None
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"manifest is not valid JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT_NAME:
        raise FormatError("manifest is not a weightstore manifest")
    unknown = sorted(set(document) - _FIELDS)
    if unknown:  # a field misspelt by damage must not read as a field left out
        raise FormatError(f"manifest has fields {unknown} this version does not define")
    version = document.get("version")
    if type(version) is not int or version > FORMAT_VERSION:
        raise FormatError(f"manifest version {short_repr(version)} is newer than this weightstore reads")
    raw_tensors = document.get("tensors")
    metadata = document.get("metadata", {})
    if not isinstance(raw_tensors, dict) or not isinstance(metadata, dict):
        raise FormatError("manifest 'tensors' and 'metadata' must be objects")
    refuse_deep(metadata, "manifest metadata")
    locations: dict[str, str] = {}
    codecs: dict[str, str] = {}
    if version >= 2:
        tensors = parse_columns(raw_tensors, _itemsize_or_none, version)
        locations_column = _sparse_column(raw_tensors, "location", tensors)
        codecs_column = _sparse_column(raw_tensors, "codec", tensors)
        for key, location in locations_column.items():
            _record_location(key, location, locations)
        for key, codec in codecs_column.items():
            _record_codec(key, codec, codecs)
    else:
        tensors = _parse_entries_v1(raw_tensors, locations, codecs)
    return Manifest(
        tensors=tensors,
        metadata=metadata,
        created=text_field(document, "created", "manifest"),
        producer=text_field(document, "producer", "manifest"),
        locations=locations,
        codecs=codecs,
    )


def _itemsize_or_none(name: object) -> int | None:
    dtype = _known_dtype(name) if type(name) is str else None
    return None if dtype is None else dtype.itemsize


def _sparse_column(raw: dict[str, Any], name: str, tensors: TensorTable) -> dict[str, Any]:
    """An optional column: an object from some of the table's keys to a value."""
    column = raw.get(name, {})
    if type(column) is not dict:
        raise FormatError(f"manifest column {name!r} is not an object of key to value")
    for key in column:
        if key not in tensors:
            raise FormatError(f"manifest column {name!r} names {key!r}, which it does not list")
    return column


def _parse_entries_v1(raw: dict[str, Any], locations: dict[str, str],
                      codecs: dict[str, str]) -> TensorTable:
    """A version 1 manifest's tensors: an object per tensor, key -> dtype, shape, checksum."""
    try:
        validate_keys(raw)
    except InvalidKeyError as exc:
        raise FormatError(f"manifest has an {exc.message}", key=exc.key) from None
    tensors = _parse_plain_entries(raw)
    if tensors is None:
        tensors = _parse_entries(raw, locations, codecs)
    for key, info in tensors.items():
        if info.checksum is not None and not _CHECKSUM_TEXT.fullmatch(info.checksum):
            raise FormatError(f"manifest checksum of {key!r} is not {CHECKSUM_ALGORITHM}: {info.checksum!r}")
        if not fits_an_array(info.shape, logical_dtype(info.dtype).itemsize):
            raise FormatError(f"has a shape {info.shape} too large for any array", key=key)
    return TensorTable.from_infos(list(tensors.values()))


def _parse_plain_entries(raw: dict[str, Any]) -> dict[str, TensorInfo] | None:
    """The entries of a manifest whose every entry is exactly ``dtype``, ``shape``, ``checksum``
    and valid, checked column by column at C speed (``map`` over 50,000 entries, no Python
    step per entry); ``None`` when anything needs :func:`_parse_entries` to look, or to name it.

    Fast twin of :func:`_parse_entries`, which is the rule. Bound by the differential test
    ``tests/test_fast_paths.py::test_version_1_entries_read_column_wise_as_entry_by_entry``."""
    entries = list(raw.values())
    if set(map(type, entries)) - {dict} or set(map(len, entries)) - {3}:
        return None
    try:
        shapes, names, digests = (list(map(operator.itemgetter(field), entries)) for field in ("shape", "dtype", "checksum"))
        itemsize = {name: _known_dtype(name).itemsize for name in set(names)}  # type: ignore[union-attr]
    except (KeyError, TypeError, AttributeError):  # a field missing, a dtype unhashable or unknown
        return None
    if set(map(type, shapes)) - {list} or max(map(len, shapes), default=0) > MAX_NDIM:
        return None
    sizes = list(itertools.chain.from_iterable(shapes))
    if set(map(type, sizes)) - {int} or min(sizes, default=0) < 0:  # ``type``: True is no size
        return None
    texts = [digest for digest in digests if digest is not None]
    if set(map(type, texts)) - {str} or sum(map(str.startswith, texts, itertools.repeat(CHECKSUM_PREFIX))) != len(texts):
        return None
    dims = list(map(tuple, shapes))
    nbytes = map(operator.mul, map(math.prod, dims), map(itemsize.__getitem__, names))
    infos = map(_new_info, itertools.repeat(TensorInfo), zip(raw, names, dims, nbytes, digests,
                                                                      itertools.repeat(None, len(raw)), strict=True))
    return dict(zip(raw, infos, strict=True))


def _parse_entries(raw: dict[str, Any], locations: dict[str, str],
                   codecs: dict[str, str]) -> dict[str, TensorInfo]:
    """Entry by entry, naming the first bad one; ``location`` and ``codec`` go to their dicts.

    The rule for version 1 entries; :func:`_parse_plain_entries` is its fast twin."""
    tensors: dict[str, TensorInfo] = {}
    itemsizes: dict[object, int] = {}  # per dtype name seen: a manifest names a handful many times over
    for key, entry in raw.items():
        # Its fields are exactly those the writer writes: a ``checksum`` field damaged into
        # another name would otherwise read as a tensor without a checksum, and go unverified.
        if type(entry) is not dict or entry.keys() != _PLAIN_ENTRY_FIELDS:
            _parse_optional_fields(key, entry, locations, codecs)
        shape = entry["shape"]
        if type(shape) is not list or len(shape) > MAX_NDIM or not _all_sizes(shape):
            raise FormatError(f"manifest shape of {key!r} is not a list of sizes: {short_repr(shape)}")
        name = entry["dtype"]
        itemsize = itemsizes.get(name) if type(name) is str else None
        if itemsize is None:
            itemsize = itemsizes[name] = _itemsize_of(key, name)
        digest = entry["checksum"]
        if digest is not None and not (type(digest) is str and digest.startswith(CHECKSUM_PREFIX)):
            raise FormatError(f"manifest checksum of {key!r} is not {CHECKSUM_ALGORITHM}: {short_repr(digest)}")
        dims = tuple(shape)
        tensors[key] = _new_info(TensorInfo, (key, name, dims, math.prod(dims) * itemsize, digest, None))
    return tensors


def _parse_json(text: str) -> Any:
    """orjson where it agrees to read the text (4x the stdlib's speed on 50,000 entries), the
    stdlib where it does not: orjson refuses what strict JSON lacks (NaN, deep nesting), and
    the stdlib then decides, exactly as when it read every manifest; metadata that may hold
    an integer past 64 bits is read by the stdlib too, which keeps it exact."""
    try:
        document = orjson.loads(text)  # a lone surrogate fails it, as invalid UTF-8 would
    except orjson.JSONDecodeError:
        return json.loads(text, parse_constant=_refuse_constant)
    if isinstance(document, dict) and _holds_rounded_integer(document.get("metadata")):
        return json.loads(text, parse_constant=_refuse_constant)  # orjson made an integer past 64 bits a float
    return document


def _holds_rounded_integer(value: Any) -> bool:
    """Whether a float in ``value`` may be an integer orjson could not hold (it reads those as
    floats where the stdlib keeps them exact): a whole float of 2**63 or more."""
    pending = [value]
    while pending:  # not recursive: orjson reads 1,024 levels, past Python's recursion limit
        item = pending.pop()
        if type(item) is float and abs(item) >= 2.0**63 and item.is_integer():
            return True
        if type(item) is dict:
            pending.extend(item.values())
        elif type(item) is list:
            pending.extend(item)
    return False


class _NonFiniteNumber(Exception):
    pass


def _refuse_constant(name: str) -> None:
    """NaN and Infinity: :func:`build_manifest` refuses them, so a reader must too (else a file
    reads but cannot be converted)."""
    raise _NonFiniteNumber(name)


#: ``TensorInfo(*fields)`` without the named tuple's generated ``__new__`` frame (and mappable over tuples)
_new_info = tuple.__new__


def _parse_optional_fields(key: str, entry: object, locations: dict[str, str],
                           codecs: dict[str, str]) -> None:
    """An entry with more than the three fields every entry has: ``location`` and ``codec`` are
    recorded; anything else (or a field missing) is a :class:`FormatError`."""
    if type(entry) is not dict:
        raise FormatError(f"manifest entry for {key!r} is not an object")
    if not (_PLAIN_ENTRY_FIELDS <= entry.keys() <= _ENTRY_FIELDS):
        raise FormatError(f"manifest entry for {key!r} has fields {sorted(entry)}, not {sorted(_ENTRY_FIELDS)}")
    if "location" in entry:
        _record_location(key, entry["location"], locations)
    if "codec" in entry:
        _record_codec(key, entry["codec"], codecs)


def _record_location(key: str, location: object, locations: dict[str, str]) -> None:
    if not isinstance(location, str) or not location:
        raise FormatError(f"manifest location of {key!r} is not a path: {short_repr(location)}")
    locations[key] = location


def _record_codec(key: str, codec: object, codecs: dict[str, str]) -> None:
    # a codec this version cannot decode must not read as plain bytes
    if not isinstance(codec, str) or codec not in CODECS:
        raise FormatError(f"manifest codec of {key!r} is {short_repr(codec)}, not one of {sorted(CODECS)}")
    codecs[key] = codec


def _itemsize_of(key: str, name: object) -> int:
    if not isinstance(name, str):
        raise FormatError(f"manifest dtype of {key!r} is missing")
    dtype = _known_dtype(name)
    if dtype is None:
        raise FormatError(f"unknown dtype {name!r}", key=key)
    return dtype.itemsize


def _all_sizes(shape: list) -> bool:
    for size in shape:  # noqa: SIM110 - a loop, not all(generator): twice as fast on 50,000 entries
        if type(size) is not int or size < 0:  # ``type``, not isinstance: True is no size
            return False
    return True
