"""The optional extras (``weightstore[tf]``, ``[torch]``, ``[flax]``, ``[s3]``) and the error naming one.

The core (stores, versions, the ``ws`` command on stores and TF checkpoints) needs none of
them; an adapter or an ``s3://`` URL needs its framework or file system. A missing one is a
:class:`~weightstore.errors.MissingDependencyError` (an ``ImportError`` too) that says which
extra to install, rather than a bare ``ModuleNotFoundError`` from deep inside an import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from weightstore.errors import MissingDependencyError

__all__ = ["install_hint", "needs"]


def install_hint(extra: str) -> str:
    """How to install ``extra``: from the clone weightstore was installed from (it is not on PyPI)."""
    return f'in your weightstore clone, pip install ".[{extra}]" (-e ".[{extra}]" for an editable install)'


@contextlib.contextmanager
def needs(extra: str, what: str) -> Iterator[None]:
    """Imports inside refused with :class:`MissingDependencyError` when a module is not installed.

    ``what`` is what needs the extra (``"weightstore.adapters.torch"``). A module of weightstore
    itself that fails to import is a bug, not a missing extra, and passes through unchanged.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] == "weightstore":
            raise
        raise MissingDependencyError(f"{what} needs {exc.name}, which is not installed: {install_hint(extra)}") from exc
