"""How a write becomes visible: every commit protocol as a named type, with its crash argument.

A reader must only ever see a whole file, old or new, and a crash at any instant must leave one
of the two. Each way weightstore reaches that is a type here (:class:`Commit`: :meth:`begin`
names the local path the writer fills, :meth:`finalize` makes it visible, :meth:`discard`
leaves the target as it was; :meth:`Commit.writing` is the three as a context manager), or a
documented composition of them:

1. *Rename* (:class:`RenameCommit`; every local file: ``save``, version files, ``LATEST``, a TF
   checkpoint's ``checkpoint`` state file). The data goes to a temporary beside the target
   (:func:`~weightstore.io.files.temporary_beside`), is fsynced, renamed over the target, and
   the folder is fsynced. A crash before the rename leaves the old file plus a temporary; after
   it, the new file. The temporary of a killed writer is removed by the next write to that
   target, as that write begins (so before a save that reserves its blocks reserves them, see
   :mod:`weightstore.io._writeback`; one begun while this process wrote the target goes within a
   minute, see :func:`~weightstore.io.files.remove_stale_temporaries`): once its PID is dead if the temporary names this PID
   namespace (at once if it names this very process, which is not writing it: an earlier process
   of this PID's), once untouched for a day if it names another (a container on a shared volume,
   another host: its PIDs mean nothing here), see :mod:`weightstore.io.files`. Only regular
   files are replaced: a folder, FIFO, socket or
   device at the target is refused before anything is written, a symlink is written *through*
   (its target file is replaced, the link stays) by ``ws.save``, but refused in a versioned
   folder (``follow_symlinks=False``: a link planted in a shared folder must not overwrite a
   file outside it), and the new file keeps the permission bits of the one it replaces.
2. *Upload* (:class:`UploadCommit`; URLs). Object stores have no rename, but make an object
   visible all at once when its upload completes (S3 PutObject / CompleteMultipartUpload), so
   the file is written to a local scratch folder and sent in one ``put``: on S3, a file of at
   least two parts (:data:`UPLOAD_PART_BYTES`) goes as a multipart upload whose parts are sent
   concurrently (s3fs's ``max_concurrency`` storage option, default 10), and the object appears
   only at CompleteMultipartUpload. A crash leaves the old object; an unfinished multipart
   upload is invisible (s3fs aborts it when a part fails), and the scratch folder of a writer
   killed goes with the first upload of a later process
   (:func:`~weightstore.io.files.scratch_folder`). ``new=True`` makes the upload only where no
   object has the name (S3's ``If-None-Match: *``, on the PUT or on the completion): a version
   file, whose name is its step, so that a publisher stopped mid-publish and resumed after
   another took the folder over never replaces the other's version of that step. Such an
   upload carries a token of its own (:data:`UPLOAD_TOKEN`), so the client's retry of a request
   whose answer was lost after the object landed, refused, finds its own object: landed.
3. *Pointer last* (versioned folders, :mod:`weightstore.sync._publish`). Each version file is
   committed by 1 or 2, and only then the small ``LATEST`` pointer, by the same protocol.
   Readers reach versions only through ``LATEST``, so a crash between the two leaves a version
   file no reader sees; the publisher's intent record says which file that is.
4. *Index last* (:class:`IndexLastCommit`; TF checkpoints written by ``ws import``). A
   checkpoint is ``PREFIX.index`` plus ``PREFIX.data-NNNNN-of-MMMMM`` files whose names
   TensorFlow fixes (``MMMMM`` is the shard count the index records). The new checkpoint is
   written under a temporary prefix beside the target with a shard count no data file at the
   prefix has, so its data files take names the old index never reads; they are fsynced and
   renamed in beside the old ones, and renaming ``.index`` over the old one is the single
   commit point. A crash before it leaves the old checkpoint whole (plus unreferenced data
   files); after it, the new one whole (plus the old data files). Either leftover, and
   temporaries of killed writers, are removed by the next write to the prefix. The one
   exception: when no unused shard count is small enough for the entries (one entry replacing
   a one-shard checkpoint), the data is written as one shard and renamed over the old one
   before ``.index``; a crash between those renames leaves the old index over the new data,
   which TensorFlow refuses to read (each entry's CRC-32C no longer matches) rather than
   returning wrong values. The folder's ``checkpoint`` state file, which makes a new prefix
   findable (``tf.train.latest_checkpoint``), is replaced after the index by protocol 1: a
   crash between the two leaves a whole checkpoint the state file does not name yet.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from weightstore.errors import StorageError, StoreExistsError, StoreNotFoundError, WeightStoreError, WriteError
from weightstore.io._writeback import behind
from weightstore.io.files import (
    check_writable_target,
    fsync_folder,
    fsync_path,
    remove_scratch,
    remove_stale_temporaries,
    scratch_folder,
    temporary_beside,
    temporary_done,
)
from weightstore.io.location import (
    Location,
    condition_refused,
    filesystem,
    protocols,
    service,
    service_answer,
    transient,
)

__all__ = ["UPLOAD_PART_BYTES", "Commit", "RenameCommit", "UploadCommit", "IndexLastCommit", "commit_for",
           "checkpoint_files"]

_log = logging.getLogger(__name__)

#: part size of a multipart upload to S3 (at least 5 MiB, S3's floor): s3fs's own default of
#: 50 MiB sends anything under 100 MiB as one serial PUT
UPLOAD_PART_BYTES = 8 << 20
#: the user metadata (``x-amz-meta-…``) an upload made only where no object has the name carries:
#: a token of its own, that tells its retry, refused, the object it landed itself from another's
UPLOAD_TOKEN = "weightstore-upload"


class Commit(abc.ABC):
    """One way a file becomes visible at its target (see the module docstring).

    :meth:`writing` yields a local path to write the whole file to; leaving the block normally
    commits it, an exception discards it and leaves the target as it was.
    """

    target: str
    #: whether the file reached the target (the commit point passed), even where a step after it
    #: failed (the folder's fsync, an interrupt): a caller undoing a composed write (a sharded
    #: folder's index last) must not undo what that file already names
    landed = False

    @abc.abstractmethod
    def begin(self) -> str:
        """Prepare and return the local path the writer fills."""

    @abc.abstractmethod
    def finalize(self) -> None:
        """Make the written file visible at the target, durably."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Remove whatever :meth:`begin` and the writer left; the target is untouched."""

    @abc.abstractmethod
    def exists(self) -> bool:
        """Whether something is at the target already (what a save without ``overwrite`` refuses)."""

    def still_landed(self) -> bool:
        """Whether the target still holds what this commit landed, where the storage can tell: a
        publisher that goes on after a pause must not name another writer's object as its own.
        True here: a local folder's lock keeps other writers of its versions out."""
        return True

    @contextlib.contextmanager
    def writing(self) -> Iterator[str]:
        """A write the file system refuses (disk full, file-size limit, read-only) comes out as
        a :class:`WriteError` naming the target and keeping the ``errno``, so a caller that
        handles ``OSError`` still does and a background publish says which file failed. A writer's
        own error about the temporary it was given (HDF5's) names the target too: the caller
        never gave the temporary's name, and it is gone once discarded."""
        path = self.begin()
        try:
            yield path
            self.finalize()
        except WeightStoreError as exc:
            self.discard()
            if exc.path == path:
                exc.path = self.target
            raise
        except OSError as exc:
            self.discard()
            raise WriteError(exc.errno or 0, f"writing failed: {exc.strerror or exc}", path=self.target,
                             transient=transient(exc)) from exc  # an object store's answer: a bucket gone stays
        except BaseException:
            self.discard()
            raise


