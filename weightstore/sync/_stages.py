"""Named points of a publish, where crash tests stop or kill the publisher.

A publish (and a sharded commit) calls :func:`reached` at each stage of its protocol: "locked",
"version-written", "latest-written"… It does nothing unless a test sets :data:`hook`, which then
sees each stage by name, and may hold the publisher there or kill its process, to prove that
every stage leaves the folder whole. One module for it, so that one assignment reaches every
caller.
"""

from __future__ import annotations

from collections.abc import Callable

#: called with each stage's name when set; ``None`` in normal use
hook: Callable[[str], object] | None = None


def reached(name: str) -> None:
    """Mark that a publish reached stage ``name``."""
    if hook is not None:
        hook(name)
