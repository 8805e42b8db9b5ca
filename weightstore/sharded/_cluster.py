"""Which rank of how many this process is, and which try at a step, from the cluster the job runs.

:func:`~weightstore.publish_shard` and :func:`~weightstore.commit_shards` fill the ``rank``,
``world`` and ``attempt`` they were not given from here, so that a job launched by
``torchrun``, ``jax.distributed`` or a ``TF_CONFIG`` launcher need not repeat what its
launcher already said. The first source that answers wins:

1. ``torch.distributed``, if this process initialized a process group: ``get_rank()`` of
   ``get_world_size()``.
2. ``jax.distributed``, if initialized: ``jax.process_index()`` of ``jax.process_count()``.
3. ``TF_CONFIG``: the chief (or, in older launchers, ``master``) is rank 0, then the workers
   in index order, the numbering ``MultiWorkerMirroredStrategy`` gives its workers; other task
   types (``ps``, ``evaluator``) write no member and are refused.

A framework is consulted only if the job already imported it (it is in ``sys.modules``), so
the core never imports one.

The attempt and the job's incarnation are never read from a node's environment: ``torchrun``
counts restarts per node (``TORCHELASTIC_RESTART_COUNT``), so after one node restarts its
workers the ranks would disagree. They are *agreed* through the job's own key-value store,
which :func:`channel` opens: ``torch.distributed``'s c10d store (the one its process group
rendezvoused through) or ``jax.distributed``'s coordination service
(:mod:`weightstore.sharded._agree`; ``tf2.publish_sharded`` uses TensorFlow's).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightstore.core._jsontext import too_deep
from weightstore.core.limits import MAX_JSON_DEPTH
from weightstore.errors import WeightStoreError, short_repr

__all__ = ["Membership", "membership", "rank_in_tf_cluster", "is_tf_chief", "tf_config_task", "Channel",
           "channel"]

#: the TF_CONFIG task types that write members, in rank order
_WRITING_TASKS = ("chief", "master", "worker")
_TF_CONFIG_FORM = 'expected {"cluster": {"chief": [...], "worker": [...]}, "task": {"type": "worker", "index": 0}}'
_PASS_ATTEMPT = ("pass attempt= (one higher each time the job retries a step, so a dead try's members never mix "
                 "with a live one's)")


@dataclass(frozen=True)
class Membership:
    """This process's place in its job: ``rank`` of ``world``, and ``source``, which names where
    it came from. ``attempt`` is always ``None``: no cluster says it alike on every rank (it is
    agreed through :func:`channel` instead); the field stays for callers that read it."""

    rank: int
    world: int
    attempt: int | None
    source: str


def membership() -> Membership:
    """This process's place, from the first source above that answers.

    Raises:
        WeightStoreError: no source answers, or one is malformed (a ``TF_CONFIG`` that is not
            JSON, a task type that writes no member); the message says what to pass instead.
    """
    for source in (_torch, _jax, _tf_config):
        found = source()
        if found is not None:
            return found
    raise WeightStoreError("rank and world were not given and nothing says them: no initialized torch.distributed "
                           "process group, no initialized jax.distributed, no TF_CONFIG; pass rank=, world= and "
                           "attempt=")


def filled(*, rank: int | None, world: int | None, attempt: int | None) -> tuple[int, int, int]:
    """``rank``, ``world`` and ``attempt``, each one not given taken from :func:`membership`
    (a coordinator, which has no rank, passes ``rank=0``)."""
    if rank is not None and world is not None and attempt is not None:
        return rank, world, attempt
    try:
        found = membership()
    except WeightStoreError:
        if rank is None or world is None:
            raise
        # rank and world were given: what is missing is the attempt, which no cluster gave
        raise WeightStoreError(f"attempt was not given and no job store agrees one; {_PASS_ATTEMPT}") from None
    if attempt is None:
        raise WeightStoreError(f"attempt was not given and {found.source} has no store to agree one through; "
                               f"{_PASS_ATTEMPT}")
    return found.rank if rank is None else rank, found.world if world is None else world, attempt


def place(*, rank: int | None, world: int | None) -> tuple[int, int]:
    """``rank`` and ``world``, each one not given taken from :func:`membership`."""
    if rank is not None and world is not None:
        return rank, world
    found = membership()
    return found.rank if rank is None else rank, found.world if world is None else world


def rank_in_tf_cluster(cluster: Mapping[str, Any], task_type: str, task_index: int) -> tuple[int, int]:
    """``(rank, world)`` of task ``task_type``/``task_index`` in a TF cluster spec (job name ->
    addresses): the chief first, then the workers in index order.

    Raises:
        WeightStoreError: the task is not a chief or a worker, or not in the cluster.
    """
    counts = {job: len(cluster.get(job) or ()) for job in _WRITING_TASKS}
    if task_type not in _WRITING_TASKS:
        raise WeightStoreError(f"task {task_type!r} {task_index} writes no member of a sharded version: only the "
                               f"chief and the workers do (ranks: chief, then workers by index)")
    if not 0 <= task_index < counts[task_type]:
        raise WeightStoreError(f"task {task_type!r} {task_index} is not in the cluster, which has "
                               f"{counts[task_type]} {task_type!r} task(s)")
    before = sum(counts[job] for job in _WRITING_TASKS[:_WRITING_TASKS.index(task_type)])
    return before + task_index, sum(counts.values())


def is_tf_chief(cluster: Mapping[str, Any], task_type: str, task_index: int) -> bool:
    """Whether a TF task is the one that publishes for its whole job: rank 0 of
    :func:`rank_in_tf_cluster` (the chief, else the master, else worker 0); a parameter server
    or an evaluator never is."""
    first = next((job for job in _WRITING_TASKS if job == task_type or cluster.get(job)), None)
    return task_type == first and task_index == 0  # never raises: a hook asks it of any TF_CONFIG


def tf_config_task() -> tuple[Mapping[str, Any], str, int] | None:
    """``TF_CONFIG``'s cluster, this task's type and index; ``None`` where it is unset or names
    no task (a single process).

    Raises:
        WeightStoreError: ``TF_CONFIG`` is set but is no cluster and task.
    """
    text = os.environ.get("TF_CONFIG")
    try:
        config = json.loads(text) if text else {}
        if too_deep(config):  # parsed, yet repr() or str() of it would raise RecursionError
            raise ValueError(f"it nests objects and arrays more than {MAX_JSON_DEPTH} levels deep")
        task = config.get("task") or {}
        if not task.get("type"):
            return None
        cluster, task_type, task_index = config.get("cluster") or {}, task["type"], task.get("index", 0)
        if not isinstance(task_type, str):
            raise TypeError(f"task type {short_repr(task_type)} is no string")
        if isinstance(task_index, str) and task_index.isascii() and task_index.isdigit():
            task_index = int(task_index)  # as TF's own resolver takes it
        if isinstance(task_index, bool) or not isinstance(task_index, int):
            raise TypeError(f"task index {short_repr(task_index)} is no int")
    except RecursionError:  # the stdlib parser's own limit, below orjson's: JSON nested some 1,000 deep
        raise WeightStoreError(f"TF_CONFIG is not a cluster and task (it nests objects and arrays more than "
                               f"{MAX_JSON_DEPTH} levels deep); {_TF_CONFIG_FORM}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise WeightStoreError(f"TF_CONFIG is not a cluster and task ({type(exc).__name__}: {exc}); "
                               f"{_TF_CONFIG_FORM}") from None
    if not isinstance(cluster, Mapping) or not all(isinstance(tasks, list) for tasks in cluster.values()):
        raise WeightStoreError("TF_CONFIG's cluster is not a mapping of task type to a list of addresses")
    return cluster, task_type, task_index


def _torch() -> Membership | None:
    dist = _torch_distributed()
    if dist is None:
        return None
    return Membership(dist.get_rank(), dist.get_world_size(), None, "torch.distributed")


def _torch_distributed() -> Any:
    """``torch.distributed`` if the job imported it and initialized a process group, else None."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _jax_client() -> Any:
    """``jax.distributed``'s client if the job imported jax and initialized it, else None."""
    state = sys.modules.get("jax._src.distributed")
    return None if state is None else state.global_state.client