class RenameCommit(Commit):
    """Protocol 1: a temporary beside the target, fsync, rename over it, fsync the folder."""

    def __init__(self, target: str | Path, *, follow_symlinks: bool = True, swept: bool = False):
        self.target = str(target)
        self._final = self.target  # a str throughout: pathlib cost a small save 10 us
        self._temporary: str | None = None
        self._mode: int | None = None  # the replaced file's, as the write began (None: none there)
        self._follow_symlinks = follow_symlinks
        #: the caller swept the target's folder of dead writers' temporaries just now, under the
        #: lock every writer of the target takes: no listing of it again
        self._swept = swept

    def begin(self) -> str:
        self._final, self._mode = check_writable_target(self.target, follow_symlinks=self._follow_symlinks)
        # the one sweep of killed writers' temporaries of the target, before the write: their blocks
        # are free before it reserves its own. Here, not on the writeback thread: a reservation
        # waiting there would wait behind the last save's close of the file it replaced (4-7 ms).
        # No listing where nothing changed in the folder since this process's last write of the target
        if not self._swept:
            remove_stale_temporaries(self._final, unless_clean=True)
        self._temporary = temporary_beside(self._final)
        return self._temporary

    def finalize(self) -> None:
        assert self._temporary is not None, "begin() first"
        fsync_path(self._temporary)
        if self._mode is not None:  # a re-save keeps 0600 (the mode the begin's lstat saw: no stat again)
            os.chmod(self._temporary, stat.S_IMODE(self._mode))
        replaced = _hold(self._final)
        try:
            os.replace(self._temporary, self._final)
            done, self._temporary, self.landed = self._temporary, None, True
            temporary_done(done)
            fsync_folder(os.path.dirname(self._final) or ".", written=self._final)
        finally:
            if replaced is not None:
                behind(os.close, replaced)

    def discard(self) -> None:
        if self._temporary is not None:
            with contextlib.suppress(OSError):  # never hides why the write failed (a name too long, say)
                os.unlink(self._temporary)
            temporary_done(self._temporary)
            self._temporary = None

    def exists(self) -> bool:
        return os.path.lexists(self.target)


