"""The S3 backend: ranged GETs through s3fs's client, pinned to the object first read, and
conditional PUTs (``If-None-Match: *``, ``If-Match``) for the compare-and-swap commits rest on.

The first request is a suffix range (``bytes=-N``) whose ``Content-Range`` gives the size, so
opening costs one request; it also gives the object's ETag, and every later request carries
``If-Match`` with it (or the ``VersionId`` a versioned URL names), so an object replaced while
open fails that request (a :class:`FormatError`) instead of returning a mix of two files.
"""

from __future__ import annotations

import asyncio
import errno
import re
from collections.abc import Callable, Mapping
from typing import Any

from weightstore.errors import FormatError, StorageError, StoreNotFoundError, WeightStoreError
from weightstore.io._buffer import aligned_buffer
from weightstore.io.location import condition_refused, protocols, service_answer, storage_error
from weightstore.io.objects import MERGE_GAP, READ_CHUNK, Backend, Request, requests_for, scatter, window

__all__ = ["BACKEND", "S3Backend", "S3Object"]

#: a ranged answer's ``Content-Range``: first and last byte, and the object's size
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
#: concurrent requests per file when the file system names none (s3fs: ``max_concurrency``)
DEFAULT_CONCURRENCY = 8


class S3Object:
    """An S3 object through s3fs's client (see the module docstring)."""

    def __init__(self, fs: Any, path: str, name: str):
        self._fs, self.name = fs, name
        self._bucket, self._key, version = fs.split_path(path)
        self._pinned: dict[str, str] = {"VersionId": version} if version else {}
        self.concurrency = max(1, int(getattr(fs, "max_concurrency", None) or DEFAULT_CONCURRENCY))

    def first(self, index_at_end: bool, length: int, size: int | None,
              details: Mapping[str, Any] | None) -> tuple[int, int, memoryview]:
        if not self._key:  # a bucket (``s3://bucket/``): no object to ask for, and boto refuses an empty key
            raise FileNotFoundError(errno.ENOENT, "a bucket, not an object", self.name)
        if size is not None:
            self._pin(details or {})
            start, end = window(index_at_end, size, length)
            data = aligned_buffer(end - start, start)
            self.fill([(start, data)], opening=True)
            return size, start, data
        wanted = f"bytes=-{length}" if index_at_end else f"bytes=0-{length - 1}"
        try:
            response, body = self._run(self._get, wanted, True, opening=True)
        except _EmptyObject:
            return 0, 0, memoryview(b"")
        self._pin(response)
        total, start = len(body), 0
        answered = str(response.get("ContentRange", ""))
        match = _CONTENT_RANGE.fullmatch(answered)
        if match and match.group(3) != "*":
            start, total = int(match.group(1)), int(match.group(3))
        elif answered or (len(body) >= length and response.get("ResponseMetadata", {}).get("HTTPStatusCode") != 200):
            # a part (a 206, or a Content-Range without the object's size) that does not say where it
            # lies in the object: a suffix read's last bytes would be read as its first
            raise StorageError(f"asked for {wanted}, the storage answered with "
                               f"{f'Content-Range {answered!r}' if answered else 'a part and no Content-Range'}: "
                               "where its bytes lie in the object is unknown", path=self.name)
        if start + len(body) > total:
            raise FormatError("the storage returned more bytes than the object holds", path=self.name)
        data = aligned_buffer(len(body), start)
        data[:] = body
        return total, start, data

    def _pin(self, described: Mapping[str, Any]) -> None:
        etag = described.get("ETag") or described.get("etag")
        if etag and "VersionId" not in self._pinned:
            self._pinned["IfMatch"] = str(etag)

    def fill(self, ranges: list[tuple[int, memoryview]], opening: bool = False, gap: int = MERGE_GAP) -> None:
        requests = requests_for(ranges, gap)
        if requests:
            self._run(self._fill, requests, opening=opening)

    async def _fill(self, requests: list[Request]) -> None:
        gate = asyncio.Semaphore(self.concurrency)

        async def one(request: Request) -> None:
            async with gate:
                response, body = await self._request(f"bytes={request.start}-{request.end - 1}")
                try:  # straight into the targets as it arrives: no copy of the body is ever whole
                    self._require_range(response, request)
                    at, first = request.start, 0
                    while at < request.end:
                        chunk = await body.read(min(READ_CHUNK, request.end - at))
                        if not chunk:
                            break
                        first = scatter(request.targets, at, memoryview(chunk), first)
                        at += len(chunk)
                finally:
                    body.close()
            if at != request.end:
                raise FormatError(f"got {at - request.start} bytes at byte {request.start}, not "
                                  f"{request.end - request.start}: the object is shorter than its index says",
                                  path=self.name)

        await asyncio.gather(*(one(request) for request in requests))

    def _require_range(self, response: Mapping[str, Any], request: Request) -> None:
        """Refuse a ranged answer that holds other bytes than asked: a server (or a proxy before
        it) that ignores ``Range`` answers 200 with the whole object, and a body of the length
        asked for says nothing of where it starts; only ``Content-Range`` does."""
        answered = str(response.get("ContentRange", ""))
        if not answered and request.start == 0 and (response.get("ContentLength") or 0) >= request.end:
            return  # from the object's first byte (a service ignoring Range sends it whole): only those asked are read
        match = _CONTENT_RANGE.fullmatch(answered)
        if match is None or (int(match.group(1)), int(match.group(2)) + 1) != (request.start, request.end):
            said = f"bytes {match.group(1)}-{match.group(2)}" if match else \
                f"Content-Range {answered!r}" if answered else "no Content-Range (the whole object?)"
            raise StorageError(f"asked for bytes {request.start}-{request.end - 1}, the storage answered with {said}",
                               path=self.name)

    async def _request(self, wanted: str, empty_is_ok: bool = False) -> tuple[Mapping[str, Any], Any]:
        """The response to a ranged GET, and its body still to be read (the caller closes it)."""
        try:
            response = await self._fs._call_s3("get_object", Bucket=self._bucket, Key=self._key,
                                               Range=wanted, **self._pinned)
        except OSError as exc:
            code = _s3_code(exc)
            if empty_is_ok and code in ("InvalidRange", "416"):
                raise _EmptyObject() from None
            raise
        return response, response["Body"]

    async def _get(self, wanted: str, empty_is_ok: bool = False) -> tuple[Mapping[str, Any], bytes]:
        response, body = await self._request(wanted, empty_is_ok)
        try:
            return response, await body.read()
        finally:
            body.close()

    def _run(self, method: Any, *args: Any, opening: bool = False) -> Any:
        from fsspec.asyn import sync

        try:
            return sync(self._fs.loop, method, *args)
        except (WeightStoreError, _EmptyObject):
            raise
        except FileNotFoundError:
            if opening:
                raise
            raise StoreNotFoundError("the object was removed while it was open", path=self.name) from None
        except Exception as exc:
            if _s3_code(exc) in ("PreconditionFailed", "412"):
                raise FormatError("the object changed while it was open (its ETag no longer matches); open it again",
                                  path=self.name) from None
            if _s3_code(exc) in ("InvalidRange", "416"):
                raise FormatError("the object is shorter than its index says", path=self.name) from None
            raise storage_error(exc, self.name) from exc


