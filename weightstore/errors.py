"""Every exception weightstore raises, in one place.

Each class also subclasses the builtin it refines, so callers may catch either the
weightstore class or the builtin they already handle::

    WeightStoreError
    ├── InvalidKeyError(ValueError)        a key breaks the key rules
    ├── UnsupportedDTypeError(TypeError)   a value weightstore does not write (text, objects, a
    │                                      long double, masked values, a sparse tensor, too many axes)
    ├── SelectionError(ValueError)         a scope/include/exclude that keeps nothing
    ├── StoreNotFoundError(FileNotFoundError)
    │   └── VersionGoneError               a version pruned under a reader; retry
    ├── StoreExistsError(FileExistsError)  overwrite=False and the target exists
    ├── KeyNotInStoreError(KeyError)
    ├── FormatError(ValueError)            not a weightstore/npz/HDF5 file, or a corrupt one
    │   ├── ChecksumError                  a tensor's bytes do not match the manifest
    │   └── UnsafeFileError                pickles, links, external storage, zip tricks
    ├── TargetError(ValueError)            a write target that must not be replaced (folder, FIFO, device)
    ├── StorageError(OSError)              the storage failed (an outage, credentials); retry later
    │   └── WriteError                     the file system refused a write (disk full, size limit)
    ├── FileAccessError(OSError)           the system will not open a file (permission, symlink loop)
    ├── SizeLimitError(ValueError)         a read would exceed ``max_bytes``
    ├── StoreClosedError(ValueError)       a tensor asked of a store after ``close()``
    ├── AssignmentError(ValueError)        assign found missing/unexpected/mismatched keys
    ├── LayoutError(ValueError)            a tensor no layout rule converts (Keras <-> PyTorch/Flax)
    ├── PublishError(RuntimeError)         a second publisher, steps that go back, pieces that do not tile a tensor
    │   └── PieceError(ValueError)         a piece publish_shard cannot place (bad start, shape or list)
    ├── ShardTimeoutError(TimeoutError)    a rank of a sharded version never finished its part
    ├── UnsupportedTargetError(TypeError)  an object no adapter takes, or that a follower cannot assign into
    ├── NotAPathError(TypeError)           no path where a path goes: None (ws.latest before a version), a file object
    └── MissingDependencyError(ImportError) an optional extra is not installed
"""

from __future__ import annotations

import contextlib
import reprlib
from collections.abc import Iterable
from typing import Any, TypeVar

__all__ = [
    "WeightStoreError",
    "InvalidKeyError",
    "UnsupportedDTypeError",
    "SelectionError",
    "StoreNotFoundError",
    "VersionGoneError",
    "StoreExistsError",
    "KeyNotInStoreError",
    "FormatError",
    "ChecksumError",
    "UnsafeFileError",
    "TargetError",
    "StorageError",
    "FileAccessError",
    "SizeLimitError",
    "StoreClosedError",
    "WriteError",
    "AssignmentError",
    "LayoutError",
    "PublishError",
    "PieceError",
    "ShardTimeoutError",
    "UnsupportedTargetError",
    "NotAPathError",
    "MissingDependencyError",
]

_E = TypeVar("_E", bound="WeightStoreError")
_SHOWN_KEY_CHARS = 200
#: shows an untrusted value in a message: a few levels deep and cut short, since orjson reads
#: values nested 1,024 deep, past the depth at which ``repr`` raises RecursionError
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxstring, _SHORT_REPR.maxother = 3, 80, 80
short_repr = _SHORT_REPR.repr


