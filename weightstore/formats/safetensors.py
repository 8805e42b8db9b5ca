"""safetensors: an 8-byte little-endian header length, a JSON header, then one flat data buffer.

We write and parse the format ourselves (no ``safetensors`` package needed) and keep every
rule of its specification and of its reference library, so ``safetensors.numpy.load_file``
and ``safe_open`` read our files and we read theirs:

- the header is a JSON object of ``name -> {"dtype", "shape", "data_offsets": [begin, end]}``
  with offsets relative to the data buffer, which they must cover exactly, contiguously and
  without overlap; names are unique; ``__metadata__`` is a string-to-string map; the header
  is at most 100 MB (the library's limit) and padded with spaces to a multiple of 8 bytes.
- our manifest (format, version, producer, created, user metadata, per-tensor logical dtype,
  shape and checksum) travels as JSON text under ``__metadata__["weightstore"]``, so reads are
  verified like npz and user metadata round-trips exactly. The manifest ends in its own
  CRC-32 (``, "checksum": "crc32:…"}``, of the text without that field), checked at every
  open as the npz manifest member's zip CRC is: changed metadata fails ``ws verify``. Files
  written before it existed have none and read as before. A file without it (written by the
  ``safetensors`` library) reads as a foreign file: tensor names become keys, its
  ``__metadata__`` becomes ``metadata``, and there are no checksums to verify.

Dtypes: every weightstore dtype the specification names is stored as that type (``bool``,
``int8``..``uint64``, ``float16``/``32``/``64``, ``complex64``, ``bfloat16`` and the float8
kinds ``e4m3fn``, ``e5m2``, ``e4m3fnuz``, ``e5m2fnuz``, ``e8m0fnu``). Anything else
(``complex128``, ``int4``, ``float4``/``float6`` which ml_dtypes keeps one per
byte where the specification packs them, other float8 kinds) is refused on save with
:class:`UnsupportedDTypeError` naming the key, before the file is written: storing it as raw
bytes under another type would make every other reader see wrong values. Reading refuses the
packed sub-byte types (``F4``, ``F6_*``), which numpy cannot view.

Alignment: the data buffer starts on a 64-byte boundary (the header is padded with spaces,
which the specification allows). Offsets must be contiguous, so single tensors cannot be
padded to 64 bytes; but every tensor starts on a multiple of its own item size. A file of
up to ``_HOLD_BYTES`` is laid out as the library lays files out, by descending item size; in
a larger one, tensors whose size is a multiple of 8 bytes come first, in order, and the
others last, by descending item size. Tensors read from a local file are read-only views of
the mapped file; a tensor that a foreign writer left misaligned is copied instead.

Writing: the header, which holds every offset and checksum, comes before the data, but is
known only at :meth:`SafetensorsWriter.commit`. The writer holds the first tensors (up to
``_HOLD_BYTES``, as references, not copies) so that small files get an exact header; past
that it reserves generous room for the header and streams the rest (holding only tensors
whose odd size would misalign the next), and in the rare case the header outgrows the
room, it moves the data up once.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import operator
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np
import orjson

from weightstore.core import _jsontext as jsontext
from weightstore.core._gcpause import paused_gc
from weightstore.core._tensortable import NO_CRC, TensorTable
from weightstore.core.limits import (
    MAX_ARRAY_BYTES,
    MAX_NDIM,
    MAX_SAFETENSORS_HEADER_BYTES,
    SAFETENSORS_BYTES_PER_CONTAINER,
)
from weightstore.core.manifest import FORMAT_NAME as MANIFEST_FORMAT
from weightstore.core.manifest import (
    ML_DTYPES,
    Manifest,
    TensorInfo,
    checksum,
    crc32,
    logical_dtype,
    parse_manifest,
    raw_bytes,
    seal_manifest,
    write_checksummed,
)
from weightstore.errors import (
    ChecksumError,
    FormatError,
    KeyNotInStoreError,
    UnsafeFileError,
    UnsupportedDTypeError,
    named,
    naming,
)
from weightstore.formats import Format, ReaderDefaults, foreign_keys
from weightstore.formats._sstable import crc32c, unmask_crc
from weightstore.io._local import MappedFile
from weightstore.io.source import ByteSource, open_source, prefetch_ranges

#: the ``__metadata__`` entry that holds our manifest
MANIFEST_KEY = "weightstore"
METADATA_KEY = "__metadata__"
#: how every manifest's text starts: one under another entry's name is ours with its name damaged
_MANIFEST_START = f'{{"format": "{MANIFEST_FORMAT}"'
ALIGNMENT = 64
_LENGTH = struct.Struct("<Q")
#: tensors held by reference before the writer must commit to a header size and stream
_HOLD_BYTES = 64 << 20
#: room left for the header beyond twice the estimate, once streaming (spaces: cheap to write and parse)
_HEADER_SLACK = 64 << 10
_MOVE_CHUNK = 16 << 20
#: where a streamed file's data starts, a multiple of this (the header's room padded, under 0.1%
#: of the file): so its writes begin on page-cache folio edges. Linux (6.18, ext4) keeps written
#: pages in folios as large as the write's offset is aligned; a sharded member's 512 KiB column
#: strips written from an offset of 64 bytes took 0.37-0.40 CPU-s/GB, from 64 KiB 0.33-0.34
_STREAMED_ALIGNMENT = 64 << 10
#: payloads at least this big go to the kernel straight from the caller's memory; smaller ones
#: are gathered first (a write call per 1 KB tensor would cost more than its bytes). Python's
#: own buffered file copied every chunk of up to its buffer's size into that buffer first:
#: 0.07 CPU-s/GB of a save that the kernel's copy alone makes 0.3
_DIRECT_BYTES = 256 << 10
#: a tensor at least this big asks the plan whether the file outgrows :data:`_HOLD_BYTES` (once):
#: a sharded member's column strips are made for the write and are often under
#: :data:`_DIRECT_BYTES` (a 16 MB piece's are 256 KB); held, the first 64 MB of them stayed
#: as fresh copies, a page fault and a zeroed page per 4 KiB (a 128 MB member: 1.6-1.9 CPU-s/GB
#: streamed, 2.2-2.7 held). Smaller tensors never work the plan out
_PLAN_FROM = 64 << 10
_GATHER_BYTES = 1 << 20
#: tensors at least this big are announced to the source (it reads ahead of them) before they are read
_PREFETCH_BYTES = 1 << 20
#: fewer tensors than this are read one by one: the shared set-up of reading many costs more
_FEW = 16
_JUST_INT = {int}
_JUST_DICT, _JUST_LIST, _JUST_TWO = {dict}, {list}, {2}
#: a tensor whose byte size is a multiple of this leaves the next one aligned for any dtype
_KEEPS_ALIGNED = 8

#: logical dtype -> safetensors dtype, for every kind both know
_SPEC_CODES = {
    "bool": "BOOL", "uint8": "U8", "int8": "I8", "uint16": "U16", "int16": "I16", "uint32": "U32",
    "int32": "I32", "uint64": "U64", "int64": "I64", "float16": "F16", "float32": "F32", "float64": "F64",
    "complex64": "C64", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ", "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0",
}
_NAME_OF_CODE = {code: name for name, code in _SPEC_CODES.items()}
#: the logical dtypes a safetensors file can hold; a kind the installed ml_dtypes lacks (older
#: ones lack float8_e8m0fnu) names no array and no stored tensor (:func:`logical_dtype` refuses
#: it first), so it need not be taken out, and ml_dtypes need not be imported to know
DTYPES = frozenset(_SPEC_CODES)
#: in the specification but packed below one byte per element: no numpy view exists
_PACKED_CODES = frozenset({"F4", "F6_E2M3", "F6_E3M2"})


@functools.cache
def _dtype_of_code(code: str) -> np.dtype:
    """The dtype a code names; ``KeyError`` for one weightstore does not read (an ml_dtypes kind
    the installed ml_dtypes lacks among them). Imports ml_dtypes only for a code of its kinds."""
    name = _NAME_OF_CODE[code]
    if not _installed(name):
        raise KeyError(code)
    return logical_dtype(name)


def _installed(name: str) -> bool:
    """Whether numpy or the installed ml_dtypes has the kind (older ml_dtypes lack float8_e8m0fnu)."""
    return not name.startswith(("bfloat", "float8")) or name in ML_DTYPES


def _held_codes() -> dict[str, str]:
    """Logical dtype -> code, for every dtype this installation reads and writes (for messages)."""
    return {name: code for name, code in _SPEC_CODES.items() if _installed(name)}


@dataclass(slots=True)
class _Pending:
    key: str
    code: str
    shape: tuple[int, ...]
    size: int
    payload: memoryview
    begin: int = 0


class SafetensorsWriter:
    """Writes the data buffer as tensors arrive and the header, which describes it, last."""

    def __init__(self, path: str, planned: Callable[[], list[TensorInfo]] | None = None):
        self._path = path
        self._planned = planned  # every tensor to come: for the header's room, and whether to hold any
        self._plan: list[TensorInfo] | None = None  # what it said, once asked
        self._file = open(path, "w+b", buffering=0)  # noqa: SIM115  # read too: data may move
        self._gathered = bytearray()  # small payloads not yet handed to the kernel (see _put)
        self._tensors: list[_Pending] = []
        self._held: list[_Pending] = []
        self._held_bytes = 0
        self._data_start: int | None = None  # decided when streaming starts
        self._written = 0  # bytes of the data buffer written so far
        self.locations: dict[str, str] = {}
        self.codecs: dict[str, str] = {}
        self._header_metadata: dict[str, str] = {}

    def mark_torch_names(self) -> None:
        """Tell readers the names are PyTorch's: ``__metadata__["format"] = "pt"``, which
        ``transformers`` requires of every safetensors file it loads."""
        self._header_metadata["format"] = "pt"

    def add(self, key: str, dtype_name: str, data: np.ndarray, crc: int | None = None) -> int:
        """Write or hold a tensor; its CRC-32 is ``crc`` where the caller has it, else comes from
        the write when written now, else from a pass over it here (held tensors are written at
        :meth:`commit`, after the manifest is built)."""
        code = _SPEC_CODES.get(dtype_name)
        if code is None:
            raise UnsupportedDTypeError(_unsupported(dtype_name), path=self._path, key=key)
        size = data.nbytes
        tensor = _Pending(key, code, data.shape, size, raw_bytes(data) if size else memoryview(b""))
        self._tensors.append(tensor)
        if self._data_start is None:
            if self._held_bytes + size <= _HOLD_BYTES and not (size >= _PLAN_FROM and self._plan_outgrows_hold()):
                self._held.append(tensor)
                self._held_bytes += size
                return crc32(data) if crc is None else crc  # the array, not its byte view: cheaper for a small one
            self._start_streaming()  # writes what is held; this tensor follows, as if it had been held
        if size % _KEEPS_ALIGNED:
            self._held.append(tensor)  # would misalign what follows: laid out at the end instead
            return crc32(data) if crc is None else crc
        if crc is not None:
            self._write(tensor)
            return crc
        return self._write_checksummed(tensor)

    def _plan_outgrows_hold(self) -> bool:
        """Whether the plan says the file will hold more than :data:`_HOLD_BYTES`: then nothing
        is held for an exact header, every tensor streams as it comes, checksummed in the pass
        that writes it, and a tensor made for the write (a sharded member's column strip) is let
        go at once instead of being kept until the hold is full. Asked once, of a tensor of
        :data:`_PLAN_FROM` or more (a file of small tensors never works the plan out)."""
        if self._plan is None:
            self._plan = self._planned() if self._planned is not None else []
        return sum(info.nbytes for info in self._plan) > _HOLD_BYTES

    def _lay_out_held(self) -> None:
        """Give the held tensors their offsets after everything written: largest item size
        first (stable), as the library lays tensors out, so each starts on its item size."""
        self._held.sort(key=lambda t: -_dtype_of_code(t.code).itemsize)
        for tensor in self._held:
            tensor.begin = self._written
            self._written += tensor.size

    def _write_held(self) -> None:
        for tensor in self._held:
            self._put(tensor.payload)
            tensor.payload = memoryview(b"")  # written: let the caller's array go
        self._held = []

    def _write(self, tensor: _Pending) -> None:
        tensor.begin = self._written
        self._put(tensor.payload)
        self._written += tensor.size
        tensor.payload = memoryview(b"")

    def _write_checksummed(self, tensor: _Pending) -> int:
        tensor.begin = self._written
        crc = write_checksummed(tensor.payload, self._put)
        self._written += tensor.size
        tensor.payload = memoryview(b"")
        return crc

    def _put(self, payload: memoryview) -> None:
        """Write ``payload`` where the file's position is, small ones gathered (:data:`_DIRECT_BYTES`)."""
        if len(payload) < _DIRECT_BYTES:
            self._gathered += payload
            if len(self._gathered) >= _GATHER_BYTES:
                self._flush()
            return
        self._flush()
        _write_all(self._file, payload)

    def _flush(self) -> None:
        if self._gathered:
            _write_all(self._file, memoryview(self._gathered))
            self._gathered = bytearray()

    def _start_streaming(self) -> None:
        """Reserve room for the header and write what is held, except tensors whose size would
        misalign the ones after them: those wait for :meth:`commit`."""
        if self._plan is None:
            self._plan = self._planned() if self._planned is not None else []
        described = [(info.key, len(info.shape)) for info in self._plan] or [(t.key, len(t.shape)) for t in self._tensors]
        room = _LENGTH.size + 2 * _header_estimate(described) + _HEADER_SLACK
        most = _LENGTH.size + MAX_SAFETENSORS_HEADER_BYTES  # readers refuse a longer header, its padding included
        self._data_start = min(room + (-room % _STREAMED_ALIGNMENT), most - most % _STREAMED_ALIGNMENT)
        self._flush()
        self._file.seek(self._data_start)
        held, self._held = self._held, []
        for tensor in held:
            if tensor.size % _KEEPS_ALIGNED:
                self._held.append(tensor)
            else:
                self._write(tensor)

    def commit(self, manifest_text: str) -> None:
        self._lay_out_held()
        header = self._header(manifest_text)
        needed = _aligned(_LENGTH.size + len(header))
        if needed - _LENGTH.size > MAX_SAFETENSORS_HEADER_BYTES:  # the length readers check counts the padding
            raise FormatError(f"the safetensors header would be {needed - _LENGTH.size} bytes (readers refuse over "
                              f"{MAX_SAFETENSORS_HEADER_BYTES}); store these tensors as .npz or .h5", path=self._path)
        if self._data_start is None:  # nothing written yet: the data follows the exact header
            self._data_start = needed
            self._file.seek(needed)
        self._write_held()
        self._flush()
        if needed > self._data_start:
            self._move_data(self._data_start, needed)
            self._data_start = needed
        padded = header + b" " * (self._data_start - _LENGTH.size - len(header))
        _write_at(self._file.fileno(), _LENGTH.pack(len(padded)) + padded, 0)
        self._file.close()

    def _header(self, manifest_text: str) -> bytes:
        document: dict[str, Any] = {METADATA_KEY: {**self._header_metadata, MANIFEST_KEY: seal_manifest(manifest_text)}}
        for t in self._tensors:  # json writes tuples as arrays
            document[t.key] = {"dtype": t.code, "shape": t.shape, "data_offsets": (t.begin, t.begin + t.size)}
        return orjson.dumps(document)  # compact UTF-8, as json.dumps(ensure_ascii=False) but 10x faster

    def _move_data(self, old: int, new: int) -> None:
        """Move the data buffer up from ``old`` to ``new`` in place, last chunk first."""
        fd = self._file.fileno()
        for start in reversed(range(0, self._written, _MOVE_CHUNK)):
            _write_at(fd, os.pread(fd, min(_MOVE_CHUNK, self._written - start), old + start), new + start)

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # closing flushes, and may fail as the write did: report that
            self._file.close()


def _write_all(file: Any, view: memoryview) -> None:
    """All of ``view`` at ``file``'s position (an unbuffered file's write may take only part)."""
    while view:
        view = view[file.write(view):]


def _write_at(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _header_estimate(tensors: list[tuple[str, int]]) -> int:
    """About what the header of ``tensors`` (name, axes) will take, user metadata aside: each
    tensor appears twice (its entry, and the manifest's, escaped), with offsets of up to 20
    digits. A header that outgrows the room reserved from this costs one move of the data
    (a sharded member of 512 column strips, estimated from the 128 held before streaming
    started and not from all 512, moved 256 MB: 0.9 CPU-s/GB); so a writer given the plan
    estimates from every tensor to come."""
    return 512 + sum(2 * len(key.encode("utf-8")) + 24 * ndim + 240 for key, ndim in tensors)


def _aligned(offset: int) -> int:
    return offset + (-offset % ALIGNMENT)


def _unsupported(dtype_name: str) -> str:
    return (f"has dtype {dtype_name}, which safetensors cannot hold "
            f"(it holds {', '.join(sorted(_held_codes()))}); save it as .npz or .h5")


class _Tensor(NamedTuple):
    name: str
    code: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


#: ``_Tensor(*fields)`` without the named tuple's generated ``__new__`` frame (and mappable over tuples)
_new_tensor = tuple.__new__


class _Columns(Mapping):
    """Name -> :class:`_Tensor` of a header :func:`_plain_tensors` proved, each made when asked:
    an open that lists the keys makes none (a file of 100 tensors spent a tenth of its open
    making them all)."""

    def __init__(self, names: list[str], codes: list[str], dtype_of: dict[str, np.dtype], shapes: list[list[int]],
                 begins: list[int], ends: list[int]):
        self._row = dict(zip(names, range(len(names)), strict=True))
        self._names, self._codes, self._dtype_of, self._shapes, self._begins, self._ends = \
            names, codes, dtype_of, shapes, begins, ends

    def codes_and_shapes(self, names: list[str]) -> tuple[list[str], list[tuple[int, ...]]]:
        """The dtype codes and shapes of ``names``, in that order, with no :class:`_Tensor` made."""
        rows = list(map(self._row.__getitem__, names))
        return list(map(self._codes.__getitem__, rows)), list(map(tuple, map(self._shapes.__getitem__, rows)))

    def made(self, names: list[str]) -> list[_Tensor]:
        """``[self[name] for name in names]``, made in C (``map``), not a Python call per tensor."""
        rows = list(map(self._row.__getitem__, names))
        codes = list(map(self._codes.__getitem__, rows))
        return list(map(_new_tensor, itertools.repeat(_Tensor), zip(
            names, codes, map(self._dtype_of.__getitem__, codes), map(tuple, map(self._shapes.__getitem__, rows)),
            map(self._begins.__getitem__, rows), map(self._ends.__getitem__, rows), strict=True)))

    def __getitem__(self, name: str) -> _Tensor:
        i = self._row[name]
        code = self._codes[i]
        return _Tensor(name, code, self._dtype_of[code], tuple(self._shapes[i]), self._begins[i], self._ends[i])

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._row


FORMAT_NAME = "safetensors"


class SafetensorsReader(ReaderDefaults):
    """Reads and checks the whole header at open; each tensor's bytes only when asked."""

    #: what a store made from this reader without a format of its own (a Hugging Face folder's
    #: model.safetensors) says it is, so its state_dict names read as keys as the file's own do
    format = FORMAT_NAME

    def __init__(self, source: ByteSource):
        self._source = source
        self.name = source.name
        document = self._read_header()
        metadata = self._check_metadata(document.pop(METADATA_KEY, None))
        self._tensors = self._check_tensors(document)
        manifest_text = metadata.get(MANIFEST_KEY)
        manifest = parse_manifest(manifest_text, self.name, sealed=True) if manifest_text is not None else None
        self.has_checksums = manifest is not None
        #: key -> the header's name for it, where the two differ (a file written with ``names="torch"``)
        self.stored_names: dict[str, str] = {}
        if manifest is None:
            in_order = sorted(self._tensors)
            with naming(path=self.name):
                names = foreign_keys(zip(in_order, in_order, strict=True), "tensor")
            self._by_key = names
            self._infos: Mapping[str, TensorInfo] = {}  # each made when asked: listing keys needs none
            self.metadata: dict[str, Any] = metadata
            self.created = ""
        else:
            keys = manifest.tensors.key_list()
            locations = manifest.locations
            self._by_key = dict(zip(keys, map(locations.get, keys, keys) if locations else keys, strict=True))
            self._check_manifest(manifest)
            self.stored_names = {key: name for key, name in manifest.locations.items() if name != key}
            self._infos = manifest.tensors
            self.metadata = manifest.metadata
            self.created = manifest.created

    # -- the header ---------------------------------------------------------------------------
    def _read_header(self) -> dict[str, Any]:
        size = self._source.size
        if size < _LENGTH.size:
            raise FormatError(f"not a safetensors file ({size} bytes, shorter than its header length)", path=self.name)
        (length,) = _LENGTH.unpack(bytes(self._source.read_at(0, _LENGTH.size)))
        if size >= _TFRECORD_HEAD and _is_tfrecord(bytes(self._source.read_at(0, _TFRECORD_HEAD))):
            raise FormatError("is a TFRecord file (a TensorBoard events file, or tf.data records), not weights",
                              path=self.name)
        if length > MAX_SAFETENSORS_HEADER_BYTES:
            raise UnsafeFileError(f"safetensors header claims {length} bytes (limit {MAX_SAFETENSORS_HEADER_BYTES})",
                                  path=self.name)
        if _LENGTH.size + length > size:
            raise FormatError(f"safetensors header of {length} bytes runs past the end of the file "
                              f"({size} bytes; truncated, or not a safetensors file)", path=self.name)
        self._data_start = _LENGTH.size + length
        raw = bytes(self._source.read_at(_LENGTH.size, length))
        with naming(path=self.name):  # the bytes as they are: decoded only where the fast parse declines them
            document = jsontext.loads(raw, what="safetensors header", min_bytes=SAFETENSORS_BYTES_PER_CONTAINER)
        if not isinstance(document, dict):
            raise FormatError("safetensors header is not a JSON object", path=self.name)
        return document

    def _check_metadata(self, metadata: Any) -> dict[str, str]:
        """A string map whose strings are Unicode text: JSON's ``\\ud800`` escape makes a lone
        surrogate, which no UTF-8 output (a converted file, ``ws ls --json``) can hold."""
        if metadata is None:  # absent, or null, which the library reads as absent
            return {}
        if not isinstance(metadata, dict):
            raise FormatError(f"safetensors {METADATA_KEY} is not an object of strings", path=self.name)
        for key, value in metadata.items():
            if not isinstance(value, str):
                raise FormatError(f"safetensors {METADATA_KEY} entry {_clip(key)} is not a string", path=self.name)
            try:
                key.encode("utf-8")
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise FormatError(f"safetensors {METADATA_KEY} entry {_clip(key)} holds a lone surrogate, "
                                  "which is no Unicode text", path=self.name) from None
            if MANIFEST_KEY not in metadata and value.startswith(_MANIFEST_START):  # else read unverified, as plain
                raise FormatError(f"safetensors {METADATA_KEY} entry {_clip(key)} holds a weightstore manifest, whose "
                                  f"entry is {MANIFEST_KEY!r}: the header is damaged", path=self.name)
        return metadata

    def _check_tensors(self, document: dict[str, Any]) -> Mapping[str, _Tensor]:
        """Every entry well-formed, its bytes exactly its dtype times its shape, and the
        entries together tiling the data buffer: no overlap, no gap, nothing past the file."""
        data_size = self._source.size - self._data_start
        plain = _plain_tensors(document, data_size)
        if plain is not None:
            return plain
        tensors: dict[str, _Tensor] = {}
        for name, entry in document.items():
            try:  # the common, well-formed case first, cheaply; any surprise is diagnosed below
                code, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
                dtype = _dtype_of_code(code)
            except (TypeError, KeyError, ValueError):
                raise FormatError(self._malformed(entry), path=self.name, key=name) from None
            if (type(shape) is not list or len(shape) > MAX_NDIM
                    or (shape and (set(map(type, shape)) != _JUST_INT or min(shape) < 0))):
                raise FormatError(f"has an invalid shape {_clip(shape)}", path=self.name, key=name)
            if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
                raise FormatError(f"has invalid data_offsets {_clip([begin, end])}", path=self.name, key=name)
            if end > data_size:
                raise FormatError(f"ends at byte {end} of a {data_size}-byte data buffer (truncated file?)",
                                  path=self.name, key=name)
            expected = math.prod(shape) * dtype.itemsize
            if not expected and math.prod(d for d in shape if d) * dtype.itemsize > MAX_ARRAY_BYTES:
                raise FormatError(f"has a shape {_clip(shape)} no array can have", path=self.name, key=name)
            if end - begin != expected:
                raise FormatError(f"{code} {_clip(shape)} needs {expected} bytes "
                                  f"but data_offsets give {end - begin}", path=self.name, key=name)
            tensors[name] = _Tensor(name, code, dtype, tuple(shape), begin, end)
        covered = 0
        for begin, end, name in sorted((t.begin, t.end, t.name) for t in tensors.values()):
            if begin != covered:
                what = "overlaps the tensor before it" if begin < covered else "leaves unindexed bytes before it"
                raise UnsafeFileError(f"{what} (bytes {begin}..{end})", path=self.name, key=name)
            covered = end
        if covered != data_size:
            raise UnsafeFileError(f"{data_size - covered} bytes after the last tensor are indexed by none",
                                  path=self.name)
        return tensors

    def _malformed(self, entry: Any) -> str:
        """Why an entry that failed the quick unpacking is malformed."""
        if not isinstance(entry, dict):
            return "is not described by an object"
        code, offsets = entry.get("dtype"), entry.get("data_offsets")
        if not isinstance(code, str) or code not in _NAME_OF_CODE or not _installed(_NAME_OF_CODE[code]):  # a list: unhashable
            what = "packed sub-byte dtype" if isinstance(code, str) and code in _PACKED_CODES else "unknown dtype"
            return f"has {what} {_clip(code)}; weightstore reads {', '.join(sorted(_held_codes().values()))}"
        if "shape" not in entry:
            return "has no shape"
        return f"has invalid data_offsets {_clip(offsets)}"

    def _check_manifest(self, manifest: Manifest) -> None:
        """The manifest lists each tensor of the header once: by its key, or by the name its
        location gives (a file written with ``names="torch"`` names ``a/b`` ``a.b``), with its
        dtype and shape; compared column by column where the header's were (:class:`_Columns`),
        and tensor by tensor, to name the first that differs, otherwise."""
        stored_as = self._by_key
        listed, present = set(stored_as.values()), set(self._tensors)
        if listed != present or len(listed) != len(stored_as):
            raise FormatError(f"manifest and header disagree (listed but absent: {named(sorted(listed - present))}; "
                              f"present but unlisted: {named(sorted(present - listed))})", path=self.name)
        dtype_names, shapes, _, _ = manifest.tensors.rows()  # by row: no TensorInfo made per tensor
        if isinstance(self._tensors, _Columns):
            codes, stored_shapes = self._tensors.codes_and_shapes(list(stored_as.values()))
            if codes == list(map(_SPEC_CODES.get, dtype_names)) and stored_shapes == shapes:
                return
        for key, dtype_name, shape in zip(manifest.tensors, dtype_names, shapes, strict=True):
            tensor = self._tensors[stored_as[key]]
            if _SPEC_CODES.get(dtype_name) != tensor.code:
                raise FormatError(f"is stored as {tensor.code} but the manifest says {dtype_name}",
                                  path=self.name, key=key)
            if tensor.shape != shape:
                raise FormatError(f"has shape {tensor.shape} but the manifest says {shape}",
                                  path=self.name, key=key)

    # -- the Reader protocol ------------------------------------------------------------------
    def keys(self) -> list[str]:
        return list(self._by_key)

    def info(self, key: str) -> TensorInfo:
        info = self._infos.get(key)
        if info is None:  # a file without a manifest (whose every key is in _by_key), or no such key
            t = self._tensor(key)
            info = TensorInfo(key, _NAME_OF_CODE[t.code], t.shape, t.end - t.begin, None)
        return info

    def _tensor(self, key: str) -> _Tensor:
        name = self._by_key.get(key)
        if name is None:
            raise KeyNotInStoreError("no such tensor", path=self.name, key=key)
        return self._tensors[name]

    def _tensors_of(self, keys: list[str]) -> list[_Tensor]:
        """:meth:`_tensor` of each key, made together (50,000 of them, no Python call each)."""
        try:
            names = list(map(self._by_key.__getitem__, keys))
        except KeyError:
            return [self._tensor(key) for key in keys]  # names the missing key
        if isinstance(self._tensors, _Columns):
            return self._tensors.made(names)
        return list(map(self._tensors.__getitem__, names))

    def extent(self, key: str) -> tuple[int, int]:
        """``(offset, length)`` of a tensor's bytes in the file (a sharded version's index records it)."""
        tensor = self._tensor(key)
        return self._data_start + tensor.begin, tensor.end - tensor.begin

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        tensor = self._tensor(key)
        self._source.check_unchanged(f"tensor {key!r}")  # a mapped file truncated in place: SIGBUS
        start, size = self._data_start + tensor.begin, tensor.end - tensor.begin
        if size > _PREFETCH_BYTES:
            self._source.prefetch(start, size)
        data = self._source.read_at(start, size)
        if verify:
            self._verify(key, data)
        if not size:
            return np.empty(tensor.shape, tensor.dtype)
        array = np.frombuffer(data, dtype=tensor.dtype).reshape(tensor.shape)
        if not array.flags.aligned:  # a foreign writer's layout: views of it would trip up consumers
            array = array.copy()
        return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))

    def read_many(self, keys: list[str], *, verify: bool) -> list[np.ndarray]:
        """Tensors in ``keys``' order: what :meth:`read` returns for each, for microseconds a
        tensor where a file holds 50,000 small ones. From a map with a manifest (the usual case),
        each aligned little-endian tensor is viewed through one array over the whole map and its
        CRC-32 compared as the integer the manifest holds; any other tensor, or one whose CRC
        differs, goes to :meth:`read`, the rule, which reads it or raises the precise error
        (``tests/test_safetensors.py::test_many_tensors_read_alike_on_either_path``)."""
        self._source.check_unchanged(f"{len(keys)} tensors")  # before the map: made now, of the size at open
        mapping = self._source.mapping if isinstance(self._source, MappedFile) else None
        if len(keys) < _FEW or mapping is None or not self.has_checksums:
            return [self.read(key, verify=verify) for key in keys]
        tensors = self._tensors_of(keys)  # announced to the kernel by the store (prefetch)
        table = cast(TensorTable, self._infos)
        crcs = table.rows()[3]
        rows = table.positions(keys).tolist()
        # every array is a view of this one, which holds the map's one export (see npz's reader)
        whole = np.frombuffer(mapping, np.uint8)
        arrays: list[np.ndarray] = []
        with paused_gc():  # an array per tensor, each tracked by the collector
            for key, tensor, row in zip(keys, tensors, rows, strict=True):
                offset, size, dtype = self._data_start + tensor.begin, tensor.end - tensor.begin, tensor.dtype
                if not size or offset % dtype.alignment or not dtype.isnative:
                    arrays.append(self.read(key, verify=verify))
                    continue
                array = np.ndarray(tensor.shape, dtype, whole, offset)
                if verify and crcs[row] != NO_CRC and crcs[row] != crc32(array):
                    arrays.append(self.read(key, verify=verify))
                    continue
                arrays.append(array)
        return arrays

    def keys_by_name(self) -> dict[str, str]:
        """Each tensor's name in the header -> its key (they differ in a file written with ``names="torch"``)."""
        return {name: key for key, name in self._by_key.items()}

    def prefetch(self, keys: list[str]) -> None:
        """Announce the tensors read next: a remote source fetches them at once, a local one
        has the kernel read the stretch they span in one request (read tensor by tensor, a cold
        256 MB file took 0.15-0.18 s; announced at once, 0.09 s)."""
        tensors = self._tensors_of(keys)
        if isinstance(self._source, MappedFile):
            if tensors:
                start = min(t.begin for t in tensors)
                self._source.prefetch(self._data_start + start, max(t.end for t in tensors) - start)
            return
        prefetch_ranges(self._source, lambda: [(self._data_start + t.begin, t.end - t.begin) for t in tensors])

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        """Read a tensor straight into ``out``; False when the file has no checksum to verify it by."""
        info = self.info(key)
        if verify and not info.checksum:
            return False
        tensor = self._tensor(key)
        self._source.check_unchanged(f"tensor {key!r}")
        if out.nbytes:
            self._source.read_into(self._data_start + tensor.begin, out.reshape(-1).view(np.uint8).data)
        if verify:
            self._verify(key, out)
        return True

    def _verify(self, key: str, data: Any) -> None:
        expected = self.info(key).checksum
        if expected:
            actual = checksum(data)
            if actual != expected:
                raise ChecksumError(f"is corrupt (checksum {actual}, manifest {expected})", path=self.name, key=key)

    def close(self) -> None:
        self._source.close()