def _jax() -> Membership | None:
    jax = sys.modules.get("jax")
    if jax is None or not jax.distributed.is_initialized():
        return None
    return Membership(jax.process_index(), jax.process_count(), None, "jax.distributed")


def _tf_config() -> Membership | None:
    found = tf_config_task()
    if found is None:
        if os.environ.get("TF_CONFIG"):  # set, so meant to place this process, yet no task in it
            raise WeightStoreError(f"TF_CONFIG is not a cluster and task (it names no task); {_TF_CONFIG_FORM}")
        return None
    rank, world = rank_in_tf_cluster(*found)
    return Membership(rank, world, None, "TF_CONFIG")


class Channel:
    """A job's own key-value store, which every rank of the job reaches: the keys the sharded
    protocol meets at (:mod:`weightstore.sharded._agree`). ``owner`` is the object whose life is
    the store's (a process group, a client): a new one is a new launch."""

    source: str = ""
    owner: Any = None

    def set(self, key: str, value: str) -> None:
        """Set ``key`` to ``value``, replacing what is there."""
        raise NotImplementedError

    def offer(self, key: str, value: str) -> None:
        """Set ``key`` to ``value`` unless it is set: the first offer stands."""
        raise NotImplementedError

    def peek(self, key: str) -> str | None:
        """``key``'s value now, or ``None``; never waits."""
        raise NotImplementedError

    def get(self, key: str, timeout: float) -> str | None:
        """``key``'s value once it is set, or ``None`` after ``timeout`` seconds."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Remove ``key`` where it is set (what no rank will read again: the store stays as small
        as one step's keys however many steps a job publishes)."""
        raise NotImplementedError

    def lost(self, exc: BaseException) -> WeightStoreError:
        return WeightStoreError(f"lost the job's store ({self.source}): {type(exc).__name__}: {exc}")


