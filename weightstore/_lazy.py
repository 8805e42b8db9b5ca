"""A package's public names imported from their modules on first use (PEP 562).

Every ``ws`` command, follower and rank starts a Python process that imports weightstore; a
package whose ``__init__`` imported every public name made each of them pay for the modules of
all (numpy, the formats, sync, sharded), whichever it used. A package built with
:func:`on_first_use` imports a name's module when the name is first looked up
(``ws.publish``, ``from weightstore import publish``) and keeps it, so the next look-up is a
plain one; ``dir()`` lists the names as before, and the objects are the modules' own (pickling
names those modules). The package names them again under ``if TYPE_CHECKING:`` for type
checkers and for ``docs/gen_api.py``. A layer's submodules are reached the same way
(``weightstore.io.objects.PART_BYTES`` after a plain ``import weightstore``, as when the package
imported every layer), whichever modules an earlier call happened to import.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def on_first_use(namespace: dict[str, Any], names: Mapping[str, str], modules: Iterable[str] | None = None,
                 otherwise: Callable[[str], Any] | None = None) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose globals are ``namespace``: each of
    ``names`` (public name -> the module it is imported from) and each submodule of ``modules``
    (``None``: every one the package holds, listed at the first look-up that needs them)
    imported on first use; any other name is ``otherwise``'s to answer, or an AttributeError."""
    package = namespace["__name__"]

    @functools.cache
    def submodules() -> frozenset[str]:
        if modules is not None:
            return frozenset(modules)
        return frozenset(found.name for found in pkgutil.iter_modules(namespace["__path__"]))

    def __getattr__(name: str) -> Any:
        if name in names:
            value = getattr(importlib.import_module(names[name]), name)
            namespace[name] = value
            return value
        if not name.startswith("__") and name in submodules():  # not hasattr(module, "__wrapped__") and the like
            return importlib.import_module(f"{package}.{name}")
        if otherwise is not None:
            return otherwise(name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *names, *submodules()})

    return __getattr__, __dir__