def _plain_tensors(document: dict[str, Any], data_size: int) -> Mapping[str, _Tensor] | None:
    """The tensors of a header whose every entry is well formed, of a known dtype and no zero
    dimension, and which tile the data buffer exactly, checked column by column at C speed
    (``map`` over the entries, no Python step per tensor); ``None`` when anything needs
    :meth:`SafetensorsReader._check_tensors`'s loop to look, or to name it.

    Fast twin of that loop, which is the rule. Bound by the differential test
    ``tests/test_fast_paths.py::test_safetensors_headers_read_alike_column_wise_and_entry_by_entry``."""
    entries = list(document.values())
    if not entries or set(map(type, entries)) != _JUST_DICT:
        return None
    try:
        codes, shapes, offsets = (list(map(operator.itemgetter(field), entries))
                                  for field in ("dtype", "shape", "data_offsets"))
        dtype_of = {code: _dtype_of_code(code) for code in set(codes)}
    except (KeyError, TypeError):  # a field missing, a dtype unhashable or unknown
        return None
    if (set(map(type, shapes)) != _JUST_LIST or max(map(len, shapes)) > MAX_NDIM
            or set(map(type, offsets)) != _JUST_LIST or set(map(len, offsets)) != _JUST_TWO):
        return None
    dims, bounds = list(itertools.chain.from_iterable(shapes)), list(itertools.chain.from_iterable(offsets))
    if (operator.countOf(map(type, bounds), int) != len(bounds)
            or dims and (operator.countOf(map(type, dims), int) != len(dims) or min(dims) <= 0)):
        return None
    begins, ends = bounds[0::2], bounds[1::2]
    itemsizes = map(operator.attrgetter("itemsize"), map(dtype_of.__getitem__, codes))
    if list(map(operator.mul, map(math.prod, shapes), itemsizes)) != list(map(operator.sub, ends, begins)):
        return None
    # so each tensor holds a byte or more: laid end to end from 0 to the buffer's end, in the
    # header's order or the data's, none starts before 0 or ends past the buffer
    starts, stops = begins, ends
    if begins[1:] != ends[:-1]:
        order = sorted(range(len(entries)), key=begins.__getitem__)
        starts, stops = list(map(begins.__getitem__, order)), list(map(ends.__getitem__, order))
    if starts[0] != 0 or stops[-1] != data_size or starts[1:] != stops[:-1]:
        return None
    return _Columns(list(document), codes, dtype_of, shapes, begins, ends)