def _hold(path: str) -> int | None:
    """A descriptor of the file a rename is about to replace, or None (none there, unreadable,
    or not POSIX). Held across the rename, it keeps the old file's blocks from being freed
    inside the rename: on ext4 mounted with ``discard`` that took 4 ms, a third of a durable
    save of 100 KB. Closed behind (:func:`~weightstore.io._writeback.behind`), the last close
    frees them while the caller goes on."""
    if os.name != "posix":
        return None
    try:
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None


class UploadCommit(Commit):
    """Protocol 2: written in a local scratch folder, then sent in one upload."""

    def __init__(self, url: str, *, suffix: str = "", storage_options: Mapping[str, Any] | None = None,
                 new: bool = False):
        self.target = url
        self._fs, self._remote = filesystem(url, storage_options)
        self._suffix = suffix
        #: upload only where no object has the name (S3); elsewhere the caller's lock or promise
        #: of one writer stands for it
        self._new = new
        self._scratch: str | None = None
        #: the token the upload carried (:data:`UPLOAD_TOKEN`), once an upload with one landed
        self._landed_token: str | None = None

    def begin(self) -> str:
        self._scratch = scratch_folder("weightstore-upload-")
        return os.path.join(self._scratch, "upload" + self._suffix)

    def finalize(self) -> None:
        assert self._scratch is not None, "begin() first"
        local = os.path.join(self._scratch, "upload" + self._suffix)
        on_s3 = "s3" in protocols(self._fs)
        options: dict[str, Any] = {"chunksize": UPLOAD_PART_BYTES} if on_s3 else {}
        token = secrets.token_hex(16)
        store = _store_of(self._fs) if self._new and on_s3 else None
        if store is not None:
            options.update(Metadata={UPLOAD_TOKEN: token})
            if store not in _unconditional:
                options.update(mode="create")
        try:
            with service(self.target):
                try:
                    self._fs.put_file(local, self._remote, **options)
                except OSError as exc:
                    if options.get("mode") != "create" or not condition_refused(exc):
                        raise
                    del options["mode"]  # once, plainly: an answer it gives again is no refusal of the condition
                    self._fs.put_file(local, self._remote, **options)
                    _unconditional.add(str(store))
                    _log.warning("%s refuses uploads made only where no object has the name (If-None-Match: *; it "
                                 "answered %s), so weightstore uploads version files there unconditionally: a "
                                 "publisher paused mid-publish while a trainer restarted elsewhere published the "
                                 "same step can replace that version (its token still tells each publisher whether "
                                 "the object is its own before it names it in LATEST)", store, _answered(exc))
        except StorageError as exc:
            if not (self._new and on_s3 and _already_there(exc)):
                raise
            if not self._uploaded_with(token):
                raise StoreExistsError("was not uploaded: another writer's object of that name appeared while it "
                                       "was written", path=self.target) from exc
        except FileNotFoundError as exc:
            answer = service_answer(exc)
            if answer is None or answer[0] != "NoSuchUpload":
                raise
            # s3fs aborts an upload whose completion failed: one the first try of a completion
            # whose answer was lost completed is no upload any more, and its retry was refused
            if not (self._new and on_s3 and self._uploaded_with(token)):
                raise WriteError(exc.errno or 0, "its upload was aborted while it was sent: another process took it "
                                 "for a killed writer's (the commit of another attempt or a later step, a publish "
                                 "that moved LATEST past it, or ws clean), so what it writes is dead",
                                 path=self.target, transient=False) from exc
        self.landed = True
        self._landed_token = token if self._new and on_s3 else None
        self.discard()

    def discard(self) -> None:
        if self._scratch is not None:
            remove_scratch(self._scratch)
            self._scratch = None

    def exists(self) -> bool:
        with service(self.target):
            return bool(self._fs.exists(self._remote))

    def still_landed(self) -> bool:
        """One HEAD: whether the object still carries this upload's token (an upload without one
        is taken to: nothing tells it apart)."""
        return self._landed_token is None or self._uploaded_with(self._landed_token)

    def _uploaded_with(self, token: str) -> bool:
        """Whether the object at the name is this commit's own upload (it carries ``token``): a
        request whose answer was lost (a timeout, a reset connection) after the object landed is
        sent again by the client (botocore, s3fs), and that retry meets its own object."""
        try:
            with service(self.target):
                return bool(self._fs.metadata(self._remote).get(UPLOAD_TOKEN) == token)
        except FileNotFoundError:  # two conditional writes at once (409), neither landed yet
            return False


