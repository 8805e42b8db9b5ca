"""Which rank of how many this process is, and which try at a step, from the cluster the job runs.

:func:`~weightstore.publish_shard` and :func:`~weightstore.commit_shards` fill the ``rank``,
``world`` and ``attempt`` they were not given from here, so that a job launched by
``torchrun``, ``jax.distributed`` or a ``TF_CONFIG`` launcher need not repeat what its
launcher already said. The first source that answers wins:

1. ``torch.distributed``, if this process initialized a process group: ``get_rank()`` of
   ``get_world_size()``; the attempt is ``TORCHELASTIC_RESTART_COUNT``, which ``torchrun``
   counts up each time it restarts the group.
2. ``jax.distributed``, if initialized: ``jax.process_index()`` of ``jax.process_count()``.
3. ``TF_CONFIG``: the chief (or, in older launchers, ``master``) is rank 0, then the workers
   in index order, the numbering ``MultiWorkerMirroredStrategy`` gives its workers; other task
   types (``ps``, ``evaluator``) write no member and are refused.

A framework is consulted only if the job already imported it (it is in ``sys.modules``), so
the core never imports one. Only ``torchrun`` counts restarts: elsewhere the attempt must be
passed (``tf2.publish_sharded`` agrees one through TensorFlow's coordination service). A
default of 0 would be unsafe: a job restarted at the same step would write attempt 0 again,
and a commit could pair the live run's members with done-records the dead run left.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightstore.core._jsontext import MAX_DEPTH, too_deep
from weightstore.core._tensortable import short_repr
from weightstore.errors import WeightStoreError

__all__ = ["Membership", "membership", "rank_in_tf_cluster", "is_tf_chief", "tf_config_task"]

#: the TF_CONFIG task types that write members, in rank order
_WRITING_TASKS = ("chief", "master", "worker")
_TF_CONFIG_FORM = 'expected {"cluster": {"chief": [...], "worker": [...]}, "task": {"type": "worker", "index": 0}}'
#: a restart count as torchrun writes it: ASCII digits, few enough for an attempt (below 2**62)
_COUNT = re.compile(r"[0-9]{1,18}")
_PASS_ATTEMPT = ("pass attempt= (one higher each time the job retries a step, so a dead try's members never mix "
                 "with a live one's)")


@dataclass(frozen=True)
class Membership:
    """This process's place in its job: ``rank`` of ``world``, the ``attempt`` if the cluster
    counts restarts (else ``None``), and ``source``, which names where it came from."""

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
        raise WeightStoreError(f"attempt was not given and no torchrun counts restarts; {_PASS_ATTEMPT}") from None
    attempt = found.attempt if attempt is None else attempt
    if attempt is None:
        raise WeightStoreError(f"attempt was not given and {found.source} does not count restarts; {_PASS_ATTEMPT}")
    return found.rank if rank is None else rank, found.world if world is None else world, attempt


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
            raise ValueError(f"it nests objects and arrays more than {MAX_DEPTH} levels deep")
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
                               f"{MAX_DEPTH} levels deep); {_TF_CONFIG_FORM}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise WeightStoreError(f"TF_CONFIG is not a cluster and task ({type(exc).__name__}: {exc}); "
                               f"{_TF_CONFIG_FORM}") from None
    if not isinstance(cluster, Mapping) or not all(isinstance(tasks, list) for tasks in cluster.values()):
        raise WeightStoreError("TF_CONFIG's cluster is not a mapping of task type to a list of addresses")
    return cluster, task_type, task_index


def _torch() -> Membership | None:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if count is not None and not _COUNT.fullmatch(count):  # int() takes "-1", " 2", "1_0" and "٣"
        raise WeightStoreError(f"TORCHELASTIC_RESTART_COUNT is {count[:40]!r}, not a count of restarts (0, 1, 2...)")
    attempt = None if count is None else int(count)
    return Membership(dist.get_rank(), dist.get_world_size(), attempt, "torch.distributed")


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
