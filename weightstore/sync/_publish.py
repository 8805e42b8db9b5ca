"""Versioned folders: a trainer ``publish``es, readers take ``latest`` or ``follow``.

A folder (local path or fsspec URL) holds version files named by step
(``step-000000000042.npz``) and a small JSON pointer, ``LATEST``, naming one of them. The
order of a publish is what makes readers safe without talking to the writer:

1. the version file is written completely (locally: temporary file, fsync, rename; on object
   stores: one upload, which becomes visible all at once);
2. only then is ``LATEST`` replaced (locally by rename; on object stores by one small PUT,
   the last object written);
3. then versions past ``keep`` are pruned, never the one ``LATEST`` names nor the one before
   it, so a reader that has just read ``LATEST`` has a whole publish to open its file.

Readers only ever reach a version through ``LATEST``, so leftovers of a killed publish (a
temporary file, or a complete version ``LATEST`` never named) are invisible to them; the next
publish removes them. It knows which complete file is a leftover because every publish first
records its intent (``.publishing``, naming its step) and removes that record once ``LATEST``
names the new version: a version above ``LATEST`` that the intent names was never published.

**A version above ``LATEST`` that no intent names is never removed.** That is a ``LATEST``
rolled back (restored from a backup, copied from another folder): the newer versions are real,
so a publish whose step is not above the newest of them is refused with :class:`PublishError`
naming them, and one above them keeps them all.

**A missing or damaged ``LATEST``** (deleted by hand, or a first publish killed between its
version file and its pointer) never costs versions: the newest version file's step then counts
as current, so the next publish must be above it (with a warning), and that publish removes
nothing but temporaries of dead writers. A complete version file a killed *first* publish left
is therefore kept: it holds real weights of that step, readers never saw it, and retention
prunes it like any older version. The intent names its process, so a first publish whose
``LATEST`` write failed (a 500, a full disk) is no such file to the process that wrote it: its
retry of the step (a :class:`BackgroundPublisher`'s) writes it again and completes the publish.

**A ``LATEST`` that is not a file** (a FIFO, a folder) is reported as damaged and never opened
for reading (a FIFO would block the reader forever); the next publish replaces a FIFO, socket
or empty folder there, and refuses a folder holding files.

**One publisher per folder.** Steps must strictly increase: a publish whose step is not
above the step ``LATEST`` names (or, without a readable ``LATEST``, the newest version file's)
is refused with :class:`PublishError`. On a local folder,
publishes serialise on an advisory lock (``.publish.lock``), so two processes cannot
interleave the check and the write; on object stores there is no lock, but ``LATEST`` is
replaced by compare-and-swap on the ETag read before the check (S3 ``If-Match``; see
:func:`commit_version`), so of two publishers racing there exactly one moves ``LATEST`` and
the other gets :class:`PublishError`; ``LATEST`` never goes backwards. A version file is
uploaded only where no object has its name (S3's ``If-None-Match: *``): of two publishers of
the *same* step (a trainer stopped mid-publish on one node, resumed after a restart on another
published that step), the later upload is refused, never replacing the version ``LATEST``
names; and a publisher whose swap of ``LATEST`` failed removes its file only while ``LATEST`` is below its step
(:func:`~weightstore.sync._folder.kept_by_latest`). Two live publishers whose steps both go up are
refused as well: ``LATEST`` names the process that wrote it, and a process that published to
the folder before refuses to publish once another took it over (:mod:`weightstore.sync._writers`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

from weightstore._version import __version__
from weightstore.core._words import checks_words
from weightstore.core.manifest import utc_now
from weightstore.core.names import TORCH, is_state_dict, keys_of_torch_names
from weightstore.errors import PublishError, StoreExistsError, WeightStoreError, naming
from weightstore.formats import delta as delta_format
from weightstore.formats._pointer import (
    LATEST,
    pointer_bytes,
)
from weightstore.io.commit import Commit
from weightstore.io.folders import Folder, LocalFolder, folder_for, same_file
from weightstore.store._save import CheckedWeights, DigestsSince, file_names, write_file
from weightstore.sync import _stages as stages
from weightstore.sync._checks import checked_format, checked_keep, checked_pointer_metadata, checked_step
from weightstore.sync._defaults import DEFAULT_FORMAT, DEFAULT_KEEP
from weightstore.sync._delta import Delta, as_delta, full_weights
from weightstore.sync._folder import INTENT, FolderState, intent_bytes, kept_by_latest, prune, write_small
from weightstore.sync._pinning import Version
from weightstore.sync._writers import published_here, writer

_log = logging.getLogger(__name__)


class PublishOptions(TypedDict):
    """How :func:`publish` writes each version; what a trainer's publisher passes on every time."""

    keep: int | None
    format: str
    storage_options: Mapping[str, Any] | None


