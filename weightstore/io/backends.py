"""The one table of storage backends: which module reads and conditionally writes a file system's files.

Each entry names a module that defines ``BACKEND`` (a :class:`~weightstore.io.objects.Backend`),
imported when a URL is first met (so ``import weightstore`` does not load s3fs's machinery). The
first backend that :meth:`~weightstore.io.objects.Backend.serves` a file system reads its files
(:class:`~weightstore.io.remote.RemoteFile`, :class:`~weightstore.io._ranges.RangedFile`) and
writes its versioned folders' pointers (:class:`~weightstore.io.folders.RemoteFolder`): nothing
else asks which service a URL is on. A backend of the package is added here; one from elsewhere
(a plugin, a test) with :func:`register`.
"""

from __future__ import annotations

import importlib
from typing import Any

from weightstore.io.objects import Backend

__all__ = ["BACKEND_MODULES", "backend_for", "register"]

#: the backends, in the order they are asked; the generic fsspec one serves every file system,
#: so it stays last
BACKEND_MODULES: list[str] = ["weightstore.io.s3", "weightstore.io.fsspec_objects"]


def register(module: str) -> None:
    """Add the backend that module ``module`` defines as ``BACKEND`` to :data:`BACKEND_MODULES`,
    after those already there and before the generic fsspec one (which would serve first)."""
    if module not in BACKEND_MODULES:
        BACKEND_MODULES.insert(len(BACKEND_MODULES) - 1, module)


def backend_for(fs: Any) -> Backend:
    """The first backend in :data:`BACKEND_MODULES` that serves fsspec file system ``fs``."""
    for module in BACKEND_MODULES:
        backend: Backend = importlib.import_module(module).BACKEND
        if backend.serves(fs):
            return backend
    raise LookupError(f"no backend serves {type(fs).__name__}: the generic fsspec one must stay last in the table")
