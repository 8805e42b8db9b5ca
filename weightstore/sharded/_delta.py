"""Sharded delta versions: each rank writes its member as a delta of its own member of the version before.

:func:`~weightstore.sharded.publish_shard` with ``delta=`` asks :func:`plan_member` for a plan
before it writes; the encoding is a single writer's (:mod:`weightstore.sync._delta`), of the
rank's stored tensors (pieces, column strips) against those of its member in the version
``LATEST`` names, so no rank sends a byte to another. The member is written as a delta
(``rank-00003.wsdelta``, :func:`weightstore.formats.delta.open_member`) naming that member as
its base, unless a full version is due. Every rank decides that alike, from what they all read,
never from one rank's sizes:

- ``LATEST`` names no sharded version (nothing, a plain version, an index that does not read),
  or one written by another number of ranks (the layout changed);
- that version is ``anchor_every - 1`` deltas from its anchor (its index's chain);
- its chain's member bytes, with one more version of their average, add up to its tensors'.

A rank then writes its member full where its pieces are not those its base member held (its
partition changed), or where its delta, or its member's own chain with it, is no smaller than
its pieces. The commit (:func:`index_delta`) records in the index the versions the members
build on (what retention keeps) and the chain's bytes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from weightstore.core.limits import MAX_DELTA_CHAIN
from weightstore.core.manifest import to_storage
from weightstore.errors import FormatError, PublishError, WeightStoreError
from weightstore.formats import delta as delta_format
from weightstore.formats import format_for_suffix
from weightstore.formats._sharded_index import (
    DELTA_MEMBER_SUFFIX,
    SHARD_METADATA,
    DoneRecord,
    IndexDelta,
    ShardIndex,
    index_name,
)
from weightstore.io.folders import Folder, unchanged
from weightstore.sync._delta import Delta, Plan, Stored, _Held, plan_against
from weightstore.sync._folder import SHARDED_SUFFIX, read_index

_log = logging.getLogger("weightstore")


def base_version(delta: Delta, target: Folder, step: int, world: int) -> ShardIndex | None:
    """The version this step's members may be deltas of (what every rank reads alike), or
    ``None`` when the version must be written full (see the module)."""
    pointer = delta._base_pointer(target, step)
    if pointer is None:
        return None
    name = pointer.path.rsplit("/", 1)[-1]
    if not name.endswith(SHARDED_SUFFIX):
        return None
    try:
        index = read_index(target, name)
    except (WeightStoreError, FileNotFoundError):
        return None
    if index.world != world or index.version == 1 or index.step != pointer.step:
        return None
    if index.delta is not None:
        depth = len(index.delta.chain)
        if depth + 1 >= delta.anchor_every or depth + 1 > MAX_DELTA_CHAIN or \
                index.delta.chain_bytes + index.delta.chain_bytes // depth >= index.delta.full_bytes:
            return None
    return index


def plan_member(delta: Delta, target: Folder, base: ShardIndex, rank: int, step: int, tensors: dict[str, Stored],
                layout: dict[str, Any]) -> Plan | None:
    """This rank's member as a delta of its member in ``base``, or ``None`` to write it full:
    its pieces are not those that member held (``layout``: what the member's metadata says of
    them; and each stored tensor's dtype and shape), or the delta does not pay. A base member
    that cannot be read back is logged and costs a full member."""
    file = base.members[rank].file
    held = delta._held
    shapes = {name: (item.dtype, item.shape) for name, item in tensors.items()}
    try:
        if held is not None and (held.where, held.step, held.name) == (target.where, base.step, file):
            if held.layout != layout or shapes != {name: (item.dtype, item.shape) for name, item in held.tensors.items()}:
                return None
            head = held.head
            if head is None and file.endswith(DELTA_MEMBER_SUFFIX):
                return None  # remembered as full, named as a delta: not this rank's member
            chain, chain_bytes = _chain(file, head)
            if chain is None:
                return None
            files = {name: target.fingerprint(name) for name in chain}
            if unchanged(held.files, files):  # else a file of its chain changed since it was written: read back
                plan = delta._from_memory(held, step, file, chain, chain_bytes, tensors)
                if plan is not None:
                    plan.files = files
                return plan
        with _open_member(target, file) as reader:
            infos = [reader.info(name) for name in reader.keys()]  # noqa: SIM118 - a Reader, not a dict
            if _layout_of(reader) != layout or shapes != {info.key: (info.dtype, tuple(info.shape)) for info in infos}:
                return None
            head = reader.head if isinstance(reader, delta_format.DeltaReader) else None
            chain, chain_bytes = _chain(file, head)
            if chain is None:
                return None

            def read_back(key: str, item: Stored) -> np.ndarray | None:
                if isinstance(reader, delta_format.DeltaReader):
                    return reader.stored_bytes(key)
                array = np.ascontiguousarray(to_storage(reader.read(key, verify=True), key)[1])
                return array.reshape(-1).view(np.uint8) if array.size else np.empty(0, np.uint8)

            files = {name: target.fingerprint(name) for name in chain}
            plan = plan_against(step, file, chain, chain_bytes, tensors, read_back)
            if plan is not None:
                plan.files = files
            return plan
    except (WeightStoreError, FileNotFoundError) as exc:
        _log.warning("weightstore: publishing rank %d of step %d to %s: its base member %s cannot be read back (%s); "
                     "writing its member full", rank, step, target.where, file, exc)
        return None


def _chain(file: str, head: delta_format.Head | None) -> tuple[list[str] | None, int]:
    """The chain of a member whose base is ``file`` (a delta with ``head``, or full), and the
    bytes of its deltas so far; ``None`` when it would be too deep."""
    chain = [file] if head is None else [file, *head.chain]
    return (chain if len(chain) <= MAX_DELTA_CHAIN else None), 0 if head is None else head.chain_bytes


@contextlib.contextmanager
def _open_member(target: Folder, file: str) -> Iterator[Any]:
    """The member ``file`` of ``target`` open as a store of its stored names (a delta member with its chain)."""
    location, name = target.open_binary(file), target.url(file)
    fmt = format_for_suffix(file)
    if file.endswith(DELTA_MEMBER_SUFFIX):
        reader: Any = delta_format.open_member(location, name, mmap=False)
    elif fmt is not None:
        reader = fmt.open_reader(location, name, mmap=False)
    else:
        raise FormatError("is not a member of a format weightstore reads", path=name)
    try:
        yield reader
    finally:
        reader.close()


def _layout_of(reader: Any) -> Any:
    record = reader.metadata.get(SHARD_METADATA)
    return record.get("pieces") if isinstance(record, dict) else None


def remember(delta: Delta, target: Folder, step: int, file: str, tensors: dict[str, Stored], plan: Plan | None,
             layout: dict[str, Any]) -> None:
    """After writing this rank's member ``file`` of ``step``: remember it as the next delta's base."""
    files = {**({} if plan is None else plan.files), file: target.fingerprint(file)}
    delta._remember(_Held(target.where, step, file, "", tensors, None if plan is None else plan.head, layout,
                          files=files), plan)


def index_delta(target: Folder, records: list[DoneRecord], full_bytes: int) -> IndexDelta | None:
    """What the index records of the versions its delta members build on (``None``: no member
    is a delta). Each base's index is read for its own chain; one that is gone (pruned while the
    ranks wrote) fails the commit, as a reader could not rebuild those members."""
    bases = sorted({record.base for record in records if record.base is not None}, reverse=True)
    if not bases:
        return None
    chain: set[str] = set()
    before = 0
    for step in bases:
        name = index_name(step)
        try:
            index = read_index(target, name)
        except (WeightStoreError, FileNotFoundError) as exc:
            raise PublishError(f"members are deltas of step {step}, whose index cannot be read ({exc}); nothing was "
                               "published (publish this step again)", path=target.url(name)) from None
        chain.add(name)
        if index.delta is not None:
            chain.update(index.delta.chain)
            before = max(before, index.delta.chain_bytes)
    ordered = tuple(sorted(chain, reverse=True))
    if len(ordered) > MAX_DELTA_CHAIN:
        raise PublishError(f"its members build on {len(ordered)} versions, over {MAX_DELTA_CHAIN}; publish it full",
                           path=target.where)
    return IndexDelta(ordered, before + sum(record.member.size for record in records), full_bytes)