@checks_words("ws.publish")
def publish(
    folder: Any,
    weights: Mapping[str, Any],
    *,
    step: int,
    keep: int | None = DEFAULT_KEEP,
    metadata: Mapping[str, Any] | None = None,
    format: str = DEFAULT_FORMAT,  # noqa: A002
    storage_options: Mapping[str, Any] | None = None,
    delta: bool | Delta = False,
) -> Version:
    """Write ``weights`` as version ``step`` of ``folder``, point ``LATEST`` at it, prune.

    Args:
        folder: a local folder (created if missing) or an fsspec URL.
        weights: key -> array, or an open store; a PyTorch ``state_dict`` is published as
            :func:`~weightstore.save` writes one: read by its keys (``features/0/weight``), so
            a follower's ``scope=`` finds its tensors, and named in the file as
            ``load_state_dict`` takes it (``safetensors.torch.load_file``, ``np.load``).
        step: above the step ``LATEST`` names and every version file it does not account for.
        keep: how many versions stay (``None``: all); never fewer than two, so the version a
            reader has just found through ``LATEST`` survives the next publish.
        metadata: JSON-serializable; travels in the file and in ``LATEST``, which readers read
            up to 1 MiB (``SizeLimitError`` refuses more before anything is written).
        format: ``"npz"`` (default), ``"hdf5"`` or ``"safetensors"``.
        storage_options: for URLs, given to fsspec (credentials, ``client_kwargs={"endpoint_url": ...}``),
            except ``"one_writer": True``: where the storage has no compare-and-swap (not S3),
            a promise that no other process publishes to ``folder``, without which the publish
            is refused.
        delta: ``True``, or a :class:`Delta` given to every publish of one trainer: write a delta
            version (``step-….wsdelta``: what changed since the version ``LATEST`` names) when
            it is smaller than a full one and no anchor is due (see :class:`Delta`); readers
            see a version like any other. A :class:`Delta` keeps a copy of the last version
            (1x the model's memory); ``True`` reads the base back from the folder instead.

    Returns:
        The published :class:`Version`.

    Raises:
        PublishError: the step does not go forward (another publisher, or a restored ``LATEST``);
            or the storage has no compare-and-swap for ``LATEST`` (a URL not on S3) and
            ``storage_options`` does not say ``{"one_writer": True}``.
        StorageError: the storage service failed; nothing a reader sees has changed.

    Example:
        >>> ws.publish("runs/a", weights, step=1200, keep=5, metadata={"loss": 0.31})
    """
    return publish_digested(folder, weights, step=step, keep=keep, metadata=metadata, format=format,
                            storage_options=storage_options, delta=delta, digests=True)