class WeightStoreError(Exception):
    """Root of every error weightstore raises on purpose.

    ``path`` (the file, folder or URL) and ``key`` (the tensor), where known, are attributes so
    that callers and the CLI can filter on them; the message is composed from them here, once:
    ``"model.npz: tensor 'dense/kernel': is corrupt"``.
    """

    def __init__(self, message: str = "", *, path: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.key = key

    def __str__(self) -> str:
        parts = [self.path] if self.path else []
        if self.key is not None:
            parts.append(f"tensor {shown_key(self.key)}")
        return ": ".join([*parts, self.message]) if parts else self.message


def shown_key(key: str) -> str:
    """``key`` as a message shows it: whole up to a line's worth, else its ends and its length
    (a key may be 65,531 bytes long; ``error.key`` keeps it whole)."""
    if len(key) <= _SHOWN_KEY_CHARS:
        return repr(key)
    return f"{key[:_SHOWN_KEY_CHARS - 40]!r}…{key[-32:]!r} ({len(key)} characters)"


def named(items: Iterable[Any], *, shown: int = 3) -> str:
    """The first ``shown`` of ``items`` as a message names them, and how many more there are:
    ``'a', 'b', 'c' and 4 more`` (``none`` if empty). Every message that names several things says
    it this way, each key bounded as :func:`shown_key` bounds it (a hostile file may list
    thousands, each 65 KB long)."""
    items = list(items)
    text = ", ".join(shown_key(item) if isinstance(item, str) else str(item) for item in items[:shown]) or "none"
    return text + (f" and {len(items) - shown} more" if len(items) > shown else "")


class InvalidKeyError(WeightStoreError, ValueError):
    pass


class UnsupportedDTypeError(WeightStoreError, TypeError):
    pass


class SelectionError(WeightStoreError, ValueError):
    """A selection word (scope, include, mapping...) that cannot be honoured.

    ``word``: the word as the message quotes it (``"include '*/Adam'"``) where it matched no
    key, so a caller that knows more about the keys can retell why."""

    def __init__(self, message: str = "", *, path: str | None = None, key: str | None = None,
                 word: str | None = None) -> None:
        super().__init__(message, path=path, key=key)
        self.word = word


class StoreNotFoundError(WeightStoreError, FileNotFoundError):
    pass


class VersionGoneError(StoreNotFoundError):
    """The version was pruned between finding it and opening it: look again and retry."""


class StoreExistsError(WeightStoreError, FileExistsError):
    pass


class KeyNotInStoreError(WeightStoreError, KeyError):
    __str__ = WeightStoreError.__str__  # KeyError's would quote the whole message


class FormatError(WeightStoreError, ValueError):
    pass


class ChecksumError(FormatError):
    """Bytes that do not match their checksum. Where one check found several corrupt tensors
    (``ws verify``) ``keys`` lists them all and ``key`` is ``None``; otherwise it is empty."""

    def __init__(self, message: str = "", *, path: str | None = None, key: str | None = None,
                 keys: Iterable[str] = ()) -> None:
        super().__init__(message, path=path, key=key)
        self.keys = list(keys)


class UnsafeFileError(FormatError):
    pass


class TargetError(WeightStoreError, ValueError):
    """A write whose target must not be replaced: a folder, FIFO, socket or device."""


class StorageError(WeightStoreError, OSError):
    """The storage failed (an object store outage, refused credentials), not the file: retrying may help.

    ``transient``: whether the failure may pass by itself (a connection refused or reset, a
    timeout, the service's own fault or throttling: 5xx, ``SlowDown``), so a follower waits it
    out; False where it stays until someone acts (credentials refused, a bucket access is denied
    to or that does not exist, a host name that names no host), so a follower or background
    publisher that never got an answer from the folder gives up at once (once it has, it waits
    every failure out, for its ``retry_for`` where it publishes): a publish never raises into training.
    """

    __str__ = WeightStoreError.__str__

    def __init__(self, message: str = "", *, path: str | None = None, key: str | None = None,
                 transient: bool = True) -> None:
        super().__init__(message, path=path, key=key)
        self.transient = transient


class FileAccessError(WeightStoreError, OSError):
    """The system refuses to open a local file (no permission, a symlink loop, a name too long).

    Not a :class:`StorageError`: the file, not the storage, is at fault, and a retry (a
    follower's, say) would meet the same refusal.
    """

    __str__ = WeightStoreError.__str__


class SizeLimitError(WeightStoreError, ValueError):
    pass


class StoreClosedError(WeightStoreError, ValueError):
    pass


class WriteError(StorageError):
    """A write the file system refused; keeps its ``errno``, so callers that handle ``OSError`` still do."""

    def __init__(self, errno: int, message: str, *, path: str | None = None, key: str | None = None,
                 transient: bool = True) -> None:
        super().__init__(message, path=path, key=key, transient=transient)
        self.errno = errno


class AssignmentError(WeightStoreError, ValueError):
    """Carries the plan that failed so callers can inspect it, not only read it."""

    def __init__(
        self,
        message: str,
        *,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        mismatched: Iterable[object] = (),
        path: str | None = None,
    ) -> None:
        super().__init__(message, path=path)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


class LayoutError(WeightStoreError, ValueError):
    pass


class PublishError(WeightStoreError, RuntimeError):
    pass


class PieceError(PublishError, ValueError):
    """A piece :func:`~weightstore.publish_shard` cannot place: a start or shape that is no
    sequence of non-negative ints or does not fit its tensor, a list of Pieces and arrays, two
    pieces of a key at one index. A bad argument, so a ``ValueError`` too. Before it named the
    member and the key, a start or shape of non-ints and a list mixing Pieces and arrays raised
    ``TypeError``, which no longer catches them: catch ``ValueError`` or this class."""


class ShardTimeoutError(WeightStoreError, TimeoutError):
    """Ranks of a sharded version that did not finish in time (``missing``); nothing was published."""

    def __init__(self, message: str = "", *, path: str | None = None, missing: Iterable[int] = ()) -> None:
        super().__init__(message, path=path)
        self.missing = list(missing)


class UnsupportedTargetError(WeightStoreError, TypeError):
    """An object of no framework an adapter is registered for (``weightstore.adapters.adapter_for``),
    or one its adapter cannot assign into in place, which a follower needs (a Flax parameter tree)."""


class NotAPathError(WeightStoreError, TypeError):
    """What is no path given where one goes (a file to read or write, a folder): ``None``, most
    often ``ws.latest(folder)`` before the first version; a file object (``io.BytesIO``, an open
    file), since files are read and written by name. The message says what to pass instead. A
    ``TypeError`` too, as it was before it was a :class:`WeightStoreError`."""


class MissingDependencyError(WeightStoreError, ImportError):
    pass


def attach(exc: _E, *, path: object = None, key: str | None = None) -> _E:
    """``exc`` with ``path`` and ``key`` filled in where it has none; returned for ``raise attach(...)``."""
    if exc.path is None and path:
        exc.path = str(path)
    if exc.key is None and key is not None:
        exc.key = key
    return exc


def naming(*, path: object = None, key: str | None = None) -> contextlib.AbstractContextManager[None]:
    """Attach ``path`` (the file) and ``key`` (the tensor) to a :class:`WeightStoreError` raised
    inside that does not name them yet.

    The code that knows which file an operation is about wraps it, as httpx's
    ``request_context`` attaches the request to errors raised under it, so the checks below need
    not be handed the name only to put it in their messages: ``path``/``key`` are set as
    attributes (``ws --json`` prints them) and the message is composed from them.
    """
    return _Naming(path, key)


class _Naming(contextlib.AbstractContextManager):
    """:func:`naming`'s context: a plain class, a quarter of a generator context's cost (an
    open of a small file enters five)."""

    __slots__ = ("_path", "_key")

    def __init__(self, path: object, key: str | None):
        self._path, self._key = path, key

    def __exit__(self, kind: object, exc: BaseException | None, traceback: object) -> None:
        if isinstance(exc, WeightStoreError):
            attach(exc, path=self._path, key=self._key)
