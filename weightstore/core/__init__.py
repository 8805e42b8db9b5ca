"""The vocabulary every layer above speaks, with no I/O and no framework.

* :mod:`~weightstore.core.keys`: keys (validation, scopes, selection, mapping);
* :mod:`~weightstore.core.names`: PyTorch and Hugging Face spellings of keys;
* :mod:`~weightstore.core.manifest`: the manifest a store carries, and :class:`TensorInfo`;
* :mod:`~weightstore.core.checksums`: CRC-32C checksums and content digests;
* :mod:`~weightstore.core.limits`: every size, count and depth bound readers and writers enforce;
* private helpers: array conversion, optional imports, JSON text, unknown keyword arguments
  refused by name, the tensor table, thread pools, finishing background publishes at exit,
  pausing the garbage collector, giving freed heap back.
"""

from weightstore import _lazy

#: each submodule imported on first use, as when ``import weightstore`` imported every layer
#: (``weightstore.io.objects.PART_BYTES``): :mod:`weightstore._lazy`
__getattr__, __dir__ = _lazy.on_first_use(globals(), {})
