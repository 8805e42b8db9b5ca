"""Every exception weightstore raises, in one place.

Each class also subclasses the builtin it refines, so callers may catch either the
weightstore class or the builtin they already handle::

    WeightStoreError
    ├── InvalidKeyError(ValueError)        a key breaks the key rules
    ├── UnsupportedDTypeError(TypeError)   object, string or structured arrays
    ├── SelectionError(ValueError)         a scope/include/exclude that keeps nothing
    ├── StoreNotFoundError(FileNotFoundError)
    │   └── VersionGoneError               a version pruned under a reader; retry
    ├── StoreExistsError(FileExistsError)  overwrite=False and the target exists
    ├── KeyNotInStoreError(KeyError)
    ├── FormatError(ValueError)            not a weightstore/npz/HDF5 file, or a corrupt one
    │   ├── ChecksumError                  a tensor's bytes do not match the manifest
    │   └── UnsafeFileError                pickles, links, external storage, zip tricks
    ├── SizeLimitError(ValueError)         a read would exceed ``max_bytes``
    ├── StoreClosedError(ValueError)       a tensor asked of a store after ``close()``
    ├── WriteError(OSError)                the file system refused a write (disk full, size limit)
    ├── AssignmentError(ValueError)        assign found missing/unexpected/mismatched keys
    ├── PublishError(RuntimeError)         a second publisher, or steps that go back
    └── MissingDependencyError(ImportError) an optional extra is not installed
"""

from __future__ import annotations

from collections.abc import Iterable

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
    "SizeLimitError",
    "StoreClosedError",
    "WriteError",
    "AssignmentError",
    "PublishError",
    "MissingDependencyError",
]


class WeightStoreError(Exception):
    """Root of every error weightstore raises on purpose."""


class InvalidKeyError(WeightStoreError, ValueError):
    pass


class UnsupportedDTypeError(WeightStoreError, TypeError):
    pass


class SelectionError(WeightStoreError, ValueError):
    pass


class StoreNotFoundError(WeightStoreError, FileNotFoundError):
    pass


class VersionGoneError(StoreNotFoundError):
    """The version was pruned between finding it and opening it: look again and retry."""


class StoreExistsError(WeightStoreError, FileExistsError):
    pass


class KeyNotInStoreError(WeightStoreError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class FormatError(WeightStoreError, ValueError):
    pass


class ChecksumError(FormatError):
    pass


class UnsafeFileError(FormatError):
    pass


class SizeLimitError(WeightStoreError, ValueError):
    pass


class StoreClosedError(WeightStoreError, ValueError):
    pass


class WriteError(WeightStoreError, OSError):
    """Keeps the ``errno`` of the failed write, so callers that handle ``OSError`` still do."""


class AssignmentError(WeightStoreError, ValueError):
    """Carries the plan that failed so callers can inspect it, not only read it."""

    def __init__(
        self,
        message: str,
        *,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        mismatched: Iterable[object] = (),
    ) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


class PublishError(WeightStoreError, RuntimeError):
    pass


class MissingDependencyError(WeightStoreError, ImportError):
    pass