def _clip(value: Any) -> str:
    """A value from a hostile header, short enough for one error line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _open_reader(location: Any, name: str, *, mmap: bool = True) -> SafetensorsReader:
    """``mmap=False`` reads local tensors into memory they own instead of viewing a map of the file."""
    return open_source(location, name, SafetensorsReader, index_at_end=False, mmap=mmap)


_TFRECORD_HEAD = 12  # a record's 8-byte length and the masked CRC-32C of those 8 bytes


def _is_tfrecord(head: bytes) -> bool:
    """Whether the file opens as a TFRecord does (TensorBoard's ``events.out.tfevents.*``): its
    first 8 bytes, a length like a safetensors header's, are followed by their masked CRC-32C,
    where a safetensors header has ``{``."""
    return unmask_crc(int.from_bytes(head[8:12], "little")) == crc32c(head[:8])


def _looks_like_safetensors(head: bytes) -> bool:
    """Eight bytes are all a sniffer gets: a header length the library would accept (the
    high bytes of any such length are zero); the reader then checks the rest."""
    return len(head) >= _LENGTH.size and 2 <= _LENGTH.unpack(head[: _LENGTH.size])[0] <= MAX_SAFETENSORS_HEADER_BYTES


FORMAT = Format(
    name=FORMAT_NAME,
    suffixes=(".safetensors",),
    magic=_looks_like_safetensors,
    open_reader=_open_reader,
    open_writer=lambda path, compress, planned=None: SafetensorsWriter(path, planned),
    planned_writer=True,
    dtypes=DTYPES,
    compresses=False,
    torch_names=True,
    reserved_keys=frozenset({METADATA_KEY}),
)
