"""One weight file, read and written: ``ws.open``, ``ws.load`` and ``ws.save``.

:mod:`~weightstore.store._open` opens any file or folder weightstore reads (through the format
registry, locally or remotely) as one :class:`Store` with one key view (scope, mapping,
renames); :mod:`~weightstore.store._save` writes a dictionary in the format its suffix names.
"""

from weightstore import _lazy
from weightstore.store._open import Store, load, open  # noqa: A004
from weightstore.store._save import save

__all__ = ["Store", "load", "open", "save"]

#: each submodule imported on first use, as when ``import weightstore`` imported every layer
#: (``weightstore.io.objects.PART_BYTES``): :mod:`weightstore._lazy`
__getattr__, __dir__ = _lazy.on_first_use(globals(), {})
