"""Pausing Python's cyclic garbage collector while an index is built or a model assigned.

Parsing the manifest of 50,000 tensors allocates some 300,000 containers (dicts, lists,
tuples), none of them garbage. Each 700 allocations start a collection, and every few of those
walk older objects too, which in a process that has imported TensorFlow means millions of them:
a third of an open's time goes to collections that free nothing; an assign of 20,000
variables lost a third of its time the same way. Reference counting still frees everything
at once; the collector runs again as soon as the block ends.
"""

from __future__ import annotations

import contextlib
import gc


class paused_gc(contextlib.AbstractContextManager):  # noqa: N801 - used as the function it was
    """No cyclic collection inside the block; a collector the caller already disabled stays so.
    A plain class: a generator's context costs four times as much, and every open enters one."""

    __slots__ = ("_paused",)

    def __enter__(self) -> None:
        self._paused = gc.isenabled()
        if self._paused:
            gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._paused:
            gc.enable()