def publish_digested(folder: Any, weights: Mapping[str, Any], *, step: int, keep: int | None,
                     metadata: Mapping[str, Any] | None, format: str,  # noqa: A002
                     storage_options: Mapping[str, Any] | None, delta: bool | Delta,
                     digests: bool | DigestsSince) -> Version:
    """:func:`publish`, its full versions' content digests as ``digests`` says (``write_file``'s):
    a :class:`~weightstore.sync.BackgroundPublisher`, and a training hook publishing on the
    training thread, leave them out of versions no digest of which could match. A delta
    publisher's anchors keep them all, as its deltas do."""
    step, keep, planner = checked_step(step), checked_keep(keep), as_delta(delta)
    digests = True if planner is not None else digests
    fmt = checked_format(format)
    target = folder_for(folder, storage_options)
    name = f"step-{step:012d}{fmt.suffixes[0]}"
    stored_names: dict[str, str] = {}  # a state_dict's own names, which load_state_dict takes from the file
    if is_state_dict(weights):
        with naming(path=target.url(name)):
            weights = dict(zip(keys_of_torch_names(list(weights)), weights.values(), strict=True))
            stored_names = file_names(weights, TORCH)
    arrays = CheckedWeights(weights, target.url(name), fmt)
    metadata = checked_pointer_metadata(metadata, step, name, target.url(name))
    target.create()
    written: list[Commit] = []  # the version file's commit, once this publish wrote it
    tensors = planner.stored(arrays) if planner is not None else None
    plan = planner.plan(target, step, tensors) if planner is not None and tensors is not None else None
    if tensors is not None and plan is None:
        arrays = CheckedWeights(full_weights(tensors), target.url(name), fmt)
    if plan is not None:
        name = f"step-{step:012d}{delta_format.SUFFIX}"

    def write_version(created: str) -> None:
        suffix = fmt.suffixes[0] if plan is None else delta_format.SUFFIX
        commit = target.commit(name, suffix, new=True, swept=True)  # by commit_version's clean
        try:
            with commit.writing() as local:
                if plan is None:
                    write_file(local, fmt, arrays, metadata, False, stored_names, created=created, digests=digests)
                else:
                    with open(local, "wb") as handle:
                        delta_format.write(handle, plan.head, plan.rows, plan.digests, plan.encoded, metadata,
                                           f"weightstore {__version__}", created, path=local)
                stages.reached("version-temporary")
        except StoreExistsError:
            raise PublishError(f"step {step} was not published: another writer wrote its own {name} to this folder "
                               "while this process wrote it (a trainer restarted elsewhere took the folder over "
                               "while this one was stopped or slow); that version stays", path=target.where) from None
        written.append(commit)

    def still_written() -> bool:
        return not written or written[-1].still_landed()

    try:
        try:
            version = commit_version(target, step, name, write_version, metadata, keep,
                                     base=None if plan is None else plan.head.base, new=True, own=still_written,
                                     chain={} if plan is None else plan.files, bases=() if plan is None else plan.head.chain)
        except _BaseMoved as moved:  # nothing written yet: the same weights go whole onto the new LATEST
            _log.warning("%s; it is written as a full version instead", moved)
            plan, name = None, f"step-{step:012d}{fmt.suffixes[0]}"
            if tensors is not None:
                arrays = CheckedWeights(full_weights(tensors), target.url(name), fmt)
            version = commit_version(target, step, name, write_version, metadata, keep, new=True, own=still_written)
        if planner is not None and tensors is not None:
            planner.published(target, version, tensors, plan)
        return version
    except PublishError:
        # a race lost on object storage: left above LATEST with no intent naming it, the file
        # would read as a restored LATEST's newer version and refuse this very step's retry
        # (a look or removal that fails, an outage, leaves it as an outage mid-publish does: the lost race is raised)
        with contextlib.suppress(WeightStoreError, OSError):
            if written and not kept_by_latest(target, step, name) and written[-1].still_landed():
                target.remove(name)
        raise


class _BaseMoved(PublishError):
    """A delta's base is no longer the version ``LATEST`` names: another publisher's version was
    committed after the delta was encoded (nothing of this one is written yet)."""