class _EmptyObject(Exception):
    """S3 refuses any range of an empty object."""


def _s3_code(exc: BaseException) -> str | None:
    """The S3 error code behind an exception s3fs translated (it keeps the botocore error as the cause)."""
    answer = service_answer(exc)
    return None if answer is None else answer[0]


class S3Backend(Backend):
    """S3 through s3fs's client: :class:`S3Object` reads, and S3's own conditional writes."""

    def serves(self, fs: Any) -> bool:
        """Whether ``fs`` is s3fs's file system (its client is what this backend calls)."""
        return "s3" in protocols(fs) and hasattr(fs, "_call_s3")

    def object(self, fs: Any, path: str, name: str) -> S3Object:
        return S3Object(fs, path, name)

    def read_tagged(self, fs: Any, path: str, limit: int) -> tuple[bytes | None, str | None]:
        """One GET without a range (S3 refuses a range on an empty object), of which no more than
        ``limit`` bytes are taken off the wire: a hostile object of gigabytes allocates nothing more."""
        from fsspec.asyn import sync

        bucket, key, _ = fs.split_path(path)

        async def get() -> tuple[bytes, str]:
            response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
            body = response["Body"]
            chunks, left = [], limit
            try:
                while left > 0:  # a read returns what has arrived, up to its size: one network chunk, say
                    chunk = await body.read(left)
                    if not chunk:
                        break
                    chunks.append(chunk)
                    left -= len(chunk)
                return b"".join(chunks), str(response.get("ETag", ""))
            finally:
                body.close()

        try:
            return sync(fs.loop, get)
        except FileNotFoundError:
            return None, None

    def put_if(self, fs: Any, path: str, data: bytes, *, create: bool, expect: str | None) -> bool:
        """``create``: ``If-None-Match: *``; else ``If-Match`` with ETag ``expect``. A refused
        condition (``PreconditionFailed``, or ``ConditionalRequestConflict`` for two at once) is False."""
        from fsspec.asyn import sync

        bucket, key, _ = fs.split_path(path)
        condition = {"IfNoneMatch": "*"} if create else {"IfMatch": expect} if expect else {}
        try:
            sync(fs.loop, fs._call_s3, "put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except Exception as exc:
            if isinstance(exc, FileExistsError) or _s3_code(exc) in ("PreconditionFailed", "412",
                                                                    "ConditionalRequestConflict", "409"):
                return False
            if condition and condition_refused(exc):  # a 501 is no outage: a publisher must not wait it out
                raise StorageError(f"the store refuses conditional writes ({next(iter(condition))}; it answered "
                                   f"{_s3_code(exc)}), which replacing {key.rsplit('/', 1)[-1]} needs so that two "
                                   "publishers never overwrite each other unseen: use a store that has them (AWS S3, "
                                   "a recent MinIO, R2)", path=f"s3://{path}", transient=False) from exc
            raise
        finally:
            fs.invalidate_cache(path)
        return True

    def abort_uploads(self, fs: Any, folder: str, dead: Callable[[str], bool]) -> list[str]:
        """One ``ListMultipartUploads`` of the folder's prefix (more where the service truncates it),
        then an ``AbortMultipartUpload`` of each dead one (one already gone is no failure). A
        folder at a bucket's root lists the whole bucket (no prefix). A service that says a listing
        is truncated but gives no markers past the ones it was asked with is refused
        (:class:`StorageError`), rather than asked the same page for ever."""
        from fsspec.asyn import sync

        bucket, prefix, _ = fs.split_path(folder.rstrip("/") + "/")
        prefix = prefix if not prefix or prefix.endswith("/") else prefix + "/"
        aborted: list[str] = []
        markers: dict[str, str] = {}
        while True:
            listed = sync(fs.loop, fs._call_s3, "list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            for upload in listed.get("Uploads", []):
                name = str(upload["Key"])[len(prefix):]
                if not dead(name):
                    continue
                try:
                    sync(fs.loop, fs._call_s3, "abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                         UploadId=upload["UploadId"])
                except FileNotFoundError:  # s3fs's NoSuchUpload: completed or aborted meanwhile
                    continue
                aborted.append(name)
            if not listed.get("IsTruncated"):
                return aborted
            following = {"KeyMarker": listed.get("NextKeyMarker", ""),
                         "UploadIdMarker": listed.get("NextUploadIdMarker", "")}
            if following == (markers or {"KeyMarker": "", "UploadIdMarker": ""}):
                raise StorageError(f"the listing of unfinished uploads says it is truncated but does not go on past "
                                   f"{following['KeyMarker'] or 'its start'}", path=f"s3://{bucket}/{prefix}",
                                   transient=False)
            markers = following


BACKEND = S3Backend()
