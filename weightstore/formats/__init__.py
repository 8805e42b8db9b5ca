"""One small reader/writer protocol for every format, file or folder, in one table.

The rest of weightstore never branches on the format: it asks :func:`format_named`,
:func:`format_for_suffix`, :func:`sniff` or :func:`finders` for the :class:`Format` (all read the
one table, :data:`FORMAT_MODULES`) and speaks :class:`Reader` and :class:`Writer`. A file format
is recognised by its suffix or first bytes; a format recognised by where it lies (a Hugging Face
model folder, a TF checkpoint prefix, a ``.keras`` archive) declares how in :attr:`Format.find`,
asked of a local path and a URL alike (:class:`~weightstore.io.places.Place`). Readers treat the
file as hostile: every size is checked against the bytes that really exist before anything is
allocated.
"""

from __future__ import annotations

import importlib
import operator
import posixpath
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from weightstore import _lazy
from weightstore.core.keys import OUTPUT_SUFFIX, validate_key, validate_keys
from weightstore.core.manifest import TensorInfo
from weightstore.errors import FormatError, InvalidKeyError

if TYPE_CHECKING:
    from weightstore.io.places import Place


class Reader(Protocol):
    """What every format's reader provides, optional capabilities included.

    The rest of weightstore calls every member below and never asks ``hasattr``; a reader
    inherits :class:`ReaderDefaults` for the optional ones it does not provide (``kind``,
    ``skipped``, ``meta_graph``, ``read_into``, ``read_many``, ``prefetch``). Reading part of a
    tensor is the one capability a reader declares by having it: :class:`RegionReader`. Readers treat the
    file as hostile (see the module docstring) and read bytes only through
    :mod:`weightstore.io.source`.
    """

    @property
    def kind(self) -> str | None:
        """What ``ws ls`` calls the source ("TF1 name-based checkpoint"); ``None``: a store or a
        plain file, as its checksums say."""
    @property
    def skipped(self) -> list[str]:
        """Entries that are not numeric tensors (string variables), left out of :meth:`keys`."""
    @property
    def meta_graph(self) -> str | None:
        """The TF1 ``.meta`` graph that records which variables are trainable; ``None`` when none does."""
    @property
    def name(self) -> str: ...
    @property
    def metadata(self) -> dict[str, Any]: ...
    @property
    def created(self) -> str: ...
    @property
    def has_checksums(self) -> bool: ...

    def keys(self) -> list[str]: ...
    def info(self, key: str) -> TensorInfo: ...
    def read(self, key: str, *, verify: bool) -> np.ndarray: ...

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        """Read ``key`` straight into ``out`` (its shape and dtype, C-contiguous) and return True;
        False when this reader cannot, and the store copies what :meth:`read` returns."""

    def read_many(self, keys: list[str], *, verify: bool) -> list[np.ndarray]:
        """What :meth:`read` returns for each of ``keys``, in order (npz: all in one pass)."""

    def prefetch(self, keys: list[str]) -> None:
        """Warn that ``keys`` are read next, so a remote file fetches their bytes at once."""

    def close(self) -> None: ...


class RegionReader(Protocol):
    """The optional capability of a reader that reads part of a tensor without the rest (a
    sharded version: only the blocks that hold the region); :meth:`Store.read_region` reads the
    whole tensor and copies the part from any other."""

    def read_region(self, key: str, region: Any, *, verify: bool) -> np.ndarray: ...

    def region_digest(self, key: str, region: Any) -> str | None:
        """The content digest of the region (from the index: no read), or None when unknown."""


class ReaderDefaults:
    """The optional capabilities of :class:`Reader`, as a reader has them that does not override them."""

    kind: str | None = None
    skipped: list[str] = []  # noqa: RUF012 - never changed; a reader that skips entries sets its own list
    meta_graph: str | None = None

    def read(self, key: str, *, verify: bool) -> np.ndarray:
        raise NotImplementedError

    def read_into(self, key: str, out: np.ndarray, *, verify: bool) -> bool:
        """False: the store then copies what :meth:`read` returns."""
        return False

    def read_many(self, keys: list[str], *, verify: bool) -> list[np.ndarray]:
        """One :meth:`read` after another."""
        return [self.read(key, verify=verify) for key in keys]

    def prefetch(self, keys: list[str]) -> None:
        """Nothing: a local file needs no warning."""


class Writer(Protocol):
    #: tensors stored somewhere other than their key (HDF5 reserved datasets), for the manifest
    locations: dict[str, str]
    #: tensors whose bytes a codec encodes (npz ``compress="shuffle"``), for the manifest
    codecs: dict[str, str]

    #: returns the CRC-32 of data, from the write pass; ``crc``: that CRC-32 where the caller has it already
    #: (a sharded member's, joined from its block CRC-32s), so an uncompressed write makes no pass for it
    def add(self, key: str, dtype_name: str, data: np.ndarray, crc: int | None = None) -> int: ...
    def commit(self, manifest_text: str) -> None: ...
    def abort(self) -> None: ...


