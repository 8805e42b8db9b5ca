"""The one assign every adapter runs: plan, skip unchanged, read, write, remember.

Frameworks differ in how they list their variables and how they write arrays into them, and
in nothing else; so an adapter describes itself as a :class:`Target` and calls
:func:`run_assign`, the way safetensors' framework modules convert tensors and call one
implementation. What ``strict``, ``scope``, hot reload and the report mean is decided here
and in :mod:`weightstore.adapters.plan`, once for every framework.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from weightstore.adapters.plan import (
    MEMORY,
    AssignOptions,
    Plan,
    Report,
    TargetInfo,
    open_values,
    plan_assign,
    wants_skip,
)

__all__ = ["Target", "ValueSource", "run_assign"]


class ValueSource(Protocol):
    """What a plan reads values through: :class:`~weightstore.adapters.plan.Values` or a view of it."""

    where: str

    def checksum(self, key: str) -> str | None: ...
    def read(self, key: str) -> np.ndarray: ...


@dataclass
class Target:
    """What one framework supplies to an assign.

    ``infos``: every variable it can write, by key. ``write``: writes a batch of ``(key, array)``
    (arrays as :attr:`prepare` made them) and returns the keys it wrote; it is called once, after
    every value was read and checked, so raising in it still changes nothing, and it may add
    to the report what it refused to write (``strict=False``). ``owner``: the
    object whose hot-reload memory a key belongs to (a TF1 session, a variable, a tensor).
    ``prepare`` reads one value for a target, by default read and cast to the target's dtype.
    ``plan`` pairs values with targets, by default :func:`plan_assign`; an adapter with a
    layout plans over converted values and returns the view to read them through.
    """

    infos: Mapping[str, TargetInfo]
    write: Callable[[list[tuple[str, Any]], Report], list[str]]
    owner: Callable[[str], object]
    prepare: Callable[[ValueSource, str, str], Any] | None = None
    plan: Callable[[Any, AssignOptions], tuple[Plan, ValueSource]] | None = None


def run_assign(target: Target, weights: Any, options: AssignOptions, *, skip_for: Any = None) -> Report:
    """Assign ``weights`` (a dict, path, Store or Version) into ``target`` under ``options``.

    ``skip_for`` is what decides the default of ``skip_unchanged`` when ``weights`` is a view
    made from it (a Keras file paired by structure from the Version the user passed).
    """
    skip = wants_skip(weights if skip_for is None else skip_for, options.skip_unchanged)
    prepare = target.prepare or _read_as_target(target.infos)
    with open_values(weights) as values:
        plan, source = (target.plan or _plain_plan(target.infos))(values, options)
        report = plan.report
        batch: list[tuple[str, Any]] = []
        digests: dict[str, str | None] = {}
        for key, value_key in plan.pairs.items():
            digest = source.checksum(value_key)
            if skip and MEMORY.unchanged(target.owner(key), key, digest):
                report.skipped.append(key)
                continue
            batch.append((key, prepare(source, key, value_key)))
            digests[key] = digest
        written = target.write(batch, report) if batch else []
    for key in written:
        MEMORY.remember(target.owner(key), key, digests[key])
        report.assigned.append(key)
    return report


def _plain_plan(infos: Mapping[str, TargetInfo]) -> Callable[[Any, AssignOptions], tuple[Plan, ValueSource]]:
    return lambda values, options: (plan_assign(values, infos, options), values)


def _read_as_target(infos: Mapping[str, TargetInfo]) -> Callable[[ValueSource, str, str], np.ndarray]:
    return lambda source, key, value_key: np.asarray(source.read(value_key), dtype=infos[key].dtype)