class _TorchChannel(Channel):
    """The c10d store ``init_process_group`` rendezvoused through (a ``TCPStore`` under
    ``torchrun``, behind the process group's ``PrefixStore``)."""

    source = "torch.distributed's c10d store"

    def __init__(self, dist: Any) -> None:
        c10d = dist.distributed_c10d
        self.owner = c10d._get_default_group()
        self.store = c10d._get_default_store()
        self.timeout_error = dist.DistStoreError

    def set(self, key: str, value: str) -> None:
        try:
            self.store.set(key, value)
        except RuntimeError as exc:
            raise self.lost(exc) from None

    def offer(self, key: str, value: str) -> None:
        try:
            self.store.compare_set(key, "", value)  # sets it only where it is absent
        except RuntimeError as exc:
            raise self.lost(exc) from None

    def peek(self, key: str) -> str | None:
        try:
            return bytes(self.store.get(key)).decode() if self.store.check([key]) else None
        except RuntimeError as exc:
            raise self.lost(exc) from None

    def get(self, key: str, timeout: float) -> str | None:
        try:
            self.store.wait([key], datetime.timedelta(seconds=max(timeout, 0.001)))
            return bytes(self.store.get(key)).decode()
        except self.timeout_error as exc:
            if "timeout" in str(exc).lower():
                return None
            raise self.lost(exc) from None
        except RuntimeError as exc:
            raise self.lost(exc) from None

    def delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)  # False where it was not set
        except RuntimeError as exc:
            raise self.lost(exc) from None


class _JaxChannel(Channel):
    """``jax.distributed``'s coordination service (its key-value store), which process 0 runs."""

    source = "jax.distributed's key-value store"

    def __init__(self, client: Any) -> None:
        self.owner = self.client = client

    def set(self, key: str, value: str) -> None:
        try:
            self.client.key_value_set(key, value, allow_overwrite=True)
        except RuntimeError as exc:
            raise self.lost(exc) from None

    def offer(self, key: str, value: str) -> None:
        try:
            self.client.key_value_set(key, value)
        except RuntimeError as exc:
            if "ALREADY_EXISTS" not in str(exc):
                raise self.lost(exc) from None

    def peek(self, key: str) -> str | None:
        try:
            return str(self.client.key_value_try_get(key))
        except RuntimeError as exc:
            if "NOT_FOUND" in str(exc):
                return None
            raise self.lost(exc) from None

    def get(self, key: str, timeout: float) -> str | None:
        try:
            return str(self.client.blocking_key_value_get(key, max(1, int(timeout * 1000))))
        except RuntimeError as exc:
            if "DEADLINE_EXCEEDED" in str(exc):
                return None
            raise self.lost(exc) from None

    def delete(self, key: str) -> None:
        try:
            self.client.key_value_delete(key)  # nothing where it is not set
        except RuntimeError as exc:
            raise self.lost(exc) from None


def channel() -> Channel | None:
    """The job's own key-value store, from the first source of :func:`membership` that has one
    (``torch.distributed``'s c10d store, ``jax.distributed``'s coordination service); ``None``
    where the job runs neither (``TF_CONFIG`` alone: ``tf2.publish_sharded`` agrees through
    TensorFlow's coordination service itself)."""
    dist = _torch_distributed()
    if dist is not None:
        return _TorchChannel(dist)
    client = _jax_client()
    if client is not None:
        return _JaxChannel(client)
    return None