@dataclass(frozen=True)
class Format:
    name: str
    suffixes: tuple[str, ...]
    magic: Callable[[bytes], bool]
    open_reader: Callable[..., Reader]  # (location, name, *, mmap=True)
    #: ``(path, compress: False, True or "shuffle")``, and ``planned`` where :attr:`planned_writer`
    open_writer: Callable[..., Writer]
    #: the logical dtypes the format can hold; ``None``: every dtype weightstore stores
    dtypes: frozenset[str] | None = None
    compresses: bool = True
    #: whether tensors can be named in the file other than by their keys (``names="torch"``)
    torch_names: bool = False
    #: names the format keeps for itself (safetensors' ``__metadata__``): refused as keys before writing
    reserved_keys: frozenset[str] = frozenset()
    #: the most ``/``-separated segments a key may have for the format's readers to read it back
    #: (HDF5: one group per segment, and groups are read only so deep); ``None``: no limit
    max_key_segments: int | None = None
    #: the most axes a tensor may have in the format (HDF5: 32); ``None``: weightstore's own limit
    max_ndim: int | None = None
    #: False for a format ``ws.save`` does not write (a sharded version's index, a TF checkpoint):
    #: its :attr:`open_writer` raises, saying what writes it, and a save is refused with that
    writes: bool = True
    #: whether a remote file is read through an fsspec file object (h5py's reads) instead of a
    #: :class:`~weightstore.io.remote.RemoteFile`'s ranged reads, which open with one request
    remote_file_object: bool = False
    #: whether :attr:`open_writer` takes a third argument, ``planned``: ``planned()`` lists the tensors
    #: to be written, in order, named as stored, for a writer that lays the file out before the data
    #: comes (HDF5 makes every header first); worked out only when called
    planned_writer: bool = False
    #: for a format recognised by where it lies rather than by a file's suffix or first bytes (a
    #: folder, a checkpoint prefix): ``find(place)`` is the place :attr:`open_reader` is given
    #: for what lies at ``place`` (the place itself, a file in the folder, a checkpoint's prefix),
    #: or ``None`` when it is none of this format's; asked in table order before a local file is
    #: read, and of a URL only once no file is there (so opening a remote file stays one request)
    find: Callable[[Place], Place | None] | None = None


#: The one table of formats, file and folder, in the order suffixes, magic bytes and
#: :attr:`Format.find` are tried: each entry names a module that defines ``FORMAT``, imported
#: when a file is first opened or saved (so ``import weightstore`` does not load h5py). A format
#: of the package is added here; one from elsewhere (a plugin, a test) with :func:`register`.
#: HDF5 comes after every format whose module is light: its module imports h5py (60 ms of a
#: process's first open), which a lookup passing it would import for a ``.safetensors`` file, a
#: version or an index. No suffix or magic of one format is another's, so the order decides
#: nothing else. The TF checkpoint stays last: its ``find`` refuses a folder that no format
#: before it reads, saying what a checkpoint folder would hold.
FORMAT_MODULES: list[str] = ["weightstore.formats.npz", "weightstore.formats.safetensors",
                             "weightstore.formats.delta", "weightstore.formats.sharded",
                             "weightstore.formats.hf_sharded",
                             "weightstore.formats.keras_sharded", "weightstore.formats.keras_preset",
                             "weightstore.formats.keras_file", "weightstore.formats.hdf5",
                             "weightstore.formats.tf_checkpoint"]
_LAST = "weightstore.formats.tf_checkpoint"


def register(module: str) -> None:
    """Add the format that module ``module`` defines as ``FORMAT`` to :data:`FORMAT_MODULES`,
    after those already there (a format of the same name or suffix already there wins) and
    before the TF checkpoint's (whose ``find`` would refuse a folder the new format reads)."""
    if module not in FORMAT_MODULES:
        at = FORMAT_MODULES.index(_LAST) if _LAST in FORMAT_MODULES else len(FORMAT_MODULES)
        FORMAT_MODULES.insert(at, module)


#: each format module's ``FORMAT``, kept once its import finished (see :func:`_registry`)
_IMPORTED: dict[str, Format] = {}


def _registry() -> Iterator[Format]:
    """The formats in table order, each module imported only when reached: a lookup that stops at
    the first match (an ``.npz`` suffix) loads no module after it (0.05 CPU-s of a first assign)."""
    # kept once imported: import_module of a module already imported still takes the import lock,
    # and every open asks the registry twice (0.1 ms of a 0.8 ms open of a small file); never taken
    # from sys.modules, which holds a module from the start of its import: a thread that found it
    # there while another still imported it got no FORMAT (AttributeError), where import_module waits
    for module in list(FORMAT_MODULES):
        found = _IMPORTED.get(module)
        if found is None:
            found = _IMPORTED[module] = importlib.import_module(module).FORMAT
        yield found


