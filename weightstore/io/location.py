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
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from weightstore.core._extras import install_hint
from weightstore.errors import (
    FileAccessError,
    MissingDependencyError,
    NotAPathError,
    StorageError,
    StoreNotFoundError,
    WeightStoreError,
)

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


#: what a path of ``None`` most often is: ``ws.open(ws.latest(folder))`` before the first publish
NO_VERSION_YET = ("a path or a Version was expected, not None (ws.latest(folder) is None while the folder has no "
                  "version yet: wait for one with ws.follow(folder) or a Follower's wait())")


def refused_path(value: Any, *, reading: bool = True, expected: str = "a path or URL") -> NotAPathError:
    """The refusal of ``value``, which is no path, given where one goes (``expected``: what does),
    saying what to pass instead. ``None`` is most often, to a reader, ``ws.latest(folder)`` before the
    first publish (``reading=False``: a file to write, refused plainly, as no ``ws.latest`` gave it);
    a file object (``io.BytesIO``, an open file) is told its own name where it has one (``open``'s
    ``name`` is the path it was given; ``os.fdopen``'s is a descriptor number, no path). Every
    reader, writer and assign refuses through here."""
    if value is None:  # os.fsdecode's own TypeError names no cause
        return NotAPathError(NO_VERSION_YET if reading else "a path was expected, not None")
    if not (hasattr(value, "read") or hasattr(value, "write")):
        return NotAPathError(f"{expected} was expected, not {type(value).__name__}")
    name = getattr(value, "name", None)
    if isinstance(name, (str, bytes)):
        instead = f"pass its name instead: {os.fsdecode(name)!r}"
    elif reading:
        instead = "write its bytes to a file and pass that file's name"
    else:
        instead = "give the name of the file or folder to write"
    return NotAPathError(f"a path or URL was expected, not a file object ({type(value).__name__}): weightstore "
                         f"opens and writes files by name, as its readers map them and its writers replace them "
                         f"whole; {instead}")


def location_of(path: Any, *, reading: bool = True) -> Location:
    """The location behind anything weightstore accepts as a file (``Version`` has ``.path``): a
    ``str``, an ``os.PathLike``, or a ``bytes`` path, decoded as :func:`os.fsdecode` decodes it
    (as ``open`` and ``os`` take one), so errors name it as text; anything else is refused
    (:func:`refused_path`)."""
    if hasattr(path, "path") and not isinstance(path, (str, bytes, os.PathLike)):
        path = path.path
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise refused_path(path, reading=reading)
    text = os.fsdecode(path)
    if text.startswith("file://"):
        text = text[len("file://"):]
    remote = is_url(text)
    if not remote and "\0" in text:  # os refuses it with a bare ValueError, naming nothing
        # named with the NUL as \x00: a terminal shows none, and a C log sink cuts the name there
        raise FileAccessError("cannot be opened (its name holds a NUL byte, which no file name can)",
                              path=text.replace("\0", "\\x00"))
    return Location(text, remote)


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
    """A failure of the storage service itself (network, credentials, outage), as a weightstore
    error that says whether it may pass (:func:`transient`)."""
    return StorageError(f"storage failed ({type(exc).__name__}: {str(exc).strip() or 'no detail'})", path=where,
                        transient=transient(exc))


#: the service's answers that say "later": throttling and timeouts (S3's codes, and statuses)
_LATER = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                    "RequestTimeout", "408", "429"})


def service_answer(exc: BaseException) -> tuple[str, int] | None:
    """The error code and HTTP status the service answered with, from the first exception in
    ``exc``'s chain that carries botocore's ``response`` (s3fs keeps it as the cause of what it
    raises); ``None`` where the service never answered (no connection, a host not found)."""
    seen = 0
    while exc is not None and seen < 8:
        response = getattr(exc, "response", None)
        if isinstance(response, Mapping):
            error = response.get("Error") or {}
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return str(error.get("Code") or status or ""), int(status)
        exc, seen = exc.__cause__ or exc.__context__, seen + 1  # type: ignore[assignment]
    return None


def _operation(exc: BaseException | None) -> str | None:
    """The S3 operation (``PutObject``, ``UploadPart``) whose answer is in ``exc``'s chain, as
    botocore names it; ``None`` where none is named."""
    for _ in range(8):
        if exc is None:
            return None
        if isinstance(getattr(exc, "response", None), Mapping):
            name = getattr(exc, "operation_name", None)
            return name if isinstance(name, str) else None
        exc = exc.__cause__ or exc.__context__
    return None


def condition_refused(exc: BaseException) -> bool:
    """Whether a write's condition (``If-None-Match``, ``If-Match``) was refused as unknown to
    the store, not as unmet: some S3-compatible stores (versions of MinIO, Ceph, R2) answer it on
    a PUT or a multipart completion with 501 ``NotImplemented`` or 400 ``InvalidArgument`` or
    ``NotImplemented``, which no retry of the same request changes. Only the request that
    carries the condition tells it so: such an answer to a multipart upload's part (a proxy's
    hiccup) is no refusal of it, and taking it as one made the process's uploads unconditional."""
    answer = service_answer(exc)
    if answer is None or _operation(exc) not in (None, "PutObject", "CompleteMultipartUpload"):
        return False
    code, status = answer
    return status == 501 or code in ("NotImplemented", "501") or (
        status == 400 and code in ("InvalidArgument", "NotImplemented"))


def transient(exc: BaseException) -> bool:
    """Whether a storage failure may pass by itself: the service answered 5xx or "later"
    (:data:`_LATER`), or never answered because the connection was refused, reset or timed out
    (a server down or restarting). Not: any other answer (403 credentials refused, 404 a bucket
    that is not there, 400) nor a host name that resolves to nothing (a mistyped endpoint), which
    stay until someone acts. A failure of neither kind counts as passing, as every one did."""
    answer = service_answer(exc)
    if answer is not None:
        code, status = answer
        return status >= 500 or code in _LATER
    unanswered = connection_failure(exc)
    return True if unanswered is None else unanswered


def connection_failure(exc: BaseException) -> bool | None:
    """Whether the connection failure in ``exc``'s chain may pass: True for a connection refused,
    reset or timed out, or a name server that did not answer; False for a host name that names no
    host; ``None`` where the chain holds no connection failure."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, socket.gaierror):
            return exc.errno == socket.EAI_AGAIN  # a name server that did not answer, not a name it does not know
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1  # type: ignore[assignment]
    return None


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
