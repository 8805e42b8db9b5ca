"""HDF5: one dataset per key in groups that follow the scope path, manifest in a root attribute.

A key that is also the scope of other keys (TF1 keeps the slot ``w/Adagrad`` under ``w``)
becomes a group, and its own array moves into the reserved dataset ``VALUE`` inside it; the
manifest records that location. The reader refuses everything that would make it read
outside the file or allocate more than the file can hold: links, external storage, virtual
datasets, unknown filters, and sizes the stored bytes cannot back.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import BinaryIO, NamedTuple

import h5py
import numpy as np

from weightstore.core.keys import RESERVED_PREFIX, join_scope
from weightstore.core.limits import HDF5_FILTER_SLACK_BYTES, MAX_HDF5_DEPTH, MAX_HDF5_FILTER_RATIO, MAX_MANIFEST_BYTES
from weightstore.core.manifest import (
    ML_DTYPES,
    Manifest,
    TensorInfo,
    checksum,
    crc32,
    crc32_before_write,
    dtype_name,
    from_storage,
    parse_manifest,
    raw_bytes,
    shape_nbytes,
    storage_dtype,
)
from weightstore.errors import (
    ChecksumError,
    FormatError,
    KeyNotInStoreError,
    StoreClosedError,
    UnsafeFileError,
    WeightStoreError,
    WriteError,
    named,
    naming,
)
from weightstore.formats import Format, ReaderDefaults, foreign_keys
from weightstore.formats._hdf5_bytes import (
    READ_AHEAD_WINDOW,
    ObjectHeader,
    ReadAt,
    check_object,
    check_root_group,
    check_vlen_attribute,
    read_ahead,
)
from weightstore.io._local import MappedFile
from weightstore.io.files import open_regular

MANIFEST_ATTRIBUTE = "weightstore"
_KERAS_DTYPE_ATTRIBUTE = b"dtype"  # Keras's label of the raw bytes it stores bfloat16 as
_LABEL_BYTES = 64  # longer than any dtype's name: such an attribute is no label
VALUE = RESERVED_PREFIX + "_value__"
#: where a dataset waits while its name becomes a group; reserved, so no key segment can clash
_MOVING = RESERVED_PREFIX + "_moving__"
_SAFE_FILTERS = {h5py.h5z.FILTER_DEFLATE, h5py.h5z.FILTER_SHUFFLE, h5py.h5z.FILTER_FLETCHER32, 32000}
_MAGIC = b"\x89HDF\r\n\x1a\n"
_MIN_COMPRESSED_BYTES = 4096
#: mapped tensors at least this big are announced to the kernel before they are read (as safetensors does)
_ANNOUNCED_FROM = 1 << 20
#: an uncompressed file whose tensors average at least this has every header made before any
#: data (:class:`Hdf5Writer`); below it, headers are a large part of the file and the lookups
#: of datasets made early cost more than the stream they keep whole
_HEADERS_FIRST_FROM = 256 << 10
_LINK_KINDS = {h5py.h5l.TYPE_SOFT: "a SoftLink", h5py.h5l.TYPE_EXTERNAL: "an ExternalLink"}
#: what h5py raises for a corrupt file or a failed write, depending on which C call failed
_H5PY_ERRORS = (OSError, RuntimeError, KeyError, ValueError, TypeError, IndexError, UnicodeDecodeError)


@contextlib.contextmanager
def _raw_bytes(location, descriptor: int | None) -> Iterator[tuple[ReadAt, int, Callable[[list[int]], None]]]:
    """``(read_at, size, queue)`` over the file's bytes, beside h5py's own access to it
    (a local file's through ``descriptor``, the one h5py opened).

    A local file is read 64 KB at a time (:func:`read_ahead`: its structures lie close
    together), and ``queue(offsets)`` has the kernel read the windows holding those offsets
    all at once: in a cold file of large datasets each header lies beside its data, and checked
    one after another each was a wait for the disk (256 headers: 0.08-0.10 s to open 256 MB).
    A file object (a URL) keeps its own buffering, which decides what is fetched.
    """
    if descriptor is not None:
        size = os.fstat(descriptor).st_size
        yield (read_ahead(lambda offset, length: os.pread(descriptor, length, offset)), size,
               functools.partial(_queue_windows, descriptor, size))
        return
    position = location.tell()
    size = location.seek(0, os.SEEK_END)

    def read_at(offset: int, length: int) -> bytes:
        location.seek(offset)  # h5py's file-object driver seeks before each of its reads too
        return location.read(length)

    try:
        yield read_at, size, lambda offsets: None
    finally:
        location.seek(position)


def _queue_windows(descriptor: int, size: int, offsets: list[int]) -> None:
    """``posix_fadvise(WILLNEED)`` of each :func:`read_ahead` window that holds one of ``offsets``,
    each window once (the headers of small datasets share one). Only advice: an offset a hostile
    file puts past its end (or past what ``off_t`` holds) is left to the checks that read it."""
    if not hasattr(os, "posix_fadvise"):
        return
    end = -1
    for offset in sorted(offset for offset in offsets if 0 <= offset < size):
        if offset >= end:
            with contextlib.suppress(OSError):
                os.posix_fadvise(descriptor, offset, READ_AHEAD_WINDOW, os.POSIX_FADV_WILLNEED)
            end = offset + READ_AHEAD_WINDOW


def _links(group: h5py.h5g.GroupID) -> list[tuple[bytes, int, int]]:
    """``(name, link type, address)`` of each link in one group, without descending."""
    links: list[tuple[bytes, int, int]] = []
    group.links.iterate(lambda name, info: links.append((name, info.type, info.u)), info=True)
    return links


@contextlib.contextmanager
def _as_write_error(path: str) -> Iterator[None]:
    """A failed HDF5 write as a :class:`WriteError` naming ``path``, with the errno h5py kept."""
    try:
        yield
    except WeightStoreError:
        raise
    except _H5PY_ERRORS as exc:
        raise _write_error(path, exc) from None


def _write_error(path: str, exc: Exception, key: str | None = None) -> WriteError:
    detail = (str(exc).splitlines() or [""])[0][:300]
    return WriteError(getattr(exc, "errno", None) or 0, f"writing HDF5 failed ({detail})", path=path, key=key)


@contextlib.contextmanager
def _as_format_error(path: str, doing: str = "unreadable HDF5", key: str | None = None) -> Iterator[None]:
    """Turn whatever h5py raises into a :class:`FormatError` naming ``path`` (and ``key``, the tensor read)."""
    try:
        yield
    except WeightStoreError:
        raise
    except _H5PY_ERRORS as exc:
        raise _format_error(path, doing, exc, key) from None


def _format_error(path: str, doing: str, exc: Exception, key: str | None = None) -> FormatError:
    detail = (str(exc).splitlines() or [""])[0][:300]  # HDF5's messages run to many lines
    return FormatError(f"{doing} ({type(exc).__name__}: {detail})", path=path, key=key)


class _Reading(NamedTuple):
    """How the tensors of one manifest dtype are read, worked out once per file."""

    stored: np.dtype  #: what the dataset must hold, little-endian (ml_dtypes as raw bytes)
    memory_type: h5py.h5t.TypeID  #: HDF5's type for it: making one took two thirds of a 1 KB read
    logical: np.dtype | None  #: the view callers get; None when it is ``stored`` itself


#: bytes per h5py write when checksumming as we write: each write call costs h5py about 0.1 ms,
#: so 1 MB blocks took 30% more CPU than 4 MB ones (still in cache when written) here
_WRITE_BLOCK = 4 << 20


def _write_rows(dataset: h5py.h5d.DatasetID, data: np.ndarray, memory_type: h5py.h5t.TypeID) -> int:
    """Write ``data`` in blocks of whole rows (of whole chunks, when chunked, so no chunk is
    written twice) and return its CRC-32, each block checksummed just before it is written.
    Through HDF5's own calls: h5py's slicing took 0.1 CPU-s/GB of a 1 GB save in Python."""
    rows = max(1, _WRITE_BLOCK // max(1, data[0].nbytes))
    creation = dataset.get_create_plist()
    if creation.get_layout() == h5py.h5d.CHUNKED:
        chunk_rows = creation.get_chunk()[0]
        rows = -(-rows // chunk_rows) * chunk_rows
    space = dataset.get_space()
    corner = (0,) * (data.ndim - 1)
    crc = 0
    for start in range(0, data.shape[0], rows):
        block = data[start : start + rows]
        crc = crc32_before_write(raw_bytes(block), crc)  # ISA-L's faster kernel, without the GIL
        space.select_hyperslab((start, *corner), block.shape)
        dataset.write(h5py.h5s.create_simple(block.shape), space, block, memory_type)
    return crc


def _keras_labelled(dataset: h5py.h5d.DatasetID, stored: np.dtype) -> np.dtype | None:
    """The ml_dtypes kind of raw bytes a Keras file labels (Keras stores bfloat16 as opaque
    ``V2`` with an attribute ``dtype="bfloat16"``, and reads it back by that label), or ``None``.
    The label is read only when it is a short attribute and names a kind of the bytes' width."""
    if not h5py.h5a.exists(dataset, _KERAS_DTYPE_ATTRIBUTE):
        return None
    attribute = h5py.h5a.open(dataset, _KERAS_DTYPE_ATTRIBUTE)
    if attribute.get_storage_size() > _LABEL_BYTES:
        return None
    label = h5py.AttributeManager(h5py.Dataset(dataset)).get("dtype")
    label = label.decode("utf-8", "replace") if isinstance(label, bytes) else label
    kind = ML_DTYPES.get(label) if isinstance(label, str) else None
    return kind if kind is not None and kind.itemsize == stored.itemsize else None


def _check_stored_size(dataset: h5py.h5d.DatasetID, path: str, key: str, nbytes: int) -> None:
    """For a dataset whose header shows its bytes lie plainly in the file: they must all be there."""
    stored = dataset.get_storage_size()
    if stored == 0 and nbytes:  # h5py's create_dataset without data: its readers make up the fill value
        raise FormatError(f"was made but never written: the file holds none of its {nbytes} bytes", path=path, key=key)
    if stored < nbytes:
        raise FormatError(f"declares {nbytes} bytes but the file stores {stored}", path=path, key=key)


def _check_storage(dataset: h5py.h5d.DatasetID, path: str, key: str, nbytes: int) -> None:
    """For any other dataset, HDF5's own account of where its bytes are and how they are encoded."""
    plist = dataset.get_create_plist()
    if plist.get_layout() == h5py.h5d.VIRTUAL:
        raise UnsafeFileError("is a virtual dataset; only data inside the file is read", path=path, key=key)
    if plist.get_external_count():
        raise UnsafeFileError("keeps its data in external files; only data inside the file is read", path=path, key=key)
    filters = [plist.get_filter(i)[0] for i in range(plist.get_nfilters())]
    unknown = [f for f in filters if f not in _SAFE_FILTERS]
    if unknown:
        raise UnsafeFileError(f"uses HDF5 filters {unknown}; only gzip, lzf, shuffle and fletcher32 are read",
                              path=path, key=key)
    if not filters:
        _check_stored_size(dataset, path, key, nbytes)
    elif nbytes > dataset.get_storage_size() * MAX_HDF5_FILTER_RATIO + HDF5_FILTER_SLACK_BYTES:
        raise UnsafeFileError(f"declares {nbytes} bytes from {dataset.get_storage_size()} compressed; "
                              "refusing (bomb?)", path=path, key=key)


class Hdf5Writer:
    """Writes through HDF5 with neither a chunk cache nor a sieve buffer.

    With a chunk cache, compressed chunks are written when the file is flushed or closed;
    with a sieve buffer (64 KB by default), so are the bytes of small uncompressed datasets,
    when the dataset is closed. HDF5 1.14 crashes the process (SIGSEGV) when such a deferred
    write fails (disk full, file size limit). Written through, the failure surfaces in
    :meth:`add`, and closing after it is safe. A failure is a :class:`WriteError` (an
    ``OSError``) naming the file.

    **Headers first.** HDF5 puts each dataset's header where the file ends when it is made,
    so made one by one, headers and groups lie between the data of one tensor and the next.
    A cold read then streams the data in pieces around them: 0.17-0.21 s for a 256 MB file
    against 0.10-0.11 s with every header made first and the data after, in one stretch (the
    same bytes; 173 reads of the disk to open the file before, 6 after). So an uncompressed file
    of large tensors (:data:`_HEADERS_FIRST_FROM`) has its groups and datasets made from
    ``planned`` before any data is written; :meth:`add` opens each again by name.
    """

    def __init__(self, path: str, compress: bool | str, planned: Callable[[], list[TensorInfo]] | None = None):
        self._path = path
        access = h5py.h5p.create(h5py.h5p.FILE_ACCESS)  # what h5py.File(path, "w", ...) makes, and no sieve buffer
        access.set_libver_bounds(h5py.h5f.LIBVER_EARLIEST, h5py.h5f.LIBVER_V110)
        cache = list(access.get_cache())
        cache[2] = 0  # chunk cache bytes
        access.set_cache(*cache)
        access.set_sieve_buf_size(0)
        with _as_write_error(path):
            self._file = h5py.File(h5py.h5f.create(os.fsencode(path), h5py.h5f.ACC_TRUNC, fapl=access))
        self._compress = compress
        self.locations: dict[str, str] = {}
        self.codecs: dict[str, str] = {}
        #: scope -> its group, and the keys written at their own path, so that placing a tensor
        #: asks HDF5 nothing (each lookup by name cost as much as writing a small tensor)
        self._groups: dict[str, h5py.Group] = {"": self._file}
        self._at_own_path: set[str] = set()
        self._plain_creation = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        self._plain_creation.set_obj_track_times(False)  # as h5py's create_dataset: files differ only by content
        self._types: dict[np.dtype, tuple[h5py.h5t.TypeID, h5py.h5t.TypeID]] = {}
        #: the keys whose datasets were made before their data
        self._made: set[str] = set()
        if planned is not None and not compress:
            try:
                self._make_headers(planned())
            except BaseException:
                self.abort()
                raise

    def _make_headers(self, planned: list[TensorInfo]) -> None:
        if not planned or sum(info.nbytes for info in planned) < _HEADERS_FIRST_FROM * len(planned):
            return
        for info in planned:
            try:
                self._create_plain(*self._place(info.key), info.shape, storage_dtype(info.dtype))
            except _H5PY_ERRORS as exc:
                raise _write_error(self._path, exc, info.key) from None
            self._made.add(info.key)

    def add(self, key: str, dtype_name: str, data: np.ndarray, crc: int | None = None) -> int:
        try:  # not _as_write_error: a generator context per tensor cost a tenth of writing 1 KB
            return self._add(key, data, crc)
        except WeightStoreError:
            raise
        except _H5PY_ERRORS as exc:
            raise _write_error(self._path, exc, key) from None

    def _add(self, key: str, data: np.ndarray, crc: int | None) -> int:
        if key in self._made:
            self._made.discard(key)
            path = self.locations.get(key, key)  # moved inside its group since, if it became a scope
            dataset = h5py.h5d.open(self._file.id, path.encode("utf-8"))
            if dataset.shape == data.shape and dataset.dtype == data.dtype:
                return self._write_plain(dataset, data, crc)
            del self._file[path]  # not what was planned: made anew where it was
            parent_path, _, leaf = path.rpartition("/")
            parent = self._file[parent_path] if parent_path else self._file
        else:
            parent, leaf = self._place(key)
        compressed = self._compress and data.ndim and data.nbytes >= _MIN_COMPRESSED_BYTES
        if compressed:  # True and "shuffle" alike: HDF5's own shuffle filter, which h5py reads
            options = {"compression": "gzip", "compression_opts": 4, "shuffle": data.dtype.itemsize > 1}
            if data.nbytes > _WRITE_BLOCK:
                created = parent.create_dataset(leaf, shape=data.shape, dtype=data.dtype, **options)
                return _write_rows(created.id, data, self._types_of(data.dtype)[1])
            parent.create_dataset(leaf, data=data, **options)
            return crc32(data)
        return self._write_plain(self._create_plain(parent, leaf, data.shape, data.dtype), data, crc)

    def _place(self, key: str) -> tuple[h5py.Group, str]:
        """The group and name ``key``'s dataset goes in (a key that is already the scope of
        other keys goes inside its group, as :data:`VALUE`), recorded in :attr:`locations`."""
        parent_key, _, leaf = key.rpartition("/")
        parent = self._group_for(parent_key)
        inside = self._groups.get(key)
        if inside is not None:  # the key is already the scope of other keys: store it inside
            self.locations[key] = join_scope(key, VALUE)
            return inside, VALUE
        self._at_own_path.add(key)
        return parent, leaf

    def _create_plain(self, parent: h5py.Group, name: str, shape: tuple[int, ...], dtype: np.dtype) -> h5py.h5d.DatasetID:
        """An uncompressed dataset through the HDF5 calls h5py's ``create_dataset`` makes (the
        same file), without its argument handling, which took longer than HDF5's own work on
        a 1 KB tensor; types are made once per dtype. Its storage is allocated at the first write."""
        return h5py.h5d.create(parent.id, name.encode("utf-8"), self._types_of(dtype)[0], h5py.h5s.create_simple(shape),
                               dcpl=self._plain_creation)

    def _types_of(self, dtype: np.dtype) -> tuple[h5py.h5t.TypeID, h5py.h5t.TypeID]:
        """``(stored type, memory type)`` of ``dtype``, made once per dtype."""
        types = self._types.get(dtype)
        if types is None:
            types = h5py.h5t.py_create(dtype, logical=True), h5py.h5t.py_create(dtype)
            self._types[dtype] = types
        return types

    def _write_plain(self, dataset: h5py.h5d.DatasetID, data: np.ndarray, crc: int | None) -> int:
        """Write an uncompressed dataset in full; its CRC-32 (``crc`` where given: not checksummed)."""
        if crc is None and data.nbytes > _WRITE_BLOCK:
            return _write_rows(dataset, data, self._types_of(data.dtype)[1])
        dataset.write(h5py.h5s.ALL, h5py.h5s.ALL, data, self._types_of(data.dtype)[1])
        return crc32(data) if crc is None else crc

    def _group_for(self, scope: str) -> h5py.Group:
        group = self._groups.get(scope)
        if group is not None:
            return group
        group = self._file
        walked = ""
        for segment in scope.split("/"):
            walked = join_scope(walked, segment)
            known = self._groups.get(walked)
            if known is None:
                if walked in self._at_own_path:  # a key is becoming a scope: move its array in
                    group.move(segment, _MOVING)
                    known = group.create_group(segment)
                    group.move(_MOVING, f"{segment}/{VALUE}")
                    self._at_own_path.discard(walked)
                    self.locations[walked] = join_scope(walked, VALUE)
                else:
                    known = group.create_group(segment)
                self._groups[walked] = known
            group = known
        return group

    def commit(self, manifest_text: str) -> None:
        with _as_write_error(self._path):
            self._file.attrs[MANIFEST_ATTRIBUTE] = manifest_text
            self._file.close()

    def abort(self) -> None:
        with contextlib.suppress(Exception):  # closing flushes, and may fail as the write did: report that error
            self._file.close()


def _h5_file(location, descriptor: int | None) -> tuple[h5py.File, BinaryIO | None]:
    """libhdf5's file of ``location``, opened as the checked file ``descriptor`` where there is one.

    Opened by ``/proc/self/fd/N``, which names that very file (Linux); without ``/proc``, by the
    name again, which a rename since the check may have swapped. Not h5py's ``driver="fileobj"``:
    it cost 40% more CPU to open and walk 2,000 datasets and 15-40% to read them, every read a
    Python call. That driver reads only a file removed since its check (another file renamed over
    its name), which libhdf5 cannot open by ``/proc`` (it resolves the link, whose target is gone):
    the file object is returned too, to be closed with the store.
    """
    through = f"/proc/self/fd/{descriptor}"
    if descriptor is None or not os.path.exists(through):
        return h5py.File(location, "r"), None
    try:
        return h5py.File(through, "r"), None
    except OSError:
        if os.fstat(descriptor).st_nlink:
            raise
    removed = os.fdopen(os.dup(descriptor), "rb")
    try:
        return h5py.File(removed, "r"), removed
    except BaseException:
        removed.close()
        raise


class RemoteHDF5Warning(UserWarning):
    """An HDF5 file read from an object store: h5py's small reads move many times what is asked."""


_WARNED: set[str] = set()  # folders of object storage whose HDF5 files have been warned about


class Hdf5Reader(ReaderDefaults):
    """Reads the manifest and the tree of datasets at open; each tensor only when asked.

    Every h5py call on the file runs inside :func:`_as_format_error` (:meth:`read` does the
    same inline): a corrupt file makes h5py raise most builtins, and each becomes a
    :class:`FormatError` naming file and key. Datasets are read through HDF5's low-level calls,
    which on 50,000 tensors of 1 KB take about half the time of h5py's ``File[path][()]``.

    With ``mapped`` (a local file), a contiguous dataset stored as it is read (no filter, the
    dtype and byte order of the array) is a read-only view of the file mapped, as an npz tensor
    is: libhdf5 would copy it from the page cache into new memory, which took longer than the
    disk (256 MB: 0.15 s warm) and held the model a second time.
    """

    def __init__(self, location, name: str, *, mapped: bool = True):
        self.name = name
        folder = name.rsplit("/", 1)[0]
        if getattr(location, "fs", None) is not None and folder not in _WARNED:  # an object store, not a local file
            _WARNED.add(folder)  # once a folder: a follower opens one file of it each version
            warnings.warn(RemoteHDF5Warning(
                f"{name}: HDF5 from an object store moves many times the bytes it reads (h5py reads in "
                "small pieces: a one-scope load moved 51x its bytes); keep remote weights as npz or "
                "safetensors (ws convert in.h5 out.npz)"), stacklevel=2)
        # a local file is opened and checked once (a FIFO would make libhdf5 wait for a writer), and
        # everything reads that file: the map, the raw bytes, and libhdf5 through /proc/self/fd
        self._map = MappedFile(location) if mapped and isinstance(location, str) else None
        unmapped = open_regular(location) if self._map is None and isinstance(location, str) else None
        try:
            checked = self._map if self._map is not None else unmapped
            descriptor = checked.fileno() if checked is not None else None
            with _as_format_error(name, "not a readable HDF5 file"):
                self._file, self._removed = _h5_file(location, descriptor)
            try:
                with _as_format_error(name), _raw_bytes(location, descriptor) as (read_at, size, queue):
                    self._raw = read_at, size, self._file.userblock_size
                    self._manifest = self._read_manifest()
                    self._datasets = self._walk(queue)
                self._paths = self._keyed(set(self._datasets))
            except BaseException:
                self._file.close()
                if self._removed is not None:
                    self._removed.close()
                raise
        except BaseException:
            if self._map is not None:
                self._map.close()
            raise
        finally:
            if unmapped is not None:
                unmapped.close()
        manifest = self._manifest
        self.metadata = manifest.metadata if manifest else {}
        self.created = manifest.created if manifest else ""
        self.has_checksums = manifest is not None
        self._infos: dict[str, TensorInfo] = dict(manifest.tensors) if manifest else {}
        self._readings: dict[str, _Reading] = {}
        self._memory_types: dict[np.dtype, h5py.h5t.TypeID] = {}

    def _keyed(self, found: set[str]) -> dict[str, str]:
        """Key -> dataset path. A manifest must name every dataset exactly once, each key at its
        own path (or the reserved dataset inside it): no key may read another's data, none hide.
        Without a manifest each path is its key, so a weightstore file whose manifest attribute
        is damaged (its ``VALUE`` datasets then name no key) is refused, not read unverified."""
        if self._manifest is None:
            with naming(path=self.name):
                return foreign_keys(((path, path) for path in sorted(found)), "dataset")
        paths = {}
        for key in self._manifest.tensors:
            path = self._manifest.locations.get(key, key)
            if path not in (key, join_scope(key, VALUE)):
                raise FormatError(f"manifest puts tensor {key!r} at {path!r}, outside its own name", path=self.name)
            paths[key] = path
        unknown = sorted(set(paths.values()) - found)
        unlisted = sorted(found - set(paths.values()))
        if unknown or unlisted:
            raise FormatError(
                f"manifest and datasets disagree (listed but absent: {named(unknown)}; "
                f"present but unlisted: {named(unlisted)})", path=self.name
            )
        return paths

    def _read_manifest(self) -> Manifest | None:
        """The manifest attribute, its size bounded before HDF5 reads it and before any JSON is parsed.

        It must be one string. A fixed-length string's size is known before reading and is
        checked first. A variable-length one (what h5py writes for a ``str``, and what we
        write) keeps only a 16-byte heap reference in the attribute, which HDF5 follows
        blindly (allocating what it claims, looping on a corrupt heap):
        :func:`check_vlen_attribute` checks the reference and its heap object in the file's
        bytes first, and the text's length is checked again before parsing.
        """
        read_at, size, base = self._raw  # first: HDF5 walks the root header to find any attribute
        with naming(path=self.name):
            check_vlen_attribute(read_at, size, base, MANIFEST_ATTRIBUTE, MAX_MANIFEST_BYTES)
        if MANIFEST_ATTRIBUTE not in self._file.attrs:
            return None
        attribute = self._file.attrs.get_id(MANIFEST_ATTRIBUTE)
        string = h5py.check_string_dtype(attribute.dtype)
        if attribute.shape != () or string is None:
            raise FormatError(f"manifest attribute is not one text value ({attribute.dtype}, shape {attribute.shape})", path=self.name)
        if string.length is not None and attribute.get_storage_size() > MAX_MANIFEST_BYTES:
            raise UnsafeFileError(f"manifest attribute is too large ({attribute.get_storage_size()} bytes)", path=self.name)
        text = self._file.attrs[MANIFEST_ATTRIBUTE]
        if isinstance(text, np.ndarray) and text.shape == ():
            text = text[()]
        if not isinstance(text, (str, bytes)):
            raise FormatError("manifest attribute is not text", path=self.name)
        size = len(text)
        if isinstance(text, str) and MAX_MANIFEST_BYTES // 4 < size <= MAX_MANIFEST_BYTES:
            size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_MANIFEST_BYTES:
            raise UnsafeFileError(f"manifest attribute is too large ({size} bytes, limit {MAX_MANIFEST_BYTES})", path=self.name)
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return parse_manifest(text, self.name)

    def _walk(self, queue: Callable[[list[int]], None]) -> dict[str, ObjectHeader]:
        """The path of every dataset and what its header says (whether its bytes lie plainly in
        the file, and where), refusing links that leave the tree.

        One group at a time with an explicit stack (HDF5's own recursive visit overflows the C
        stack on groups nested 10,000 deep, and takes seconds at 3,000), refusing nesting
        deeper than :data:`MAX_HDF5_DEPTH` before descending into it, and checking each object's
        header and each group's symbol table (:func:`check_object`) before HDF5 opens or lists
        it. That check also says what each object is, which HDF5 would otherwise work out by
        walking the header again (a third of the time to open a file of 50,000 small tensors).
        """
        with naming(path=self.name):  # once around the walk, not once per object: the byte checks name no file
            return self._walk_tree(queue)

    def _walk_tree(self, queue: Callable[[list[int]], None]) -> dict[str, ObjectHeader]:
        read_at, size, base = self._raw
        found: dict[str, ObjectHeader] = {}
        seen: set = set()
        check_root_group(read_at, size, base)
        pending: list[tuple[h5py.h5g.GroupID, str, int]] = [(self._file.id, "", 0)]
        while pending:
            group, prefix, depth = pending.pop()
            links = _links(group)
            queue([base + address for _, kind, address in links if kind == h5py.h5l.TYPE_HARD])
            for raw, kind, address in links:
                try:
                    path = join_scope(prefix, raw.decode("utf-8"))
                except UnicodeDecodeError:
                    raise FormatError(f"an object name is not valid UTF-8: {raw!r}", path=self.name) from None
                if kind != h5py.h5l.TYPE_HARD:
                    what = _LINK_KINDS.get(kind, "a user-defined link")
                    raise UnsafeFileError(f"{path!r} is {what}; only plain datasets are read", path=self.name)
                if address in seen:
                    raise UnsafeFileError(f"{path!r} links to an object seen before", path=self.name)
                seen.add(address)
                header = check_object(read_at, size, base, address)
                if header.is_dataset:
                    found[path] = header
                elif not header.is_group:
                    raise FormatError(f"{path!r} is neither a group nor a dataset", path=self.name)
                elif depth + 1 >= MAX_HDF5_DEPTH:
                    raise UnsafeFileError(f"groups nest deeper than {MAX_HDF5_DEPTH} levels at {path[:200]!r}", path=self.name)
                else:
                    pending.append((h5py.h5g.open(group, raw), path, depth + 1))
        return found

    def keys(self) -> list[str]:
        return list(self._infos) if self._manifest else sorted(self._paths)

    def prefetch(self, keys: list[str]) -> None:
        """Announce the stretch of the mapped file that holds these tensors' bytes, once (as
        safetensors does), rather than tensor by tensor as each is read: announced in steps, a
        cold 256 MB load (written headers first) took 0.275 s, announced at once 0.187 s (medians
        of eleven each, interleaved).
        Where their headers said (:func:`check_object`); a remote file is read by h5py."""
        if self._map is None:
            return
        extents = [extent for key in keys if (path := self._paths.get(key)) is not None
                   and (extent := self._datasets[path].extent) is not None and extent[1]]
        if extents:
            start = min(offset for offset, _ in extents)
            self._map.prefetch(start, max(offset + length for offset, length in extents) - start)

    def _open_dataset(self, key: str) -> tuple[h5py.h5d.DatasetID, tuple[int, ...]]:
        """The dataset of ``key`` through HDF5's low-level calls (h5py's ``File[path]`` and
        ``Dataset`` wrappers cost more than HDF5's own work on a small tensor), and its shape."""
        path = self._paths.get(key)
        if path is None:
            raise KeyNotInStoreError("no such tensor", path=self.name, key=key)
        if not self._file.id.valid:
            raise StoreClosedError(f"store is closed; cannot read tensor {key!r}", path=self.name)
        dataset = h5py.h5d.open(self._file.id, path.encode("utf-8"))
        space = dataset.get_space()
        if space.get_simple_extent_type() == h5py.h5s.NULL:
            raise FormatError("has no shape (empty dataspace)", path=self.name, key=key)
        return dataset, space.shape

    def info(self, key: str) -> TensorInfo:
        info = self._infos.get(key)
        if info is None:
            with _as_format_error(self.name, key=key):
                dataset, shape = self._open_dataset(key)
                dtype = dataset.dtype
            if dtype.kind == "V":
                labelled = _keras_labelled(dataset, dtype)
                name = dtype_name(labelled, key) if labelled is not None else f"V{dtype.itemsize}"
            else:
                name = dtype_name(dtype, key)
            info = TensorInfo(key, name, shape, shape_nbytes(shape, dtype.itemsize))
            self._infos[key] = info
        return info

    def extent(self, key: str) -> tuple[int, int]:
        """``(offset, length)`` of a tensor's bytes in the file (a sharded version's index records
        it, and readers of a region fetch byte ranges of it): only a contiguous dataset, neither
        chunked nor compressed, has its bytes as they are in memory; an empty one is ``(0, 0)``."""
        with _as_format_error(self.name, key=key):
            dataset, _ = self._open_dataset(key)
            offset, size = dataset.get_offset(), dataset.get_storage_size()
        if offset is None and size:
            raise FormatError("is chunked or compressed; its bytes are not a plain range of the file",
                              path=self.name, key=key)
        return offset or 0, size

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        try:  # not _as_format_error: a generator context per read cost a tenth of reading 1 KB
            return self._read(key, verify)
        except WeightStoreError:
            raise
        except _H5PY_ERRORS as exc:
            raise _format_error(self.name, "unreadable HDF5", exc, key) from None

    def _read(self, key: str, verify: bool) -> np.ndarray:
        dataset, shape = self._open_dataset(key)
        info = self._infos.get(key) if self._manifest else None
        if info is None:
            return self._read_unlisted(key, dataset, shape)
        reading = self._readings.get(info.dtype) or self._reading(info.dtype)
        # HDF5's comparison of the types first: cheaper than h5py's translation of the stored
        # type into a dtype, and when they are equal HDF5 reads without converting
        if shape != info.shape or (dataset.get_type() != reading.memory_type and dataset.dtype != reading.stored):
            raise FormatError(f"is {shape} {dataset.dtype} but the manifest says "
                              f"{info.shape} {info.dtype}", path=self.name, key=key)
        out = self._read_stored(key, dataset, shape, reading.stored, reading.memory_type)
        if verify and info.checksum:
            actual = checksum(out)
            if actual != info.checksum:
                raise ChecksumError(f"is corrupt (checksum {actual}, manifest {info.checksum})", path=self.name, key=key)
        return out if reading.logical is None else out.view(reading.logical)

    def _read_unlisted(self, key: str, dataset: h5py.h5d.DatasetID, shape: tuple[int, ...]) -> np.ndarray:
        """A dataset of a file without a manifest, as the numeric array its own type says."""
        dtype = dataset.dtype
        if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biufcV":
            raise UnsafeFileError(f"has dtype {dtype}; only numeric arrays are read", path=self.name, key=key)
        if dtype.kind == "V":
            labelled = _keras_labelled(dataset, dtype)
            if labelled is None:
                raise FormatError(f"is raw bytes ({dtype}) and no manifest says what they are", path=self.name, key=key)
            return self._read_stored(key, dataset, shape, dtype, dataset.get_type()).view(labelled)
        dtype = dtype.newbyteorder("<")
        memory_type = self._memory_types.get(dtype)
        if memory_type is None:
            memory_type = self._memory_types[dtype] = h5py.h5t.py_create(dtype)
        return self._read_stored(key, dataset, shape, dtype, memory_type)

    def _read_stored(self, key: str, dataset: h5py.h5d.DatasetID, shape: tuple[int, ...], dtype: np.dtype,
                     memory_type: h5py.h5t.TypeID) -> np.ndarray:
        """The dataset's bytes into a new array, once HDF5's account of them is known to fit the file."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._datasets[self._paths[key]].stored_plain:
            _check_stored_size(dataset, self.name, key, nbytes)
            view = self._mapped(key, dataset, shape, dtype, nbytes)
            if view is not None:
                return view
        else:
            _check_storage(dataset, self.name, key, nbytes)
        out = np.empty(shape, dtype=dtype)
        if out.size:
            dataset.read(h5py.h5s.ALL, h5py.h5s.ALL, out, memory_type)
        return out

    def _mapped(self, key: str, dataset: h5py.h5d.DatasetID, shape: tuple[int, ...], dtype: np.dtype,
                nbytes: int) -> np.ndarray | None:
        """The contiguous dataset as a view of the mapped file, or None where libhdf5 must read
        it: no map (``mmap=False``, a URL), nothing stored, a stored type HDF5 converts (another
        byte order), or never written (HDF5 gives its fill value)."""
        if self._map is None or not nbytes or dataset.dtype != dtype:
            return None
        offset = dataset.get_offset()
        if offset is None:
            return None
        self._map.check_unchanged(f"tensor {key!r}")  # a map past a truncated end: SIGBUS
        if nbytes >= _ANNOUNCED_FROM:
            self._map.prefetch(offset, nbytes)  # a cold file streams rather than faults in
        return np.frombuffer(self._map.read_at(offset, nbytes), dtype).reshape(shape)

    def _reading(self, name: str) -> _Reading:
        stored = storage_dtype(name)
        logical = from_storage(np.empty(0, stored), name).dtype
        reading = _Reading(stored, h5py.h5t.py_create(stored), None if logical == stored else logical)
        self._readings[name] = reading
        return reading

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        """False: the store copies what :meth:`read` returns, a view of the mapped file (one copy)
        or libhdf5's own read (``mmap=False``, a converted dataset)."""
        return False

    def close(self) -> None:
        self._file.close()
        if self._removed is not None:
            self._removed.close()
        if self._map is not None:
            self._map.close()


FORMAT = Format(
    name="hdf5",
    suffixes=(".h5", ".hdf5"),
    magic=lambda head: head.startswith(_MAGIC),
    open_reader=lambda location, name, mmap=True: Hdf5Reader(location, name, mapped=mmap),
    open_writer=Hdf5Writer,
    planned_writer=True,
    remote_file_object=True,
    max_key_segments=MAX_HDF5_DEPTH,
    max_ndim=32,  # libhdf5's H5S_MAX_RANK
)
