"""The I/O layer: every byte weightstore reads or writes crosses the boundary here.

Formats (:mod:`weightstore.formats`) parse and build containers; they never name a temporary
for a write, call ``fsync`` or talk to a storage service themselves, and a local file they
open goes through :func:`~weightstore.io.files.open_regular` (or its unbuffered twin
:func:`~weightstore.io.files.open_regular_unbuffered`). The readers that hand a file to a
library of its own (h5py for HDF5 and a ``.keras`` archive's weights, unpacked to a scratch
folder; a TF checkpoint's bundle files) open it by path; the rest read their bytes through
:mod:`~weightstore.io.source`. What they need is here, one responsibility a module:

* :mod:`~weightstore.io.location`: a path or URL, decided once (:func:`location_of`); the
  fsspec file system behind a URL; the one mapping of storage-service failures to
  :class:`~weightstore.errors.StorageError`.
* :mod:`~weightstore.io.files`: local files: the one regular-file check every reader and
  writer uses (a FIFO would block forever), fsync, temporaries and the sweep of those a killed
  writer left.
* :mod:`~weightstore.io.commit`: how a write becomes visible, as named types with their crash
  argument (rename, upload, index last; pointer last is composed of them in versions).
* :mod:`~weightstore.io._buffer`: the one allocator of aligned memory for bytes read.
* :mod:`~weightstore.io._local`: local byte sources (mapped, ``pread`` into owned memory, a
  stream), their readahead, and the size guard before each read of a mapped file.
* :mod:`~weightstore.io._writeback`: a file being written starts reaching the disk as it is
  written, so a durable save's fsync waits only for the last stretch.
* :mod:`~weightstore.io.backends`: the one table of storage backends, one module per service
  doing its ranged reads *and* its conditional writes (:mod:`~weightstore.io.s3`; the generic
  :mod:`~weightstore.io.fsspec_objects`, which has no compare-and-swap and says so); what a
  backend provides is :mod:`~weightstore.io.objects`, and a new one is one module added to
  that table.
* :mod:`~weightstore.io.remote`: a file on object storage read by ranged requests through its
  backend.
* :mod:`~weightstore.io.source`: the :class:`~weightstore.io.source.ByteSource` protocol every
  reader reads through, and the choice of source for what a reader is given.
* :mod:`~weightstore.io.folders`: the few operations a versioned folder needs, local or remote.
* :mod:`~weightstore.io.places`: the questions a format recognised by where it lies (a model
  folder) asks of a local path or a URL, answered alike.
"""

from weightstore import _lazy

#: each submodule imported on first use, as when ``import weightstore`` imported every layer
#: (``weightstore.io.objects.PART_BYTES``): :mod:`weightstore._lazy`
__getattr__, __dir__ = _lazy.on_first_use(globals(), {})