def format_named(name: str) -> Format:
    for fmt in _registry():
        if fmt.name == name:
            return fmt
    by_suffix = [fmt.name for fmt in _registry() if f".{str(name).lower()}" in fmt.suffixes]  # "h5" for "hdf5"
    hint = f"; did you mean {by_suffix[0]!r}?" if by_suffix else ""
    raise FormatError(f"unknown format {name!r}; known: {', '.join(f.name for f in _registry())}{hint}")


def format_for_suffix(path: str) -> Format | None:
    """The format a file name asks for, by how it ends (``.npz``, ``.safetensors.index.json``);
    ``None`` when its ending says nothing."""
    name = posixpath.basename(str(path).rstrip("/")).lower()  # not PurePosixPath: 0.05 ms an open
    for fmt in _registry():
        if any(name.endswith(suffix) and len(name) > len(suffix) for suffix in fmt.suffixes):
            return fmt
    return None


def finders() -> list[Format]:
    """The formats recognised by where they lie (:attr:`Format.find`), in table order."""
    return [fmt for fmt in _registry() if fmt.find is not None]


def known_suffixes() -> list[str]:
    """Every suffix a save can write, in registry order."""
    return [suffix for fmt in _registry() if fmt.writes for suffix in fmt.suffixes]


def sniff(head: bytes) -> Format:
    """The format of a file by its first bytes, for names whose suffix says nothing; the caller
    names the file (:func:`~weightstore.errors.naming`)."""
    for fmt in _registry():
        if fmt.magic(head):
            return fmt
    if not head:
        raise FormatError("file is empty")
    raise FormatError("not a weightstore file (not npz, HDF5 or safetensors)")


def refuse_misnamed(head: bytes, named: Format, *, asked: bool = False) -> None:
    """Raise :class:`FormatError` if ``head``, the first bytes of a file the reader of ``named``
    (its suffix's format, or with ``asked`` the one ``format=`` asked for) refused, starts a file
    of another format: a file saved or downloaded under the wrong name (a safetensors file as
    ``model.npz``), which the suffix's reader can only call damaged. The caller names the file
    (:func:`~weightstore.errors.naming`)."""
    for fmt in _registry():
        if fmt.name != named.name and fmt.magic(head):  # by name: a reader may open with a copy of one (ws verify)
            read_so = f"ws.open(path, format={fmt.name!r})"
            if asked:
                raise FormatError(f"format={named.name!r} was asked for, but its first bytes say {fmt.name}: "
                                  f"read it with {read_so}")
            suffix = fmt.suffixes[0] if fmt.suffixes else ""
            raise FormatError(f"its name says {named.name}, but its first bytes say {fmt.name}: rename it to end in "
                              f"{suffix} (or read it with {read_so})")


def foreign_keys(names: Iterable[tuple[str, str]], what: str) -> dict[str, str]:
    """Key -> member (npz member, HDF5 dataset path) of a file without a manifest.

    Such names were chosen by whatever wrote the file, so each must become a valid key: a
    trailing TensorFlow output suffix is dropped (old tf.keras HDF5 files name datasets
    ``dense/kernel:0``); any other name that is not a valid key (``c//d``, ``a/./b``, a
    control character, a reserved ``__weightstore`` segment) refuses the file with a
    :class:`FormatError` naming it, as do two names that drop to the same key (the reader
    names the file, with :func:`weightstore.errors.naming`).
    """
    pairs = list(names)
    try:  # the usual file: every name a key as it is, checked at once (no key ends in an output suffix)
        validate_keys(list(map(operator.itemgetter(0), pairs)))  # not a comprehension: 700 bytecodes of 100 names
    except InvalidKeyError:
        pass  # a suffix to drop, or a name to refuse by name: one at a time below
    else:
        keys = dict(pairs)
        if len(keys) == len(pairs):
            return keys
    keys = {}
    for name, member in pairs:
        key = OUTPUT_SUFFIX.sub("", name)
        try:
            validate_key(key)
        except InvalidKeyError as exc:
            raise FormatError(f"{what} {member!r} does not name a valid key ({exc.message})") from None
        if key in keys:
            raise FormatError(f"{what}s {keys[key]!r} and {member!r} both read as key {key!r}")
        keys[key] = member
    return keys


#: each submodule imported on first use, as when ``import weightstore`` imported every layer
#: (``weightstore.io.objects.PART_BYTES``): :mod:`weightstore._lazy`
__getattr__, __dir__ = _lazy.on_first_use(globals(), {})
