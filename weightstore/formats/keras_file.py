"""Keras 3 files read without Keras: ``.weights.h5`` and the ``.keras`` zip archive.

A ``.weights.h5`` file is plain HDF5 and is read by :mod:`weightstore.formats.hdf5` as a file
without a manifest; its keys are its dataset paths (``layers/dense/vars/0``). A ``.keras``
archive is a zip holding that same weights file as ``model.weights.h5`` beside
``config.json`` and ``metadata.json``. Its weights member is copied out, after checks that
refuse zip bombs before a byte is inflated, and read the same way. Its tensors are keyed as
``tf2.export`` keys the model the config describes (``dense/kernel``), worked out from the
config as bounded JSON (:func:`read_config`, :mod:`weightstore.formats._keras_keys`), never
deserialized into a model: nothing in the file is ever executed. Where the config has a layer
that table does not know, the whole file keeps its own names (:attr:`KerasArchiveReader.keys_note`
says why); :meth:`KerasArchiveReader.file_named` gives them for writers and the model-walk pairing.
An archive on object storage is copied whole into the reader's private folder first (a zip is
read by seeking about it), and dropped once its weights member is unpacked.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO

import numpy as np

from weightstore.core import _jsontext as jsontext
from weightstore.core.limits import (
    KERAS_CONFIG_BYTES_PER_CONTAINER,
    MAX_DEFLATE_RATIO,
    MAX_KERAS_CONFIG_BYTES,
    MAX_KERAS_MEMBERS,
)
from weightstore.core.manifest import TensorInfo
from weightstore.errors import FormatError, StoreNotFoundError, TargetError, UnsafeFileError, WeightStoreError, naming
from weightstore.formats import Format, Reader, ReaderDefaults, _keras_keys, _zipdir, format_for_suffix, format_named
from weightstore.formats._renamed import RenamedReader
from weightstore.io.files import open_regular, remove_scratch, scratch_folder, unreadable
from weightstore.io.location import service
from weightstore.io.places import Place
from weightstore.io.remote import RemoteFile

KERAS_SUFFIX = ".keras"
WEIGHTS_SUFFIX = ".weights.h5"
WEIGHTS_MEMBER = "model.weights.h5"
CONFIG_MEMBER = "config.json"
KIND = "Keras weights file"
_CHUNK = 16 << 20
#: what :mod:`zipfile` raises on damaged or unusual archives (unsupported features, bad names)
_ZIP_ERRORS = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error, struct.error, ValueError,
               NotImplementedError, UnicodeDecodeError, OverflowError)


def is_keras_archive(path: str) -> bool:
    """Whether ``path`` is to be read as a ``.keras`` archive: by suffix, or, for a name whose
    suffix says nothing, a zip holding ``model.weights.h5``. Never raises for a damaged zip.

    A TF checkpoint's own file (``ckpt.index``, ``ckpt.data-00000-of-00001`` beside its index) is
    the checkpoint's whatever it holds: zipfile finds an archive after any bytes, so a damaged
    index ending in one was read as that archive's weights, not refused as the checkpoint's."""
    if path.endswith(KERAS_SUFFIX):
        return True
    if format_for_suffix(path) is not None or not os.path.isfile(path):
        return False
    from weightstore.formats.tf_checkpoint import resolve_prefix  # not at import: a .keras open needs none of it

    if resolve_prefix(path) not in (None, path):
        return False
    try:
        with _open_archive(path) as archive:
            return WEIGHTS_MEMBER in archive.namelist()
    except (OSError, WeightStoreError):
        return False


class KerasArchiveReader(ReaderDefaults):
    """The Reader protocol over a ``.keras`` archive's weights, unpacked to a private folder,
    keyed like its model where the config allows (else by the file's own names)."""

    kind = KIND

    def __init__(self, path: str | RemoteFile, *, own_names: bool = False):
        """``path``: the archive's local path, or its object on a store (copied here first).
        ``own_names``: key by the file's own names and leave the config unread, for pairing
        by a live model's save walk, which needs none of it."""
        self.name = path if isinstance(path, str) else path.name
        self.skipped: list[str] = []
        self._scratch = scratch_folder("weightstore-keras-")
        self._file: Reader | None = None
        try:
            archive_path = path if isinstance(path, str) else _fetched(path, self._scratch)
            local = os.path.join(self._scratch, WEIGHTS_MEMBER)
            with _named_as(self.name, archive_path), _open_archive(archive_path) as archive:  # the config is
                with open(local, "wb") as out:  # read from the weights' own archive, through one handle
                    for chunk in _member_chunks(archive_path, archive, WEIGHTS_MEMBER):
                        out.write(chunk)
                self._file = format_named("hdf5").open_reader(local, f"{self.name}:{WEIGHTS_MEMBER}")
                config: dict[str, Any] | None = None
                names, why = None, ""
                try:
                    if not own_names:
                        config = _archive_config(archive_path, archive, MAX_KERAS_CONFIG_BYTES)
                except (FormatError, UnsafeFileError) as exc:  # the weights read without it, by their own names
                    why = f"its {CONFIG_MEMBER} cannot be read ({exc.message})"
            if archive_path != self.name:
                os.remove(archive_path)  # a store's archive, copied: its weights are out, the copy is no longer needed
            if config is not None:
                names, why = _keras_keys.model_names(config, self._file.keys(), self.name)
            #: why the tensors keep the file's own names (``layers/dense/vars/0``); empty where keyed like the model
            self.keys_note = why
            self._reader: Any = RenamedReader(self._file, names) if names is not None else self._file
        except BaseException:
            self.close()
            raise
        self.metadata: dict[str, Any] = {}
        self.created = ""
        self.has_checksums = False

    @property
    def stored_names(self) -> dict[str, str]:
        """Key -> the file's own name for it (``dense/kernel`` -> ``layers/dense/vars/0``)."""
        return dict(getattr(self._reader, "stored_names", {}))

    def file_named(self) -> Reader:
        """This reader under the file's own names, as Keras's loader reads them; closing it closes this."""
        return RenamedReader(self, {name: key for key, name in self._name_pairs()})

    def _name_pairs(self) -> list[tuple[str, str]]:
        stored = self.stored_names
        return [(key, stored.get(key, key)) for key in self.keys()]

    def keys(self) -> list[str]:
        return self._reader.keys()

    def info(self, key: str) -> TensorInfo:
        return self._reader.info(key)

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        return self._reader.read(key, verify=verify)

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        return self._reader.read_into(key, out, verify=verify)

    def close(self) -> None:
        try:
            if self._file is not None:
                self._file.close()
        finally:
            remove_scratch(self._scratch)


def _fetched(source: RemoteFile, folder: str) -> str:
    """A store's archive copied whole into ``folder`` (one GET): a zip is read by seeking about it."""
    local = os.path.join(folder, "archive" + KERAS_SUFFIX)
    try:
        with service(source.name):
            source.fs.get_file(source.path, local)
    except FileNotFoundError:
        raise StoreNotFoundError("no such file", path=source.name) from None
    finally:
        source.close()
    return local


@contextlib.contextmanager
def _named_as(name: str, local: str) -> Iterator[None]:
    """Errors about ``local`` (a store's archive, copied) name ``name``, the URL the caller gave."""
    try:
        yield
    except WeightStoreError as exc:
        if exc.path == local and local != name:
            exc.path = name
        raise


def read_config(path: str | os.PathLike, *, max_bytes: int = MAX_KERAS_CONFIG_BYTES) -> dict[str, Any]:
    """The model config of a ``.keras`` archive, as plain JSON data: never deserialized.

    For mapping the archive's weights onto a model's keys (``layers/dense/vars/0`` is layer
    ``dense``'s first variable). The member's declared size is checked against ``max_bytes``
    and against what deflate can produce before anything is inflated, and inflation stops at
    the declared size.

    Raises:
        StoreNotFoundError: no such file.
        UnsafeFileError: the config is larger than ``max_bytes``, or a zip bomb.
        FormatError: not a zip, no ``config.json``, or not a JSON object in UTF-8.
    """
    text = os.fspath(path)
    with _open_archive(text) as archive:
        return _archive_config(text, archive, max_bytes)


def _archive_config(text: str, archive: zipfile.ZipFile, max_bytes: int) -> dict[str, Any]:
    """:func:`read_config` from an open archive."""
    info = _member(text, archive, CONFIG_MEMBER)
    if info.file_size > max_bytes:
        raise UnsafeFileError(f"{CONFIG_MEMBER} declares {info.file_size} bytes, over the {max_bytes}-byte limit",
                              path=text)
    raw = b"".join(_member_chunks(text, archive, CONFIG_MEMBER))
    with naming(path=text):  # Keras writes with Python's json, which writes NaN and Infinity
        config = jsontext.loads(raw, what=CONFIG_MEMBER, min_bytes=KERAS_CONFIG_BYTES_PER_CONTAINER, nonfinite=True)
    if not isinstance(config, dict):
        raise FormatError(f"{CONFIG_MEMBER} holds a JSON {type(config).__name__}, not an object", path=text)
    with naming(path=text):  # the stdlib parses some 1,000 levels: past what a walk of it (or repr) survives
        jsontext.refuse_deep(config, CONFIG_MEMBER)
    return config


@contextlib.contextmanager
def _open_archive(path: str) -> Iterator[zipfile.ZipFile]:
    """The archive at ``path``, read through the one descriptor checked to be a regular file
    (``zipfile`` given the name would open it again: a FIFO swapped in meanwhile would block)."""
    try:
        handle = open_regular(path)
    except FileNotFoundError:
        raise StoreNotFoundError("no such file", path=path) from None
    with handle:
        try:
            _refuse_crowded(handle, path)
            archive = zipfile.ZipFile(handle)
        except WeightStoreError:
            raise
        except OSError as exc:  # the read the system failed (an I/O error): the storage's, named
            raise unreadable(exc, path) from None
        except _ZIP_ERRORS as exc:
            raise FormatError(f"not a .keras archive (not a readable zip file: {type(exc).__name__})",
                              path=path) from None
        with archive:
            yield archive


def _refuse_crowded(handle: BinaryIO, path: str) -> None:
    """Refuse, from the end record alone, a directory of more than :data:`MAX_KERAS_MEMBERS` entries,
    before ``zipfile`` makes an object of each. A file without a readable end record is left
    to ``zipfile`` to refuse in its own words."""
    size = os.fstat(handle.fileno()).st_size
    tail_start = max(0, size - (_zipdir.EOCD.size + 0xFFFF))

    def read_at(offset: int, length: int = -1) -> bytes:
        try:
            handle.seek(offset)
            return handle.read(length)
        except OSError as exc:  # the read the system failed (an I/O error): the storage's, named
            raise unreadable(exc, path) from None

    try:
        count = _zipdir.locate_zip64(read_at, _zipdir.locate(read_at(tail_start), tail_start))[0]
    except FormatError:
        return
    if count > MAX_KERAS_MEMBERS:
        raise UnsafeFileError(f".keras archive lists {count} members (at most {MAX_KERAS_MEMBERS} are read)", path=path)


def _member(path: str, archive: zipfile.ZipFile, name: str) -> zipfile.ZipInfo:
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise FormatError(f".keras archive holds no {name}", path=path) from None
    refuse_bomb(path, info, os.fstat(archive.fp.fileno()).st_size if archive.fp else 0)  # the file read, not the name
    return info


def _member_chunks(path: str, archive: zipfile.ZipFile, name: str):
    """The bytes of one member, in chunks, checked against its declared size as they inflate."""
    info = _member(path, archive, name)
    left = info.file_size
    try:
        with archive.open(info) as member:
            while chunk := member.read(min(_CHUNK, left + 1)):
                if len(chunk) > left:
                    raise UnsafeFileError(f"{name} inflates past its declared {info.file_size} bytes", path=path)
                left -= len(chunk)
                yield chunk
    except WeightStoreError:
        raise
    except _ZIP_ERRORS as exc:
        raise FormatError(f"corrupt .keras archive ({name}: {exc})", path=path) from None
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # the read the system failed (an I/O error): the storage's, named
            raise unreadable(exc, path) from None
        # a member before the file's start (its first bytes cut off): a seek to a negative offset
        raise FormatError(f"corrupt .keras archive ({name} cannot be read: {exc.strerror or exc})", path=path) from None
    if left:
        raise FormatError(f"corrupt .keras archive ({name} ends {left} bytes short of its declared size)", path=path)


def refuse_bomb(path: str, info: zipfile.ZipInfo, archive_size: int) -> None:
    """Refuse, before inflating a byte, a member that could not honestly be that big (CWE-409).

    Deflate expands at most about 1032 to 1, so a larger declared size is a zip bomb (or a
    lie about the size); stored members must declare equal sizes. Members other than stored
    or deflated (bzip2, lzma reach far higher ratios) and encrypted ones are refused too.
    """
    member = info.filename
    if info.flag_bits & 0x1:
        raise UnsafeFileError(f"{member} is encrypted", path=path)
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise UnsafeFileError(f"{member} uses compression method {info.compress_type}; only stored and deflate are "
                              "read", path=path)
    if info.compress_size > archive_size:
        raise FormatError(f"{member} declares {info.compress_size} compressed bytes in a {archive_size}-byte archive",
                          path=path)
    if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
        raise UnsafeFileError(f"{member} is stored but declares {info.file_size} bytes in {info.compress_size}",
                              path=path)
    if info.file_size > MAX_DEFLATE_RATIO * min(info.compress_size, archive_size):
        raise UnsafeFileError(f"{member} declares {info.file_size} bytes from {info.compress_size} compressed, "
                              f"more than deflate can expand ({MAX_DEFLATE_RATIO}x): a zip bomb", path=path)


def _find(place: Place) -> Place | None:
    """The archive itself: a local file :func:`is_keras_archive` takes, or a URL named ``.keras``
    (its reader copies it here first; a URL is not asked what it holds, which costs a request)."""
    if place.remote:
        return place if place.text.endswith(KERAS_SUFFIX) else None
    return place if is_keras_archive(place.text) else None


def _no_writer(path: str, compress: bool | str) -> Any:
    raise TargetError("a .keras archive is written by Keras's model.save; ws import --into it replaces its weights",
                      path=path)


#: a ``.keras`` archive: recognised by its suffix or, under another name, by the members it holds
FORMAT = Format(name="keras", suffixes=(KERAS_SUFFIX,), magic=lambda head: False,
                open_reader=lambda location, name, *, mmap=True: KerasArchiveReader(location),
                open_writer=_no_writer, compresses=False, writes=False, find=_find)