#: the S3 endpoints (:func:`_store_of`) that refused a conditional upload, which are sent
#: unconditionally from then on in this process
_unconditional: set[str] = set()


def _store_of(fs: Any) -> str:
    """The S3 endpoint ``fs`` sends its requests to: what an S3-compatible store is told by."""
    client = getattr(fs, "s3", None)
    return str(getattr(getattr(client, "meta", None), "endpoint_url", None) or "S3")


def _answered(exc: BaseException) -> str:
    answer = service_answer(exc)
    return "nothing" if answer is None else f"{answer[1]} {answer[0]}"


def _already_there(exc: BaseException) -> bool:
    """Whether a conditional upload failed because an object has the name now (S3 answers 412, or
    409 for two conditional writes at once; s3fs gives the first as ``FileExistsError``)."""
    answer = service_answer(exc)
    return isinstance(exc.__cause__, FileExistsError) or (
        answer is not None and answer[0] in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"))


def commit_for(location: Location, *, suffix: str = "",
               storage_options: Mapping[str, Any] | None = None) -> RenameCommit | UploadCommit:
    """The commit protocol a write to ``location`` uses: rename locally, one upload to a URL."""
    if location.remote:
        return UploadCommit(location.text, suffix=suffix, storage_options=storage_options)
    return RenameCommit(location.text)


#: a TF checkpoint's data file, by the shard count its name records
_DATA_FILE = re.compile(r"\.data-[0-9]{5}-of-([0-9]{5})\Z")
#: what a checkpoint writer appends to the temporary prefix (``-partN``: a sharded write's pieces;
#: ``.tempstateN``: TensorFlow's SaveV2 writes a data file under that name, then renames it)
_TEMPORARY_ENDINGS = r"(?:-part[0-9]+)?(?:\.index|\.data-[0-9]{5}-of-[0-9]{5}(?:\.tempstate[0-9]+)?)?"
#: the most bytes of those endings (a thousand pieces, TensorFlow's 64-bit random number), which a
#: temporary prefix leaves room for: a prefix TensorFlow itself writes is written through it too
_TEMPORARY_ROOM = len("-part999.data-00000-of-00001.tempstate18446744073709551615")


class IndexLastCommit(Commit):
    """Protocol 4: a TF checkpoint's data files under fresh names, then ``.index`` renamed last.

    :meth:`begin` returns the temporary *prefix* the writer saves the checkpoint at, as
    :attr:`shards` data files (``PREFIX.data-NNNNN-of-<shards>``, plus ``PREFIX-partN`` pieces a
    sharded writer merges); ``entries`` is how many tensors it holds (a shard holds at least one).
    """

    def __init__(self, prefix: str, *, entries: int):
        self.target = prefix
        self._entries = entries
        self._temporary: str | None = None
        self._moved: list[str] = []
        #: how many data files the writer writes; fixed by :meth:`begin`
        self.shards = 1
        self._fresh_names = True

    def begin(self) -> str:
        target = Path(self.target)
        if not target.parent.is_dir():
            raise StoreNotFoundError(f"folder {str(target.parent)!r} does not exist", path=self.target)
        remove_stale_temporaries(target, _TEMPORARY_ENDINGS, room=_TEMPORARY_ROOM)
        taken = {int(match.group(1)) for path in checkpoint_files(self.target)
                 if (match := _DATA_FILE.search(path))}
        self.shards = next(n for n in range(1, len(taken) + 2) if n not in taken)
        self._fresh_names = self.shards <= self._entries
        if not self._fresh_names:
            self.shards = 1  # the exception of the module docstring: data renamed over the old data
        try:  # a checkpoint rewritten keeps the permission bits of the one it replaces (0600 stays 0600)
            self._mode: int | None = stat.S_IMODE(os.stat(self.target + ".index").st_mode)
        except FileNotFoundError:
            self._mode = None
        # last: a begin that fails has no discard (see writing), so nothing after it may fail
        # and leave its name noted as this process's write for good (see temporary_done)
        self._temporary = str(temporary_beside(target, room=_TEMPORARY_ROOM))
        return self._temporary

    def finalize(self) -> None:
        assert self._temporary is not None, "begin() first"
        temporary, prefix = self._temporary, self.target
        written = checkpoint_files(temporary)
        for path in written:
            if self._mode is not None:
                os.chmod(path, self._mode)
            fsync_path(path)
        for path in written:
            if not path.endswith(".index"):
                os.replace(path, prefix + path[len(temporary):])
                self._moved.append(prefix + path[len(temporary):])
        fsync_folder(Path(prefix).parent)
        os.replace(temporary + ".index", prefix + ".index")  # the commit point
        self._temporary, self.landed = None, True
        temporary_done(temporary)
        kept = {prefix + path[len(temporary):] for path in written}
        for stale in checkpoint_files(prefix):
            if _DATA_FILE.search(stale) and stale not in kept:
                os.unlink(stale)
        fsync_folder(Path(prefix).parent)

    def discard(self) -> None:
        temporary = self._temporary
        if temporary is None:
            return
        folder, base = os.path.split(temporary)
        try:
            with contextlib.suppress(FileNotFoundError):  # its files, pieces and TF's .tempstate files (a write refused midway)
                for name in os.listdir(folder or "."):
                    if name.startswith(base) and re.fullmatch(_TEMPORARY_ENDINGS, name[len(base):]):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(folder, name))
        finally:  # a listing refused: what is left goes with a later sweep, its name no longer noted as written
            temporary_done(temporary)
        if self._fresh_names:  # data files the old index never names
            for path in self._moved:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._temporary, self._moved = None, []

    def exists(self) -> bool:
        return os.path.exists(self.target + ".index")


def checkpoint_files(prefix: str) -> list[str]:
    """The ``.index`` and ``.data-…`` files of the TF checkpoint at ``prefix`` that exist."""
    folder, base = os.path.split(prefix)
    with contextlib.suppress(FileNotFoundError):
        return [os.path.join(folder, name) for name in os.listdir(folder or ".")
                if name == base + ".index" or (name.startswith(base + ".data-") and _DATA_FILE.search(name))]
    return []
