"""Where a file lives: a local path or an fsspec URL, decided once; and how a storage service fails.

No other module decides "local path or URL?" for itself: :func:`location_of` turns what a user
passes (a path, ``file://`` URL, fsspec URL, or anything with a ``.path`` such as a
``Version``) into a :class:`Location`. Every failure of a storage service (network,
credentials, outage) becomes a :class:`StorageError` through :func:`storage_error`, so callers
can tell "try again later" from "this file is damaged".
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from weightstore.core._extras import install_hint
from weightstore.errors import MissingDependencyError, StorageError, StoreNotFoundError, WeightStoreError

__all__ = ["Location", "location_of", "is_url", "filesystem", "protocols", "storage_error", "service"]


def is_url(path: object) -> bool:
    """Whether ``path`` names an fsspec URL rather than a local file (``file://`` is local)."""
    text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    return "://" in text and not text.startswith("file://")


@dataclass(frozen=True)
class Location:
    """A path or URL, with the one decision every caller needs made once: is it remote?"""

    text: str
    remote: bool

    def __str__(self) -> str:
        return self.text


def location_of(path: Any) -> Location:
    """The location behind anything weightstore accepts as a file (``Version`` has ``.path``): a
    ``str``, an ``os.PathLike``, or a ``bytes`` path, decoded as :func:`os.fsdecode` decodes it
    (as ``open`` and ``os`` take one), so errors name it as text."""
    if hasattr(path, "path") and not isinstance(path, (str, bytes, os.PathLike)):
        path = path.path
    text = os.fsdecode(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    return Location(text, is_url(text))


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """The fsspec file system and its path for ``url``; fsspec is imported only for URLs."""
    import fsspec  # a core dependency

    try:
        return fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as exc:  # fsspec knows the protocol, its implementation is not installed
        protocol = url.partition("://")[0]
        if protocol in ("s3", "s3a"):
            raise MissingDependencyError(f"{protocol}:// URLs need s3fs, which is not installed: {install_hint('s3')}",
                                         path=url) from None
        raise MissingDependencyError(f"{protocol}:// URLs need the fsspec file system for them: {exc}", path=url) from None
    except ValueError as exc:
        if not str(exc).startswith("Protocol not known"):
            raise
        protocol = str(exc).rpartition(":")[2].strip()
        raise StoreNotFoundError(f"{protocol}:// is no storage weightstore knows: use a local path or a URL "
                                 "fsspec reads (s3://, gs://, az://, http(s)://, memory://, ...)", path=url) from None


def on_filesystem(url: str, fs: Any = None) -> tuple[Any, str]:
    """``url``'s file system and its path there: ``fs`` where the caller already has one (its
    storage options hold for every file of a version), else the URL's own (:func:`filesystem`)."""
    return filesystem(url) if fs is None else (fs, fs._strip_protocol(url))


def uncached(fs: Any, path: str) -> str:
    """``path``, with whatever ``fs`` cached about it in this process dropped, for a read that
    must see what another process wrote since: s3fs (and other fsspec file systems) answer
    ``info``/``open``/``exists`` from a listing made earlier, which knows nothing of objects
    written after it (a new version read as missing, a replaced one with its old size)."""
    fs.invalidate_cache(path)
    return path


def protocols(fs: Any) -> tuple[str, ...]:
    """The protocol names an fsspec file system answers to (``("s3", "s3a")``)."""
    return tuple(fs.protocol) if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)


def storage_error(exc: BaseException, where: str) -> StorageError:
    """A failure of the storage service itself (network, credentials, outage), as a weightstore error."""
    return StorageError(f"storage failed ({type(exc).__name__}: {str(exc).strip() or 'no detail'})", path=where)


@contextlib.contextmanager
def service(where: str) -> Iterator[None]:
    """Calls to a storage service: its failures become :func:`storage_error`; a missing file
    (``FileNotFoundError``) and weightstore's own errors pass through as they are."""
    try:
        yield
    except (FileNotFoundError, WeightStoreError):
        raise
    except Exception as exc:
        raise storage_error(exc, where) from exc