def commit_version(target: Folder, step: int, name: str, write: Callable[[str], str | None],
                   metadata: Mapping[str, Any] | None, keep: int | None, *, base: str | None = None,
                   new: bool = False, own: Callable[[], bool] | None = None,
                   chain: Mapping[str, object] | None = None, bases: Sequence[str] = ()) -> Version:
    """The publish protocol around one version file: check the step, clean what killed publishes
    left, record the intent, ``write(created)`` the file ``name``, replace ``LATEST``, prune.
    ``write`` returns the ``created`` time its file records where that is not the one it was
    given (a sharded commit adopting the identical index a killed one wrote), so that ``LATEST``
    records its file's, which readers check.

    :func:`publish` writes a plain version file; :func:`~weightstore.commit_shards` a
    sharded version's index. On object storage ``LATEST`` is replaced by compare-and-swap on the
    ETag read at the start (``If-Match``; ``If-None-Match: *`` when there was none), so a
    publisher that lost a race gets :class:`PublishError` and ``LATEST`` never goes backwards;
    where the folder's backend has no compare-and-swap, the publish is refused before anything is
    written (:meth:`Folder.require_compare_and_swap`). ``base``, a delta version's, must still be
    the file ``LATEST`` names: a delta is encoded before the folder is locked, and another
    publisher's version committed meanwhile would leave it based off the line retention keeps.
    ``chain``: the files of that base's chain as the delta's plan took them (name ->
    :meth:`~weightstore.io.folders.Folder.fingerprint`), which must be unchanged once the folder
    is read: on an object store that listing is the first look at them (the plan's came from
    memory), so an anchor replaced or removed since it was published costs a full version, not
    deltas that no reader rebuilds. ``bases``: that delta's chain, its base first down to its
    anchor, which retention takes the chain of the oldest version it keeps from (:func:`prune`).
    ``new``: ``write`` uploads only where no object has the name (a plain version), so the file
    of this step that a killed publish left is removed first (a sharded index is compared with
    the one there instead). ``own``: whether the file written is still this publish's, asked
    just before ``LATEST`` is replaced: a publisher paused between its upload and its swap (SIGSTOP,
    a suspended node) may find that a trainer restarted meanwhile took its file for a killed
    publish's and uploaded its own in its place, which ``LATEST`` must not name under this
    publish's record (readers refuse such a record too: :func:`~weightstore.sync._pinning.own_record`).
    """
    target.require_compare_and_swap(f"replacing {LATEST}")
    with target.lock():
        stages.reached("locked")
        state = FolderState.read(target)
        state.check_step(step)
        if base is not None and (state.pointer is None or state.pointer.file_name != base):
            raise _BaseMoved(f"LATEST moved to step {state.pointer.step if state.pointer else 'none'} while step "
                             f"{step} was encoded as a delta of {base} (is another trainer publishing to this "
                             "folder?)", path=target.where)
        changed = [name for name, was in (chain or {}).items() if not same_file(was, target.fingerprint(name))]
        if changed:
            raise _BaseMoved(f"{changed[0]}, which step {step} was encoded as a delta on, was removed, replaced or "
                             "written over since it was published", path=target.url(changed[0]))
        state.clean()
        if new and not isinstance(target, LocalFolder):
            state.remove_unpublished_of(step)
        stages.reached("cleaned")
        write_small(target, INTENT, intent_bytes(step, name), swept=True)
        created = utc_now()
        created = write(created) or created
        pointer = pointer_bytes(step, name, created, metadata or {}, writer())
        stages.reached("version-written")
        if own is not None and not own():
            raise PublishError(f"step {step} was not published: another writer put its own {name} in place of this "
                               "process's while it was paused between its upload and its swap of LATEST (a trainer "
                               "restarted elsewhere took the folder over); that version stays", path=target.where)
        _write_latest(target, state, pointer, step)
        published_here(target, step)
        try:  # published: what follows tidies the folder, and its failure unpublishes nothing
            stages.reached("latest-written")
            if not isinstance(target, LocalFolder):
                state.remove_unpublished(step)  # only now: see FolderState.remove_unpublished
            target.remove(INTENT)
            listed = None  # on object storage, listed anew: the first look at what this publish uploaded
            if isinstance(target, LocalFolder):
                listed = sorted({*state.versions, (step, name)})
            prune(target, step, None if keep is None else max(keep, 2), listed, bases)
            stages.reached("pruned")
        except (WeightStoreError, OSError) as error:
            _log.warning("published step %d to %s; tidying the folder after it failed (%s); the next publish "
                         "tidies it", step, target.where, error)
    return Version(step, target.url(name), created, dict(metadata or {}), target)


def _write_latest(target: Folder, state: FolderState, pointer: bytes, step: int) -> None:
    """Replace ``LATEST``: by rename under the folder's lock locally, by compare-and-swap remotely."""
    if isinstance(target, LocalFolder):
        target.replace_special(LATEST)
        with target.commit(LATEST, swept=True).writing() as local:  # swept by commit_version's clean
            with open(local, "wb") as handle:
                handle.write(pointer)
            stages.reached("latest-temporary")
        return
    stages.reached("latest-temporary")
    if not target.put_if(LATEST, pointer, create=not state.latest_exists, expect=state.latest_tag):
        raise PublishError(f"LATEST changed while step {step} was being published (another publisher committed "
                           "first); this version was not published: publish it again (with a step above the one "
                           "LATEST names now)", path=target.where)
